"""Statistics over masked tokens, as pure functions over tensors: means, variances, whitening (over this process's
batch or every process's), explained variance, and the unbiased pass@k estimator.

Every function documents the shapes it takes and returns, using B for the number of sequences, T for response tokens
and V for the vocabulary. This module imports only torch (and the other modules of the mathematics).

References:
  [N+]     Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO",
           arXiv:2403.17031.
  [RPP]    Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
           Models", arXiv:2501.03262 (token-level KL penalty, discounted return, advantage
           normalisation over the global batch).
  [Codex]  Chen et al. 2021, "Evaluating Large Language Models Trained on Code", arXiv:2107.03374 (section 2.1:
           the unbiased pass@k estimator 1 - C(n - c, k) / C(n, k) and its numerically stable product form).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


# Sums a tensor over every process (the trainer passes accelerate's reduce); None: one process.
AllReduce = Optional[Callable[[torch.Tensor], torch.Tensor]]


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


def _summed(values: torch.Tensor, all_reduce: AllReduce) -> torch.Tensor:
    return values if all_reduce is None else all_reduce(values)


def _masked_mean_and_var(values: torch.Tensor, mask: torch.Tensor, all_reduce: AllReduce) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean, unbiased variance, count) of values over the real tokens of every process.

    Two passes (the mean first, then the centred squares), one reduction each: the sum of squares
    minus the squared sum loses the digits that matter when the mean is large.
    """
    maskf = mask.to(values.dtype)
    count, total = _summed(torch.stack([maskf.sum(), (values * maskf).sum()]), all_reduce)
    mean = total / count.clamp(min=1)
    centred_sq = _summed((((values - mean) ** 2) * maskf).sum().reshape(1), all_reduce)[0]
    var = torch.where(count > 1, centred_sq / (count - 1).clamp(min=1), centred_sq / count.clamp(min=1))
    return mean, var, count


def whiten_over_batch(values: torch.Tensor, mask: torch.Tensor, all_reduce: AllReduce = None) -> torch.Tensor:
    """`masked_whiten` with the mean and variance taken over the global batch: the real tokens of
    every process (`all_reduce` sums a tensor over them) [RPP, global advantage normalisation].

    values, mask: (B, T) -> (B, T), 0 on padding. Unbiased variance, as `masked_whiten`.
    """
    mean, var, _ = _masked_mean_and_var(values, mask, all_reduce)
    return (values - mean) * torch.rsqrt(var + 1e-8) * mask.to(values.dtype)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, all_reduce: AllReduce = None) -> torch.Tensor:
    """1 - Var(returns - values) / Var(returns) over the real tokens of every process (scalar).

    values (the critic's predictions at rollout time), returns (its targets), mask: (B, T).
    1 is a perfect critic, 0 one no better than a constant, below 0 worse than a constant.
    Returns of zero variance give 0 (nothing to explain), as the metric is a diagnostic.
    """
    _, var_returns, _ = _masked_mean_and_var(returns, mask, all_reduce)
    _, var_residual, _ = _masked_mean_and_var(returns - values, mask, all_reduce)
    return torch.where(var_returns > 0, 1 - var_residual / var_returns.clamp(min=torch.finfo(var_returns.dtype).tiny), torch.zeros_like(var_returns))


def pass_at_k(n: torch.Tensor, c: torch.Tensor, k: int) -> torch.Tensor:
    """The unbiased pass@k estimator [Codex, section 2.1], per problem.

    n: (P,) long, samples drawn for each problem; c: (P,) long, how many of them were correct (0 <= c <= n);
    k: the budget, 1 <= k <= min(n) -> (P,) float64, the estimated probability that at least one of k samples is correct:
      pass@k = 1 - C(n - c, k) / C(n, k)  =  1 - prod_{i = n - c + 1}^{n} (1 - k / i)
    and exactly 1 where n - c < k (every draw of k holds a correct sample). The product form never forms the
    binomial coefficients, which overflow float64 from n ~ 1030 on. Averaged over problems it is the pass@k of a
    benchmark; with k = 1 it is c / n.
    """
    n, c = torch.as_tensor(n, dtype=torch.long), torch.as_tensor(c, dtype=torch.long)
    if k < 1 or bool((n < k).any()) or bool(((c < 0) | (c > n)).any()):
        raise ValueError(f"pass_at_k needs 1 <= k <= n and 0 <= c <= n; got k={k}, n={n.tolist()}, c={c.tolist()}")
    i = torch.arange(1, int(n.max()) + 1 if n.numel() else 1, dtype=torch.float64)  # (N,)
    inside = (i > (n - c).unsqueeze(1)) & (i <= n.unsqueeze(1))  # (P, N): the product's factors for each problem
    factors = torch.where(inside, 1.0 - k / i, torch.ones((), dtype=torch.float64))
    return torch.where(n - c < k, torch.ones((), dtype=torch.float64), 1.0 - factors.prod(dim=1))
