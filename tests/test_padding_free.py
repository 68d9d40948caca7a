"""ppo.padding_free: several episodes per row, positions restarting at each (ppokit.models.packing). Every forward
(policy, reference, critic, reward model) gives the padded computation's logprobs, values, scores and gradients
within float rounding, and the token budget fills packed rows (docs/speed.md)."""

import dataclasses

import pytest
import torch
from conftest import FLOAT32_EPS, assert_float32_close, tiny_ppo_config, with_speed_switches
from test_speed import GradientRecorder, one_rollout

from ppokit.errors import UserError
from ppokit.models import packing
from ppokit.models.forwards import check_packed_forward, response_logprobs, response_values
from ppokit.training import batching, optimise
from ppokit.training.episodes import Span, pack
from ppokit.trainer import PPOTrainer


def _mask(spans: list[tuple[int, int]], width: int) -> torch.Tensor:
    mask = torch.zeros(len(spans), width, dtype=torch.bool)
    for row, (start, end) in enumerate(spans):
        mask[row, start:end] = True
    return mask


def test_layout_places_whole_sequences_longest_first_with_positions_restarting():
    ids = torch.arange(1, 5 * 7 + 1).reshape(5, 7)
    mask = _mask([(2, 7), (0, 3), (3, 7), (0, 7), (5, 6)], 7)  # lengths 5, 3, 4, 7, 1
    rows = packing.layout(ids, mask)
    # capacity 7 (the longest); first fit, longest first: [7], [5 | 1], [4 | 3]
    assert rows.ids.shape == (3, 7) and rows.positions == 21
    assert rows.ids[0].tolist() == ids[3].tolist()
    assert rows.ids[1, :6].tolist() == ids[0, 2:].tolist() + [ids[4, 5].item()]
    assert rows.ids[2].tolist() == ids[2, 3:].tolist() + ids[1, :3].tolist()
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 0, 0], [0, 1, 2, 3, 0, 1, 2]]
    # back to the (B, L) layout: every real token where it was, 0 at padding
    back = rows.unpack(rows.ids.unsqueeze(-1).float()).squeeze(-1)
    assert torch.equal(back, torch.where(mask, ids, 0).float())
    assert packing.packed_positions(mask) == rows.positions


def _multiturn_episodes(generator: torch.Generator, vocab: int, rows: int = 7):
    """Episodes as the episode loop makes them: prompts of 1-8 tokens, then model turns (trained) and observations
    (read, not trained) of varied lengths, some rows ending after one turn."""
    def tokens(n):
        return torch.randint(5, vocab, (n,), generator=generator).tolist()

    prompts, spans = [], []
    for row in range(rows):
        prompts.append(tokens(int(torch.randint(1, 9, (1,), generator=generator))))
        turns = [Span(tokens(int(torch.randint(1, 5, (1,), generator=generator))), logprobs=[0.0])]
        turns[0].logprobs = [0.0] * len(turns[0].ids)
        if row % 2:  # a second turn after an observation: a loss mask with a gap
            turns.append(Span(tokens(int(torch.randint(1, 4, (1,), generator=generator)))))
            second = tokens(int(torch.randint(1, 4, (1,), generator=generator)))
            turns.append(Span(second, logprobs=[0.0] * len(second)))
        spans.append(turns)
    return pack(prompts, spans, [True] * rows, pad_token_id=0)


def _terms(episodes, hidden: int) -> int:
    """Summands behind one float32 result here: a token's hidden state sums over the hidden size per layer, a weight's
    gradient over every token as well."""
    return int(episodes.attention_mask.sum()) * hidden


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_logprobs_entropy_values_and_gradients_equal_the_padded_forward(model_dir, arch, attention):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    policy = AutoModelForCausalLM.from_pretrained(model_dir(arch), attn_implementation=attention).eval()  # no dropout
    critic = AutoModelForSequenceClassification.from_pretrained(model_dir(arch), num_labels=1, attn_implementation=attention).eval()
    episodes = _multiturn_episodes(torch.Generator().manual_seed(3), policy.config.vocab_size)
    assert (episodes.loss_mask.sum(1) < episodes.attention_mask[:, episodes.query_ids.shape[1]:].sum(1)).any(), "a gap in a loss mask"
    assert_same_forwards(policy, critic, episodes, True)


def assert_same_forwards(policy, critic, episodes, layout) -> None:
    """Logprobs, entropy, values and the gradients of a loss of them over `layout` (`models.hidden_states`'s
    padding_free) equal the padded forward's within float rounding."""
    weights = torch.randn(episodes.loss_mask.shape, generator=torch.Generator().manual_seed(4))
    results = {}
    for padding_free in (False, layout):
        policy.zero_grad(set_to_none=True)
        critic.zero_grad(set_to_none=True)
        inputs = (episodes.input_ids, episodes.attention_mask, episodes.response_ids, episodes.trained_mask)
        logprobs, entropy = response_logprobs(policy, *inputs, 0.7, with_entropy=True, entropy_grad=True, padding_free=padding_free)
        values = response_values(critic, episodes.input_ids, episodes.attention_mask, episodes.response_ids.shape[1],
                                 padding_free=padding_free) * episodes.trained_mask
        ((logprobs + 0.1 * entropy) * weights).sum().backward()
        (values * weights).sum().backward()
        grads = [p.grad.clone() for m in (policy, critic) for p in m.parameters() if p.grad is not None]
        results[padding_free is not False] = (logprobs.detach(), entropy.detach(), values.detach(), grads)
    hidden = policy.config.get_text_config().hidden_size
    terms = _terms(episodes, hidden)
    for got, want in zip(results[True][:3], results[False][:3]):
        assert_float32_close(got, want, terms=policy.config.vocab_size * hidden)
    assert len(results[True][3]) == len(results[False][3]) > 0
    for got, want in zip(results[True][3], results[False][3]):
        assert_float32_close(got, want, terms=terms)


def test_packed_rows_never_attend_across_episodes(model_dir):
    """Each episode's states alone in a row of its own equal its states packed beside others."""
    from transformers import AutoModelForCausalLM

    from ppokit.models.forwards import hidden_states

    model = AutoModelForCausalLM.from_pretrained(model_dir("llama")).eval()
    ids = torch.randint(5, 40, (4, 6), generator=torch.Generator().manual_seed(0))
    mask = _mask([(0, 3), (0, 3), (1, 6), (4, 6)], 6)
    assert packing.layout(ids, mask).ids.shape[0] < 4  # some share a row
    with torch.no_grad():
        packed = hidden_states(model, ids, mask, padding_free=True)
        for row in range(4):
            alone = hidden_states(model, ids[row : row + 1, mask[row]], torch.ones(1, int(mask[row].sum()), dtype=torch.bool))
            assert_float32_close(packed[row, mask[row]], alone[0], terms=6 * model.config.hidden_size)


def test_the_budget_fills_packed_rows_and_the_layout_keeps_within_it():
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(3, 40, (64,), generator=g)
    rows = torch.randperm(64, generator=g)
    for budget in (40, 64, 100, 333, 2000):
        plan = batching.plan_packed_micro_batches(rows, lengths, budget)
        assert sorted(torch.cat(plan).tolist()) == list(range(64))
        positions = []
        for index in plan:
            mask = torch.arange(40) < lengths[index].unsqueeze(1)
            positions.append(packing.packed_positions(mask))
            assert positions[-1] <= budget, budget
        # packed rows leave less padding than rows of one episode each (the micro-batch's longest x its rows)
        padded = sum(len(index) * int(lengths[index].max()) for index in batching.plan_micro_batches(rows, lengths, budget))
        assert sum(positions) <= padded
    assert sum(positions) < 0.7 * padded  # a budget of the whole minibatch: rows of one episode each pad to the longest
    whole, = batching.plan_packed_micro_batches(rows, lengths, 2000)
    assert whole.tolist() == rows[lengths[rows].argsort(descending=True, stable=True)].tolist()  # longest first, stable
    with pytest.raises(Exception, match="a row of 39 tokens is longer than ppo.max_tokens_per_micro_batch=38"):
        batching.plan_packed_micro_batches(rows, lengths, 38)


def _compare_training(trainer, config, rollout, budget):
    """ppo_epochs over the same rollout with the padded and the padding-free forwards -> both (gradients, metrics)."""
    results = {}
    for padding_free in (False, True):
        hp = dataclasses.replace(config.ppo, max_tokens_per_micro_batch=budget, padding_free=padding_free)
        results[padding_free] = recorded_epochs(trainer, rollout, hp, padding_free)
    return results


def recorded_epochs(trainer, rollout, hp, layout):
    """ppo_epochs over `rollout` with the forwards' `layout`, the weights unmoved -> (every step's gradients, metrics)."""
    trainer.model.padding_free = layout
    recorder = GradientRecorder([p for p in trainer.model.parameters() if p.requires_grad])
    scheduler = torch.optim.lr_scheduler.LambdaLR(recorder, lambda step: 1.0)
    torch.manual_seed(5)
    metrics = optimise.ppo_epochs(trainer.model, recorder, scheduler, rollout, hp, trainer.sizes, trainer.strategy, lambda t: t)
    return recorder.grads, metrics


def _assert_same_training(results, tokens: int, hidden: int, less_padding: bool = True):
    (grads, metrics), (want_grads, want_metrics) = results[True], results[False]
    assert len(grads) == len(want_grads) > 0
    for step_got, step_want in zip(grads, want_grads):
        assert len(step_got) == len(step_want)
        for got, want in zip(step_got, step_want):
            assert_float32_close(got, want, terms=tokens * hidden)
    assert metrics.keys() == want_metrics.keys()
    for key, value in want_metrics.items():
        if key != "perf/padding_share":
            # means of unit-scale terms over the minibatch's tokens (val/ratio_var: a variance of ratios near 1)
            assert metrics[key] == pytest.approx(value, rel=16 * FLOAT32_EPS * tokens ** 0.5, abs=1e-6), key
    assert metrics["perf/padding_share"] <= want_metrics["perf/padding_share"]
    assert metrics["perf/padding_share"] < want_metrics["perf/padding_share"] or not less_padding


@pytest.mark.parametrize("estimator", ["gae", "grpo", "rloo", "reinforce_pp", "remax"])
def test_training_on_packed_rows_gives_the_padded_gradients_for_each_estimator(sft_model_dir, prompts_file, tmp_path, estimator):
    """Every loss term on (KL loss, entropy bonus, value loss for gae): the same gradients at every step and the same
    statistics, with fixed micro-batches (the same rows, TRL's normalisation) and with a token budget (packed rows
    filled: other micro-batches, the minibatch's normalisation)."""
    n = 2 if estimator in ("grpo", "rloo") else 1
    config = tiny_ppo_config(sft_model_dir, prompts_file, tmp_path / "run", total_episodes=16, per_device_train_batch_size=4,
                             num_mini_batches=2, num_ppo_epochs=1, response_length=10, max_grad_norm=0.0, entropy_coef=0.01,
                             kl_loss_coef=0.1, advantage_estimator=estimator, num_samples_per_prompt=n)
    trainer = PPOTrainer(config, show_progress=False)
    rollout = one_rollout(trainer)
    tokens = int(rollout.attention_mask.sum())
    hidden = trainer.model.policy.config.hidden_size
    _assert_same_training(_compare_training(trainer, config, rollout, None), tokens, hidden)
    longest = int(rollout.attention_mask.sum(1).max())
    _assert_same_training(_compare_training(trainer, config, rollout, 2 * longest), tokens, hidden, less_padding=False)


def test_lora_reference_values_and_training_on_packed_rows_equal_the_padded(sft_model_dir, prompts_file, tmp_path):
    """The LoRA policy (the reference: its base with the adapters off) and its critic's adapter."""
    from ppokit.config.schema import LoraConfig
    from ppokit.training import experience

    config = tiny_ppo_config(sft_model_dir, prompts_file, tmp_path / "run", total_episodes=16, per_device_train_batch_size=8,
                             num_mini_batches=1, num_ppo_epochs=1, response_length=10, max_grad_norm=0.0)
    config.lora = LoraConfig(r=4, alpha=8)
    trainer = PPOTrainer(config, show_progress=False)
    rollout = one_rollout(trainer)
    for model in (trainer.model.policy, trainer.model.value_model):  # adapters that move the outputs
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
    model = trainer.accelerator.unwrap_model(trainer.model)
    passes = [experience.reference_and_values(rollout, model, trainer.parts.ref_model, rows=5, packed=packed, temperature=1.0,
                                              chunk_size=None, policy_logprobs=True, padding_free=padding_free)
              for packed, padding_free in ((False, False), (False, True), (True, True))]
    vocab_terms = model.policy.config.vocab_size * model.policy.config.hidden_size
    for got_pass in passes[1:]:
        for got, want in zip(got_pass, passes[0]):
            if want is None:  # the teacher's logprobs: no teacher here
                assert got is None
                continue
            assert_float32_close(got, want, terms=vocab_terms)
    tokens, hidden = int(rollout.attention_mask.sum()), model.policy.config.hidden_size
    _assert_same_training(_compare_training(trainer, config, rollout, None), tokens, hidden)


def test_reward_model_scores_on_packed_rows_equal_the_padded(model_dir, tokenizer):
    from ppokit.models.loading import load_scalar_model
    from ppokit.rewards.model import RewardModelReward
    from ppokit.rewards.sources import ScoringBatch

    model = load_scalar_model(str(model_dir("llama")), "reward.model").eval()
    torch.nn.init.normal_(model.score.weight, std=1.0)
    episodes = _multiturn_episodes(torch.Generator().manual_seed(2), 40, rows=9)
    batch = ScoringBatch(["p"] * 9, ["c"] * 9, {}, episodes.input_ids, episodes.attention_mask.long(), tokenizer)
    want = RewardModelReward(model, tokenizer, batch_size=4).score(batch)
    terms = int(episodes.attention_mask.sum(1).max()) * model.config.hidden_size
    for by_tokens in (False, True):
        got = RewardModelReward(model, tokenizer, batch_size=4, by_tokens=by_tokens, padding_free=True).score(batch)
        assert_float32_close(got, want, terms=terms)


def test_padding_free_follows_the_padded_learning_curve(sft_model_dir, prompts_file, tmp_path):
    """Same seed, 3 updates, the same token budget: packed rows against rows of one episode each."""
    from test_speed import CURVE

    def run(name, padding_free):
        config = tiny_ppo_config(sft_model_dir, prompts_file, tmp_path / name, total_episodes=48, per_device_train_batch_size=8,
                                 num_mini_batches=2, response_length=10, num_sample_generations=0)
        config.ppo.padding_free = padding_free
        return PPOTrainer(with_speed_switches(config, max_tokens_per_micro_batch=400), show_progress=False).train()

    padded, packed = run("padded", False), run("packed", True)
    for want, got in zip(padded, packed):
        for key in CURVE:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (got["update"], key)
    shares = [(w["perf/padding_share"], g["perf/padding_share"]) for w, g in zip(padded, packed)]
    assert all(g <= w for w, g in shares) and sum(g for _, g in shares) < sum(w for w, _ in shares), shares


class _IgnoresPackedPositions(torch.nn.Module):
    """A model whose attention reads a mask of its own (all ones) and never the packed sequences: the kind of model
    padding-free forwards must refuse."""

    def __init__(self, model):
        super().__init__()
        self.inner = model
        self.config = model.config
        self.base_model_prefix = "backbone"

    def backbone(self, input_ids, attention_mask, position_ids, use_cache):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return self.inner.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache)


def test_a_model_that_lets_packed_episodes_attend_to_each_other_is_refused(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir("llama"))
    check_packed_forward(model, "ppo.padding_free")
    with pytest.raises(UserError, match="ppo.padding_free: _IgnoresPackedPositions does not keep sequences packed in one row apart"):
        check_packed_forward(_IgnoresPackedPositions(model), "ppo.padding_free")


@pytest.mark.slow
def test_the_compiled_backbone_reads_packed_rows_as_eager_does(model_dir):
    """compile: true with ppo.padding_free: the compiled backbone builds the packed masks too (traced, the packed
    sequences are always read from the positions), for two widths (dynamic shapes)."""
    from transformers import AutoModelForCausalLM

    from ppokit.models.compiled import compiled_backbone
    from ppokit.models.forwards import hidden_states

    model = AutoModelForCausalLM.from_pretrained(model_dir("llama")).eval()
    compiled = compiled_backbone(model)
    for width in (9, 12):
        ids = torch.randint(5, 40, (5, width), generator=torch.Generator().manual_seed(width))
        mask = _mask([(2, width), (0, 5), (4, 7), (0, width), (3, 4)], width)
        with torch.no_grad():
            want = hidden_states(model, ids, mask)
            got = hidden_states(model, ids, mask, backbone_fn=compiled, padding_free=True)
        assert_float32_close(got[mask], want[mask], terms=width * model.config.hidden_size)
