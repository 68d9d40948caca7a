"""What the hf engine's two decoders share: the sampling distribution cut down by top-k / top-p / min-p."""

from __future__ import annotations

import torch


def truncate_distribution(logprobs: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """The sampling distribution cut down by top-k, then top-p (nucleus), then min-p, in the order
    transformers' logits processors apply them; each cut acts on the distribution the one before left.

    logprobs: (rows, V) log-probabilities -> (rows, V) log-probabilities of the kept tokens,
    renormalised, -inf elsewhere. The most likely token is always kept.
      top_k > 0:  the k most likely tokens (ties at the k-th are kept);
      top_p < 1:  the smallest set of most likely tokens whose probability reaches top_p
                  [Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration"];
      min_p > 0:  the tokens with p >= min_p * p_max [Nguyen et al. 2024, "Turning Up the Heat:
                  Min-p Sampling for Creative and Coherent LLM Outputs"].
    """
    cut = float("-inf")
    if top_k > 0 and top_k < logprobs.shape[-1]:
        kth = logprobs.topk(top_k, dim=-1).values[:, -1:]
        logprobs = logprobs.masked_fill(logprobs < kth, cut)
    if top_p < 1.0:
        ordered, order = logprobs.sort(dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        mass_before = probs.cumsum(-1) - probs  # what the more likely tokens already cover
        drop = torch.zeros_like(mass_before, dtype=torch.bool).scatter(-1, order, mass_before >= top_p)
        logprobs = logprobs.masked_fill(drop, cut)
    if min_p > 0.0:
        probs = torch.softmax(logprobs, dim=-1)
        logprobs = logprobs.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, cut)
    return torch.log_softmax(logprobs, dim=-1)
