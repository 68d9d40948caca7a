"""Stage 6 of an update: num_ppo_epochs passes of clipped policy + value loss over minibatches.

    for each epoch:                       rows of the rollout in a fresh random order
      for each minibatch:                 one optimiser step
        for each micro-batch:             one forward + backward; gradients accumulate
          loss = micro_batch_loss(...)
        clip gradients; refuse a non-finite loss or gradient; optimiser step; schedule step

`micro_batches` is the one place micro-batches are formed and `micro_batch_loss` the one place a
micro-batch's losses are computed; the optimiser and its schedule are built by `build_optimiser`.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ppokit import algo
from ppokit.config import BatchSizes, PPOHyperparams
from ppokit.guards import check_finite
from ppokit.models import response_logits, scalar_outputs
from ppokit.rollout import Rollout
from ppokit.statistics import training_metrics


class PolicyAndValue(nn.Module):
    """Policy and value model under one module, so one optimiser and one `prepare` cover both."""

    def __init__(self, policy: nn.Module, value_model: nn.Module):
        super().__init__()
        self.policy = policy
        self.value_model = value_model

    def forward(self, input_ids, attention_mask, response_length: int):
        """(B, P + R) -> (logits (B, R, V) predicting each response token, values (B, R))."""
        logits = response_logits(self.policy, input_ids, attention_mask, response_length)
        values = scalar_outputs(self.value_model, input_ids, attention_mask)[:, -response_length - 1 : -1]
        return logits, values


def build_optimiser(model: nn.Module, hp: PPOHyperparams, num_steps: int):
    """AdamW over every trainable parameter and its learning-rate schedule over `num_steps` optimiser steps.

    The schedule is stepped once per optimiser step by `ppo_epochs`, on every process alike; it is
    deliberately not handed to accelerate, whose wrapper steps it once per process per call (with N
    processes the rate then reaches 0 after 1/N of the run).
    """
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=hp.learning_rate,
        eps=hp.adam_epsilon,
        weight_decay=hp.weight_decay,
        fused=_fused_adamw_supported(),  # one kernel per step instead of a loop of small ones
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(hp.lr_scheduler_type, hp.warmup_steps, num_steps))
    return optimizer, scheduler


def micro_batches(minibatch: torch.Tensor, sizes: BatchSizes) -> list[torch.Tensor]:
    """Row indices of each micro-batch of a minibatch: consecutive groups of `sizes.micro_batch` rows."""
    return list(minibatch.split(sizes.micro_batch))


def micro_batch_loss(model: nn.Module, mb: Rollout, hp: PPOHyperparams, num_micro_batches: int) -> tuple[torch.Tensor, dict]:
    """The loss to back-propagate for one micro-batch and its detached statistics.

    Each micro-batch's token-mean loss is divided by the number of micro-batches, so the
    accumulated gradient is their mean (TRL's gradient accumulation).
    """
    width = mb.response_ids.shape[1]
    logits, new_values = model(mb.input_ids, mb.attention_mask, width)
    new_logprobs, token_entropy = algo.logprobs_and_entropy(logits, mb.response_ids, hp.temperature)
    pg_loss, pg_stats = algo.clipped_policy_loss(new_logprobs, mb.logprobs, mb.advantages, mb.response_mask, hp.cliprange)
    vf_loss, vf_clipfrac = algo.clipped_value_loss(new_values, mb.values, mb.returns, mb.response_mask, hp.cliprange_value)
    loss = (pg_loss + hp.vf_coef * vf_loss) / num_micro_batches
    stats = {
        "approxkl": pg_stats.approxkl, "clipfrac": pg_stats.clipfrac, "pg_loss": pg_loss.detach(), "vf_loss": vf_loss.detach(),
        "vf_clipfrac": vf_clipfrac, "entropy": algo.masked_mean(token_entropy, mb.response_mask), "ratio": pg_stats.ratio,
    }
    return loss, stats


def ppo_epochs(
    model: nn.Module, optimizer, scheduler, rollout: Rollout, hp: PPOHyperparams, sizes: BatchSizes, engine,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, float]:
    """Every optimiser step of one update; returns the loss statistics (means over processes).
    engine (ppokit.parallel): how gradients are synchronised and clipped under ddp or fsdp."""
    accelerator = engine.accelerator
    device = rollout.query_ids.device
    stats: dict[str, list[torch.Tensor]] = {}
    # A micro-batch whose rows were all dropped (reward.on_error=skip) has no tokens: its statistics
    # are 0 by convention, not measurements, so it is left out of the averages (ratio 0 would read as a collapse).
    has_tokens: list[torch.Tensor] = []
    for _ in range(hp.num_ppo_epochs):
        order = torch.randperm(len(rollout), device=device)
        for start in range(0, len(rollout), sizes.local_mini_batch):
            micros = micro_batches(order[start : start + sizes.local_mini_batch], sizes)
            step_loss = torch.zeros((), device=device)
            for k, micro in enumerate(micros):
                mb = rollout.select(micro)
                with engine.no_sync(model, last=k == len(micros) - 1):
                    loss, micro_stats = micro_batch_loss(model, mb, hp, len(micros))
                    accelerator.backward(loss)
                step_loss = step_loss + loss.detach()
                for key, value in micro_stats.items():
                    stats.setdefault(key, []).append(value)
                has_tokens.append(mb.response_mask.any())
            grad_norm = engine.clip_grad_norm_(model, hp.max_grad_norm)  # max_grad_norm 0: the norm, unclipped
            # Checked before the step: a non-finite loss or gradient must never reach the weights.
            # One check of both, so that several processes agree in one reduction.
            check_finite({"loss": step_loss, "gradient": grad_norm}, accelerator)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    return training_metrics(stats, has_tokens, reduce_sum)


def _lr_lambda(kind: str, warmup: int, total: int):
    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        return max(0.0, (total - step) / max(1, total - warmup)) if step >= warmup else 1.0

    return factor


def _fused_adamw_supported() -> bool:
    try:
        torch.optim.AdamW([nn.Parameter(torch.zeros(1))], fused=True)
        return True
    except (RuntimeError, TypeError, ValueError):
        return False
