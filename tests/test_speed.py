"""The speed switches change no result beyond float rounding: the same gradients however a minibatch is
split, the same learning curve as the padded path (docs/speed.md)."""

import dataclasses

import pytest
import torch
from conftest import tiny_ppo_config, with_speed_switches

from ppokit.training import batching, experience, optimise
from ppokit.errors import UserError
from ppokit.trainer import PPOTrainer

CURVE = ("objective/scores", "objective/kl", "objective/entropy", "objective/response_length", "policy/approxkl_avg",
         "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg", "val/clipfrac_avg", "policy/entropy_avg", "val/ratio",
         "val/ratio_var", "lr")


class GradientRecorder(torch.optim.SGD):
    """Learning rate 0 (the weights never move) and a copy of every step's gradients."""

    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.grads: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        self.grads.append([p.grad.clone() for group in self.param_groups for p in group["params"] if p.grad is not None])
        return super().step(closure)


def one_rollout(trainer: PPOTrainer):
    """The rollout of the trainer's first update, with advantages and returns (captured from a real step)."""
    captured, optimise_once = [], trainer.optimise
    trainer.optimise = lambda rollout: captured.append(rollout) or optimise_once(rollout)
    trainer.step()
    return captured[0]


def test_a_minibatch_split_three_ways_gives_the_same_gradients_and_metrics(sft_model_dir, prompts_file, tmp_path):
    config = tiny_ppo_config(sft_model_dir, prompts_file, tmp_path / "run", total_episodes=16, per_device_train_batch_size=8,
                             num_mini_batches=2, num_ppo_epochs=1, response_length=10,
                             max_grad_norm=0.0)
    trainer = PPOTrainer(config, show_progress=False)
    rollout = one_rollout(trainer)
    lengths = rollout.loss_mask.sum(1)
    assert len(set(lengths.tolist())) > 3, "responses of varied lengths"
    longest = int(rollout.attention_mask.sum(1).max())
    model = trainer.model
    results = {}
    for name, budget in (("small", longest), ("large", 3 * longest), ("one micro-batch", 10**6)):
        hp = dataclasses.replace(config.ppo, max_tokens_per_micro_batch=budget)
        counts = [len(batching.plan_episodes(rows, rollout, budget)) for rows in torch.arange(16).split(8)]
        recorder = GradientRecorder([p for p in model.parameters() if p.requires_grad])
        scheduler = torch.optim.lr_scheduler.LambdaLR(recorder, lambda step: 1.0)
        torch.manual_seed(5)  # the same minibatch order each time
        metrics = optimise.ppo_epochs(model, recorder, scheduler, rollout, hp, trainer.sizes, trainer.strategy, lambda t: t)
        results[name] = (counts, recorder.grads, metrics)
    assert results["small"][0][0] >= 3 and 1 < results["large"][0][0] < results["small"][0][0]
    assert results["one micro-batch"][0] == [1, 1]
    _, want_grads, want_metrics = results["one micro-batch"]
    for name in ("small", "large"):
        _, grads, metrics = results[name]
        for step_got, step_want in zip(grads, want_grads):
            for got, want in zip(step_got, step_want):
                assert (got - want).norm() <= 1e-5 * want.norm() + 1e-12, name
        for key, value in want_metrics.items():
            # Means of unit-scale terms summed in another order: a few float32 ulps of 1 apart (near-zero
            # ones too, e.g. a policy loss of whitened advantages). val/ratio_var is a variance of ratios
            # near 1 from their sums of squares: float32 rounding of the ratios (1e-7) moves it by up to ~1e-6.
            if key != "perf/padding_share":
                assert metrics[key] == pytest.approx(value, rel=1e-5, abs=2e-6 if key == "val/ratio_var" else 1e-6), (name, key)
        assert metrics["perf/padding_share"] < want_metrics["perf/padding_share"]  # smaller micro-batches, less padding


def test_policy_then_critic_backward_gives_the_combined_gradients_with_one_models_activations(sft_model_dir, prompts_file, tmp_path):
    """One process back-propagates the policy's terms before the critic's forward (parallel.backward_separately):
    every gradient and metric equals the one forward + one backward of both that ddp runs, with every loss term
    on (KL loss, entropy bonus), and the tensors alive at once are fewer (the critic's activations come after
    the policy's are freed)."""
    import copy

    from conftest import LiveTensors

    config = tiny_ppo_config(sft_model_dir, prompts_file, tmp_path / "run", total_episodes=16, per_device_train_batch_size=8,
                             num_mini_batches=2, num_ppo_epochs=1, response_length=10, max_grad_norm=0.0,
                             entropy_coef=0.01, kl_loss_coef=0.1)
    trainer = PPOTrainer(config, show_progress=False)
    assert trainer.strategy.backward_separately  # one process
    rollout = one_rollout(trainer)
    results = {}
    for separately in (True, False):
        strategy = copy.copy(trainer.strategy)
        strategy.backward_separately = separately
        recorder = GradientRecorder([p for p in trainer.model.parameters() if p.requires_grad])
        scheduler = torch.optim.lr_scheduler.LambdaLR(recorder, lambda step: 1.0)
        torch.manual_seed(5)
        metrics = optimise.ppo_epochs(trainer.model, recorder, scheduler, rollout, config.ppo, trainer.sizes, strategy, lambda t: t)
        mb = optimise.micro_batches(rollout, torch.arange(8), trainer.sizes, config.ppo)[0]
        (normalisers, scale), = optimise.loss_normalisers([mb], config.ppo, lambda t: t, 1)
        with LiveTensors() as mode:
            optimise.micro_batch_backward(trainer.model, mb, config.ppo, normalisers, scale, torch.Tensor.backward, separately)
        trainer.model.zero_grad(set_to_none=True)
        results[separately] = recorder.grads, metrics, mode.peak_bytes
    (grads, metrics, peak), (want_grads, want_metrics, combined_peak) = results[True], results[False]
    assert len(grads) == len(want_grads) == 2
    for step_got, step_want in zip(grads, want_grads):
        assert len(step_got) == len(step_want)
        for got, want in zip(step_got, step_want):
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-9)
    assert metrics.keys() == want_metrics.keys() and "loss/value_avg" in metrics
    for key, value in want_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert peak < 0.8 * combined_peak, (peak, combined_peak)


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_switches_on_follow_the_padded_learning_curve(sft_model_dir, prompts_file, tmp_path, compile):
    """Same seed, 3 updates: token budget + light head (+ compile) against fixed, padded micro-batches
    with the same loss normalisation (one micro-batch per minibatch): every metric within float rounding."""
    def run(name, **switches):
        config = tiny_ppo_config(sft_model_dir, prompts_file, tmp_path / name, total_episodes=48,
                                 per_device_train_batch_size=8, num_mini_batches=2, response_length=10,
                                 num_sample_generations=0)
        return PPOTrainer(with_speed_switches(config, **switches), show_progress=False).train()

    padded = run("padded")
    switched = run("switched", max_tokens_per_micro_batch=40, lm_head_chunk_size=7, compile=compile)
    for want, got in zip(padded, switched):
        for key in CURVE:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (got["update"], key)
    assert all(g["perf/padding_share"] < w["perf/padding_share"] for w, g in zip(padded, switched))


def test_a_budget_below_the_longest_row_is_refused_before_any_model_loads(sft_model_dir, prompts_file, tmp_path):
    config = with_speed_switches(tiny_ppo_config(sft_model_dir, prompts_file, tmp_path / "run"), max_tokens_per_micro_batch=9)
    with pytest.raises(UserError, match=r"ppo.max_tokens_per_micro_batch=9 is smaller than the longest row this run can produce \(1[0-9] tokens"):
        PPOTrainer(config, show_progress=False)


def test_the_compiled_backbones_run_in_training_only(sft_model_dir, prompts_file, tmp_path):
    """compile: true wraps the training forward; the rollout's reference and value passes stay eager (docs/speed.md).
    The stand-ins here are the eager backbones behind a call counter, so no compile is paid."""
    from ppokit.models.loading import backbone

    config = tiny_ppo_config(sft_model_dir, prompts_file, tmp_path / "run", total_episodes=8, per_device_train_batch_size=4,
                             num_mini_batches=1, num_ppo_epochs=1, response_length=6)
    trainer = PPOTrainer(config, show_progress=False)
    calls = {"policy": 0, "value": 0}

    def counted(role, module):
        def run(*args, **kwargs):
            calls[role] += 1
            return module(*args, **kwargs)
        return run

    model = trainer.model
    model.__dict__["backbones"] = (counted("policy", backbone(model.policy)), counted("value", backbone(model.value_model)))
    rollout = one_rollout(trainer)  # one whole update: sampling, reference and values, training
    trained = dict(calls)
    assert trained["policy"] >= 1 and trained["value"] >= 1
    calls.update(policy=0, value=0)
    with torch.no_grad():
        hp = trainer.config.ppo
        experience.reference_and_values(rollout, model, trainer.ref_model, rows=hp.local_rollout_forward_batch_size,
                                        packed=hp.max_tokens_per_micro_batch is not None, temperature=hp.temperature,
                                        chunk_size=trainer.config.lm_head_chunk_size)
    assert calls == {"policy": 0, "value": 0}
