"""What stops a run safely: non-finite numbers (an optimiser step is skipped, or an update rolled back
and skipped) and SIGINT/SIGTERM (the current update finishes, a checkpoint is written, the run exits)."""

from __future__ import annotations

import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch

from ppokit.process import random_states
from ppokit.errors import TrainingInterrupted, UserError  # noqa: F401  (TrainingInterrupted: raised here, named here too)


class NonFiniteUpdate(Exception):
    """Raised inside an update, before any optimiser step that would use it, when `quantity`
    (score, loss or gradient) is NaN or infinite."""

    def __init__(self, quantity: str, detail: str):
        super().__init__(f"non-finite {quantity}: {detail}")
        self.quantity = quantity
        self.detail = detail


class NonFiniteStop(UserError):
    """max_skipped_updates updates in a row were non-finite; the run stopped after a checkpoint."""


def too_many_skipped(state, hp, checkpoint) -> NonFiniteStop:
    """The stop after ppo.max_skipped_updates skipped updates in a row, saying what the checkpoint's
    weights are: the last update that trained, or the starting ones. A skipped update leaves no step in
    the weights: it was rolled back (nonfinite_rollback memory/disk), or every step of it was skipped (off)."""
    trained = [r["update"] for r in state.records if not any(k.startswith("nonfinite/") for k in r)]
    if trained:
        how = "the skipped ones were rolled back" if hp.rollback != "off" else "the skipped ones took no optimiser step"
        weights = f"holds the weights of update {trained[-1]}, the last that trained ({how})"
    else:
        weights = "holds the starting weights: no update trained"
    return NonFiniteStop(
        f"update {state.update}: {state.skipped_in_a_row} updates in a row were skipped "
        f"(ppo.max_skipped_updates={hp.max_skipped_updates}), the last for a {state.last_nonfinite}. "
        f"The checkpoint {checkpoint} {weights}; fix the cause (reward, learning rate, data) and continue with --resume"
    )


def saved_if_it_fails(part: Callable, state, save_checkpoint: Callable[[], Path], finished_record: Optional[dict] = None, *,
                      alone: Callable[[UserError], bool] = lambda error: False):
    """part(), or on a user error (a reward source failing under reward.on_error=raise) a checkpoint of the last complete
    update first, then the error, with it. `finished_record`: the update whose samples failed is complete (kept in
    state.records). `alone(error)`: this process stops without the others, so no collective save can be made."""
    try:
        return part()
    except UserError as error:
        if alone(error):
            raise
        if finished_record is not None:
            state.records.append(finished_record)
        if not state.update:
            raise
        raise UserError(f"{error}. Updates 1-{state.update} are saved in {save_checkpoint()}; "
                        "fix the cause and continue with --resume") from None


def nothing_trained(state, checkpoint) -> NonFiniteStop:
    """A run that ended with every update skipped: it fails, and writes no final/."""
    return NonFiniteStop(
        f"every update of the run ({state.update}) was skipped, the last for a {state.last_nonfinite}; nothing was "
        f"trained, so final/ is not written. The checkpoint {checkpoint} holds the starting weights and the counters; "
        "fix the cause (reward, learning rate, data)"
    )


def check_finite(values: dict[str, torch.Tensor], accelerator=None) -> None:
    """Raise NonFiniteUpdate for the first quantity of `values` (name -> tensor) that has a NaN or
    infinite element on any process.

    With several processes the verdicts are shared in one reduction, so that all of them skip the
    update together.
    """
    values = {name: value.detach() for name, value in values.items()}
    bad = torch.stack([~torch.isfinite(v).all() for v in values.values()]).float()
    if accelerator is not None and accelerator.num_processes > 1:
        bad = accelerator.reduce(bad.to(accelerator.device), "sum")
    for (quantity, value), is_bad in zip(values.items(), bad.tolist()):
        if is_bad:
            flat = value.flatten().float()
            where = (~torch.isfinite(flat)).nonzero().flatten()
            detail = f"{flat[where[0]].item()} at element {int(where[0])} of {flat.numel()}" if where.numel() else "on another process"
            raise NonFiniteUpdate(quantity, detail)


def check_some_scored(scored: torch.Tensor, errors: list[str], accelerator=None) -> None:
    """Raise NonFiniteUpdate("score") when no row of the update, on any process, has a score: under
    reward.on_error=skip every row failed. Such an update is skipped like one with a NaN score, so a
    passing outage costs one batch and a lasting one stops at max_skipped_updates with a checkpoint.

    scored: (B,) bool, False on the rows dropped; errors: the failed sources' first messages.
    """
    count = scored.sum().float().reshape(1)
    if accelerator is not None and accelerator.num_processes > 1:
        count = accelerator.reduce(count.to(accelerator.device), "sum")
    if count.item() == 0:
        first = errors[0] if errors else "no reward source scored any row"
        raise NonFiniteUpdate("score", f"every row of the batch failed to score (reward.on_error=skip); first error: {first}")


def _cpu_copy(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's own shard (fsdp's DTensor), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class UpdateSnapshot:
    """What a skipped update goes back to: trainable weights, optimiser state and schedule position at
    the start of the update (`ppo.nonfinite_rollback`).

    A PPO update takes num_ppo_epochs x num_mini_batches optimiser steps; with rollback "memory" or "disk"
    a NaN found at step k (the update stops there) means steps 1..k-1 already moved the weights, and
    restoring this snapshot undoes them, so a skipped update leaves no trace but its place in the schedule.
    "memory": the copies live in CPU memory (about 3x the trainable weights with AdamW). "disk": they are
    written to `file` (each process its own) and read back, memory-mapped, only to restore. "off": only the
    schedule is kept; the steps are checked one by one instead (`optimise.ppo_epochs` skips a bad one), so
    an update that is skipped took no step.
    """

    def __init__(self, model: torch.nn.Module, optimizer, scheduler, rollback: str = "memory", file: Optional[Path] = None):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.params = self.optimizer_state = self.file = None
        if rollback == "memory":
            self.params = [p.detach().to("cpu", copy=True) for p in self._trainable()]
            self.optimizer_state = _cpu_copy(optimizer.state_dict())
        elif rollback == "disk":
            self.file = Path(file)
            self._write(self.file)
        self.scheduler_state = _cpu_copy(scheduler.state_dict())

    def _trainable(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def _optimised(self):
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _write(self, file: Path) -> None:
        """Weights and each optimised parameter's state (None where it has none yet), one tensor at a time
        through torch.save (no whole copy in host memory); written beside and renamed, so a file is whole."""
        file.parent.mkdir(parents=True, exist_ok=True)
        state = [self.optimizer.state.get(p) for p in self._optimised()]
        saved = {
            "params": [_local(p.detach()) for p in self._trainable()],
            "optimizer": [None if not s else {k: _local(v.detach()) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                          for s in state],
        }
        partial = file.with_name(file.name + ".partial")
        torch.save(saved, partial)
        partial.replace(file)

    def _read(self) -> None:
        """The disk snapshot copied back in place (the weights' and the optimiser state's own tensors, so
        that their devices, dtypes and sharding stay as they are); a state the snapshot lacks is dropped."""
        saved = torch.load(self.file, map_location="cpu", mmap=True, weights_only=True)
        with torch.no_grad():
            for p, value in zip(self._trainable(), saved["params"]):
                _local(p).copy_(value)
            for p, before in zip(self._optimised(), saved["optimizer"]):
                if before is None:
                    self.optimizer.state.pop(p, None)
                    continue
                now = self.optimizer.state[p]
                for key, value in before.items():
                    if isinstance(value, torch.Tensor) and isinstance(now.get(key), torch.Tensor):
                        _local(now[key]).copy_(value)
                    else:
                        now[key] = value

    def discard(self) -> None:
        """Delete the disk snapshot (the update it guarded is over), and its folder once no process's is left."""
        if self.file is not None:
            self.file.unlink(missing_ok=True)
            try:
                self.file.parent.rmdir()
            except OSError:  # another process's snapshot is still there, or the folder is gone
                pass

    def restore(self, scheduler_steps: int) -> None:
        """Weights and optimiser back to the snapshot; the schedule moved on by one whole update,
        so the learning rate stays a function of the update index."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.params is not None:
            with torch.no_grad():
                for p, saved in zip(self._trainable(), self.params):
                    p.copy_(saved)
            self.optimizer.load_state_dict(self.optimizer_state)
        elif self.file is not None:
            self._read()
        self.scheduler.load_state_dict(self.scheduler_state)
        with warnings.catch_warnings():  # stepping the schedule without an optimiser step is the point here
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            for _ in range(scheduler_steps):
                self.scheduler.step()


def rollback_file(run_folder: Path, process_index: int) -> Path:
    """Where process `process_index` writes its snapshot under nonfinite_rollback: disk."""
    return Path(run_folder) / ".rollback" / f"process-{process_index}.pt"


def guarded_update(update: Callable[[], dict], snapshot: UpdateSnapshot, state, *, optimiser_steps: int, episodes: int,
                   rolled_back: bool, started: float, say: Callable[[str], None]) -> dict:
    """`update()`, one update, under the non-finite guard -> its record. An update whose score is NaN or infinite, whose
    every optimiser step had a non-finite loss or gradient, or (ppo.nonfinite_rollback memory/disk: `rolled_back`) any
    step did, goes back to `snapshot` with the schedule moved on by its `optimiser_steps`, is counted in `state`'s
    skipped updates (its batch of `episodes` is not retried: the data position moves on) and recorded as
    `nonfinite/<quantity>`. A UserError (scoring fails before any optimiser step) goes back to the snapshot and to the
    random states of the update's start, so that a checkpoint written now is the last complete update's.
    started: when the update began (perf_counter); say: a line for the user."""
    rng = random_states.rng_state()
    try:
        record = update()
    except UserError:
        snapshot.restore(scheduler_steps=0)
        random_states.set_rng_state(rng)
        raise
    except NonFiniteUpdate as bad:
        snapshot.restore(scheduler_steps=optimiser_steps)
        snapshot.model.train()
        state.count_skipped(str(bad), episodes)
        say(f"update {state.update}: skipped{' and rolled back' if rolled_back else ''}, {bad}")
        return {
            "update": state.update, "episode": state.episodes_sampled, f"nonfinite/{bad.quantity}": 1,
            "skipped_updates": state.skipped_updates, "time/update": time.perf_counter() - started,
        }
    finally:
        snapshot.discard()
    state.skipped_in_a_row = 0
    record["skipped_updates"] = state.skipped_updates
    return record


# --------------------------------------------------------------------------- signals


class StopSignals:
    """SIGINT/SIGTERM handlers for the length of a run.

    The first signal asks the run to stop after the current update (then it writes a checkpoint);
    a second one abandons the update at once, leaving the last complete checkpoint to resume from.
    Installed only in the main thread (Python delivers signals there); restored by `uninstall`.

    last_checkpoint: the run's last complete checkpoint or None (named when abandoning);
    current_update: the number of updates done so far; accelerator: to share the request.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, last_checkpoint: Callable[[], Optional[Path]], current_update: Callable[[], int], accelerator):
        self.last_checkpoint = last_checkpoint
        self.current_update = current_update
        self.accelerator = accelerator
        self.received: Optional[int] = None
        self._previous: dict = {}

    def install(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        update = self.current_update()
        if self.received is not None:
            raise TrainingInterrupted(signum, update, self.last_checkpoint(), abandoned=True)
        self.received = signum
        if self.accelerator.is_main_process:
            print(
                f"\nppokit: {signal.Signals(signum).name}: finishing update {update + 1}, then writing a "
                "checkpoint (send it again to abandon the update)",
                file=sys.stderr,
                flush=True,
            )

    def requested(self) -> Optional[int]:
        """The signal received by any process, or None (every process must call this together)."""
        if self.accelerator.num_processes == 1:
            return self.received
        flag = torch.tensor([float(self.received or 0)], device=self.accelerator.device)
        received = int(self.accelerator.reduce(flag, "max").item())
        return received or None
