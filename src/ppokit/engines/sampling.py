"""What the hf engine's two decoders share: the sampling distribution cut down by top-k / top-p / min-p."""

from __future__ import annotations

import functools
import math
from typing import Optional

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


# Rows of uniforms drawn at a time by `multinomial_rows` (float64: 16 rows of a 32k vocabulary are 4 MB).
DRAW_ELEMENTS = 1 << 19
# `multinomial_rows` keeps as candidates the entries whose float32 p / float32(u) is within this factor of a row's
# best exact p / E: since E = -log1p(-u) >= u, an entry's float32 p / float32(E) (three roundings to float32, one of
# log1p's float64 ulp) exceeds its float32 p / float32(u) (two roundings) by at most (1 + 2^-24)^3 / (1 - 2^-24)^2 /
# (1 - 2^-52) < 1 + 3.1e-7 (p / u >= 1e-38 and below float32's largest: p <= 1, u >= 2^-53); three times that spare.
CANDIDATE_SLACK = 1.0 - 1e-6


def multinomial_rows(probs: torch.Tensor, rows: Optional[torch.Tensor] = None, total: Optional[int] = None,
                     generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row, the token `torch.multinomial(full, 1)` draws on a CPU from the same generator state,
    where `full` is the (total, V) matrix whose rows `rows` are `probs` (any others: rows nobody reads), and the
    generator left in the state that call leaves it in.

    probs: (n, V) float32 probabilities (finite, >= 0, each row summing to > 0; a NaN raises as torch.multinomial
    does); rows: (n,) ascending, the rows of `full` they are (None: 0..n-1); total: full's rows (None: n).
    -> (n,) int64 tokens.

    What torch.multinomial computes for one sample (the exponential race): E = exponential_() over the whole (total, V)
    float32 matrix, each entry float32(-log1p(-u)) of one float64 uniform u (`uniform_`'s, in row order), then the
    first argmax of probs / E per row. Here the uniforms are drawn the same way, in the same order (rows nobody reads
    too, so the stream stays the same), but log1p is taken only where the token can win: p / E <= p / u, so an entry
    whose p / u falls below a row's best exact p / E (at the row's largest p / u) cannot win (`CANDIDATE_SLACK`
    covers float32's rounding); the few entries left get their exact E (math.log1p, the C library's log1p that
    torch's CPU kernel calls) and the first largest float32 p / E wins. Its cost is the uniforms and a few passes over
    the rows in use, where torch.multinomial's is a log1p per entry of the whole matrix.
    """
    n, vocab = probs.shape
    total = n if total is None else total
    rows = torch.arange(n, device=probs.device) if rows is None else rows
    tokens = torch.empty(n, dtype=torch.long, device=probs.device)
    block = max(1, DRAW_ELEMENTS // max(vocab, 1))
    uniforms = torch.empty(min(block, total), vocab, dtype=torch.float64, device=probs.device)
    first = 0  # the first of `probs`' rows not yet drawn
    for start in range(0, total, block):
        u = uniforms[: min(block, total - start)].uniform_(generator=generator)
        end = first + int(torch.searchsorted(rows[first:], start + u.shape[0]))
        if end > first:
            these = rows[first:end] - start
            if these.shape[0] < u.shape[0]:
                u = u.index_select(0, these)
            tokens[first:end] = _race(probs[first:end], u)
        first = end
    return tokens


def _race(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(m, V) float32 probabilities and their float64 uniforms -> (m,) the first argmax of probs / float32(-log1p(-u))."""
    bound = probs / u.to(torch.float32)  # >= p / E within float32's rounding (CANDIDATE_SLACK)
    best, at = bound.max(dim=-1)
    if bool(best.isnan().any()):  # a NaN probability, or u = 0 at p = 0 (2^-53 an entry): the row whole
        return torch.stack([_race_exactly(p, v) for p, v in zip(probs, u)])
    if bool((best <= 0).any()):
        raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
    exact = _quotients(probs.gather(1, at[:, None]).squeeze(1), u.gather(1, at[:, None]).squeeze(1))
    candidates = bound >= (exact * CANDIDATE_SLACK)[:, None]
    if bool((candidates.sum(-1) == 1).all()):  # each row's only candidate is its largest p / u
        return at
    row, col = candidates.nonzero(as_tuple=True)
    value = _quotients(probs[row, col], u[row, col])
    best = torch.full_like(exact, float("-inf")).scatter_reduce(0, row, value, "amax")
    wins = value == best[row]
    return torch.full_like(at, probs.shape[1]).scatter_reduce(0, row[wins], col[wins], "amin")


def _quotients(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """float32 p / float32(-log1p(-u)), E as torch's CPU exponential_ computes it (float64, the C library's log1p)."""
    exponential = torch.tensor([-math.log1p(-x) for x in u.tolist()], dtype=torch.float64, device=u.device)
    return p / exponential.to(torch.float32)


def _race_exactly(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    if not bool(torch.isfinite(p).all()) or bool((p < 0).any()):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    return _quotients(p, u).argmax()


@functools.cache
def reproduces_multinomial() -> bool:
    """Whether this torch's CPU torch.multinomial (one sample) is the exponential race `multinomial_rows` reproduces:
    exponential_() as -log1p(-u) of float64 uniforms, and the same tokens and generator state on a small case (checked
    once a process, the global generator's state kept). Elsewhere the hf engine calls torch.multinomial itself."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        exponential = torch.empty(64).exponential_()
        torch.manual_seed(0)
        uniform = torch.empty(64, dtype=torch.float64).uniform_()
        if not torch.equal(exponential, torch.tensor([-math.log1p(-x) for x in uniform.tolist()]).to(torch.float32)):
            return False
        probs = torch.softmax(torch.randn(5, 300) * 3, -1)
        start = torch.get_rng_state()
        want, after = torch.multinomial(probs, 1).squeeze(1), torch.get_rng_state()
        torch.set_rng_state(start)
        rows = torch.tensor([0, 2, 3])
        return torch.equal(multinomial_rows(probs[rows], rows, 5), want[rows]) and torch.equal(torch.get_rng_state(), after)
