"""Read a run directory as it is on disk: config.yaml, metrics.jsonl, samples.jsonl.

Only the files are read (never the trainer), so a run made by another machine, an older
version of ppokit, a run still in progress or one killed mid-write can be read. What cannot
be read is skipped and said, in `RunData.notes`.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from ppokit.errors import UserError

RUN_FILES = ("config.yaml", "metrics.jsonl", "samples.jsonl")
MAX_UPDATE = 2**53  # update numbers are counts: beyond this a float (a chart's axis) no longer holds them exactly
NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


@dataclass
class RunData:
    """One run directory. `records` are the metrics, one dict per update, in update order."""

    path: Path
    label: str
    config: dict = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)
    finished: bool = False
    notes: list[str] = field(default_factory=list)  # what was skipped or missing, in words

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(updates, values) of a numeric metric; updates where it is missing are left out."""
        updates, values = [], []
        for record in self.records:
            value = record.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            updates.append(record["update"])
            values.append(float(value))
        return updates, values

    def has(self, key: str) -> bool:
        return any(key in r for r in self.records)

    @property
    def normalised_scores(self) -> bool:
        """The run's scores (objective/scores, eval/scores, rlhf_reward) combine standardised sources
        (`reward.normalize` on for any): z-scores, not the sources' raw scale (reward/<name>)."""
        normalize = self.setting("reward.normalize")
        return normalize is True or (isinstance(normalize, list) and any(v is True for v in normalize))

    def setting(self, dotted: str, default: Any = None) -> Any:
        """A config value by dotted key (`ppo.kl_coef`), or `default` when config.yaml lacks it."""
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    @property
    def total_updates(self) -> Optional[int]:
        """Updates the run was configured for, when config.yaml and the metrics tell (else None)."""
        total = self.setting("ppo.total_episodes")
        if not isinstance(total, int) or not self.records:
            return None
        first = self.records[0]
        batch = first.get("episode", 0) // max(1, first["update"])
        return total // batch if batch > 0 else None


def stop_rate(run: RunData) -> tuple[list[int], list[float]]:
    """Share of the update's kept responses that produced the stop token: `val/num_eos_tokens` over
    the episodes of the update (the `episode` counter's step) less `reward/skipped`."""
    updates, rates, previous = [], [], 0
    for record in run.records:
        episode = record.get("episode")
        if not isinstance(episode, int):
            continue
        responses = episode - previous - (record.get("reward/skipped") or 0)
        previous = episode
        eos = record.get("val/num_eos_tokens")
        if isinstance(eos, (int, float)) and responses > 0:
            updates.append(record["update"])
            rates.append(float(eos) / responses)
    return updates, rates


def eval_before(run: RunData) -> Optional[float]:
    """The eval score before training: the mean score of the eval samples written at update 0 (the sample
    generation a run makes before its first update), or None when the run has none."""
    scores = [row["score"] for row in run.samples if row["update"] == 0 and row.get("split") == "eval"
              and _is_number(row.get("score")) and math.isfinite(row["score"])]
    return sum(scores) / len(scores) if scores else None


def eval_scores(run: RunData) -> tuple[list[int], list[float]]:
    """(updates, eval/scores), with the score before training at update 0 (`eval_before`) when the run wrote one:
    metrics.jsonl has a record per update, none for the samples taken before the first."""
    updates, values = run.series("eval/scores")
    before = eval_before(run)
    if before is None or 0 in updates:
        return updates, values
    return [0] + updates, [before] + values


def score_spread(run: RunData) -> tuple[list[int], list[float], str]:
    """(updates, std of scores within the batch, where it came from): `objective/scores_std` when the
    run logged it, else the std of the scores of each sample generation in samples.jsonl."""
    updates, values = run.series("objective/scores_std")
    if updates:
        return updates, values, "objective/scores_std"
    by_update: dict[int, list[float]] = {}
    for row in run.samples:
        if isinstance(row.get("score"), (int, float)) and math.isfinite(row["score"]):
            by_update.setdefault(row["update"], []).append(float(row["score"]))
    kept = {u: statistics.pstdev(s) for u, s in sorted(by_update.items()) if len(s) >= 2}
    return list(kept), list(kept.values()), "the scores of each sample generation (samples.jsonl)"


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in RUN_FILES)


def read_run(path: str | Path) -> RunData:
    """Read one run directory; raises UserError when `path` is not one (naming what is missing)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such directory")
    if not is_run_dir(path):
        inside = sorted(p.name for p in path.iterdir() if is_run_dir(p)) if path.is_dir() else []
        hint = f"; runs inside it: {', '.join(str(path / name) for name in inside)}" if inside else ""
        raise UserError(f"{path}: not a run directory (none of {', '.join(RUN_FILES)}){hint}")
    run = RunData(path=path, label=path.name, finished=(path / "final").is_dir())
    run.config = _read_config(path / "config.yaml", run.notes)
    run.records = _read_metrics(path / "metrics.jsonl", run.notes)
    run.samples = _read_samples(path / "samples.jsonl", run.notes)
    if isinstance(run.config.get("run_name"), str) and run.config["run_name"]:
        run.label = run.config["run_name"]
    return run


def label_runs(runs: list[RunData]) -> None:
    """Make labels unique: runs/a/ppo and runs/b/ppo become a/ppo and b/ppo."""
    for depth in range(1, 8):
        labels = [r.label for r in runs]
        clashes = {label for label in labels if labels.count(label) > 1}
        if not clashes:
            return
        for run in runs:
            if run.label in clashes:
                parts = run.path.resolve().parts
                run.label = "/".join(parts[-(depth + 1):])


def _read_config(path: Path, notes: list[str]) -> dict:
    if not path.is_file():
        notes.append("config.yaml: missing; settings (kl_coef, response_length, reward) are unknown, so alarms that need them are skipped")
        return {}
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8", errors="replace"))
    except yaml.YAMLError as e:
        notes.append(f"config.yaml: not valid YAML ({str(e).splitlines()[0]}); settings are unknown")
        return {}
    if not isinstance(data, dict):
        notes.append("config.yaml: not a mapping of keys; settings are unknown")
        return {}
    return data


def _jsonl_rows(path: Path, notes: list[str]) -> list[tuple[int, dict]]:
    """(1-based line number, object) for every line that parses; the others are noted and skipped."""
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    rows, bad = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line, parse_constant=lambda name: NON_FINITE[name])
        except (json.JSONDecodeError, KeyError):
            bad.append(number)
            continue
        if not isinstance(obj, dict):
            bad.append(number)
            continue
        rows.append((number, obj))
    if bad:
        last = len(lines)
        truncated = bad == [last] and not text.endswith("\n")
        why = "the last line is cut short (a run stopped mid-write)" if truncated else "not a JSON object"
        notes.append(f"{path.name}: skipped line{'s' if len(bad) > 1 else ''} {_ranges(bad)}: {why}")
    return rows


def _read_metrics(path: Path, notes: list[str]) -> list[dict]:
    if not path.is_file():
        notes.append("metrics.jsonl: missing; no curves or metric alarms")
        return []
    by_update: dict[int, dict] = {}
    without_update = []
    not_numbers: dict[str, list[int]] = {}  # key -> lines where its value is not a number
    for number, row in _jsonl_rows(path, notes):
        update = row.get("update")
        if not _is_number(update) or not isinstance(update, int) or not 0 <= update <= MAX_UPDATE:
            without_update.append(number)
            continue
        record = {}
        for key, value in row.items():
            value = _number(value)
            if _is_number(value):
                record[key] = value
            else:
                not_numbers.setdefault(key, []).append(number)
        by_update[update] = record  # a later line for the same update wins
    if without_update:
        notes.append(f"metrics.jsonl: skipped line{'s' if len(without_update) > 1 else ''} {_ranges(without_update)}: "
                     f"no integer `update` from 0 to {MAX_UPDATE}")
    if not_numbers:
        left_out = "; ".join(f"{key} (line{'s' if len(lines) > 1 else ''} {_ranges(lines)})" for key, lines in not_numbers.items())
        notes.append(f"metrics.jsonl: left out values that are not numbers: {left_out}")
    if not by_update:
        notes.append("metrics.jsonl: no update recorded yet; no curves or metric alarms")
    return [by_update[u] for u in sorted(by_update)]


def _read_samples(path: Path, notes: list[str]) -> list[dict]:
    if not path.is_file():
        notes.append("samples.jsonl: missing; no sample tables and no repetition alarm")
        return []
    rows = []
    for _, row in _jsonl_rows(path, notes):
        if isinstance(row.get("update"), int) and isinstance(row.get("completion"), str):
            row["score"] = _number(row.get("score"))
            rows.append(row)
    if not rows:
        notes.append("samples.jsonl: no sample rows yet")
    return rows


def _is_number(value: Any) -> bool:
    """A metric value the report can compute with: an int or float (not a bool) that a float holds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        float(value)
    except OverflowError:  # JSON integers have no limit: 10**400 would break every sum and chart
        return False
    return True


def _number(value: Any) -> Any:
    """Non-finite floats were logged as strings ("nan"); read them back as floats."""
    if isinstance(value, str) and value in NON_FINITE:
        return NON_FINITE[value]
    return value


def _ranges(numbers: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    parts, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            parts.append(f"{start}" if start == n else f"{start}-{n}")
            start = None
    return ", ".join(parts)
