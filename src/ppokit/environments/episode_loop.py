"""The multi-turn episode loop: a rollout engine's model turns interleaved with an environment's answers.

    prompt [+ reset observation] -> model turn -> step -> observation -> model turn -> step -> ... -> done

One environment instance per episode. Every turn is ONE batched `engine.generate` call for all the
episodes still running (their contexts: prompt + everything so far, as token ids: model tokens are
never re-tokenised). An episode ends when its environment says done, after `max_turns` model turns,
or when its response region reaches `max_episode_tokens` (a model turn or an observation longer than
what is left is cut there, and the episode is marked truncated).

The result is one `Episodes` for the batch, in the layout of a single-turn rollout: the prompt in
query_ids (with chat data and a reset observation, without its generation prompt, which follows the
observation: `ObservationFormat.first`), everything after it (model turns and observations) in the response region; loss_mask is
True on the model's tokens only (observations are read, never trained on); score_index is the last
model token. What the environment said is in the same Episodes: each episode's summed step rewards, each step's
reward at the last token of its turn, the turns, done, truncated, failures and transcripts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from ppokit.engines.base import RolloutEngine, Sampling
    from ppokit.episodes import Episodes

class ObservationFormat:
    """How an observation becomes the tokens appended after a model turn.

    Plain text data: the observation's text as it is. Chat data (`chat_template` given): its messages
    (a `user` or `tool` message, `Step.messages`) rendered by the template as they follow an assistant
    message: the template's end-of-turn text, the messages, and the generation prompt for the next
    model turn. When the model's turn ended with the stop token and the end-of-turn text begins with
    it, the token is not written twice. `tools` (JSON schemas) go to the template as `tools=`.
    """

    def __init__(self, tokenizer, chat_template: Optional[str] = None, stop_token_id: Optional[int] = None,
                 tools: Optional[list[dict]] = None):
        self.tokenizer, self.chat_template, self.tools = tokenizer, chat_template, tools
        if chat_template is None:
            return
        self.turn = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
        self.before = self._render(self.turn, False)
        end_of_turn = self.before[self.before.rindex("A") + 1:]
        stop_text = tokenizer.decode([stop_token_id]) if stop_token_id is not None else None
        self.end_of_turn = end_of_turn
        self.end_of_stopped_turn = end_of_turn[len(stop_text):] if stop_text and end_of_turn.startswith(stop_text) else end_of_turn
        self.closed_prompt = self._render(self.turn[:1], False)
        self.generation_prompt = self._render(self.turn[:1], True)[len(self.closed_prompt):]

    def _render(self, messages: list[dict], generation: bool) -> str:
        extra = {"tools": self.tools} if self.tools else {}
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, add_generation_prompt=generation,
                                                  tokenize=False, **extra)

    def text(self, observation: str, messages: Optional[list[dict]] = None, turn_stopped: bool = True) -> str:
        """The text appended after a model turn (turn_stopped: it ended with the stop token)."""
        if self.chat_template is None:
            return observation
        after = self._render(self.turn + (messages or [{"role": "user", "content": observation}]), True)
        if not after.startswith(self.before):
            raise ValueError("the chat template does not render an observation after an assistant turn as a continuation "
                             "(set data.chat_template=plain or another template)")
        return (self.end_of_stopped_turn if turn_stopped else self.end_of_turn) + after[len(self.before):]

    def ids(self, observation: str, messages: Optional[list[dict]] = None, turn_stopped: bool = True) -> list[int]:
        return self.tokenizer(self.text(observation, messages, turn_stopped), add_special_tokens=False)["input_ids"]

    def first(self, prompt: list[int], observation: str, messages: Optional[list[dict]] = None) -> tuple[list[int], list[int]]:
        """reset's observation after a prompt (token ids) -> (the prompt's ids, the ids appended after them).

        Plain text: the prompt as it is, the observation's text after it. Chat data: the observation is the
        next user (or tool) message of the prompt's conversation, so that prompt + observation is what the
        template renders for [prompt's messages..., observation's messages] with the generation prompt:
        the prompt's own generation prompt (its last tokens) moves after the observation."""
        ids = lambda text: self.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        if self.chat_template is None:
            return prompt, ids(observation)
        rendered = self._render(self.turn[:1] + (messages or [{"role": "user", "content": observation}]), True)
        generation = ids(self.generation_prompt) if self.generation_prompt else []
        if not rendered.startswith(self.closed_prompt) or prompt[len(prompt) - len(generation):] != generation:
            raise ValueError("the chat template does not render a first observation after the prompt as a continuation "
                             "(set data.chat_template=plain or another template)")
        return prompt[: len(prompt) - len(generation)], ids(rendered[len(self.closed_prompt):])


@dataclass
class _Episode:
    """One episode while it runs: its token ids after the prompt, which of them are the model's."""

    environment: Any = None  # the runner's EnvironmentEpisode
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
    transcript: list[dict] = field(default_factory=list)  # the turns as text: the model's decoded, the environment's as it said them

    def add(self, ids: list[int], logprobs: Optional[list[float]]) -> None:
        self.ids += ids
        self.trained += [logprobs is not None] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def fail(self, message: str) -> None:
        self.error, self.running = message, False


class EpisodeLoop:
    """Runs batches of multi-turn episodes over a rollout engine (see the module docstring).

    runner: makes and calls the environments (`ppokit.environments.EnvironmentRunner`: start_many(rows,
    prompts) -> per row an episode with `.first` (a Step) or the exception it failed with;
    step_many(episodes, completions) -> per episode a Step (observation, reward, done, messages) or an
    exception). max_episode_tokens: the response region's budget (model turns + observations).
    observation: how observations become tokens (plain text by default).
    """

    def __init__(
        self, engine: "RolloutEngine", tokenizer, runner, *, max_turns: int, max_episode_tokens: Optional[int],
        pad_token_id: int, observation: Optional[ObservationFormat] = None,
    ):
        self.engine, self.tokenizer, self.runner = engine, tokenizer, runner
        self.max_turns, self.max_episode_tokens, self.pad_token_id = max_turns, max_episode_tokens, pad_token_id
        self.observation = observation or ObservationFormat(tokenizer)

    def _room(self, episode: _Episode) -> float:
        return math.inf if self.max_episode_tokens is None else self.max_episode_tokens - len(episode.ids)

    def _observe(self, episode: _Episode, step, turn_stopped: bool, ids: Optional[list[int]] = None) -> None:
        """Append an observation (its `ids` when given: reset's, `ObservationFormat.first`), cut to the room left
        (the episode then ends, truncated)."""
        if step.observation is None:
            return
        if ids is None:
            ids = self.observation.ids(step.observation, step.messages, turn_stopped)
        said = [{"role": m.get("role", "user"), "text": str(m.get("content", ""))} for m in step.messages] or \
            [{"role": "user", "text": step.observation}]
        room = self._room(episode)
        if len(ids) >= room:
            ids, episode.truncated, episode.running = ids[: int(room)], True, False
            # the transcript shows what the model read: the observation's tokens left after the cut
            said = [{"role": said[0]["role"], "text": self.tokenizer.decode(ids, skip_special_tokens=True), "cut": True}]
        episode.add(ids, None)
        episode.transcript += said

    def sample(self, prompts: list[list[int]], rows: list[dict], sampling: "Sampling") -> "Episodes":
        """B prompts (token ids) and their data rows -> Episodes with what the environment said, rows in order."""
        episodes, prompts = [_Episode() for _ in prompts], list(prompts)
        texts = [str(row.get("prompt", "")) for row in rows]
        for i, (episode, started) in enumerate(zip(episodes, self.runner.start_many([dict(row) for row in rows], texts))):
            if isinstance(started, BaseException):
                episode.fail(str(started))
                continue
            episode.environment = started
            if started.first is not None and started.first.observation is not None:
                prompts[i], ids = self.observation.first(prompts[i], started.first.observation, started.first.messages)
                self._observe(episode, started.first, turn_stopped=True, ids=ids)
                if not episode.running:  # nothing left for the model: an episode that trains nothing is a failure, not a silent 0
                    episode.fail(self._no_room_after_reset(len(ids), texts[i]))
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
            steps = self.runner.step_many([e.environment for e in running], completions)
            for e, step in zip(running, steps):
                self._answer(e, step)
        return self._collect(prompts, episodes, device)

    def _no_room_after_reset(self, tokens: int, prompt: str) -> str:
        from ppokit.environments.base import prompt_suffix

        return (f"environment {self.runner.spec}: reset's observation is {tokens} tokens, which fills the episode's budget "
                f"(rollout.max_episode_tokens: {self.max_episode_tokens} tokens after the prompt) and leaves no room for a model "
                f"turn; shorten the observation or raise rollout.max_episode_tokens{prompt_suffix(prompt)}")

    def _add_turn(self, episode: _Episode, turn: "Episodes", k: int) -> str:
        """Row k of one generate call is the episode's next model turn (cut to the room left) -> its text."""
        mask = turn.loss_mask[k]
        ids, logprobs = turn.response_ids[k][mask].tolist(), turn.logprobs[k][mask].tolist()
        room = self._room(episode)
        if len(ids) > room:
            ids, logprobs, episode.truncated = ids[: int(room)], logprobs[: int(room)], True
        episode.add(ids, logprobs)
        episode.turns += 1
        episode.last_turn_stopped = bool(turn.ended[k]) and not episode.truncated
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        episode.transcript.append({"role": "assistant", "text": text})
        return text

    def _answer(self, episode: _Episode, step) -> None:
        """The environment's answer to the episode's last turn: its reward, and the next observation or the end."""
        if isinstance(step, BaseException):
            episode.fail(str(step))
            return
        episode.reward += step.reward
        episode.turn_ends.append((len(episode.ids) - 1, step.reward))
        episode.done = step.done
        if step.done or episode.turns >= self.max_turns or episode.truncated:
            episode.running = False
            return
        self._observe(episode, step, episode.last_turn_stopped)
        if episode.running and self._room(episode) <= 0:
            episode.truncated, episode.running = True, False

    def _collect(self, prompts: list[list[int]], episodes: list[_Episode], device) -> "Episodes":
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


def episode_source(engine: "RolloutEngine", tokenizer, *, environment: Optional[str], environment_args: dict,
                   timeout_s: Optional[float], rollout, response_length: int, pad_token_id: int, stop_token_id: Optional[int],
                   chat_template: Optional[str], base_dir=None):
    """What the trainer samples its episodes from, decided once: without an environment the engine itself
    (`SingleTurn`); with one, the `EpisodeLoop` over the `rollout:` section's turns and budget
    (max_episode_tokens, default max_turns x response_length); observations rendered by `chat_template`
    when the prompts were chats, else as plain text."""
    if environment is None:
        return SingleTurn(engine)
    from ppokit.environments.base import EnvironmentRunner

    runner = EnvironmentRunner.from_config(environment, environment_args, timeout_s, base_dir)
    budget = response_room(rollout, environment, response_length)
    observation = ObservationFormat(tokenizer, chat_template, stop_token_id, runner.tools)
    return EpisodeLoop(engine, tokenizer, runner, max_turns=rollout.max_turns, max_episode_tokens=budget, pad_token_id=pad_token_id,
                       observation=observation)


def response_room(rollout, environment: Optional[str], response_length: int) -> int:
    """Tokens after the prompt an episode may take: ppo.response_length for one response; with an environment
    rollout.max_episode_tokens (default max_turns x response_length). What the budget and position checks use."""
    if environment is None:
        return response_length
    return rollout.max_episode_tokens if rollout.max_episode_tokens is not None else rollout.max_turns * response_length


def turn_weight(rollout, reward) -> Optional[float]:
    """The environment's weight when its step rewards are placed per turn (rollout.turn_rewards: `experience.rewards`),
    else None.
    Moving them is exact only while the score is a plain weighted sum: a normalised environment source or
    reward.clip_range with turn rewards is refused."""
    if not rollout.turn_rewards:
        return None
    from ppokit.errors import UserError

    normalize = reward.normalize[-1] if isinstance(reward.normalize, list) else reward.normalize
    if normalize or reward.clip_range is not None:
        which = "reward.normalize on the environment" if normalize else "reward.clip_range"
        raise UserError(f"rollout.turn_rewards places each step reward at its turn, which needs the score to be a plain weighted "
                        f"sum; {which} changes it as a whole; turn one of them off")
    return float(reward.weights[-1]) if reward.weights is not None else 1.0


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
