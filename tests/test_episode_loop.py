"""The per-episode loop (ppokit.environments.episode_loop): each episode advances as soon as its own request or its own
environment call returns, environment calls run side by side (async ones too), the episodes in flight are bounded, the
results do not depend on the tools' latencies (seeds keyed by run seed, update, row and turn), and one function packs
every rollout (`episodes.pack`), a one-turn rollout as every earlier ppokit sampled it."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import types

import pytest
import torch
from request_engines import ScriptedRequests
from test_multiturn import ScriptedEngine, ids, sampling

from ppokit.engines.base import Request, Sampling, request_seed
from ppokit.engines.hf import HFEngine
from ppokit.environments import EnvironmentRunner, EnvironmentTimeout
from ppokit.environments.episode_loop import EpisodeLoop, EpisodeSeeds
from ppokit.training.episodes import EnvironmentSaid, Span, pack
from ppokit.demos.tiny import tiny_causal_lm, word_tokenizer

pytestmark = pytest.mark.transformers_pins  # CI runs this file under vLLM's transformers pin too (.ci/vllm-env)

WORDS = "guess the number from 1 to 16 : 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 higher lower correct user assistant"
# What a test waits for at most before it calls the behaviour broken (the behaviour itself needs no wait): far above
# what a loaded machine takes, so only a loop that cannot make progress reaches it.
WAIT_BOUND_S = 20.0


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer([WORDS])


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    return tiny_causal_lm("llama", tok).eval()


def loop_over(engine, tok, cls, *, timeout_s=60.0, **kw):
    args = dict(max_turns=3, max_episode_tokens=40, pad_token_id=tok.pad_token_id)
    args.update(kw)
    return EpisodeLoop(engine, tok, EnvironmentRunner(f"test:{cls.__name__}", cls, {}, timeout_s=timeout_s), **args)


def scripted(tok):
    eos, seven = tok.eos_token_id, ids(tok, "7")[0]
    return ScriptedEngine([seven, eos], tok.pad_token_id, eos)


# --------------------------------------------------------------------------- each episode on its own


class WaitsForTheOther:
    """Row "slow": its first step returns only once row "fast" has played all its three turns (or after WAIT_BOUND_S).
    A loop that waits for every episode's step before the next turn can never let "fast" finish first."""

    fast_done: threading.Event
    released: list

    def reset(self, row):
        self.row, self.turn = row["prompt"], 0

    def step(self, completion):
        self.turn += 1
        if self.row == "slow" and self.turn == 1:
            WaitsForTheOther.released.append(WaitsForTheOther.fast_done.wait(WAIT_BOUND_S))
        if self.row == "fast" and self.turn == 3:
            WaitsForTheOther.fast_done.set()
        return "higher", float(self.turn), self.turn >= 3


def test_an_episode_advances_while_another_waits_on_its_environment(tok):
    WaitsForTheOther.fast_done, WaitsForTheOther.released = threading.Event(), []
    loop = loop_over(scripted(tok), tok, WaitsForTheOther)
    episodes = loop.sample([ids(tok, "guess")] * 2, [{"prompt": "slow"}, {"prompt": "fast"}], sampling(tok), EpisodeSeeds(0))
    assert WaitsForTheOther.released == [True]  # "fast" played its three turns while "slow" waited in its first step
    assert episodes.turns.tolist() == [3, 3] and episodes.environment_errors == [None, None]
    assert episodes.environment_rewards.tolist() == [6.0, 6.0]


class MeetsTheOthers:
    """Every episode's first step waits at a barrier for the other episodes' first steps: it returns only if all of
    them run at the same time (a BrokenBarrierError after WAIT_BOUND_S otherwise, which fails the episode)."""

    barrier: threading.Barrier

    def reset(self, row):
        self.turn = 0

    def step(self, completion):
        self.turn += 1
        if self.turn == 1:
            MeetsTheOthers.barrier.wait(WAIT_BOUND_S)
        return "higher", 1.0, self.turn >= 2


def test_environment_calls_run_side_by_side(tok):
    MeetsTheOthers.barrier = threading.Barrier(4)
    loop = loop_over(scripted(tok), tok, MeetsTheOthers)
    episodes = loop.sample([ids(tok, "guess")] * 4, [{"prompt": str(i)} for i in range(4)], sampling(tok), EpisodeSeeds(0))
    assert episodes.environment_errors == [None] * 4 and episodes.turns.tolist() == [2] * 4


class Staggered:
    """Row i's reset and steps take 10 + 4·i ms; two turns."""

    def reset(self, row):
        self.wait_s, self.turn = 0.010 + 0.004 * int(row["prompt"]), 0
        time.sleep(self.wait_s)

    def step(self, completion):
        time.sleep(self.wait_s)
        self.turn += 1
        return "higher", 1.0, self.turn >= 2


def test_calls_back_within_a_decoding_steps_time_join_the_next_step_together(tok):
    """After an engine step, the loop waits for the environment calls it started, twice as long as its calls usually
    take (within a step's time): calls of 10-22 ms, beside a 0.5 s step, all join the next step (one submit of the
    four episodes' requests a turn), not one step after another."""
    engine = scripted(tok)
    step = engine.step

    def slow_step():
        time.sleep(0.5)
        return step()

    engine.step = slow_step
    loop = loop_over(engine, tok, Staggered)
    rows = [{"prompt": str(i)} for i in range(4)]
    for _ in range(2):  # the second rollout's first look knows a step's time and the calls' too
        engine.submitted.clear()
        episodes = loop.sample([ids(tok, "guess")] * 4, rows, sampling(tok), EpisodeSeeds(0))
    assert episodes.turns.tolist() == [2] * 4
    assert [len(batch) for batch in engine.submitted] == [4, 4]


class AsyncMeetsTheOthers:
    """`async def` reset and step: every first step awaits the others' at an asyncio barrier (on the one event loop the
    environments' coroutines share), then the episode plays a second turn."""

    barrier = None
    cancelled: list = []

    async def reset(self, row):
        await asyncio.sleep(0)
        self.turn, self.hang = 0, row.get("hang", False)
        return "guess"

    async def step(self, completion):
        self.turn += 1
        if self.hang:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                AsyncMeetsTheOthers.cancelled.append(True)
                raise
        if self.turn == 1:
            if AsyncMeetsTheOthers.barrier is None:
                AsyncMeetsTheOthers.barrier = asyncio.Barrier(3)
            await asyncio.wait_for(AsyncMeetsTheOthers.barrier.wait(), WAIT_BOUND_S)
        return "higher", 0.5, self.turn >= 2


def test_async_environments_run_side_by_side_and_a_hung_coroutine_is_cancelled_at_its_deadline(tok):
    AsyncMeetsTheOthers.barrier, AsyncMeetsTheOthers.cancelled = None, []
    loop = loop_over(scripted(tok), tok, AsyncMeetsTheOthers)
    episodes = loop.sample([ids(tok, "guess")] * 3, [{"prompt": str(i)} for i in range(3)], sampling(tok), EpisodeSeeds(0))
    assert episodes.environment_errors == [None] * 3 and episodes.turns.tolist() == [2] * 3
    assert episodes.environment_rewards.tolist() == [1.0] * 3 and episodes.transcripts[0][0] == {"role": "user", "text": "guess"}

    loop = loop_over(scripted(tok), tok, AsyncMeetsTheOthers, timeout_s=0.3)
    started = time.monotonic()
    episodes = loop.sample([ids(tok, "guess")], [{"prompt": "p", "hang": True}], sampling(tok), EpisodeSeeds(0))
    assert time.monotonic() - started < WAIT_BOUND_S
    assert episodes.environment_errors[0].startswith("environment test:AsyncMeetsTheOthers: step did not return within environment_timeout_s=0.3s")
    bound = time.monotonic() + WAIT_BOUND_S
    while not AsyncMeetsTheOthers.cancelled and time.monotonic() < bound:
        time.sleep(0.01)
    assert AsyncMeetsTheOthers.cancelled == [True]


def test_a_timeout_is_one_episodes_and_the_runner_calls_async_code_too(tok):
    """The runner's own calls (`start_many` / `step_many`) settle an `async def` reset and step as well."""
    runner = EnvironmentRunner("test:AsyncMeetsTheOthers", AsyncMeetsTheOthers, {}, timeout_s=0.3)
    AsyncMeetsTheOthers.cancelled = []
    [episode] = runner.start_many([{"prompt": "p", "hang": True}], ["p"])
    assert episode.first.observation == "guess"
    [outcome] = runner.step_many([episode], ["x"])
    assert isinstance(outcome, EnvironmentTimeout)


# --------------------------------------------------------------------------- the bound on episodes in flight


class CountsLive:
    """Counts the episodes alive at once (reset to the step that says done, at the second turn)."""

    lock = threading.Lock()
    live = 0
    most = 0

    def reset(self, row):
        self.turn = 0
        with CountsLive.lock:
            CountsLive.live += 1
            CountsLive.most = max(CountsLive.most, CountsLive.live)

    def step(self, completion):
        self.turn += 1
        time.sleep(0.002)
        if self.turn == 2:
            with CountsLive.lock:
                CountsLive.live -= 1
        return "lower", 1.0, self.turn == 2


@pytest.mark.parametrize("bound", [None, 2])
def test_max_concurrent_episodes_bounds_the_episodes_in_flight(tok, model, bound):
    """rollout.max_concurrent_episodes: at most that many episodes are alive at once (their environments, their kept
    keys and values); the episodes are the same as without the bound (their seeds are their own)."""
    CountsLive.live = CountsLive.most = 0
    engine = HFEngine(model, tok.pad_token_id, torch.device("cpu"), rows_per_forward=4, max_sequence=64)
    loop = loop_over(engine, tok, CountsLive, max_concurrent=bound)
    prompts = [ids(tok, "guess the number :"), ids(tok, "guess :")] * 3
    episodes = loop.sample(prompts, [{"prompt": str(i)} for i in range(6)], sampling(tok, 4), EpisodeSeeds(3))
    assert CountsLive.most == (6 if bound is None else bound)
    assert episodes.turns.tolist() == [2] * 6 and not engine._decoder.kept  # nothing kept once the rollout is done
    unbounded = loop_over(engine, tok, CountsLive).sample(prompts, [{"prompt": str(i)} for i in range(6)], sampling(tok, 4), EpisodeSeeds(3))
    assert torch.equal(episodes.response_ids, unbounded.response_ids) and torch.equal(episodes.logprobs, unbounded.logprobs)


# --------------------------------------------------------------------------- results independent of timing


class Latent:
    """A tool with latency: each call sleeps `delay(row, turn)` seconds; three turns, the reward the turn's length."""

    delay = staticmethod(lambda row, turn: 0.0)

    def reset(self, row):
        self.row, self.turn = int(row["prompt"]), 0
        time.sleep(Latent.delay(self.row, -1))

    def step(self, completion):
        time.sleep(Latent.delay(self.row, self.turn))
        self.turn += 1
        return ["higher", "lower", "higher"][self.turn - 1], float(len(completion.split())), self.turn >= 3


def test_the_same_episodes_whatever_the_tools_latencies(tok, model):
    """Over the hf engine: tools that answer at once, then late rows first, then at random: the episodes are the same
    to the last bit (every token, logprob and reward), although the requests complete in another order each time;
    other seeds give other episodes."""
    def run(delay, seeds=EpisodeSeeds(7, update=2, first_row=8)):
        Latent.delay = staticmethod(delay)
        engine = HFEngine(model, tok.pad_token_id, torch.device("cpu"), rows_per_forward=4, max_sequence=64)
        order = []
        step = engine.step
        engine.step = lambda: [order.append(c.request_id) or c for c in step()]
        loop = loop_over(engine, tok, Latent, max_episode_tokens=30)
        prompts = [ids(tok, "guess the number from 1 to 16 :"), ids(tok, "guess :"), ids(tok, "the number :")] * 2
        return loop.sample(prompts, [{"prompt": str(i)} for i in range(6)], sampling(tok, 6), seeds), order

    now, now_order = run(lambda row, turn: 0.0)
    late_first, late_order = run(lambda row, turn: 0.02 * (5 - row))
    jitter = random.Random()
    shuffled, shuffled_order = run(lambda row, turn: 0.03 * jitter.random())
    assert late_order != now_order  # the episodes did not advance in the same order
    for other in (late_first, shuffled):
        for name in ("response_ids", "attention_mask", "loss_mask", "logprobs", "turn_rewards", "environment_rewards", "turns"):
            assert torch.equal(getattr(now, name), getattr(other, name)), name
        assert other.transcripts == now.transcripts
    reseeded, _ = run(lambda row, turn: 0.0, EpisodeSeeds(7, update=3, first_row=8))
    assert not torch.equal(reseeded.response_ids, now.response_ids)


LATENT_TOOL = '''
import random
import time

class Latent:
    """Three turns; each call takes a random time (this run's own random stream: another in every run)."""

    def reset(self, row):
        time.sleep(random.random() * 0.01)
        self.turn = 0

    def step(self, completion):
        time.sleep(random.random() * 0.03)
        self.turn += 1
        return "the movie was", float(len(completion.split()) % 3), self.turn >= 3
'''


def test_a_run_writes_the_same_metrics_whatever_its_tools_latencies(model_dir, prompts_file, tmp_path):
    """Two multi-turn runs whose tool calls take random times: identical metrics.jsonl (but its timings) and
    samples.jsonl."""
    from conftest import tiny_ppo_config

    from ppokit.config.schema import RolloutConfig
    from ppokit.trainer import PPOTrainer

    env_file = tmp_path / "latent.py"
    env_file.write_text(LATENT_TOOL)

    def run(name):
        config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / name, total_episodes=16, advantage_estimator="grpo",
                                 num_samples_per_prompt=4, num_sample_generations=1)
        config.environment = f"{env_file}:Latent"
        config.rollout = RolloutConfig(max_turns=3, max_episode_tokens=24)
        PPOTrainer(config, show_progress=False).train()
        metrics = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        untimed = [{k: v for k, v in r.items() if not k.startswith("time/") and k != "eps"} for r in metrics]
        return untimed, (tmp_path / name / "samples.jsonl").read_text()

    first, second = run("first"), run("second")
    assert first[0][0]["rollout/turns"] == 3 and len(first[0]) == 2
    assert first == second


# --------------------------------------------------------------------------- seeds


def test_episode_seeds_are_keyed_by_run_seed_update_row_and_turn():
    seeds = EpisodeSeeds(11, update=4, first_row=16)
    assert seeds.of(2, 1) == request_seed(11, 4, 18, 1)  # this process's row 2 is row 18 of the update
    keys = [seeds.of(r, t) for r in range(3) for t in range(3)]
    assert len(set(keys)) == 9
    assert EpisodeSeeds(11, 4, "eval", 16).of(2, 1) == request_seed(11, 4, 18, 1, 1) != seeds.of(2, 1)
    assert EpisodeSeeds(11, 4, "greedy", 16).of(2, 1) == request_seed(11, 4, 18, 1, 2)
    torch.manual_seed(5)
    drawn = EpisodeSeeds.drawn()
    torch.manual_seed(5)
    assert EpisodeSeeds.drawn() == drawn  # without a key: one draw from torch's generator, repeatable under its seed


def test_the_rollout_seeds_an_update_by_its_number_and_rows_across_processes(monkeypatch):
    from ppokit.training import rollout as rollout_module
    from ppokit.training.rollout import Rollout

    class Source:
        def sample(self, query_ids, rows, sampling, seeds):
            self.seeds = seeds

    class Hp:
        temperature, eval_temperature, response_length, top_k, top_p, min_p = 1.0, None, 4, 0, 1.0, 0.0

    source = Source()
    monkeypatch.setattr(rollout_module, "episode_source", lambda engine, conversation, **keys: source)
    conversation = types.SimpleNamespace(stop_token_ids=(), runner=None)
    rollout = Rollout(None, conversation, None, None, Sampling.by_purpose(Hp, ()), max_turns=1, max_episode_tokens=4, max_concurrent=None,
                      pad_token_id=0, device=torch.device("cpu"), reduce=None, seed=9, process_index=2)
    rollout.sample([[1], [2], [3]], ["a", "b", "c"], {}, update=5)
    assert source.seeds == EpisodeSeeds(9, 5, "train", first_row=6)
    rollout.sample([[1]], ["a"], {}, "eval")
    assert source.seeds is None  # evaluate(): drawn from torch's generator, which it seeds


# --------------------------------------------------------------------------- one turn, one packer


class Recording(HFEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.submits = []

    def submit(self, requests):
        self.submits.append(list(requests))
        super().submit(requests)


def test_a_one_turn_rollout_is_the_engines_lock_step_batch_bit_for_bit(tok, model):
    """Without an environment the loop sends every prompt's request at once, unseeded: the engine's one lock-step batch
    from torch's generator, the same tokens, logprobs and layout as `generate` (what every earlier ppokit sampled)."""
    engine = Recording(model, tok.pad_token_id, torch.device("cpu"), rows_per_forward=4, max_sequence=64)
    prompts = [ids(tok, "guess the number :"), ids(tok, "guess :"), ids(tok, "1 to 16 :")]
    torch.manual_seed(3)
    want = engine.generate(prompts, sampling(tok, 6))
    loop = EpisodeLoop(engine, tok, None, pad_token_id=tok.pad_token_id)
    torch.manual_seed(3)
    got = loop.sample(prompts, [{"prompt": "p"}] * 3, sampling(tok, 6), EpisodeSeeds(1))
    for name in ("query_ids", "response_ids", "attention_mask", "loss_mask", "logprobs", "ended", "score_index"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.environment_rewards is None and got.transcripts is None
    assert [len(s) for s in engine.submits] == [3, 3] and all(r.seed is None for s in engine.submits for r in s)


def test_pack_lays_out_spans_hand_checked():
    """Two episodes: prompt [5, 6] with an observation, a model turn, an observation, a model turn; prompt [7] with
    one model turn. Left-padded prompts, right-padded responses, the model's tokens trained with their logprobs, each
    step reward at its turn's last token, the score at the last model token."""
    spans = [[Span([20, 21]), Span([30, 31], [-0.1, -0.2], reward=0.5), Span([22]), Span([32], [-0.3], reward=2.0)],
             [Span([40, 41, 42], [-1.0, -2.0, -3.0], reward=1.0)]]
    said = [EnvironmentSaid(done=True, truncated=False, transcript=[{"role": "user", "text": "x"}]),
            EnvironmentSaid(done=False, truncated=True, error="boom")]
    episodes = pack([[5, 6], [7]], spans, [True, False], pad_token_id=0, environment=said)
    assert episodes.query_ids.tolist() == [[5, 6], [0, 7]]
    assert episodes.response_ids.tolist() == [[20, 21, 30, 31, 22, 32], [40, 41, 42, 0, 0, 0]]
    assert episodes.attention_mask.tolist() == [[True] * 8, [False, True, True, True, True, False, False, False]]
    assert episodes.loss_mask.tolist() == [[False, False, True, True, False, True], [True, True, True, False, False, False]]
    want = torch.tensor([[0, 0, -0.1, -0.2, 0, -0.3], [-1, -2, -3, 0, 0, 0]], dtype=torch.float32)  # float32 as given
    assert torch.equal(episodes.logprobs, want)
    assert episodes.turn_rewards.tolist() == [[0, 0, 0, 0.5, 0, 2.0], [0, 0, 1.0, 0, 0, 0]]
    assert episodes.score_index.tolist() == [5, 2] and episodes.ended.tolist() == [True, False]
    assert episodes.environment_rewards[0].item() == 2.5 and torch.isnan(episodes.environment_rewards[1])
    assert episodes.turns.tolist() == [2, 1] and episodes.done.tolist() == [True, False] and episodes.truncated.tolist() == [False, True]
    assert episodes.environment_errors == [None, "boom"] and episodes.transcripts == [[{"role": "user", "text": "x"}], []]
    alone = pack([[7]], [[Span([40, 41], [-1.0, -2.0])]], [False], pad_token_id=0)
    assert alone.turns is None and alone.environment_rewards is None and alone.transcripts is None


def test_a_stop_mid_rollout_leaves_nothing_in_the_engine(tok, model):
    """An error that stops the run while requests are in flight (a UserError the environment raises itself) aborts
    them and forgets what the engine keeps, so that the engine can be released for training."""
    from ppokit.errors import UserError

    class Complains:
        def reset(self, row):
            self.turn, self.row = 0, row["prompt"]

        def step(self, completion):
            self.turn += 1
            if self.row == "0" and self.turn == 2:
                raise UserError("the environment refuses to go on")
            return "higher", 0.0, False

    engine = HFEngine(model, tok.pad_token_id, torch.device("cpu"), rows_per_forward=2, max_sequence=64)
    loop = loop_over(engine, tok, Complains)
    with pytest.raises(UserError, match="refuses"):
        loop.sample([ids(tok, "guess :")] * 4, [{"prompt": str(i)} for i in range(4)], sampling(tok, 4), EpisodeSeeds(0))
    assert engine.unfinished() == 0 and not engine._decoder.kept
    engine.release()


def test_requests_carry_their_seed_and_continue_the_episodes_last_turn(tok):
    engine = scripted(tok)
    loop = loop_over(engine, tok, Latent, max_turns=3)
    Latent.delay = staticmethod(lambda row, turn: 0.0)
    seeds = EpisodeSeeds(2, update=1, first_row=4)
    loop.sample([ids(tok, "guess")] * 2, [{"prompt": "0"}, {"prompt": "1"}], sampling(tok), seeds)
    by_row = {}
    for request in engine.requests:
        by_row.setdefault(request.request_id.split("-")[-2], []).append(request)
    for row, requests in by_row.items():
        assert [r.seed for r in requests] == [seeds.of(int(row), t) for t in range(3)]
        assert [r.keep for r in requests] == [True, True, False]  # the last turn possible keeps nothing
        assert [r.continues for r in requests] == [None, requests[0].request_id, requests[1].request_id]
        assert all(isinstance(r, Request) and r.sampling.max_new_tokens == 8 for r in requests)


def test_requests_ask_at_most_the_room_left(tok):
    engine = scripted(tok)
    Latent.delay = staticmethod(lambda row, turn: 0.0)
    loop = loop_over(engine, tok, Latent, max_turns=3, max_episode_tokens=6)
    loop.sample([ids(tok, "guess")], [{"prompt": "0"}], Sampling(max_new_tokens=8, temperature=1.0, stop_token_ids=tok.eos_token_id),
                EpisodeSeeds(0))
    # turn 1: 6 tokens of room (2 taken: 7 <eos>), observation "higher" (1), turn 2: 3 left
    assert [r.sampling.max_new_tokens for r in engine.requests] == [6, 3]


# --------------------------------------------------------------------------- the loop's own event loop


def test_sample_called_from_a_running_event_loop_is_the_same_rollout(tok, model):
    """An async caller (an agent endpoint) calls `sample` from its event loop's thread: the rollout runs on a loop of its
    own, blocking the caller as any synchronous call does, and gives the same episodes."""
    def rollout():
        engine = HFEngine(model, tok.pad_token_id, torch.device("cpu"), rows_per_forward=4, max_sequence=64)
        Latent.delay = staticmethod(lambda row, turn: 0.0)
        loop = loop_over(engine, tok, Latent, max_episode_tokens=30)
        prompts = [ids(tok, "guess the number :"), ids(tok, "guess :")]
        return loop.sample(prompts, [{"prompt": str(i)} for i in range(2)], sampling(tok, 6), EpisodeSeeds(5))

    async def caller():
        return rollout()

    plain, from_async = rollout(), asyncio.run(caller())
    for name in ("response_ids", "logprobs", "loss_mask", "environment_rewards"):
        assert torch.equal(getattr(plain, name), getattr(from_async, name)), name


class Forgetful(ScriptedRequests):
    """Completes every request but the second turn of row 1, which it drops without a word (a broken engine)."""

    def respond(self, request):
        return [self.seven, self.eos], [-0.5, -0.5]

    def step(self):
        self.queue = [r for r in self.queue if not r.request_id.endswith("-1-1")]
        return super().step()


def test_an_engine_that_loses_a_request_is_an_error_not_a_hang(tok):
    engine = Forgetful()
    engine.seven, engine.eos, engine.pad_token_id = ids(tok, "7")[0], tok.eos_token_id, tok.pad_token_id
    loop = loop_over(engine, tok, Latent)
    Latent.delay = staticmethod(lambda row, turn: 0.0)
    raised = []

    def rollout():  # in a thread of its own, so that a loop that hangs fails the test instead of hanging it
        try:
            loop.sample([ids(tok, "guess")] * 2, [{"prompt": "0"}, {"prompt": "1"}], Sampling(4, 1.0, tok.eos_token_id), EpisodeSeeds(0))
        except RuntimeError as e:
            raised.append(str(e))

    thread = threading.Thread(target=rollout, daemon=True)
    thread.start()
    thread.join(WAIT_BOUND_S)
    assert raised and raised[0].startswith("stuck: the engine holds none of the 1 requests still waited for (episode-0-1-1")


def test_ctrl_c_mid_rollout_leaves_nothing_in_the_engine_and_leaves_its_serving(tok, model, monkeypatch, caplog):
    """Ctrl-C under Python's own SIGINT handler while an environment runs in the loop's thread (environment_timeout_s
    null): the KeyboardInterrupt is the run's, not the episode's. It stops the rollout; the other episodes' coroutines are
    unwound (the engine's `serving()` left), their requests aborted and what the engine kept for them forgotten; nothing
    of the rollout's tasks is left for asyncio to report later (at a garbage collection, in the middle of other code)."""
    import gc
    import signal

    monkeypatch.setattr(signal, "getsignal", lambda sig: signal.default_int_handler)

    class CtrlC:
        def reset(self, row):
            self.turn, self.row = 0, row["prompt"]

        def step(self, completion):
            self.turn += 1
            if self.row == "0" and self.turn == 2:
                raise KeyboardInterrupt  # what the default handler raises where the main thread is
            return "higher", 0.0, False

    engine = HFEngine(model, tok.pad_token_id, torch.device("cpu"), rows_per_forward=2, max_sequence=64)
    loop = loop_over(engine, tok, CtrlC, timeout_s=None)
    with pytest.raises(KeyboardInterrupt):
        loop.sample([ids(tok, "guess :")] * 4, [{"prompt": str(i)} for i in range(4)], sampling(tok, 4), EpisodeSeeds(0))
    assert engine.unfinished() == 0 and not engine._decoder.kept and not engine._serving
    engine.release()
    caplog.clear()
    gc.collect()
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


# --------------------------------------------------------------------------- close, once per episode, however it ends


class Closes:
    """Each row's `prompt` says how its episode ends: "done" (the first step says done), "fails" (the first step
    raises), "reset_fails", "hangs" (the first step outlives its deadline: it waits for `released`), "turns" (never
    done: rollout.max_turns ends it), "cut" (an observation longer than the episode's budget). `closed`: the row of
    every close() call, in order; `instances`: how many instances each row's episodes made."""

    closed: list
    released: threading.Event

    def reset(self, row):
        self.row = row["prompt"]
        if self.row == "reset_fails":
            raise ValueError("no game today")

    def step(self, completion):
        if self.row == "fails":
            raise ValueError("the game broke")
        if self.row == "hangs":
            Closes.released.wait(WAIT_BOUND_S)
        if self.row == "cut":
            return " ".join(["higher"] * 60), 0.0, False
        return "higher", 1.0, self.row == "done"

    def close(self):
        Closes.closed.append(getattr(self, "row", "probe"))  # the runner's start-up instance is never reset


class ClosesAsync(Closes):
    async def close(self):
        await asyncio.sleep(0)
        Closes.closed.append(getattr(self, "row", "probe"))


class ClosesBadly(Closes):
    def close(self):
        Closes.closed.append(getattr(self, "row", "probe"))
        raise OSError("the socket was gone already")


ENDINGS = ["done", "fails", "reset_fails", "hangs", "turns", "cut"]


@pytest.mark.parametrize("cls", [Closes, ClosesAsync], ids=["sync", "async"])
@pytest.mark.parametrize("timeout_s", [2.0, None], ids=["worker_thread", "callers_thread"])
def test_close_is_called_once_per_episode_however_it_ends(tok, cls, timeout_s):
    endings = ENDINGS if timeout_s is not None else [e for e in ENDINGS if e != "hangs"]  # no deadline: a hang hangs
    Closes.closed, Closes.released = [], threading.Event()
    loop = loop_over(scripted(tok), tok, cls, timeout_s=timeout_s, max_turns=3, max_episode_tokens=24)
    try:
        episodes = loop.sample([ids(tok, "guess")] * len(endings), [{"prompt": e} for e in endings], sampling(tok), EpisodeSeeds(0))
    finally:
        Closes.released.set()
    assert sorted(Closes.closed) == sorted(endings + ["probe"])  # each episode's instance closed once, and the start-up one
    errors = dict(zip(endings, episodes.environment_errors))
    assert [e for e in endings if errors[e]] == [e for e in endings if e in ("fails", "reset_fails", "hangs")]
    assert episodes.truncated.tolist()[endings.index("cut")] and episodes.turns.tolist()[endings.index("turns")] == 3


def test_a_close_that_raises_is_said_and_the_episode_counts(tok, capsys):
    Closes.closed, Closes.released = [], threading.Event()
    loop = loop_over(scripted(tok), tok, ClosesBadly)
    episodes = loop.sample([ids(tok, "guess")], [{"prompt": "done"}], sampling(tok), EpisodeSeeds(0))
    assert Closes.closed == ["probe", "done"] and episodes.environment_errors == [None]
    assert episodes.environment_rewards.tolist() == [1.0]
    err = capsys.readouterr().err
    assert ("ppokit: warning: environment test:ClosesBadly: close raised OSError: the socket was gone already; prompt 'done' "
            "(after its episode ended: the episode counts)") in err


def test_a_rollout_that_stops_still_closes_every_started_episode(tok, model):
    """A UserError from one episode stops the rollout: the others are cancelled, their environments closed all the same
    (on worker threads, not waited for)."""
    from ppokit.errors import UserError

    class StopsAll(Closes):
        def step(self, completion):
            if self.row == "0":
                raise UserError("the environment refuses to go on")
            return "higher", 0.0, False

    Closes.closed = []
    loop = loop_over(scripted(tok), tok, StopsAll)
    with pytest.raises(UserError, match="refuses"):
        loop.sample([ids(tok, "guess")] * 4, [{"prompt": str(i)} for i in range(4)], sampling(tok), EpisodeSeeds(0))
    deadline = time.monotonic() + WAIT_BOUND_S
    while len(Closes.closed) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(Closes.closed) == ["0", "1", "2", "3", "probe"]
