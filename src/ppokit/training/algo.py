"""The PPO mathematics, as pure functions over tensors.

This module imports only torch. Every function documents the shapes it takes
and returns, using B for the number of sequences, T for response tokens and
V for the vocabulary. Masks are boolean tensors over the response columns, True on the tokens
trained on and False elsewhere: the trainer passes `Episodes.trained_mask` (ppokit.training.episodes), the
policy's own tokens (the stop token included) of the rows in the update; padding after a response,
tokens the policy reads but did not produce (an observation between two model turns) and rows
outside the update are False. A mask may have several spans per row: whatever runs backwards in
time (`gae`, `discounted_returns`) steps from one True position to the previous one.

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
  [DAPO]   Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
           arXiv:2503.14476 (section 3.1 clip-higher, eps_low < eps_high; section 3.3 token-level
           loss; section 3.4 overlong filtering: the loss of truncated samples masked).
  [DC]     Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement
           Learning", arXiv:1912.09729 (dual-clip PPO: for A < 0 the loss is capped at c * |A|).
  [GSPO]   Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071 (eq. 7: the
           sequence-level ratio s_i = (pi(y_i|x) / pi_old(y_i|x))^(1/|y_i|), clipped per sequence).
  [LitePPO] Liu et al. 2025, "Part I: Tricks or Traps? A Deep Dive into RL for LLM Reasoning",
           arXiv:2508.08221 (advantages with the group's mean and the batch's standard deviation).
  [TIS]    Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
           https://fengyao.notion.site/off-policy-rl (truncated importance sampling between the
           rollout engine's and the trainer's probabilities).
  [AReaL]  Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language
           Reasoning", arXiv:2505.24298 (the decoupled PPO objective for stale rollouts: the ratio against a
           proximal policy, the behaviour policy corrected by an importance weight), after Hilton et al. 2022,
           "Batch size-invariance for policy optimization", arXiv:2110.00641 (decoupling the proximal policy).
  [Codex]  Chen et al. 2021, "Evaluating Large Language Models Trained on Code", arXiv:2107.03374 (section 2.1:
           the unbiased pass@k estimator 1 - C(n - c, k) / C(n, k) and its numerically stable product form).
  [OPD]    Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated
           Mistakes" (GKD), arXiv:2306.13649; Lu & Thinking Machines Lab 2025, "On-Policy Distillation"
           (the student samples, the teacher scores each sampled token, the per-token reverse KL
           log pi_student - log pi_teacher is the negative reward).

Loss aggregation and micro-batches (the contract `ppo_loss` keeps; batching code relies on it):

  Every loss term is  L = sum_{i,t} w_{i,t} * l_{i,t} / D.  The per-token weights w depend only
  on their own row (`token_weights`: 1 on real tokens, or 1/|o_i| for seq_mean_token_mean), and
  the normaliser D is one number for the set of rows that make one optimiser step
  (`loss_normalisers`: real tokens, sequences, or sequences x response_length). So a caller that
  computes D once over a whole minibatch, passes the same D to `ppo_loss` for every micro-batch
  of it and lets the gradients add up gets exactly the gradient of the minibatch in one piece,
  however its rows are split into micro-batches (by count or by a token budget).
  The trainer's default (TRL's) instead computes D over each micro-batch and divides each
  micro-batch's loss by the number of micro-batches: with micro-batches of equal token counts
  the two agree; otherwise the default weights a token by its micro-batch's size. With several
  processes (DDP averages gradients), a D summed over the processes' minibatches and a loss
  multiplied by the number of processes normalise over the global minibatch.
  The value loss is always a token mean (its own D: the real tokens); the policy, KL-loss and
  entropy terms use the configured aggregation.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

import torch
import torch.utils.checkpoint

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm")
LOG_RATIO_CLAMP = 20.0  # |log p - log q| bound before exp (verl's and OpenRLHF's): e^20 ~ 4.9e8, finite in bf16 and float32

# Sums a tensor over every process (the trainer passes accelerate's reduce); None: one process.
AllReduce = Optional[Callable[[torch.Tensor], torch.Tensor]]


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


def logprobs_and_entropy(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`logprobs_from_logits` (with grad) and the entropy of the temperature-scaled distribution
    at each position, from one log-softmax.

    logits: (B, T, V) (or (N, V)); tokens: (B, T) (or (N,)) long -> (logprobs, entropy), float32, tokens' shape.
    H = -sum_v p_v log p_v. The entropy is a detached statistic unless `entropy_grad` (an entropy bonus
    in the loss needs its gradient: dH/ds_k = -p_k (log p_k + H) for the scaled logits s).
    The training step needs both; sharing the scaled log-softmax saves a pass and a float32 copy over
    the vocabulary per micro-batch.
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    chosen = torch.gather(logp, -1, tokens.unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp.exp() * logp).sum(-1)
    return chosen, entropy


class _HeadLogprobs(torch.autograd.Function):
    """logits (N, V) -> (logprobs (N,), entropy (N,)) of the temperature-scaled distribution: the same numbers
    as `logprobs_and_entropy`, whose chain of autograd ops (scale, log-softmax, exp, product) keeps four to
    six (N, V) float32 tensors alive. Here the forward works `rows_per_block` rows at a time and keeps
    nothing of that size; the backward writes the logits' gradient, the one (N, V) tensor it makes, a
    block of rows at a time, in place (with the entropy's gradient, one block-sized temporary).

    Saved for backward: the logits (alive anyway: the head's matmul made them), the tokens, and per row the
    log-normaliser lse and the entropy H. With s = logits / temperature and p = softmax(s):
      d logprob / d s = onehot(token) - p;   d H / d s = -p * (log p + H),  log p = s - lse.
    """

    @staticmethod
    def forward(ctx, logits, tokens, temperature: float, entropy_grad: bool, rows_per_block: int):
        lse, entropy, chosen = (logits.new_empty(logits.shape[0], dtype=torch.float32) for _ in range(3))
        for rows in _row_blocks(logits.shape[0], rows_per_block):
            scaled = logits[rows].to(torch.float32, copy=True).div_(temperature)
            shift = scaled.amax(-1, keepdim=True)
            scaled.sub_(shift)  # s - max: every exp is at most 1
            chosen[rows] = scaled.gather(-1, tokens[rows].unsqueeze(-1)).squeeze(-1)
            exps = scaled.exp()
            total = exps.sum(-1)
            weighted = torch.bmm(exps.unsqueeze(1), scaled.unsqueeze(2)).reshape(-1)  # sum_v exp(s_v - max) (s_v - max)
            log_total = total.log()
            lse[rows] = log_total + shift.squeeze(-1)
            entropy[rows] = log_total - weighted / total  # -sum p log p, log p = (s - max) - log_total
            chosen[rows] -= log_total
        ctx.save_for_backward(logits, tokens, lse, entropy)
        ctx.temperature, ctx.entropy_grad, ctx.rows_per_block = temperature, entropy_grad, rows_per_block
        ctx.mark_non_differentiable(tokens)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return chosen, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, tokens, lse, entropy = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        with_entropy = ctx.entropy_grad and grad_entropy is not None
        inverse_t = 1.0 / ctx.temperature  # d s / d logits, folded into the per-row factors
        for rows in _row_blocks(logits.shape[0], ctx.rows_per_block):
            block = grad[rows]
            torch.add(-lse[rows].unsqueeze(-1), logits[rows], alpha=inverse_t, out=block)  # log p = logits / T - lse, in float32
            entropy_term = block + entropy[rows].unsqueeze(-1) if with_entropy else None  # log p + H, a block's size
            block.exp_()  # p
            if with_entropy:
                entropy_term.mul_(block).mul_(grad_entropy[rows].unsqueeze(-1) * -inverse_t)  # dH/ds * g / T
            if grad_logprobs is not None:
                g = grad_logprobs[rows].unsqueeze(-1) * inverse_t
                block.mul_(-g).scatter_add_(-1, tokens[rows].unsqueeze(-1), g)  # (onehot - p) * g / T
                if with_entropy:
                    block.add_(entropy_term)
            elif with_entropy:
                block.copy_(entropy_term)
            else:
                block.zero_()
        return grad.to(logits.dtype), None, None, None, None


def _row_blocks(rows: int, rows_per_block: int):
    return (slice(start, start + rows_per_block) for start in range(0, rows, rows_per_block))


def head_logprobs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, entropy_grad: bool = False,
                              block_elements: int = 2**22):
    """`logprobs_and_entropy` for logits (N, V) and tokens (N,) without (N, V) temporaries in the forward and
    with one, the gradient, in the backward (`_HeadLogprobs`); rows are taken about `block_elements` logits
    at a time. -> (logprobs (N,) float32 with grad, entropy (N,) float32, with grad only if entropy_grad)."""
    rows_per_block = max(1, block_elements // max(logits.shape[-1], 1))
    entropy_grad = entropy_grad and torch.is_grad_enabled()
    logprobs, entropy = _HeadLogprobs.apply(logits, tokens, temperature, entropy_grad, rows_per_block)
    return logprobs, (entropy if entropy_grad else entropy.detach())


def chunked_head_logprobs(
    hidden: torch.Tensor,
    head,
    tokens: torch.Tensor,
    temperature: float,
    chunk_size: int,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (and entropy) of `tokens` from hidden states, `chunk_size` positions at a time.

    hidden: (N, H), the final hidden state at each position that predicts a token; head: a callable
    (n, H) -> (n, V) logits (the model's output layer); tokens: (N,) long
    -> (logprobs (N,) float32, entropy (N,) float32 or None).

    The same numbers as `logprobs_and_entropy(head(hidden), tokens, temperature)`, but at most
    chunk_size x V logits exist at a time instead of N x V, and of the softmax over them only their
    gradient in the backward (`head_logprobs_and_entropy`). With gradients, each chunk runs under
    activation checkpointing: the forward keeps only the chunk's hidden states, and the backward
    recomputes the chunk's logits (one more head matmul) before differentiating them. Without
    gradients (reference pass) there is nothing to recompute.
    """

    def one_chunk(h: torch.Tensor, t: torch.Tensor):
        logprobs, entropy = head_logprobs_and_entropy(head(h), t, temperature, entropy_grad)
        return logprobs, (entropy if with_entropy else None)

    needs_grad = torch.is_grad_enabled()
    logprobs, entropy = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[start : start + chunk_size], tokens[start : start + chunk_size]
        if needs_grad:
            lp, ent = torch.utils.checkpoint.checkpoint(one_chunk, h, t, use_reentrant=False)
        else:
            lp, ent = one_chunk(h, t)
        logprobs.append(lp)
        entropy.append(ent)
    if not logprobs:  # no real token in the micro-batch
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(logprobs), (torch.cat(entropy) if with_entropy else None)


# --------------------------------------------------------------------------- masks


def first_true_index(bools: torch.Tensor) -> torch.Tensor:
    """Index of the first True in each row, or the row length if there is none.

    bools: (B, T) bool -> (B,) long.
    """
    length = bools.shape[-1]
    positions = torch.arange(length, device=bools.device).expand_as(bools)
    return torch.where(bools, positions, torch.full_like(positions, length)).min(-1).values


def is_stop(ids: torch.Tensor, stop_token_ids: Sequence[int]) -> torch.Tensor:
    """Which of `ids` (any shape, long) are one of the stop tokens `stop_token_ids` -> bool, the same shape."""
    return torch.isin(ids, torch.tensor(list(stop_token_ids), dtype=ids.dtype, device=ids.device))


def truncate_after_stop(response_ids: torch.Tensor, stop_token_ids: Sequence[int], pad_token_id: int):
    """Replace every token after the first stop token (any of `stop_token_ids`) by padding.

    response_ids: (B, T) long -> (truncated_ids (B, T) long, response_mask (B, T) bool).
    The stop token itself stays and is a real token: the score is read there
    [N+, details "truncate after EOS" and "reward at EOS"]. Rows that never stop keep all T tokens.
    """
    stop_at = first_true_index(is_stop(response_ids, stop_token_ids))
    positions = torch.arange(response_ids.shape[1], device=response_ids.device)
    response_mask = positions.unsqueeze(0) <= stop_at.unsqueeze(1)
    truncated = response_ids.masked_fill(~response_mask, pad_token_id)
    return truncated, response_mask


def mask_truncated(mask: torch.Tensor, ended: torch.Tensor) -> torch.Tensor:
    """The trained tokens without those of truncated rows [DAPO, 3.4 overlong filtering].

    mask: (B, T) bool, the trained tokens; ended: (B,) bool, True where the row ended by itself (its stop token, or
    its environment said done) -> (B, T) bool: mask on the rows that ended, all False on the others. A response cut at
    the length limit was scored on text it did not finish; leaving it out of the loss does not teach the policy
    that its length was wrong (TRL `mask_truncated_completions`). Its score still counts in its group's baseline: the
    caller masks after the advantages.
    """
    return mask & ended.to(torch.bool).unsqueeze(1)


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last True in each row (0 for an empty row).

    mask: (B, T) bool -> (B,) long.
    """
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.full_like(positions, -1)).max(-1).values.clamp(min=0)


def mask_first_order(mask: torch.Tensor) -> torch.Tensor:
    """A permutation of each row's columns: its True positions first, then the others, each in order.

    mask: (B, T) bool -> order (B, T) long. `x.gather(1, order)` puts a row's masked positions side by
    side at its start, so that a recursion over time that stops at the first padding column treats
    the positions between two spans as absent; `restore_order` moves the result back. A mask that is
    already a prefix of each row (one span from column 0) gives the identity.
    """
    return torch.sort((~mask.bool()).to(torch.uint8), dim=-1, stable=True).indices


def restore_order(values: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The inverse of `x.gather(1, order)`: values (B, T) in `order`'s columns -> (B, T) in the original ones."""
    return torch.empty_like(values).scatter_(1, order, values)


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


# --------------------------------------------------------------------------- KL and rewards


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


# --------------------------------------------------------------------------- critic-free estimators
#
# Group layout: the trainer samples n = group_size responses per prompt and keeps them adjacent,
# so rows [g * n, (g + 1) * n) of a (B,) tensor are the n samples of prompt g (B = G * n).
# A row dropped from the update (all padding, e.g. reward.on_error=skip) is no member of its group:
# `valid` is False there, it gets advantage 0, and the others' baseline is taken without it.


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


# --------------------------------------------------------------------------- losses


class PolicyLossStats(NamedTuple):
    """Detached statistics of one policy-loss evaluation (scalars, means over real tokens)."""

    approxkl: torch.Tensor
    clipfrac: torch.Tensor
    ratio: torch.Tensor


def truncated_is_weights(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, cap: float, floor: float = 0.0) -> torch.Tensor:
    """Truncated importance weights of tokens sampled by a rollout engine whose probabilities are not the
    trainer's [TIS]: w_t = clip(pi_trainer(y_t) / pi_engine(y_t), floor, cap) = clip(exp(trainer - engine), floor, cap).

    trainer_logprobs (the old policy under the training forward), engine_logprobs (what the engine sampled
    with): (B, T) -> (B, T) float, detached (a weight, not a path for gradients). Where the two agree, 1.
    The policy-gradient loss of each token is multiplied by its weight, which corrects the gradient for
    sampling from pi_engine instead of pi_trainer; the cap bounds its variance (a token the engine found
    far less likely than the trainer does). floor 0 (the default) is one-sided truncation, veRL's token-level
    weights; OpenRLHF's `tis` clips to [0.5, 5] by default (floor 0.5, cap 5). Padding (both 0) gets 1.
    """
    return torch.exp(trainer_logprobs.detach().float() - engine_logprobs.detach().float()).clamp(min=floor, max=cap)


def truncated_is_sequence_weights(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor,
                                  cap: float, floor: float = 0.0) -> torch.Tensor:
    """Sequence-level truncated importance weights [TIS]: one weight per response, the ratio of the whole
    response's probabilities, on each of its tokens (veRL's `rollout_is: sequence`).

    trainer_logprobs, engine_logprobs: (B, T); mask: (B, T) bool, the trained tokens -> (B, T) float, detached.
    w_i = clip(exp(clamp(sum_t mask_it (trainer_it - engine_it), -20, 20)), floor, cap) on every column of row i
    (the log-ratio sum clamped to +-LOG_RATIO_CLAMP before the exp, as veRL does). Unlike the token-level
    weights, the product over a response is an unbiased correction of the whole sequence's probability, at
    the price of a variance that grows with its length. A row without trained tokens gets 1.
    """
    log_ratio = (trainer_logprobs.detach().float() - engine_logprobs.detach().float()) * mask.to(torch.float32)
    weight = torch.exp(clamp_log_ratio(log_ratio.sum(-1, keepdim=True))).clamp(min=floor, max=cap)
    return weight.expand_as(log_ratio).contiguous()


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence-level log-ratio [GSPO, eq. 7], on every column of its row.

    logprobs (with grad), old_logprobs: (B, T); mask: (B, T) bool, the trained tokens -> (B, T).
    log s_i = (1/|y_i|) sum_t (logp_{i,t} - old_logp_{i,t}) over row i's masked tokens (0 for a row without any),
    the same value in each of the row's T columns: s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|), the geometric mean of the
    token ratios. Its gradient reaches every token's logprob of the row, each by 1/|y_i|.
    """
    maskf = mask.to(logprobs.dtype)
    per_row = ((logprobs - old_logprobs) * maskf).sum(-1, keepdim=True) / maskf.sum(-1, keepdim=True).clamp(min=1)
    return per_row.expand_as(logprobs)


def policy_loss_per_token(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    cliprange_low: float,
    cliprange_high: float,
    dual_clip_c: Optional[float] = None,
    sequence_mask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """PPO's clipped surrogate at every token, as a loss [PPO, eq. 7], with an asymmetric clip
    range [DAPO, clip-higher] and an optional dual clip [DC].

    logprobs (current policy, with grad), old_logprobs (sampling policy), advantages: (B, T)
    -> (loss (B, T), log_ratio (B, T), ratio (B, T), clipped (B, T) bool, dual_clipped (B, T) bool or None).
    l_t = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), r = exp(logp - old_logp) with the log-ratio
    clamped to +-LOG_RATIO_CLAMP (`clamp_log_ratio`: beyond it r = e^{+-20} and no gradient);
    with dual clip c > 1, where A < 0:  l_t = min(l_t, -A c), so a ratio far above 1 on a bad
    action cannot make the loss unbounded. `clipped` marks the tokens where the clip bound was
    taken, `dual_clipped` those where the dual clip was.
    sequence_mask: (B, T) bool, the trained tokens, for GSPO's sequence-level ratio [GSPO]: r is then each row's
    `sequence_log_ratio` exponentiated, the same on all its tokens (so is the clip); None: each token's own ratio.
    """
    log_ratio = logprobs - old_logprobs if sequence_mask is None else sequence_log_ratio(logprobs, old_logprobs, sequence_mask)
    ratio = torch.exp(clamp_log_ratio(log_ratio))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange_low, 1.0 + cliprange_high)
    loss = torch.max(unclipped, clipped)
    dual_clipped = None
    if dual_clip_c is not None:
        cap = -advantages * dual_clip_c
        dual_clipped = (advantages < 0) & (loss > cap)
        loss = torch.where(advantages < 0, torch.min(loss, cap), loss)
    return loss, log_ratio, ratio, clipped > unclipped, dual_clipped


def decoupled_policy_loss(logprobs: torch.Tensor, proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                          advantages: torch.Tensor, cliprange_low: float, cliprange_high: float, cap: float,
                          floor: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoupled PPO loss at every token [AReaL], for episodes sampled by an older policy (the behaviour
    policy, the rollout engine's weights of some versions ago) and trained against a recent one (the proximal policy).

    logprobs (current policy, with grad), proximal_logprobs (the trainer's no-gradient forward of the weights at the
    update's start), behaviour_logprobs (what the engine sampled with), advantages: (B, T) -> (loss (B, T), the
    behaviour weights (B, T)).
        l_t = w_t * max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high)),   r_t = pi(y_t) / pi_prox(y_t),
        w_t = clip(pi_prox(y_t) / pi_behav(y_t), floor, cap)                (`truncated_is_weights`, detached)
    The trust region is around the proximal policy (the clip acts on r_t, as in PPO), and the importance weight w_t
    moves the expectation from the behaviour policy to the proximal one, truncated to [floor, cap] as TIS does (AReaL's
    `behav_imp_weight_cap` drops the tokens above it instead). With proximal = behaviour (on-policy) every w_t is 1 and this is
    `policy_loss_per_token`'s loss. The trainer computes exactly this: the PPO ratio against its recomputed logprobs
    (`engines.correction.use_trainer_logprobs`) times `ppo.rollout_is`'s weights (`ppo_loss`'s is_weights).
    """
    weights = truncated_is_weights(proximal_logprobs, behaviour_logprobs, cap, floor)
    per_token = policy_loss_per_token(logprobs, proximal_logprobs, advantages, cliprange_low, cliprange_high)[0]
    return per_token * weights, weights


def _policy_stats(log_ratio: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor, mask: torch.Tensor) -> PolicyLossStats:
    with torch.no_grad():
        return PolicyLossStats(
            approxkl=0.5 * masked_mean(log_ratio**2, mask),
            clipfrac=masked_mean(clipped.float(), mask),
            ratio=masked_mean(ratio, mask),
        )


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """PPO's clipped surrogate objective, as a loss to minimise [PPO, eq. 7], a mean over real tokens.

    logprobs (current policy, with grad), old_logprobs (sampling policy), advantages: (B, T);
    mask: (B, T) bool, the trained tokens -> (scalar loss, PolicyLossStats).
    L = mean_t max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)), ratio = exp(logp - old_logp).
    approxkl is 0.5 * mean((logp - old_logp)^2) over real tokens, as in OpenAI's baselines
    (TRL's mean also counts padding slots, at 0).
    """
    per_token, log_ratio, ratio, clipped, _ = policy_loss_per_token(logprobs, old_logprobs, advantages, cliprange, cliprange)
    return masked_mean(per_token, mask), _policy_stats(log_ratio, ratio, clipped, mask)


def value_loss_per_token(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, cliprange_value: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2) at every token, and where the clipped
    term was the larger [PPO as implemented in OpenAI baselines; N+ "value function clipping"].

    values (with grad), old_values (from the rollout), returns: (B, T) -> ((B, T), (B, T) bool).
    Inside the clip range the clipped value is V itself, bit for bit (clamp against the bounds, not
    V_old + clamp(V - V_old), whose rounding made unclipped tokens count as clipped).
    """
    clipped_values = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    unclipped_sq = (values - returns) ** 2
    clipped_sq = (clipped_values - returns) ** 2
    return torch.max(unclipped_sq, clipped_sq), clipped_sq > unclipped_sq


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss, a mean over real tokens (see `value_loss_per_token`).

    values (with grad), old_values (from the rollout), returns: (B, T); mask: (B, T) bool, the trained tokens
    -> (scalar loss, detached clip fraction).
    L = 0.5 * mean_t max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2).
    """
    per_token, clipped = value_loss_per_token(values, old_values, returns, cliprange_value)
    loss = 0.5 * masked_mean(per_token, mask)
    return loss, masked_mean(clipped.float(), mask).detach()


# --------------------------------------------------------------------------- loss aggregation


def token_weights(mask: torch.Tensor, aggregation: str, row_share: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-token weights w of an aggregation (see the module docstring): (B, T) bool -> (B, T) float32.

      token_mean, seq_mean_token_sum, seq_mean_token_sum_norm: 1 on every real token;
      seq_mean_token_mean: 1/|o_i| on the real tokens of row i (each sequence weighs the same).
    Padding is 0. Each row's weights depend on that row only, so they survive any split into
    micro-batches. row_share: (B,) float, each row's share of its episode's tokens (`segments.row_shares`; None: one
    row per episode): the sequence is the episode, seq_mean_token_mean's weight 1/|episode's tokens| = share/|o_i|.
    """
    maskf = mask.float()
    if aggregation == "seq_mean_token_mean":
        weights = maskf / maskf.sum(-1, keepdim=True).clamp(min=1)
        return weights if row_share is None else weights * row_share.to(weights.dtype).unsqueeze(1)
    if aggregation in LOSS_AGGREGATIONS:
        return maskf
    raise ValueError(f"loss aggregation must be one of {LOSS_AGGREGATIONS}, got {aggregation!r}")


class LossNormalisers(NamedTuple):
    """The D of the module docstring for the rows of one optimiser step (0-dim float32 tensors)."""

    policy: torch.Tensor  # policy, KL-loss and entropy terms, per the configured aggregation
    value: torch.Tensor  # the value loss: the number of real tokens


def loss_normalisers(mask: torch.Tensor, aggregation: str, response_length: int, row_share: Optional[torch.Tensor] = None) -> LossNormalisers:
    """Normalisers over the rows of `mask` (B, T) bool, each at least 1.

      token_mean                 D = real tokens                 (TRL's, OpenRLHF's token-level loss) [DAPO, 3.3];
      seq_mean_token_sum         D = sequences                   (a sum over each sequence, mean over sequences);
      seq_mean_token_mean        D = sequences                   (weights 1/|o_i|: the original GRPO's mean of means) [GRPO, eq. 3];
      seq_mean_token_sum_norm    D = sequences x response_length (a constant per sequence: Dr. GRPO's) [DrGRPO, 3.2].
    Sequences count the rows with at least one real token (rows dropped from the update are none).
    `response_length` is the configured maximum, not this batch's longest response, so that D
    does not depend on what was sampled. row_share: (B,) float, each row's share of its episode's tokens
    (`segments.row_shares`; None: one row per episode): the sequences are then the episodes, the shares summed, so an
    episode of several rows counts once.
    """
    maskf = mask.float()
    tokens = maskf.sum().clamp(min=1)
    sequences = (mask.any(-1).float() if row_share is None else row_share.float()).sum().clamp(min=1)
    if aggregation == "token_mean":
        policy = tokens
    elif aggregation in ("seq_mean_token_sum", "seq_mean_token_mean"):
        policy = sequences
    elif aggregation == "seq_mean_token_sum_norm":
        policy = sequences * response_length
    else:
        raise ValueError(f"loss aggregation must be one of {LOSS_AGGREGATIONS}, got {aggregation!r}")
    return LossNormalisers(policy=policy, value=tokens)


def aggregate(per_token: torch.Tensor, weights: torch.Tensor, normaliser: torch.Tensor) -> torch.Tensor:
    """sum_{i,t} w_{i,t} l_{i,t} / D: per_token, weights (B, T); normaliser 0-dim -> scalar."""
    return (per_token * weights.to(per_token.dtype)).sum() / normaliser


class LossSettings(NamedTuple):
    """The knobs of `ppo_loss` (the trainer builds it once from the config)."""

    cliprange_low: float = 0.2
    cliprange_high: float = 0.2
    dual_clip_c: Optional[float] = None  # None: off; else > 1
    importance_sampling_level: str = "token"  # "sequence": GSPO's ratio per response (`sequence_log_ratio`)
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    entropy_coef: float = 0.0
    kl_loss_coef: float = 0.0
    kl_loss_estimator: str = "k3"
    kl_clamp: Optional[float] = None  # None: off; else the per-token KL estimate is clamped to +-kl_clamp
    aggregation: str = "token_mean"


class LossTerms(NamedTuple):
    """`ppo_loss`'s result: the loss to back-propagate and detached statistics (scalars).

    A term that is off (no critic, no KL loss) is None; `dual_clipfrac` is None without dual clip.
    """

    loss: torch.Tensor
    policy: torch.Tensor
    value: Optional[torch.Tensor]
    value_clipfrac: Optional[torch.Tensor]
    kl: Optional[torch.Tensor]
    entropy: torch.Tensor
    stats: PolicyLossStats
    dual_clipfrac: Optional[torch.Tensor]


def value_loss(
    settings: LossSettings,
    normalisers: LossNormalisers,
    mask: torch.Tensor,
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The value term of `ppo_loss` (before vf_coef): 0.5 * `value_loss_per_token`, a token mean over
    normalisers.value, and the share of tokens whose value was clipped (detached).

    Tensors (B, T); values with grad. A trainer that back-propagates the policy and the value terms one
    after the other (their models share no forward) adds vf_coef * this to the policy terms' loss.
    """
    value_per_token, value_clipped = value_loss_per_token(values, old_values, returns, settings.cliprange_value)
    value = 0.5 * aggregate(value_per_token, mask, normalisers.value)
    return value, masked_mean(value_clipped.float(), mask).detach()


def ppo_loss(
    settings: LossSettings,
    normalisers: LossNormalisers,
    mask: torch.Tensor,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    entropy: torch.Tensor,
    *,
    values: Optional[torch.Tensor] = None,
    old_values: Optional[torch.Tensor] = None,
    returns: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    is_weights: Optional[torch.Tensor] = None,
    row_share: Optional[torch.Tensor] = None,
) -> LossTerms:
    """The loss of one micro-batch: policy + vf_coef * value + kl_loss_coef * KL - entropy_coef * H.

    Tensors (B, T): mask bool, the trained tokens; logprobs (with grad), old_logprobs, advantages, entropy (with
    grad when entropy_coef > 0); values (with grad), old_values, returns: with a critic; ref_logprobs:
    with kl_loss_coef > 0; is_weights (no grad): `truncated_is_weights`, or None. normalisers: `loss_normalisers` over this micro-batch or over its whole
    minibatch (module docstring); row_share (B,): `token_weights`'s (rows of multi-segment episodes). -> LossTerms.
      policy  `policy_loss_per_token` (times is_weights token by token, when given), aggregated per `settings.aggregation`;
              with importance_sampling_level "sequence", GSPO's ratio per response [GSPO];
      value   0.5 * `value_loss_per_token`, a token mean;
      KL      `kl_per_token(logprobs, ref_logprobs, kl_loss_estimator, kl_clamp)` in the loss (k3 is the usual
              "low-variance KL" of GRPO [GRPO, eq. 4]), aggregated as the policy term;
      H       the entropy of the policy at each token, aggregated as the policy term.
    """
    weights = token_weights(mask, settings.aggregation, row_share)
    per_token, log_ratio, ratio, clipped, dual_clipped = policy_loss_per_token(
        logprobs, old_logprobs, advantages, settings.cliprange_low, settings.cliprange_high, settings.dual_clip_c,
        sequence_mask=mask if settings.importance_sampling_level == "sequence" else None,
    )
    if is_weights is not None:
        per_token = per_token * is_weights
    policy = aggregate(per_token, weights, normalisers.policy)
    loss = policy
    value = value_clipfrac = kl = None
    if values is not None:
        value, value_clipfrac = value_loss(settings, normalisers, mask, values, old_values, returns)
        loss = loss + settings.vf_coef * value
    if settings.kl_loss_coef > 0:
        kl = aggregate(kl_per_token(logprobs, ref_logprobs, settings.kl_loss_estimator, settings.kl_clamp), weights, normalisers.policy)
        loss = loss + settings.kl_loss_coef * kl
        kl = kl.detach()
    if settings.entropy_coef > 0:
        loss = loss - settings.entropy_coef * aggregate(entropy, weights, normalisers.policy)
    with torch.no_grad():
        dual_clipfrac = masked_mean(dual_clipped.float(), mask) if dual_clipped is not None else None
        return LossTerms(
            loss=loss,
            policy=policy.detach(),
            value=value.detach() if value is not None else None,
            value_clipfrac=value_clipfrac,
            kl=kl,
            entropy=masked_mean(entropy.detach(), mask),
            stats=_policy_stats(log_ratio, ratio, clipped, mask),
            dual_clipfrac=dual_clipfrac,
        )


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
