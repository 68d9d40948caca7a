"""Where a run's numbers go: sinks that each take every update's record and the sample rows.

The trainer hands each record to `Sinks.record` and each sample generation's rows to
`Sinks.samples`, and knows nothing of where they end up: metrics.jsonl and samples.jsonl
(`RunFiles`), the console (`ConsoleReporter`), and any further sink `open_sinks` adds.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Protocol

from tqdm.auto import tqdm

from ppokit.console import is_terminal
from ppokit.metrics.trackers import open_trackers


def _jsonable(value: Any) -> Any:
    """`value` as JSON can hold it: nested dicts and lists (a samples.jsonl row's `rewards`, its data `columns`) too."""
    if hasattr(value, "tolist"):  # a tensor or numpy value: its Python number or (nested) list
        value = value.tolist()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN; keep the fact visible instead of failing to log it
    return value


class JsonlWriter:
    """Appends one JSON object per line and flushes, so a crash loses at most the line being written."""

    def __init__(self, path: str | Path, append: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a" if append else "w", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(_jsonable(record), default=str) + "\n")  # a value JSON has no type for (a date): its text
        self._file.flush()

    def write_many(self, records: Iterable[dict]) -> None:
        for record in records:
            self.write(record)

    def close(self) -> None:
        self._file.close()


CONSOLE_KEYS = (
    ("objective/scores", "score", "{:+.3f}"),
    ("objective/kl", "kl", "{:.3f}"),
    ("objective/entropy", "entropy per sequence", "{:.2f}"),  # a sum over the response's tokens, as the report says
    ("objective/response_length", "len", "{:.1f}"),
    ("eps", "eps", "{:.1f}"),
)


class Sink(Protocol):
    def record(self, record: dict) -> None: ...

    def samples(self, rows: list[dict]) -> None: ...

    def close(self) -> None: ...


class RunFiles:
    """metrics.jsonl (one record per update) and samples.jsonl (one row per sample) of a run.

    `append`: a resumed run continues the files the checkpoint restored; a fresh run starts them empty.
    """

    def __init__(self, output_dir: str | Path, append: bool):
        self.metrics = JsonlWriter(Path(output_dir) / "metrics.jsonl", append=append)
        self.sample_rows = JsonlWriter(Path(output_dir) / "samples.jsonl", append=append)

    def record(self, record: dict) -> None:
        self.metrics.write(record)

    def samples(self, rows: list[dict]) -> None:
        self.sample_rows.write_many(rows)

    def close(self) -> None:
        self.metrics.close()
        self.sample_rows.close()


class ConsoleReporter:
    """A progress bar with ETA over updates, and one line every `logging_steps` updates (and the last).

    Where stderr is not a terminal (a log file, a pipe), a bar's redraws would be carriage-return noise:
    there each update prints one plain line instead, with the time so far and the estimated time left.
    """

    def __init__(self, total_updates: int, initial: int = 0, enabled: bool = True, description: str = "ppo", logging_steps: int = 1):
        self.enabled = enabled
        self.logging_steps = logging_steps
        self.total, self.initial = total_updates, initial
        self.plain = not is_terminal(sys.stderr)
        self.started = time.monotonic()
        self.bar = tqdm(total=total_updates, initial=initial, desc=description, unit="update", disable=not enabled or self.plain,
                        file=sys.stderr, dynamic_ncols=True)

    def record(self, record: dict) -> None:
        if not self.enabled:
            return
        self.bar.update(1)
        logged = record["update"] % self.logging_steps == 0 or record["update"] == self.total
        if not (logged or self.plain):
            return
        parts = [f"update {record['update']}/{self.total}"]
        if logged:
            parts += [f"{label} {fmt.format(record[key])}" for key, label, fmt in CONSOLE_KEYS if key in record]
            if "eval/scores" in record:
                parts.append(f"eval {record['eval/scores']:+.3f}")
        if self.plain:
            parts.append(self._times(record["update"]))
            print(" | ".join(parts), file=sys.stderr, flush=True)
        else:
            self.bar.write(" | ".join(parts), file=sys.stderr)

    def _times(self, update: int) -> str:
        elapsed = time.monotonic() - self.started
        done = update - self.initial
        left = elapsed / done * (self.total - update) if done > 0 else 0.0
        return f"{tqdm.format_interval(elapsed)} elapsed, {tqdm.format_interval(left)} left"

    def samples(self, rows: list[dict]) -> None:
        pass

    def close(self) -> None:
        self.bar.close()


class Sinks:
    """Every sink of a run; each record and sample row goes to all of them, in order."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks

    def record(self, record: dict) -> None:
        for sink in self.sinks:
            sink.record(record)

    def samples(self, rows: list[dict]) -> None:
        for sink in self.sinks:
            sink.samples(rows)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def open_sinks(config, *, total_updates: int, done_updates: int, is_main: bool, show_progress: bool, folder=None,
               output_dir=None) -> Sinks:
    """The sinks of a PPO run: on the main process the run's files and the trackers of `report_to`
    (ppokit.metrics.trackers); the console where progress shows.

    done_updates > 0: a resumed run, whose files continue where the checkpoint left them (and whose
    trackers continue their runs).
    output_dir: the run folder as the run resolved it (`saving.Saving`), if not config.output_dir.
    folder: where the run's files go, if not output_dir (a run replacing another writes beside it first).
    """
    sinks: list[Sink] = []
    output_dir = output_dir if output_dir is not None else config.output_dir
    if is_main:
        sinks.append(RunFiles(folder or output_dir, append=done_updates > 0))
        trackers = open_trackers(config, output_dir=output_dir, total_updates=total_updates, done_updates=done_updates,
                                 say=lambda message: print(f"ppokit: {message}", file=sys.stderr) if show_progress else None)
        if trackers is not None:
            sinks.append(trackers)
    sinks.append(ConsoleReporter(total_updates, initial=done_updates, enabled=show_progress, logging_steps=config.ppo.logging_steps))
    return Sinks(sinks)
