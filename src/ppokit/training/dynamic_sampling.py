"""Stages 1-2 of an update as the trainer asks for them: its batch sampled by the sampler and scored, and with
`rollout.dynamic_sampling` (DAPO's dynamic sampling, Yu et al. 2025, §3.2) filled with groups that teach something.

Under a group estimator (GRPO, RLOO, ...) a group whose n samples all score the same has zero advantage: it only
dilutes the batch. Dynamic sampling drops such groups (`groups_with_spread`: the metric, the score by default, has no
spread among the group's scored rows) and samples further rounds of prompts (each one update's worth, the next in
the prompt stream) until every process holds its share of groups with spread, at most
`rollout.dynamic_sampling_extra_rounds` rounds beyond the first. Then the batch is cut to its size (groups found beyond
it are not trained), or, short of it, `rollout.dynamic_sampling_when_short` says what happens: `train` fills the
batch's missing groups with dropped ones marked out of the update (`valid` False: the losses skip them; the batch
keeps its shape, the same on every process) and says so; `stop` stops the run with the last checkpoint.

Groups are never split across processes: each process samples whole prompts (`prompts.batch_indices`) and fills its
own share; a round is sampled on every process while any is short (scoring is collective), the verdicts summed.
The rounds an update takes are the prompt stream's position (`TrainingState.rounds`), saved with every checkpoint.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable, Optional

import torch

from ppokit.errors import UserError
from ppokit.training.episodes import Episodes, concat
from ppokit.training.experience import Scored
from ppokit.training.sampler import UpdatePrompts, staleness_metrics


def groups_with_spread(values: torch.Tensor, scored: torch.Tensor, group_size: int) -> torch.Tensor:
    """values (B,) float, scored (B,) bool (the rows that have a value), B = groups x group_size with each group's rows
    adjacent -> (groups,) bool: True where two of the group's scored rows differ. A group with fewer than two scored
    rows has no spread."""
    values = values.reshape(-1, group_size)
    scored = scored.reshape(-1, group_size) & torch.isfinite(values)
    highest = torch.where(scored, values, torch.full_like(values, -torch.inf)).amax(1)
    lowest = torch.where(scored, values, torch.full_like(values, torch.inf)).amin(1)
    return highest > lowest


@dataclasses.dataclass(frozen=True)
class Rule:
    """rollout.dynamic_sampling's settings: `metric` (`score`, or a reward source's name: its raw score),
    `extra_rounds`, `when_short` (`train` or `stop`)."""

    metric: str
    extra_rounds: int
    when_short: str

    @classmethod
    def of(cls, rollout) -> Optional["Rule"]:
        """The rule of a `rollout:` section (None: dynamic sampling off). The metric names `score` or a reward source (the
        run's start-up checked it: `startup.prepare`)."""
        if not rollout.dynamic_sampling:
            return None
        return cls(rollout.dynamic_sampling_metric, rollout.dynamic_sampling_extra_rounds, rollout.dynamic_sampling_when_short)

    def values(self, scored: Scored) -> torch.Tensor:
        """(B,) the metric of each row: the combined score, or the named source's raw score (NaN where it gave none)."""
        return scored.scores if self.metric == "score" else scored.sources[self.metric].to(scored.scores.device)


@dataclasses.dataclass
class Batch:
    """An update's episodes after stages 1-2, with what scoring found and, per group, its prompt (this process's)."""

    episodes: Episodes
    scored: Scored
    indices: list[int]  # one prompt index per group
    prompts: list[str]  # one per row
    columns: dict  # the data's other columns, one value per row
    metrics: dict[str, float]  # the sampler's (staleness, waits), with dynamic sampling rollout/*
    scoring_s: float = 0.0  # seconds spent scoring (every round's)

    def groups(self, picks: list[int], group_size: int) -> "Batch":
        """The groups `picks` (positions in this batch), in that order."""
        rows = [g * group_size + i for g in picks for i in range(group_size)]
        index = torch.tensor(rows, dtype=torch.long, device=self.episodes.query_ids.device)
        scored = self.scored
        return Batch(self.episodes.select(index), Scored(
            scored.scores[index], scored.valid[index], scored.errors, [scored.completions[r] for r in rows], scored.metrics,
            {name: values[index.to(values.device)] for name, values in scored.sources.items()},
        ), [self.indices[g] for g in picks], [self.prompts[r] for r in rows], {k: [v[r] for r in rows] for k, v in self.columns.items()},
            self.metrics)


def joined(batches: list[Batch], rounds: list[dict[str, float]], pad_token_id: int) -> Batch:
    """Batches (rounds' groups) as one, rows in order; the scoring metrics of every round sampled (`rounds`, each over
    the same number of rows) averaged, `reward/skipped` summed."""
    first = batches[0]
    metrics = {key: sum(m[key] for m in rounds) / (1 if key == "reward/skipped" else len(rounds)) for key in rounds[0]}
    errors = list(dict.fromkeys(e for b in batches for e in b.scored.errors))
    scored = Scored(torch.cat([b.scored.scores for b in batches]), torch.cat([b.scored.valid for b in batches]), errors,
                    [c for b in batches for c in b.scored.completions], metrics,
                    {name: torch.cat([b.scored.sources[name] for b in batches]) for name in first.scored.sources})
    return Batch(concat([b.episodes for b in batches], pad_token_id), scored, [i for b in batches for i in b.indices],
                 [p for b in batches for p in b.prompts], {k: [v for b in batches for v in b.columns[k]] for k in first.columns}, {})


class UpdateBatches:
    """Each update's batch (`take`): one round sampled by `sampler` and scored by `rollout`, or with a dynamic sampling
    `rule` as many rounds as fill it (module docstring). reduce: a sum over processes; say: a line for the user."""

    def __init__(self, sampler, rollout, prompts: UpdatePrompts, rule: Optional[Rule], *, reduce: Callable[[torch.Tensor], torch.Tensor],
                 say: Callable[[str], None]):
        self.sampler, self.rollout, self.prompts, self.rule, self.reduce, self.say = sampler, rollout, prompts, rule, reduce, say
        self.group_size = prompts.samples_per_prompt

    def round(self, update: int, num_updates: int, round: int) -> Batch:
        """Round `round` of the prompt stream, taken by `update`: sampled (now, or ahead) and scored."""
        indices = self.prompts.indices(round)
        prompts, columns = self.prompts.data.rows([i for i in indices for _ in range(self.group_size)])
        episodes, metrics = self.sampler.episodes(update, num_updates, round)
        started = time.perf_counter()
        scored = self.rollout.score(episodes, prompts, columns)
        return Batch(episodes, scored, indices, prompts, columns, metrics, time.perf_counter() - started)

    def take(self, state, num_updates: int) -> Batch:
        """The batch of update `state.update`, from the prompt stream at `state.rounds`; the rounds it took are noted
        in `state` (`take_rounds`)."""
        update, first = state.update, state.rounds
        if self.rule is None:
            batch = self.round(update, num_updates, first)
            state.take_rounds(first + 1)
            return batch
        share, n = len(self.prompts.indices(first)), self.group_size
        rounds, kept, dropped = [], [], []  # kept / dropped: (round, group) in sampled order
        while True:
            batch = self.round(update, num_updates, first + len(rounds))
            spread = groups_with_spread(self.rule.values(batch.scored), batch.scored.valid, n).tolist()
            kept += [(len(rounds), g) for g, has in enumerate(spread) if has]
            dropped += [(len(rounds), g) for g, has in enumerate(spread) if not has]
            rounds.append(batch)
            short = self.reduce(torch.tensor([float(max(share - len(kept), 0))], device=batch.scored.scores.device)).item()
            if not short or len(rounds) > self.rule.extra_rounds:
                break
        counts = self.reduce(torch.tensor([float(len(kept) + len(dropped)), float(len(kept))], device=batch.scored.scores.device)).tolist()
        if short and self.rule.when_short == "stop":
            raise UserError(f"update {update + 1}: rollout.dynamic_sampling found {int(counts[1])} groups with spread in {len(rounds)} "
                            f"rounds of prompts, {int(short)} fewer than the batch needs (rollout.dynamic_sampling_when_short: stop); "
                            "raise rollout.dynamic_sampling_extra_rounds, or set rollout.dynamic_sampling_when_short: train")
        if short:
            self.say(f"update {update + 1}: dynamic sampling found {int(counts[1])} groups with spread in {len(rounds)} rounds, "
                     f"{int(short)} short of the batch; it trains on them (rollout.dynamic_sampling_when_short: train)")
        picks = kept[:share]
        fillers = dropped[: share - len(picks)]
        # The fillers stay out of the update (valid False), unless no process found any group to train: then the batch
        # is trained as without dynamic sampling rather than not at all.
        runs = [list(run) for _, run in itertools.groupby(picks + fillers, key=lambda pick: pick[0])]  # one selection per run of a round
        filled = [rounds[run[0][0]].groups([g for _, g in run], n) for run in runs]
        result = joined(filled, [b.scored.metrics for b in rounds], self.rollout.engine.pad_token_id)
        if counts[1] and fillers:
            result.scored.valid[len(picks) * n:] = False
        state.take_rounds(first + len(rounds))
        result.scoring_s = sum(b.scoring_s for b in rounds)
        result.metrics = self._sampler_metrics(update, result.episodes, [b.metrics for b in rounds])
        result.metrics.update({"rollout/groups_kept": counts[1] / counts[0], "rollout/rounds": float(len(rounds)),
                               "rollout/prompts_consumed": float((first + len(rounds)) * self.prompts.prompts_per_update)})
        return result

    def _sampler_metrics(self, update: int, episodes: Episodes, rounds: list[dict]) -> dict[str, float]:
        """The sampler's metrics over the rounds: waits summed, staleness of the episodes trained. In the last round's
        dict, which the sampler completes when the update's training ends (`sampler.Ahead.training`)."""
        metrics = rounds[-1]
        metrics.update({key: sum(m[key] for m in rounds) for key in rounds[0] if key.startswith("time/")})
        if episodes.weight_version is not None:
            metrics.update(staleness_metrics(update, episodes.weight_version, self.sampler.k))
        return metrics
