"""The PPO maths against values worked out by hand and against plain Python loops."""

import math

import pytest
import torch
from conftest import assert_float32_close

from ppokit.training import algo


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
    out, mask = algo.truncate_after_stop(ids, stop_token_ids=[1], pad_token_id=0)
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
    rewards, non_score = algo.shape_rewards(scores, kl, mask, 0.5, algo.last_token_index(mask))
    assert non_score.flatten().tolist() == pytest.approx([-0.05, -0.1, 0.0, -0.2, -0.25, -0.3])
    assert rewards.flatten().tolist() == pytest.approx([-0.05, 1.9, 0.0, -0.2, -0.25, -1.3])


def test_shape_rewards_adds_score_at_the_declared_position():
    # the score goes where score_index says (a multi-turn episode's last model token), not at the mask's last token
    scores = torch.tensor([2.0])
    kl = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    mask = torch.tensor([[True, False, True, True]])
    rewards, _ = algo.shape_rewards(scores, kl, mask, 1.0, torch.tensor([2]))
    assert rewards.flatten().tolist() == pytest.approx([-0.1, 0.0, 1.7, -0.4])


def test_shape_rewards_gives_an_empty_row_nothing():
    # A row dropped from the update (mask all False) must stay all padding, score included.
    scores = torch.tensor([2.0, 5.0])
    kl = torch.tensor([[0.1, 0.2], [0.3, 0.4]])
    mask = torch.tensor([[True, True], [False, False]])
    rewards, non_score = algo.shape_rewards(scores, kl, mask, 1.0, torch.tensor([1, 1]))
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


def _gae_loop_skipping(rewards, values, mask, gamma, lam):
    """The recursion over each row's masked positions alone, plain floats: a position outside the mask
    is no step, so the one before a gap bootstraps from the value after it."""
    advantages = [[0.0] * len(row) for row in rewards]
    for b, row_mask in enumerate(mask):
        steps = [t for t, m in enumerate(row_mask) if m]
        last, next_value = 0.0, 0.0
        for t in reversed(steps):
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            last = delta + gamma * lam * last
            advantages[b][t] = last
            next_value = values[b][t]
    return advantages


def test_gae_by_hand_bootstraps_across_a_gap():
    # columns 2 and 3 are an observation (read, not trained on): their rewards and values must not count
    rewards = torch.tensor([[0.0, 0.0, 9.0, 9.0, 3.0]])
    values = torch.tensor([[1.0, 2.0, 9.0, 9.0, 4.0]])
    mask = torch.tensor([[True, True, False, False, True]])
    adv, ret = algo.gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # t=4: delta = 3 + 0 - 4 = -1;               A4 = -1
    # t=1: delta = 0 + V4 - V1 = 4 - 2 = 2;      A1 = 2 + 0.5 * A4 = 1.5
    # t=0: delta = 0 + V1 - V0 = 2 - 1 = 1;      A0 = 1 + 0.5 * A1 = 1.75
    assert adv[0].tolist() == [1.75, 1.5, 0.0, 0.0, -1.0]  # exact: halves and small integers
    assert ret[0].tolist() == [2.75, 3.5, 0.0, 0.0, 3.0]


def test_gae_with_gaps_matches_a_plain_loop():
    torch.manual_seed(0)
    rewards, values = torch.randn(6, 9), torch.randn(6, 9)
    mask = torch.rand(6, 9) < 0.6
    mask[0] = False  # a row outside the update
    mask[1] = True
    adv, ret = algo.gae(rewards, values, mask, gamma=0.99, lam=0.95)
    expected = torch.tensor(_gae_loop_skipping(rewards.tolist(), values.tolist(), mask.tolist(), 0.99, 0.95))
    assert_float32_close(adv, expected, terms=2 * 9)  # each A_t: a sum of at most 2 terms per later step
    assert_float32_close(ret, (expected + values) * mask, terms=2 * 9 + 1)
    assert torch.all(adv[~mask] == 0) and torch.all(ret[~mask] == 0)


def test_gae_of_one_span_from_the_start_is_the_plain_recursion_bit_for_bit():
    # the single-turn layout (each row's trained tokens one span from column 0): moving the masked positions
    # to the front is the identity, so the arithmetic is the recursion's over the padded row, unchanged
    torch.manual_seed(1)
    rewards, values = torch.randn(5, 7), torch.randn(5, 7)
    mask = torch.arange(7).unsqueeze(0) < torch.tensor([7, 3, 1, 0, 6]).unsqueeze(1)
    assert torch.equal(algo.mask_first_order(mask), torch.arange(7).expand(5, 7))
    adv, ret = algo.gae(rewards, values, mask, gamma=0.99, lam=0.95)
    plain_adv, plain_ret = algo._gae_prefix(rewards, values, mask, 0.99, 0.95)
    assert torch.equal(adv, plain_adv) and torch.equal(ret, plain_ret)


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


def test_log_ratio_clamp_bounds_the_policy_loss_by_hand():
    # Log-ratios 25, 25, -25 and 0.1 (float64: the values below are exact up to exp's rounding).
    old = torch.zeros(1, 4, dtype=torch.float64)
    new = torch.tensor([[25.0, 25.0, -25.0, 0.1]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[-2.0, 2.0, -2.0, -1.0]], dtype=torch.float64)
    loss, log_ratio, ratio, clipped, _ = algo.policy_loss_per_token(new, old, adv, 0.2, 0.2)
    # token 1 (A < 0, ratio above the clip): max(2 e^20, 2 x 1.2) = 2 e^20 ~ 9.7e8, not 2 e^25 ~ 1.4e11;
    # token 2 (A > 0): max(-2 e^20, -2 x 1.2) = -2.4 (clipped); token 3: max(2 e^-20, 2 x 0.8) = 1.6;
    # token 4, inside the clip range: e^0.1.
    assert loss[0].tolist() == pytest.approx([2 * math.exp(20), -2.4, 1.6, math.exp(0.1)], rel=1e-15)
    assert ratio[0, :3].tolist() == pytest.approx([math.exp(20), math.exp(20), math.exp(-20)], rel=1e-15)
    assert log_ratio[0, 0].item() == 25.0  # the statistics see the log-ratio itself
    loss.sum().backward()
    # Beyond the clamp the ratio is a constant: token 1 contributes no gradient (2 e^25 without the clamp);
    # tokens 2 and 3 have none from the clip either; token 4's is -A e^0.1.
    assert new.grad[0, :3].tolist() == [0.0, 0.0, 0.0]
    assert new.grad[0, 3].item() == pytest.approx(math.exp(0.1), rel=1e-15)
    capped, *_ = algo.policy_loss_per_token(new.detach(), old, adv, 0.2, 0.2, dual_clip_c=3.0)
    assert capped[0, 0].item() == 6.0  # the dual clip caps it lower still: c |A|


def test_log_ratio_clamp_changes_nothing_within_its_bound():
    # Every log-ratio in [-20, 20], the bounds included: the loss, its gradient and k3 are those of the
    # unclamped formulas bit for bit (the clamp returns its input there and passes the gradient through).
    torch.manual_seed(0)
    old = torch.randint(-4, 5, (4, 64)).float()  # integers: old + 20 - old is 20 exactly, and no difference exceeds it
    log_ratio = torch.cat([torch.tensor([-20.0, 20.0]), torch.empty(254).uniform_(-20, 20)]).reshape(4, 64)
    assert ((old + log_ratio) - old).abs().max() <= algo.LOG_RATIO_CLAMP
    adv = torch.randn(4, 64)
    for dual_clip_c in (None, 3.0):
        new = (old + log_ratio).requires_grad_()
        loss, _, ratio, _, _ = algo.policy_loss_per_token(new, old, adv, 0.2, 0.28, dual_clip_c)
        loss.sum().backward()
        plain = new.detach().clone().requires_grad_()
        plain_ratio = torch.exp(plain - old)
        plain_loss = torch.max(-adv * plain_ratio, -adv * torch.clamp(plain_ratio, 0.8, 1.28))
        if dual_clip_c is not None:
            plain_loss = torch.where(adv < 0, torch.min(plain_loss, -adv * dual_clip_c), plain_loss)
        plain_loss.sum().backward()
        assert torch.equal(ratio, plain_ratio) and torch.equal(loss, plain_loss) and torch.equal(new.grad, plain.grad)
    ref = old + log_ratio
    assert torch.equal(algo.kl_per_token(old, ref, "k3"), torch.expm1(ref - old) - (ref - old))


def test_k3_is_bounded_beyond_the_log_ratio_clamp():
    logprobs = torch.tensor([[0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[25.0, 100.0]], dtype=torch.float64)  # log(ref / policy) = 25 and 100
    k3 = algo.kl_per_token(logprobs, ref, "k3")
    assert k3[0].tolist() == pytest.approx([math.expm1(20) - 25, math.expm1(20) - 100], rel=1e-15)
    k3.sum().backward()
    assert logprobs.grad[0].tolist() == [1.0, 1.0]  # only the -r term's: 1 - e^r without the clamp


def test_kl_clamp_by_hand():
    logprobs = torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[15.0, 0.5, -15.0]], dtype=torch.float64)  # r = 15, 0.5, -15
    k3 = algo.kl_per_token(logprobs, ref, "k3", clamp=10.0)
    # k3(15) = e^15 - 16 ~ 3.3e6 -> 10; k3(0.5) = e^0.5 - 1.5, inside; k3(-15) = e^-15 + 14 -> 10
    assert k3[0].tolist() == pytest.approx([10.0, math.expm1(0.5) - 0.5, 10.0], rel=1e-15)
    k3.sum().backward()
    # d k3 / d logprob = 1 - e^r: -3.3e6 at r = 15 unclamped; 0 where the clamp is active
    assert logprobs.grad[0].tolist() == pytest.approx([0.0, 1 - math.exp(0.5), 0.0], rel=1e-15)
    assert logprobs.grad[0, 0].item() == 0.0
    k1 = algo.kl_per_token(logprobs.detach(), ref, "k1", clamp=10.0)
    assert k1[0].tolist() == [-10.0, -0.5, 10.0]  # every estimator, both signs
    assert torch.equal(algo.kl_per_token(logprobs.detach(), ref, "k2", clamp=None), 0.5 * ref**2)
    # in the loss: the KL term is the clamped estimate
    mask = torch.ones(1, 3, dtype=torch.bool)
    settings = algo.LossSettings(kl_loss_coef=1.0, kl_clamp=10.0)
    terms = algo.ppo_loss(settings, algo.loss_normalisers(mask, "token_mean", 3), mask, logprobs.detach(), logprobs.detach(),
                          torch.zeros(1, 3, dtype=torch.float64), torch.zeros(1, 3, dtype=torch.float64),
                          ref_logprobs=ref)
    assert terms.kl.item() == pytest.approx((20.0 + math.expm1(0.5) - 0.5) / 3, rel=1e-12)


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


# --------------------------------------------------------------------------- estimators


def _two_processes(fn, first, second):
    """Run fn(inputs, all_reduce) on two threads that sum tensors between them, as two processes'
    all-reduce does; returns both results."""
    import threading

    barrier, slots, results = threading.Barrier(2), [None, None], [None, None]

    def reduce_from(rank):
        def all_reduce(tensor):
            slots[rank] = tensor.clone()
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()
            return total

        return all_reduce

    def run(rank, inputs):
        results[rank] = fn(*inputs, reduce_from(rank))

    threads = [threading.Thread(target=run, args=(r, x)) for r, x in enumerate((first, second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_grpo_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    valid = torch.ones(8, dtype=torch.bool)
    # group 1: mean 0.5, std (Bessel) sqrt(4 * 0.25 / 3) = 0.57735; group 2: all equal -> 0
    adv = algo.grpo_advantages(scores, valid, group_size=4)
    assert adv.tolist() == pytest.approx([0.5 / (math.sqrt(1 / 3) + 1e-6) * s for s in (1, -1, -1, 1)] + [0.0] * 4, abs=1e-6)
    # Dr. GRPO: no std
    assert algo.grpo_advantages(scores, valid, 4, scale_std=False).tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])


def test_grpo_leaves_dropped_rows_out_of_their_group():
    scores = torch.tensor([1.0, 3.0, 100.0, 5.0, 7.0, 9.0])
    valid = torch.tensor([True, True, False, True, False, False])
    adv = algo.grpo_advantages(scores, valid, group_size=3, scale_std=False)
    # group 1 is {1, 3} (mean 2); group 2 has one member left: no baseline, 0
    assert adv.tolist() == pytest.approx([-1.0, 1.0, 0.0, 0.0, 0.0, 0.0])


def test_grpo_and_rloo_match_plain_loops():
    import statistics

    torch.manual_seed(0)
    n, groups = 5, 4
    scores = torch.randn(n * groups)
    valid = torch.rand(n * groups) > 0.2
    grpo = algo.grpo_advantages(scores, valid, n).tolist()
    drgrpo = algo.grpo_advantages(scores, valid, n, scale_std=False).tolist()
    rloo = algo.rloo_advantages(scores, valid, n).tolist()
    for g in range(groups):
        rows = range(g * n, (g + 1) * n)
        members = [scores[i].item() for i in rows if valid[i]]
        for i in rows:
            if not valid[i] or len(members) < 2:
                assert grpo[i] == drgrpo[i] == rloo[i] == 0.0
                continue
            mean = statistics.mean(members)
            r = scores[i].item()
            assert drgrpo[i] == pytest.approx(r - mean, abs=1e-5)
            assert grpo[i] == pytest.approx((r - mean) / (statistics.stdev(members) + 1e-6), abs=1e-4)
            others = list(members)
            others.remove(r)
            assert rloo[i] == pytest.approx(r - sum(others) / len(others), abs=1e-5)


def test_rloo_by_hand():
    adv = algo.rloo_advantages(torch.tensor([1.0, 2.0, 3.0]), torch.ones(3, dtype=torch.bool), group_size=3)
    # 1 - (2 + 3)/2, 2 - (1 + 3)/2, 3 - (1 + 2)/2; also = 3/2 * (r - mean)
    assert adv.tolist() == pytest.approx([-1.5, 0.0, 1.5])
    with pytest.raises(ValueError, match="whole groups"):
        algo.rloo_advantages(torch.zeros(5), torch.ones(5, dtype=torch.bool), group_size=2)


def test_discounted_returns_match_a_plain_loop():
    torch.manual_seed(0)
    rewards = torch.randn(4, 6)
    lengths = [6, 3, 0, 1]
    mask = torch.arange(6).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    returns = algo.discounted_returns(rewards, mask, gamma=0.9)
    for b, length in enumerate(lengths):
        for t in range(6):
            expected = sum(0.9 ** (s - t) * rewards[b, s].item() for s in range(t, length)) if t < length else 0.0
            assert returns[b, t].item() == pytest.approx(expected, abs=1e-5)


def test_discounted_returns_by_hand_skip_a_gap():
    # G_3 = 2; G_0 = 1 + 0.5 * G_3 = 2: the gap (columns 1, 2) is no step, its rewards do not count
    rewards = torch.tensor([[1.0, 7.0, 7.0, 2.0]])
    mask = torch.tensor([[True, False, False, True]])
    assert algo.discounted_returns(rewards, mask, gamma=0.5)[0].tolist() == [2.0, 0.0, 0.0, 2.0]


def test_reinforce_pp_by_hand():
    # score 1 on the last token, KL penalties -0.1 per token; gamma 1 -> G = [0.8, 0.9] and [-1.1]
    rewards = torch.tensor([[-0.1, 0.9], [-1.1, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    assert algo.reinforce_pp_advantages(rewards, mask, 1.0, whiten=False).flatten().tolist() == pytest.approx([0.8, 0.9, -1.1, 0.0])
    adv = algo.reinforce_pp_advantages(rewards, mask, 1.0)
    g = [0.8, 0.9, -1.1]
    mean = sum(g) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in g) / 2)
    assert adv.flatten().tolist() == pytest.approx([(0.8 - mean) / std, (0.9 - mean) / std, (-1.1 - mean) / std, 0.0], abs=1e-4)


def test_global_whitening_over_two_processes_equals_one_batch():
    torch.manual_seed(0)
    values = torch.randn(6, 5) * 3 + 10
    mask = torch.arange(5).unsqueeze(0) < torch.tensor([5, 2, 4, 1, 3, 5]).unsqueeze(1)
    whole = algo.whiten_over_batch(values, mask)
    assert torch.allclose(whole, algo.masked_whiten(values, mask), atol=1e-5)
    first, second = _two_processes(algo.whiten_over_batch, (values[:2], mask[:2]), (values[2:], mask[2:]))
    assert torch.allclose(torch.cat([first, second]), whole, atol=1e-5)
    # each half alone would not be whitened over the batch
    assert not torch.allclose(algo.whiten_over_batch(values[:2], mask[:2]), whole[:2], atol=1e-2)


def test_remax_by_hand():
    mask = torch.tensor([[True, True, False], [True, True, True]])
    scores_only = torch.tensor([[0.0, 0.7, 0.0], [0.0, 0.0, 0.2]])
    baseline = torch.tensor([0.5, 0.5])
    # the zeros come from float32 sums of tenths minus the baseline: exact in decimal, a few ulps of 1 in float32
    assert algo.remax_advantages(scores_only, mask, baseline).flatten().tolist() == pytest.approx([0.2, 0.2, 0.0, -0.3, -0.3, -0.3], abs=1e-6)
    with_kl = torch.tensor([[-0.1, 0.6, 0.0], [-0.1, -0.1, 0.1]])  # the same scores, KL penalty 0.1 per token
    assert algo.remax_advantages(with_kl, mask, baseline).flatten().tolist() == pytest.approx([0.0, 0.1, 0.0, -0.6, -0.5, -0.4], abs=1e-6)


def test_reward_whitening_rewards_length_so_only_gae_may_use_it():
    """Why ppo.whiten_rewards is refused with the critic-free estimators (config.check_combination):
    whitening with the mean kept is r' = r / std + mean (1 - 1 / std) on every real token, so two responses
    with the same return but different lengths no longer have the same return, and no transform of a
    sequence-level baseline (remax's greedy score) can take that back out."""
    # Tokens 3 | 1 -1 3 | -1: mean 1, centred 2 0 -2 2 -2, unbiased variance 16 / 4 = 4, std 2 -> r' = r / 2 + 1 / 2.
    rewards = torch.tensor([[3.0, 0.0, 0.0], [1.0, -1.0, 3.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[True, False, False], [True, True, True], [True, False, False]])
    white = algo.masked_whiten(rewards, mask, shift_mean=False)
    assert white.flatten().tolist() == pytest.approx([2.0, 0, 0, 1.0, 0.0, 2.0, 0.0, 0, 0], abs=1e-6)
    assert algo.sequence_rewards(rewards, mask).tolist() == pytest.approx([3.0, 3.0, -1.0])
    assert algo.sequence_rewards(white, mask).tolist() == pytest.approx([2.0, 3.0, 0.0], abs=1e-6)  # +0.5 per token
    # remax: rows 0 and 1 score exactly what their greedy response (3) scores, so their advantage is 0 ...
    greedy = torch.tensor([3.0, 3.0, -1.0])
    assert algo.remax_advantages(rewards, mask, greedy)[:, 0].tolist() == pytest.approx([0.0, 0.0, 0.0])
    # ... but not once the sampled side is whitened, nor with the baseline whitened as a one-token reward (3 -> 2)
    assert algo.remax_advantages(white, mask, greedy)[:, 0].tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-6)
    assert algo.remax_advantages(white, mask, greedy / 2 + 0.5)[:, 0].tolist() == pytest.approx([0.0, 1.0, 0.0], abs=1e-6)


# --------------------------------------------------------------------------- loss variants


def test_asymmetric_clip_by_hand():
    ratios = torch.tensor([[1.3, 0.7, 1.3, 0.7]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, _, _, clipped, dual = algo.policy_loss_per_token(ratios.log(), torch.zeros(1, 4), adv, cliprange_low=0.2, cliprange_high=0.28)
    # A > 0: max(-1.3, -1.28) = -1.28 (clipped high), max(-0.7, -0.8) = -0.7
    # A < 0: max(1.3, 1.28) = 1.3, max(0.7, 0.8) = 0.8 (clipped low)
    assert loss[0].tolist() == pytest.approx([-1.28, -0.7, 1.3, 0.8])
    assert clipped[0].tolist() == [True, False, False, True] and dual is None


def test_dual_clip_caps_the_loss_of_bad_actions():
    ratios = torch.tensor([[5.0, 2.0, 5.0]])
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    loss, _, _, _, dual = algo.policy_loss_per_token(ratios.log(), torch.zeros(1, 3), adv, 0.2, 0.2, dual_clip_c=3.0)
    # A < 0, ratio 5: max(5, 1.2) = 5 capped at 3; ratio 2: 2 < 3 stays; A > 0: max(-5, -1.2) = -1.2, no dual clip
    assert loss[0].tolist() == pytest.approx([3.0, 2.0, -1.2])
    assert dual[0].tolist() == [True, False, False]
    plain, *_ = algo.policy_loss_per_token(ratios.log(), torch.zeros(1, 3), adv, 0.2, 0.2)
    assert plain[0].tolist() == pytest.approx([5.0, 2.0, -1.2])


def test_loss_aggregations_by_hand():
    per_token = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])  # row 3: dropped
    expected = {
        "token_mean": (1 + 2 + 3) / 3,
        "seq_mean_token_sum": (3 + 3) / 2,
        "seq_mean_token_mean": (1.5 + 3) / 2,
        "seq_mean_token_sum_norm": (3 + 3) / (2 * 4),  # response_length 4, the configured maximum
    }
    for aggregation, value in expected.items():
        norm = algo.loss_normalisers(mask, aggregation, response_length=4)
        assert algo.aggregate(per_token, algo.token_weights(mask, aggregation), norm.policy).item() == pytest.approx(value)
        assert norm.value.item() == 3
    with pytest.raises(ValueError, match="aggregation must be one of"):
        algo.token_weights(mask, "sum")


def _loss_inputs(seed=0, B=6, T=5):
    torch.manual_seed(seed)
    logits = torch.randn(B, T, 7, requires_grad=True)
    values = torch.randn(B, T, requires_grad=True)
    tokens = torch.randint(0, 7, (B, T))
    lengths = torch.tensor([5, 1, 3, 2, 4, 5])[:B]
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    fixed = dict(old_logprobs=torch.randn(B, T) * 0.1 - 2, advantages=torch.randn(B, T), old_values=torch.randn(B, T),
                 returns=torch.randn(B, T), ref_logprobs=torch.randn(B, T) * 0.1 - 2)
    return logits, values, tokens, mask, fixed


def _micro_batch_loss(settings, norm, rows, logits, values, tokens, mask, fixed):
    logprobs, entropy = algo.logprobs_and_entropy(logits[rows], tokens[rows], 0.7, entropy_grad=True)
    return algo.ppo_loss(
        settings, norm, mask[rows], logprobs, fixed["old_logprobs"][rows], fixed["advantages"][rows], entropy,
        values=values[rows], old_values=fixed["old_values"][rows], returns=fixed["returns"][rows], ref_logprobs=fixed["ref_logprobs"][rows],
    )


@pytest.mark.parametrize("aggregation", algo.LOSS_AGGREGATIONS)
def test_a_minibatch_normaliser_makes_the_gradient_independent_of_the_micro_batch_split(aggregation):
    logits, values, tokens, mask, fixed = _loss_inputs()
    settings = algo.LossSettings(cliprange_low=0.2, cliprange_high=0.3, dual_clip_c=3.0, entropy_coef=0.01,
                                 kl_loss_coef=0.1, kl_loss_estimator="k3", aggregation=aggregation)
    norm = algo.loss_normalisers(mask, aggregation, response_length=5)
    whole = _micro_batch_loss(settings, norm, torch.arange(6), logits, values, tokens, mask, fixed).loss
    expected = torch.autograd.grad(whole, [logits, values])
    for split in ([[0, 1, 2], [3, 4, 5]], [[0], [1, 2, 3, 4], [5]]):  # by count, and unevenly (as a token budget would)
        total = sum(_micro_batch_loss(settings, norm, torch.tensor(rows), logits, values, tokens, mask, fixed).loss for rows in split)
        assert total.item() == pytest.approx(whole.item(), abs=1e-6)
        got = torch.autograd.grad(total, [logits, values])
        for a, b in zip(got, expected):  # the split changes only the order of the sums over the tokens
            assert_float32_close(a, b, terms=mask.numel())


def test_ppo_loss_terms_by_hand():
    logits, values, tokens, mask, fixed = _loss_inputs()
    logprobs, entropy = algo.logprobs_and_entropy(logits, tokens, 0.7, entropy_grad=True)
    base = algo.LossSettings()
    norm = algo.loss_normalisers(mask, "token_mean", 5)
    plain = algo.ppo_loss(base, norm, mask, logprobs, fixed["old_logprobs"], fixed["advantages"], entropy,
                          values=values, old_values=fixed["old_values"], returns=fixed["returns"])
    assert plain.kl is None and plain.dual_clipfrac is None
    assert plain.loss.item() == pytest.approx(plain.policy.item() + 0.1 * plain.value.item(), abs=1e-6)
    pg, _ = algo.clipped_policy_loss(logprobs, fixed["old_logprobs"], fixed["advantages"], mask, 0.2)
    assert plain.policy.item() == pytest.approx(pg.item())
    knobs = base._replace(kl_loss_coef=0.5, kl_loss_estimator="k3", entropy_coef=0.02)
    full = algo.ppo_loss(knobs, norm, mask, logprobs, fixed["old_logprobs"], fixed["advantages"], entropy,
                         values=values, old_values=fixed["old_values"], returns=fixed["returns"], ref_logprobs=fixed["ref_logprobs"])
    kl = algo.masked_mean(algo.kl_per_token(logprobs, fixed["ref_logprobs"], "k3"), mask)
    assert full.kl.item() == pytest.approx(kl.item())
    assert full.loss.item() == pytest.approx(plain.loss.item() + 0.5 * kl.item() - 0.02 * full.entropy.item(), abs=1e-6)
    # without a critic there is no value term
    critic_free = algo.ppo_loss(base, norm, mask, logprobs, fixed["old_logprobs"], fixed["advantages"], entropy)
    assert critic_free.value is None and critic_free.loss.item() == pytest.approx(plain.policy.item())


def test_entropy_bonus_has_a_gradient_only_when_asked():
    logits = torch.randn(1, 2, 5, requires_grad=True)
    tokens = torch.zeros(1, 2, dtype=torch.long)
    assert not algo.logprobs_and_entropy(logits, tokens, 1.0)[1].requires_grad
    _, entropy = algo.logprobs_and_entropy(logits, tokens, 1.0, entropy_grad=True)
    entropy.sum().backward()
    assert logits.grad.abs().sum() > 0


def test_kl_loss_gradient_pulls_towards_the_reference():
    logprobs = torch.tensor([[-1.0, -3.0]], requires_grad=True)
    ref = torch.tensor([[-2.0, -2.0]])
    kl = algo.kl_per_token(logprobs, ref, "k3").sum()
    kl.backward()
    # k3 = e^r - 1 - r with r = ref - logp; d/dlogp = 1 - e^r: positive where the policy is above the reference
    assert logprobs.grad[0].tolist() == pytest.approx([1 - math.exp(-1.0), 1 - math.exp(1.0)])


def test_explained_variance_by_hand_and_over_two_processes():
    returns = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    assert algo.explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    assert algo.explained_variance(torch.full_like(returns, 2.5), returns, mask).item() == pytest.approx(0.0, abs=1e-6)
    # residual [0, 0, 0, 1]: Var 0.25 (Bessel); Var(returns) 5/3 -> 1 - 0.15
    values = torch.tensor([[1.0, 2.0], [3.0, 3.0]])
    assert algo.explained_variance(values, returns, mask).item() == pytest.approx(0.85)
    padded = torch.tensor([[True, True], [True, False]])
    assert algo.explained_variance(values, returns, padded).item() == pytest.approx(1.0)  # the miss is on padding
    assert algo.explained_variance(values, torch.ones_like(returns), mask).item() == 0.0  # nothing to explain
    torch.manual_seed(0)
    v, r = torch.randn(5, 4), torch.randn(5, 4)
    m = torch.rand(5, 4) > 0.3
    first, second = _two_processes(algo.explained_variance, (v[:2], r[:2], m[:2]), (v[2:], r[2:], m[2:]))
    assert first.item() == pytest.approx(algo.explained_variance(v, r, m).item(), abs=1e-5) and first.item() == second.item()


def test_values_inside_the_clip_range_never_count_as_clipped():
    # V_old + clamp(V - V_old) differs from V by rounding; such tokens were counted as clipped.
    torch.manual_seed(0)
    old = torch.randn(64, 32) * 3
    values = old + (torch.rand(64, 32) - 0.5) * 0.39  # within 0.2 of the rollout value
    returns = torch.randn(64, 32) * 3
    per_token, clipped = algo.value_loss_per_token(values, old, returns, 0.2)
    assert not clipped.any()
    torch.testing.assert_close(per_token, (values - returns) ** 2, rtol=0, atol=0)
