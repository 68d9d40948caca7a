"""Stage 1 of every update, decided once at set-up: the sampler. It holds the rollout (and through it the engine),
which prompts each update samples, and when its episodes are sampled; it answers the trainer's two questions:

    episodes, metrics = sampler.episodes(update, num_updates, round)  # a round of this update's episodes (sampled now, or earlier)
    with sampler.training(policy):                              # the optimiser's steps; the engine samples with the
        ...                                                     # new weights after the block

    OnPolicy   rollout.max_staleness 0: each update samples its episodes from the current weights, trains, pushes
    Ahead      k >= 1: the episodes of updates u+1 ... u+k are sampled by an engine outside the trainer's process
               while update u trains, and trained at most k weight versions after the weights that sampled them

A weight version is the number of updates whose weights the engine holds (0: the start's). Batch b (the episodes of
update b, 0-based) is sampled with version `sampling_version(b)`:

    max(b - k, the last barrier at or before b)        barriers: 0 (the run's start) and every checkpoint (ppo.save_steps)

so after the first k updates each batch is k versions old, and no batch is sampled across a checkpoint: a run resumed
from a checkpoint samples what the straight run sampled there (episodes that would be in flight at a checkpoint are
not sampled ahead; they are sampled after it, from the checkpoint's weights, with seeds keyed by update, row and turn).
The schedule is a pure function of (b, k, save_steps): a run repeats and resumes exactly.

Rounds: the prompts come in rounds of one update's worth (`UpdatePrompts.indices(round)`); an update takes one, or with
rollout.dynamic_sampling as many as fill its batch (`training.dynamic_sampling`). Batches are sampled and keyed by round
(one round per update: the round is the update). When update u takes round r, the round r + j is trained by update
u + j at the latest (every update takes at least one), so it is sampled ahead when that update's version
`sampling_version(u + j)` is held: no round is trained more than k versions after its weights, or across a checkpoint.

One worker thread samples the batches in order (`Ahead`); the trainer's thread takes each when its update starts,
waits for those in flight before the weights change (a batch is sampled by one version only: the engine refuses a
completion of another) and pushes the new weights. The loss for the stale episodes is the decoupled PPO loss
(`losses.decoupled_policy_loss`): the trainer's recomputed logprobs are the proximal policy (the PPO ratio's), the
engine's the behaviour policy, whose mismatch `ppo.rollout_is` corrects (`engines.correction`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch

from ppokit.data.prompts import PromptDataset, batch_indices
from ppokit.engines.base import RolloutEngine, generate, request_seed, training_between_rollouts
from ppokit.training.episodes import Episodes, repeat_each
from ppokit.training.rollout import Rollout


@dataclasses.dataclass(frozen=True)
class UpdatePrompts:
    """Which training prompts each round samples on this process (`prompts.batch_indices`: by (seed, round); a round is
    one update's prompts, so the rounds taken are the data position), each repeated for its n adjacent samples."""

    data: PromptDataset
    query_ids: list[list[int]]  # every training prompt's token ids
    prompts_per_update: int  # over every process
    samples_per_prompt: int
    seed: int
    process: int
    processes: int

    def indices(self, round: int) -> list[int]:
        """The prompt indices of `round` (0-based; without dynamic sampling the update) on this process."""
        return batch_indices(round, len(self.data), self.prompts_per_update, self.seed, self.process, self.processes)

    def sample(self, rollout: Rollout, round: int) -> Episodes:
        """The episodes of `round` sampled by `rollout`, seeded by (run seed, round, row, turn)."""
        rows = repeat_each(self.indices(round), self.samples_per_prompt)
        return rollout.sample([self.query_ids[i] for i in rows], *self.data.rows(rows), update=round)


def sampling_version(update: int, max_staleness: int, save_steps: int) -> int:
    """The weight version that samples the episodes of `update` (0-based): max(update - max_staleness, the last barrier at
    or before it), barriers at 0 and at every multiple of save_steps (0: none but the start). See the module docstring."""
    barrier = update - update % save_steps if save_steps else 0
    return max(update - max_staleness, barrier)


def staleness_metrics(update: int, weight_versions: torch.Tensor, max_staleness: int) -> dict[str, float]:
    """rollout/staleness_mean and rollout/staleness_max of the episodes trained in `update` (0-based; it trains on
    version `update`), sampled with `weight_versions` (B,); a RuntimeError if any is over max_staleness or from the future."""
    staleness = (update - weight_versions).float()
    if staleness.numel() and (staleness.max() > max_staleness or staleness.min() < 0):
        raise RuntimeError(f"update {update + 1}: episodes sampled with weight versions {sorted(set(weight_versions.tolist()))}, "
                           f"outside [{update - max_staleness}, {update}] (rollout.max_staleness {max_staleness})")
    return {"rollout/staleness_mean": staleness.mean().item() if staleness.numel() else 0.0,
            "rollout/staleness_max": staleness.max().item() if staleness.numel() else 0.0}


class OnPolicy:
    """k = 0: each update samples its episodes from the current weights, trains, then pushes (`training_between_rollouts`)."""

    def __init__(self, rollout: Rollout, prompts: UpdatePrompts):
        self.rollout, self.prompts = rollout, prompts

    def episodes(self, update: int, num_updates: int, round: Optional[int] = None) -> tuple[Episodes, dict]:
        return self.prompts.sample(self.rollout, update if round is None else round), {}

    def training(self, policy):
        return training_between_rollouts(self.rollout.engine, policy)

    def close(self) -> None:
        pass


@dataclasses.dataclass
class _Job:
    version: int  # the weights that sample it
    future: Future
    ran: list = dataclasses.field(default_factory=list)  # [started, finished] (perf_counter)


class Ahead:
    """k >= 1: batches sampled ahead by one worker thread (module docstring). `episodes(update, num_updates)` returns the
    update's episodes, each tagged with its `weight_version`, and its metrics (staleness; the wait; the generation /
    training overlap, from the moment the update's episodes were ready to the end of its training, is added when
    `training` ends, before the record is written); `training(policy)` wraps the optimisation: the batches in flight
    finish with the old weights, then the new are pushed.

    The worker samples through the rollout over a `SeededEngine` (seeds keyed by (seed, update, process, call, row)),
    so no draw from torch's shared generator happens on its thread."""

    def __init__(self, rollout: Rollout, prompts: UpdatePrompts, max_staleness: int, save_steps: int, *, seed: int):
        self.k, self.save_steps, self.prompts = max_staleness, save_steps, prompts
        self.engine, self.seed = rollout.engine, seed
        self._seeded = SeededEngine(rollout.engine)
        self._rollout = rollout.over(self._seeded)  # built once; the one worker thread re-keys its engine per batch
        self.version: Optional[int] = None  # the weights the engine holds, in updates (set when the run starts or resumes)
        self._jobs: dict[int, _Job] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ppokit-ahead")
        self._metrics: dict = {}
        self._window_start = 0.0

    def _launch(self, round: int) -> None:
        job = _Job(self.version, None)

        def run() -> Episodes:
            job.ran.append(time.perf_counter())
            try:
                self._seeded.key((self.seed, round, self.prompts.process))
                episodes = self.prompts.sample(self._rollout, round)
            finally:
                job.ran.append(time.perf_counter())
            episodes.weight_version = torch.full((len(episodes),), job.version, dtype=torch.long, device=episodes.query_ids.device)
            return episodes

        job.future = self._pool.submit(run)
        self._jobs[round] = job

    def episodes(self, update: int, num_updates: int, round: Optional[int] = None) -> tuple[Episodes, dict]:
        """Round `round` (default: the update's own) taken by `update`. num_updates: the run's updates (a resumed run may
        continue to another length): nothing is sampled past them."""
        started, round = time.perf_counter(), update if round is None else round
        if self.version is None:
            self.version = update  # the start or a resume: the engine holds this update's weights
        for j in range(min(self.k, num_updates - 1 - update) + 1):  # round + j is trained by update + j at the latest
            if round + j not in self._jobs and sampling_version(update + j, self.k, self.save_steps) <= self.version:
                self._launch(round + j)
        job = self._jobs.pop(round)
        episodes = job.future.result()
        # The update's own time starts when its episodes were ready (or when it asked, if later), not when this thread
        # woke to take them: on a loaded machine that can come after the next batch was sampled whole.
        self._window_start = max(started, job.ran[1])
        self._metrics = {**staleness_metrics(update, episodes.weight_version, self.k), "time/generation_wait": self._window_start - started}
        return episodes, self._metrics

    @contextlib.contextmanager
    def training(self, policy):
        engine = self.engine
        engine.release()
        try:
            yield
        finally:
            engine.resume()
        trained = time.perf_counter()
        overlap = 0.0
        for job in list(self._jobs.values()):
            job.future.result()  # sampled to its end by the weights it started with
            if job.ran and job.ran[0] < trained:
                overlap += max(0.0, min(job.ran[1], trained) - max(job.ran[0], self._window_start))
        self._metrics["time/overlap"] = overlap
        engine.sync_weights(policy)
        self.version += 1

    def close(self) -> None:
        """Let the batch being sampled finish (every wait of the engine is bounded), drop the rest."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._jobs.clear()


class SeededEngine:
    """An engine whose `generate` sends seeded requests: request i of call c sampled with request_seed(*key, c, i), key
    (run seed, update, process), calls counted from the last `key`. The tokens are then a function of the weights, the
    prompts and the key alone, not of torch's shared generator (which the training thread draws from meanwhile).
    Everything else is the engine's."""

    def __init__(self, engine: RolloutEngine):
        self._engine, self._key, self._calls = engine, (), 0

    def key(self, key: tuple[int, ...]) -> None:
        """Seed what follows by `key` (a batch's: run seed, update, process)."""
        self._key, self._calls = key, 0

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def submit(self, requests) -> None:
        """The episode loop's requests (`episode_loop.EpisodeLoop`), an unseeded sampled one (a one-turn episode's; a
        multi-turn episode's carry their own keys) seeded as `generate` seeds its: request i of call c by
        request_seed(*key, c, i)."""
        call, self._calls = self._calls, self._calls + 1
        self._engine.submit([r if r.seed is not None or r.sampling.greedy else dataclasses.replace(r, seed=request_seed(*self._key, call, i))
                             for i, r in enumerate(requests)])

    def generate(self, prompts: list[list[int]], sampling) -> Episodes:
        return generate(self, prompts, sampling, self._engine.pad_token_id, self._engine.device)  # through `submit`


def build(rollout: Rollout, prompts: UpdatePrompts, *, max_staleness: int, save_steps: int, seed: int):
    """The run's sampler: `OnPolicy` for k = 0, else `Ahead`."""
    if not max_staleness:
        return OnPolicy(rollout, prompts)
    return Ahead(rollout, prompts, max_staleness, save_steps, seed=seed)
