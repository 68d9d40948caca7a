"""The PPO maths against values worked out by hand and against plain Python loops."""

import math

import pytest
import torch

from ppokit import algo


def test_logprobs_divide_logits_by_temperature():
    logits = torch.tensor([[[1.0, 2.0, 3.0]]])
    tokens = torch.tensor([[2]])
    # T = 2: scaled logits 0.5, 1, 1.5; log p(2) = 1.5 - log(e^0.5 + e^1 + e^1.5)
    expected = 1.5 - math.log(math.exp(0.5) + math.exp(1.0) + math.exp(1.5))
    assert algo.logprobs_from_logits(logits, tokens, 2.0).item() == pytest.approx(expected, abs=1e-6)
    assert algo.logprobs_from_logits(logits, tokens, 1.0).item() == pytest.approx(
        3.0 - math.log(math.exp(1) + math.exp(2) + math.exp(3)), abs=1e-6
    )


def test_entropy_of_uniform_is_log_vocab():
    _, entropy = algo.logprobs_and_entropy(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), 0.7)
    assert torch.allclose(entropy, torch.full((2, 3), math.log(5)))


def test_logprobs_and_entropy_against_a_plain_loop():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7, requires_grad=True)
    tokens = torch.randint(0, 7, (2, 3))
    logprobs, entropy = algo.logprobs_and_entropy(logits, tokens, 0.7)
    for b in range(2):
        for t in range(3):
            scaled = [x / 0.7 for x in logits[b, t].tolist()]
            log_z = math.log(sum(math.exp(x) for x in scaled))
            p = [math.exp(x - log_z) for x in scaled]
            assert entropy[b, t].item() == pytest.approx(-sum(q * math.log(q) for q in p), abs=1e-5)
            assert logprobs[b, t].item() == pytest.approx(scaled[tokens[b, t]] - log_z, abs=1e-5)
    assert torch.allclose(logprobs, algo.logprobs_from_logits(logits, tokens, 0.7), atol=1e-6)
    assert logprobs.requires_grad and not entropy.requires_grad
    logprobs.sum().backward()
    expected = torch.autograd.grad(algo.logprobs_from_logits(logits, tokens, 0.7).sum(), logits)[0]
    assert torch.allclose(logits.grad, expected, atol=1e-6)


def test_truncate_after_stop_keeps_stop_token_and_pads_after():
    ids = torch.tensor([[5, 1, 7, 1], [5, 6, 7, 8]])
    out, mask = algo.truncate_after_stop(ids, stop_token_id=1, pad_token_id=0)
    assert out.tolist() == [[5, 1, 0, 0], [5, 6, 7, 8]]
    assert mask.tolist() == [[True, True, False, False], [True, True, True, True]]
    assert algo.first_true_index(ids == 1).tolist() == [1, 4]
    assert algo.last_token_index(mask).tolist() == [1, 3]


def test_kl_estimators_by_hand():
    logprobs = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    # r = ref - logprobs = [-0.5, 1.0]
    assert algo.kl_per_token(logprobs, ref, "k1")[0].tolist() == pytest.approx([0.5, -1.0])
    assert algo.kl_per_token(logprobs, ref, "k2")[0].tolist() == pytest.approx([0.125, 0.5])
    k3 = [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0]
    assert algo.kl_per_token(logprobs, ref, "k3")[0].tolist() == pytest.approx(k3)
    assert torch.all(algo.kl_per_token(logprobs, ref, "k3") >= 0)
    with pytest.raises(ValueError):
        algo.kl_per_token(logprobs, ref, "k4")


def test_shape_rewards_adds_score_at_last_real_token():
    scores = torch.tensor([2.0, -1.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    rewards, non_score = algo.shape_rewards(scores, kl, mask, kl_coef=0.5)
    assert non_score.flatten().tolist() == pytest.approx([-0.05, -0.1, 0.0, -0.2, -0.25, -0.3])
    assert rewards.flatten().tolist() == pytest.approx([-0.05, 1.9, 0.0, -0.2, -0.25, -1.3])


def test_shape_rewards_gives_an_empty_row_nothing():
    # A row dropped from the update (mask all False) must stay all padding, score included.
    scores = torch.tensor([2.0, 5.0])
    kl = torch.tensor([[0.1, 0.2], [0.3, 0.4]])
    mask = torch.tensor([[True, True], [False, False]])
    rewards, non_score = algo.shape_rewards(scores, kl, mask, kl_coef=1.0)
    assert rewards.flatten().tolist() == pytest.approx([-0.1, 1.8, 0.0, 0.0])
    assert non_score[1].tolist() == [0.0, 0.0]


def test_whitening_one_token_and_no_tokens():
    values = torch.tensor([[3.0, 7.0], [9.0, 1.0]])
    one = torch.tensor([[False, True], [False, False]])
    assert algo.masked_var(values, one).item() == 0.0  # no Bessel correction for n = 1
    assert algo.masked_whiten(values, one).tolist() == [[0.0, 0.0], [0.0, 0.0]]
    assert algo.masked_whiten(values, one, shift_mean=False).tolist() == [[0.0, 7.0], [0.0, 0.0]]
    none = torch.zeros(2, 2, dtype=torch.bool)
    assert algo.masked_mean(values, none).item() == 0.0
    assert algo.masked_whiten(values, none).tolist() == [[0.0, 0.0], [0.0, 0.0]]


def _gae_loop(rewards, values, mask, gamma, lam):
    """The textbook recursion, one row and one step at a time, with plain floats."""
    B, T = len(rewards), len(rewards[0])
    advantages = [[0.0] * T for _ in range(B)]
    for b in range(B):
        length = sum(mask[b])
        last = 0.0
        for t in reversed(range(length)):
            next_value = values[b][t + 1] if t + 1 < length else 0.0
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            last = delta + gamma * lam * last
            advantages[b][t] = last
    return advantages


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 1.0]])
    values = torch.tensor([[0.5, 0.25]])
    mask = torch.tensor([[True, True]])
    adv, ret = algo.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # t=1: delta = 1 + 0 - 0.25 = 0.75; A1 = 0.75
    # t=0: delta = 0 + 0.9*0.25 - 0.5 = -0.275; A0 = -0.275 + 0.72*0.75 = 0.265
    assert adv[0].tolist() == pytest.approx([0.265, 0.75])
    assert ret[0].tolist() == pytest.approx([0.765, 1.0])


def test_gae_matches_plain_loop_with_padding():
    torch.manual_seed(0)
    rewards, values = torch.randn(5, 7), torch.randn(5, 7)
    lengths = torch.tensor([7, 3, 1, 5, 6])
    mask = torch.arange(7).unsqueeze(0) < lengths.unsqueeze(1)
    adv, ret = algo.gae(rewards, values, mask, gamma=0.99, lam=0.95)
    expected = torch.tensor(_gae_loop(rewards.tolist(), values.tolist(), mask.int().tolist(), 0.99, 0.95))
    assert torch.allclose(adv, expected, atol=1e-5)
    assert torch.allclose(ret, (expected + values) * mask, atol=1e-5)
    assert torch.all(adv[~mask] == 0)


def test_masked_statistics_and_whitening():
    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, 100.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    assert algo.masked_mean(values, mask).item() == pytest.approx(2.5)
    assert algo.masked_var(values, mask).item() == pytest.approx(5 / 3)  # unbiased, n = 4
    white = algo.masked_whiten(values, mask)
    assert algo.masked_mean(white, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert algo.masked_var(white, mask).item() == pytest.approx(1.0, abs=1e-4)
    assert torch.all(white[~mask] == 0)
    kept = algo.masked_whiten(values, mask, shift_mean=False)
    assert algo.masked_mean(kept, mask).item() == pytest.approx(2.5, abs=1e-5)


def test_clipped_policy_loss_by_hand():
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[1.5, 0.5]]))  # ratios 1.5 and 0.5
    adv = torch.tensor([[1.0, 1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, stats = algo.clipped_policy_loss(new, old, adv, mask, cliprange=0.2)
    # token 1: max(-1.5, -1.2) = -1.2 (clipped); token 2: max(-0.5, -0.8) = -0.5 (unclipped)
    assert loss.item() == pytest.approx((-1.2 - 0.5) / 2)
    assert stats.clipfrac.item() == pytest.approx(0.5)
    assert stats.ratio.item() == pytest.approx(1.0)
    assert stats.approxkl.item() == pytest.approx(0.5 * (math.log(1.5) ** 2 + math.log(0.5) ** 2) / 2)
    assert not stats.approxkl.requires_grad


def test_policy_loss_ignores_padding_and_has_gradient():
    new = torch.zeros(1, 3, requires_grad=True)
    loss, _ = algo.clipped_policy_loss(new, torch.zeros(1, 3), torch.tensor([[1.0, 2.0, 50.0]]), torch.tensor([[True, True, False]]), 0.2)
    loss.backward()
    assert loss.item() == pytest.approx(-1.5)
    assert new.grad[0].tolist() == pytest.approx([-0.5, -1.0, 0.0])


def test_clipped_value_loss_by_hand():
    old = torch.tensor([[0.0, 0.0]])
    new = torch.tensor([[1.0, 0.1]])
    returns = torch.tensor([[2.0, 1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, clipfrac = algo.clipped_value_loss(new, old, returns, mask, cliprange_value=0.2)
    # token 1: unclipped (1-2)^2 = 1, clipped (0.2-2)^2 = 3.24 -> 3.24; token 2: 0.81 vs 0.81 -> 0.81
    assert loss.item() == pytest.approx(0.5 * (3.24 + 0.81) / 2)
    assert clipfrac.item() == pytest.approx(0.5)


def test_adaptive_kl_controller_by_hand():
    ctl = algo.AdaptiveKLController(0.1, target=6.0, horizon=10000)
    # KL 9 -> error clip(9/6 - 1) = 0.2 (clipped from 0.5); coef *= 1 + 0.2 * 256 / 10000
    assert ctl.update(9.0, 256) == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    # KL 5.4 -> error -0.1
    value = ctl.value
    assert ctl.update(5.4, 100) == pytest.approx(value * (1 - 0.1 * 100 / 10000))
    restored = algo.AdaptiveKLController(0.5, 6.0, 10000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
    assert algo.FixedKLController(0.05).update(100.0, 64) == 0.05
