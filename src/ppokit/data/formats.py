"""Training data in a format: every format ppokit accepts, checked row by row, and what each stage
takes from it, with errors that name the file, the line or row, and the field.

Formats (`detect_format`, or `data.format`), decided from the columns:

    preference         prompt, chosen, rejected (strings or message lists; prompt may be left
                       out when chosen/rejected are message lists that share it)
    messages           messages: a list of {"role", "content"}
    alpaca             instruction, output (input optional)
    prompt_completion  prompt, completion (strings or message lists)
    prompt             prompt (string or message list); other columns go to reward functions

`load_records` reads a source (`ppokit.data.sources`) in a format; each stage turns its rows into
what it trains on (`sft_pairs`, `preference_triples`; PPO prompts `ppokit.data.prompts.as_prompt_dataset`).
Rendering chats is `ppokit.conversation.templates`, the length rule `ppokit.data.lengths`. docs/data.md describes all of it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ppokit.conversation.templates import Messages, Text, is_messages
from ppokit.data.sources import Rows, non_empty, read_source
from ppokit.errors import UserError

# Required columns of each format, in detection order (most specific first).
FORMAT_FIELDS: dict[str, tuple[str, ...]] = {
    "preference": ("chosen", "rejected"),
    "messages": ("messages",),
    "alpaca": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
    "prompt": ("prompt",),
}
FORMATS_ACCEPTED = (
    "prompt | prompt+completion | messages | instruction+output (+input, Alpaca) | prompt+chosen+rejected (preference)"
)


# --------------------------------------------------------------------------- formats


def detect_format(columns) -> Optional[str]:
    """The first format whose required columns are all present, or None."""
    present = set(columns)
    for name, fields_ in FORMAT_FIELDS.items():
        if set(fields_) <= present:
            return name
    return None


@dataclass
class Records:
    """Rows of one source in one format (checked row by row)."""

    rows: list[dict]
    format: str
    source: str
    columns: list[str]
    detected: bool  # True when the format came from the columns, False when data.format set it
    origin: Rows = field(repr=False, default=None)

    def __len__(self) -> int:
        return len(self.rows)

    def where(self, i: int) -> str:
        return self.origin.where(i) if self.origin is not None else f"{self.source}: row {i + 1}"

    def describe(self) -> str:
        how = f"detected from columns {', '.join(self.columns)}" if self.detected else "set by data.format"
        return f"{self.format} ({how})"


def load_records(data, format: str = "auto", prompt_field: str = "prompt") -> Records:
    """A path / hub name / list of rows / `datasets.Dataset` -> Records in the given or detected format.

    `prompt_field` names the prompt column when it is not `prompt` (it is read as `prompt`).
    """
    if isinstance(data, Rows):
        raw = data
    elif isinstance(data, (str, Path)):
        raw = read_source(data)
    elif isinstance(data, list):
        if not data:
            raise UserError("the data list is empty")
        raw = Rows([{prompt_field: r} if isinstance(r, str) else r for r in data], "<list>")
    elif hasattr(data, "column_names") and hasattr(data, "to_list"):
        raw = Rows(data.to_list(), "<dataset>")
        if not raw.rows:
            raise UserError("the dataset is empty")
    else:
        raise UserError(f"cannot read {type(data).__name__} as data; give a path, a hub name, a list of rows or a datasets.Dataset")
    non_empty(raw)
    for i, row in enumerate(raw.rows):
        if not isinstance(row, dict):
            raise UserError(f"{raw.where(i)}: expected a row object, got {type(row).__name__}")
    if prompt_field != "prompt":
        raw = _renamed_prompt_field(raw, prompt_field)
    columns = sorted({k for row in raw.rows for k in row})
    if format in (None, "auto"):
        fmt = detect_format(columns)
        if fmt is None:
            raise UserError(
                f"{raw.source}: cannot tell the data format from its columns ({', '.join(columns)}); "
                f"formats accepted: {FORMATS_ACCEPTED}"
            )
    elif format in FORMAT_FIELDS:
        fmt = format
    else:
        raise UserError(f"data.format: unknown format {format!r}; use auto or one of {', '.join(FORMAT_FIELDS)}")
    records = Records(raw.rows, fmt, raw.source, columns, detected=format in (None, "auto"), origin=raw)
    for i, row in enumerate(raw.rows):
        _check_row(records, i, row)
    return records


def _renamed_prompt_field(raw: Rows, prompt_field: str) -> Rows:
    """Rows with column `prompt_field` read as `prompt`; a row without it is an error (no fall-back
    to a `prompt` column), and so is a row holding both (one would hide the other)."""
    renamed = []
    for i, row in enumerate(raw.rows):
        if prompt_field not in row:
            if not any(prompt_field in r for r in raw.rows):
                columns = sorted({k for r in raw.rows for k in r})
                raise UserError(f"{raw.source}: data.prompt_field is {prompt_field!r} but the data has no such column (columns: {', '.join(columns)})")
            raise UserError(f"{raw.where(i)}: no field {prompt_field} (data.prompt_field); the row has {', '.join(sorted(row)) or 'nothing'}")
        if "prompt" in row:
            raise UserError(
                f"{raw.where(i)}: data.prompt_field is {prompt_field!r} but the row also has a prompt column; "
                "the prompt field is read as `prompt`, so one would hide the other: rename one of them"
            )
        row = dict(row)
        row["prompt"] = row.pop(prompt_field)
        renamed.append(row)
    return Rows(renamed, raw.source, raw.lines, raw.empty_cells)


def _check_row(records: Records, i: int, row: dict) -> None:
    fmt = records.format
    required = list(FORMAT_FIELDS[fmt])
    if fmt == "preference" and not (is_messages(row.get("chosen")) and is_messages(row.get("rejected"))):
        required = ["prompt", *required]  # only message lists can carry their prompt inside
    nulls = [k for k in required if k in row and row[k] is None]
    if nulls:
        raise UserError(
            f"{records.where(i)}: field{'s' if len(nulls) > 1 else ''} {', '.join(nulls)} "
            f"{'are' if len(nulls) > 1 else 'is'} null; the {fmt} format needs a string or a list of {{role, content}} messages there"
        )
    missing = [k for k in required if row.get(k) is None]
    if missing:
        raise UserError(
            f"{records.where(i)}: missing field(s) {', '.join(missing)} of the {fmt} format "
            f"(it needs {', '.join(required)}; the row has {', '.join(sorted(row)) or 'nothing'}); "
            f"formats accepted: {FORMATS_ACCEPTED}"
        )
    texts = {"messages": ("messages",), "alpaca": ("instruction", "output")}.get(fmt, required)
    if fmt == "preference" and row.get("prompt") is not None:
        texts = ["prompt", "chosen", "rejected"]
    for key in texts:
        value = row[key]
        if key == "messages" and not is_messages(value):
            raise UserError(f"{records.where(i)}: field messages must be a non-empty list of {{role, content}} objects with string values")
        if not isinstance(value, str) and not is_messages(value):
            raise UserError(
                f"{records.where(i)}: field {key} must be a string or a list of {{role, content}} messages, "
                f"got {type(value).__name__}"
            )
    if fmt == "alpaca" and row.get("input") is not None and not isinstance(row["input"], str):
        raise UserError(f"{records.where(i)}: field input must be a string")


# --------------------------------------------------------------------------- per stage


STAGE_NEEDS = {
    "sft": "prompt+completion, messages or Alpaca instruction/output rows",
    "rm": "preference pairs: prompt, chosen and rejected (strings or message lists)",
}


def _wrong_data(records: Records, stage: str, hint: str) -> UserError:
    return UserError(
        f"{records.source}: `ppokit {stage}` needs {STAGE_NEEDS[stage]}; this data is in the "
        f"{records.describe()} format. {hint}"
    )


def alpaca_prompt(row: dict) -> Messages:
    text = row["instruction"] if not row.get("input") else f"{row['instruction']}\n\n{row['input']}"
    return [{"role": "user", "content": text}]


def sft_pairs(records: Records) -> list[tuple[Text, Text]]:
    """(prompt, completion) per row. For `messages` the completion is the last message (an
    assistant turn) and everything before it is the prompt."""
    if records.format == "preference":
        raise _wrong_data(records, "sft", "Train a reward model on it with `ppokit rm`, or give prompt/completion data.")
    if records.format == "prompt":
        raise _wrong_data(records, "sft", "Prompt-only rows have nothing to imitate; they are PPO prompts (`ppokit ppo`).")
    pairs = []
    for i, row in enumerate(records.rows):
        if records.format == "prompt_completion":
            pairs.append((row["prompt"], row["completion"]))
        elif records.format == "alpaca":
            pairs.append((alpaca_prompt(row), [{"role": "assistant", "content": row["output"]}]))
        else:
            messages = row["messages"]
            if messages[-1]["role"] != "assistant":
                raise UserError(f"{records.where(i)}: the last message must be the assistant's (it is the completion trained on), got role "
                                f"{messages[-1]['role']!r}")
            pairs.append((messages[:-1], messages[-1:]))
    return pairs


def preference_triples(records: Records) -> list[tuple[Text, Text, Text]]:
    """(prompt, chosen, rejected) per row; message lists without a prompt column share it as a prefix."""
    if records.format != "preference":
        raise _wrong_data(records, "rm", "Add chosen and rejected completions for each prompt.")
    triples = []
    for i, row in enumerate(records.rows):
        chosen, rejected = row["chosen"], row["rejected"]
        prompt = row.get("prompt")
        if prompt is None:
            common = 0
            while common < min(len(chosen), len(rejected)) - 1 and chosen[common] == rejected[common]:
                common += 1
            prompt, chosen, rejected = chosen[:common], chosen[common:], rejected[common:]
        triples.append((prompt, chosen, rejected))
    return triples


def split_eval(items: list, fraction: float, seed: int) -> tuple[list, list]:
    """A seeded shuffle holds out round(len * fraction) items (at least one) -> (train, eval)."""
    if not fraction:
        return items, []
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(len(items) * fraction))
    if n_eval >= len(items):
        raise UserError(
            f"data.eval_fraction={fraction} holds out all {len(items)} rows; add rows, lower eval_fraction or give data.eval"
        )
    held = set(order[:n_eval])
    return [x for i, x in enumerate(items) if i not in held], [items[i] for i in order[:n_eval]]
