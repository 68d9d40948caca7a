"""A run's batch sizes and its learning-rate schedule's steps (`BatchSizes`), derived once from the `ppo:` section,
the number of processes and the number of training prompts (`derive`, TRL's batch arithmetic). The trainer, `ppokit
plan` and `ppokit ppo`'s check of the process count derive them the same way.

The `ppo:` section (`config.PPOHyperparams`) is read, not imported: the config module declares the keys, this one
the arithmetic over them.
"""

from __future__ import annotations

from typing import NamedTuple

from ppokit.errors import UserError


class BatchSizes(NamedTuple):
    """Derived sizes. local_* are per process; batch is the global rollout batch of one update."""

    micro_batch: int
    local_batch: int
    batch: int
    local_mini_batch: int
    total_episodes: int
    num_updates: int
    samples_per_prompt: int = 1  # n: episodes = prompts x n
    prompts_per_update: int = 0  # batch / n, over every process
    local_prompts: int = 0  # local_batch / n, on each process
    # The learning-rate schedule, decided here once (`derive`; `optimise.build_optimiser` builds it):
    optimiser_steps: int = 0  # the run's: num_updates x num_ppo_epochs x num_mini_batches
    warmup_steps: int = 0  # ppo.warmup_steps, or ceil(ppo.warmup_ratio x optimiser_steps)
    policy_start_step: int = 0  # the policy's first optimiser step: the critic's warm-up (ppo.critic_warmup_updates) before it


def derive(hp, world_size: int, num_prompts: int) -> BatchSizes:
    """Batch arithmetic of the `ppo:` section `hp`, as TRL does it; raises UserError on inexact division.

    Sizes count episodes (responses). With n = num_samples_per_prompt, one update samples
    n responses for each of batch / n prompts, local_batch / n of them on each process; a pass
    over the training prompts is num_prompts x n episodes.
    """
    n = hp.num_samples_per_prompt
    local_batch = hp.per_device_train_batch_size * hp.gradient_accumulation_steps * hp.num_mini_batches
    batch = local_batch * world_size
    local_mini = local_batch // hp.num_mini_batches
    if hp.total_episodes is None:
        total = (hp.num_train_epochs * num_prompts * n) // batch * batch
        if total == 0:
            samples = f" x {n} samples per prompt" if n > 1 else ""
            raise UserError(
                f"ppo.total_episodes: {num_prompts} training prompts{samples} x {hp.num_train_epochs} epoch(s) "
                f"is less than one batch of {batch}; add prompts or lower the batch size"
            )
    else:
        total = hp.total_episodes
        if total % batch:
            raise UserError(
                f"ppo.total_episodes ({total}) is not a multiple of the batch size ({batch} = "
                f"per_device_train_batch_size {hp.per_device_train_batch_size} x gradient_accumulation_steps "
                f"{hp.gradient_accumulation_steps} x num_mini_batches {hp.num_mini_batches} x processes {world_size})"
            )
    num_updates = total // batch
    steps = num_updates * hp.num_ppo_epochs * hp.num_mini_batches
    sizes = BatchSizes(
        micro_batch=hp.per_device_train_batch_size,
        local_batch=local_batch,
        batch=batch,
        local_mini_batch=local_mini,
        total_episodes=total,
        num_updates=num_updates,
        samples_per_prompt=n,
        prompts_per_update=batch // n,
        local_prompts=local_batch // n,
        optimiser_steps=steps,
        warmup_steps=hp.warmup_steps_over(steps),
        policy_start_step=hp.critic_warmup_updates * hp.num_ppo_epochs * hp.num_mini_batches,
    )
    check_schedule(hp, sizes)
    return sizes


def check_schedule(hp, sizes: BatchSizes) -> None:
    """The policy trains after the critic's warm-up, and each warm-up is shorter than the steps it warms: else the
    learning rate would never reach learning_rate (the schedule counts optimiser steps)."""
    steps, warmup = sizes.optimiser_steps, sizes.warmup_steps
    if hp.critic_warmup_updates:
        if hp.critic_warmup_updates >= sizes.num_updates:
            raise UserError(
                f"ppo.critic_warmup_updates ({hp.critic_warmup_updates}) leaves no update that trains the policy: "
                f"the run has {sizes.num_updates} updates; it must be fewer"
            )
        policy_steps = steps - sizes.policy_start_step
        if warmup >= policy_steps:
            raise UserError(
                f"{_warmup_said(hp, warmup)} is not shorter than the policy's {policy_steps} optimiser steps after "
                f"ppo.critic_warmup_updates ({hp.critic_warmup_updates}): its learning rate would never reach ppo.learning_rate"
            )
    if warmup and warmup >= steps:
        shorter = "ppo.warmup_steps below" if hp.warmup_steps else "ppo.warmup_ratio so that ceil(ratio x steps) is below"
        raise UserError(
            f"{_warmup_said(hp, warmup)} is not shorter than the run's {steps} optimiser steps ({sizes.num_updates} "
            f"updates x num_ppo_epochs {hp.num_ppo_epochs} x num_mini_batches {hp.num_mini_batches}): the learning rate "
            f"would never reach ppo.learning_rate; set {shorter} {steps}"
        )


def _warmup_said(hp, warmup: int) -> str:
    """The warm-up key as set, for an error message: `ppo.warmup_steps (4)`, `ppo.warmup_ratio (0.9), a warm-up of 5 steps,`."""
    if hp.warmup_steps:
        return f"ppo.warmup_steps ({hp.warmup_steps})"
    return f"ppo.warmup_ratio ({hp.warmup_ratio}), a warm-up of {warmup} optimiser steps,"
