"""Engines take requests (ppokit.engines.base.Request -> Sampled): the hf engine's slot decoder
(ppokit.engines.slots) on tiny real models. A seeded request's tokens and logprobs are a function of the weights,
its prompt, its sampling and its seed alone: bit for bit the same alone or among others that share its decoding
steps, arrive before or after it, wait in the queue or are aborted."""

import time

import pytest
import torch
from conftest import assert_float32_close
from test_engines import _recording

from ppokit.engines.base import Sampled, Request, Sampling, complete, request_seed
from ppokit.engines.hf import HFEngine, HFSampler
from ppokit.models.forwards import left_pad, response_logprobs
from ppokit.demos.tiny import tiny_causal_lm

pytestmark = pytest.mark.transformers_pins  # CI runs this file under vLLM's transformers pin too (.ci/vllm-env)

SLOTS, CAPACITY = 4, 48
# The properties that hold by construction hold on a GPU too (its own kernels, its own generators): the tests that
# take `device` run there as well, where a CUDA device is (marker gpu).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def make_policy(tokenizer, arch="llama", device="cpu"):
    torch.manual_seed(0)
    return tiny_causal_lm(arch, tokenizer).eval().to(device)


@pytest.fixture(scope="module")
def policy(tokenizer):
    return make_policy(tokenizer)


@pytest.fixture(scope="module")
def prompts(tokenizer, demo_data):
    return [tokenizer(r["prompt"])["input_ids"][:14] for r in demo_data["prompts"][:16]]


def engine_for(policy, tokenizer, slots=SLOTS, **kwargs):
    device = next(policy.parameters()).device
    return HFEngine(policy, tokenizer.pad_token_id, device, rows_per_forward=slots, max_sequence=CAPACITY, **kwargs)


def drive(engine, arrivals: dict[int, list[Request]], abort_at: dict[int, list[str]] = ()) -> tuple[dict[str, Sampled], int]:
    """Step the engine, submitting arrivals[k] before step k and aborting abort_at[k] before it, until nothing is
    unfinished -> (completions by id, steps taken)."""
    done, k = {}, 0
    abort_at = dict(abort_at)
    with engine.serving():
        while k <= max(arrivals, default=0) or engine.unfinished():
            if k in arrivals:
                engine.submit(arrivals[k])
            for completion in engine.abort(abort_at.get(k, [])):
                done[completion.request_id] = completion
            for completion in engine.step():
                done[completion.request_id] = completion
            k += 1
    return done, k


SAMPLINGS = [
    Sampling(10, 1.0, None),
    Sampling(7, 0.7, None, top_k=5),
    Sampling(12, 1.3, None, top_p=0.8),
    Sampling(9, 0.9, None, min_p=0.1),
    Sampling(6, 1.0, None, greedy=True),
]


def crowd(prompts, n, first_seed=100, prefix="other"):
    return [Request(f"{prefix}{i}", prompts[(i + 3) % len(prompts)], SAMPLINGS[i % len(SAMPLINGS)], seed=first_seed + i) for i in range(n)]


# How the slot decoder reads a prompt (`slots.SlotDecoder`): every prompt alone; through the decoding forwards; in the
# reading forwards beside the other slots that read then; by the defaults (these 14-token prompts: together).
READING = {"alone": dict(read_in_steps=0, read_together=0), "in-steps": dict(read_in_steps=CAPACITY),
           "together": dict(read_in_steps=0, read_together=CAPACITY), "default": {}}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reading", list(READING))
@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_a_request_is_the_same_alone_and_among_others_bit_for_bit(arch, reading, device, tokenizer, prompts):
    """The same request decoded alone, then among others: some running before it arrived (it takes a slot freed
    mid-way), some arriving with and after it, more of them than slots (they wait), other samplings (temperature,
    top_k / top_p / min_p, greedy) and other lengths beside it. Identical tokens and logprobs, to the last bit."""
    policy = make_policy(tokenizer, arch, device)
    targets = [Request("target", prompts[0], Sampling(12, 1.0, None), seed=7),
               Request("target-top-k", prompts[1], Sampling(10, 0.8, None, top_k=4), seed=8),
               Request("target-greedy", prompts[2], Sampling(8, 1.0, None, greedy=True), seed=0)]
    siblings = [Request(f"sibling{i}", prompts[0], Sampling(12, 1.0, None), seed=70 + i) for i in range(2)]  # one read for three
    alone = {t.request_id: complete(engine_for(policy, tokenizer, **READING[reading]), [t])[0] for t in targets + siblings}
    others = crowd(prompts, 10)
    crowded, _ = drive(engine_for(policy, tokenizer, **READING[reading]), {0: others[:5], 3: targets[:1] + siblings + others[5:8], 5: targets[1:] + others[8:]})
    for t in targets + siblings:
        got, want = crowded[t.request_id], alone[t.request_id]
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs, t.request_id
    assert {c.finish_reason for c in crowded.values()} == {"length"}
    assert len({tuple(crowded[s.request_id].token_ids) for s in siblings + targets[:1]}) == 3  # their own seeds
    assert [len(crowded[o.request_id].token_ids) for o in others] == [o.sampling.max_new_tokens for o in others]


@pytest.mark.parametrize("reading", list(READING))
def test_a_groups_samples_read_their_prompt_once_and_are_each_their_own(reading, policy, tokenizer, prompts):
    """Four samples of one prompt admitted in one step (read alone once and shared, each read in the decoding steps,
    or all in one reading forward) are each what they are alone."""
    group = [Request(f"sample{i}", prompts[5], Sampling(9, 1.0, None), seed=40 + i) for i in range(4)]
    engine = lambda: engine_for(policy, tokenizer, **READING[reading])  # noqa: E731
    together = complete(engine(), group)
    assert together == [complete(engine(), [r])[0] for r in group]
    assert len({tuple(c.token_ids) for c in together}) == 4


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_the_training_forwards(device, tokenizer, prompts):
    """Each completion's logprobs are log softmax(logits / its temperature) of a plain forward over prompt +
    completion (the full distribution, also where top_k / top_p / min_p cut the one it was drawn from), within
    float rounding; the slots' positions and masks are right (an off-by-one would move them by far more)."""
    policy = make_policy(tokenizer, device=device)
    requests = crowd(prompts, 9, prefix="r")
    done, _ = drive(engine_for(policy, tokenizer), {0: requests[:6], 2: requests[6:]})
    for request in requests:
        completion = done[request.request_id]
        ids = torch.tensor([list(request.prompt) + completion.token_ids], device=device)
        response = torch.tensor([completion.token_ids], device=device)
        with torch.no_grad():
            want, _ = response_logprobs(policy, ids, torch.ones_like(ids), response, torch.ones_like(response, dtype=torch.bool),
                                        request.sampling.temperature)
        got = torch.tensor([completion.logprobs], device=device)
        assert got.dtype == torch.float32
        assert_float32_close(got, want, terms=64 * 2, ulps=16, scale=want.abs().max().item() / request.sampling.temperature)
        if request.sampling.greedy:  # the argmax at every step
            with torch.no_grad():
                logits = policy(input_ids=ids).logits[0, len(request.prompt) - 1:-1]
            assert completion.token_ids == logits.argmax(-1).tolist()


def test_seeds_are_the_requests_own_stream(policy, tokenizer, prompts):
    """The same seed gives the same completion whatever torch's global generator holds, and leaves that generator
    where it was; another seed gives another completion."""
    sampling = Sampling(16, 1.0, None)

    def run(seed, global_seed):
        torch.manual_seed(global_seed)
        state = torch.get_rng_state()
        completion = complete(engine_for(policy, tokenizer), [Request("r", prompts[0], sampling, seed=seed)])[0]
        assert torch.equal(torch.get_rng_state(), state)
        return completion.token_ids

    first = run(seed=11, global_seed=0)
    assert run(seed=11, global_seed=1) == first
    assert run(seed=12, global_seed=0) != first


def test_request_seed_is_a_fixed_hash_of_its_key():
    assert request_seed(0, 1, 2, 3) == request_seed(0, 1, 2, 3) == 2867806201813668182  # the same on any machine (blake2b)
    keys = [(0, 1, 2, 3), (0, 1, 3, 2), (1, 0, 2, 3), (0, 1, 2, 4), (0, 1, 23)]
    seeds = [request_seed(*key) for key in keys]
    assert len(set(seeds)) == len(keys) and all(0 <= s < 2**62 for s in seeds)


def test_finish_reasons(policy, tokenizer, prompts):
    """The stop token ends a completion (included, finish_reason stop), also as its very first token; otherwise
    max_new_tokens does (length)."""
    free = complete(engine_for(policy, tokenizer), [Request("free", prompts[3], Sampling(12, 1.0, None), seed=5)])[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    stop = free.token_ids[4]
    first = free.token_ids.index(stop)
    stopped = complete(engine_for(policy, tokenizer), [Request("s", prompts[3], Sampling(12, 1.0, stop), seed=5)])[0]
    assert (stopped.finish_reason, stopped.token_ids, stopped.logprobs) == ("stop", free.token_ids[: first + 1], free.logprobs[: first + 1])
    at_once = complete(engine_for(policy, tokenizer), [Request("f", prompts[3], Sampling(12, 1.0, free.token_ids[0]), seed=5)])[0]
    assert (at_once.finish_reason, at_once.token_ids) == ("stop", free.token_ids[:1])
    one = complete(engine_for(policy, tokenizer), [Request("o", prompts[3], Sampling(1, 1.0, None), seed=5)])[0]
    assert (one.finish_reason, one.token_ids) == ("length", free.token_ids[:1])


def test_many_in_flight_and_each_returns_as_soon_as_it_is_done(policy, tokenizer, prompts):
    """12 requests in 3 slots: they share decoding steps (far fewer steps than their tokens), a short request
    submitted after long ones comes back before them, and `unfinished` counts what is queued or running."""
    engine = engine_for(policy, tokenizer, slots=3)
    long = [Request(f"long{i}", prompts[i], Sampling(20, 1.0, None), seed=i) for i in range(11)]
    short = Request("short", prompts[11], Sampling(2, 1.0, None), seed=99)
    engine.submit(long[:2])
    order = []
    with engine.serving():
        order += [c.request_id for c in engine.step()]
        engine.submit([short] + long[2:])
        assert engine.unfinished() == 12
        steps = 1
        while engine.unfinished():
            order += [c.request_id for c in engine.step()]
            steps += 1
    assert sorted(order) == sorted(r.request_id for r in long + [short])
    assert order.index("short") < order.index("long0")
    assert steps < sum(r.sampling.max_new_tokens for r in long) / 2


def test_abort_hands_back_the_tokens_so_far_and_leaves_the_others_alone(policy, tokenizer, prompts):
    engine = engine_for(policy, tokenizer, slots=2)
    requests = [Request(f"r{i}", prompts[i], Sampling(10, 1.0, None), seed=i) for i in range(4)]
    alone = {r.request_id: complete(engine_for(policy, tokenizer, slots=2), [r])[0] for r in requests}
    done, _ = drive(engine, {0: requests}, abort_at={4: ["r0", "r3", "never-submitted"]})
    running, queued = done["r0"], done["r3"]
    assert running.finish_reason == "abort" and 0 < len(running.token_ids) < 10
    assert running.token_ids == alone["r0"].token_ids[: len(running.token_ids)]
    assert running.logprobs == alone["r0"].logprobs[: len(running.token_ids)]
    assert (queued.finish_reason, queued.token_ids) == ("abort", [])
    for kept in ("r1", "r2"):
        assert done[kept].token_ids == alone[kept].token_ids and done[kept].logprobs == alone[kept].logprobs
    assert engine.unfinished() == 0 and "never-submitted" not in done


@pytest.mark.parametrize("reading", list(READING))  # how the turn's new tokens are read
def test_an_episode_continues_from_its_kept_keys_and_values(reading, policy, tokenizer, prompts):
    """Turn 1 kept, turn 2 continues it: only the new tokens are read (cached_tokens), its logprobs are a plain
    forward's over the whole context, and the two-turn chain is bit for bit the same among other episodes."""
    sampling = Sampling(8, 1.0, None)
    observation = tokenizer(" the plot was", add_special_tokens=False)["input_ids"]

    def episode(engine, others=()):
        turn1 = Request("e-1", prompts[0], sampling, seed=1, keep=True)
        done, _ = drive(engine, {0: [turn1, *others[:3]]})
        first = done["e-1"]
        context = list(prompts[0]) + first.token_ids + observation
        done2, _ = drive(engine, {0: [*others[3:], Request("e-2", context, sampling, seed=2, continues="e-1")]})
        return first, done2["e-2"], context

    engine = engine_for(policy, tokenizer, **READING[reading])
    first, second, context = episode(engine)
    assert second.cached_tokens == len(prompts[0]) + len(first.token_ids) - 1 and first.cached_tokens == 0
    ids = torch.tensor([context + second.token_ids])
    response = torch.tensor([second.token_ids])
    with torch.no_grad():
        want, _ = response_logprobs(policy, ids, torch.ones_like(ids), response, torch.ones_like(response, dtype=torch.bool), 1.0)
    assert_float32_close(torch.tensor([second.logprobs]), want, terms=64 * 2, ulps=16, scale=want.abs().max().item())
    with pytest.raises(ValueError, match="not kept"):  # its keys and values moved to the request that continued it
        engine.submit([Request("e-3", context + second.token_ids, sampling, seed=3, continues="e-1")])
    crowded_first, crowded_second, _ = episode(engine_for(policy, tokenizer, **READING[reading]), crowd(prompts, 7))
    assert (crowded_first.token_ids, crowded_first.logprobs) == (first.token_ids, first.logprobs)
    assert (crowded_second.token_ids, crowded_second.logprobs) == (second.token_ids, second.logprobs)


def test_kept_keys_and_values_stay_in_their_slot_until_another_request_needs_it(policy, tokenizer, prompts):
    """A finished turn's keys and values stay in its slot (nothing copied) while other requests find free slots
    elsewhere, and the turn that continues it goes back there; a request that needs that very slot copies them out
    first. The continuation is the same either way, bit for bit."""
    sampling = Sampling(6, 1.0, None)
    observation = tokenizer(" the plot was", add_special_tokens=False)["input_ids"]

    def two_turns(others: int):
        engine = engine_for(policy, tokenizer)
        first = complete(engine, [Request("e-1", prompts[0], sampling, seed=1, keep=True)])[0]
        kept = engine._decoder.kept["e-1"]
        assert kept.slot is not None and kept.keys is None  # left in its slot
        complete(engine, crowd(prompts, others))
        context = list(prompts[0]) + first.token_ids + observation
        return kept, complete(engine, [Request("e-2", context, sampling, seed=2, continues="e-1")])[0]

    in_place, second = two_turns(SLOTS - 1)  # the others fit in the slots that hold nothing kept
    assert in_place.slot is not None and in_place.keys is None
    copied, again = two_turns(SLOTS)  # one of them needed its slot
    assert copied.slot is None and len(copied.keys) == policy.config.num_hidden_layers
    assert copied.keys[0].shape[-2] == len(prompts[0]) + 5  # its prompt and every token it sampled but the last (6 tokens)
    assert (again.token_ids, again.logprobs) == (second.token_ids, second.logprobs)


def test_kept_requests_are_forgotten_and_released(policy, tokenizer, prompts):
    engine = engine_for(policy, tokenizer)
    sampling = Sampling(4, 1.0, None)
    done = complete(engine, [Request("a", prompts[0], sampling, seed=1, keep=True), Request("b", prompts[1], sampling, seed=2, keep=True)])
    with pytest.raises(ValueError, match="already unfinished or kept"):
        engine.submit([Request("a", prompts[0], sampling, seed=1)])
    engine.forget(["a"])
    with pytest.raises(ValueError, match="'a', which is not kept"):
        engine.submit([Request("a2", list(prompts[0]) + done[0].token_ids, sampling, seed=1, continues="a")])
    with pytest.raises(ValueError, match="'b', which another request continues already"):
        engine.submit([Request(f"b{i}", list(prompts[1]) + done[1].token_ids, sampling, seed=i, continues="b") for i in range(2)])
    with pytest.raises(ValueError, match="does not start with"):
        engine.submit([Request("b2", list(prompts[0]) + done[1].token_ids, sampling, seed=1, continues="b")])
    engine.release()  # between rollouts: nothing kept
    with pytest.raises(ValueError, match="'b', which is not kept"):
        engine.submit([Request("b2", list(prompts[1]) + done[1].token_ids, sampling, seed=1, continues="b")])


def test_refused_requests(policy, tokenizer, prompts):
    engine = engine_for(policy, tokenizer)
    with pytest.raises(ValueError, match="over the engine's 48 positions"):
        engine.submit([Request("long", prompts[0], Sampling(CAPACITY, 1.0, None), seed=1)])
    with pytest.raises(ValueError, match="keep and continues need a seed"):
        Request("k", prompts[0], Sampling(4, 1.0, None), keep=True)
    with pytest.raises(ValueError, match="already unfinished"):
        engine.submit([Request("x", prompts[0], Sampling(4, 1.0, None), seed=1), Request("x", prompts[1], Sampling(4, 1.0, None), seed=2)])
    assert engine.unfinished() == 0  # a refused call queues nothing
    engine.submit([Request("x", prompts[0], Sampling(4, 1.0, None), seed=1)])
    with pytest.raises(RuntimeError, match="unfinished requests"):
        engine.release()


def test_seedless_requests_of_one_call_are_todays_lock_step_batch(policy, tokenizer, prompts):
    """Requests without a seed are decoded together by HFSampler from torch's generator, as `generate` always was;
    seeded requests submitted beside them do not change them."""
    sampling = Sampling(9, 1.0, None, top_k=6)
    engine = engine_for(policy, tokenizer)
    seedless = [Request(f"s{i}", p, sampling) for i, p in enumerate(prompts[:6])]
    torch.manual_seed(4)
    done, _ = drive(engine, {0: seedless[:3] + crowd(prompts, 3) + seedless[3:]})
    torch.manual_seed(4)
    ids, mask = left_pad(prompts[:6], tokenizer.pad_token_id)
    want = HFSampler(policy, 9, 1.0, None, tokenizer.pad_token_id, SLOTS, top_k=6, compact_every=8).sample(ids, mask)
    assert [done[r.request_id].token_ids for r in seedless] == want.response_ids.tolist()
    assert [done[r.request_id].logprobs for r in seedless] == want.logprobs.tolist()


def test_the_sampling_contexts_are_entered_once_per_serving(tokenizer, prompts):
    """Inside `serving()` every step runs under the sampling contexts (the policy in eval mode), entered once, not
    at every step (under fsdp each entry gathers the whole policy); step() outside it enters them itself."""
    policy = make_policy(tokenizer).train()
    log = []  # the policy's training flag at each entry
    engine = engine_for(policy, tokenizer, sampling_contexts=lambda p: (_recording(log, p),))
    engine.submit(crowd(prompts, 6))
    with engine.serving():
        steps = 0
        while engine.unfinished():
            engine.step()
            steps += 1
    assert log == [False] and steps > 5 and policy.training
    engine.submit(crowd(prompts, 1))
    engine.step()
    assert log == [False, False]


def test_an_episodes_results_do_not_depend_on_its_environments_latency(policy, tokenizer, prompts):
    """Eight two-turn episodes driven as a per-episode loop drives them: the engine steps in this thread, each
    environment answers from a thread pool after its own delay, and the episode's next turn (continuing its kept
    first turn, seeded by (run, row, turn)) is submitted as soon as that answer is in. With other delays the turns
    arrive in another order and share their steps with others: every completion is the same, bit for bit; and the
    same again with the episodes as coroutines over `engines.driver.AsyncRequests`."""
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    sampling = Sampling(6, 1.0, None)

    def environment(completion, delay):
        time.sleep(delay)
        return tokenizer(" the plot was" if completion.token_ids[0] % 2 else " it was", add_special_tokens=False)["input_ids"]

    def run(delays):
        engine, done, waiting = engine_for(policy, tokenizer, slots=3), {}, {}
        engine.submit([Request(f"{row}-1", prompts[row], sampling, seed=request_seed(0, row, 1), keep=True) for row in range(8)])
        with ThreadPoolExecutor(4) as pool, engine.serving():
            while engine.unfinished() or waiting:
                for completion in engine.step():
                    done[completion.request_id] = completion
                    row, turn = map(int, completion.request_id.split("-"))
                    if turn == 1:
                        waiting[pool.submit(environment, completion, delays[row])] = (row, completion)
                for answered in [f for f in waiting if f.done()]:
                    row, first = waiting.pop(answered)
                    context = list(prompts[row]) + first.token_ids + answered.result()
                    engine.submit([Request(f"{row}-2", context, sampling, seed=request_seed(0, row, 2), continues=f"{row}-1")])
                if waiting and not engine.unfinished():
                    wait(list(waiting), return_when=FIRST_COMPLETED)
        return done

    instant = run([0.0] * 8)
    slow_first = run([0.05 * (8 - row) for row in range(8)])
    assert len(instant) == 16 and all(c.finish_reason == "length" for c in instant.values())
    assert {k: (c.token_ids, c.logprobs) for k, c in slow_first.items()} == {k: (c.token_ids, c.logprobs) for k, c in instant.items()}

    # The same episodes as coroutines (ppokit.engines.driver): an async environment, other delays again.
    import asyncio

    from ppokit.engines.driver import AsyncRequests

    async def rollout(delays):
        engine = engine_for(policy, tokenizer, slots=3)
        driver = AsyncRequests(engine)

        async def episode(row):
            first = await driver.complete(Request(f"{row}-1", prompts[row], sampling, seed=request_seed(0, row, 1), keep=True))
            await asyncio.sleep(delays[row])
            observation = environment(first, 0.0)
            context = list(prompts[row]) + first.token_ids + observation
            second = await driver.complete(Request(f"{row}-2", context, sampling, seed=request_seed(0, row, 2), continues=f"{row}-1"))
            return first, second

        with engine.serving():
            async with driver.running():
                turns = await asyncio.gather(*(episode(row) for row in range(8)))
        return {c.request_id: c for pair in turns for c in pair}

    for delays in ([0.0] * 8, [0.03 * row for row in range(8)]):
        coroutines = asyncio.run(rollout(delays))
        assert {k: (c.token_ids, c.logprobs) for k, c in coroutines.items()} == {k: (c.token_ids, c.logprobs) for k, c in instant.items()}


def test_a_cancelled_episode_stops_its_request(policy, tokenizer, prompts):
    import asyncio

    from ppokit.engines.driver import AsyncRequests

    engine = engine_for(policy, tokenizer)
    driver = AsyncRequests(engine)

    async def rollout():
        async with driver.running():
            waiting = asyncio.ensure_future(driver.complete(Request("long", prompts[0], Sampling(40, 1.0, None), seed=1)))
            short = await driver.complete(Request("short", prompts[1], Sampling(2, 1.0, None), seed=2))
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            return short

    assert asyncio.run(rollout()).finish_reason == "length" and engine.unfinished() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_under_the_training_precision_bf16_autocast(device, tokenizer, prompts):
    """Sampling under the training forward's precision (the trainer's sampling contexts enter autocast): the slots
    hold the values autocast made (bfloat16; the keys come out of the rotary embedding in float32) and a request
    is still the same alone and among others."""
    policy = make_policy(tokenizer, device=device)
    autocast = lambda p: (torch.autocast(device, dtype=torch.bfloat16),)  # noqa: E731
    target = Request("target", prompts[0], Sampling(10, 1.0, None), seed=7)
    engine = engine_for(policy, tokenizer, sampling_contexts=autocast)
    alone = complete(engine, [target])[0]
    assert engine._decoder._decode.values[0].dtype == torch.bfloat16
    crowded, _ = drive(engine_for(policy, tokenizer, sampling_contexts=autocast), {0: crowd(prompts, 5), 2: [target]})
    assert (crowded["target"].token_ids, crowded["target"].logprobs) == (alone.token_ids, alone.logprobs)
