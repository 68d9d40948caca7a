"""Reading data sources: local JSONL, JSON, CSV and Parquet files, `datasets.save_to_disk` folders,
reasoning-gym's tasks and hub dataset names (`datasets.load_dataset`) -> `Rows`, with errors that name the file and the
line or row. No format is applied here (that is `ppokit.data.formats`)."""

from __future__ import annotations

import csv
import io
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ppokit.config.fields import decode_utf8
from ppokit.conversation.templates import is_messages
from ppokit.data.reasoning_gym import is_gym_spec, read_rows
from ppokit.errors import UserError

DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


@dataclass
class Rows:
    """Rows of one source as read, before any format is applied."""

    rows: list[dict]
    source: str
    lines: Optional[list[int]] = None  # line of each row, for line-oriented files
    empty_cells: Optional[dict[str, int]] = None  # CSV: column -> cells that were empty (read as '')

    def where(self, i: int) -> str:
        """Where row i (0-based) is, for error messages: `file:line` or `source: row n` (from 1)."""
        if self.lines is not None:
            return f"{self.source}:{self.lines[i]}"
        return f"{self.source}: row {i + 1}"


def _read_text(path: Path) -> str:
    try:
        return decode_utf8(path.read_bytes(), path)
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror})") from None


def _read_jsonl_rows(path: Path) -> Rows:
    if not path.is_file():
        raise UserError(f"data file not found: {path}")
    rows, lines = [], []
    for line_no, line in enumerate(_read_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise UserError(f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
        lines.append(line_no)
    return non_empty(Rows(rows, str(path), lines))


def _read_json(path: Path) -> Rows:
    text = _read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # several JSON values: JSON Lines under a .json name
            return _read_jsonl_rows(path)
        raise UserError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
        lengths = {len(v) for v in data.values()}
        if len(lengths) != 1:
            raise UserError(f"{path}: column lists have different lengths ({sorted(lengths)})")
        keys = list(data)
        data = [dict(zip(keys, values)) for values in zip(*data.values())]
    if not isinstance(data, list):
        raise UserError(f"{path}: expected a list of row objects (or an object of column lists), got {type(data).__name__}")
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise UserError(f"{path}: row {i + 1}: expected a JSON object, got {type(row).__name__}")
    return non_empty(Rows(data, str(path)))


def _read_csv(path: Path) -> Rows:
    rows, lines = [], []
    empty: dict[str, list[int]] = {}  # column -> lines where its cell is empty or missing
    reader = csv.DictReader(io.StringIO(_read_text(path), newline=""))
    for row in reader:
        if None in row:
            raise UserError(f"{path}:{reader.line_num}: more values than the header has columns")
        for column, value in row.items():
            if not value:
                empty.setdefault(column, []).append(reader.line_num)
        rows.append({k: _cell(v) for k, v in row.items()})
        lines.append(reader.line_num)
    if empty and rows:
        warnings.warn(f"{path}: {describe_empty_cells(empty)} read as empty strings", stacklevel=2)
    return non_empty(Rows(rows, str(path), lines, {k: len(v) for k, v in empty.items()}))


def describe_empty_cells(empty: dict[str, list[int]]) -> str:
    """'3 empty cells (column completion: lines 4, 9; column prompt: line 7)', at most 5 lines per column."""
    total = sum(len(v) for v in empty.values())
    parts = []
    for column, lines in sorted(empty.items()):
        shown = ", ".join(map(str, lines[:5])) + (f" and {len(lines) - 5} more" if len(lines) > 5 else "")
        parts.append(f"column {column}: line{'s' if len(lines) > 1 else ''} {shown}")
    return f"{total} empty cell{'s' if total > 1 else ''} ({'; '.join(parts)})"


def _cell(value: Optional[str]) -> Any:
    """CSV cells are text; a cell holding a JSON list of role/content messages becomes that list."""
    if value and value.lstrip().startswith("[{"):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            return value
        if is_messages(parsed):
            return parsed
    return "" if value is None else value


def _read_parquet(path: Path) -> Rows:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise UserError(f"{path}: not a readable Parquet file ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    return non_empty(Rows(table.to_pylist(), str(path)))


def _read_saved_dataset(path: Path, split: Optional[str], spec: str) -> Rows:
    from datasets import DatasetDict, load_from_disk

    if not any((path / name).is_file() for name in ("dataset_dict.json", "state.json", "dataset_info.json")):
        raise UserError(
            f"{path} is a directory but not a datasets.save_to_disk folder (no dataset_dict.json or state.json); "
            f"give a {'/'.join(DATA_SUFFIXES)} file instead"
        )
    dataset = load_from_disk(str(path))
    if isinstance(dataset, DatasetDict):
        splits = list(dataset)
        if split is None:
            if "train" in dataset:
                split = "train"
            elif len(splits) == 1:
                split = splits[0]
            else:
                raise UserError(f"{path} holds splits {', '.join(splits)}; pick one as {path}:SPLIT")
        if split not in dataset:
            raise UserError(f"{path} has no split {split!r}; splits: {', '.join(splits)}")
        dataset = dataset[split]
    elif split is not None:
        raise UserError(f"{spec}: {path} holds a single dataset, not splits; drop ':{split}'")
    return non_empty(Rows(dataset.to_list(), spec))


def _read_hub(spec: str) -> Rows:
    """`name`, `name:split` or `name@config:split` -> rows of that split (default train)."""
    name, _, split = spec.partition(":")
    name, _, subset = name.partition("@")
    import datasets

    try:
        dataset = datasets.load_dataset(name, subset or None, split=split or "train")
    except Exception as e:  # not found, offline, bad split: all reported the same way
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UserError(
            f"{spec}: no such local file or folder, and loading it as a hub dataset failed "
            f"({type(e).__name__}: {first})"
        ) from None
    return non_empty(Rows(dataset.to_list(), spec))


def non_empty(rows: Rows) -> Rows:
    if not rows.rows:
        raise UserError(f"{rows.source}: no rows (the file is empty)")
    return rows


def _looks_local(spec: str) -> bool:
    return spec.endswith(DATA_SUFFIXES) or spec.startswith((".", "/", "~")) or spec.count("/") > 1


def read_source(spec: str | Path) -> Rows:
    """Rows from a local file, a save_to_disk folder (`path` or `path:split`), reasoning-gym's tasks
    (`reasoning_gym:TASK?size=N&seed=S`, `ppokit.data.reasoning_gym`) or a hub dataset name."""
    spec = str(spec)
    if is_gym_spec(spec):
        return non_empty(Rows(read_rows(spec), spec))
    path = Path(spec).expanduser()
    if path.is_file():
        readers = {".jsonl": _read_jsonl_rows, ".json": _read_json, ".csv": _read_csv, ".parquet": _read_parquet}
        reader = readers.get(path.suffix.lower())
        if reader is None:
            raise UserError(f"{path}: unknown data file type {path.suffix!r}; use one of {', '.join(DATA_SUFFIXES)}")
        return reader(path)
    if path.is_dir():
        return _read_saved_dataset(path, None, spec)
    base, sep, split = spec.rpartition(":")
    if sep and base and Path(base).expanduser().is_dir():
        return _read_saved_dataset(Path(base).expanduser(), split, spec)
    if _looks_local(spec):
        raise UserError(f"data file not found: {spec}")
    return _read_hub(spec)
