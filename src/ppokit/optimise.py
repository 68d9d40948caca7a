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

import contextlib
from typing import Callable, Optional

import torch
from torch import nn

from ppokit import algo, batching
from ppokit.config import BatchSizes, PPOHyperparams
from ppokit.guards import check_finite, gradient_norm
from ppokit.models import response_logprobs, response_values
from ppokit.rollout import Rollout
from ppokit.statistics import training_metrics


class PolicyAndValue(nn.Module):
    """Policy and value model under one module, so one optimiser and one `prepare` cover both.

    lm_head_chunk_size: the memory-light LM head's chunk (None: the direct computation);
    `use_compiled_backbones()` runs both backbones through torch.compile in the training forward.
    """

    def __init__(self, policy: nn.Module, value_model: nn.Module, lm_head_chunk_size: Optional[int] = None):
        super().__init__()
        self.policy = policy
        self.value_model = value_model
        self.lm_head_chunk_size = lm_head_chunk_size
        # Compiled stand-ins for the two backbones; a plain attribute, not submodules: they wrap these
        # modules' own weights, which must not appear twice in a state_dict.
        self.__dict__["backbones"] = (None, None)

    def use_compiled_backbones(self) -> None:
        from ppokit.compiled import compiled_backbone

        self.__dict__["backbones"] = (compiled_backbone(self.policy), compiled_backbone(self.value_model))

    def forward(self, input_ids, attention_mask, response_ids, response_mask, temperature: float, entropy_grad: bool = False):
        """(B, P + R), (B, R) -> (logprobs, entropy, values), each (B, R), 0 at padding.

        Logprobs and entropy by `models.response_logprobs` (the reference pass uses it too); values:
        the critic's value of the state before each response token.
        """
        policy_backbone, value_backbone = self.__dict__["backbones"]
        logprobs, entropy = response_logprobs(
            self.policy, input_ids, attention_mask, response_ids, response_mask, temperature, chunk_size=self.lm_head_chunk_size,
            with_entropy=True, entropy_grad=entropy_grad, backbone_fn=policy_backbone,
        )
        values = response_values(self.value_model, input_ids, attention_mask, response_ids.shape[1], value_backbone)
        return logprobs, entropy, values


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


def micro_batches(rollout: Rollout, minibatch: torch.Tensor, sizes: BatchSizes, hp: PPOHyperparams) -> list[Rollout]:
    """The micro-batches of a minibatch (row indices into `rollout`): consecutive groups of
    `sizes.micro_batch` rows, or with ppo.max_tokens_per_micro_batch rows of similar length packed
    within the token budget and trimmed (ppokit.batching)."""
    return [mb for _, mb in batching.split(rollout, minibatch, sizes.micro_batch, hp.max_tokens_per_micro_batch)]


def loss_shares(micros: list[Rollout], by_tokens: bool, reduce_sum: Callable[[torch.Tensor], torch.Tensor], processes: int) -> list:
    """The factor each micro-batch's token-mean loss is multiplied by before its backward: the one
    place the loss normalisation is decided.

    Default (TRL): 1 / the number of micro-batches, so the accumulated gradient is the mean of the
    micro-batches' token means (a token weighs more in a micro-batch with fewer tokens).
    by_tokens (ppo.max_tokens_per_micro_batch): the micro-batch's real tokens / the minibatch's,
    counted over every process and divided by their number (DDP averages gradients over processes):
    the accumulated gradient is that of the token mean over the whole (global) minibatch, whatever its
    split. A token-mean loss times its tokens is its sum, so this is sum_micro / D with one D per
    minibatch (algo's contract for loss aggregations).
    """
    if not by_tokens:
        return [1.0 / len(micros)] * len(micros)
    tokens = torch.stack([mb.response_mask.sum() for mb in micros]).float()
    per_process = reduce_sum(tokens.sum()) / processes
    return list(tokens / per_process.clamp(min=1))


def micro_batch_loss(model: nn.Module, mb: Rollout, hp: PPOHyperparams, share) -> tuple[torch.Tensor, dict]:
    """The loss to back-propagate for one micro-batch (its token-mean loss times `share`, see
    `loss_shares`) and its detached statistics (token means over the micro-batch)."""
    new_logprobs, token_entropy, new_values = model(mb.input_ids, mb.attention_mask, mb.response_ids, mb.response_mask, hp.temperature)
    pg_loss, pg_stats = algo.clipped_policy_loss(new_logprobs, mb.logprobs, mb.advantages, mb.response_mask, hp.cliprange)
    vf_loss, vf_clipfrac = algo.clipped_value_loss(new_values, mb.values, mb.returns, mb.response_mask, hp.cliprange_value)
    loss = (pg_loss + hp.vf_coef * vf_loss) * share
    stats = {
        "approxkl": pg_stats.approxkl, "clipfrac": pg_stats.clipfrac, "pg_loss": pg_loss.detach(), "vf_loss": vf_loss.detach(),
        "vf_clipfrac": vf_clipfrac, "entropy": algo.masked_mean(token_entropy, mb.response_mask), "ratio": pg_stats.ratio,
    }
    return loss, stats


def ppo_epochs(
    model: nn.Module, optimizer, scheduler, rollout: Rollout, hp: PPOHyperparams, sizes: BatchSizes, accelerator,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, float]:
    """Every optimiser step of one update; returns the loss statistics (means over processes) and
    perf/padding_share, the share of padding among the token positions the training forwards processed.

    Statistics are token means per micro-batch, averaged over micro-batches (TRL); with
    ppo.max_tokens_per_micro_batch they are token means per minibatch, averaged over minibatches, so
    that they do not depend on the split either (val/ratio_var is then the variance over minibatches).
    """
    device = rollout.query_ids.device
    by_tokens = hp.max_tokens_per_micro_batch is not None
    stats: dict[str, list[torch.Tensor]] = {}
    # A micro-batch (minibatch, by tokens) whose rows were all dropped (reward.on_error=skip) has no tokens: its
    # statistics are 0 by convention, not measurements, so it is left out of the averages (ratio 0 would read as a collapse).
    has_tokens: list[torch.Tensor] = []
    processed, real = 0, torch.zeros((), device=device)
    for _ in range(hp.num_ppo_epochs):
        order = torch.randperm(len(rollout), device=device)
        for start in range(0, len(rollout), sizes.local_mini_batch):
            micros = micro_batches(rollout, order[start : start + sizes.local_mini_batch], sizes, hp)
            shares = loss_shares(micros, by_tokens, reduce_sum, accelerator.num_processes)
            tokens = torch.stack([mb.response_mask.sum() for mb in micros]).float()
            step_loss = torch.zeros((), device=device)
            minibatch_stats: dict[str, torch.Tensor] = {}
            for k, (mb, share) in enumerate(zip(micros, shares)):
                # Gradients are synchronised across processes on the last micro-batch only.
                with accelerator.no_sync(model) if k < len(micros) - 1 else contextlib.nullcontext():
                    loss, micro_stats = micro_batch_loss(model, mb, hp, share)
                    accelerator.backward(loss)
                step_loss = step_loss + loss.detach()
                if by_tokens:  # the minibatch's token mean: each micro-batch's mean weighted by its tokens
                    weight = tokens[k] / tokens.sum().clamp(min=1)
                    for key, value in micro_stats.items():
                        minibatch_stats[key] = minibatch_stats.get(key, 0.0) + value * weight
                else:
                    for key, value in micro_stats.items():
                        stats.setdefault(key, []).append(value)
                    has_tokens.append(mb.response_mask.any())
            if by_tokens:
                for key, value in minibatch_stats.items():
                    stats.setdefault(key, []).append(value)
                has_tokens.append(tokens.sum() > 0)
            mb_processed, mb_real = batching.padded_tokens(micros)
            processed, real = processed + mb_processed, real + mb_real
            if hp.max_grad_norm > 0:
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), hp.max_grad_norm)
            else:
                grad_norm = gradient_norm(model.parameters())
            # Checked before the step: a non-finite loss or gradient must never reach the weights.
            # One check of both, so that several processes agree in one reduction.
            check_finite({"loss": step_loss, "gradient": grad_norm}, accelerator)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    padding = reduce_sum(torch.stack([torch.tensor(float(processed), device=device), real.float()]))
    return {**training_metrics(stats, has_tokens, reduce_sum), "perf/padding_share": 1.0 - padding[1].item() / max(padding[0].item(), 1.0)}


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
