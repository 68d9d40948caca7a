"""Where a PPO run stands: the counters and records that a checkpoint saves and a resume restores.

Weights, optimiser, schedule, reward-scorer statistics and the KL controller have their own
state_dicts; everything else that makes a resumed run continue exactly is here, in one object
that the trainer updates and `ppokit.run.checkpoint` writes and reads. The data position is `rounds`:
the prompt stream is a pure function of (seed, round index), one round being an update's prompts
(`prompts.batch_indices`); an update takes one round, or with rollout.dynamic_sampling as many as it
needs to fill its batch, so the stream's position is saved beside the update counter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ppokit.errors import UserError


@dataclass
class TrainingState:
    update: int = 0  # updates done (skipped ones included): the data position
    episodes_sampled: int = 0  # episodes sampled so far, over every process (the `episode` metric; "episode" in trainer_state.json)
    skipped_updates: int = 0  # updates rolled back for a non-finite score, loss or gradient
    skipped_in_a_row: int = 0
    records: list[dict] = field(default_factory=list)  # metric records of updates 1..update
    last_nonfinite: Optional[str] = None  # what the last skipped update found, e.g. "non-finite loss: nan at ..."
    rounds: int = 0  # rounds of prompts taken by the updates done (skipped ones included): the prompt stream's position
    rounds_taken: Optional[int] = None  # the stream's position after the update in progress; counted when it is done or skipped

    def take_rounds(self, end: int) -> None:
        """The update in progress has taken the stream's rounds up to `end` (counted in `rounds` once it is done or
        skipped: a run stopped by an error mid-update is saved at the position its last complete update left)."""
        self.rounds_taken = end

    def count_done(self, episodes: int) -> None:
        """An update trained on a batch of `episodes`: the counters and the prompt stream move on past it."""
        self.update += 1
        self.episodes_sampled += episodes
        self._count_rounds()

    def _count_rounds(self) -> None:
        self.rounds = self.rounds_taken if self.rounds_taken is not None else self.rounds + 1
        self.rounds_taken = None

    def count_skipped(self, reason: str, episodes: int) -> None:
        """An update rolled back and skipped (`reason`: what it found): the data position and the episode count move
        on past its batch of `episodes`, as after a trained one."""
        self.update += 1
        self.episodes_sampled += episodes
        self.skipped_updates += 1
        self.skipped_in_a_row += 1
        self.last_nonfinite = reason
        self._count_rounds()

    def data_position(self, num_prompts: int, batch: int) -> dict:
        """The pass over the prompts and the offset in it where the next update starts (`batch`: prompts per round)."""
        done = self.rounds * batch
        return {"pass": done // num_prompts, "offset_in_pass": done % num_prompts}

    def counters(self) -> dict:
        """Everything but the records (those go to the checkpoint's metrics.jsonl)."""
        return {
            "update": self.update,
            "episode": self.episodes_sampled,
            "skipped_updates": self.skipped_updates,
            "skipped_in_a_row": self.skipped_in_a_row,
            "last_nonfinite": self.last_nonfinite,
            "rounds": self.rounds,
        }

    @classmethod
    def from_counters(cls, saved: dict, records: list[dict], source: str) -> "TrainingState":
        """The inverse of `counters`; a missing key or a value of the wrong type is a UserError naming `source`."""
        values = {}
        for key, field_name in (("update", "update"), ("episode", "episodes_sampled"), ("skipped_updates", "skipped_updates"),
                                ("skipped_in_a_row", "skipped_in_a_row")):
            value = saved.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UserError(f"{source}: {key} must be a non-negative integer, got {value!r}")
            values[field_name] = value
        # A checkpoint from before dynamic sampling took one round per update.
        rounds = saved.get("rounds", values["update"])
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < values["update"]:
            raise UserError(f"{source}: rounds must be an integer, at least update ({values['update']}), got {rounds!r}")
        last = saved.get("last_nonfinite")
        if last is not None and not isinstance(last, str):
            raise UserError(f"{source}: last_nonfinite must be text or null, got {last!r}")
        return cls(**values, records=records, last_nonfinite=last, rounds=rounds)
