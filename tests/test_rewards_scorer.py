import asyncio
import math
import sys
import threading
import time

import pytest
import torch

from ppokit.config.schema import RewardConfig
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
    # The trainer skips such an update (ppokit.training.guards.check_some_scored); the scorer only reports it.
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


# --------------------------------------------------------------------------- each source its own copy


def test_a_function_that_edits_its_arguments_changes_nothing_outside_itself():
    messages = [[{"role": "user", "content": f"q{i}"}] for i in range(4)]
    b = ScoringBatch(list(PROMPTS), list(COMPLETIONS), {"k": [0, 1, 2, 3], "messages": messages},
                     input_ids=torch.arange(8).reshape(4, 2), completion_ids=[[1], [2], [3], [4]])
    before = (list(b.prompts), list(b.completions), repr(b.columns), b.input_ids.clone(), [list(r) for r in b.completion_ids])
    seen = []

    def vandal(prompts, completions, k, messages, completion_ids, **columns):
        n = len(completions)
        prompts[0] = "edited"
        completions.append("extra")
        k.reverse()
        messages[0][0]["content"] = "edited"
        messages[1].append({"role": "assistant", "content": "injected"})
        completion_ids[0].append(99)
        completions.clear()  # was a traceback: the scorer then counted 0 completions
        return [1.0] * n

    def witness(prompts, completions, k, messages, **columns):
        seen.append((list(prompts), list(completions), list(k), repr(messages)))
        return [0.0] * len(completions)

    class TensorVandal:  # a RewardSource object: it gets a copy too, tensors included
        name = "tensor_vandal"

        def score(self, batch):
            batch.input_ids.zero_()
            batch.prompts.clear()
            return torch.ones(4)

    result = scorer(vandal, TensorVandal(), witness).score(b)
    assert result.valid.all() and result.scores.tolist() == [2.0] * 4
    assert seen == [(before[0], before[1], [0, 1, 2, 3], repr(messages))] and "edited" not in before[2]
    assert (b.prompts, b.completions, repr(b.columns)) == (before[0], before[1], before[2])
    assert torch.equal(b.input_ids, before[3]) and b.completion_ids == before[4]


def test_a_function_that_empties_its_completions_and_returns_nothing_fails_with_one_line():
    def clears(prompts, completions, **columns):
        completions.clear()
        return [1.0 for _ in completions]

    with pytest.raises(RewardError, match=r"reward function clears returned 0 scores for 4 completions; first row 0: prompt 'p0'"):
        scorer(clears).score(batch())


# --------------------------------------------------------------------------- what counts as a score


@pytest.mark.parametrize(
    "returned, message",
    [
        (["0.5"] * 4, r"returned '0.5' \(a str\) for row 0: prompt 'p0', completion 'good'; expected a number"),
        ("1111", r"returned '1111' \(a str\), not a list of numbers"),
        ("11111111", r"returned '11111111' \(a str\), not a list of numbers"),
        ([1.0, 1.0, b"1", 1.0], r"returned b'1' \(a bytes\) for row 2"),
        ({"a": 1.0}, r"\(a dict\), not a list of numbers"),
        (0.5, r"returned 0.5 \(a float\), not a list of numbers"),
        ([[1.0, 2.0]] * 4, r"returned \[1.0, 2.0\] \(a list\) for row 0"),
    ],
)
def test_strings_and_other_non_numbers_are_a_failed_source(returned, message):
    fn = lambda prompts, completions, **columns: returned  # noqa: E731
    with pytest.raises(RewardError, match=message) as e:
        scorer(fn).score(batch())
    assert str(e.value).count("prompt 'p0'") == 1, str(e.value)  # the row is named once, not again as the failing one
    with pytest.warns(UserWarning, match=message):
        assert not scorer(fn, on_error="skip").score(batch()).valid.any()


def test_numbers_of_every_usual_kind_are_scores():
    import numpy as np

    kinds = [
        [True, False, True, False], (1, 0, 1, 0), torch.tensor([1.0, 0.0, 1.0, 0.0]), np.array([1, 0, 1, 0]),
        [np.float32(1), np.int64(0), torch.tensor(1.0), 0.0], (float(i % 2 == 0) for i in range(4)),
    ]
    for returned in kinds:
        got = scorer(lambda prompts, completions, r=returned, **columns: r).score(batch()).scores.tolist()
        assert got == [1.0, 0.0, 1.0, 0.0], returned


def test_sys_exit_in_a_reward_function_is_that_function_failing():
    def quits(prompts, completions, **columns):
        if "boom" in completions:
            sys.exit(0)
        return [1.0] * len(completions)

    with pytest.raises(RewardError, match=r"reward function quits called sys.exit\(0\).*failing row 2"):
        scorer(quits).score(batch())
    with pytest.warns(UserWarning, match=r"sys.exit\(0\)"):
        assert scorer(quits, on_error="skip").score(batch()).valid.tolist() == [True, True, False, True]

    class QuittingSource:  # a RewardSource object too
        name = "quitter"

        def score(self, batch):
            raise SystemExit("bye")

    with pytest.raises(RewardError, match=r"reward source quitter called sys.exit\('bye'\)"):
        scorer(QuittingSource()).score(batch())


# --------------------------------------------------------------------------- reward.timeout_s


def test_a_function_past_its_deadline_fails_and_fails_at_once_until_it_returns():
    release = threading.Event()
    calls = []

    def hangs(prompts, completions, **columns):
        calls.append(len(completions))
        if len(calls) == 1:
            release.wait(60)  # the test releases it; never longer than a minute
        return [1.0] * len(completions)

    s = scorer(hangs, const(2.0), on_error="skip", timeout_s=2.0)
    t0 = time.monotonic()
    with pytest.warns(UserWarning, match=r"reward function hangs did not return within reward.timeout_s=2s"):
        result = s.score(batch())
    # bounds between the right wait and the wrong one (the stuck call's 60 s; another 2 s deadline), loose
    # enough for a machine 3-4x slower than quiet
    assert time.monotonic() - t0 < 30 and not result.valid.any() and calls == [4]  # no row-by-row retry of a stuck function
    t0 = time.monotonic()
    again = s.score(batch())  # the stuck call still runs: this one fails at once, no second thread
    assert time.monotonic() - t0 < 1.5 and not again.valid.any() and calls == [4]
    assert "has still not returned" in again.errors[0]
    release.set()
    for _ in range(100):
        if s.sources[0].stuck_s() is None:
            break
        time.sleep(0.05)
    assert s.score(batch()).valid.all() and calls == [4, 4]
    with pytest.raises(RewardError, match="did not return within reward.timeout_s=0.1s"):
        scorer(lambda p, c, **k: time.sleep(5) or [1.0] * len(c), timeout_s=0.1).score(batch())


def test_a_function_in_its_worker_thread_runs_in_the_callers_grad_mode():
    modes = []

    def records(prompts, completions, **columns):
        modes.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled(), threading.current_thread().name))
        return [1.0] * len(completions)

    s = scorer(records, timeout_s=10)
    with torch.no_grad():
        s.score(batch())
    with torch.inference_mode():
        s.score(batch())
    s.score(batch())
    assert [m[:2] for m in modes] == [(False, False), (False, True), (True, False)]
    assert all(m[2] == "reward-records" for m in modes)
    scorer(records, timeout_s=None).score(batch())  # null: the caller's own thread
    assert modes[-1][2] == threading.current_thread().name


def test_timeout_s_is_a_checked_config_key():
    from ppokit.config.fields import validate

    assert RewardConfig().timeout_s == 600.0
    with pytest.raises(UserError, match=r"reward.timeout_s: value 0 is out of range, it must be in \(0, "):
        validate(RewardConfig(timeout_s=0), prefix="reward.")


def _by_length(lengths, **reward):
    """Scores of const(1.0) with the shaping `reward` for completions of `lengths` tokens."""
    n = len(lengths)
    s = build_scorer(RewardConfig(functions=[], **reward), reward_functions=[const(1.0)])
    return s.score(ScoringBatch([f"p{i}" for i in range(n)], ["c"] * n, {}, completion_ids=[[1] * L for L in lengths])).scores


def test_dapo_overlong_shaping_hand_worked_and_as_length_penalty_expresses_it():
    lengths = list(range(14))
    overlong = _by_length(lengths, overlong_max_length=10, overlong_cache_length=4, overlong_penalty_factor=0.5)
    # DAPO: nothing up to L_max - L_cache = 6; ((6 - L) / 4) x 0.5 over (6, 10]; -0.5 beyond 10
    assert overlong.tolist() == [1.0] * 7 + [0.875, 0.75, 0.625, 0.5, 0.5, 0.5, 0.5]
    # reward.length_penalty's expression of it: factor / L_cache per token from L_max - L_cache, the same up to L_max
    linear = _by_length(lengths, length_penalty=0.5 / 4, length_penalty_start=10 - 4)
    assert torch.equal(overlong[:11], linear[:11])
    assert linear[11:].tolist() == [0.375, 0.25, 0.125]  # the plain penalty keeps growing; DAPO's holds at the factor

    # DAPO's formula as written, in float64, against the scorer's float32 (each a couple of roundings of numbers near 1)
    lengths, longest, cache, factor = list(range(30)), 20, 7, 0.3
    got = _by_length(lengths, overlong_max_length=longest, overlong_cache_length=cache, overlong_penalty_factor=factor)
    want = [1.0 + (0.0 if L <= longest - cache else ((longest - cache) - L) / cache * factor if L <= longest else -factor) for L in lengths]
    assert got.double().sub(torch.tensor(want, dtype=torch.float64)).abs().max().item() <= 4 * torch.finfo(torch.float32).eps


@pytest.mark.parametrize("keys, message", [
    (dict(overlong_cache_length=4), "reward.overlong_cache_length needs reward.overlong_max_length"),
    (dict(overlong_max_length=10), "reward.overlong_max_length needs reward.overlong_cache_length"),
    (dict(overlong_max_length=4, overlong_cache_length=10), r"reward.overlong_cache_length \(10\) is longer than reward.overlong_max_length \(4\)"),
    (dict(overlong_max_length=10, overlong_cache_length=4, length_penalty=0.1), "DAPO's form of reward.length_penalty"),
    (dict(overlong_penalty_factor=2.0), "reward.overlong_penalty_factor is read only with reward.overlong_max_length"),
])
def test_overlong_keys_that_cannot_work_are_refused_by_name(keys, message):
    with pytest.raises(UserError, match=message):
        RewardConfig(functions=["sentiment"], **keys).check_combination(1)
