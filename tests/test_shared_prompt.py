"""ppo.shared_prompt: a group's prompt computed once (ppokit.models.prefix). The policy, reference and critic forwards
give the separate computation's logprobs, values, losses and gradients within float rounding (docs/speed.md)."""

import dataclasses

import pytest
import torch
from conftest import assert_float32_close, tiny_ppo_config
from test_padding_free import _IgnoresPackedPositions, _assert_same_training, assert_same_forwards, recorded_epochs
from test_speed import one_rollout

from ppokit.errors import UserError
from ppokit.models import prefix
from ppokit.models.forwards import check_shared_forward, hidden_states
from ppokit.training import batching, experience
from ppokit.training.episodes import Span, pack
from ppokit.trainer import PPOTrainer


def test_layout_puts_the_common_prefix_once_then_each_rest_with_positions_continuing():
    ids = torch.tensor([[0, 0, 5, 6, 7, 1, 2], [0, 0, 5, 6, 7, 3, 0], [9, 8, 7, 6, 5, 4, 3], [0, 0, 0, 0, 0, 2, 2]])
    mask = ids != 0
    mask[2] = True
    rows = prefix.layout(ids, mask, 2)
    # run 1: prefix [5 6 7] once, then [1 2] and [3]; run 2 shares nothing: [9 .. 3] then [2 2]; capacity 9
    assert rows.ids[0, :6].tolist() == [5, 6, 7, 1, 2, 3]
    assert rows.position_ids[0, :6].tolist() == [0, 1, 2, 3, 4, 3]
    assert rows.ids[1].tolist() == [9, 8, 7, 6, 5, 4, 3, 2, 2]
    assert rows.position_ids[1].tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 1]
    allowed = rows.allowed.int()
    assert allowed[0, 5].tolist() == [1, 1, 1, 0, 0, 1, 0, 0, 0]  # token 3 sees the prefix and itself, not [1 2]
    assert allowed[0, 4].tolist() == [1, 1, 1, 1, 1, 0, 0, 0, 0]
    assert allowed[0, 7].tolist() == [0] * 7 + [1, 0]  # padding: itself alone
    assert allowed[1, 8].tolist() == [0] * 7 + [1, 1]  # the second row of a run that shares nothing: its own tokens
    back = rows.unpack(rows.ids.unsqueeze(-1).float()).squeeze(-1)
    assert torch.equal(back, torch.where(mask, ids, 0).float())
    assert prefix.shared_positions(mask, ids, 2) == rows.ids.numel() == 18
    eager = rows.attention_mask("eager")
    assert eager.shape == (2, 1, 9, 9) and eager.dtype == torch.float32 and (eager[rows.allowed.unsqueeze(1)] == 0).all()
    assert rows.attention_mask("sdpa").dtype == torch.bool


def _groups(generator: torch.Generator, vocab: int, groups: int = 3, samples: int = 4, turns: bool = False):
    """Episodes of `groups` prompts (1-9 tokens) with `samples` responses each (1-6 tokens); turns: some with an
    observation and a second model turn (a loss mask with a gap)."""
    def tokens(n):
        return torch.randint(5, vocab, (n,), generator=generator).tolist()

    prompts, spans = [], []
    for _ in range(groups):
        prompt = tokens(int(torch.randint(1, 10, (1,), generator=generator)))
        for sample in range(samples):
            first = tokens(int(torch.randint(1, 7, (1,), generator=generator)))
            row = [Span(first, logprobs=[0.0] * len(first))]
            if turns and sample % 2:
                second = tokens(int(torch.randint(1, 4, (1,), generator=generator)))
                row += [Span(tokens(2)), Span(second, logprobs=[0.0] * len(second))]
            prompts.append(list(prompt))
            spans.append(row)
    return pack(prompts, spans, [True] * len(prompts), pad_token_id=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_prompt_logprobs_entropy_values_and_gradients_equal_the_separate_forward(model_dir, arch, attention):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    policy = AutoModelForCausalLM.from_pretrained(model_dir(arch), attn_implementation=attention).eval()
    critic = AutoModelForSequenceClassification.from_pretrained(model_dir(arch), num_labels=1, attn_implementation=attention).eval()
    episodes = _groups(torch.Generator().manual_seed(3), policy.config.vocab_size, turns=True)
    layout = prefix.SharedPrefix(4)
    assert prefix.shared_positions(episodes.attention_mask, episodes.input_ids, 4) < episodes.attention_mask.sum()  # shared
    assert_same_forwards(policy, critic, episodes, layout)


def test_each_row_alone_equals_its_states_in_the_shared_layout(model_dir):
    """No sample attends to another's tokens: each row in a forward of its own gives the states it has in its group's row."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir("llama")).eval()
    episodes = _groups(torch.Generator().manual_seed(5), model.config.vocab_size, groups=2, samples=3)
    ids, mask = episodes.input_ids, episodes.attention_mask
    with torch.no_grad():
        shared = hidden_states(model, ids, mask, padding_free=prefix.SharedPrefix(3))
        for row in range(len(ids)):
            alone = hidden_states(model, ids[row : row + 1, mask[row]], torch.ones(1, int(mask[row].sum()), dtype=torch.bool))
            assert_float32_close(shared[row, mask[row]], alone[0], terms=int(mask[row].sum()) * model.config.hidden_size)


def test_the_shuffle_keeps_groups_together():
    torch.manual_seed(0)
    order = batching.shuffled(12, 4, None)
    assert sorted(order.tolist()) == list(range(12))
    assert all(order[i : i + 4].tolist() == list(range(order[i], order[i] + 4)) for i in range(0, 12, 4))
    torch.manual_seed(0)
    want = torch.randperm(12)
    torch.manual_seed(0)
    assert torch.equal(batching.shuffled(12, 1, None), want)  # one row at a time: the shuffle without the switch


def _compare_training(trainer, config, rollout, samples: int):
    """ppo_epochs over the same rollout, the groups' prompts shared and not -> both (gradients, metrics)."""
    hp = dataclasses.replace(config.ppo, shared_prompt=True)  # the same group-wise shuffle both ways
    return {shared: recorded_epochs(trainer, rollout, hp, prefix.SharedPrefix(samples) if shared else False) for shared in (False, True)}


@pytest.mark.parametrize("estimator,lora", [("grpo", False), ("rloo", False), ("grpo", True), ("gae", True), ("gae", "shared")])
def test_training_with_the_prompt_shared_gives_the_separate_gradients(sft_model_dir, prompts_file, tmp_path, estimator, lora):
    """Every loss term on (KL loss, entropy bonus; a value model's loss for gae): the same gradients at every step and the
    same statistics; the reference and value pass too (LoRA: the reference is the base with the adapters off; "shared":
    the critic on the policy's base)."""
    from ppokit.config.schema import LoraConfig

    config = tiny_ppo_config(sft_model_dir, prompts_file, tmp_path / "run", total_episodes=16, per_device_train_batch_size=4,
                             num_mini_batches=2, num_ppo_epochs=1, response_length=10, max_grad_norm=0.0, entropy_coef=0.01,
                             kl_loss_coef=0.1, advantage_estimator=estimator, num_samples_per_prompt=4,
                             local_rollout_forward_batch_size=8, shared_prompt=True)
    if lora:
        config.lora = LoraConfig(r=4, alpha=8)
    if lora == "shared":  # the critic: an adapter and a head on the policy's own base (`adapters.SharedBaseCritic`)
        config.value_model = "shared"
    trainer = PPOTrainer(config, show_progress=False)
    assert trainer.model.padding_free == prefix.SharedPrefix(4)
    rollout = one_rollout(trainer)
    model = trainer.accelerator.unwrap_model(trainer.model)
    for part in (model.policy, model.value_model) if lora else ():
        for name, p in part.named_parameters() if part is not None else ():
            if "lora_B" in name:  # adapters that move the outputs
                torch.nn.init.normal_(p, std=0.05)
    passes = [experience.reference_and_values(rollout, model, trainer.parts.ref_model, rows=8, packed=False, temperature=1.0,
                                              chunk_size=None, policy_logprobs=True, padding_free=layout)
              for layout in (False, prefix.SharedPrefix(4))]
    vocab_terms = model.policy.config.vocab_size * model.policy.config.hidden_size
    for got, want in zip(passes[1], passes[0]):
        if want is None:
            assert got is None
            continue
        assert_float32_close(got, want, terms=vocab_terms)
    tokens, hidden = int(rollout.attention_mask.sum()), model.policy.config.hidden_size
    _assert_same_training(_compare_training(trainer, config, rollout, 4), tokens, hidden, less_padding=False)


def test_a_run_with_the_shared_prompt_completes_through_the_cli(sft_model_dir, prompts_file, tmp_path):
    import yaml

    from ppokit.cli import main

    config = tmp_path / "ppo.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(sft_model_dir), "output_dir": str(tmp_path / "run"), "seed": 1, "reward": {"functions": ["sentiment"]},
        "data": {"train": str(prompts_file)},
        "ppo": {"total_episodes": 16, "per_device_train_batch_size": 4, "num_mini_batches": 2, "response_length": 8,
                "advantage_estimator": "grpo", "num_samples_per_prompt": 4, "local_rollout_forward_batch_size": 8,
                "shared_prompt": True, "num_sample_generations": 0}}))
    assert main(["ppo", str(config)]) in (0, None)
    assert (tmp_path / "run" / "final").exists()


@pytest.mark.parametrize("keys,message", [
    (dict(num_samples_per_prompt=1, advantage_estimator="gae"),
     r"ppo.shared_prompt computes the prompt of a group of samples once, and ppo.num_samples_per_prompt is 1"),
    (dict(num_samples_per_prompt=4, per_device_train_batch_size=6, num_mini_batches=2),
     r"ppo.shared_prompt lays out whole groups of ppo.num_samples_per_prompt \(4\) samples: ppo.per_device_train_batch_size \(6\) "
     r"and ppo.local_rollout_forward_batch_size \(6\) must be a multiple of 4"),
    (dict(num_samples_per_prompt=2, padding_free=True), r"ppo.shared_prompt with ppo.padding_free: the two layouts do not combine yet"),
    (dict(num_samples_per_prompt=2, max_tokens_per_micro_batch=400), r"ppo.shared_prompt with ppo.max_tokens_per_micro_batch"),
])
def test_shared_prompt_refuses_what_it_cannot_lay_out(model_dir, prompts_file, tmp_path, keys, message):
    keys = {"local_rollout_forward_batch_size": keys.get("per_device_train_batch_size", 4), "advantage_estimator": "grpo", **keys}
    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run", shared_prompt=True, **keys)
    with pytest.raises(UserError, match=message):
        config.validate()


def test_shared_prompt_with_compile_is_refused_and_under_fsdp_accepted(model_dir, prompts_file, tmp_path):
    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run", advantage_estimator="grpo", num_samples_per_prompt=2,
                             shared_prompt=True)
    config.parallel.strategy = "fsdp"
    config.validate()  # runs under fsdp: tests/test_multiprocess.py
    config.compile = True
    with pytest.raises(UserError, match=r"ppo.shared_prompt with compile"):
        config.validate()


class _IgnoresTheMask(_IgnoresPackedPositions):
    """A model whose attention drops a 4-D mask (plain causal attention over the whole row): samples see each other."""

    def backbone(self, input_ids, attention_mask, position_ids, use_cache):
        flat = attention_mask if attention_mask is None or attention_mask.dim() == 2 else None
        return super().backbone(input_ids, flat, position_ids, use_cache)


def test_a_model_that_does_not_follow_the_4d_mask_is_refused(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir("llama"))
    check_shared_forward(model, "ppo.shared_prompt", prefix.SharedPrefix(2))
    with pytest.raises(UserError, match="ppo.shared_prompt: _IgnoresTheMask does not follow a 4-D attention mask"):
        check_shared_forward(_IgnoresTheMask(model), "ppo.shared_prompt", prefix.SharedPrefix(2))
