"""Micro-batches by a token budget: rows of similar length together, packed without padding between them.

A row of an update's episodes is a left-padded prompt followed by a right-padded response (`ppokit.training.episodes.Episodes`):

    query   [pad pad p p p]   response [r r r stop pad pad]
    query   [p p p p p p p]   response [r stop pad pad pad]

Padded to the widest prompt and the longest response of the whole batch, a row of a short prompt and a
short response costs as much as the longest one; and trimming alone leaves a row of a long prompt and a
short response beside one of a short prompt and a long response padded on both sides. Here, rows are
sorted by their length (prompt + response) within a minibatch and packed greedily into micro-batches of
at most the budget's tokens; in each micro-batch (`pack`) every row's tokens are moved to end at the last
column, so the micro-batch is as wide as its longest row and no wider:

    query   [pad p p p r r]   response [r stop]     (response columns: the last ones, right-aligned)
    query   [p p p p p p p]   response [r stop]

A packed micro-batch is an Episodes like any other: its `attention_mask` marks every real token, and a
prompt may reach into the response columns (the first row above), while its (B, R) fields (loss_mask,
logprobs, values, ...) hold response tokens only. Positions come from the attention mask
(`models.position_ids_from_mask`), so moving a row changes no position, no attention and no logit; every
logprob site reads the states before the last response columns, which holds in both layouts. Per-token
results go back into the batch by the trained masks (`restore_tokens`).

Every micro-batch (`split`, either way) carries what the forwards over trained tokens need: each row's
real tokens up to its last trained token, the prompt alone for a row with none (a row outside the update,
`Episodes.valid`). A causal model's outputs at the trained tokens do not depend on later tokens.

What the budget bounds: rows x the longest row of the micro-batch, the tensor the forward pass sees,
padding left inside it included. A row longer than the budget cannot be placed: `plan_micro_batches`
raises `BudgetTooSmall` naming both numbers (the run's set-up checks the longest row it can produce,
longest prompt + `response_length`, before any model loads: `lengths.check_budget`).

The order of the micro-batches and of the rows in them depends only on the row lengths and the order of
the rows given (the minibatch's seeded shuffle): the same seed gives the same plan. Longest micro-batch
first, so a budget too large for the device fails on the first micro-batch, not the last.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Optional

import torch

from ppokit.models import packing
from ppokit.training import algo, segments
from ppokit.training.episodes import Episodes
from ppokit.data.lengths import BudgetTooSmall


def right_align(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's real tokens moved to end at the last column, as wide as the longest row (at least 1).

    ids, mask: (B, L), L >= 1, each row's real tokens one contiguous span (a left-padded prompt and a
    right-padded response; any row padded on either side) -> (ids (B, W), mask (B, W) bool,
    source (B, W) long: the column of the input each output column came from, < 0 or >= L at padding).
    Padding ids become 0 (never attended).
    """
    real_in = mask.bool()
    columns_in = torch.arange(ids.shape[1], device=ids.device)
    lengths = real_in.sum(1)
    end = torch.where(real_in, columns_in + 1, torch.zeros_like(columns_in)).max(1).values
    width = max(int(lengths.max()) if len(lengths) else 0, 1)
    columns = torch.arange(width, device=ids.device)
    source = columns + (end - width).unsqueeze(1)
    real = columns >= (width - lengths).unsqueeze(1)
    aligned = ids.gather(1, source.clamp(0, ids.shape[1] - 1)).masked_fill(~real, 0)
    return aligned, real, source


def plan_micro_batches(rows: torch.Tensor, lengths: torch.Tensor, max_tokens: int) -> list[torch.Tensor]:
    """Split `rows` (indices into the batch, in minibatch order) into micro-batches within `max_tokens`.

    rows: (n,) long; lengths: (B,) long, each row's real tokens (prompt + response) over the whole batch
    -> list of (n_i,) long index tensors that together hold every row of `rows` once.
    Rows are sorted by length, longest first (stable, so equal lengths keep the minibatch's seeded
    order), and packed greedily: a row joins the current micro-batch while rows x the micro-batch's
    longest row (its packed width, `pack`) stays within `max_tokens`.
    """
    if rows.numel() == 0:
        return []
    row_lengths = lengths[rows].tolist()
    order = sorted(range(len(row_lengths)), key=lambda i: -row_lengths[i])  # longest first; sorted() is stable
    longest = row_lengths[order[0]]
    if longest > max_tokens:
        raise BudgetTooSmall(f"a row of {longest} tokens is longer than ppo.max_tokens_per_micro_batch={max_tokens}")
    groups: list[list[int]] = [[]]
    for i in order:  # longest first: a micro-batch's first row is its widest
        if groups[-1] and (len(groups[-1]) + 1) * row_lengths[groups[-1][0]] > max_tokens:
            groups.append([])
        groups[-1].append(i)
    rows_list = rows.tolist()
    return [torch.tensor([rows_list[i] for i in g], dtype=torch.long, device=rows.device) for g in groups]


def plan_packed_micro_batches(rows: torch.Tensor, lengths: torch.Tensor, max_tokens: int) -> list[torch.Tensor]:
    """`plan_micro_batches` for padding-free forwards (ppo.padding_free): the budget fills packed rows.

    Rows (episodes) are taken longest first (stable), and each is placed in the current micro-batch's packed rows
    (`packing.place`: first fit into rows as wide as the micro-batch's first, longest, episode) while those rows x
    that width stay within `max_tokens`; else it starts the next micro-batch. `packing.layout` lays a micro-batch out
    by the same rule in the same order, so its forward processes exactly the planned rows.
    """
    if rows.numel() == 0:
        return []
    row_lengths = lengths[rows].tolist()
    order = packing.longest_first(row_lengths)
    longest = row_lengths[order[0]]
    if longest > max_tokens:
        raise BudgetTooSmall(f"a row of {longest} tokens is longer than ppo.max_tokens_per_micro_batch={max_tokens}")
    groups: list[list[int]] = []
    free: list[int] = []
    capacity = 0
    for i in order:
        if groups:
            trial = list(free)
            packing.place(trial, row_lengths[i], capacity)
            if len(trial) * capacity <= max_tokens:
                free = trial
                groups[-1].append(i)
                continue
        capacity = max(row_lengths[i], 1)
        free = []
        packing.place(free, row_lengths[i], capacity)
        groups.append([i])
    rows_list = rows.tolist()
    return [torch.tensor([rows_list[i] for i in g], dtype=torch.long, device=rows.device) for g in groups]


def shuffled(rows: int, together: int, device=None) -> torch.Tensor:
    """A random order of `rows` rows (rows, long) that keeps each run of `together` adjacent rows (a prompt's samples,
    ppo.shared_prompt) together and in order, the runs shuffled; together 1: `torch.randperm(rows)`."""
    if together == 1:
        return torch.randperm(rows, device=device)
    order = torch.randperm(-(-rows // together), device=device).unsqueeze(1) * together + torch.arange(together, device=device)
    order = order.reshape(-1)
    return order[order < rows]


def plan_rows(rows: torch.Tensor, size: int, episode: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
    """Fixed micro-batches of `size` rows in the given order (TRL's semantics; no sorting, no trimming); with `episode`
    ((B,) long, an agent's segment rows, each episode's rows adjacent in `rows`) of `size` episodes with all their rows."""
    return list(rows.split(size)) if episode is None else segments.episode_chunks(rows, episode, size)


def forward_view(episodes: Episodes) -> Episodes:
    """The episodes as the forwards over trained tokens read them: each row's attention_mask cut after its
    last trained token, to its prompt for a row without one (a row outside the update). Unpacked layout
    (P prompt columns, R response columns). A row trained to its last real token is unchanged. The forwards read
    tensors only: the environment's failures and transcripts (Python lists) are left out."""
    trained = episodes.trained_mask
    prompt_width, response_width = episodes.query_ids.shape[1], trained.shape[1]
    end = torch.where(trained.any(1), algo.last_token_index(trained) + 1, torch.zeros_like(trained[:, 0], dtype=torch.long))
    needed = torch.arange(prompt_width + response_width, device=trained.device) < (prompt_width + end).unsqueeze(1)
    return replace(episodes, attention_mask=episodes.attention_mask & needed, environment_errors=None, transcripts=None,
                   environments=None, earlier_segments=None)


def plan_episodes(rows: torch.Tensor, episodes: Episodes, max_tokens: int) -> list[torch.Tensor]:
    """`plan_micro_batches` over rows of `episodes` by their real tokens (prompt + response)."""
    return plan_micro_batches(rows, episodes.attention_mask.sum(1), max_tokens)


def split(episodes: Episodes, rows: torch.Tensor, max_rows: int, max_tokens: Optional[int] = None,
          padding_free: bool = False, episode: Optional[torch.Tensor] = None) -> list[tuple[torch.Tensor, Episodes]]:
    """The micro-batches (training) or chunks (no-gradient passes) of `rows` of the episodes, as
    (row index (n_i,), the rows' Episodes, each row cut to what the forwards need: `forward_view`)
    pairs, in the order to run them.

    max_tokens None: consecutive groups of `max_rows` rows as given, padded to the whole batch's width
    (TRL's semantics; with `episode`, of `max_rows` episodes: `plan_rows`). Else the token-budget plan (`plan_micro_batches`), each micro-batch packed.
    padding_free (ppo.padding_free: the forwards run over packed rows, `models.packing`): the same groups of rows
    without a budget, each right-aligned (`pack`); with one, the budget fills packed rows (`plan_packed_micro_batches`).
    """
    view = forward_view(episodes)
    if max_tokens is None:
        return [(index, pack(view.select(index)) if padding_free else view.select(index)) for index in plan_rows(rows, max_rows, episode)]
    plan = plan_packed_micro_batches(rows, view.attention_mask.sum(1), max_tokens) if padding_free else plan_episodes(rows, view, max_tokens)
    return [(index, pack(view.select(index))) for index in plan]


def pack(episodes: Episodes) -> Episodes:
    """The same rows, each moved to end at the last column, as wide as the longest row (module docstring).

    In: the unpacked layout, query (B, P) left-padded, response (B, R) right-padded; a row's response
    tokens are the real tokens of its response columns. Out: W = the longest row's real tokens (at least
    R' + 1: a prompt column always stays), R' = the longest response; query_ids (B, W - R'), (B, R') fields
    with each row's response tokens in its last columns, attention_mask (B, W) True on every real token,
    score_index moved with its token. valid is kept. Every (B, R) field (loss_mask included) moves with
    response_ids, so token i of a row's response keeps its logprob, value and advantage.
    """
    width_p = episodes.query_ids.shape[1]
    response_lengths = episodes.attention_mask[:, width_p:].sum(1)
    width_r = int(response_lengths.max()) if len(episodes) else 0
    ids, real, source = right_align(episodes.input_ids, episodes.attention_mask)
    if ids.shape[1] < width_r + 1:  # every row a response alone: one prompt column of padding
        ids, real, source = (_pad_left(ids, 0), _pad_left(real, False), _pad_left(source, -1))
    width = ids.shape[1]
    in_response = real[:, width - width_r :] & (source[:, width - width_r :] >= width_p)
    response_source = (source[:, width - width_r :] - width_p).clamp(min=0)  # the column in the (B, R) fields
    picked = {}
    for f in fields(episodes):
        value = getattr(episodes, f.name)
        if isinstance(value, torch.Tensor) and value.dim() == 2 and f.name not in ("query_ids", "attention_mask"):
            value = value.gather(1, response_source).masked_fill(~in_response, 0)
        picked[f.name] = value
    at_score = in_response & (response_source == episodes.score_index.unsqueeze(1))  # one True, or none in a row cut before it
    score_index = (at_score.long() * torch.arange(width_r, device=at_score.device)).sum(1)
    picked.update(query_ids=ids[:, : width - width_r], response_ids=ids[:, width - width_r :], attention_mask=real,
                  score_index=score_index)
    return Episodes(**picked)


def _pad_left(x: torch.Tensor, fill) -> torch.Tensor:
    """One column of `fill` on the left of (B, W)."""
    return torch.cat([torch.full((x.shape[0], 1), fill, dtype=x.dtype, device=x.device), x], 1)


def restore_tokens(pieces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], trained_mask: torch.Tensor) -> torch.Tensor:
    """Per-token results of micro-batches back into the batch's layout, by the trained masks.

    pieces: [(index (n_i,) long, values (n_i, w_i), the micro-batch's trained_mask (n_i, w_i))];
    trained_mask: (B, R) of the whole batch -> (B, R), 0 elsewhere. A row's trained tokens are in
    order in both masks, whichever columns they sit in (padded, trimmed or packed).
    """
    first = pieces[0][1]
    out = torch.zeros(trained_mask.shape, dtype=first.dtype, device=first.device)
    for index, values, mask in pieces:
        index = index.to(out.device)
        rows = torch.zeros((len(index), trained_mask.shape[1]), dtype=first.dtype, device=first.device)
        out[index] = rows.masked_scatter(trained_mask[index].bool(), values[mask.bool()])
    return out


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


def forward_budget(episodes: Episodes, rows_per_forward: int) -> int:
    """Token budget of the no-gradient passes: `rows_per_forward` rows of the batch's full padded width,
    the most one fixed-size chunk of today costs, so trimmed chunks never take more memory than that."""
    return rows_per_forward * (episodes.query_ids.shape[1] + episodes.response_ids.shape[1])


def padded_tokens(micro_batches: list[Episodes], padding_free: bool = False) -> tuple[int, torch.Tensor]:
    """(token positions the forward passes of these micro-batches process, of which real (0-dim tensor)).
    padding_free: the forwards' packed rows (`packing.packed_positions`)."""
    if padding_free:
        processed = sum(packing.packed_positions(mb.attention_mask) for mb in micro_batches)
    else:
        processed = sum(mb.query_ids.numel() + mb.response_ids.numel() for mb in micro_batches)
    if not micro_batches:
        return 0, torch.zeros((), dtype=torch.long)
    real = torch.stack([mb.attention_mask.sum() for mb in micro_batches]).sum()
    return processed, real
