"""Where a run's numbers go: metrics.jsonl, samples.jsonl, and the console."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Iterable

from tqdm.auto import tqdm


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
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
        self._file.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")
        self._file.flush()

    def write_many(self, records: Iterable[dict]) -> None:
        for record in records:
            self.write(record)

    def close(self) -> None:
        self._file.close()


def read_jsonl_records(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


CONSOLE_KEYS = (
    ("objective/scores", "score", "{:+.3f}"),
    ("objective/kl", "kl", "{:.3f}"),
    ("objective/entropy", "entropy", "{:.2f}"),
    ("objective/response_length", "len", "{:.1f}"),
    ("eps", "eps", "{:.1f}"),
)


class ConsoleReporter:
    """A progress bar with ETA over updates, and one line per logged update."""

    def __init__(self, total_updates: int, initial: int = 0, enabled: bool = True, description: str = "ppo"):
        self.enabled = enabled
        self.bar = tqdm(total=total_updates, initial=initial, desc=description, unit="update", disable=not enabled, file=sys.stderr, dynamic_ncols=True)

    def update(self, record: dict, print_line: bool) -> None:
        if not self.enabled:
            return
        self.bar.update(1)
        if print_line:
            parts = [f"update {record['update']}/{self.bar.total}"]
            parts += [f"{label} {fmt.format(record[key])}" for key, label, fmt in CONSOLE_KEYS if key in record]
            if "eval/scores" in record:
                parts.append(f"eval {record['eval/scores']:+.3f}")
            self.bar.write(" | ".join(parts), file=sys.stderr)

    def write(self, text: str) -> None:
        if self.enabled:
            self.bar.write(text, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
