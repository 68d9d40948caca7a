"""The options TRL's GRPO users reach for: grpo_scale_std: batch (Lite PPO), importance_sampling_level: sequence
(GSPO), mask_truncated_completions (DAPO's overlong filtering), warmup_ratio. Each pure function against
hand-worked values and a plain loop; each key through the trainer; the defaults change nothing
(tests/test_golden.py)."""

from __future__ import annotations

import math
import re
import statistics

import pytest
import torch
from conftest import tiny_ppo_config
from test_algo import _two_processes

from ppokit.training import algo
from ppokit.training.batch_sizes import derive
from ppokit.config.schema import PPOConfig, PPOHyperparams
from ppokit.errors import UserError
from ppokit.training.estimators import ESTIMATORS

BASE = ["model=some/model", "reward.functions=[sentiment]", "data.train=p.jsonl"]
GRPO = ["ppo.advantage_estimator=grpo", "ppo.num_samples_per_prompt=4"]


# --------------------------------------------------------------------------- grpo_scale_std: batch


def test_batch_std_by_hand():
    # two groups of 2: means 2 and 2; the batch [1, 3, 2, 2] has mean 2 and unbiased variance (1 + 1 + 0 + 0) / 3
    scores = torch.tensor([1.0, 3.0, 2.0, 2.0])
    got = algo.grpo_advantages_batch_std(scores, torch.ones(4, dtype=torch.bool), group_size=2, eps=0.0)
    k = math.sqrt(3 / 2)  # 1 / sqrt(2/3)
    torch.testing.assert_close(got, torch.tensor([-k, k, 0.0, 0.0]), rtol=1e-6, atol=0)
    # the group's own std would give +-1 in the first group: the batch's spread is what divides
    group = algo.grpo_advantages(scores, torch.ones(4, dtype=torch.bool), group_size=2)
    torch.testing.assert_close(group, torch.tensor([-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0, 0.0]), rtol=1e-5, atol=0)


def test_batch_std_against_a_plain_loop_with_dropped_rows():
    g = torch.Generator().manual_seed(0)
    n, groups = 4, 6
    scores = torch.randn(n * groups, generator=g, dtype=torch.float64) * 3 + 1
    valid = torch.rand(n * groups, generator=g) > 0.25
    valid[n * 2: n * 3] = False  # a group with no valid member
    valid[n * 3 + 1: n * 4] = False  # a group with one
    got = algo.grpo_advantages_batch_std(scores, valid, n, eps=1e-6)
    batch_std = statistics.stdev([float(s) for s, v in zip(scores, valid) if v])
    want = []
    for start in range(0, n * groups, n):
        members = [(float(scores[i]), bool(valid[i])) for i in range(start, start + n)]
        kept = [s for s, v in members if v]
        for s, v in members:
            want.append((s - sum(kept) / len(kept)) / (batch_std + 1e-6) if v and len(kept) >= 2 else 0.0)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_batch_std_is_trls_formula():
    """TRL 1.16 (grpo_trainer.py, scale_rewards == "batch"): (r - group mean) / (nanstd(r) + 1e-4), its own nanstd."""
    pytest.importorskip("trl")
    from trl.trainer.utils import nanstd

    scores = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.5, 0.25, 2.0, -1.0])
    mean = scores.view(-1, 4).mean(1).repeat_interleave(4)
    trl = (scores - mean) / (nanstd(scores) + 1e-4)
    ours = algo.grpo_advantages_batch_std(scores, torch.ones(8, dtype=torch.bool), 4, eps=1e-4)
    torch.testing.assert_close(ours, trl, rtol=1e-6, atol=1e-7)


def test_batch_std_over_two_processes_equals_one_batch():
    """The standard deviation is the whole batch's: two processes holding half the groups each, summing their
    statistics through `all_reduce`, give the advantages of the batch in one piece."""
    g = torch.Generator().manual_seed(1)
    scores, valid = torch.randn(16, generator=g), torch.rand(16, generator=g) > 0.2
    whole = algo.grpo_advantages_batch_std(scores, valid, 4)
    results = _two_processes(lambda s, v, reduce: algo.grpo_advantages_batch_std(s, v, 4, reduce),
                             (scores[:8], valid[:8]), (scores[8:], valid[8:]))
    torch.testing.assert_close(torch.cat(results), whole, rtol=1e-6, atol=1e-7)
    alone = algo.grpo_advantages_batch_std(scores[:8], valid[:8], 4)
    assert not torch.allclose(alone, whole[:8])  # without the reduction the half batch's std differs


def test_the_grpo_estimator_reads_grpo_scale_std():
    rewards = torch.zeros(8, 3)
    rewards[:, 2] = torch.tensor([1.0, 3.0, 2.0, 2.0, 0.0, 4.0, 5.0, 1.0])
    mask = torch.ones(8, 3, dtype=torch.bool)
    scores, valid = rewards[:, 2], torch.ones(8, dtype=torch.bool)
    grpo = ESTIMATORS["grpo"]
    for value, want in [("batch", algo.grpo_advantages_batch_std(scores, valid, 4)),
                        (True, algo.grpo_advantages(scores, valid, 4, True)), ("group", algo.grpo_advantages(scores, valid, 4, True)),
                        (False, algo.grpo_advantages(scores, valid, 4, False)), ("none", algo.grpo_advantages(scores, valid, 4, False))]:
        advantages, _ = grpo.advantages(rewards, mask, group_size=4, grpo_scale_std=value)
        torch.testing.assert_close(advantages, want.unsqueeze(1).expand(8, 3), msg=str(value))


@pytest.mark.parametrize("overrides, message", [
    (GRPO + ["ppo.grpo_scale_std=global"], "ppo.grpo_scale_std: value 'global' is out of range, it must be true, false, batch, or TRL's group, none"),
    (["ppo.grpo_scale_std=batch"], "ppo.grpo_scale_std ('batch') is for ppo.advantage_estimator grpo"),
])
def test_grpo_scale_std_values(overrides, message):
    with pytest.raises(UserError, match=re.escape(message)):
        PPOConfig.load(None, BASE + overrides)
    for value in ("batch", "group", "none", "true", "false"):
        assert PPOConfig.load(None, BASE + GRPO + [f"ppo.grpo_scale_std={value}"]).ppo.grpo_scale_std in (value, True, False)


# --------------------------------------------------------------------------- importance_sampling_level: sequence (GSPO)


def test_sequence_log_ratio_by_hand_and_its_gradient():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -1.0, -9.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    got = algo.sequence_log_ratio(logprobs, old, mask)
    # row 0: ((-1 + 1.5) + (-2 + 1)) / 2 = -0.25 on every column; row 1: 0.5 / 1
    torch.testing.assert_close(got, torch.tensor([[-0.25] * 3, [0.5] * 3]))
    got[:, 0].sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]))


def _gspo_loop(logprobs, old, advantages, mask, low, high):
    """GSPO's per-sequence objective written out [Zheng et al. 2025, eq. 7]: each row's loss
    -min(s A, clip(s, 1 - low, 1 + high) A), s = exp(mean over its tokens of log pi - log pi_old), A the row's advantage."""
    losses = []
    for i in range(logprobs.shape[0]):
        tokens = [t for t in range(logprobs.shape[1]) if mask[i, t]]
        log_s = sum(logprobs[i, t] - old[i, t] for t in tokens) / len(tokens)
        s, a = torch.exp(log_s), advantages[i, tokens[0]]
        losses.append(-torch.min(s * a, torch.clamp(s, 1 - low, 1 + high) * a))
    return torch.stack(losses)


def test_gspo_loss_with_a_mean_per_sequence_is_the_papers_objective_value_and_gradient():
    g = torch.Generator().manual_seed(2)
    B, T = 6, 5
    old = -torch.rand(B, T, generator=g) * 3
    logprobs = (old + torch.randn(B, T, generator=g) * 0.3).requires_grad_(True)
    advantages = torch.randn(B, 1, generator=g).expand(B, T).contiguous()  # one advantage per response
    mask = torch.arange(T).expand(B, T) < torch.tensor([[5], [3], [1], [4], [2], [5]])
    settings = algo.LossSettings(cliprange_low=0.05, cliprange_high=0.08, importance_sampling_level="sequence",
                                 aggregation="seq_mean_token_mean")
    terms = algo.ppo_loss(settings, algo.loss_normalisers(mask, "seq_mean_token_mean", T), mask, logprobs, old, advantages,
                          torch.zeros(B, T))
    ours_grad = torch.autograd.grad(terms.loss, logprobs)[0]
    logprobs_loop = logprobs.detach().clone().requires_grad_(True)
    want = _gspo_loop(logprobs_loop, old, advantages, mask, 0.05, 0.08).mean()
    want_grad = torch.autograd.grad(want, logprobs_loop)[0]
    torch.testing.assert_close(terms.policy, want.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours_grad, want_grad, rtol=1e-5, atol=1e-7)
    # some sequences clipped, some not: the test sees both branches
    assert 0 < terms.stats.clipfrac < 1


def test_gspo_with_one_token_per_response_is_ppo_and_differs_otherwise():
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(4, 3, generator=g)
    logprobs = old + torch.randn(4, 3, generator=g) * 0.5
    advantages = torch.randn(4, 3, generator=g)
    one = torch.zeros(4, 3, dtype=torch.bool)
    one[:, 0] = True
    token = algo.policy_loss_per_token(logprobs, old, advantages, 0.2, 0.2)[0]
    sequence = algo.policy_loss_per_token(logprobs, old, advantages, 0.2, 0.2, sequence_mask=one)[0]
    torch.testing.assert_close(sequence[:, 0], token[:, 0])
    full = torch.ones(4, 3, dtype=torch.bool)
    assert not torch.allclose(algo.policy_loss_per_token(logprobs, old, advantages, 0.2, 0.2, sequence_mask=full)[0], token)


def test_importance_sampling_level_reaches_the_loss():
    from ppokit.training.optimise import loss_settings

    assert loss_settings(PPOHyperparams()).importance_sampling_level == "token"
    assert loss_settings(PPOHyperparams(importance_sampling_level="sequence")).importance_sampling_level == "sequence"
    with pytest.raises(UserError, match="ppo.importance_sampling_level: value 'sequences' is out of range, it must be one of token, sequence"):
        PPOConfig.load(None, BASE + ["ppo.importance_sampling_level=sequences"])


# --------------------------------------------------------------------------- mask_truncated_completions


def test_mask_truncated_by_hand():
    mask = torch.tensor([[True, True, False], [True, True, True], [False, False, False], [True, False, True]])
    ended = torch.tensor([True, False, True, False])
    want = torch.tensor([[True, True, False], [False, False, False], [False, False, False], [False, False, False]])
    assert torch.equal(algo.mask_truncated(mask, ended), want)
    for i in range(4):  # plain loop: a row keeps its mask iff it ended
        assert torch.equal(algo.mask_truncated(mask, ended)[i], mask[i] if ended[i] else torch.zeros(3, dtype=torch.bool))


def test_mask_truncated_completions_needs_a_way_to_end():
    with pytest.raises(UserError, match="ppo.mask_truncated_completions needs a stop token"):
        PPOConfig.load(None, BASE + ["ppo.mask_truncated_completions=true", "ppo.stop_token=null"])
    PPOConfig.load(None, BASE + ["ppo.mask_truncated_completions=true"])  # eos, the default stop token
    PPOConfig.load(None, BASE + ["ppo.mask_truncated_completions=true", "ppo.stop_token=null",
                                 "environment=ppokit.environments:GuessNumber"])  # the environment ends episodes


# --------------------------------------------------------------------------- warmup_ratio


@pytest.mark.parametrize("ratio, steps, want", [(0.1, 30, 3), (0.1, 31, 4), (0.03, 100, 3), (0.0, 50, 0), (0.5, 1, 1), (0.25, 7, 2),
                                               (0.07, 100, 7), (0.55, 100, 55)])  # 0.07 * 100 == 7.000000000000001 in floats
def test_warmup_ratio_is_ceil_of_the_share_of_steps_as_written(ratio, steps, want):
    assert PPOHyperparams(warmup_ratio=ratio).warmup_steps_over(steps) == want
    assert PPOHyperparams(warmup_steps=5).warmup_steps_over(steps) == 5


def test_warmup_ratio_shapes_the_schedule_as_the_same_warmup_steps_would():
    from torch import nn

    from ppokit.training.optimise import PolicyAndValue, build_optimiser

    def rates(hp, steps=20):
        optimizer, scheduler = build_optimiser(PolicyAndValue(nn.Linear(2, 2), None), hp, steps, hp.warmup_steps_over(steps))
        out = []
        for _ in range(steps):
            out.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
        return out

    by_ratio = rates(PPOHyperparams(warmup_ratio=0.25, learning_rate=1.0))
    assert by_ratio == rates(PPOHyperparams(warmup_steps=5, learning_rate=1.0))
    assert by_ratio[:6] == [0.2, 0.4, 0.6, 0.8, 1.0, 1.0] and by_ratio != rates(PPOHyperparams(learning_rate=1.0))


@pytest.mark.parametrize("overrides, message", [
    (["ppo.warmup_ratio=0.1", "ppo.warmup_steps=3"], "ppo.warmup_steps (3) and ppo.warmup_ratio (0.1) both set the warm-up; set one of them"),
    (["ppo.warmup_ratio=1"], "ppo.warmup_ratio: value 1.0 is out of range, it must be in [0, 1)"),
])
def test_warmup_ratio_refusals(overrides, message):
    with pytest.raises(UserError, match=re.escape(message)):
        PPOConfig.load(None, BASE + overrides)


def test_a_warmup_ratio_as_long_as_the_run_is_refused():
    hp = PPOHyperparams(per_device_train_batch_size=8, total_episodes=32, num_ppo_epochs=2, num_mini_batches=2, warmup_ratio=0.8)
    assert derive(hp, 1, 100).num_updates == 2  # ceil(0.8 x 8) = 7 of the run's 8 optimiser steps
    hp.warmup_ratio = 0.9  # ceil(0.9 x 8) = 8: the whole run
    with pytest.raises(UserError, match=re.escape("ppo.warmup_ratio (0.9), a warm-up of 8 optimiser steps, is not shorter than the run's 8 optimiser steps")):
        derive(hp, 1, 100)


# --------------------------------------------------------------------------- through the trainer


def _first_update(config, monkeypatch):
    """One update of a real run -> (what stage 6 optimised over, the update's record)."""
    from ppokit.trainer import PPOTrainer

    trainer = PPOTrainer(config, show_progress=False)
    seen = []
    optimise = trainer.optimise
    monkeypatch.setattr(trainer, "optimise", lambda episodes: seen.append(episodes) or optimise(episodes))
    record = trainer.step()
    return seen[0], record


def _grpo_config(model, prompts_file, output_dir, **ppo):
    return tiny_ppo_config(model, prompts_file, output_dir, total_episodes=16, per_device_train_batch_size=8, num_mini_batches=2,
                           advantage_estimator="grpo", num_samples_per_prompt=4, stop_token="eos", num_sample_generations=0, **ppo)


def test_mask_truncated_completions_takes_truncated_episodes_out_of_the_loss_only(sft_model_dir, prompts_file, tmp_path, monkeypatch):
    """The same seed with and without: the same episodes and advantages (a truncated response's score stays in its
    group's baseline), but the optimisation trains only on the responses that produced the stop token."""
    kept, record_kept = _first_update(_grpo_config(sft_model_dir, prompts_file, tmp_path / "a", response_length=6), monkeypatch)
    masked, record = _first_update(_grpo_config(sft_model_dir, prompts_file, tmp_path / "b", response_length=6,
                                                 mask_truncated_completions=True), monkeypatch)
    ended = masked.ended
    assert 0 < int(ended.sum()) < len(ended), "the test needs both ended and truncated responses"
    assert torch.equal(kept.response_ids, masked.response_ids) and torch.equal(kept.ended, ended)
    torch.testing.assert_close(masked.advantages, kept.advantages, rtol=0, atol=0)
    assert kept.trained_mask[~ended].any()  # without the option truncated responses are trained on
    assert not masked.trained_mask[~ended].any()
    assert torch.equal(masked.trained_mask[ended], kept.trained_mask[ended])
    # the metrics describe what was sampled, the same either way
    assert record["objective/response_length"] == record_kept["objective/response_length"]
    assert record["val/num_eos_tokens"] == int(ended.sum())


def test_grpo_scale_std_batch_through_the_trainer(sft_model_dir, prompts_file, tmp_path, monkeypatch):
    episodes, _ = _first_update(_grpo_config(sft_model_dir, prompts_file, tmp_path / "run", response_length=8, grpo_scale_std="batch"),
                                monkeypatch)
    mask = episodes.trained_mask
    scores = algo.sequence_rewards(episodes.rewards, mask)
    per_sequence = algo.grpo_advantages_batch_std(scores, mask.any(-1), 4)
    torch.testing.assert_close(episodes.advantages, per_sequence.unsqueeze(1) * mask, rtol=0, atol=0)
    by_group = algo.grpo_advantages(scores, mask.any(-1), 4)
    assert not torch.allclose(per_sequence, by_group)


def test_gspo_trains_and_its_ratio_statistics_are_the_sequences(sft_model_dir, prompts_file, tmp_path, monkeypatch):
    """Two epochs over one rollout: the second epoch's ratios differ from 1, token by token or per sequence."""
    runs = {}
    for level in ("token", "sequence"):
        config = _grpo_config(sft_model_dir, prompts_file, tmp_path / level, response_length=8, num_ppo_epochs=2,
                              importance_sampling_level=level, loss_aggregation="seq_mean_token_mean", learning_rate=5e-3)
        runs[level] = _first_update(config, monkeypatch)[1]
    token, sequence = runs["token"], runs["sequence"]
    for key in ("policy/approxkl_avg", "loss/policy_avg", "val/ratio"):
        assert math.isfinite(sequence[key]) and sequence[key] != token[key], key
