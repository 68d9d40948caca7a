"""The episode loop: every episode of a rollout one coroutine, over a rollout engine that takes requests.

    prompt [+ reset observation] -> model turn -> step -> observation -> model turn -> step -> ... -> done

One environment instance per episode. An episode's context (prompt + everything so far, as token ids: model tokens
are never re-tokenised) is one `Request` per model turn; an episode ends when its environment says done, after
`max_turns` model turns, or when its response region reaches `max_episode_tokens` (a model turn is asked for at
most the room left; an observation longer than the room is cut there, and the episode is marked truncated). A
rollout without an environment is the one-turn case of the same loop.

What runs when. A rollout is an event loop in the caller's thread (`process.workers.run_coroutine`) running one
coroutine per episode (`_play`: reset, then ask the engine, step, ask the engine, ... top to bottom) and, beside them,
a task that steps the engine while requests are unfinished (`engines.driver.AsyncRequests`: the requests asked for
between two steps go in one `submit`). Each episode waits only for its own request and its own environment call: a
slow tool call holds its episode, not the others. An environment call (reset: the constructor and reset; step: the
step and the observation's rendering, `ConversationRenderer.observation`) runs under one deadline
(environment_timeout_s) on a worker thread (`EnvironmentCalls`; null: at once, in the loop's thread). At most
`max_concurrent` episodes are in flight (rollout.max_concurrent_episodes; null: all of the rollout's): when one ends
the next starts, in row order. Before each engine step the loop waits for the environment calls started since the
last one, twice as long as the environment's calls usually take when that is shorter than the last step (a call back
by then joins this step instead of the next).

Seeds. Each request of an episode with an environment is seeded by its key (`EpisodeSeeds`: run seed, update, row,
turn), never by the order requests complete in: with an engine whose results do not depend on what shares its steps
(hf's slot decoder), the same run gives the same episodes whatever the tools' latencies. Between two turns the engine
keeps the episode's keys and values (hf: `Request.keep` / `continues`; vLLM: its prefix cache), so a turn reads only
the tokens added since; the loop forgets them when the episode ends, and a stop (an error, Ctrl-C) leaves nothing of
the rollout in the engine. A rollout without an environment asks for every prompt's turn at once, unseeded: the engine
decodes them as one lock-step batch from torch's generator, the single-turn results of every earlier ppokit.

The result is one `Episodes` for the batch, built by `episodes.pack` from each episode's spans (model turns and
observations): the prompt in query_ids (with chat data and a reset observation, without its generation prompt, which
follows the observation: `ConversationRenderer.first`), everything after it in the response region; loss_mask is True
on the model's tokens only (observations are read, never trained on); score_index is the last model token. What the
environment said is in the same Episodes: each episode's summed step rewards, each step's reward at the last token of
its turn, the turns, done, truncated, failures and transcripts.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Optional

import torch

from ppokit.conversation.renderer import ConversationRenderer, Observation
from ppokit.engines.base import PURPOSES, Request, request_seed
from ppokit.engines.driver import AsyncRequests
from ppokit.environments.agent_session import AgentSession
from ppokit.environments.agent_endpoint import Endpoint
from ppokit.environments.base import prompt_suffix
from ppokit.training.episodes import EnvironmentSaid, SegmentRow, Span, pack
from ppokit.errors import UserError
from ppokit.process.workers import run_coroutine

if TYPE_CHECKING:
    from ppokit.environments.conversation import Conversation
    from ppokit.engines.base import Sampled, RolloutEngine, Sampling
    from ppokit.environments.base import EnvironmentCalls
    from ppokit.training.episodes import Episodes


@dataclass(frozen=True)
class EpisodeSeeds:
    """The sampling seeds of a rollout's episodes: turn t of row r is sampled with `request_seed(seed, update, first_row
    + r, t)` for training, with the purpose's index appended for the others (`engines.base.PURPOSES`: eval, greedy).
    The same key, the same seed, whatever order the requests complete in, whatever else is in flight, on any machine.

    seed: the run's seed. update: the update the rollout is for (0-based). first_row: the number of this process's
    first row among every process's (rows are numbered across processes, so no two processes share a key)."""

    seed: int
    update: int = 0
    purpose: str = "train"
    first_row: int = 0

    def of(self, row: int, turn: int) -> int:
        key = (self.seed, self.update, self.first_row + row, turn)
        return request_seed(*key) if self.purpose == "train" else request_seed(*key, PURPOSES.index(self.purpose))

    @classmethod
    def drawn(cls) -> "EpisodeSeeds":
        """Seeds for a caller that gives no key: one draw from torch's generator per rollout (evaluate() seeds it)."""
        return cls(int(torch.randint(0, 2**62, ()).item()))


@dataclass
class _Episode:
    """What an episode has made so far: its prompt, its spans after it (model turns and observations), how it ended."""

    row: int
    prompt: list[int]
    text: str  # the data row's prompt, naming the episode in error lines
    spans: list[Span] = field(default_factory=list)
    length: int = 0  # tokens after the prompt
    turns: int = 0
    done: bool = False
    truncated: bool = False
    last_turn_stopped: bool = False
    error: Optional[str] = None
    environment: Optional[str] = None  # the name of the environment its row chose, among several (its metrics'); None: one
    numbers: dict = field(default_factory=dict)  # an agent's episode: its calls, segments, ... and the agent's own numbers (`agent/*` metrics)
    earlier: list = field(default_factory=list)  # an agent's episode: its segments before the last (`SegmentRow`s), trained as rows of their own
    # the turns as text: the model's decoded (with the step's reward, done), the environment's as it said them
    transcript: list[dict] = field(default_factory=list)
    request: Optional[str] = None  # the id of its last request
    kept: bool = False  # the engine keeps that request's keys and values for the episode's next turn
    continues: Optional[str] = None  # the kept request its last request continues

    def add(self, span: Span) -> None:
        self.spans.append(span)
        self.length += len(span.ids)

    def context(self) -> list[int]:
        return self.prompt + [token for span in self.spans for token in span.ids]


class EpisodeLoop:
    """Runs the episodes of a rollout over a rollout engine, each a coroutine of its own (see the module docstring).

    engine: a `RolloutEngine` (requests: submit / step / abort / forget / serving). tokenizer: the policy's. runner: the
    environment's (`ppokit.environments.EnvironmentRunner`: `start(row, prompt)` -> an EpisodeEnvironment with `.first`;
    its `step(completion, render)` -> a Step with `rendered`, what render made of it under the same deadline;
    `side_by_side()` runs them; failures are EnvironmentFailures); None: one model turn per prompt, no environment.
    max_turns / max_episode_tokens: rollout.max_turns and the response region's budget (model turns + observations;
    None: no limit). renderer: the run's `ConversationRenderer` (how a turn reads as text, how observations become
    tokens; plain text by default). max_concurrent: rollout.max_concurrent_episodes (None: every episode of a rollout
    at once). device: where the Episodes go. agent: an agent program (`environments.agent.AgentRunner`) in place of an
    environment: each episode is its run against an endpoint of its own (`_play_agent`).
    """

    def __init__(self, engine: "RolloutEngine", tokenizer, runner=None, *, max_turns: int = 1, max_episode_tokens: Optional[int] = None,
                 pad_token_id: int, renderer: Optional[ConversationRenderer] = None, max_concurrent: Optional[int] = None,
                 device=None, agent=None):
        self.engine, self.tokenizer, self.runner, self.agent = engine, tokenizer, runner, agent
        self.max_turns, self.max_episode_tokens, self.pad_token_id = max_turns, max_episode_tokens, pad_token_id
        self.renderer = renderer or ConversationRenderer(tokenizer, None)
        self.max_concurrent, self.device = max_concurrent, device
        self._rollouts = itertools.count()  # request ids: unique across this loop's rollouts
        self._step_s = 0.0  # the last engine step's time: the most the first look of the next rollout waits (`EnvironmentCalls.settle`)

    def sample(self, prompts: list[list[int]], rows: list[dict], sampling: "Sampling", seeds: Optional[EpisodeSeeds] = None) -> "Episodes":
        """B prompts (token ids) and their data rows -> Episodes (what the environment said in them), rows in order.
        seeds: the episodes' sampling seeds (`EpisodeSeeds`; None: drawn from torch's generator); not read without an
        environment (one unseeded lock-step batch)."""
        answered = self.runner is not None or self.agent is not None
        if answered and seeds is None:
            seeds = EpisodeSeeds.drawn()
        seeds = seeds if answered else None
        episodes = [_Episode(i, list(p), str(row.get("prompt", ""))) for i, (p, row) in enumerate(zip(prompts, rows))]
        requests = AsyncRequests(self.engine, self._step_s)
        calls = self.runner.side_by_side() if self.runner is not None else None
        endpoint = Endpoint() if self.agent is not None else None
        play = partial(self._play if endpoint is None else partial(self._play_agent, endpoint=endpoint), sampling=sampling, seeds=seeds,
                       requests=requests, calls=calls, tag=f"episode-{next(self._rollouts)}")
        try:
            run_coroutine(lambda: self._rollout(episodes, rows, play, requests, calls, endpoint))
        finally:  # a stop (an error, Ctrl-C): nothing of this rollout left in the engine
            self._step_s = requests.step_s
            self.engine.abort(requests.unanswered())
            # what is kept for the episodes: their last request's, and what an aborted one was to continue
            self.engine.forget([e.request for e in episodes if e.kept] + [e.continues for e in episodes if e.continues])
        return self._packed(episodes)

    async def _rollout(self, episodes: list[_Episode], rows: list[dict], play, requests: AsyncRequests,
                       calls: Optional["EnvironmentCalls"], endpoint: Optional[Endpoint] = None) -> None:
        """Every episode played, at most `max_concurrent` at once, each started in row order as a lane frees (with an
        agent, its endpoint served in this loop meanwhile)."""
        unplayed = iter(zip(episodes, rows))  # shared by the lanes

        async def lane():
            for episode, row in unplayed:
                await play(episode, row)

        if endpoint is not None:
            await endpoint.start()
        try:
            await self._lanes(lane, len(episodes), requests, calls)
        finally:
            if endpoint is not None:
                await endpoint.stop()

    async def _lanes(self, lane, count: int, requests: AsyncRequests, calls: Optional["EnvironmentCalls"]) -> None:
        with self.engine.serving():
            async with requests.running(before_step=calls.settle if calls is not None else None):
                lanes = [asyncio.ensure_future(lane()) for _ in range(min(self.max_concurrent or count, count))]
                try:
                    await asyncio.gather(*lanes)
                finally:  # one episode's error stops the rollout: the others are cancelled (their requests aborted)
                    for running in lanes:
                        running.cancel()
                    await asyncio.gather(*lanes, return_exceptions=True)

    async def _play(self, episode: _Episode, row: dict, *, sampling: "Sampling", seeds: Optional[EpisodeSeeds],
                    requests: AsyncRequests, calls: Optional["EnvironmentCalls"], tag: str) -> None:
        """One episode, top to bottom: its environment made and reset, then model turn, step, model turn, ... until
        it ends; the engine then forgets what it kept for the episode."""
        environment = None if self.runner is None else self.runner.episode(episode.text)
        stopped = False
        try:
            if environment is not None:
                episode.environment = self.runner.environment_for(row)
                started = await calls.run(partial(environment.start, dict(row)), "reset", episode.text)
                if not self._started(episode, started):
                    return
            while True:
                completion = await requests.complete(self._request(episode, sampling, seeds, tag))
                self._turn(episode, completion)
                if environment is None:
                    return
                text = self.renderer.turn_text(episode.spans[-1].ids, episode.last_turn_stopped)
                episode.transcript.append({"role": "assistant", "text": text})
                more = episode.turns < self.max_turns and not episode.truncated
                step = await calls.run(partial(environment.step, text, self._render(episode) if more else None), "step", episode.text)
                if not self._answered(episode, step):
                    break
            if episode.error is None:  # it ended (done, its turns or its budget used up): the environment's own verdict, if it has one
                self._rewarded(episode, await calls.run(environment.final_reward, "get_reward", episode.text))
        except asyncio.CancelledError:  # the rollout is stopping (another episode's error, Ctrl-C): not waited for
            stopped = True
            raise
        finally:
            if episode.kept:
                self.engine.forget([episode.request])
                episode.kept = False
            if environment is not None:
                await self._close(environment, calls, episode.text, stopped)

    @staticmethod
    async def _close(environment, calls: "EnvironmentCalls", text: str, stopped: bool) -> None:
        """The episode's environment closed, once, however the episode ended (`EpisodeEnvironment.close`: under the
        deadline, a failure said on stderr, not the episode's); when the rollout is stopping, on a worker thread, not
        waited for."""
        from ppokit.environments.base import EnvironmentFailure, close_failed, close_later

        if stopped:
            close_later(environment)
            return
        outcome = await calls.run(environment.close, "close", text)
        if isinstance(outcome, EnvironmentFailure):  # past its deadline (its own failures it says itself)
            close_failed(str(outcome))

    async def _play_agent(self, episode: _Episode, row: dict, *, sampling: "Sampling", seeds: EpisodeSeeds, requests: AsyncRequests,
                          calls, tag: str, endpoint: Endpoint) -> None:
        """One episode made by the agent program: its run against a URL of its own, each call an engine request
        (`AgentSession`); when it returns (or fails) the URL is closed and the episode is the session's last segment,
        the reward at its last model token, with its earlier segments that sampled anything (`earlier`: rows of their own
        after scoring, `episodes.with_segment_rows`)."""
        session = AgentSession(self.agent, ask=requests.complete, forget=self.engine.forget, seed=partial(seeds.of, episode.row),
                               sampling=sampling, max_calls=self.max_turns, room=self.max_episode_tokens, name=f"{tag}-{episode.row}")
        url = endpoint.open(session)
        running = asyncio.ensure_future(self.agent.run(dict(row), url, episode.text))
        broken = asyncio.ensure_future(session.broken.wait())
        try:
            await asyncio.wait({running, broken}, return_when=asyncio.FIRST_COMPLETED)
            if session.failure is not None:  # the engine failed under a call: the rollout stops, as with an environment
                raise session.failure
            outcome = running.result()
        finally:
            for task in (running, broken):
                task.cancel()
            endpoint.close(url)
            session.end()
        episode.numbers = session.numbers()
        segment = session.trained()
        if isinstance(outcome, str) or session.error is not None:
            episode.error = session.error + prompt_suffix(episode.text) if session.error is not None else outcome
        elif segment is None or not any(span.logprobs is not None for span in segment.spans):
            episode.error = f"agent {self.agent.spec}: returned without a call answered by its endpoint (nothing to train){prompt_suffix(episode.text)}"
        if segment is None:
            return
        episode.prompt, episode.spans, episode.length = segment.prompt, segment.spans, segment.length
        model_turns = [span for span in segment.spans if span.logprobs is not None]
        episode.turns, episode.truncated, episode.last_turn_stopped = len(model_turns), segment.truncated, segment.stopped
        episode.transcript = segment.transcript
        episode.earlier = [SegmentRow(list(s.prompt), list(s.spans)) for s in session.segments[:-1] if any(span.logprobs is not None for span in s.spans)]
        if episode.error is None:
            model_turns[-1].reward = outcome.reward
            episode.done = True
            episode.numbers.update(outcome.numbers)

    # ------------------------------------------------------------------ what each event makes of the episode

    def _room(self, episode: _Episode) -> float:
        return math.inf if self.max_episode_tokens is None else self.max_episode_tokens - episode.length

    def _request(self, episode: _Episode, sampling: "Sampling", seeds: Optional[EpisodeSeeds], tag: str) -> Request:
        """The episode's next model turn as a request: its context so far, at most the room left, seeded by its key; the
        engine keeps its keys and values when another turn may follow, and continues from the last turn's."""
        budget = int(min(sampling.max_new_tokens, self._room(episode)))
        request_id = f"{tag}-{episode.row}-{episode.turns}"
        seed = None if seeds is None else seeds.of(episode.row, episode.turns)
        keep = seed is not None and episode.turns + 1 < self.max_turns
        continues = episode.request if episode.kept else None
        episode.request, episode.kept, episode.continues = request_id, keep, continues
        return Request(request_id, episode.context(), sampling if budget == sampling.max_new_tokens else replace(sampling, max_new_tokens=budget),
                       seed=seed, keep=keep, continues=continues)

    def _started(self, episode: _Episode, started) -> bool:
        """The episode's environment made and reset (or the failure it raised) -> whether its first turn may be asked for."""
        if isinstance(started, BaseException):
            episode.error = str(started)
            return False
        first = started.first
        if first is not None and first.observation is not None:
            place = self.renderer.appended if self.runner.reset_appends else self.renderer.first
            try:
                episode.prompt, observation = place(episode.prompt, first.messages, first.observation, self._room(episode))
            except UserError as e:  # the template cannot follow a prompt with an observation (said at the start)
                episode.error = str(e)
                return False
            if not self._observe(episode, observation):  # nothing left for the model: an episode that trains nothing is a failure, not a silent 0
                episode.error = self._no_room_after_reset(episode.text)
                return False
        return True

    def _turn(self, episode: _Episode, completion: "Sampled") -> None:
        """A completed request is the episode's next model turn, cut to the room left."""
        ids, logprobs, room = completion.token_ids, completion.logprobs, self._room(episode)
        stopped = completion.finish_reason == "stop" and len(ids) <= room
        if len(ids) > room:
            ids, logprobs = ids[: int(room)], logprobs[: int(room)]
        episode.truncated = not stopped and len(ids) >= room  # it reached the room without ending
        episode.add(Span(list(ids), list(logprobs)))
        episode.turns += 1
        episode.last_turn_stopped = stopped

    def _answered(self, episode: _Episode, value) -> bool:
        """The environment's step returned (its Step, or the failure) -> whether the episode's next turn may be asked for."""
        if isinstance(value, BaseException):
            episode.error = str(value)
            return False
        episode.spans[-1].reward = value.reward
        episode.done = value.done
        episode.transcript[-1]["reward"] = value.reward  # the model's turn this step answered
        if value.done:
            episode.transcript[-1]["done"] = True
        if value.done or episode.turns >= self.max_turns or episode.truncated:
            return False
        if self._room(episode) <= 0:
            episode.truncated = True
            return False
        return value.observation is None or self._observe(episode, value.rendered)

    def _rewarded(self, episode: _Episode, value) -> None:
        """The environment's reward for the whole episode (`EpisodeEnvironment.final_reward`: None without one, or the
        failure) -> added to its last model turn's reward (where the score sits), shown on that turn in the transcript."""
        if isinstance(value, BaseException):
            episode.error = str(value)
        elif value is not None:
            last = next(span for span in reversed(episode.spans) if span.logprobs is not None)
            last.reward += value
            turn = next(entry for entry in reversed(episode.transcript) if entry["role"] == "assistant")
            turn["final_reward"] = value

    def _observe(self, episode: _Episode, observation: Observation) -> bool:
        """Append an observation's tokens (`ConversationRenderer.first` or `.observation`), cut to the room left (the
        episode then ends, truncated: False); its transcript entries say what the model read."""
        ids, said = observation.ids, observation.said
        room = self._room(episode)
        if len(ids) >= room:
            ids, episode.truncated = ids[: int(room)], True
            # the transcript shows what the model read: the observation's tokens left after the cut
            said = [{"role": said[0]["role"], "text": self.tokenizer.decode(ids, skip_special_tokens=True), "cut": True}]
        episode.add(Span(list(ids)))
        episode.transcript += said
        return not episode.truncated

    def _render(self, episode: _Episode):
        """What the observation after the episode's last turn reads as (run by the runner within the step's deadline)."""
        stopped, room = episode.last_turn_stopped, self._room(episode)
        return lambda step: self.renderer.observation(step.messages, step.observation, stopped, room)

    def _no_room_after_reset(self, prompt: str) -> str:
        from ppokit.environments.base import prompt_suffix

        # the observation was cut to the room before it was tokenised: its own length is not known, only that it fills it
        return (f"environment {self.runner.spec}: reset's observation fills the episode's whole budget (rollout.max_episode_tokens: "
                f"{self.max_episode_tokens} tokens after the prompt) and leaves no room for a model turn; shorten the observation or "
                f"raise rollout.max_episode_tokens{prompt_suffix(prompt)}")

    def _packed(self, episodes: list[_Episode]) -> "Episodes":
        answered = self.runner is not None or self.agent is not None
        said = [EnvironmentSaid(e.done, e.truncated, e.error, e.transcript, e.environment, e.numbers, e.earlier) for e in episodes] if answered else None
        ended = [e.done or (e.last_turn_stopped and not e.truncated) for e in episodes]
        return pack([e.prompt for e in episodes], [e.spans for e in episodes], ended, self.pad_token_id, self.device, said)


def episode_source(engine: "RolloutEngine", conversation: "Conversation", *, max_turns: int, max_episode_tokens: int,
                   max_concurrent: Optional[int], pad_token_id: int, device=None) -> EpisodeLoop:
    """What the trainer samples its episodes from, decided once: the `EpisodeLoop` over the engine, with the conversation's
    environment (one turn per prompt without one) and renderer, at most `max_turns` turns (rollout.max_turns) within the
    episode's token budget (`PPOConfig.response_room`), at most `max_concurrent` episodes in flight
    (rollout.max_concurrent_episodes)."""
    answered = conversation.runner is not None or conversation.agent is not None
    return EpisodeLoop(engine, conversation.renderer.tokenizer, conversation.runner, max_turns=max_turns if answered else 1,
                       max_episode_tokens=max_episode_tokens if answered else None, pad_token_id=pad_token_id,
                       renderer=conversation.renderer, max_concurrent=max_concurrent, device=device, agent=conversation.agent)


def data_rows(prompts: list[str], columns: dict[str, list]) -> list[dict]:
    """The data rows an environment's reset sees: the prompt and every other column."""
    return [{"prompt": prompt, **{name: values[i] for name, values in columns.items()}} for i, prompt in enumerate(prompts)]
