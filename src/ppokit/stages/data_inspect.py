"""`ppokit data inspect PATH`: what a stage will make of a data source, before training on it.

Reports the detected format, row count, columns, length percentiles (tokens with a tokenizer,
characters without), how many rows the length rule would truncate or drop at the given limits,
and the first rows rendered as the stage will see them.
"""

from __future__ import annotations

import json
from typing import Optional

from ppokit.config import DataConfig, StageDataConfig
from ppokit.data import (
    LengthReport,
    Renderer,
    fit_lengths,
    load_records,
    preference_triples,
    prompt_dataset_from_records,
    sft_pairs,
    tokenize_pair,
)
from ppokit.errors import UserError

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
    path: str,
    tokenizer=None,
    format: str = "auto",
    stage: Optional[str] = None,
    max_prompt_length: Optional[int] = -1,
    max_length: Optional[int] = -1,
    chat_template: Optional[str] = None,
    examples: int = 3,
) -> dict:
    """-> a report dict. Limits of -1 mean the stage's default (`data.max_prompt_length` etc.)."""
    records = load_records(path, format)
    if stage is None and records.format == "messages" and not any(_ends_with_assistant(row) for row in records.rows):
        stage = "ppo"  # no conversation has an answer to train on: they are PPO prompts
    stage = stage or STAGE_OF_FORMAT.get(records.format, "sft")
    if stage not in ("sft", "rm", "ppo"):
        raise UserError(f"--stage must be sft, rm or ppo, got {stage!r}")
    defaults = DataConfig() if stage == "ppo" else StageDataConfig()
    if max_prompt_length == -1:
        max_prompt_length = defaults.max_prompt_length
    if max_length == -1:
        max_length = None if stage == "ppo" else defaults.max_length
    renderer = Renderer(tokenizer, chat_template)
    count = (lambda text, special=True: len(tokenizer(text, add_special_tokens=special)["input_ids"])) if tokenizer else (lambda text, special=True: len(text))
    lengths: dict[str, list[int]] = {}
    rule = LengthReport()
    shown = []

    def add(name, value):
        lengths.setdefault(name, []).append(value)

    if stage == "ppo":
        dataset = prompt_dataset_from_records(records)
        dataset.render_chat(renderer)
        for i, prompt in enumerate(dataset.prompts):
            n = count(prompt)
            add("prompt", n)
            rule.rows += 1
            rule.prompts_truncated += tokenizer is not None and max_prompt_length is not None and n > max_prompt_length
            if i < examples:
                prompts, columns = dataset.rows([i])
                shown.append({"prompt": _short(prompts[0]), **{k: _short(v[0]) for k, v in columns.items()}})
    else:
        items = sft_pairs(records) if stage == "sft" else preference_triples(records)
        names = ("completion",) if stage == "sft" else ("chosen", "rejected")
        for i, (prompt, *completions) in enumerate(items):
            rule.rows += 1
            row_view: dict = {}
            dropped = prompt_cut = any_cut = False
            for name, completion in zip(names, completions):
                prompt_text, completion_text = renderer.pair(prompt, completion, records.where(i))
                row_view["prompt"] = prompt_text
                row_view[name] = completion_text
                if tokenizer is None:
                    if name == names[0]:
                        add("prompt", len(prompt_text))
                    add(name, len(completion_text))
                    continue
                prompt_ids, completion_ids = tokenize_pair(tokenizer, prompt_text, completion_text)
                if name == names[0]:
                    add("prompt", len(prompt_ids))
                add(name, len(completion_ids))
                add("total" if stage == "sft" else f"total_{name}", len(prompt_ids) + len(completion_ids))
                fitted, p_cut, c_cut = fit_lengths(prompt_ids, completion_ids, max_prompt_length, max_length)
                prompt_cut, any_cut, dropped = prompt_cut or p_cut, any_cut or c_cut, dropped or fitted is None
                if fitted is not None:
                    row_view[f"{name}_tokens"] = tokenizer.decode(fitted[0] + fitted[1])
            rule.prompts_truncated += prompt_cut
            rule.completions_cut += any_cut and not dropped
            rule.dropped += dropped
            if i < examples:
                shown.append({k: _short(v) for k, v in row_view.items()})
    return {
        "source": records.source,
        "format": records.format,
        "format_detected": records.detected,
        "stage": stage,
        "rows": len(records),
        "columns": records.columns,
        "length_unit": "tokens" if tokenizer is not None else "characters",
        "lengths": {name: percentiles(values) for name, values in lengths.items()},
        "limits": {"max_prompt_length": max_prompt_length, "max_length": max_length},
        "length_rule": vars(rule) if tokenizer is not None else None,
        "chat_template": renderer.template_used,
        "empty_cells": records.origin.empty_cells if records.origin is not None else None,
        "examples": shown,
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
        lines.append(row("limits", f"max_prompt_length {limits['max_prompt_length']}: {rule['prompts_truncated']} prompts truncated from the left (PPO never drops a prompt)"))
    else:
        lines.append(row(
            "limits",
            f"max_prompt_length {limits['max_prompt_length']}: {rule['prompts_truncated']} prompts truncated from the left "
            f"| max_length {limits['max_length']}: {rule['completions_cut']} completions cut, {rule['dropped']} rows dropped",
        ))
    if report.get("empty_cells"):
        cells = ", ".join(f"{column} {n}" for column, n in sorted(report["empty_cells"].items()))
        lines.append(row("empty cells", f"{cells} (read as empty strings)"))
    if report["chat_template"] is not None:
        lines.append(row("template", report["chat_template"].replace("\n", "\\n")[:120]))
    for i, example in enumerate(report["examples"], start=1):
        lines.append(f"example {i}")
        for key, value in example.items():
            lines.append(f"  {key}: {value!r}")
    return "\n".join(lines)
