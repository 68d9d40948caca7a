"""`ppokit data inspect PATH`: what a stage will make of a data source, before training on it.

Reports the detected format, row count, columns, length percentiles (tokens with a tokenizer,
characters without), how many rows the length rule would truncate or drop at the given limits,
and the first rows rendered as the stage will see them.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Callable, Optional

from ppokit.conversation.templates import Renderer
from ppokit.config.schema import DataConfig, PPOHyperparams
from ppokit.config.stages import StageDataConfig
from ppokit.data.formats import Records, load_records, preference_triples, sft_pairs
from ppokit.errors import UserError
from ppokit.data.lengths import LengthReport, encode_prompt_text, encode_row, render_row, truncate_prompt
from ppokit.data.prompts import PromptDataset, prompt_dataset_from_records

if TYPE_CHECKING:  # torch and transformers: not for a report without a tokenizer
    from ppokit.models.loading import PositionLimit

STAGE_OF_FORMAT = {"preference": "rm", "prompt": "ppo"}  # everything else is sft data


def _ends_with_assistant(row: dict) -> bool:
    messages = row.get("messages")
    return bool(messages) and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant"


def percentiles(values: list[int]) -> dict:
    """Nearest-rank p50 / p90 / p99 and max."""
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, max(0, -(-len(ordered) * q // 100) - 1))]  # noqa: E731
    return {"p50": pick(50), "p90": pick(90), "p99": pick(99), "max": ordered[-1]}


def inspect_data(
    path: "str | Records",
    tokenizer=None,
    format: str = "auto",
    stage: Optional[str] = None,
    max_prompt_length: Optional[int] = -1,
    max_length: Optional[int] = -1,
    chat_template: Optional[str] = None,
    examples: int = 3,
    position_limit: Optional[PositionLimit] = None,
    response_length: Optional[int] = None,
    render_prompts: Optional[Callable[[PromptDataset], Optional[str]]] = None,
) -> dict:
    """-> a report dict of `path` (a data source, or its Records already read in `format`). Limits of -1 mean the
    stage's default (`data.max_prompt_length` etc.).

    With a tokenizer, rows go through the stages' own length rule (`data.encode_row`; PPO
    prompts: `data.truncate_prompt`), so the counts are what the stage will report. With the
    model's `position_limit`, rows whose sequence (PPO: prompt + `response_length`, default
    ppo.response_length's) would not fit the model are counted and the first is named.

    render_prompts: renders PPO prompts as a run does and returns the template used (`ppokit data inspect --config`:
    the run's conversation, `environments.conversation.conversation_for`, tools' schemas included); default: `chat_template` alone.
    """
    records = path if isinstance(path, Records) else load_records(path, format)
    if stage is None and records.format == "messages" and not any(_ends_with_assistant(row) for row in records.rows):
        stage = "ppo"  # no conversation has an answer to train on: they are PPO prompts
    stage = stage or STAGE_OF_FORMAT.get(records.format, "sft")
    if stage not in ("sft", "rm", "ppo"):
        raise UserError(f"--stage must be sft, rm or ppo, got {stage!r}")
    for key, value in (("max_prompt_length", max_prompt_length), ("max_length", max_length), ("response_length", response_length)):
        if value is not None and value != -1 and (not isinstance(value, int) or value < 1):
            raise UserError(f"{key} must be a whole number > 0 (or none for no limit), got {value!r}")
    defaults = DataConfig() if stage == "ppo" else StageDataConfig()
    if max_prompt_length == -1:
        max_prompt_length = defaults.max_prompt_length
    if max_length == -1:
        max_length = None if stage == "ppo" else defaults.max_length
    if response_length is None:
        response_length = PPOHyperparams().response_length
    renderer = Renderer(tokenizer, chat_template)
    template_used = None
    lengths: dict[str, list[int]] = {}
    rule = LengthReport()
    sequences: list[tuple[str, int]] = []  # (where, tokens through the model) of each kept row
    shown = []

    def add(name, value):
        lengths.setdefault(name, []).append(value)

    if stage == "ppo":
        dataset = prompt_dataset_from_records(records)
        if render_prompts is not None:
            template_used = render_prompts(dataset)
        else:
            dataset.render_chat(renderer)
        for i, prompt in enumerate(dataset.prompts):
            if tokenizer is None:
                add("prompt", len(prompt))
            else:
                ids = encode_prompt_text(tokenizer, prompt)
                add("prompt", len(ids))
                kept, truncated = truncate_prompt(ids, max_prompt_length)
                rule.add(truncated)
                sequences.append((records.where(i), len(kept) + response_length))
            if i < examples:
                prompts, columns = dataset.rows([i])
                shown.append({"prompt": _short(prompts[0]), **{k: _short(v[0]) for k, v in columns.items()}})
    else:
        items = sft_pairs(records) if stage == "sft" else preference_triples(records)
        names = COMPLETIONS[stage]
        for i, (prompt, *completions) in enumerate(items):
            where = records.where(i)
            if tokenizer is None:
                texts = render_row(renderer, prompt, completions, where)
                add("prompt", len(texts[0][0]))
                for name, (_, completion_text) in zip(names, texts):
                    add(name, len(completion_text))
            else:
                row = encode_row(renderer, tokenizer, prompt, completions, where, max_prompt_length, max_length)
                rule.add_row(row)
                texts = row.texts
                add("prompt", len(row.raw[0][0]))
                for name, (prompt_ids, completion_ids) in zip(names, row.raw):
                    add(name, len(completion_ids))
                    add("total" if stage == "sft" else f"total_{name}", len(prompt_ids) + len(completion_ids))
                if not row.dropped:
                    sequences.append((where, max(len(s) for s in row.sequences)))
            if i < examples:
                view = {"prompt": texts[0][0], **{name: completion_text for name, (_, completion_text) in zip(names, texts)}}
                if tokenizer is not None and not row.dropped:  # what the model reads: prompt + completion + EOS, not the completion alone
                    view.update({sequence_key(stage, name): tokenizer.decode(s) for name, s in zip(names, row.sequences)})
                shown.append({k: _short(v) for k, v in view.items()})
    return {
        "source": records.source,
        "format": records.format,
        "format_detected": records.detected,
        "stage": stage,
        "rows": len(records),
        "columns": records.columns,
        "length_unit": "tokens" if tokenizer is not None else "characters",
        "lengths": {name: percentiles(values) for name, values in lengths.items()},
        "limits": {"max_prompt_length": max_prompt_length, "max_length": max_length,
                   **({"response_length": response_length} if stage == "ppo" else {})},
        "length_rule": vars(rule) if tokenizer is not None else None,
        "position_limit": _positions(position_limit, sequences, stage, response_length, max_prompt_length) if tokenizer is not None else None,
        "chat_template": template_used or renderer.template_used,
        "empty_cells": records.origin.empty_cells if records.origin is not None else None,
        "examples": shown,
    }


COMPLETIONS = {"sft": ("completion",), "rm": ("chosen", "rejected")}  # the completions of a row of each stage's data


def sequence_key(stage: str, name: str) -> str:
    """An example's key for one whole sequence as the stage trains on it (`sequence`; rm: `chosen_sequence`, `rejected_sequence`)."""
    return "sequence" if stage == "sft" else f"{name}_sequence"


SEQUENCE_LEGEND = "the token ids the stage trains on, decoded: prompt + {} + EOS, after the length rule"


def _positions(limit: Optional[PositionLimit], sequences: list[tuple[str, int]], stage: str, response_length: int,
               max_prompt_length: Optional[int]):
    """Rows the model could not take: count, the first, and the key that fixes it."""
    if limit is None:
        return None
    from ppokit.models.loading import prompt_room
    from ppokit.stages.common import max_length_room

    over = limit.rows_over(sequences)
    fix = prompt_room(limit, response_length, max_prompt_length) if stage == "ppo" else max_length_room(limit)
    return {
        "tokens": limit.tokens, "key": limit.key, "rows_over": len(over),
        "first_over": {"where": over[0][0], "tokens": over[0][1]} if over else None, "fix": fix,
    }


EXAMPLE_CHARS = 300  # an example longer than this is cut (a 10 MB prompt would fill the terminal)


def _short(value, limit: int = EXAMPLE_CHARS):
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters in all)"


def format_report(report: dict) -> str:
    """The report as aligned text lines for the terminal."""
    how = "detected from the columns" if report["format_detected"] else "set by --format"
    row = lambda label, text: f"{label:<15}{text}"  # noqa: E731
    lines = [
        row("source", report["source"]),
        row("format", f"{report['format']} ({how}); read as `ppokit {report['stage']}` data"),
        row("rows", report["rows"]),
        row("columns", ", ".join(report["columns"])),
    ]
    for name, p in report["lengths"].items():
        lines.append(row(name, f"{report['length_unit']}: p50 {p['p50']}  p90 {p['p90']}  p99 {p['p99']}  max {p['max']}"))
    limits, rule = report["limits"], report["length_rule"]
    if rule is None:
        lines.append(row("limits", "give --tokenizer to count rows over max_prompt_length / max_length"))
    elif report["stage"] == "ppo":
        lines.append(row("limits", f"max_prompt_length {limits['max_prompt_length']}: {rule['prompts_truncated']} prompts truncated from the left (PPO never "
                                   "drops a prompt)"))
    else:
        lines.append(row(
            "limits",
            f"max_prompt_length {limits['max_prompt_length']}: {rule['prompts_truncated']} prompts truncated from the left "
            f"| max_length {limits['max_length']}: {rule['completions_cut']} completions cut, {rule['dropped']} rows dropped"
            + (f" ({rule['identical_pairs']} pairs with chosen == rejected)" if rule["identical_pairs"] else ""),
        ))
    if report.get("empty_cells"):
        cells = ", ".join(f"{column} {n}" for column, n in sorted(report["empty_cells"].items()))
        lines.append(row("empty cells", f"{cells} (read as empty strings)"))
    positions = report.get("position_limit")
    if positions is not None:
        first = positions["first_over"]
        lines.append(row("positions", f"model limit {positions['tokens']} ({positions['key']}): {positions['rows_over']} rows over" + (
            f" (first {first['where']}, {first['tokens']} tokens{' with the response' if report['stage'] == 'ppo' else ''}); "
            f"{positions['fix']}" if first else "")))
    if report["chat_template"] is not None:
        lines.append(row("template", report["chat_template"].replace("\n", "\\n")[:120]))
    for i, example in enumerate(report["examples"], start=1):
        lines.append(f"example {i}")
        for key, value in example.items():
            lines.append(f"  {key}: {value!r}")
    names = COMPLETIONS.get(report["stage"], ())
    keys = [sequence_key(report["stage"], name) for name in names]
    if any(key in example for key in keys for example in report["examples"]):
        lines.append(f"({', '.join(keys)}: {SEQUENCE_LEGEND.format(' / '.join(names))})")
    return "\n".join(lines)
