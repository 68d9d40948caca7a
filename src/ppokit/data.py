"""Reading prompt data, with errors that name the file, the line and the field."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppokit.errors import UserError


@dataclass
class PromptDataset:
    """Rows of a prompt file: `prompts[i]` is the prompt text, `columns[name][i]` any other field."""

    prompts: list[str]
    columns: dict[str, list[Any]]
    source: str

    def __len__(self) -> int:
        return len(self.prompts)

    def rows(self, indices) -> tuple[list[str], dict[str, list[Any]]]:
        idx = [int(i) for i in indices]
        return [self.prompts[i] for i in idx], {k: [v[i] for i in idx] for k, v in self.columns.items()}


def read_jsonl(path: str | Path) -> list[dict]:
    """Every non-blank line of a JSONL file as a dict; a bad line is a UserError naming file and line."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"data file not found: {path}")
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    if not rows:
        raise UserError(f"{path}: no rows (the file is empty)")
    return rows


def prompts_from_rows(rows: list[dict], source: str, prompt_field: str = "prompt") -> PromptDataset:
    prompts = []
    for i, row in enumerate(rows):
        value = row.get(prompt_field)
        if not isinstance(value, str):
            got = "missing" if value is None else f"a {type(value).__name__}"
            raise UserError(
                f"{source}: row {i}: field {prompt_field!r} is {got}; a prompt dataset needs a string "
                f"{prompt_field!r} in every row (columns seen: {', '.join(sorted(row)) or 'none'})"
            )
        prompts.append(value)
    other = sorted({k for row in rows for k in row} - {prompt_field})
    columns = {k: [row.get(k) for row in rows] for k in other}
    return PromptDataset(prompts=prompts, columns=columns, source=source)


def load_prompts(path: str | Path, prompt_field: str = "prompt") -> PromptDataset:
    """A JSONL prompt file -> PromptDataset."""
    return prompts_from_rows(read_jsonl(path), str(path), prompt_field)


def as_prompt_dataset(data, prompt_field: str = "prompt") -> PromptDataset:
    """Accepts a PromptDataset, a path, a list of strings or dicts, or a `datasets.Dataset`."""
    if isinstance(data, PromptDataset):
        return data
    if isinstance(data, (str, Path)):
        return load_prompts(data, prompt_field)
    if isinstance(data, list):
        rows = [{prompt_field: r} if isinstance(r, str) else r for r in data]
        if not rows:
            raise UserError("the prompt list is empty")
        return prompts_from_rows(rows, "<list>", prompt_field)
    if hasattr(data, "column_names") and hasattr(data, "to_list"):
        rows = data.to_list()
        if not rows:
            raise UserError("the prompt dataset is empty")
        return prompts_from_rows(rows, "<dataset>", prompt_field)
    raise UserError(f"cannot use {type(data).__name__} as prompt data; give a path, a list or a datasets.Dataset")
