"""Stage 6 of an update: num_ppo_epochs passes of clipped policy + value loss over minibatches.

    for each epoch:                       rows of the episodes in a fresh random order
      for each minibatch:                 one optimiser step
        for each micro-batch:             forward + backward (policy, then critic); gradients accumulate
          micro_batch_backward(...)
        clip gradients; a non-finite loss or gradient: skip the step (or stop the update, to be rolled
        back: ppo.nonfinite_rollback memory/disk); optimiser step; schedule step

`micro_batches` is the one place micro-batches are formed (fixed rows, or a token budget:
ppokit.training.batching), `loss_normalisers` the one place the loss normalisation is decided and
`micro_batch_backward` the one place a micro-batch's losses are computed and back-propagated (`algo.ppo_loss` with the
knobs of `loss_settings`); the
optimiser and its schedule are built by `build_optimiser`: two parameter groups, the policy's and
the critic's (`ppo.vf_learning_rate`), each on its own schedule; during the first
`ppo.critic_warmup_updates` updates only the critic moves. Without a critic (a critic-free
estimator) there is one group and no value loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from typing import Any, Callable, Optional

import torch
from torch import nn

from ppokit.models import prefix, roles

from ppokit.training import algo, batching, segments
from ppokit.training.batch_sizes import BatchSizes
from ppokit.config.schema import PER_MICRO_BATCH, PER_MINIBATCH, PPOHyperparams
from ppokit.training.episodes import Episodes
from ppokit.training.guards import NonFiniteUpdate, check_finite
from ppokit.metrics.values import training_metrics
from ppokit.models.forwards import Layout, response_logprobs, response_values


class PolicyAndValue(nn.Module):
    """Policy and value model under one module, so one optimiser and one `prepare` cover both.
    value_model is None for a critic-free estimator.

    lm_head_chunk_size: the memory-light LM head's chunk (None: the direct computation);
    padding_free: the forwards' layout (`models.hidden_states`): packed rows (True, ppo.padding_free), a group's
    prompt once (`models.prefix.SharedPrefix`, ppo.shared_prompt) or padded rows (False);
    `use_compiled_backbones()` runs both backbones through torch.compile in the training forward.
    """

    def __init__(self, policy: nn.Module, value_model: Optional[nn.Module], lm_head_chunk_size: Optional[int] = None,
                 padding_free: Layout = False):
        super().__init__()
        self.policy = policy
        self.value_model = value_model
        self.lm_head_chunk_size = lm_head_chunk_size
        self.padding_free = padding_free
        # Compiled stand-ins for the two backbones (training only); a plain attribute, not submodules:
        # they wrap these modules' own weights, which must not appear twice in a state_dict.
        self.__dict__["backbones"] = (None, None)

    def use_compiled_backbones(self) -> None:
        from ppokit.models.compiled import compiled_backbone

        critic = compiled_backbone(self.value_model) if self.value_model is not None else None
        self.__dict__["backbones"] = (compiled_backbone(self.policy), critic)

    def forward(self, input_ids, attention_mask, response_ids, trained_mask, temperature: float, entropy_grad: bool = False,
                part: str = "both"):
        """The training forward. input_ids, attention_mask (B, P + R); response_ids, trained_mask (B, R)
        -> (logprobs, entropy, values), each (B, R); logprobs and entropy 0 outside trained_mask.

        part "policy" runs the policy alone (values None), "value" the critic alone (logprobs and entropy None),
        "both" both. Each part goes through this forward, so that what accelerate wraps it in (autocast) applies.
        Logprobs and entropy by `models.response_logprobs`, the function the reference pass uses too.
        """
        logprobs = entropy = values = None
        if part in ("both", "policy"):
            logprobs, entropy = response_logprobs(
                self.policy, input_ids, attention_mask, response_ids, trained_mask, temperature, chunk_size=self.lm_head_chunk_size,
                with_entropy=True, entropy_grad=entropy_grad, backbone_fn=self.__dict__["backbones"][0],
                padding_free=self.padding_free,
            )
        if part in ("both", "value"):
            values = self.values(input_ids, attention_mask, response_ids.shape[1], self.__dict__["backbones"][1])
        return logprobs, entropy, values

    def values(self, input_ids, attention_mask, response_length: int, backbone_fn=None) -> Optional[torch.Tensor]:
        """(B, P + R) -> the critic's value of the state before each response token (B, R); None without a critic.
        backbone_fn: the compiled backbone (training only; the rollout's value pass runs eager)."""
        if self.value_model is None:
            return None
        return response_values(self.value_model, input_ids, attention_mask, response_length, backbone_fn, self.padding_free)

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


def prepare_training(built: roles.Roles, strategy, hp: PPOHyperparams, sizes: BatchSizes, *, lm_head_chunk_size: Optional[int],
                     compile: bool, unwrap: Callable[[nn.Module], nn.Module]) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """-> (model, optimizer, scheduler): the policy and critic of `built` under one trainable module (`PolicyAndValue`),
    placed by the parallel `strategy` with its optimiser over the run's optimiser steps (`sizes`: `build_optimiser`).
    The memory-light LM head (lm_head_chunk_size) and the compiled forward (`compile`) read the logits from the last
    hidden state: `roles.build_roles` checked the output heads for it. unwrap: the module under the strategy's wrapping."""
    layout = prefix.forward_layout(hp.padding_free, hp.shared_prompt, hp.num_samples_per_prompt)
    trainable = PolicyAndValue(built.policy, built.value, lm_head_chunk_size, layout).train()
    model, optimizer, scheduler = strategy.prepare(trainable, lambda m: build_optimiser(
        m, hp, sizes.optimiser_steps, sizes.warmup_steps, policy_start=sizes.policy_start_step))
    if compile:
        unwrap(model).use_compiled_backbones()
    return model, optimizer, scheduler


def build_optimiser(model: PolicyAndValue, hp: PPOHyperparams, num_steps: int, warmup: int, policy_start: int = 0):
    """AdamW and its learning-rate schedule over `num_steps` optimiser steps, the first `warmup` of them warming up
    (`BatchSizes`: the schedule is decided once, by `batch_sizes.derive`).

    Two parameter groups: the policy's (`learning_rate`) and the critic's (`vf_learning_rate`,
    default the same), in that order; both follow the schedule. The policy's schedule starts at step `policy_start`,
    after the critic's warm-up (`critic_warmup_updates`), so its warm-up
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
        betas=(hp.adam_beta1, hp.adam_beta2),
        eps=hp.adam_epsilon,
        weight_decay=hp.weight_decay,
        fused=_fused_adamw_supported(),  # one kernel per step instead of a loop of small ones
    )
    floor = hp.min_lr_rate or 0.0
    schedules = [_lr_lambda(hp.lr_scheduler_type, warmup, num_steps - policy_start, start=policy_start, min_lr_rate=floor)]
    if critic_params:
        schedules.append(_lr_lambda(hp.lr_scheduler_type, warmup, num_steps, min_lr_rate=floor))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedules)
    return optimizer, scheduler


def loss_settings(hp: PPOHyperparams) -> algo.LossSettings:
    """The knobs of `algo.ppo_loss` from the config (clip ranges default to `cliprange`)."""
    return algo.LossSettings(
        cliprange_low=hp.cliprange if hp.cliprange_low is None else hp.cliprange_low,
        cliprange_high=hp.cliprange if hp.cliprange_high is None else hp.cliprange_high,
        dual_clip_c=hp.dual_clip_c,
        importance_sampling_level=hp.importance_sampling_level,
        cliprange_value=hp.cliprange_value,
        vf_coef=hp.vf_coef,
        entropy_coef=hp.entropy_coef,
        kl_loss_coef=hp.kl_loss_coef,
        kl_loss_estimator=hp.kl_loss_estimator,
        kl_clamp=hp.kl_clamp,
        aggregation=hp.loss_aggregation,
    )


def micro_batches(episodes: Episodes, minibatch: torch.Tensor, sizes: BatchSizes, hp: PPOHyperparams) -> list[Episodes]:
    """The micro-batches of a minibatch (episode indices into `episodes`: its rows, or with an agent's segment rows the
    episodes, each bringing all its rows, `segments.rows_of`): consecutive groups of `sizes.micro_batch` episodes, or
    with ppo.max_tokens_per_micro_batch rows of similar length packed within the token budget and packed
    (ppokit.training.batching); ppo.padding_free: laid out for packed rows."""
    owner = episodes.episode_index
    rows = minibatch if owner is None else segments.rows_of(minibatch, owner)
    return [mb for _, mb in batching.split(episodes, rows, sizes.micro_batch, hp.max_tokens_per_micro_batch, hp.padding_free, owner)]


def loss_normalisers(micros: list[Episodes], hp: PPOHyperparams, reduce_sum: Callable[[torch.Tensor], torch.Tensor],
                     processes: int) -> list[tuple[algo.LossNormalisers, float]]:
    """(normalisers D, scale) for each micro-batch of one minibatch: its loss is ppo_loss(D) x scale.
    The one place the loss normalisation (`hp.loss_normalisation`) is applied (algo's docstring states the contract).

    PER_MICRO_BATCH (TRL, the default): D over each micro-batch's own rows, scale 1 / the number of micro-batches: the
    gradient is the mean of the micro-batches' losses (a token weighs more in a micro-batch with fewer).
    PER_MINIBATCH (with ppo.max_tokens_per_micro_batch): one D over the whole minibatch, summed over every process and
    divided by their number (DDP averages gradients), scale 1: the gradients of the micro-batches add
    up to that of the global minibatch in one piece, however it was split.
    With an agent's segment rows, each row's `row_share` makes an episode of several rows count as one sequence.
    """
    if hp.loss_normalisation == PER_MICRO_BATCH:
        return [(algo.loss_normalisers(mb.trained_mask, hp.loss_aggregation, hp.response_length, mb.row_share), 1.0 / len(micros))
                for mb in micros]
    masks = [mb.trained_mask for mb in micros]
    width = max(mask.shape[1] for mask in masks)
    minibatch = torch.cat([nn.functional.pad(mask, (0, width - mask.shape[1])) for mask in masks])
    shares = None if micros[0].row_share is None else torch.cat([mb.row_share for mb in micros])
    local = algo.loss_normalisers(minibatch, hp.loss_aggregation, hp.response_length, shares)
    policy, value = (reduce_sum(torch.stack([local.policy, local.value])) / processes).unbind()
    return [(algo.LossNormalisers(policy=policy, value=value), 1.0)] * len(micros)


# Statistics that are terms of the loss (sums over the micro-batch's tokens over the minibatch's D when the
# normaliser is the minibatch's: they add up over micro-batches); the others are token means of each micro-batch.
LOSS_TERMS = ("pg_loss", "vf_loss", "kl_loss")


def micro_batch_backward(model: nn.Module, mb: Episodes, hp: PPOHyperparams, normalisers: algo.LossNormalisers, scale: float,
                         backward: Callable[[torch.Tensor], None], separately: bool) -> tuple[torch.Tensor, dict]:
    """Back-propagate one micro-batch's loss (ppo_loss over `normalisers`, times `scale`; see `loss_normalisers`)
    -> (that loss, detached; its detached statistics).

    separately (`parallel.backward_separately`): the policy's terms are back-propagated before the critic runs
    its forward, so that only one model's activations are alive at a time. The gradients are the same (each
    model's come from its own terms; shared weights add up both), as are the statistics. Otherwise one forward
    of both models and one backward of the summed loss, as DDP needs (one backward per forward).
    """
    inputs = (mb.input_ids, mb.attention_mask, mb.response_ids, mb.trained_mask, hp.temperature)
    settings = loss_settings(hp)
    if not separately or model.value_model is None:
        logprobs, entropy, values = model(*inputs, entropy_grad=hp.entropy_coef > 0)
        terms = _ppo_loss(settings, normalisers, mb, logprobs, entropy, values)
        loss = terms.loss * scale
        backward(loss)
        return loss.detach(), _loss_stats(terms, terms.value, terms.value_clipfrac)
    logprobs, entropy, _ = model(*inputs, entropy_grad=hp.entropy_coef > 0, part="policy")
    terms = _ppo_loss(settings, normalisers, mb, logprobs, entropy, None)
    policy_loss = terms.loss * scale
    backward(policy_loss)
    del logprobs, entropy  # the policy's graph is freed: the critic's activations come next
    values = model(*inputs, part="value")[2]
    value, value_clipfrac = algo.value_loss(settings, normalisers, mb.trained_mask, values, mb.values, mb.returns)
    value_loss = settings.vf_coef * value * scale
    backward(value_loss)
    return (policy_loss + value_loss).detach(), _loss_stats(terms, value.detach(), value_clipfrac)


def _ppo_loss(settings: algo.LossSettings, normalisers: algo.LossNormalisers, mb: Episodes, logprobs, entropy, values) -> algo.LossTerms:
    return algo.ppo_loss(
        settings, normalisers, mb.trained_mask, logprobs, mb.logprobs, mb.advantages, entropy,
        values=values, old_values=mb.values, returns=mb.returns, ref_logprobs=mb.ref_logprobs, is_weights=mb.rollout_is_weights,
        row_share=mb.row_share,
    )


def _loss_stats(terms: algo.LossTerms, value: Optional[torch.Tensor], value_clipfrac: Optional[torch.Tensor]) -> dict:
    stats = {
        "approxkl": terms.stats.approxkl, "clipfrac": terms.stats.clipfrac, "pg_loss": terms.policy, "entropy": terms.entropy,
        "ratio": terms.stats.ratio,
    }
    optional = {"vf_loss": value, "vf_clipfrac": value_clipfrac, "kl_loss": terms.kl, "dual_clipfrac": terms.dual_clipfrac}
    stats.update({k: v for k, v in optional.items() if v is not None})
    return stats


def ppo_epochs(
    model: nn.Module, optimizer, scheduler, episodes: Episodes, hp: PPOHyperparams, sizes: BatchSizes, strategy,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor], train_policy: bool = True,
    on_skipped_step: Optional[Callable[[NonFiniteUpdate], None]] = None,
) -> dict[str, float]:
    """Every optimiser step of one update; returns the loss statistics (means over processes) and
    perf/padding_share, the share of padding among the token positions the training forwards processed.
    strategy (ppokit.process.parallel): how gradients are synchronised and clipped under ddp or fsdp.

    Statistics follow the loss normalisation: per micro-batch, averaged over micro-batches (TRL); PER_MINIBATCH
    (ppo.max_tokens_per_micro_batch) they are per minibatch (the loss terms summed over its micro-batches, the rest token means over it),
    averaged over minibatches, so that they do not depend on the split either (val/ratio_var is then
    the variance over minibatches).

    train_policy False (the critic's warm-up): the loss is computed and back-propagated as usual
    (every process's gradients are reduced alike), then the policy's gradients are dropped before
    clipping, so the optimiser moves the critic alone and the policy's AdamW state stays untouched.

    A step whose loss or gradient is not finite (on any process: they agree in one reduction) never reaches
    the weights. With ppo.nonfinite_rollback off it is skipped: its gradients are dropped, the optimiser does
    not step (its state stays), the schedule does, its statistics are left out, and the update goes on;
    `nonfinite_steps` counts such steps, and `on_skipped_step` is told of each. If every step was skipped, NonFiniteUpdate is raised at the end (a
    skipped update that took no step). With memory or disk, NonFiniteUpdate is raised at the first bad step,
    for the caller to roll the whole update back.
    """
    accelerator = strategy.accelerator
    per_minibatch = hp.loss_normalisation == PER_MINIBATCH  # the loss terms add up over its micro-batches
    policy_params = optimizer.param_groups[0]["params"]
    device = episodes.query_ids.device
    stats: dict[str, list[torch.Tensor]] = {}
    # A micro-batch (per_minibatch: a minibatch) whose rows were all dropped (reward.on_error=skip) has no trained tokens: its
    # statistics are 0 by convention, not measurements, so it is left out of the averages (ratio 0 would read as a collapse).
    has_tokens: list[torch.Tensor] = []
    processed, real = 0, torch.zeros((), device=device)
    skipped: list[NonFiniteUpdate] = []
    steps = 0
    if episodes.episode_index is not None:  # an agent's segment rows: each row's share of its episode's tokens
        episodes = dataclasses.replace(episodes, row_share=segments.row_shares(episodes.trained_mask, episodes.episode_index))
    count = int(episodes.is_episode.sum())  # minibatches are of episodes (with their rows), as many on every process
    for _ in range(hp.num_ppo_epochs):
        order = batching.shuffled(count, hp.kept_together, device)
        for start in range(0, count, sizes.local_mini_batch):
            micros = micro_batches(episodes, order[start : start + sizes.local_mini_batch], sizes, hp)
            tokens = torch.stack([mb.trained_mask.sum() for mb in micros]).float()
            step_loss = torch.zeros((), device=device)
            kept = ({key: len(values) for key, values in stats.items()}, len(has_tokens))  # to drop a skipped step's
            minibatch_stats: dict[str, torch.Tensor] = {}
            for k, (mb, (normalisers, scale)) in enumerate(zip(micros, loss_normalisers(micros, hp, reduce_sum, accelerator.num_processes))):
                with strategy.no_sync(model, last=k == len(micros) - 1):
                    loss, micro_stats = micro_batch_backward(model, mb, hp, normalisers, scale, accelerator.backward,
                                                             strategy.backward_separately)
                step_loss = step_loss + loss
                if per_minibatch:
                    weight = tokens[k] / tokens.sum().clamp(min=1)
                    for key, value in micro_stats.items():
                        minibatch_stats[key] = minibatch_stats.get(key, 0.0) + value * (1.0 if key in LOSS_TERMS else weight)
                else:
                    for key, value in micro_stats.items():
                        stats.setdefault(key, []).append(value)
                    has_tokens.append(mb.trained_mask.any())
            if per_minibatch:
                for key, value in minibatch_stats.items():
                    stats.setdefault(key, []).append(value)
                has_tokens.append(tokens.sum() > 0)
            mb_processed, mb_real = batching.padded_tokens(micros, hp.padding_free)
            processed, real = processed + mb_processed, real + mb_real
            if not train_policy:
                for p in policy_params:
                    p.grad = None
            grad_norm = strategy.clip_grad_norm_(model, hp.max_grad_norm)  # max_grad_norm 0: the norm, unclipped
            # Checked before the step: a non-finite loss or gradient must never reach the weights.
            # One check of both, so that several processes agree in one reduction.
            steps += 1
            try:
                check_finite({"loss": step_loss, "gradient": grad_norm}, accelerator)
            except NonFiniteUpdate as bad:
                if hp.rollback != "off":
                    raise
                skipped.append(bad)
                if on_skipped_step is not None:
                    on_skipped_step(bad)
                _drop_since(stats, has_tokens, *kept)
                optimizer.zero_grad(set_to_none=True)
                with warnings.catch_warnings():  # the schedule steps without the optimiser on purpose
                    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
                    scheduler.step()
                continue
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    if skipped and len(skipped) == steps:  # every step was skipped: the update took none
        raise skipped[0]
    padding = reduce_sum(torch.stack([torch.tensor(float(processed), device=device), real.float()]))
    return {**training_metrics(stats, has_tokens, reduce_sum), "perf/padding_share": 1.0 - padding[1].item() / max(padding[0].item(), 1.0),
            "nonfinite_steps": len(skipped)}


def _drop_since(stats: dict[str, list], has_tokens: list, lengths: dict[str, int], tokens_length: int) -> None:
    """Statistics back to their `lengths` (a skipped step's are left out of the update's averages)."""
    for key in list(stats):
        del stats[key][lengths.get(key, 0):]
        if not stats[key]:
            del stats[key]
    del has_tokens[tokens_length:]


def _lr_lambda(kind: str, warmup: int, total: int, start: int = 0, min_lr_rate: float = 0.0):
    """The schedule's factor at each optimiser step; a schedule that starts at step `start` is 0 before it.

    The warm-up gives step i (counted from `start`) (i + 1) / warmup, so that the first step moves the weights; after
    it each schedule is transformers' of the same name on the same step (get_linear_schedule_with_warmup, get_cosine_*
    with num_cycles 0.5, get_cosine_with_min_lr_schedule_with_warmup with `min_lr_rate`), the same float operations."""

    def factor(step: int) -> float:
        if step < start:
            return 0.0
        step -= start
        if warmup and step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        if kind == "linear":
            return max(0.0, (total - step) / max(1, total - warmup))
        progress = float(step - warmup) / float(max(1, total - warmup))
        cosine = 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress))
        if kind == "cosine":
            return max(0.0, cosine)
        return max(0, cosine * (1 - min_lr_rate) + min_lr_rate)  # cosine_with_min_lr

    return factor


def _fused_adamw_supported() -> bool:
    try:
        torch.optim.AdamW([nn.Parameter(torch.zeros(1))], fused=True)
        return True
    except (RuntimeError, TypeError, ValueError):
        return False
