"""Reading training data: every source and format ppokit accepts, with errors that name the file,
the line or row, and the field.

Sources (`read_source`): local JSONL, JSON, CSV and Parquet files, `datasets.save_to_disk`
folders, and hub dataset names loaded with `datasets.load_dataset`.

Formats (`detect_format`, or `data.format`), decided from the columns:

    preference         prompt, chosen, rejected (strings or message lists; prompt may be left
                       out when chosen/rejected are message lists that share it)
    messages           messages: a list of {"role", "content"}
    alpaca             instruction, output (input optional)
    prompt_completion  prompt, completion (strings or message lists)
    prompt             prompt (string or message list); other columns go to reward functions

Each stage turns rows into what it trains on (`sft_pairs`, `preference_triples`,
`as_prompt_dataset`); `Renderer` turns message lists into text with the tokenizer's chat
template (or `PLAIN_CHAT_TEMPLATE` when it has none); `tokenize_pair` and `fit_lengths`
make token ids under the documented length rule. docs/data.md describes all of it.
"""

from __future__ import annotations

import csv
import io
import json
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from ppokit.errors import UserError

Messages = list[dict]
Text = Union[str, Messages]  # a string, or a chat as role/content messages

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
DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")

# The fallback chat template, for tokenizers without one: "role: content" lines, and
# "assistant:" as the generation prompt. Plain text, so any tokenizer can encode it.
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


# --------------------------------------------------------------------------- sources


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


def decode_utf8(raw: bytes, path: str | Path) -> str:
    """File bytes -> text, or a UserError naming the file and the line of the first byte that is not
    UTF-8. A leading byte-order mark is dropped (it would otherwise end up in the first key or column name)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise UserError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x}); save the file as UTF-8") from None
    return text.removeprefix("\ufeff")


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
    return _non_empty(Rows(rows, str(path), lines))


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
    return _non_empty(Rows(data, str(path)))


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
    return _non_empty(Rows(rows, str(path), lines, {k: len(v) for k, v in empty.items()}))


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
        if _is_messages(parsed):
            return parsed
    return "" if value is None else value


def _read_parquet(path: Path) -> Rows:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise UserError(f"{path}: not a readable Parquet file ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    return _non_empty(Rows(table.to_pylist(), str(path)))


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
    return _non_empty(Rows(dataset.to_list(), spec))


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
    return _non_empty(Rows(dataset.to_list(), spec))


def _non_empty(rows: Rows) -> Rows:
    if not rows.rows:
        raise UserError(f"{rows.source}: no rows (the file is empty)")
    return rows


def _looks_local(spec: str) -> bool:
    return spec.endswith(DATA_SUFFIXES) or spec.startswith((".", "/", "~")) or spec.count("/") > 1


def read_source(spec: str | Path) -> Rows:
    """Rows from a local file, a save_to_disk folder (`path` or `path:split`) or a hub dataset name."""
    spec = str(spec)
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


# --------------------------------------------------------------------------- formats


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    )


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
    _non_empty(raw)
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
    if fmt == "preference" and not (_is_messages(row.get("chosen")) and _is_messages(row.get("rejected"))):
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
        if key == "messages" and not _is_messages(value):
            raise UserError(f"{records.where(i)}: field messages must be a non-empty list of {{role, content}} objects with string values")
        if not isinstance(value, str) and not _is_messages(value):
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


def _alpaca_prompt(row: dict) -> Messages:
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
            pairs.append((_alpaca_prompt(row), [{"role": "assistant", "content": row["output"]}]))
        else:
            messages = row["messages"]
            if messages[-1]["role"] != "assistant":
                raise UserError(f"{records.where(i)}: the last message must be the assistant's (it is the completion trained on), got role {messages[-1]['role']!r}")
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


# --------------------------------------------------------------------------- rendering and tokens


def resolve_chat_template(tokenizer, requested: Optional[str]) -> str:
    """The template to use: null/`auto` -> the tokenizer's, else PLAIN_CHAT_TEMPLATE; `plain`;
    `tokenizer` (must exist); a path to a .jinja file; or the Jinja text itself."""
    own = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if isinstance(own, dict):  # several named templates: the default one
        own = own.get("default")
    if requested in (None, "auto"):
        return own or PLAIN_CHAT_TEMPLATE
    if requested == "plain":
        return PLAIN_CHAT_TEMPLATE
    if requested == "tokenizer":
        if not own:
            raise UserError("data.chat_template is 'tokenizer' but the tokenizer has no chat template; use auto or plain")
        return own
    if requested.endswith(".jinja"):
        path = Path(requested).expanduser()
        if not path.is_file():
            raise UserError(f"data.chat_template: file {requested} not found")
        return path.read_text(encoding="utf-8")
    return requested


class Renderer:
    """Turns prompts and completions (strings, or message lists) into the text the model sees.

    Strings pass through unchanged. Message lists go through the chat template chosen by
    `resolve_chat_template`; a BOS token the template writes is removed when the tokenizer adds
    one itself, so it is not doubled. `template_used` is the template text once any chat was
    rendered (the stage records it in its config and saves it with the tokenizer).
    """

    def __init__(self, tokenizer=None, chat_template: Optional[str] = None):
        self.tokenizer = tokenizer
        self.requested = chat_template
        self.template_used: Optional[str] = None
        self._strip_bos: Optional[str] = None

    def _chat(self, messages: Messages, add_generation_prompt: bool) -> str:
        if self.template_used is None:
            self.template_used = resolve_chat_template(self.tokenizer, self.requested)
            self._strip_bos = _bos_added_by(self.tokenizer)
        if self.tokenizer is None:
            import jinja2

            text = jinja2.Template(self.template_used).render(messages=messages, add_generation_prompt=add_generation_prompt)
        else:
            try:
                text = self.tokenizer.apply_chat_template(
                    messages, chat_template=self.template_used, add_generation_prompt=add_generation_prompt, tokenize=False
                )
            except Exception as e:  # a Jinja error in a user's template
                raise UserError(f"data.chat_template: rendering failed ({type(e).__name__}: {e})") from None
        if self._strip_bos and text.startswith(self._strip_bos):
            text = text[len(self._strip_bos) :]
        return text

    def prompt(self, prompt: Text) -> str:
        return prompt if isinstance(prompt, str) else self._chat(prompt, add_generation_prompt=True)

    def pair(self, prompt: Text, completion: Text, where: str = "") -> tuple[str, str]:
        """-> (prompt text, completion text); chat completions are the rendered conversation's tail."""
        if isinstance(prompt, str) and isinstance(completion, str):
            return prompt, completion
        prompt_messages = prompt if not isinstance(prompt, str) else [{"role": "user", "content": prompt}]
        completion_messages = completion if not isinstance(completion, str) else [{"role": "assistant", "content": completion}]
        prompt_text = self._chat(prompt_messages, add_generation_prompt=True)
        full = self._chat(prompt_messages + completion_messages, add_generation_prompt=False)
        if not full.startswith(prompt_text):
            raise UserError(
                f"{where}: the chat template renders the conversation so that it does not begin with its "
                f"rendered prompt; the completion cannot be separated (set data.chat_template=plain or another template)"
            )
        return prompt_text, full[len(prompt_text) :]


def describe_template(template: str) -> str:
    return "the plain fallback template (role: content lines)" if template == PLAIN_CHAT_TEMPLATE else "the chat template"


def _bos_added_by(tokenizer) -> Optional[str]:
    """The BOS string when the tokenizer prepends BOS by itself, else None."""
    if tokenizer is None or tokenizer.bos_token is None or tokenizer.bos_token_id is None:
        return None
    ids = tokenizer("a")["input_ids"]
    return tokenizer.bos_token if ids[:1] == [tokenizer.bos_token_id] else None


def tokenize_pair(tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """-> (prompt ids with the tokenizer's special tokens, completion ids ending with EOS).

    Prompt and completion are encoded separately, as PPO samples completions after the prompt's
    tokens. EOS is appended unless the completion already ends with it (some chat templates write it).
    """
    if tokenizer.eos_token_id is None:
        raise UserError(
            "the tokenizer has no EOS token; every completion ends with EOS so that the model learns to stop: "
            "set the tokenizer's eos_token and save it again (or give another `tokenizer`)"
        )
    prompt_ids = encode_prompt_text(tokenizer, prompt)
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    if not completion_ids or completion_ids[-1] != tokenizer.eos_token_id:
        completion_ids = completion_ids + [tokenizer.eos_token_id]
    return prompt_ids, completion_ids


def encode_prompt_text(tokenizer, prompt: str) -> list[int]:
    """A prompt's token ids, the tokenizer's special tokens included: what every stage and PPO encode."""
    return tokenizer(prompt)["input_ids"]


def truncate_prompt(prompt_ids: list[int], max_prompt_length: Optional[int]) -> tuple[list[int], bool]:
    """Rule 1 of the length rule: a prompt over max_prompt_length keeps its last tokens (the end is
    what the completion continues) -> (ids, truncated?). PPO prompts follow only this rule."""
    if max_prompt_length is not None and len(prompt_ids) > max_prompt_length:
        return prompt_ids[-max_prompt_length:], True
    return prompt_ids, False


@dataclass
class LengthReport:
    """What the length rule did to a set of rows (reported by every stage and `data inspect`).

    prompts_truncated counts every row whose prompt was truncated (dropped ones too);
    completions_cut counts kept rows with a completion cut; dropped, rows left out, of which
    identical_pairs are preference pairs whose chosen and rejected were the same already in the data.
    """

    rows: int = 0
    prompts_truncated: int = 0
    completions_cut: int = 0
    dropped: int = 0
    identical_pairs: int = 0

    def add(self, prompt_truncated: bool, completion_cut: bool = False, dropped: bool = False, identical: bool = False) -> None:
        self.rows += 1
        self.prompts_truncated += prompt_truncated
        self.completions_cut += completion_cut
        self.dropped += dropped
        self.identical_pairs += identical

    def add_row(self, row: "EncodedRow") -> None:
        self.add(row.prompt_truncated, row.completion_cut, row.dropped, row.identical)

    def describe(self, max_prompt_length, max_length) -> str:
        identical = f" ({self.identical_pairs} of them pairs whose chosen and rejected are the same)" if self.identical_pairs else ""
        return (
            f"{self.prompts_truncated} of {self.rows} prompts over max_prompt_length={max_prompt_length} truncated "
            f"from the left, {self.completions_cut} completions cut at max_length={max_length}, {self.dropped} rows dropped"
            f"{identical}"
        )


def fit_lengths(
    prompt_ids: list[int], completion_ids: list[int], max_prompt_length: Optional[int], max_length: Optional[int]
) -> tuple[Optional[tuple[list[int], list[int]]], bool, bool]:
    """The length rule on one sequence -> ((prompt_ids, completion_ids) or None when dropped,
    prompt truncated?, completion cut?).

    1. A prompt over max_prompt_length keeps its last max_prompt_length tokens (truncated from
       the left: the end is what the completion continues).
    2. A prompt + completion over max_length has its completion cut on the right.
    3. A row whose prompt leaves no room for a completion token is dropped.
    """
    prompt_ids, prompt_cut = truncate_prompt(prompt_ids, max_prompt_length)
    completion_cut = False
    if max_length is not None and len(prompt_ids) + len(completion_ids) > max_length:
        room = max_length - len(prompt_ids)
        if room < 1:
            return None, prompt_cut, False
        completion_ids, completion_cut = completion_ids[:room], True
    return (prompt_ids, completion_ids), prompt_cut, completion_cut


@dataclass
class EncodedRow:
    """One sft or rm row under the length rule.

    raw: (prompt ids, completion ids) per completion as encoded, before the rule;
    fitted: the same after it, or None when the row is dropped.
    """

    where: str
    texts: list[tuple[str, str]]  # (prompt text, completion text) per completion, as rendered
    raw: list[tuple[list[int], list[int]]]
    fitted: Optional[list[tuple[list[int], list[int]]]]
    prompt_truncated: bool
    any_completion_cut: bool

    @property
    def dropped(self) -> bool:
        return self.fitted is None

    @property
    def identical(self) -> bool:
        """Several completions that were the same before any cut (a preference pair with nothing to prefer)."""
        return len(self.raw) > 1 and all(r == self.raw[0] for r in self.raw[1:])

    @property
    def completion_cut(self) -> bool:
        """A kept row with a completion cut (a dropped row counts as dropped only)."""
        return self.any_completion_cut and not self.dropped

    @property
    def sequences(self) -> list[list[int]]:
        """prompt + completion ids of each completion, after the rule (the row must be kept)."""
        return [p + c for p, c in self.fitted]


def encode_row(
    renderer: Renderer, tokenizer, prompt: Text, completions: list[Text], where: str,
    max_prompt_length: Optional[int], max_length: Optional[int],
) -> EncodedRow:
    """Render, encode and fit one row with one or more completions (sft: one; rm: chosen, rejected).

    Every (prompt, completion) follows `fit_lengths`; the row is dropped when any is dropped, or,
    with several completions, when cutting made them identical (no preference left to learn).
    Used by `ppokit sft`, `ppokit rm` and `ppokit data inspect`, so their counts agree.
    """
    texts = render_row(renderer, prompt, completions, where)
    raw = [tokenize_pair(tokenizer, prompt_text, completion_text) for prompt_text, completion_text in texts]
    fits = [fit_lengths(p, c, max_prompt_length, max_length) for p, c in raw]
    fitted: Optional[list] = [f for f, _, _ in fits]
    if any(f is None for f in fitted) or (len(fitted) > 1 and all(f == fitted[0] for f in fitted[1:])):
        fitted = None
    return EncodedRow(
        where, texts, raw, fitted, prompt_truncated=any(p for _, p, _ in fits), any_completion_cut=any(c for _, _, c in fits)
    )


def render_row(renderer: Renderer, prompt: Text, completions: list[Text], where: str) -> list[tuple[str, str]]:
    """(prompt text, completion text) per completion, as the model sees them."""
    return [renderer.pair(prompt, completion, where) for completion in completions]


def encode_rows(
    items: list[tuple[str, tuple]], renderer: Renderer, tokenizer, max_prompt_length: Optional[int],
    max_length: Optional[int],
) -> tuple[list[EncodedRow], LengthReport]:
    """(where, (prompt, *completions)) items -> (kept rows, what the rule did)."""
    kept, report = [], LengthReport()
    for where, (prompt, *completions) in items:
        row = encode_row(renderer, tokenizer, prompt, completions, where, max_prompt_length, max_length)
        report.add_row(row)
        if not row.dropped:
            kept.append(row)
    return kept, report


# --------------------------------------------------------------------------- PPO prompts


@dataclass
class PromptDataset:
    """Rows of PPO prompts: `prompts[i]` is the prompt text, `columns[name][i]` any other field.

    Chat prompts (message lists) are kept in `chat` until `render_chat` turns them into text
    with the policy's tokenizer; `prompts[i]` is None until then.
    """

    prompts: list[Optional[str]]
    columns: dict[str, list[Any]]
    source: str
    chat: Optional[list[Optional[Messages]]] = None
    format: str = "prompt"
    locations: Optional[list[str]] = None  # where each row is (`file:line`), for error messages

    def __len__(self) -> int:
        return len(self.prompts)

    def where(self, i: int) -> str:
        """`file:line` (or `source: row n`, from 1) of prompt i (0-based)."""
        return self.locations[i] if self.locations is not None else f"{self.source}: row {i + 1}"

    def rows(self, indices) -> tuple[list[str], dict[str, list[Any]]]:
        idx = [int(i) for i in indices]
        return [self.prompts[i] for i in idx], {k: [v[i] for i in idx] for k, v in self.columns.items()}

    def subset(self, indices: list[int]) -> "PromptDataset":
        chat = [self.chat[i] for i in indices] if self.chat is not None else None
        prompts, columns = self.rows(indices)
        locations = [self.where(i) for i in indices]
        return PromptDataset(prompts, columns, self.source, chat, self.format, locations)

    def split(self, fraction: float, seed: int) -> tuple["PromptDataset", "PromptDataset"]:
        """(train, eval) by a seeded shuffle, as `split_eval`."""
        train, held = split_eval(list(range(len(self))), fraction, seed)
        return self.subset(train), self.subset(held)

    def render_chat(self, renderer: Renderer) -> None:
        """Render chat prompts with a generation prompt; no-op for text prompts."""
        if self.chat is None:
            return
        for i, messages in enumerate(self.chat):
            if messages is not None:
                self.prompts[i] = renderer.prompt(messages)
        self.chat = None


def render_chat_prompts(tokenizer, chat_template: Optional[str], *datasets_: Optional[PromptDataset]) -> Optional[str]:
    """Render every chat prompt of the given datasets; -> the template used, or None if none was needed."""
    renderer = Renderer(tokenizer, chat_template)
    for dataset in datasets_:
        if dataset is not None:
            dataset.render_chat(renderer)
    return renderer.template_used


def prompt_dataset_from_records(records: Records) -> PromptDataset:
    """Any format with a prompt -> PromptDataset. Every column except the prompt column goes to
    reward functions (a `messages` chat minus a final assistant turn is the prompt; the full
    conversation stays available as the `messages` column)."""
    prompts, chat = [], []
    for i, row in enumerate(records.rows):
        if records.format == "alpaca":
            value: Text = _alpaca_prompt(row)
        elif records.format == "messages":
            value = row["messages"][:-1] if row["messages"][-1]["role"] == "assistant" else row["messages"]
            if not value:
                raise UserError(f"{records.where(i)}: the conversation is a single assistant message; there is no prompt")
        else:
            value = row.get("prompt")
            if value is None:
                raise UserError(f"{records.where(i)}: a PPO prompt needs a prompt column; formats accepted: {FORMATS_ACCEPTED}")
        if isinstance(value, str) and not value.strip():
            # Found here, before any model loads: the policy would have nothing to continue.
            raise UserError(f"{records.where(i)}: the prompt is empty")
        prompts.append(value if isinstance(value, str) else None)
        chat.append(None if isinstance(value, str) else value)
    other = [c for c in records.columns if c != "prompt"]
    columns = {k: [row.get(k) for row in records.rows] for k in other}
    has_chat = any(c is not None for c in chat)
    locations = [records.where(i) for i in range(len(records))]
    return PromptDataset(prompts, columns, records.source, chat if has_chat else None, records.format, locations)


def as_prompt_dataset(data, prompt_field: str = "prompt", format: str = "auto") -> PromptDataset:
    """Accepts a PromptDataset, a path or hub name, a list of strings or dicts, or a `datasets.Dataset`."""
    if isinstance(data, PromptDataset):
        return data
    return prompt_dataset_from_records(load_records(data, format, prompt_field))
