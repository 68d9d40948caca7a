"""Masks over response tokens, as pure functions over tensors: where a response stops, the truncated rows, the last
trained token, an order of rows and its inverse.

Masks are boolean tensors over the response columns, True on the tokens
trained on and False elsewhere: the trainer passes `Episodes.trained_mask` (ppokit.training.episodes), the
policy's own tokens (the stop token included) of the rows in the update; padding after a response,
tokens the policy reads but did not produce (an observation between two model turns) and rows
outside the update are False. A mask may have several spans per row: whatever runs backwards in
time (`advantages.gae`, `advantages.discounted_returns`) steps from one True position to the previous one.

Every function documents the shapes it takes and returns, using B for the number of sequences, T for response tokens
and V for the vocabulary. This module imports only torch (and the other modules of the mathematics).

References:
  [N+]     Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO",
           arXiv:2403.17031.
  [DAPO]   Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
           arXiv:2503.14476 (section 3.1 clip-higher, eps_low < eps_high; section 3.3 token-level
           loss; section 3.4 overlong filtering: the loss of truncated samples masked).
"""

from __future__ import annotations

from typing import Sequence

import torch


def first_true_index(bools: torch.Tensor) -> torch.Tensor:
    """Index of the first True in each row, or the row length if there is none.

    bools: (B, T) bool -> (B,) long.
    """
    length = bools.shape[-1]
    positions = torch.arange(length, device=bools.device).expand_as(bools)
    return torch.where(bools, positions, torch.full_like(positions, length)).min(-1).values


def is_stop(ids: torch.Tensor, stop_token_ids: Sequence[int]) -> torch.Tensor:
    """Which of `ids` (any shape, long) are one of the stop tokens `stop_token_ids` -> bool, the same shape."""
    return torch.isin(ids, torch.tensor(list(stop_token_ids), dtype=ids.dtype, device=ids.device))


def truncate_after_stop(response_ids: torch.Tensor, stop_token_ids: Sequence[int], pad_token_id: int):
    """Replace every token after the first stop token (any of `stop_token_ids`) by padding.

    response_ids: (B, T) long -> (truncated_ids (B, T) long, response_mask (B, T) bool).
    The stop token itself stays and is a real token: the score is read there
    [N+, details "truncate after EOS" and "reward at EOS"]. Rows that never stop keep all T tokens.
    """
    stop_at = first_true_index(is_stop(response_ids, stop_token_ids))
    positions = torch.arange(response_ids.shape[1], device=response_ids.device)
    response_mask = positions.unsqueeze(0) <= stop_at.unsqueeze(1)
    truncated = response_ids.masked_fill(~response_mask, pad_token_id)
    return truncated, response_mask


def mask_truncated(mask: torch.Tensor, ended: torch.Tensor) -> torch.Tensor:
    """The trained tokens without those of truncated rows [DAPO, 3.4 overlong filtering].

    mask: (B, T) bool, the trained tokens; ended: (B,) bool, True where the row ended by itself (its stop token, or
    its environment said done) -> (B, T) bool: mask on the rows that ended, all False on the others. A response cut at
    the length limit was scored on text it did not finish; leaving it out of the loss does not teach the policy
    that its length was wrong (TRL `mask_truncated_completions`). Its score still counts in its group's baseline: the
    caller masks after the advantages.
    """
    return mask & ended.to(torch.bool).unsqueeze(1)


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last True in each row (0 for an empty row).

    mask: (B, T) bool -> (B,) long.
    """
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.full_like(positions, -1)).max(-1).values.clamp(min=0)


def mask_first_order(mask: torch.Tensor) -> torch.Tensor:
    """A permutation of each row's columns: its True positions first, then the others, each in order.

    mask: (B, T) bool -> order (B, T) long. `x.gather(1, order)` puts a row's masked positions side by
    side at its start, so that a recursion over time that stops at the first padding column treats
    the positions between two spans as absent; `restore_order` moves the result back. A mask that is
    already a prefix of each row (one span from column 0) gives the identity.
    """
    return torch.sort((~mask.bool()).to(torch.uint8), dim=-1, stable=True).indices


def restore_order(values: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The inverse of `x.gather(1, order)`: values (B, T) in `order`'s columns -> (B, T) in the original ones."""
    return torch.empty_like(values).scatter_(1, order, values)
