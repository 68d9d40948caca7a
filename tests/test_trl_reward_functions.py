"""TRL-style reward functions (`def reward_len(completions, **kwargs)`, called by TRL with keywords) beside ppokit's
own (`fn(prompts, completions, **columns)`), and every function's signature checked before any model loads: it once
failed with "takes 1 positional argument but 2 were given" after the models loaded and the first rollout ran."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ppokit.models import roles
from ppokit.config.schema import PPOConfig
from ppokit.errors import UserError
from ppokit.rewards import FunctionReward, ScoringBatch
from ppokit.rewards.sources import KEYWORDS, POSITIONAL, calling_convention

import inspect


def _convention(source: str) -> str:
    namespace: dict = {}
    exec(source, namespace)
    fn = next(v for k, v in namespace.items() if k == "f")
    return calling_convention(inspect.signature(fn).parameters)


@pytest.mark.parametrize("source, convention", [
    ("def f(prompts, completions, **columns): ...", POSITIONAL),  # ppokit's own
    ("def f(prompts, completions): ...", POSITIONAL),
    ("def f(p, c, **kw): ...", POSITIONAL),  # any names: no parameter called completions
    ("def f(*args, **kwargs): ...", POSITIONAL),
    ("def f(prompts, completions, /, **kw): ...", POSITIONAL),
    ("def f(completions, **kwargs): ...", KEYWORDS),  # TRL's documentation's reward_len
    ("def f(completions, solution, **kwargs): ...", KEYWORDS),
    ("def f(prompts, answer, completions, **kwargs): ...", KEYWORDS),  # completions not second
    ("def f(*, prompts, completions, **kwargs): ...", KEYWORDS),
    ("def f(**kwargs): ...", KEYWORDS),
])
def test_the_calling_convention_is_read_from_the_signature(source, convention):
    assert _convention(source) == convention


def _batch():
    return ScoringBatch(["p one", "p two"], ["hello there", "a"], {"target": ["hello", "b"]}, completion_ids=[[4, 5], [6]])


def test_each_convention_gets_its_call():
    calls = {}

    def reward_len(completions, **kwargs):
        calls["trl"] = (completions, kwargs)
        return [-abs(5 - len(c)) for c in completions]

    def ours(prompts, completions, **columns):
        calls["ours"] = (prompts, completions, columns)
        return [len(c) for c in completions]

    def strict(completions, target):  # TRL-style without **kwargs: gets only what it names
        return [float(t in c) for c, t in zip(completions, target)]

    assert FunctionReward(reward_len, "reward_len").score(_batch()).tolist() == [-6.0, -4.0]
    completions, kwargs = calls["trl"]
    assert completions == ["hello there", "a"]
    assert kwargs == {"prompts": ["p one", "p two"], "completion_ids": [[4, 5], [6]], "target": ["hello", "b"]}
    assert FunctionReward(ours, "ours").score(_batch()).tolist() == [11.0, 1.0]
    assert calls["ours"] == (["p one", "p two"], ["hello there", "a"], {"target": ["hello", "b"]})  # as before: no ids
    assert FunctionReward(strict, "strict").score(_batch()).tolist() == [1.0, 0.0]


@pytest.mark.parametrize("source, columns, lacks", [
    ("def f(text):\n    return []\n", set(),
     "reward function f (rewards.py:1) takes 1 positional parameter(s), and ppokit calls it as fn(prompts, completions, **columns)"),
    ("def f(prompts, completions):\n    return []\n", {"target"},
     "reward function f (rewards.py:1) has no parameter for the column(s) target of the data, which ppokit passes to it; add **kwargs"),
    ("def f(completions):\n    return []\n", {"target", "answer"},
     "reward function f (rewards.py:1) has no parameter for the column(s) answer, target of the data, which ppokit passes to it; add **kwargs"),
    ("def f(completions, trainer_state, **kwargs):\n    return []\n", {"target"},
     "reward function f (rewards.py:1) needs trainer_state, which TRL's GRPOTrainer passes and ppokit does not"),
])
def test_a_signature_that_cannot_take_the_call_is_one_line_naming_what_it_lacks(tmp_path, source, columns, lacks):
    (tmp_path / "rewards.py").write_text(source)
    from ppokit.rewards import function_source

    problem = function_source(str(tmp_path / "rewards.py") + ":f", "reward.functions[0]").call_problem(columns)
    assert problem is not None and problem.startswith(lacks), problem
    assert "\n" not in problem


REWARDS = '''\
import json, os

LOG = os.environ["REWARD_LOG"]


def _log(name, **what):
    with open(LOG, "a") as f:
        f.write(json.dumps({"name": name, **what}) + "\\n")


def reward_len(completions, **kwargs):
    """TRL's documentation's example, as is."""
    scores = [-abs(20 - len(completion)) for completion in completions]
    _log("reward_len", kwargs=sorted(kwargs), n=len(completions), ids=[len(i) for i in kwargs["completion_ids"]],
         target=kwargs["target"], scores=scores)
    return scores


def hits_target(completions, target, **kwargs):
    """TRL style with a dataset column by name."""
    scores = [float(t in c.split()) for c, t in zip(completions, target)]
    _log("hits_target", kwargs=sorted(kwargs), scores=scores)
    return scores


def ppokit_style(prompts, completions, **columns):
    _log("ppokit_style", columns=sorted(columns), prompts=len(prompts), scores=[0.5] * len(completions))
    return [0.5] * len(completions)
'''


@pytest.fixture
def target_data(tmp_path, demo_data):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": r["prompt"], "target": "great"}) + "\n" for r in demo_data["prompts"]))
    return path


def _config(tmp_path, model, data, functions) -> Path:
    path = tmp_path / "ppo.yaml"
    path.write_text(yaml.safe_dump({
        "model": str(model), "output_dir": str(tmp_path / "run"), "seed": 1, "data": {"train": str(data)},
        "reward": {"functions": functions},
        "ppo": {"total_episodes": 8, "per_device_train_batch_size": 4, "num_mini_batches": 2, "num_ppo_epochs": 1,
                "response_length": 8, "temperature": 1.0, "num_sample_generations": 0},
    }))
    return path


def test_trl_and_ppokit_reward_functions_in_one_real_run(tmp_path, model_dir, target_data, monkeypatch):
    from ppokit.trainer import PPOTrainer

    (tmp_path / "rewards.py").write_text(REWARDS)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("REWARD_LOG", str(log))
    monkeypatch.chdir(tmp_path)
    config = PPOConfig.load(_config(tmp_path, model_dir("llama"), target_data,
                                    ["rewards.py:reward_len", "rewards.py:hits_target", "rewards.py:ppokit_style"]))
    record = PPOTrainer(config, show_progress=False).step()
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    by_name = {c["name"]: c for c in calls}
    assert set(by_name) == {"reward_len", "hits_target", "ppokit_style"} and len(calls) == 3  # one call each, no retry
    trl = by_name["reward_len"]
    assert trl["kwargs"] == ["completion_ids", "prompts", "target"] and trl["n"] == 8 and trl["target"] == ["great"] * 8
    assert all(0 < n <= 8 for n in trl["ids"])  # the policy's token ids of each completion
    assert by_name["hits_target"]["kwargs"] == ["completion_ids", "prompts"]
    assert by_name["ppokit_style"]["columns"] == ["target"] and by_name["ppokit_style"]["prompts"] == 8
    for name, call in by_name.items():  # the scores the functions returned are the run's
        assert record[f"reward/{name}"] == pytest.approx(sum(call["scores"]) / 8, rel=1e-6), name
    assert record["objective/scores"] == pytest.approx(sum(sum(c["scores"]) for c in calls) / 8, rel=1e-5)


BAD = '''\
def reward_one(completions):
    return [0.0] * len(completions)
'''


def test_a_reward_function_that_cannot_take_the_call_stops_the_run_before_any_weights_load(tmp_path, model_dir, target_data, monkeypatch):
    from ppokit.trainer import PPOTrainer

    (tmp_path / "rewards.py").write_text(BAD)
    monkeypatch.chdir(tmp_path)

    def no_weights(*args, **kwargs):
        raise AssertionError("the models were loaded before the reward functions were checked")

    monkeypatch.setattr(roles, "build_roles", no_weights)
    config = PPOConfig.load(_config(tmp_path, model_dir("llama"), target_data, ["rewards.py:reward_one"]))
    with pytest.raises(UserError) as error:
        PPOTrainer(config, show_progress=False)
    assert str(error.value) == (
        f"reward function reward_one (rewards.py:1) has no parameter for the column(s) target of data.train ({target_data}), "
        "which ppokit passes to it; add **kwargs")


def test_the_refusal_is_one_line_from_the_command_line(tmp_path, model_dir, target_data):
    (tmp_path / "rewards.py").write_text("def by_text(text):\n    return [0.0] * len(text)\n")
    config = _config(tmp_path, model_dir("llama"), target_data, ["rewards.py:by_text"])
    done = subprocess.run([sys.executable, "-m", "ppokit", "ppo", str(config)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 2, done.stderr  # ppokit's exit status for a user error
    lines = [line for line in done.stderr.splitlines() if line.startswith("ppokit: error:")]
    assert lines == [
        "ppokit: error: reward function by_text (rewards.py:1) takes 1 positional parameter(s), and ppokit calls it as "
        "fn(prompts, completions, **columns); name them (prompts, completions), or name a parameter `completions` to be "
        "called TRL's way, every argument by keyword"], done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run" / "final").exists()


# --------------------------------------------------------------------------- None: "this function does not score this row"

def _accuracy(completions, solution, **kwargs):
    """TRL's documentation's pattern: None where the row has no solution to check against."""
    return [None if s is None else float(c.startswith(s)) for c, s in zip(completions, solution)]


def _format(completions, **kwargs):
    return [None if c.endswith("?") else 0.5 * len(c) for c in completions]


NONE_BATCH = dict(prompts=["a", "b", "c", "d"], completions=["yes it is", "no", "maybe?", "no thanks"],
                  columns={"solution": ["yes", None, None, "yes"]})


def _trls_rewards(functions, weights):
    """TRL 1.16's own rewards_per_func, by GRPOTrainer._calculate_rewards itself (None -> NaN), on a stand-in trainer;
    then its combination in _generate_and_score_completions (sum_then_normalize): the weighted nansum, NaN for a row
    that no function scored."""
    import types

    import torch
    from accelerate import PartialState
    from trl.trainer.grpo_trainer import GRPOTrainer

    PartialState()  # TRL's logger needs accelerate's state
    trainer = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(device=torch.device("cpu"), is_main_process=True), state=types.SimpleNamespace(global_step=0),
        args=types.SimpleNamespace(report_to=[]), _log_completion_extra=None, _log_metric=None, environments=None,
        reward_funcs=functions, reward_processing_classes=[None] * len(functions), reward_func_names=[f.__name__ for f in functions])
    batch = NONE_BATCH
    inputs = [{"prompt": p, "solution": s} for p, s in zip(batch["prompts"], batch["columns"]["solution"])]
    per_function = GRPOTrainer._calculate_rewards(trainer, inputs, batch["prompts"], batch["completions"], [[1]] * len(inputs))
    rewards = (per_function * torch.tensor(weights).unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(per_function).all(dim=1)] = torch.nan
    return rewards


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_none_score_is_trls_no_score_the_others_weighted_sum_stands(on_error):
    """Rows 1 and 2: _accuracy returns None (no solution), row 2 _format too. TRL's combination: row 1 is _format's score
    alone (weighted), row 2 no function scored (left out); ppokit's the same, under raise (no error) and skip (not dropped)."""
    pytest.importorskip("trl")
    import torch

    from ppokit.rewards.scorer import RewardScorer

    weights = [1.0, 0.5]
    trl_rewards = _trls_rewards([_accuracy, _format], weights)
    scorer = RewardScorer([FunctionReward(_accuracy, "accuracy"), FunctionReward(_format, "format")], weights, [False, False],
                          on_error=on_error)
    with pytest.warns(UserWarning, match=r"every reward source returned None \(no score\) for row 2: prompt 'c'"):
        result = scorer.score(ScoringBatch(**NONE_BATCH))
    assert result.valid.tolist() == (~torch.isnan(trl_rewards)).tolist() == [True, True, False, True]
    assert result.scores[result.valid].tolist() == trl_rewards[~torch.isnan(trl_rewards)].tolist()
    assert result.scores[2] == 0 and result.errors == []
    metrics = scorer.metrics(result)  # each source's mean over the rows it scored (TRL's nanmean), the unscored row skipped
    assert (metrics["reward/accuracy"], metrics["reward/format"], metrics["reward/skipped"]) == (0.5, (4.5 + 1 + 4.5) / 3, 1.0)


def test_a_none_score_leaves_the_normalisation_to_the_rows_scored():
    """With reward.normalize a None row adds 0 (not its normalised 0 score) and its statistics come from the scored rows."""
    import torch

    from ppokit.rewards.scorer import RewardScorer

    scorer = RewardScorer([FunctionReward(_accuracy, "accuracy"), FunctionReward(_format, "format")], [1.0, 1.0], [True, False])
    with pytest.warns(UserWarning):
        result = scorer.score(ScoringBatch(**NONE_BATCH))
    moments = scorer.moments["accuracy"]
    assert (moments.count, moments.mean, moments.var) == (2, 0.5, 0.25)  # rows 0 and 3: 1 and 0
    assert result.scores[1].item() == 1.0  # format's 1.0 alone: accuracy adds 0, not (0 - 0.5) / 0.5
    assert result.scores[0].item() == pytest.approx((1 - 0.5) / (0.5 + 1e-8) + 4.5, rel=1e-6)
    assert torch.isfinite(result.scores).all()


def test_a_nan_returned_is_still_a_failure_and_none_is_not():
    """float('nan') is a function's failure (the run stops naming it); None is TRL's no-score."""
    from ppokit.rewards.scorer import RewardScorer

    def nan_score(completions, **kwargs):
        return [float("nan")] + [1.0] * (len(completions) - 1)

    scorer = RewardScorer([FunctionReward(nan_score, "nan_score"), FunctionReward(_format, "format")], [1.0, 1.0], [False, False])
    with pytest.raises(UserError, match=r"reward function nan_score returned nan for row 0"):
        scorer.score(ScoringBatch(**NONE_BATCH))
