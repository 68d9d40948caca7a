"""Stage 4's mathematics, as pure functions over tensors: the per-token KL to the reference, the score placed on the
last token (`shape_rewards`), an environment's rewards moved to the turns that earned them, a teacher's negative
reverse KL (on-policy distillation); and the controllers of the KL coefficient.

Every function documents the shapes it takes and returns, using B for the number of sequences, T for response tokens
and V for the vocabulary. This module imports only torch (and the other modules of the mathematics).

References:
  [KL]     Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html.
  [Z19]    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences",
           arXiv:1909.08593.
  [OPD]    Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated
           Mistakes" (GKD), arXiv:2306.13649; Lu & Thinking Machines Lab 2025, "On-Policy Distillation"
           (the student samples, the teacher scores each sampled token, the per-token reverse KL
           log pi_student - log pi_teacher is the negative reward).
"""

from __future__ import annotations

from typing import Optional

import torch


KL_ESTIMATORS = ("k1", "k2", "k3")
LOG_RATIO_CLAMP = 20.0  # |log p - log q| bound before exp (verl's and OpenRLHF's): e^20 ~ 4.9e8, finite in bf16 and float32


def clamp_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """A log-prob difference clamped to +-LOG_RATIO_CLAMP, taken before every exp of one (the PPO ratio, k3).

    (any shape) -> same shape. Within the bound it is log_ratio itself, bit for bit, and so is the gradient
    through it. Beyond it the value is +-20 and the gradient through it is 0 (clamp's derivative outside its
    range), so exp(...) of it is at most e^20 ~ 4.9e8 and such a token adds a bounded term and no gradient
    through the exp (verl and OpenRLHF do the same). Without it one token at log-ratio 25 adds |A| e^25 ~
    7e10 |A| to the policy loss and to its gradient, and float32/bf16 reach inf from log-ratio ~89 on.
    """
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def kl_per_token(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1",
                 clamp: Optional[float] = None) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens [KL].

    logprobs, ref_logprobs: (B, T) -> (B, T). With r = ref_logprobs - logprobs:
      k1 = -r               unbiased, can be negative per token;
      k2 = r^2 / 2          biased, always >= 0, low variance;
      k3 = (e^r - 1) - r    unbiased, always >= 0, low variance; e^r with r clamped to
                            +-LOG_RATIO_CLAMP (`clamp_log_ratio`: beyond it, no gradient through e^r).
    clamp: the estimate is clamped to [-clamp, clamp] (`ppo.kl_clamp`; None: not clamped). Where the
    clamp is active the estimate is the constant +-clamp and its gradient 0: k3's gradient with respect
    to logprobs, 1 - e^r (-3.3e6 at r = 15), becomes 0 there.
    """
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        kl = -log_ratio
    elif estimator == "k2":
        kl = 0.5 * log_ratio**2
    elif estimator == "k3":
        kl = torch.expm1(clamp_log_ratio(log_ratio)) - log_ratio
    else:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    return kl if clamp is None else kl.clamp(-clamp, clamp)


def shape_rewards(
    scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float, score_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: a KL penalty on every trained token, the score added at each row's score position.

    scores: (B,); kl: (B, T); mask: (B, T) bool, the trained tokens; score_index: (B,) long, the column
    that receives the score (`Episodes.score_index`: single-turn, the last trained token)
    -> (rewards (B, T), non_score_rewards (B, T)), both 0 outside the mask.
    r_t = -kl_coef * KL_t, and r_score_index += score  [Z19, eq. 2; N+ "per-token KL penalty"].
    A row without trained tokens (one dropped from the update) gets no score: it is all padding.
    """
    maskf = mask.to(kl.dtype)
    non_score = -kl_coef * kl * maskf
    rewards = non_score.clone()
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    score_index = score_index.to(rewards.device)
    rewards[rows, score_index] += scores.to(rewards.dtype) * maskf[rows, score_index]
    return rewards, non_score


def place_turn_rewards(rewards: torch.Tensor, score_index: torch.Tensor, summed: torch.Tensor, per_turn: torch.Tensor,
                       weight: float) -> torch.Tensor:
    """Per-token rewards with an environment's part of each score moved to the turns that earned it.

    rewards: (B, T), the score (a weighted sum of sources, the environment's weighted by `weight`) at score_index
    (B,) long; summed: (B,) the environment's step rewards summed per episode (NaN where it failed: that row is out
    of the update, nothing is moved); per_turn: (B, T) each step's reward at the last token of its turn
    -> (B, T): r - weight * summed at score_index, + weight * per_turn everywhere. Exact while the score is a plain
    weighted sum (no normalisation or clipping of the environment's part: the config refuses them: `PPOConfig.turn_weight`).
    """
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    moved = rewards.clone()
    moved[rows, score_index] -= weight * torch.nan_to_num(summed.to(rewards.device, rewards.dtype))
    return moved + weight * per_turn.to(rewards.device, rewards.dtype)


def distillation_rewards(logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor,
                         coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards of on-policy distillation: the negative reverse KL to a teacher on the sampled tokens [OPD].

    logprobs: (B, T) the student's logprobs of its own sampled tokens (the rollout's old logprobs);
    teacher_logprobs: (B, T) the teacher's logprobs of the same tokens; mask: (B, T) bool, the trained tokens
    -> (rewards (B, T), reverse_kl (B, T)), both 0 outside the mask:
      reverse_kl_t = log pi_student(y_t) - log pi_teacher(y_t)   (a one-sample estimate of KL(student || teacher))
      rewards_t    = -coef * reverse_kl_t
    placed on each token as the KL penalty's (`shape_rewards`), so gae and the critic-free estimators read them alike.
    Both results are detached: the teacher's score is a reward, and no gradient reaches the policy (or the teacher)
    through it; the policy learns from it only through the advantages, as from any reward.
    """
    maskf = mask.to(logprobs.dtype)
    reverse_kl = ((logprobs - teacher_logprobs) * maskf).detach()
    return -coef * reverse_kl, reverse_kl


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
