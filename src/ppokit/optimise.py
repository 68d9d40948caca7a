"""Stage 6 of an update: num_ppo_epochs passes of clipped policy + value loss over minibatches.

    for each epoch:                       rows of the rollout in a fresh random order
      for each minibatch:                 one optimiser step
        for each micro-batch:             one forward + backward; gradients accumulate
          loss = micro_batch_loss(...)
        clip gradients; refuse a non-finite loss or gradient; optimiser step; schedule step

`micro_batches` is the one place micro-batches are formed and `micro_batch_loss` the one place a
micro-batch's losses are computed (`algo.ppo_loss` with the knobs of `loss_settings`); the
optimiser and its schedule are built by `build_optimiser`: two parameter groups, the policy's and
the critic's (`ppo.vf_learning_rate`), each on its own schedule; during the first
`ppo.critic_warmup_updates` updates only the critic moves. Without a critic (a critic-free
estimator) there is one group and no value loss.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
from torch import nn

from ppokit import algo, roles
from ppokit.config import BatchSizes, PPOHyperparams
from ppokit.guards import check_finite
from ppokit.models import response_logits, scalar_outputs
from ppokit.rollout import Rollout
from ppokit.statistics import training_metrics


class PolicyAndValue(nn.Module):
    """Policy and value model under one module, so one optimiser and one `prepare` cover both.
    value_model is None for a critic-free estimator."""

    def __init__(self, policy: nn.Module, value_model: Optional[nn.Module]):
        super().__init__()
        self.policy = policy
        self.value_model = value_model

    def forward(self, input_ids, attention_mask, response_length: int):
        """(B, P + R) -> (logits (B, R, V) predicting each response token, values (B, R) or None)."""
        return response_logits(self.policy, input_ids, attention_mask, response_length), self.values(input_ids, attention_mask, response_length)

    def values(self, input_ids, attention_mask, response_length: int) -> Optional[torch.Tensor]:
        """(B, P + R) -> the critic's value of the state before each response token (B, R); None without a critic."""
        if self.value_model is None:
            return None
        return scalar_outputs(self.value_model, input_ids, attention_mask)[:, -response_length - 1 : -1]

    @contextlib.contextmanager
    def critic_in_eval_mode(self):
        """The critic in eval mode for the rollout's value pass (the policy is switched by the sampler's caller)."""
        if self.value_model is None:
            yield
            return
        self.value_model.eval()
        try:
            yield
        finally:
            self.value_model.train()


def build_optimiser(model: PolicyAndValue, hp: PPOHyperparams, num_steps: int):
    """AdamW and its learning-rate schedule over `num_steps` optimiser steps.

    Two parameter groups: the policy's (`learning_rate`) and the critic's (`vf_learning_rate`,
    default the same), in that order; both follow the schedule. The policy's schedule starts after
    the critic's warm-up (`critic_warmup_updates`, counted here in optimiser steps), so its warm-up
    and decay are the same as in a run without one. The schedule is stepped once per optimiser
    step by `ppo_epochs`, on every process alike; it is deliberately not handed to accelerate,
    whose wrapper steps it once per process per call (with N processes the rate then reaches 0
    after 1/N of the run).
    """
    policy_params, critic_params = roles.trainable_by_role(model.policy, model.value_model)
    groups = [{"params": policy_params, "lr": hp.learning_rate}]
    if critic_params:
        groups.append({"params": critic_params, "lr": hp.vf_learning_rate or hp.learning_rate})
    optimizer = torch.optim.AdamW(
        groups,
        lr=hp.learning_rate,
        eps=hp.adam_epsilon,
        weight_decay=hp.weight_decay,
        fused=_fused_adamw_supported(),  # one kernel per step instead of a loop of small ones
    )
    frozen = hp.critic_warmup_updates * hp.num_ppo_epochs * hp.num_mini_batches
    schedules = [_lr_lambda(hp.lr_scheduler_type, hp.warmup_steps, num_steps - frozen, start=frozen)]
    if critic_params:
        schedules.append(_lr_lambda(hp.lr_scheduler_type, hp.warmup_steps, num_steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedules)
    return optimizer, scheduler


def loss_settings(hp: PPOHyperparams) -> algo.LossSettings:
    """The knobs of `algo.ppo_loss` from the config (clip ranges default to `cliprange`)."""
    return algo.LossSettings(
        cliprange_low=hp.cliprange if hp.cliprange_low is None else hp.cliprange_low,
        cliprange_high=hp.cliprange if hp.cliprange_high is None else hp.cliprange_high,
        dual_clip_c=hp.dual_clip_c,
        cliprange_value=hp.cliprange_value,
        vf_coef=hp.vf_coef,
        entropy_coef=hp.entropy_coef,
        kl_loss_coef=hp.kl_loss_coef,
        kl_loss_estimator=hp.kl_loss_estimator,
        aggregation=hp.loss_aggregation,
    )


def micro_batches(minibatch: torch.Tensor, sizes: BatchSizes) -> list[torch.Tensor]:
    """Row indices of each micro-batch of a minibatch: consecutive groups of `sizes.micro_batch` rows."""
    return list(minibatch.split(sizes.micro_batch))


def micro_batch_loss(model: nn.Module, mb: Rollout, hp: PPOHyperparams, num_micro_batches: int) -> tuple[torch.Tensor, dict]:
    """The loss to back-propagate for one micro-batch and its detached statistics.

    The loss is normalised over this micro-batch (`algo.loss_normalisers` of its rows) and divided
    by the number of micro-batches, so the accumulated gradient is their mean (TRL's gradient
    accumulation; `algo`'s docstring says how a normaliser over the whole minibatch makes the
    gradient independent of the split instead).
    """
    width = mb.response_ids.shape[1]
    logits, new_values = model(mb.input_ids, mb.attention_mask, width)
    new_logprobs, token_entropy = algo.logprobs_and_entropy(logits, mb.response_ids, hp.temperature, entropy_grad=hp.entropy_coef > 0)
    terms = algo.ppo_loss(
        loss_settings(hp), algo.loss_normalisers(mb.response_mask, hp.loss_aggregation, hp.response_length), mb.response_mask,
        new_logprobs, mb.logprobs, mb.advantages, token_entropy,
        values=new_values, old_values=mb.values, returns=mb.returns, ref_logprobs=mb.ref_logprobs,
    )
    loss = terms.loss / num_micro_batches
    stats = {
        "approxkl": terms.stats.approxkl, "clipfrac": terms.stats.clipfrac, "pg_loss": terms.policy, "entropy": terms.entropy,
        "ratio": terms.stats.ratio,
    }
    optional = {"vf_loss": terms.value, "vf_clipfrac": terms.value_clipfrac, "kl_loss": terms.kl, "dual_clipfrac": terms.dual_clipfrac}
    stats.update({k: v for k, v in optional.items() if v is not None})
    return loss, stats


def ppo_epochs(
    model: nn.Module, optimizer, scheduler, rollout: Rollout, hp: PPOHyperparams, sizes: BatchSizes, engine,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor], train_policy: bool = True,
) -> dict[str, float]:
    """Every optimiser step of one update; returns the loss statistics (means over processes).
    engine (ppokit.parallel): how gradients are synchronised and clipped under ddp or fsdp.

    train_policy False (the critic's warm-up): the loss is computed and back-propagated as usual
    (every process's gradients are reduced alike), then the policy's gradients are dropped before
    clipping, so the optimiser moves the critic alone and the policy's AdamW state stays untouched.
    """
    accelerator = engine.accelerator
    policy_params = optimizer.param_groups[0]["params"]
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
            if not train_policy:
                for p in policy_params:
                    p.grad = None
            grad_norm = engine.clip_grad_norm_(model, hp.max_grad_norm)  # max_grad_norm 0: the norm, unclipped
            # Checked before the step: a non-finite loss or gradient must never reach the weights.
            # One check of both, so that several processes agree in one reduction.
            check_finite({"loss": step_loss, "gradient": grad_norm}, accelerator)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    return training_metrics(stats, has_tokens, reduce_sum)


def _lr_lambda(kind: str, warmup: int, total: int, start: int = 0):
    """The schedule's factor at each optimiser step; a schedule that starts at step `start` is 0 before it."""

    def factor(step: int) -> float:
        if step < start:
            return 0.0
        step -= start
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
