"""Padding-free forwards (`ppo.padding_free`): several sequences per row, positions restarting at each one.

A batch of B sequences, each row's real tokens one contiguous span of a (B, L) layout (a left-padded prompt
and its right-padded response, or a row right-aligned by `training.batching.pack`), becomes rows of
`capacity` = the longest sequence's tokens, each holding as many whole sequences as fit (first fit, longest
first), with nothing between them:

    (B, L) rows                          packed rows (capacity 6)
    [pad pad p p r r]                    [p p p p r r]        positions 0 1 2 3 4 5
    [p p p p r r]                 ->     [p p r r | p q]      positions 0 1 2 3 0 1
    [pad pad pad pad p q]
    [pad pad p p r r]

The model is called with `attention_mask=None` and these `position_ids`: transformers (>= 4.57/5.x) reads a
position that does not follow its left neighbour as the start of a new sequence and masks attention to each
sequence's own tokens (`masking_utils.find_packed_sequence_indices`, for sdpa, eager and flash attention), so
every token sees exactly what it saw in its own padded row, at the same position. What is left at the end of a
row is padding of its own sequence (positions 0, 1, ...), which no real token attends to (causal). Whether a
model honours this is checked once at start (`models.forwards.check_packed_forward`).

The outputs go back to the (B, L) layout (`Rows.unpack`: a gather, zeros at padding), so that every reader
downstream (logprob sites, values, a reward model's last token) is the padded computation's.

`place` is the one first-fit rule: the layout here and the token budget's plan (`training.batching`) both use it,
so a micro-batch planned within the budget is laid out within it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def place(free: list[int], length: int, capacity: int) -> int:
    """First fit: the first row of `free` (each row's free tokens) with room for `length`, or a new row at the end;
    `free` is updated. -> the row's index."""
    for row, room in enumerate(free):
        if length <= room:
            free[row] -= length
            return row
    free.append(capacity - length)
    return len(free) - 1


def longest_first(lengths: list[int]) -> list[int]:
    """Indices of `lengths`, longest first; a stable sort, so equal lengths keep their order."""
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


@dataclass
class Rows:
    """B sequences laid out in packed rows."""

    ids: torch.Tensor  # (rows, capacity) long
    position_ids: torch.Tensor  # (rows, capacity) long, restarting at 0 at each sequence (and at a row's trailing padding)
    source: torch.Tensor  # (B, L) long: each real token's index in the flattened rows, rows x capacity at padding
    # (rows, capacity, capacity) bool, True where a query (dim 1) may attend a key (dim 2); None: the model's own causal
    # masks from the position ids (packed rows). Set by a layout whose rows are not plain sequences (`models.prefix`).
    allowed: Optional[torch.Tensor] = None

    @property
    def positions(self) -> int:
        """Token positions the forward processes (real and padding)."""
        return self.ids.numel()

    def attention_mask(self, implementation: Optional[str]) -> Optional[torch.Tensor]:
        """The mask the model is called with: None without `allowed`, else its 4-D (rows, 1, capacity, capacity) form, which
        transformers passes to the attention as it is: boolean (True: attend) for sdpa and the others, additive (0, or
        float32's lowest) for `eager`, which adds its mask to the scores."""
        if self.allowed is None:
            return None
        mask = self.allowed.unsqueeze(1)
        if implementation == "eager":
            return torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, torch.finfo(torch.float32).min)
        return mask

    def unpack(self, outputs: torch.Tensor) -> torch.Tensor:
        """(rows, capacity, ...) outputs -> (B, L, ...) in the input's layout, 0 at its padding; differentiable."""
        flat = outputs.reshape(-1, *outputs.shape[2:])
        flat = torch.cat([flat, flat.new_zeros((1, *flat.shape[1:]))])  # the last index: padding
        return flat[self.source]


def layout(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Rows:
    """(B, L) ids and mask (each row's real tokens contiguous) -> `Rows`: rows as wide as the longest sequence
    (at least 1), the sequences placed longest first by `place`."""
    mask = attention_mask.bool()
    device = input_ids.device
    lengths = mask.sum(1).tolist()
    capacity = max(max(lengths, default=0), 1)
    free: list[int] = []
    row_of, offset_of = [0] * len(lengths), [0] * len(lengths)
    for i in longest_first(lengths):
        row_of[i] = place(free, lengths[i], capacity)
        offset_of[i] = capacity - free[row_of[i]] - lengths[i]
    rows = max(len(free), 1)
    start = mask.long().argmax(1)  # each sequence's first real column (0 for an empty row)
    columns = torch.arange(mask.shape[1], device=device)
    within = columns - start.unsqueeze(1)  # a real token's position in its sequence
    begin = torch.tensor(row_of, dtype=torch.long, device=device) * capacity + torch.tensor(offset_of, dtype=torch.long, device=device)
    source = torch.where(mask, begin.unsqueeze(1) + within, torch.full_like(within, rows * capacity))
    # padding: a real token's id (never attended; a pad id there would make transformers warn about a missing mask)
    ids = torch.full((rows * capacity + 1,), int(input_ids[mask][0]) if mask.any() else 0, dtype=input_ids.dtype, device=device)
    ids[source[mask]] = input_ids[mask]
    # padding after a row's sequences: positions from 0, a sequence of its own
    used = torch.tensor([capacity - room for room in free] or [0], dtype=torch.long, device=device)
    position_ids = (torch.arange(capacity, device=device) - used.unsqueeze(1)).clamp(min=0).reshape(-1)
    position_ids = torch.cat([position_ids, position_ids.new_zeros(1)])
    position_ids[source[mask]] = within[mask]
    return Rows(ids[:-1].reshape(rows, capacity), position_ids[:-1].reshape(rows, capacity), source)


def packed_positions(attention_mask: torch.Tensor) -> int:
    """The token positions a padding-free forward of these (B, L) rows processes (`layout`'s rows x capacity),
    counted without building the rows."""
    lengths = attention_mask.bool().sum(1).tolist()
    capacity = max(max(lengths, default=0), 1)
    free: list[int] = []
    for i in longest_first(lengths):
        place(free, lengths[i], capacity)
    return max(len(free), 1) * capacity
