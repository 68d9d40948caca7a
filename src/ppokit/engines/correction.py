"""What the trainer does with the episodes of an engine whose logprobs are not its own (`logprobs_are_trainers`
False): the policy's own logprobs, recomputed by the trainer with one no-gradient forward, replace the
engine's as the old logprobs of the PPO ratio and of the KL (so the first minibatch's ratio is 1, as with
an engine that samples from the training weights), the difference is measured, and with `ppo.rollout_is`
the remaining off-policyness is corrected by truncated importance weights (`losses.truncated_is_weights` per
token, `losses.truncated_is_sequence_weights` per response)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ppokit.training.losses import truncated_is_sequence_weights, truncated_is_weights

Reduce = Callable[[torch.Tensor], torch.Tensor]


def _token_weights(trainer, engine, mask, cap: float, floor: float) -> torch.Tensor:
    return truncated_is_weights(trainer, engine, cap, floor)


# ppo.rollout_is -> its weights (trainer logprobs, engine logprobs, trained mask, cap, floor) -> (B, R); config.ROLLOUT_IS
# holds the same names (a config is read without torch).
IMPORTANCE_WEIGHTS: dict[str, Callable[..., torch.Tensor]] = {
    "tis": _token_weights,
    "tis_sequence": truncated_is_sequence_weights,
}


def use_trainer_logprobs(episodes, trainer_logprobs: Optional[torch.Tensor], rollout_is: Optional[str], cap: float,
                         reduce_sum: Reduce, floor: float = 0.0) -> dict[str, float]:
    """Put `trainer_logprobs` (B, R) in place of the engine's logprobs in `episodes` (with `rollout_is`, their
    truncated importance weights in [floor, cap] in `episodes.rollout_is_weights` first) -> the mismatch metrics:
    rollout/logprob_diff_mean and rollout/logprob_diff_max, |engine - trainer| logprob (not probability) over the
    trained tokens of every process. trainer_logprobs None (the engine's are the trainer's): nothing changes, no metrics."""
    if trainer_logprobs is None:
        return {}
    mask = episodes.trained_mask
    diff = (episodes.logprobs.float() - trainer_logprobs.float()).abs() * mask
    total, count = reduce_sum(torch.stack([diff.sum(), mask.sum().float()])).unbind()
    biggest = diff.max() if diff.numel() else diff.new_zeros(())
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(biggest, op=torch.distributed.ReduceOp.MAX)
    if rollout_is is not None:
        episodes.rollout_is_weights = IMPORTANCE_WEIGHTS[rollout_is](trainer_logprobs, episodes.logprobs, mask, cap, floor)
    episodes.logprobs = trainer_logprobs
    return {"rollout/logprob_diff_mean": (total / count.clamp(min=1)).item(), "rollout/logprob_diff_max": biggest.item()}
