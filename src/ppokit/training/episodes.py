"""Episodes: the batch container that carries one update's sampled sequences through every stage.

Three masks, each with one meaning (a reader uses the one it means):

    attention_mask (B, P + R)  the real tokens: what every forward reads
    loss_mask      (B, R)      the tokens the policy produced and is trained on (policy loss, KL
                               penalty, advantages, value targets): a subset of the real response
                               tokens, possibly several spans per row (a multi-turn episode's model
                               turns, with observation tokens between them read but not trained on)
    valid          (B,)        the rows in the update (False: a reward source failed on the row
                               under reward.on_error=skip, or its episode failed)

`trained_mask` = loss_mask & valid is what the losses, advantages and their statistics average over.

Layout: P prompt columns, left-padded; R response columns, right-padded. A row's real tokens are
contiguous (prompt at the right of its columns, then the response region from the first response
column), which is what packing (`ppokit.training.batching.pack`) relies on. A packed micro-batch keeps that
meaning with the split moved: W - R' prompt columns, R' response columns, and a prompt may reach
into the response columns (attention_mask says which columns are real).

What an environment said (multi-turn episodes; None without one) rides in the same object: each episode's summed
step rewards, each step's reward at the last token of the turn that earned it, the turns, done, truncated, the
failures and the transcripts. Stage 2 scores from them, stage 4 places the turn rewards (`experience.rewards`).

Segment rows: an agent's episode whose calls made several segments (docs/agents.md) is sampled and scored as one row,
its last segment, with the earlier ones in `earlier_segments`; after scoring `with_segment_rows` appends one row per
earlier segment (rows E.. in the episodes' order, each episode's in call order), `episode_index` naming each row's
episode. Rows [0, E) stay the episodes, in the group layout below; scores sit on them only.

Group layout: with n = ppo.num_samples_per_prompt, the n samples of a prompt are adjacent rows, so
rows [g * n, (g + 1) * n) answer prompt g and B = prompts x n. The group estimators read groups from
this layout; only the optimisation epochs shuffle rows, after the advantages are computed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Any, Optional

import torch


@dataclass
class Episodes:
    """One batch of episodes, filled in stages: a rollout engine fills the first seven fields (the episode loop
    the environment's too); scoring `scores` (and `baseline_scores` for an estimator with a greedy baseline) and
    `valid`; the reference and value passes `ref_logprobs` and `values` (and a teacher's `teacher_logprobs`); shaping and the advantage estimator the
    rest. Without a critic `values` and `returns` stay None; without an environment its fields do. Per-token
    fields are 0 outside `loss_mask`."""

    query_ids: torch.Tensor  # (B, P) long, left-padded
    response_ids: torch.Tensor  # (B, R) long: model turns (and observations between them), right-padded
    attention_mask: torch.Tensor  # (B, P + R) bool, True on every real token
    loss_mask: torch.Tensor  # (B, R) bool, True on the tokens the policy is trained on
    logprobs: torch.Tensor  # (B, R) float, the policy's logprobs (logits / temperature) of the loss tokens
    ended: torch.Tensor  # (B,) bool, True where the episode ended by itself (the stop token, the environment)
    score_index: torch.Tensor  # (B,) long, the response column that receives the score (single-turn: the last loss token)
    valid: Optional[torch.Tensor] = None  # (B,) bool, rows in the update; None: all of them
    ref_logprobs: Optional[torch.Tensor] = None  # (B, R) float, reference policy's logprobs
    teacher_logprobs: Optional[torch.Tensor] = None  # (B, R) float, the teacher's logprobs (on-policy distillation: `teacher`)
    values: Optional[torch.Tensor] = None  # (B, R) float, value of the state before each token
    scores: Optional[torch.Tensor] = None  # (B,) float, combined reward-source score per episode
    baseline_scores: Optional[torch.Tensor] = None  # (B,) float, the greedy response's score (a greedy-baseline estimator)
    rewards: Optional[torch.Tensor] = None  # (B, R) float, per-token reward (KL penalty + score)
    advantages: Optional[torch.Tensor] = None  # (B, R) float, the estimator's advantages
    returns: Optional[torch.Tensor] = None  # (B, R) float, value targets (critic estimators only)
    rollout_is_weights: Optional[torch.Tensor] = None  # (B, R) float, ppo.rollout_is's truncated importance weights
    weight_version: Optional[torch.Tensor] = None  # (B,) long, the weights that sampled each episode, in updates (rollout.max_staleness)
    # What the environment said (multi-turn episodes), None without one:
    environment_rewards: Optional[torch.Tensor] = None  # (B,) float64, the sum of each episode's step rewards; NaN where it failed
    turn_rewards: Optional[torch.Tensor] = None  # (B, R) float, each step's reward at the last token of the turn that earned it
    turns: Optional[torch.Tensor] = None  # (B,) long, model turns
    done: Optional[torch.Tensor] = None  # (B,) bool, the environment said done
    truncated: Optional[torch.Tensor] = None  # (B,) bool, cut by rollout.max_episode_tokens
    environment_errors: Optional[list[Optional[str]]] = None  # one line per failed episode (raised, timed out, a bad value)
    transcripts: Optional[list[list[dict[str, Any]]]] = None  # per episode its turns as text: {"role": assistant|user|tool, "text"}
    environments: Optional[list[Optional[str]]] = None  # per episode the name of the environment its row chose (several in a run)
    agent_numbers: Optional[list[dict[str, float]]] = None  # an agent program's episodes: each one's agent/* numbers (calls, segments, ...)
    # An agent's episodes of several segments (`with_segment_rows`), None otherwise:
    earlier_segments: Optional[list[list["SegmentRow"]]] = None  # per episode the segments before its last, in call order
    episode_index: Optional[torch.Tensor] = None  # (B,) long, each row's episode: rows [0, E) the episodes (their last segments)
    row_share: Optional[torch.Tensor] = None  # (B,) float, each row's share of its episode's trained tokens (the optimisation's)

    @property
    def input_ids(self) -> torch.Tensor:
        """(B, P + R) prompt and response."""
        return torch.cat([self.query_ids, self.response_ids], dim=1)

    @property
    def query_mask(self) -> torch.Tensor:
        """(B, P) bool, the real tokens of the prompt columns."""
        return self.attention_mask[:, : self.query_ids.shape[1]]

    @property
    def rows_valid(self) -> torch.Tensor:
        """(B,) bool: `valid`, all True while no stage has dropped a row."""
        if self.valid is None:
            return torch.ones(self.query_ids.shape[0], dtype=torch.bool, device=self.query_ids.device)
        return self.valid

    @property
    def trained_mask(self) -> torch.Tensor:
        """(B, R) bool: loss tokens of the rows in the update."""
        return self.loss_mask & self.rows_valid.unsqueeze(1)

    @property
    def model_tokens(self) -> torch.Tensor:
        """(B,) long: the tokens the policy produced (every model turn)."""
        return self.loss_mask.sum(1)

    @property
    def observation_tokens(self) -> torch.Tensor:
        """(B,) long: the real response tokens that are not the model's (an environment's observations)."""
        return self.attention_mask[:, self.query_ids.shape[1]:].sum(1) - self.model_tokens

    @property
    def is_episode(self) -> torch.Tensor:
        """(B,) bool: the rows that stand for an episode (its last segment): all of them but an agent's earlier segments."""
        rows = torch.arange(self.query_ids.shape[0], device=self.query_ids.device)
        return torch.ones_like(rows, dtype=torch.bool) if self.episode_index is None else self.episode_index == rows

    def per_row(self, value: torch.Tensor) -> torch.Tensor:
        """(E,) per episode -> (B,) per row, each row its episode's (the same tensor with one row per episode)."""
        return value if self.episode_index is None else value[self.episode_index.to(value.device)]

    def select(self, index: torch.Tensor) -> "Episodes":
        """Rows `index` of every filled field."""
        return Episodes(**{f.name: _rows(getattr(self, f.name), index) for f in fields(self)})

    def __len__(self) -> int:
        return self.query_ids.shape[0]


def concat(parts: list["Episodes"], pad_token_id: int) -> "Episodes":
    """Episodes of several rollouts as one, rows in order (dynamic sampling's rounds): the prompt columns left-padded
    and the response columns right-padded to the widest (pad_token_id; masks False, other values 0), so every row keeps
    its layout and its score position. A field is None in the result where it is None in every part."""
    prompt = max(p.query_ids.shape[1] for p in parts)
    response = max(p.response_ids.shape[1] for p in parts)

    def widened(value: torch.Tensor, width: int, left: bool, fill) -> torch.Tensor:
        room = width - value.shape[1]
        pad = torch.full((value.shape[0], room), fill, dtype=value.dtype, device=value.device)
        return torch.cat([pad, value] if left else [value, pad], dim=1)

    joined = {}
    for f in fields(Episodes):
        values = [getattr(p, f.name) for p in parts]
        if all(v is None for v in values):
            joined[f.name] = None
        elif not isinstance(values[0], torch.Tensor):
            joined[f.name] = [item for v in values for item in v]
        elif f.name == "query_ids":
            joined[f.name] = torch.cat([widened(v, prompt, True, pad_token_id) for v in values])
        elif f.name == "attention_mask":
            joined[f.name] = torch.cat([torch.cat([widened(v[:, : p.query_ids.shape[1]], prompt, True, False),
                                                   widened(v[:, p.query_ids.shape[1]:], response, False, False)], dim=1)
                                        for v, p in zip(values, parts)])
        elif values[0].dim() == 2:
            fill = pad_token_id if f.name == "response_ids" else 0
            joined[f.name] = torch.cat([widened(v, response, False, fill) for v in values])
        else:
            joined[f.name] = torch.cat(values)
    return Episodes(**joined)


def _rows(value, index: torch.Tensor):
    """Rows `index` of a (B, ...) tensor or a list of B items; None stays None."""
    if value is None or isinstance(value, torch.Tensor):
        return None if value is None else value[index]
    return [value[i] for i in index.tolist()]


def repeat_each(items: list, n: int) -> list:
    """[a, b] -> [a, a, b, b] for n = 2: the n samples of each prompt in adjacent rows (the group layout)."""
    return [item for item in items for _ in range(n)]


@dataclass
class Span:
    """A stretch of an episode's tokens after its prompt: a model turn (`logprobs` given, one per token: trained on)
    or what the model read (an observation: `logprobs` None). `reward`: the environment's step reward for a model
    turn, placed at its last token (`turn_rewards`)."""

    ids: list[int]
    logprobs: Optional[list[float]] = None
    reward: float = 0.0


@dataclass
class SegmentRow:
    """An agent's segment before the last of its episode, trained as a row of its own: its prompt and its spans."""

    prompt: list[int]
    spans: list[Span]


def with_segment_rows(episodes: Episodes, pad_token_id: int) -> Episodes:
    """The episodes with each earlier segment of an agent's episode (`earlier_segments`) appended as a row of its own
    (module docstring): its prompt, its model turns trained and observations read, no score (0: the episode's sits on
    its last segment), the episode's valid, ended, weight version, failure and agent numbers; `episode_index` (B,) set.
    Episodes without earlier segments are returned as they are (episode_index None)."""
    earlier = episodes.earlier_segments
    owners = [e for e, segments in enumerate(earlier or []) for _ in segments]
    if not owners:
        return episodes
    segments = [segment for per_episode in earlier for segment in per_episode]
    said = None if episodes.turns is None else [EnvironmentSaid(done=False, truncated=False) for _ in segments]
    extra = pack([s.prompt for s in segments], [s.spans for s in segments], [True] * len(segments), pad_token_id,
                 episodes.query_ids.device, said)
    index = torch.tensor(owners, dtype=torch.long, device=episodes.query_ids.device)
    for f in fields(Episodes):
        mine, theirs = getattr(episodes, f.name), getattr(extra, f.name)
        if mine is None or f.name == "earlier_segments":
            setattr(extra, f.name, None)
        elif f.name in ("scores", "environment_rewards"):
            setattr(extra, f.name, torch.zeros(len(owners), dtype=mine.dtype, device=mine.device))
        elif theirs is None or f.name in ("ended", "environment_errors", "environments", "agent_numbers"):
            setattr(extra, f.name, _rows(mine, index))
    episodes = dataclasses.replace(episodes, earlier_segments=None)
    joined = concat([episodes, extra], pad_token_id)
    joined.episode_index = torch.cat([torch.arange(len(episodes), device=index.device), index])
    return joined


@dataclass
class EnvironmentSaid:
    """What an environment said of one episode besides its step rewards (`pack`'s `environment`)."""

    done: bool  # it said done
    truncated: bool  # cut by rollout.max_episode_tokens
    error: Optional[str] = None  # the one line of its failure (raised, timed out, a bad value); the episode is out
    transcript: list[dict[str, Any]] = field(default_factory=list)  # its turns as text: {"role", "text"}
    environment: Optional[str] = None  # the name of the environment its row chose, among several; None: one
    numbers: dict[str, float] = field(default_factory=dict)  # an agent program's episode: its agent/* numbers
    earlier: list[SegmentRow] = field(default_factory=list)  # an agent program's episode: its segments before the last


def pack(prompts: list[list[int]], spans: list[list[Span]], ended: list[bool], pad_token_id: int, device=None,
         environment: Optional[list[EnvironmentSaid]] = None) -> Episodes:
    """The one function that builds Episodes: B prompts (token ids), each episode's spans after its prompt (model turns
    and observations, in order) and whether it ended by itself -> Episodes with prompts left-padded and the spans
    right-padded with pad_token_id, every span token real (attention_mask), the model's tokens trained on (loss_mask)
    with their logprobs (0 elsewhere), the score at the last model token (0 in a row without one).

    environment: per episode what its environment said (None: no environment; its fields stay None): the episode's
    summed step rewards (NaN where it failed), each step's reward at the last token of its turn, the model turns, done,
    truncated, the failures and the transcripts. A one-turn rollout is one model span per prompt."""
    from ppokit.training import algo
    from ppokit.models.forwards import left_pad

    query_ids, query_mask = left_pad(prompts, pad_token_id)
    rows, width = len(spans), max(1, max(sum(len(s.ids) for s in row) for row in spans))
    # each row's columns as Python lists, made tensors at once (a tensor op per span costs more than the spans' work)
    ids, real, trained, logprobs = [], [], [], []
    rewards: dict[tuple[int, int], float] = {}  # (row, column) -> the step rewards ending there
    for row, row_spans in enumerate(spans):
        row_ids, row_trained, row_logprobs = [], [], []
        for span in row_spans:
            row_ids += span.ids
            model = span.logprobs is not None
            row_trained += [model] * len(span.ids)
            row_logprobs += span.logprobs if model else [0.0] * len(span.ids)
            if model:
                at = (row, max(len(row_ids) - 1, 0))
                # a second reward at one token (after an empty turn) adds in float32, as a tensor's += would
                rewards[at] = span.reward if at not in rewards else (torch.tensor(rewards[at], dtype=torch.float32) + span.reward).item()
        room = width - len(row_ids)
        ids.append(row_ids + [pad_token_id] * room)
        real.append([True] * len(row_ids) + [False] * room)
        trained.append(row_trained + [False] * room)
        logprobs.append(row_logprobs + [0.0] * room)
    response_ids = torch.tensor(ids, dtype=torch.long)
    response_mask = torch.tensor(real, dtype=torch.bool)
    loss_mask = torch.tensor(trained, dtype=torch.bool)
    token_logprobs = torch.tensor(logprobs, dtype=torch.float32)
    turn_rewards = torch.zeros((rows, width), dtype=torch.float32)
    if rewards:
        turn_rewards[tuple(torch.tensor(list(rewards)).T)] = torch.tensor(list(rewards.values()), dtype=torch.float32)
    episodes = Episodes(
        query_ids=query_ids.to(device), response_ids=response_ids.to(device),
        attention_mask=torch.cat([query_mask, response_mask], dim=1).to(device), loss_mask=loss_mask.to(device),
        logprobs=token_logprobs.to(device), ended=torch.tensor(ended, dtype=torch.bool, device=device),
        score_index=algo.last_token_index(loss_mask).to(device),
    )
    if environment is None:
        return episodes
    model_turns = [[s for s in row if s.logprobs is not None] for row in spans]
    episodes.environment_rewards = torch.tensor([math.nan if said.error else sum(s.reward for s in turns)
                                                 for said, turns in zip(environment, model_turns)], dtype=torch.float64, device=device)
    episodes.turn_rewards = turn_rewards.to(device)
    episodes.turns = torch.tensor([len(turns) for turns in model_turns], dtype=torch.long, device=device)
    episodes.done = torch.tensor([said.done for said in environment], dtype=torch.bool, device=device)
    episodes.truncated = torch.tensor([said.truncated for said in environment], dtype=torch.bool, device=device)
    episodes.environment_errors = [said.error for said in environment]
    episodes.transcripts = [said.transcript for said in environment]
    episodes.environments = [said.environment for said in environment]
    if any(said.numbers for said in environment):  # an agent's episodes
        episodes.agent_numbers = [dict(said.numbers) for said in environment]
        episodes.earlier_segments = [list(said.earlier) for said in environment]
    return episodes
