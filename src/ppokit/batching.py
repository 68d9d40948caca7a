"""Micro-batches by a token budget: rows of similar length together, each trimmed to its own widest row.

A rollout row is a left-padded prompt followed by a right-padded response (`ppokit.rollout.Rollout`):

    query   [pad pad p p p]   response [r r r stop pad pad]
    query   [p p p p p p p]   response [r stop pad pad pad]

Padded to the widest prompt and the longest response of the whole batch, a row of a short prompt and a
short response costs as much as the longest one. Here, rows are sorted by length within a minibatch and
packed greedily into micro-batches whose trimmed tensor fits a token budget; each micro-batch keeps only
the prompt columns its own rows use (from the left) and the response columns up to its own longest
response (from the right). Positions come from the attention mask (`models.position_ids_from_mask`), so
dropping columns that are padding in every row changes no position, no attention and no logit.

What the budget bounds: rows x (widest prompt + longest response) of the micro-batch, i.e. the trimmed
tensor the forward pass sees, padding left inside it included. The real prompt + response tokens of the
rows are therefore within it too; the bound is on what costs memory. A row longer than the budget
cannot be placed: `plan_micro_batches` raises `BudgetTooSmall` naming both numbers (the trainer checks
the longest row a run can produce, longest prompt + `response_length`, before any model loads).

The order of the micro-batches and of the rows in them depends only on the row lengths and the order of
the rows given (the minibatch's seeded shuffle): the same seed gives the same plan. Widest micro-batch
first, so a budget too large for the device fails on the first micro-batch, not the last.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Optional

import torch

from ppokit.errors import UserError
from ppokit.rollout import Rollout


class BudgetTooSmall(UserError):
    """A single row is wider than the token budget (a user's setting, so a UserError naming both numbers)."""


def row_spans(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first real column (B,), one past the last real column (B,)) of each row of mask (B, L).

    A left-padded prompt followed by a right-padded response is one contiguous span; so is any row
    padded on either side. A row without real tokens gets the empty span (0, 0).
    """
    width = mask.shape[1]
    columns = torch.arange(width, device=mask.device)
    real = mask.bool()
    start = torch.where(real, columns, torch.full_like(columns, width)).min(1).values
    end = torch.where(real, columns + 1, torch.zeros_like(columns)).max(1).values
    return torch.where(end > 0, start, torch.zeros_like(start)), end


def plan_micro_batches(rows: torch.Tensor, start: torch.Tensor, end: torch.Tensor, max_tokens: int) -> list[torch.Tensor]:
    """Split `rows` (indices into the batch, in minibatch order) into micro-batches within `max_tokens`.

    rows: (n,) long; start, end: (B,) long, each row's real span (`row_spans`) over the whole batch
    -> list of (n_i,) long index tensors that together hold every row of `rows` once.
    Rows are sorted by span length, longest first (stable, so equal lengths keep the minibatch's
    seeded order), and packed greedily: a row joins the current micro-batch while
    rows x (the micro-batch's last real column - its first) stays within `max_tokens`.
    """
    if rows.numel() == 0:
        return []
    starts, ends = start[rows].tolist(), end[rows].tolist()
    order = sorted(range(len(starts)), key=lambda i: starts[i] - ends[i])  # longest first; sorted() is stable
    widest = ends[order[0]] - starts[order[0]]
    if widest > max_tokens:
        raise BudgetTooSmall(f"a row of {widest} tokens is longer than ppo.max_tokens_per_micro_batch={max_tokens}")
    groups: list[list[int]] = []
    current: list[int] = []
    lo = hi = 0
    for i in order:
        new_lo, new_hi = (min(lo, starts[i]), max(hi, ends[i])) if current else (starts[i], ends[i])
        if current and (len(current) + 1) * (new_hi - new_lo) > max_tokens:
            groups.append(current)
            current, new_lo, new_hi = [], starts[i], ends[i]
        current.append(i)
        lo, hi = new_lo, new_hi
    groups.append(current)
    rows_list = rows.tolist()
    return [torch.tensor([rows_list[i] for i in g], dtype=torch.long, device=rows.device) for g in groups]


def plan_rows(rows: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Fixed micro-batches of `size` rows in the given order (TRL's semantics; no sorting, no trimming)."""
    return list(rows.split(size))


def plan_rollout(rows: torch.Tensor, rollout: Rollout, max_tokens: int) -> list[torch.Tensor]:
    """`plan_micro_batches` over a rollout's rows (prompt + response spans)."""
    return plan_micro_batches(rows, *row_spans(rollout.attention_mask), max_tokens)


def split(rollout: Rollout, rows: torch.Tensor, max_rows: int, max_tokens: Optional[int] = None) -> list[tuple[torch.Tensor, Rollout]]:
    """The micro-batches (training) or chunks (no-gradient passes) of `rows` of a rollout, as
    (row index (n_i,), the rows' Rollout) pairs, in the order to run them.

    max_tokens None: consecutive groups of `max_rows` rows as given, padded to the whole batch's width
    (TRL's semantics). Else the token-budget plan (`plan_micro_batches`), each micro-batch trimmed.
    """
    if max_tokens is None:
        return [(index, rollout.select(index)) for index in plan_rows(rows, max_rows)]
    return [(index, trim(rollout.select(index))) for index in plan_rollout(rows, rollout, max_tokens)]


def _kept_columns(mask: torch.Tensor) -> tuple[int, int]:
    start, end = row_spans(mask)
    has_tokens = end > 0
    if not bool(has_tokens.any()):
        return 0, 0
    return int(start[has_tokens].min()), int(end.max())


def trim(rollout: Rollout) -> Rollout:
    """The same rows without the columns that are padding in every row: prompt columns from the left,
    response columns after the longest response. Every (B, P) field loses the same prompt columns and
    every (B, R) field the same response columns; (B,) fields are kept. Positions are counted from the
    attention mask, so no real token's position changes."""
    width_p, width_r = rollout.query_ids.shape[1], rollout.response_ids.shape[1]
    first, last = _kept_columns(rollout.attention_mask)
    first, last = min(first, width_p), max(last, width_p)  # a prompt column always stays: a row's first token
    if first == 0 and last == width_p + width_r:
        return rollout
    picked = {}
    for f in fields(rollout):
        value = getattr(rollout, f.name)
        if value is not None and value.dim() == 2:
            value = value[:, first:] if f.name.startswith("query_") else value[:, : last - width_p]
        picked[f.name] = value
    return Rollout(**picked)


def trim_columns(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) ids and mask without the columns that are padding in every row, on either side."""
    first, last = _kept_columns(attention_mask)
    return input_ids[:, first:last], attention_mask[:, first:last]


def restore(pieces: list[tuple[torch.Tensor, torch.Tensor]], rows: int, width: int, fill: float = 0.0) -> torch.Tensor:
    """Scatter per-micro-batch results back into batch order.

    pieces: [(index (n_i,) long, values (n_i, w_i) with w_i <= width)] -> (rows, width), `fill` where no
    piece wrote (trimmed padding).
    """
    first = pieces[0][1]
    out = torch.full((rows, width), fill, dtype=first.dtype, device=first.device)
    for index, values in pieces:
        out[index.to(out.device), : values.shape[1]] = values
    return out


def forward_budget(rollout: Rollout, rows_per_forward: int) -> int:
    """Token budget of the no-gradient passes: `rows_per_forward` rows of the batch's full padded width,
    the most one fixed-size chunk of today costs, so trimmed chunks never take more memory than that."""
    return rows_per_forward * (rollout.query_ids.shape[1] + rollout.response_ids.shape[1])


def padded_tokens(micro_batches: list[Rollout]) -> tuple[int, torch.Tensor]:
    """(token positions the forward passes of these micro-batches process, of which real (0-dim tensor))."""
    processed = sum(mb.query_ids.numel() + mb.response_ids.numel() for mb in micro_batches)
    if not micro_batches:
        return 0, torch.zeros((), dtype=torch.long)
    real = torch.stack([mb.query_mask.sum() + mb.response_mask.sum() for mb in micro_batches]).sum()
    return processed, real


def longest_row(prompt_token_counts: list[int], response_length: int) -> int:
    """The widest row a run can produce: its longest prompt and a full-length response."""
    return (max(prompt_token_counts) if prompt_token_counts else 0) + response_length


def check_budget(max_tokens: Optional[int], prompt_token_counts: list[int], response_length: int) -> None:
    """Before any model loads: a budget below the longest possible row is an error naming both numbers."""
    if max_tokens is None:
        return
    longest = longest_row(prompt_token_counts, response_length)
    if max_tokens < longest:
        raise BudgetTooSmall(
            f"ppo.max_tokens_per_micro_batch={max_tokens} is smaller than the longest row this run can produce "
            f"({longest} tokens: the longest prompt, {longest - response_length} tokens, + ppo.response_length "
            f"{response_length}); raise it to at least {longest} or shorten prompts with data.max_prompt_length"
        )
