"""engines/sampling.py's `multinomial_rows`: torch.multinomial's one-sample draw on a CPU (the exponential race),
reproduced with a log1p only where a token can win: the same tokens and the same generator state."""

import math

import pytest
import torch

from ppokit.engines import sampling
from ppokit.engines.sampling import multinomial_rows, reproduces_multinomial


def _case(generator: torch.Generator, total: int, vocab: int, temperature: float, zeros: bool):
    """(total, V) probabilities (a softmax at `temperature`; with `zeros`, a top-k cut of each row), the rows in use."""
    logits = torch.randn(total, vocab, generator=generator) * 3 / temperature
    if zeros and vocab > 4:
        kth = logits.topk(vocab // 4, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    keep = torch.rand(total, generator=generator) < 0.6
    keep[int(torch.randint(total, (), generator=generator))] = True
    rows = keep.nonzero().squeeze(1)
    probs = torch.softmax(logits, -1).masked_fill(~keep[:, None], 1.0)  # rows not in use: placeholders
    return probs, rows


def test_this_torch_draws_the_exponential_race():
    assert reproduces_multinomial()


@pytest.mark.parametrize("zeros", [False, True])
def test_the_same_tokens_and_generator_state_as_torch_multinomial(zeros):
    """Random shapes, temperatures, rows in use; the global generator and one of its own."""
    cases = torch.Generator().manual_seed(7)
    for trial in range(120):
        total, vocab = int(torch.randint(1, 40, (), generator=cases)), int(torch.randint(2, 2500, (), generator=cases))
        if trial % 10 == 0:
            vocab = sampling.DRAW_ELEMENTS // 3 + 1  # blocks of 2 rows: rows in use fall in several blocks
        probs, rows = _case(cases, total, vocab, float(torch.rand((), generator=cases)) * 3 + 0.2, zeros)
        own = trial % 2 == 1
        generator = torch.Generator().manual_seed(trial) if own else None
        torch.manual_seed(trial)
        before = generator.get_state() if own else torch.get_rng_state()
        want = torch.multinomial(probs, 1, generator=generator).squeeze(1)[rows]
        after = generator.get_state() if own else torch.get_rng_state()
        (generator.set_state if own else torch.set_rng_state)(before)
        got = multinomial_rows(probs[rows].contiguous(), rows, total, generator=generator)
        assert torch.equal(got, want), (trial, total, vocab)
        assert torch.equal(generator.get_state() if own else torch.get_rng_state(), after)


def test_a_plain_loop_of_the_race():
    """Hand-worked: with u the float64 uniforms drawn in row order, E = float32(-log1p(-u)), the token is the first
    largest float32 p / E of its row; ties go to the first."""
    probs = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1], [0.0, 0.5, 0.5, 0.0]])
    for seed in range(50):
        torch.manual_seed(seed)
        uniforms = torch.empty(3, 4, dtype=torch.float64).uniform_().tolist()
        want = []
        for p_row, u_row in zip(probs.tolist(), uniforms):
            values = [torch.tensor(p, dtype=torch.float32) / torch.tensor(-math.log1p(-u), dtype=torch.float64).float() for p, u in zip(p_row, u_row)]
            best = 0
            for j, v in enumerate(values):
                if v > values[best]:
                    best = j
            want.append(best)
        torch.manual_seed(seed)
        assert multinomial_rows(probs).tolist() == want
        torch.manual_seed(seed)
        assert multinomial_rows(probs[[0, 2]], torch.tensor([0, 2]), 3).tolist() == [want[0], want[2]]


def test_near_ties_of_the_bound_are_settled_exactly():
    """Where p / u ranks two entries one way and p / E the other way (E = -log1p(-u) > u), the exact value decides."""
    p = torch.tensor([[0.5, 0.5]])
    u = torch.tensor([[0.30, 0.31]], dtype=torch.float64)  # p / u: entry 0 largest; p / E: entry 0 too (E grows faster)
    exact = lambda row: (p / torch.tensor([[-math.log1p(-x) for x in row]], dtype=torch.float64).float()).argmax(-1)  # noqa: E731
    assert torch.equal(sampling._race(p, u), exact(u[0].tolist()))
    p = torch.tensor([[0.8, 0.2]])
    u = torch.tensor([[0.9, 0.2]], dtype=torch.float64)  # p / u: 0.889 vs 1.0 -> entry 1; p / E: 0.347 vs 0.896 -> entry 1
    assert sampling._race(p, u).tolist() == exact(u[0].tolist()).tolist() == [1]
    p = torch.tensor([[0.9, 0.1]])
    u = torch.tensor([[0.95, 0.1]], dtype=torch.float64)  # p / u: 0.947 vs 1.0 -> entry 1; p / E: 0.300 vs 0.949 -> entry 1
    assert sampling._race(p, u).tolist() == [1]
    p = torch.tensor([[0.45, 0.55]])
    u = torch.tensor([[0.40, 0.50]], dtype=torch.float64)  # p / u: 1.125 vs 1.1 -> entry 0; p / E: 0.881 vs 0.793 -> entry 0
    assert sampling._race(p, u).tolist() == [0]
    p = torch.tensor([[0.5, 0.5]])
    u = torch.tensor([[0.5, 0.49]], dtype=torch.float64)  # p / u: 1.0 vs 1.0204 -> entry 1; p / E: 0.721 vs 0.7456 -> 1
    assert sampling._race(p, u).tolist() == [1]
    p = torch.tensor([[0.52, 0.48]])
    u = torch.tensor([[0.99, 0.90]], dtype=torch.float64)  # p / u: 0.525 vs 0.533 -> entry 1; p / E: 0.1129 vs 0.2085 -> 1
    assert sampling._race(p, u).tolist() == [1]
    p = torch.tensor([[0.53, 0.47]])
    u = torch.tensor([[0.50, 0.45]], dtype=torch.float64)  # p / u: 1.06 vs 1.0444 -> entry 0; p / E: 0.7646 vs 0.7868 -> 1
    assert sampling._race(p, u).tolist() == exact(u[0].tolist()).tolist() == [1]


def test_a_zero_uniform_and_invalid_rows():
    """u = 0 gives E = 0: p / E is inf (p > 0) or NaN (p = 0), which torch's argmax takes as the largest; a row with a
    NaN or all zeros is refused as torch.multinomial refuses it."""
    p = torch.tensor([[0.2, 0.3, 0.5], [0.0, 0.5, 0.5]])
    u = torch.tensor([[0.5, 0.0, 0.1], [0.0, 0.3, 0.2]], dtype=torch.float64)
    assert sampling._race(p, u).tolist() == [1, 0]
    with pytest.raises(RuntimeError, match="nan"):
        multinomial_rows(torch.tensor([[0.5, float("nan")]]))
    with pytest.raises(RuntimeError, match="sum of probabilities"):
        multinomial_rows(torch.tensor([[0.0, 0.0]]))
