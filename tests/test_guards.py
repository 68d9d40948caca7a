"""The non-finite guard: a NaN or infinite loss, gradient or score skips the update without a trace
in the weights, and too many in a row stop the run with a checkpoint of the last good state."""

import dataclasses
import json
import math

import pytest
import torch
from conftest import tiny_ppo_config, with_speed_switches
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification

from ppokit.run import checkpoint

from ppokit.training import losses
from ppokit.training.guards import NonFiniteStop
from ppokit.demos.tiny import tiny_config
from ppokit.trainer import PPOTrainer


def make_trainer(model_dir, prompts_file, out, **kwargs):
    config = tiny_ppo_config(model_dir("llama"), prompts_file, out, total_episodes=24, **kwargs.pop("ppo", {}))
    return PPOTrainer(with_speed_switches(config, **kwargs.pop("speed", {})), show_progress=False, **kwargs)


def trainable(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters() if p.requires_grad]


def optimizer_tensors(trainer) -> list[torch.Tensor]:
    return [t.clone() for s in trainer.optimizer.state_dict()["state"].values() for t in s.values()]


def all_equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("rollback, speed", [("memory", False), ("memory", True), ("disk", False)],
                         ids=["memory-defaults", "memory-speed-switches", "disk"])
def test_nonfinite_loss_midway_rolls_back_the_steps_already_taken(model_dir, prompts_file, tmp_path, monkeypatch, rollback, speed):
    # With the speed switches: one trimmed token-budget micro-batch per minibatch (4 rows of the longest row), light head.
    trainer = make_trainer(model_dir, prompts_file, tmp_path, ppo=dict(nonfinite_rollback=rollback),
                           **({"speed": dict(max_tokens_per_micro_batch=56, lm_head_chunk_size=3)} if speed else {}))
    trainer.run_update()
    weights, moments = trainable(trainer), optimizer_tensors(trainer)
    real_loss, calls, snapshots = losses.value_loss_per_token, [], []

    def nan_at_second_minibatch(*args, **kwargs):  # the first optimiser step of the update has been taken
        calls.append(1)
        snapshots.append(sorted(p.name for p in tmp_path.rglob("process-*.pt*")))
        loss, clipped = real_loss(*args, **kwargs)
        return (loss * float("nan") if len(calls) == 2 else loss), clipped

    monkeypatch.setattr(losses, "value_loss_per_token", nan_at_second_minibatch)
    record = trainer.run_update()
    assert len(calls) == 2, "the update stopped at the bad step"
    assert record["update"] == 2 and record["nonfinite/loss"] == 1 and record["skipped_updates"] == 1
    assert all_equal(trainable(trainer), weights), "the step taken before the NaN was undone"
    assert all_equal(optimizer_tensors(trainer), moments)
    # The schedule moves on by one whole update (2 epochs x 2 minibatches), so lr stays a function of the update.
    assert trainer.scheduler.last_epoch == 8
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * (12 - 8) / 12)
    assert not any(p.grad is not None for p in trainer.model.parameters())
    # disk: the snapshot was a file of its own while the update ran, and is gone after it; memory: no file
    assert snapshots == ([["process-0.pt"]] * 2 if rollback == "disk" else [[]] * 2)
    assert not list(tmp_path.rglob("process-*.pt*")) and not list(tmp_path.rglob(".rollback"))

    monkeypatch.undo()
    record = trainer.run_update()
    assert record["update"] == 3 and record["skipped_updates"] == 1 and "nonfinite/loss" not in record
    assert math.isfinite(record["loss/policy_avg"]) and trainer.state.skipped_in_a_row == 0
    assert not all_equal(trainable(trainer), weights)


def test_nonfinite_gradient_with_finite_loss_is_caught(model_dir, prompts_file, tmp_path):
    trainer = make_trainer(model_dir, prompts_file, tmp_path, ppo=dict(max_grad_norm=0.0, nonfinite_rollback="memory"))  # no clipping: own norm
    weights = trainable(trainer)
    param = next(p for p in trainer.value_model.parameters() if p.requires_grad)
    hook = param.register_hook(lambda grad: torch.full_like(grad, float("inf")))
    record = trainer.run_update()
    hook.remove()
    assert record["nonfinite/gradient"] == 1 and "nonfinite/loss" not in record
    assert str(trainer.state.last_nonfinite).startswith("non-finite gradient: inf")
    assert all_equal(trainable(trainer), weights)


def _adam_steps(trainer) -> set[float]:
    return {float(s["step"]) for s in trainer.optimizer.state.values()}


def test_by_default_a_nonfinite_step_is_skipped_and_the_update_goes_on(model_dir, prompts_file, tmp_path, monkeypatch):
    trainer = make_trainer(model_dir, prompts_file, tmp_path)  # nonfinite_rollback: off
    assert trainer.config.ppo.rollback == "off"
    trainer.run_update()
    weights = trainable(trainer)
    assert _adam_steps(trainer) == {4.0}  # 2 epochs x 2 minibatches
    real_loss, calls = losses.value_loss_per_token, []

    def nan_at_second_minibatch(*args, **kwargs):
        calls.append(1)
        loss, clipped = real_loss(*args, **kwargs)
        return (loss * float("nan") if len(calls) == 2 else loss), clipped

    monkeypatch.setattr(losses, "value_loss_per_token", nan_at_second_minibatch)
    record = trainer.run_update()
    assert len(calls) == 4, "the update went on after the bad step"
    # One step of four skipped: the optimiser stepped 3 times (its state counts them), the schedule 4 times,
    # the update trained and its metrics are finite (the skipped step's statistics are left out).
    assert record["nonfinite_steps"] == 1 and record["skipped_updates"] == 0
    assert not any(k.startswith("nonfinite/") for k in record)
    assert _adam_steps(trainer) == {7.0} and trainer.scheduler.last_epoch == 8
    assert all(math.isfinite(record[k]) for k in ("loss/policy_avg", "loss/value_avg", "policy/approxkl_avg"))
    assert all(torch.isfinite(w).all() for w in trainable(trainer)) and not all_equal(trainable(trainer), weights)
    assert not list(tmp_path.rglob("process-*.pt*"))  # nothing is copied


def test_by_default_an_update_whose_every_step_is_nonfinite_is_skipped_without_a_step(model_dir, prompts_file, tmp_path):
    trainer = make_trainer(model_dir, prompts_file, tmp_path, ppo=dict(max_grad_norm=0.0))
    trainer.run_update()
    weights, moments = trainable(trainer), optimizer_tensors(trainer)
    param = next(p for p in trainer.value_model.parameters() if p.requires_grad)
    hook = param.register_hook(lambda grad: torch.full_like(grad, float("inf")))
    record = trainer.run_update()
    hook.remove()
    assert record["nonfinite/gradient"] == 1 and record["skipped_updates"] == 1 and trainer.state.skipped_in_a_row == 1
    assert all_equal(trainable(trainer), weights) and all_equal(optimizer_tensors(trainer), moments)
    assert trainer.scheduler.last_epoch == 8
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * (12 - 8) / 12)


def test_nonfinite_scores_stop_the_run_with_a_checkpoint_of_the_last_good_state(model_dir, prompts_file, tmp_path):
    # A source that returns NaN is stopped (or skipped) by the reward checks, naming the source
    # (tests/test_rewards_*.py); the guard is the last line for what gets past them, e.g. a
    # combination or normalisation that overflows. Simulate that after the sources' checks.
    out = tmp_path / "run"
    trainer = make_trainer(model_dir, prompts_file, out, ppo=dict(max_skipped_updates=2))
    score = trainer.rollout.score

    def overflowing_score(*args, **kwargs):
        scored = score(*args, **kwargs)
        return dataclasses.replace(scored, scores=torch.full_like(scored.scores, float("nan")))

    trainer.rollout.score = overflowing_score
    with pytest.raises(NonFiniteStop, match=r"2 updates in a row were skipped .* non-finite score: nan.*"
                                            r"checkpoints/update-2 holds the starting weights: no update trained; fix the cause"):
        trainer.train()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["update"], r["nonfinite/score"], r["skipped_updates"]) for r in records] == [(1, 1, 1), (2, 1, 2)]
    saved = checkpoint.find_checkpoint(None, out)
    assert saved.name == "update-2"
    assert json.loads((saved / "trainer_state.json").read_text())["skipped_updates"] == 2
    start = load_file(model_dir("llama") / "model.safetensors")
    last_good = load_file(saved / "model" / "model.safetensors")
    assert start.keys() == last_good.keys() and all(torch.equal(start[k], last_good[k]) for k in start)


def test_a_batch_with_no_row_scored_under_on_error_skip_is_a_skipped_update(model_dir, prompts_file, tmp_path):
    def unreachable_judge(prompts, completions, **columns):
        return [float("nan")] * len(completions)

    out = tmp_path / "run"
    config = tiny_ppo_config(model_dir("llama"), prompts_file, out, total_episodes=24, max_skipped_updates=2)
    config.reward.on_error = "skip"
    config.data.eval_fraction = 0.25
    trainer = PPOTrainer(config, reward_functions=[unreachable_judge], show_progress=False)
    before = trainable(trainer)
    with pytest.warns(UserWarning), pytest.raises(NonFiniteStop, match=r"2 updates in a row .* every row of the batch failed to score"):
        trainer.train()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["update"], r["nonfinite/score"], r["skipped_updates"]) for r in records] == [(1, 1, 1), (2, 1, 2)]
    assert checkpoint.find_checkpoint(None, out).name == "update-2"
    assert all_equal(trainable(trainer), before)
    # Evaluation does not stop the run either: the rows have no score, and eval/scores is left out.
    rows = trainer.sample_completions()
    assert rows and all(r["score"] is None for r in rows)


def test_a_reward_model_that_returns_nan_stops_before_training_with_its_name(model_dir, prompts_file, tokenizer, tmp_path):
    from ppokit.errors import UserError

    config = tiny_config("llama", tokenizer)
    config.num_labels = 1
    broken_reward = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        broken_reward.score.weight.fill_(float("nan"))  # a reward model that overflowed: every score is NaN
    value_model = AutoModelForSequenceClassification.from_config(config)  # not the broken head
    trainer = make_trainer(model_dir, prompts_file, tmp_path / "run", reward_model=broken_reward, reward_tokenizer=tokenizer,
                           value_model=value_model)
    before = trainable(trainer)
    with pytest.raises(UserError, match="reward_model"):
        trainer.train()
    assert all_equal(trainable(trainer), before)
