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


def row_lengths(query_mask: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt tokens (B,), response tokens (B,)) of each row. query_mask (B, P), response_mask (B, R) bool.

    A response's length is up to its last real token (its mask is a prefix, so that is also its count);
    a row dropped from the update (mask all False) has length 0 and costs only its prompt.
    """
    prompt = query_mask.long().sum(1)
    positions = torch.arange(1, response_mask.shape[1] + 1, device=response_mask.device)
    response = (response_mask.long() * positions).max(1).values if response_mask.shape[1] else response_mask.long().sum(1)
    return prompt, response


def plan_micro_batches(
    rows: torch.Tensor, prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, max_tokens: int
) -> list[torch.Tensor]:
    """Split `rows` (indices into the batch, in minibatch order) into micro-batches within `max_tokens`.

    rows: (n,) long; prompt_lengths, response_lengths: (B,) long over the whole batch -> list of (n_i,)
    long index tensors that together hold every row of `rows` once.
    Rows are sorted by prompt + response length, longest first (stable, so equal lengths keep the
    minibatch's seeded order), and packed greedily: a row joins the current micro-batch while
    rows x (widest prompt + longest response) stays within `max_tokens`.
    """
    if rows.numel() == 0:
        return []
    prompt = prompt_lengths[rows].tolist()
    response = response_lengths[rows].tolist()
    total = [p + r for p, r in zip(prompt, response)]
    order = sorted(range(len(total)), key=lambda i: -total[i])  # sorted() is stable
    widest = total[order[0]]
    if widest > max_tokens:
        raise BudgetTooSmall(
            f"a row of {widest} tokens ({prompt[order[0]]} prompt + {response[order[0]]} response) is longer than "
            f"ppo.max_tokens_per_micro_batch={max_tokens}"
        )
    groups: list[list[int]] = []
    current: list[int] = []
    p_width = r_width = 0
    for i in order:
        p, r = max(p_width, prompt[i]), max(r_width, response[i])
        if current and (len(current) + 1) * (p + r) > max_tokens:
            groups.append(current)
            current, p, r = [], prompt[i], response[i]
        current.append(i)
        p_width, r_width = p, r
    groups.append(current)
    rows_list = rows.tolist()
    return [torch.tensor([rows_list[i] for i in g], dtype=torch.long, device=rows.device) for g in groups]


def plan_rows(rows: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Fixed micro-batches of `size` rows in the given order (TRL's semantics; no sorting, no trimming)."""
    return list(rows.split(size))


def trim(rollout: Rollout) -> Rollout:
    """The same rows without the columns that are padding in every row: prompt columns from the left,
    response columns after the longest response. Every (B, P) field loses the same prompt columns and
    every (B, R) field the same response columns; (B,) fields are kept."""
    prompt, response = row_lengths(rollout.query_mask, rollout.response_mask)
    width_p, width_r = rollout.query_ids.shape[1], rollout.response_ids.shape[1]
    keep_p = int(prompt.max()) if len(rollout) else 0
    keep_r = int(response.max()) if len(rollout) else 0
    if keep_p == width_p and keep_r == width_r:
        return rollout
    picked = {}
    for f in fields(rollout):
        value = getattr(rollout, f.name)
        if value is not None and value.dim() == 2:
            value = value[:, width_p - keep_p :] if f.name.startswith("query_") else value[:, :keep_r]
        picked[f.name] = value
    return Rollout(**picked)


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


def padded_tokens(micro_batches: list[Rollout]) -> tuple[int, int]:
    """(token positions the forward passes process, of which real) over trimmed micro-batches."""
    processed = real = 0
    for mb in micro_batches:
        processed += mb.query_ids.numel() + mb.response_ids.numel()
        real += int(mb.query_mask.sum()) + int(mb.response_mask.sum())
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
