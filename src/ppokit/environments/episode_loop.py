"""The multi-turn episode loop: a rollout engine's model turns interleaved with an environment's answers.

    prompt [+ reset observation] -> model turn -> step -> observation -> model turn -> step -> ... -> done

One environment instance per episode. Every turn is ONE batched `engine.generate` call for all the
episodes still running (their contexts: prompt + everything so far, as token ids: model tokens are
never re-tokenised). An episode ends when its environment says done, after `max_turns` model turns,
or when its response region reaches `max_episode_tokens` (a model turn or an observation longer than
what is left is cut there, and the episode is marked truncated).

The result is one `Episodes` for the batch, in the layout of a single-turn rollout: the prompt in
query_ids, everything after it (model turns and observations) in the response region; loss_mask is
True on the model's tokens only (observations are read, never trained on); score_index is the last
model token. What the environment said (rewards per step and their sum, failures, metrics) comes
back beside it in an `EpisodeOutcome`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

if TYPE_CHECKING:
    from ppokit.engines.base import RolloutEngine, Sampling
    from ppokit.episodes import Episodes

# A stand-in for an observation's text while the chat template renders the message around it.
_MARK = "\u2063OBSERVATION\u2063"


class ObservationFormat:
    """How an observation's text becomes the tokens appended after a model turn.

    Plain text data: the observation as it is. Chat data (`chat_template` given): a `role` message
    (user, or tool) rendered by the template, with what the template writes between an assistant
    message and the next one (its end-of-turn text), and the generation prompt for the next model
    turn. When the model's turn ended with the stop token and the template's end-of-turn text begins
    with that token, the token is not written twice.
    """

    def __init__(self, tokenizer, chat_template: Optional[str] = None, role: str = "user", stop_token_id: Optional[int] = None):
        self.tokenizer = tokenizer
        self.chat = chat_template is not None
        if not self.chat:
            return
        render = lambda messages, generation: tokenizer.apply_chat_template(  # noqa: E731
            messages, chat_template=chat_template, add_generation_prompt=generation, tokenize=False)
        turn = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
        before = render(turn, False)
        after = render(turn + [{"role": role, "content": _MARK}], True)
        if not after.startswith(before) or _MARK not in after:
            raise ValueError("the chat template does not render an observation after an assistant turn as a continuation")
        end_of_turn = before[before.rindex("A") + 1:]
        self.open, self.close = after[len(before):].split(_MARK)
        self.end_of_turn = end_of_turn
        stop_text = tokenizer.decode([stop_token_id]) if stop_token_id is not None else None
        self.end_of_stopped_turn = end_of_turn[len(stop_text):] if stop_text and end_of_turn.startswith(stop_text) else end_of_turn

    def text(self, observation: str, turn_stopped: bool = True) -> str:
        """The text appended after a model turn (turn_stopped: it ended with the stop token)."""
        if not self.chat:
            return observation
        return (self.end_of_stopped_turn if turn_stopped else self.end_of_turn) + self.open + observation + self.close

    def ids(self, observation: str, turn_stopped: bool = True) -> list[int]:
        return self.tokenizer(self.text(observation, turn_stopped), add_special_tokens=False)["input_ids"]


@dataclass
class EpisodeOutcome:
    """What the environments said about a batch of B episodes (R: the Episodes' response columns)."""

    rewards: torch.Tensor  # (B,) float64: the sum of each episode's step rewards; NaN where it failed
    turn_rewards: torch.Tensor  # (B, R) float32: each step's reward at the last token of the turn that earned it
    errors: list[Optional[str]]  # one line per failed episode (the environment raised, timed out, or returned a bad reward)
    turns: list[int]  # model turns per episode
    done: list[bool]  # the environment said done
    truncated: list[bool]  # cut by rollout.max_episode_tokens
    model_tokens: list[int]
    observation_tokens: list[int]
    metrics: dict[str, float] = field(default_factory=dict)


def direct_call(fn: Callable, *args):
    return fn(*args)


@dataclass
class _Episode:
    """One episode while it runs: its token ids after the prompt, which of them are the model's."""

    environment: Any = None
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

    def add(self, ids: list[int], logprobs: Optional[list[float]]) -> None:
        self.ids += ids
        self.trained += [logprobs is not None] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def fail(self, message: str) -> None:
        self.error, self.running = message, False


def check_step(result: Any, name: str) -> tuple[Optional[str], float, bool]:
    """An environment's `step` result -> (observation, reward, done), or a ValueError naming what is wrong."""
    if not isinstance(result, tuple) or len(result) != 3:
        raise ValueError(f"{name}.step returned {type(result).__name__}, expected a tuple (observation, reward, done)")
    observation, reward, done = result
    if observation is not None and not isinstance(observation, str):
        raise ValueError(f"{name}.step returned an observation of type {type(observation).__name__}, expected str or None")
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise ValueError(f"{name}.step returned the reward {reward!r}, expected a finite number")
    return observation, float(reward), bool(done)


class EpisodeLoop:
    """Runs batches of multi-turn episodes over a rollout engine (see the module docstring).

    make_environment: a new environment for one episode (`reset(row)`, `step(completion)`).
    name: how errors name the environment (its spec). call(fn, *args): how environment code is
    called (e.g. in a thread under a timeout); it raises what fn raises. max_episode_tokens: the
    response region's budget (model turns + observations); None: only max_turns bounds it.
    describe(row): how an error names an episode (default: its prompt).
    """

    def __init__(
        self, engine: "RolloutEngine", tokenizer, make_environment: Callable[[], Any], *, name: str, max_turns: int,
        max_episode_tokens: Optional[int], pad_token_id: int, observation: Optional[ObservationFormat] = None,
        call: Callable = direct_call,
    ):
        self.engine, self.tokenizer, self.make_environment, self.name = engine, tokenizer, make_environment, name
        self.max_turns, self.max_episode_tokens, self.pad_token_id = max_turns, max_episode_tokens, pad_token_id
        self.observation = observation or ObservationFormat(tokenizer)
        self.call = call

    def _room(self, episode: _Episode) -> float:
        return math.inf if self.max_episode_tokens is None else self.max_episode_tokens - len(episode.ids)

    def _observe(self, episode: _Episode, text: Optional[str], turn_stopped: bool) -> None:
        """Append an observation, cut to the room left (the episode then ends, truncated)."""
        if text is None:
            return
        ids = self.observation.ids(text, turn_stopped) if episode.turns else self.tokenizer(text, add_special_tokens=False)["input_ids"]
        room = self._room(episode)
        if len(ids) >= room:
            ids, episode.truncated, episode.running = ids[: int(room)], True, False
        episode.add(ids, None)

    def run(self, prompts: list[list[int]], rows: list[dict], sampling: "Sampling") -> tuple["Episodes", EpisodeOutcome]:
        """B prompts (token ids) and their data rows -> (Episodes, EpisodeOutcome), rows in order."""
        episodes = [_Episode() for _ in prompts]
        for episode, row in zip(episodes, rows):
            try:
                episode.environment = self.call(self.make_environment)
                first = self.call(episode.environment.reset, row)
                if first is not None and not isinstance(first, str):
                    raise ValueError(f"{self.name}.reset returned {type(first).__name__}, expected str or None")
            except Exception as e:  # the user's code: its failure is this episode's, named with its prompt
                episode.fail(self._failure(e, row))
                continue
            self._observe(episode, first, turn_stopped=True)
        device = None
        while True:
            running = [i for i, e in enumerate(episodes) if e.running]
            if not running:
                break
            rooms = [self._room(episodes[i]) for i in running]
            budget = int(min(sampling.max_new_tokens, max(rooms)))
            turn = self.engine.generate([prompts[i] + episodes[i].ids for i in running], replace(sampling, max_new_tokens=budget))
            device = turn.response_ids.device
            for k, i in enumerate(running):
                self._take_turn(episodes[i], turn, k, rows[i])
        return self._collect(prompts, episodes, device)

    def _take_turn(self, episode: _Episode, turn: "Episodes", k: int, row: dict) -> None:
        mask = turn.loss_mask[k]
        ids, logprobs = turn.response_ids[k][mask].tolist(), turn.logprobs[k][mask].tolist()
        room = self._room(episode)
        cut = len(ids) > room
        if cut:
            ids, logprobs = ids[: int(room)], logprobs[: int(room)]
        stopped = bool(turn.ended[k]) and not cut
        episode.add(ids, logprobs)
        episode.turns += 1
        episode.last_turn_stopped = stopped
        try:
            completion = self.tokenizer.decode(ids, skip_special_tokens=True)
            observation, reward, done = check_step(self.call(episode.environment.step, completion), self.name)
        except Exception as e:
            episode.fail(self._failure(e, row))
            return
        episode.reward += reward
        episode.turn_ends.append((len(episode.ids) - 1, reward))
        episode.done = done
        if done or episode.turns >= self.max_turns:
            episode.running = False
        elif cut or self._room(episode) <= 0:
            episode.truncated, episode.running = True, False
        else:
            self._observe(episode, observation, stopped)
            if episode.running and self._room(episode) <= 0:
                episode.truncated, episode.running = True, False

    def _failure(self, error: Exception, row: dict) -> str:
        prompt = str(row.get("prompt", ""))
        shown = prompt if len(prompt) <= 80 else prompt[:77] + "..."
        detail = str(error) if isinstance(error, ValueError) and str(error).startswith(self.name) else f"{self.name} raised {type(error).__name__}: {error}"
        return f"{detail} (episode with prompt {shown!r})"

    def _collect(self, prompts: list[list[int]], episodes: list[_Episode], device) -> tuple["Episodes", EpisodeOutcome]:
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
        batch = Episodes(
            query_ids=query.to(device), response_ids=response.to(device),
            attention_mask=torch.cat([query_real, response_real], dim=1).to(device), loss_mask=loss_mask.to(device),
            logprobs=logprobs.to(device), ended=torch.tensor([e.done or (e.last_turn_stopped and not e.truncated) for e in episodes], device=device),
            score_index=score_index.to(device),
        )
        model_tokens = [sum(e.trained) for e in episodes]
        observation_tokens = [len(e.ids) - m for e, m in zip(episodes, model_tokens)]
        outcome = EpisodeOutcome(
            rewards=torch.tensor([math.nan if e.error else e.reward for e in episodes], dtype=torch.float64),
            turn_rewards=turn_rewards.to(device), errors=[e.error for e in episodes], turns=[e.turns for e in episodes],
            done=[e.done for e in episodes], truncated=[e.truncated for e in episodes],
            model_tokens=model_tokens, observation_tokens=observation_tokens,
        )
        outcome.metrics = episode_metrics(outcome)
        return batch, outcome


def episode_metrics(outcome: EpisodeOutcome) -> dict[str, float]:
    """Means per episode over one batch (this process's episodes)."""
    n = max(1, len(outcome.turns))
    return {
        "rollout/turns": sum(outcome.turns) / n,
        "rollout/model_tokens": sum(outcome.model_tokens) / n,
        "rollout/observation_tokens": sum(outcome.observation_tokens) / n,
        "rollout/truncated": sum(outcome.truncated) / n,
        "env/done_rate": sum(outcome.done) / n,
    }
