"""Advantage estimators, as pure functions over tensors: GAE against a value model, and the critic-free ones (GRPO,
RLOO, REINFORCE++, ReMax) with the discounted returns they use. A mask may have several spans per row: whatever
runs backwards in time steps from one True position to the previous one.

Every function documents the shapes it takes and returns, using B for the number of sequences, T for response tokens
and V for the vocabulary. This module imports only torch (and the other modules of the mathematics).

References:
  [GAE]    Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized
           Advantage Estimation", arXiv:1506.02438.
  [GRPO]   Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
           Language Models", arXiv:2402.03300 (section 4.1.2, outcome supervision).
  [DrGRPO] Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective",
           arXiv:2503.20783 (section 3.2: no std scaling, no 1/|o_i| length normalisation).
  [RLOO]   Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
           Learning from Human Feedback in LLMs", arXiv:2402.14740 (section 3, RLOO estimator);
           Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!".
  [RPP]    Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
           Models", arXiv:2501.03262 (token-level KL penalty, discounted return, advantage
           normalisation over the global batch).
  [ReMax]  Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning
           Method for Aligning Large Language Models", arXiv:2310.10505 (Algorithm 1: the
           greedy response's reward as the baseline).
  [LitePPO] Liu et al. 2025, "Part I: Tricks or Traps? A Deep Dive into RL for LLM Reasoning",
           arXiv:2508.08221 (advantages with the group's mean and the batch's standard deviation).
"""

from __future__ import annotations

import torch

from ppokit.training.masks import mask_first_order, restore_order
from ppokit.training.statistics import AllReduce, _masked_mean_and_var, whiten_over_batch


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the trained tokens [GAE, eq. 16].

    rewards, values: (B, T); mask: (B, T) bool, the trained tokens -> (advantages (B, T), returns (B, T)),
    0 outside the mask. With t' the next masked position after t:
    delta_t = r_t + gamma * V_{t'} - V_t;  A_t = delta_t + gamma * lam * A_{t'}.
    The positions outside the mask are not steps: between two spans of a row (an observation between
    two model turns) the value bootstraps across the gap as if its tokens were not there; after the
    last masked position the episode ends (V after it is 0). Vectorised over the batch; one pass
    backwards in time over each row's masked positions moved to its front (`mask_first_order`; with
    one span from column 0, the identity). returns = advantages + values (the value target).
    """
    order = mask_first_order(mask)
    advantages, returns = _gae_prefix(rewards.gather(1, order), values.gather(1, order), mask.gather(1, order), gamma, lam)
    return restore_order(advantages, order), restore_order(returns, order)


def _gae_prefix(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """`gae` for a mask that is a prefix of each row: padding after it holds r = V = 0."""
    maskf = mask.to(values.dtype)
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


def sequence_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The outcome reward of each sequence: its per-token rewards summed over real tokens.

    rewards: (B, T) from `shape_rewards`; mask: (B, T) bool, the trained tokens -> (B,).
    With the KL in the reward this is score - kl_coef * sum_t KL_t; without it, the score.
    """
    return (rewards * mask.to(rewards.dtype)).sum(-1)


def _groups(scores: torch.Tensor, valid: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scores (G, n), valid (G, n) float, members per group (G, 1)) for rows laid out in groups."""
    if scores.shape[0] % group_size:
        raise ValueError(f"{scores.shape[0]} rows are not whole groups of {group_size}")
    r = scores.reshape(-1, group_size)
    v = valid.reshape(-1, group_size).to(r.dtype)
    return r, v, v.sum(1, keepdim=True)


def grpo_advantages(
    scores: torch.Tensor, valid: torch.Tensor, group_size: int, scale_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-normalised outcome advantage [GRPO, section 4.1.2]; unscaled with scale_std=False [DrGRPO].

    scores: (B,) outcome reward of each sequence; valid: (B,) bool; B = G * group_size -> (B,).
    A_i = (r_i - mean_g r) / (std_g r + eps)  (std with Bessel's correction, as torch.std), or
    A_i = r_i - mean_g r  (Dr. GRPO), both over the valid members of i's group.
    A group with fewer than two valid members has no baseline: its advantages are 0, and so are
    a group's whose rewards are all equal.
    """
    r, v, count = _groups(scores, valid, group_size)
    mean = (r * v).sum(1, keepdim=True) / count.clamp(min=1)
    advantage = (r - mean) * v
    if scale_std:
        std = ((advantage**2).sum(1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
        advantage = advantage / (std + eps)
    return torch.where(count >= 2, advantage, torch.zeros_like(advantage)).reshape(-1)


def grpo_advantages_batch_std(
    scores: torch.Tensor, valid: torch.Tensor, group_size: int, all_reduce: AllReduce = None, eps: float = 1e-6
) -> torch.Tensor:
    """Group-mean baseline, batch-level scale [LitePPO]: `grpo_advantages` with the standard deviation of the whole
    batch's rewards in place of each group's (TRL `scale_rewards: batch`).

    scores: (B,) outcome reward of each sequence; valid: (B,) bool; B = G * group_size -> (B,).
    A_i = (r_i - mean_g r) / (std_B r + eps): mean_g over the valid members of i's group, std_B (with Bessel's
    correction) over the valid rows of every process (`all_reduce` sums over them; None: this batch alone).
    As in `grpo_advantages`, a group with fewer than two valid members gets 0, and so does a group whose rewards are
    all equal; a group's spread then weighs the advantage instead of being divided out.
    """
    r, v, count = _groups(scores, valid, group_size)
    mean = (r * v).sum(1, keepdim=True) / count.clamp(min=1)
    _, var, _ = _masked_mean_and_var(scores, valid, all_reduce)
    advantage = (r - mean) * v / (var.sqrt() + eps)
    return torch.where(count >= 2, advantage, torch.zeros_like(advantage)).reshape(-1)


def rloo_advantages(scores: torch.Tensor, valid: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out advantage [RLOO, section 3].

    scores: (B,); valid: (B,) bool; B = G * group_size -> (B,).
    A_i = r_i - 1/(k - 1) * sum_{j != i} r_j over the k valid members of i's group
        = k/(k - 1) * (r_i - mean_g r). Groups with fewer than two valid members: 0.
    """
    r, v, count = _groups(scores, valid, group_size)
    total = (r * v).sum(1, keepdim=True)
    advantage = (r - (total - r) / (count - 1).clamp(min=1)) * v
    return torch.where(count >= 2, advantage, torch.zeros_like(advantage)).reshape(-1)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_k gamma^k r_{t_k} over the masked positions t = t_0 < t_1 < ... of each row.

    rewards: (B, T); mask: (B, T) bool, the trained tokens -> (B, T), 0 outside the mask. Positions
    outside the mask are not steps (a gap between two spans is not discounted over), as in `gae`.
    One pass backwards over each row's masked positions moved to its front (`mask_first_order`).
    """
    order = mask_first_order(mask)
    return restore_order(_discounted_returns_prefix(rewards.gather(1, order), mask.gather(1, order), gamma), order)


def _discounted_returns_prefix(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """`discounted_returns` for a mask that is a prefix of each row."""
    maskf = mask.to(rewards.dtype)
    rewards = rewards * maskf
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    return returns * maskf


def reinforce_pp_advantages(
    rewards: torch.Tensor, mask: torch.Tensor, gamma: float, whiten: bool = True, all_reduce: AllReduce = None
) -> torch.Tensor:
    """REINFORCE++ [RPP]: the discounted return of the KL-shaped token rewards, normalised over
    the global batch.

    rewards: (B, T) from `shape_rewards` (score at the last real token, -kl_coef * KL_t on every
    token); mask: (B, T) bool, the trained tokens -> (B, T). A_t = (G_t - mean G) / std G over the real tokens
    of every process (`all_reduce`); whiten=False keeps G_t (plain REINFORCE with a KL penalty).
    """
    returns = discounted_returns(rewards, mask, gamma)
    return whiten_over_batch(returns, mask, all_reduce) if whiten else returns


def remax_advantages(rewards: torch.Tensor, mask: torch.Tensor, baseline_scores: torch.Tensor) -> torch.Tensor:
    """ReMax [ReMax, Algorithm 1]: the return minus the greedy response's reward.

    rewards: (B, T) per-token rewards of the sampled responses; baseline_scores: (B,) score of the
    greedy response to the same prompt -> (B, T). A_t = sum_{s >= t} r_s - r(greedy); with no KL in
    the reward, A_t = r - r(greedy) on every token.
    """
    returns = discounted_returns(rewards, mask, 1.0)
    return (returns - baseline_scores.to(returns.dtype).unsqueeze(1)) * mask.to(returns.dtype)
