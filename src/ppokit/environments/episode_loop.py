"""The multi-turn episode loop: a rollout engine's model turns interleaved with an environment's answers.

    prompt [+ reset observation] -> model turn -> step -> observation -> model turn -> step -> ... -> done

One environment instance per episode. Every turn is ONE batched `engine.generate` call for all the
episodes still running (their contexts: prompt + everything so far, as token ids: model tokens are
never re-tokenised). An episode ends when its environment says done, after `max_turns` model turns,
or when its response region reaches `max_episode_tokens` (a model turn or an observation longer than
what is left is cut there, and the episode is marked truncated).

The result is one `Episodes` for the batch, in the layout of a single-turn rollout: the prompt in
query_ids (with chat data and a reset observation, without its generation prompt, which follows the
observation: `ConversationRenderer.first`), everything after it (model turns and observations) in the response region; loss_mask is
True on the model's tokens only (observations are read, never trained on); score_index is the last
model token. What the environment said is in the same Episodes: each episode's summed step rewards, each step's
reward at the last token of its turn, the turns, done, truncated, failures and transcripts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Optional

import torch

from ppokit.conversation import ConversationRenderer, Observation
from ppokit.errors import UserError

if TYPE_CHECKING:
    from ppokit.engines.base import RolloutEngine, Sampling
    from ppokit.episodes import Episodes


@dataclass
class _EpisodeBuffer:
    """One episode while it runs: its token ids after the prompt, which of them are the model's."""

    environment: Any = None  # the runner's EpisodeEnvironment
    ids: list[int] = field(default_factory=list)
    trained: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_ends: list[tuple[int, float]] = field(default_factory=list)  # (column of the turn's last token, its step reward)
    reward: float = 0.0
    turns: int = 0
    running: bool = True
    done: bool = False
    truncated: bool = False
    last_turn_stopped: bool = False
    error: Optional[str] = None
    transcript: list[dict] = field(default_factory=list)  # the turns as text: the model's decoded (with the step's reward, done), the environment's as it said them

    def add(self, ids: list[int], logprobs: Optional[list[float]]) -> None:
        self.ids += ids
        self.trained += [logprobs is not None] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def fail(self, message: str) -> None:
        self.error, self.running = message, False


class MultiTurn:
    """Runs batches of multi-turn episodes over a rollout engine (see the module docstring).

    runner: makes and calls the environments (`ppokit.environments.EnvironmentRunner`: start_many(rows,
    prompts) -> per row an episode with `.first` (a Step) or the exception it failed with;
    step_many(episodes, completions, render) -> per episode a Step (observation, reward, done, messages, and
    `rendered`: what render made of it under the same deadline) or an exception). max_episode_tokens: the
    response region's budget (model turns + observations). renderer: the run's `ConversationRenderer` (how a
    turn reads as text, how observations become tokens; plain text by default).
    """

    def __init__(
        self, engine: "RolloutEngine", tokenizer, runner, *, max_turns: int, max_episode_tokens: Optional[int],
        pad_token_id: int, renderer: Optional[ConversationRenderer] = None,
    ):
        self.engine, self.tokenizer, self.runner = engine, tokenizer, runner
        self.max_turns, self.max_episode_tokens, self.pad_token_id = max_turns, max_episode_tokens, pad_token_id
        self.renderer = renderer or ConversationRenderer(tokenizer, None)

    def _room(self, episode: _EpisodeBuffer) -> float:
        return math.inf if self.max_episode_tokens is None else self.max_episode_tokens - len(episode.ids)

    def _observe(self, episode: _EpisodeBuffer, observation: Observation) -> None:
        """Append an observation's tokens (`ConversationRenderer.first` or `.observation`), cut to the room left (the
        episode then ends, truncated); its transcript entries say what the model read."""
        ids, said = observation.ids, observation.said
        room = self._room(episode)
        if len(ids) >= room:
            ids, episode.truncated, episode.running = ids[: int(room)], True, False
            # the transcript shows what the model read: the observation's tokens left after the cut
            said = [{"role": said[0]["role"], "text": self.tokenizer.decode(ids, skip_special_tokens=True), "cut": True}]
        episode.add(ids, None)
        episode.transcript += said

    def _render(self, episode: _EpisodeBuffer):
        """What the observation after the episode's last turn reads as (run by the runner within the step's deadline)."""
        stopped, room = episode.last_turn_stopped, self._room(episode)
        return lambda step: self.renderer.observation(step.messages, step.observation, stopped, room)

    def sample(self, prompts: list[list[int]], rows: list[dict], sampling: "Sampling") -> "Episodes":
        """B prompts (token ids) and their data rows -> Episodes with what the environment said, rows in order."""
        episodes, prompts = [_EpisodeBuffer() for _ in prompts], list(prompts)
        texts = [str(row.get("prompt", "")) for row in rows]
        for i, (episode, started) in enumerate(zip(episodes, self.runner.start_many([dict(row) for row in rows], texts))):
            if isinstance(started, BaseException):
                episode.fail(str(started))
                continue
            episode.environment = started
            first = started.first
            if first is not None and first.observation is not None:
                try:
                    prompts[i], observation = self.renderer.first(prompts[i], first.messages, first.observation, self._room(episode))
                except UserError as e:  # the template cannot follow a prompt with an observation (said at the start)
                    episode.fail(str(e))
                    continue
                self._observe(episode, observation)
                if not episode.running:  # nothing left for the model: an episode that trains nothing is a failure, not a silent 0
                    episode.fail(self._no_room_after_reset(texts[i]))
        device = None
        while True:
            running = [e for e in episodes if e.running]
            if not running:
                break
            budget = int(min(sampling.max_new_tokens, max(self._room(e) for e in running)))
            turn = self.engine.generate([prompts[i] + e.ids for i, e in enumerate(episodes) if e.running],
                                        replace(sampling, max_new_tokens=budget))
            device = turn.response_ids.device
            completions = [self._add_turn(e, turn, k) for k, e in enumerate(running)]
            steps = self.runner.step_many([e.environment for e in running], completions,
                                          [self._render(e) if e.turns < self.max_turns and not e.truncated else None for e in running])
            for e, step in zip(running, steps):
                self._answer(e, step)
        return self._collect(prompts, episodes, device)

    def _no_room_after_reset(self, prompt: str) -> str:
        from ppokit.environments.base import prompt_suffix

        # the observation was cut to the room before it was tokenised: its own length is not known, only that it fills it
        return (f"environment {self.runner.spec}: reset's observation fills the episode's whole budget (rollout.max_episode_tokens: "
                f"{self.max_episode_tokens} tokens after the prompt) and leaves no room for a model turn; shorten the observation or "
                f"raise rollout.max_episode_tokens{prompt_suffix(prompt)}")

    def _add_turn(self, episode: _EpisodeBuffer, turn: "Episodes", k: int) -> str:
        """Row k of one generate call is the episode's next model turn (cut to the room left) -> its text."""
        mask = turn.loss_mask[k]
        ids, logprobs = turn.response_ids[k][mask].tolist(), turn.logprobs[k][mask].tolist()
        room = self._room(episode)
        if len(ids) > room:
            ids, logprobs, episode.truncated = ids[: int(room)], logprobs[: int(room)], True
        episode.add(ids, logprobs)
        episode.turns += 1
        episode.last_turn_stopped = bool(turn.ended[k]) and not episode.truncated
        text = self.renderer.turn_text(ids, episode.last_turn_stopped)
        episode.transcript.append({"role": "assistant", "text": text})
        return text

    def _answer(self, episode: _EpisodeBuffer, step) -> None:
        """The environment's answer to the episode's last turn: its reward, and the next observation or the end."""
        if isinstance(step, BaseException):
            episode.fail(str(step))
            return
        episode.reward += step.reward
        episode.turn_ends.append((len(episode.ids) - 1, step.reward))
        episode.done = step.done
        episode.transcript[-1]["reward"] = step.reward  # the model's turn this step answered (`_add_turn`)
        if step.done:
            episode.transcript[-1]["done"] = True
        if step.done or episode.turns >= self.max_turns or episode.truncated:
            episode.running = False
            return
        if step.observation is not None:
            self._observe(episode, step.rendered)
        if episode.running and self._room(episode) <= 0:
            episode.truncated, episode.running = True, False

    def _collect(self, prompts: list[list[int]], episodes: list[_EpisodeBuffer], device) -> "Episodes":
        from ppokit.episodes import Episodes

        device = device if device is not None else torch.device("cpu")
        rows, width = len(prompts), max(len(p) for p in prompts)
        length = max(1, max(len(e.ids) for e in episodes))
        query = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        query_real = torch.zeros(rows, width, dtype=torch.bool)
        response = torch.full((rows, length), self.pad_token_id, dtype=torch.long)
        response_real = torch.zeros(rows, length, dtype=torch.bool)
        loss_mask = torch.zeros(rows, length, dtype=torch.bool)
        logprobs = torch.zeros(rows, length)
        turn_rewards = torch.zeros(rows, length)
        score_index = torch.zeros(rows, dtype=torch.long)
        for i, (prompt, e) in enumerate(zip(prompts, episodes)):
            query[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            query_real[i, width - len(prompt):] = True
            n = len(e.ids)
            if n:
                response[i, :n] = torch.tensor(e.ids, dtype=torch.long)
                response_real[i, :n] = True
                loss_mask[i, :n] = torch.tensor(e.trained)
                logprobs[i, :n] = torch.tensor(e.logprobs)
            trained = loss_mask[i].nonzero()
            score_index[i] = trained[-1, 0] if len(trained) else 0
            for column, reward in e.turn_ends:
                turn_rewards[i, column] += reward
        return Episodes(
            query_ids=query.to(device), response_ids=response.to(device),
            attention_mask=torch.cat([query_real, response_real], dim=1).to(device), loss_mask=loss_mask.to(device),
            logprobs=logprobs.to(device), ended=torch.tensor([e.done or (e.last_turn_stopped and not e.truncated) for e in episodes], device=device),
            score_index=score_index.to(device),
            environment_rewards=torch.tensor([math.nan if e.error else e.reward for e in episodes], dtype=torch.float64, device=device),
            turn_rewards=turn_rewards.to(device), turns=torch.tensor([e.turns for e in episodes], device=device),
            done=torch.tensor([e.done for e in episodes], device=device), truncated=torch.tensor([e.truncated for e in episodes], device=device),
            environment_errors=[e.error for e in episodes], transcripts=[e.transcript for e in episodes],
        )


class SingleTurn:
    """One prompt, one response: the rollout engine's own `generate` (no environment)."""

    def __init__(self, engine: "RolloutEngine"):
        self.engine = engine

    def sample(self, prompts: list[list[int]], rows: list[dict], sampling: "Sampling") -> "Episodes":
        return self.engine.generate(prompts, sampling)


@dataclass
class Conversation:
    """How a run's episodes are rendered and answered, decided before any weights load (`conversation_setup`):
    the renderer (prompts with the tools' schemas, observations as token ids), the environment's runner (None
    without one), and the chat template used (None: plain-text prompts)."""

    renderer: ConversationRenderer
    runner: Any = None
    template: Optional[str] = None

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """What ends a model turn, decided at start-up (ppo.stop_token, and a tool-calling turn's own token where the
        template ends it with another: `ConversationRenderer.check`): every purpose's sampling reads it."""
        return self.renderer.stop_token_ids


def conversation_setup(tokenizer, *, chat_template: Optional[str], template_kwargs: Optional[dict], datasets: list,
                       environment: Optional[str], environment_args: dict, timeout_s: Optional[float], max_turns: int,
                       stop_token_ids, base_dir=None, say=lambda message: None) -> Conversation:
    """The run's conversation, checked, and its chat prompts rendered (every `datasets` entry, None skipped): the
    environment is made (one instance, its arguments checked; it gets the template as `chat_template` if its
    constructor declares it), the renderer built with its tools, every rendering the episodes will need tried once
    (`ConversationRenderer.check`), then the prompts rendered with the tools' schemas. Every failure is one UserError
    line. chat_template: data.chat_template as configured; template_kwargs: data.chat_template_kwargs; stop_token_ids:
    ppo.stop_token's id(s) (the conversation's `stop_token_ids` may add one)."""
    from ppokit.chat import resolve_chat_template
    from ppokit.environments.base import EnvironmentRunner

    datasets = [d for d in datasets if d is not None]
    template = resolve_chat_template(tokenizer, chat_template) if any(d.chat is not None for d in datasets) else None
    runner = None
    if environment is not None:
        runner = EnvironmentRunner.from_config(environment, environment_args, timeout_s, base_dir, chat_template=template)
        for note in runner.notes:
            say(note)
        if runner.tools and template is None:
            raise UserError(f"environment {environment}: its tools reach the model as schemas the chat template writes into the "
                            f"prompt, and the prompts{' of ' + datasets[0].source if datasets else ''} are plain text; use chat prompts (a `messages` "
                            "column, or prompts as lists of messages) or, if the prompt text describes the tools itself, "
                            "environment_args.tool_schemas: none")
    renderer = ConversationRenderer(tokenizer, template, tools=runner.tools if runner else None, template_kwargs=template_kwargs,
                                    stop_token_ids=stop_token_ids, observation_role=runner.observation_role if runner else "user", say=say)
    if runner is not None:
        renderer.check(needs_tools=bool(runner.tools), max_turns=max_turns, what=f"environment {environment}")
        if renderer.first_observation_problem:
            say(renderer.first_observation_problem)
    for dataset in datasets:
        dataset.render_chat(renderer)
    return Conversation(renderer, runner, template)


def episode_source(engine: "RolloutEngine", conversation: Conversation, *, max_turns: int, max_episode_tokens: int, pad_token_id: int):
    """What the trainer samples its episodes from, decided once: without an environment the engine itself
    (`SingleTurn`); with one, the `MultiTurn` of at most `max_turns` turns (rollout.max_turns) within the episode's
    token budget (`PPOConfig.response_room`), observations rendered by the conversation's renderer."""
    if conversation.runner is None:
        return SingleTurn(engine)
    return MultiTurn(engine, conversation.renderer.tokenizer, conversation.runner, max_turns=max_turns,
                       max_episode_tokens=max_episode_tokens, pad_token_id=pad_token_id, renderer=conversation.renderer)


def data_rows(prompts: list[str], columns: dict[str, list]) -> list[dict]:
    """The data rows an environment's reset sees: the prompt and every other column."""
    return [{"prompt": prompt, **{name: values[i] for name, values in columns.items()}} for i, prompt in enumerate(prompts)]


def sample_row(row: dict, turns: Optional[list[dict]]) -> dict:
    """A samples.jsonl row with its episode's turns marked (`turns`), unchanged for a single-turn response."""
    return row if turns is None else {**row, "turns": turns}


class EnvironmentReward:
    """The environment as a reward source (`reward/environment`): each episode's summed step rewards.
    An episode whose environment failed fails here, with the environment's own one-line message, so
    `reward.on_error` applies to it as to any source (skip: that episode leaves the update)."""

    name = "environment"

    def score(self, batch) -> torch.Tensor:
        from ppokit.environments.base import EnvironmentFailure

        if batch.environment_rewards is None:
            raise EnvironmentFailure("the environment reward source was given a batch without environment rewards")
        failed = [error for error in batch.environment_errors or [] if error]
        if failed:
            raise EnvironmentFailure(failed[0])
        return torch.tensor(batch.environment_rewards, dtype=torch.float32)
