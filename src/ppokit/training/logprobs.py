"""Token logprobs and entropies from a language model's logits or its last hidden states, as pure functions over tensors:
the whole vocabulary at once, or chunked through the LM head with a hand-written backward.

Every function documents the shapes it takes and returns, using B for the number of sequences, T for response tokens
and V for the vocabulary. This module imports only torch (and the other modules of the mathematics).

References:
  [N+]     Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO",
           arXiv:2403.17031.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint


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
