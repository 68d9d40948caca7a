"""Shared-prompt forwards (`ppo.shared_prompt`): a group's common prefix computed once, its samples attending to it.

With `ppo.num_samples_per_prompt` n, the n episodes of a prompt are adjacent rows that begin with the same tokens.
A forward over (B, L) rows (each row's real tokens one contiguous span, as `models.packing` takes them) lays each run
of n adjacent rows out as one row: their longest common prefix (of real tokens) once, then each row's rest, one
after another:

    (B, L) rows, n = 2                        one row per group               positions     segment
    [pad p p p r r]                           [p p p | r r | s s s]           0 1 2 3 4 3 4 5   - - - 0 0 1 1 1
    [p p p s s s]               ->            ...

and calls the model with a 4-D mask (`Rows.allowed`, a prefix tree of depth one): a token attends to the earlier
tokens of the prefix and of its own rest, never to another row's, and its position continues from the prefix's,
the position it has in its own row. A causal model's state at a token depends only on the tokens before it at
their positions, so every state equals the separate computation's (within float rounding): the prefix's states are
each row's own, and the logit that predicts a row's first token after the prefix is read from the prefix's last
position, shared. The common prefix is found from the tokens, so any rows are laid out exactly (a run whose rows
share nothing computes each row whole); the rows are shared only as far as they agree, which for a group is at least
its prompt. Positions past a group's tokens are padding: each attends to itself alone (no empty softmax row).

The outputs go back to the (B, L) layout by `Rows.unpack` (every row's prefix tokens read from the one copy; the
gradient adds up over the rows that read it), so every reader downstream is the padded computation's. Whether a model
honours a 4-D mask is checked once at start (`models.forwards.check_shared_forward`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ppokit.models.packing import Rows


@dataclass(frozen=True)
class SharedPrefix:
    """The layout of `ppo.shared_prompt`: runs of `samples` adjacent rows, each laid out as one row (`layout`)."""

    samples: int

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Rows:
        return layout(input_ids, attention_mask, self.samples)


def common_prefix(input_ids: torch.Tensor, attention_mask: torch.Tensor, samples: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (lengths (B,), starts (B,), prefix (G,)) long: each row's real tokens and its first real column, and the
    tokens each run of `samples` adjacent rows (the last run may be shorter; G = ceil(B / samples)) has in common at
    its start, at most the run's shortest row."""
    mask = attention_mask.bool()
    B, L = mask.shape
    device = mask.device
    lengths, starts = mask.sum(1), mask.long().argmax(1)
    columns = torch.arange(L, device=device)
    real = columns < lengths.unsqueeze(1)  # left-aligned
    aligned = input_ids.gather(1, (starts.unsqueeze(1) + columns).clamp(max=max(L - 1, 0))).masked_fill(~real, -1)
    first = torch.arange(B, device=device) // samples * samples
    agree = (aligned == aligned[first]) & real
    shared = agree.long().cumprod(1).sum(1)  # (B,) tokens in common with its run's first row
    groups = (B + samples - 1) // samples
    prefix = torch.full((groups,), L, dtype=torch.long, device=device).scatter_reduce(0, first // samples, shared, "amin")
    return lengths, starts, prefix


def layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, samples: int) -> Rows:
    """(B, L) ids and mask (each row's real tokens contiguous) -> `Rows` with one row per run of `samples` adjacent rows:
    their common prefix, then each row's rest in order; rows as wide as the widest run (at least 1), `allowed` the
    prefix tree's mask (module docstring)."""
    device = input_ids.device
    lengths_t, starts, prefix_t = common_prefix(input_ids, attention_mask, samples)
    lengths, prefix = lengths_t.tolist(), prefix_t.tolist()
    B, L = attention_mask.shape
    offset = [0] * B  # where each row's rest begins in its group's row
    widths = []
    for g, shared in enumerate(prefix):
        at = shared
        for i in range(g * samples, min((g + 1) * samples, B)):
            offset[i] = at
            at += lengths[i] - shared
        widths.append(at)
    capacity = max(max(widths, default=0), 1)
    groups = max(len(prefix), 1)
    mask = attention_mask.bool()
    within = torch.arange(L, device=device) - starts.unsqueeze(1)  # a real token's position in its row
    group = torch.arange(B, device=device) // samples
    shared = prefix_t[group].unsqueeze(1)
    rest_at = torch.tensor(offset, dtype=torch.long, device=device).unsqueeze(1) + within - shared
    column = torch.where(within < shared, within, rest_at)
    source = torch.where(mask, group.unsqueeze(1) * capacity + column, torch.full_like(within, groups * capacity))
    flat = groups * capacity + 1
    ids = torch.full((flat,), int(input_ids[mask][0]) if mask.any() else 0, dtype=input_ids.dtype, device=device)
    ids[source[mask]] = input_ids[mask]
    position_ids = torch.zeros(flat, dtype=torch.long, device=device)
    position_ids[source[mask]] = within[mask]
    # segments: -1 the prefix, the row's index for its rest, a slot of its own (B + its index) for padding
    segment = B + torch.arange(flat, device=device)
    segment[source[mask]] = torch.where(within < shared, torch.full_like(within, -1), torch.arange(B, device=device).unsqueeze(1))[mask]
    segment = segment[:-1].reshape(groups, capacity)
    slots = torch.arange(capacity, device=device)
    earlier = slots.unsqueeze(1) >= slots.unsqueeze(0)
    to_prefix = (segment.unsqueeze(1) == -1) & (segment.unsqueeze(2) < B)  # a real token (not padding) reads the prefix
    allowed = earlier & ((segment.unsqueeze(1) == segment.unsqueeze(2)) | to_prefix)
    return Rows(ids[:-1].reshape(groups, capacity), position_ids[:-1].reshape(groups, capacity), source, allowed)


def shared_positions(attention_mask: torch.Tensor, input_ids: torch.Tensor, samples: int) -> int:
    """The token positions a shared-prompt forward of these (B, L) rows processes (groups x the widest group's tokens)."""
    lengths, _, prefix = common_prefix(input_ids, attention_mask, samples)
    group = torch.arange(len(lengths), device=lengths.device) // samples
    widths = prefix + torch.zeros_like(prefix).index_add(0, group, lengths - prefix[group])
    return max(len(prefix), 1) * max(int(widths.max()) if len(widths) else 0, 1)


def forward_layout(padding_free: bool, shared_prompt: bool, samples: int):
    """The layout of the training and no-gradient forwards, chosen once (`models.hidden_states`'s padding_free): runs of
    `samples` rows sharing their prompt (ppo.shared_prompt), packed rows (ppo.padding_free: True) or padded rows (False)."""
    return SharedPrefix(samples) if shared_prompt else padding_free
