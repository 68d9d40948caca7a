import asyncio
import math

import pytest
import torch

from ppokit.config import RewardConfig
from ppokit.errors import UserError
from ppokit.rewards import RewardError, ScoringBatch, build_scorer

PROMPTS = ["p0", "p1", "p2", "p3"]
COMPLETIONS = ["good", "bad", "boom", "fine"]


def batch(**kw):
    return ScoringBatch(PROMPTS, COMPLETIONS, {"k": [0, 1, 2, 3]}, **kw)


def scorer(*functions, **reward):
    return build_scorer(RewardConfig(**reward), reward_functions=list(functions))


def const(value):
    def fn(prompts, completions, **columns):
        return [value] * len(completions)

    fn.__name__ = f"const_{value}"
    return fn


def raises_on_boom(prompts, completions, **columns):
    if "boom" in completions:
        raise ValueError("cannot score boom")
    return [1.0] * len(completions)


def nan_on_boom(prompts, completions, **columns):
    return [float("nan") if c == "boom" else 1.0 for c in completions]


def inf_on_boom(prompts, completions, **columns):
    return [math.inf if c == "boom" else 1.0 for c in completions]


def too_few(prompts, completions, **columns):
    return [1.0]


@pytest.mark.parametrize(
    "fn, message",
    [
        (raises_on_boom, r"reward function raises_on_boom raised ValueError: cannot score boom.*row 2: prompt 'p2', completion 'boom'"),
        (nan_on_boom, r"reward function nan_on_boom returned nan for row 2: prompt 'p2', completion 'boom'"),
        (inf_on_boom, r"reward function inf_on_boom returned inf for row 2: prompt 'p2', completion 'boom'"),
        (too_few, r"reward function too_few returned 1 scores for 4 completions; first row 0: prompt 'p0'"),
    ],
)
def test_failures_stop_with_the_function_and_a_row(fn, message):
    with pytest.raises(RewardError, match=message):
        scorer(fn).score(batch())


@pytest.mark.parametrize("fn", [raises_on_boom, nan_on_boom, inf_on_boom])
def test_on_error_skip_drops_only_the_failing_row_and_counts_it(fn):
    s = scorer(fn, const(2.0), on_error="skip")
    with pytest.warns(UserWarning, match="boom"):
        result = s.score(batch())
    assert result.valid.tolist() == [True, True, False, True]
    assert result.scores.tolist() == [3.0, 3.0, 0.0, 3.0]
    metrics = s.metrics(result)
    assert metrics["reward/skipped"] == 1 and metrics[f"reward/{fn.__name__}"] == 1.0 and metrics["reward/const_2.0"] == 2.0


def test_on_error_skip_marks_every_row_when_nothing_scores():
    # The trainer skips such an update (ppokit.guards.check_some_scored); the scorer only reports it.
    with pytest.warns(UserWarning):
        result = scorer(lambda p, c, **k: [float("nan")] * len(c), on_error="skip").score(batch())
    assert not result.valid.any() and result.scores.tolist() == [0.0] * 4 and result.errors


def test_configuration_errors_stop_even_when_skipping():
    with pytest.raises(UserError, match="no column 'answer'"):
        scorer("exact_match", on_error="skip").score(batch())


def test_async_functions_and_the_columns_reach_the_function():
    async def by_column(prompts, completions, k, **columns):
        await asyncio.sleep(0)
        return [float(v) for v in k]

    assert scorer(by_column).score(batch()).scores.tolist() == [0.0, 1.0, 2.0, 3.0]

    async def inside_a_loop():  # e.g. a notebook: the caller already runs an event loop
        return scorer(by_column).score(batch()).scores.tolist()

    assert asyncio.run(inside_a_loop()) == [0.0, 1.0, 2.0, 3.0]


def test_weights_sum_sources_and_names_stay_unique():
    s = scorer(const(1.0), const(1.0), const(3.0), weights=[1.0, 2.0, -1.0])
    assert s.names == ["const_1.0", "const_1.0_2", "const_3.0"]
    result = s.score(batch())
    assert result.scores.tolist() == [0.0] * 4
    assert set(s.metrics(result)) == {"reward/const_1.0", "reward/const_1.0_2", "reward/const_3.0", "reward/skipped"}


def test_shaping_eos_penalty_length_penalty_and_clipping():
    ended = torch.tensor([True, False, True, True])
    ids = [[1], [1, 2, 3], [1, 2, 3, 4, 5, 6], [1, 2]]
    s = build_scorer(
        RewardConfig(functions=[], length_penalty=0.5, length_penalty_start=2, clip_range=[-2.0, 0.9]),
        reward_functions=[const(1.0)], missing_eos_penalty=1.0,
    )
    got = s.score(batch(ended=ended, completion_ids=ids)).scores
    # 1 - eos penalty (row 1) - 0.5 per token beyond 2, then clipped to [-2, 0.9]
    assert got.tolist() == pytest.approx([0.9, -0.5, -1.0, 0.9])
    no_stop = s.score(batch(ended=None, completion_ids=[[1]] * 4)).scores  # no stop token: no EOS penalty
    assert no_stop.tolist() == pytest.approx([0.9] * 4)


def test_running_normalisation_per_source_and_its_state_round_trip():
    def by_column(prompts, completions, k, **columns):
        return [10.0 * v + 100 for v in k]

    s = scorer(by_column, const(5.0), normalize=[True, False])
    first = s.score(batch()).scores
    raw = torch.tensor([100.0, 110, 120, 130])
    assert first.tolist() == pytest.approx(((raw - raw.mean()) / raw.std(unbiased=False) + 5).tolist(), abs=1e-5)
    s.score(batch())
    state = s.state_dict()
    assert state["moments"]["by_column"]["count"] == 8 and list(state["moments"]) == ["by_column"]
    # evaluation reads the statistics without moving them
    s.score(batch(), update_statistics=False)
    assert s.state_dict() == state
    fresh = scorer(by_column, const(5.0), normalize=[True, False])
    fresh.load_state_dict(state)
    assert torch.equal(fresh.score(batch()).scores, s.score(batch()).scores)
    with pytest.raises(UserError, match="normalisation state"):
        scorer(by_column, normalize=False).load_state_dict(state)


def test_running_moments_match_all_values_seen():
    from ppokit.rewards import RunningMoments

    m, seen = RunningMoments(), []
    for chunk in (torch.tensor([1.0, 2.0]), torch.tensor([10.0]), torch.tensor([3.0, -4.0, 5.0])):
        m.update(chunk)
        seen += chunk.tolist()
    assert m.count == 6 and m.mean == pytest.approx(sum(seen) / 6)
    assert m.var == pytest.approx(torch.tensor(seen).var(unbiased=False).item())


def test_statistics_are_shared_across_processes_through_all_reduce():
    from ppokit.rewards import RunningMoments

    other_process = torch.tensor([0.0, 100.0, 1.0])  # what a second process saw (float64 sums below)

    def all_reduce(sums):
        return sums + torch.stack([torch.tensor(3.0, dtype=torch.float64), other_process.double().sum(), (other_process.double() ** 2).sum()])

    m = RunningMoments()
    m.update(torch.tensor([1.0, 2.0, 3.0]), all_reduce)
    everything = torch.tensor([1.0, 2.0, 3.0, 0.0, 100.0, 1.0])
    assert m.count == 6 and m.mean == pytest.approx(everything.mean().item())
    assert m.var == pytest.approx(everything.var(unbiased=False).item())
