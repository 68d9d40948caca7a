"""Where a PPO run stands: the counters and records that a checkpoint saves and a resume restores.

Weights, optimiser, schedule, reward-scorer statistics and the KL controller have their own
state_dicts; everything else that makes a resumed run continue exactly is here, in one object
that the trainer updates and `ppokit.run.checkpoint` writes and reads. The data position is not
stored separately: the data order is a pure function of (seed, update index), so `update` is it.
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

    def count_skipped(self, reason: str, episodes: int) -> None:
        """An update rolled back and skipped (`reason`: what it found): the data position and the episode count move
        on past its batch of `episodes`, as after a trained one."""
        self.update += 1
        self.episodes_sampled += episodes
        self.skipped_updates += 1
        self.skipped_in_a_row += 1
        self.last_nonfinite = reason

    def data_position(self, num_prompts: int, batch: int) -> dict:
        """The pass over the prompts and the offset in it where the next update starts."""
        done = self.update * batch
        return {"pass": done // num_prompts, "offset_in_pass": done % num_prompts}

    def counters(self) -> dict:
        """Everything but the records (those go to the checkpoint's metrics.jsonl)."""
        return {
            "update": self.update,
            "episode": self.episodes_sampled,
            "skipped_updates": self.skipped_updates,
            "skipped_in_a_row": self.skipped_in_a_row,
            "last_nonfinite": self.last_nonfinite,
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
        last = saved.get("last_nonfinite")
        if last is not None and not isinstance(last, str):
            raise UserError(f"{source}: last_nonfinite must be text or null, got {last!r}")
        return cls(**values, records=records, last_nonfinite=last)
