"""The PPO mathematics, as pure functions over tensors.

This module imports only torch. Every function documents the shapes it takes
and returns, using B for the number of sequences, T for response tokens and
V for the vocabulary. Masks are boolean tensors, True on real response tokens
(the stop token included) and False on padding after it.

References:
  [PPO]    Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347.
  [GAE]    Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized
           Advantage Estimation", arXiv:1506.02438.
  [KL]     Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html.
  [Z19]    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences",
           arXiv:1909.08593.
  [N+]     Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO",
           arXiv:2403.17031.
  [BT]     Bradley & Terry 1952, "Rank Analysis of Incomplete Block Designs: I. The Method
           of Paired Comparisons", Biometrika 39(3/4).
  [O22]    Ouyang et al. 2022, "Training language models to follow instructions with human
           feedback", arXiv:2203.02155.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


# --------------------------------------------------------------------------- logprobs


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probability of each chosen token under the temperature-scaled distribution.

    logits: (B, T, V) float; tokens: (B, T) long -> (B, T) float32.

    The logits are divided by the sampling temperature before the softmax in every
    place a logprob is computed (sampling, reference, training), so that the policy
    that is optimised is the one that sampled [N+, detail "scale logits by temperature"].
    Without it the PPO ratio on the first minibatch is not 1.
    """
    scaled = logits.float() / temperature
    logsumexp = torch.logsumexp(scaled, dim=-1)
    chosen = torch.gather(scaled, -1, tokens.unsqueeze(-1)).squeeze(-1)
    return chosen - logsumexp


def logprobs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`logprobs_from_logits` (with grad) and the entropy of the temperature-scaled distribution
    at each position (detached, a statistic), from one log-softmax.

    logits: (B, T, V); tokens: (B, T) long -> (logprobs (B, T) float32, entropy (B, T) float32).
    H = -sum_v p_v log p_v. The training step needs both; sharing the scaled log-softmax saves a
    pass and a float32 copy over the vocabulary per micro-batch.
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    chosen = torch.gather(logp, -1, tokens.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return chosen, entropy


# --------------------------------------------------------------------------- masks


def first_true_index(bools: torch.Tensor) -> torch.Tensor:
    """Index of the first True in each row, or the row length if there is none.

    bools: (B, T) bool -> (B,) long.
    """
    length = bools.shape[-1]
    positions = torch.arange(length, device=bools.device).expand_as(bools)
    return torch.where(bools, positions, torch.full_like(positions, length)).min(-1).values


def truncate_after_stop(response_ids: torch.Tensor, stop_token_id: int, pad_token_id: int):
    """Replace every token after the first stop token by padding.

    response_ids: (B, T) long -> (truncated_ids (B, T) long, response_mask (B, T) bool).
    The stop token itself stays and is a real token: the score is read there
    [N+, details "truncate after EOS" and "reward at EOS"]. Rows that never stop keep all T tokens.
    """
    stop_at = first_true_index(response_ids == stop_token_id)
    positions = torch.arange(response_ids.shape[1], device=response_ids.device)
    response_mask = positions.unsqueeze(0) <= stop_at.unsqueeze(1)
    truncated = response_ids.masked_fill(~response_mask, pad_token_id)
    return truncated, response_mask


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last True in each row of a right-padded mask (0 for an empty row).

    mask: (B, T) bool -> (B,) long.
    """
    return (mask.long().sum(-1) - 1).clamp(min=0)


# --------------------------------------------------------------------------- statistics


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of values where mask is True. values, mask: same shape; dim None -> scalar."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of values where mask is True (scalar), with Bessel's correction by default.

    Fewer than two real tokens: the plain (population) variance, 0 for one token.
    """
    mean = masked_mean(values, mask)
    centred_sq = (values - mean) ** 2
    var = masked_mean(centred_sq, mask)
    if unbiased:
        # torch.where rather than `if count > 1`: no host sync in the middle of an update.
        count = mask.sum().to(var.dtype)
        var = torch.where(count > 1, var * count / (count - 1).clamp(min=1), var)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise values over the real tokens to unit variance (and zero mean if shift_mean).

    values, mask: (B, T) -> (B, T). Padding positions come back as 0.
    Used on advantages (mean shifted) and, when `whiten_rewards`, on rewards
    (mean kept, so the sign of the reward survives) [N+, "reward and advantage whitening"].
    """
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.to(values.dtype)


# --------------------------------------------------------------------------- KL and rewards


def kl_per_token(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens [KL].

    logprobs, ref_logprobs: (B, T) -> (B, T). With r = ref_logprobs - logprobs:
      k1 = -r               unbiased, can be negative per token;
      k2 = r^2 / 2          biased, always >= 0, low variance;
      k3 = (e^r - 1) - r    unbiased, always >= 0, low variance.
    """
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def shape_rewards(
    scores: torch.Tensor, kl: torch.Tensor, response_mask: torch.Tensor, kl_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: a KL penalty on every token, the score added at the last real token.

    scores: (B,); kl: (B, T); response_mask: (B, T) bool
    -> (rewards (B, T), non_score_rewards (B, T)), both 0 on padding.
    r_t = -kl_coef * KL_t, and r_last += score  [Z19, eq. 2; N+ "per-token KL penalty"].
    A row without real tokens (one dropped from the update) gets no score: it is all padding.
    """
    maskf = response_mask.to(kl.dtype)
    non_score = -kl_coef * kl * maskf
    rewards = non_score.clone()
    last = last_token_index(response_mask)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last] += scores.to(rewards.dtype) * maskf[rows, last]
    return rewards, non_score


def gae(
    rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens [GAE, eq. 16].

    rewards, values: (B, T); response_mask: (B, T) bool -> (advantages (B, T), returns (B, T)).
    delta_t = r_t + gamma * V_{t+1} - V_t;  A_t = delta_t + gamma * lam * A_{t+1}.
    Values and rewards on padding are treated as 0, so the episode ends after the last
    real token (V after it is 0). Vectorised over the batch; one pass backwards in time.
    returns = advantages + values (the value target).
    """
    maskf = response_mask.to(values.dtype)
    values = values * maskf
    rewards = rewards * maskf
    length = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    next_adv = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    for t in reversed(range(length)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_adv = delta + gamma * lam * next_adv
        advantages[:, t] = next_adv
        next_value = values[:, t]
    advantages = advantages * maskf
    returns = advantages + values
    return advantages, returns


# --------------------------------------------------------------------------- losses


class PolicyLossStats(NamedTuple):
    """Detached statistics of one policy-loss evaluation (scalars)."""

    approxkl: torch.Tensor
    clipfrac: torch.Tensor
    ratio: torch.Tensor


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """PPO's clipped surrogate objective, as a loss to minimise [PPO, eq. 7].

    logprobs (current policy, with grad), old_logprobs (sampling policy), advantages: (B, T);
    response_mask: (B, T) bool -> (scalar loss, PolicyLossStats).
    L = mean_t max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)), ratio = exp(logp - old_logp).
    approxkl is 0.5 * mean((logp - old_logp)^2) over real tokens, as in OpenAI's baselines
    (TRL's mean also counts padding slots, at 0).
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.max(unclipped, clipped), response_mask)
    with torch.no_grad():
        stats = PolicyLossStats(
            approxkl=0.5 * masked_mean(log_ratio**2, response_mask),
            clipfrac=masked_mean((clipped > unclipped).float(), response_mask),
            ratio=masked_mean(ratio, response_mask),
        )
    return loss, stats


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss [PPO as implemented in OpenAI baselines; N+ "value function clipping"].

    values (with grad), old_values (from the rollout), returns: (B, T); response_mask: (B, T) bool
    -> (scalar loss, detached clip fraction).
    L = 0.5 * mean_t max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2).
    """
    clipped_values = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    unclipped_sq = (values - returns) ** 2
    clipped_sq = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(unclipped_sq, clipped_sq), response_mask)
    clipfrac = masked_mean((clipped_sq > unclipped_sq).float(), response_mask).detach()
    return loss, clipfrac


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of the preferences under the Bradley-Terry model [BT; O22, eq. 1].

    chosen_scores, rejected_scores: (B,) reward-model scores of the preferred and the other
    completion of each pair -> scalar loss.
    P(chosen > rejected) = sigmoid(r_c - r_r);  L = -mean log sigmoid(r_c - r_r).
    Only the difference of the two scores is trained, so the scale's offset is free.
    logsigmoid keeps large negative differences finite.
    """
    return -torch.nn.functional.logsigmoid(chosen_scores.float() - rejected_scores.float()).mean()


# --------------------------------------------------------------------------- KL controllers


class AdaptiveKLController:
    """Adapts the KL coefficient towards a target KL [Z19, section 2.2].

    e = clip(KL / target - 1, -0.2, 0.2);  coef <- coef * (1 + e * n_steps / horizon).
    `kl` is the mean per-sequence KL of the last batch, `n_steps` the episodes in it.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, kl: float, n_steps: int) -> float:
        proportional_error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class FixedKLController:
    """A constant KL coefficient, with the same interface as AdaptiveKLController."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


def kl_controller(kl_coef: float, target: float | None, horizon: float):
    """The adaptive controller when a target KL is set [Z19], else a fixed coefficient."""
    return AdaptiveKLController(kl_coef, target, horizon) if target is not None else FixedKLController(kl_coef)
