"""Where ppokit's multi-turn advantages and its importance weights stand next to veRL's and OpenRLHF's
(docs/algorithms.md, "Multi-turn episodes: the gaps between turns" and "Rollout engines and their logprobs"):
the worked examples computed with ppokit's functions, and plain loops of each peer's convention (written
here from their published formulas) on the same tensors."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from ppokit.training import algo

DOCS = Path(__file__).resolve().parents[1] / "docs" / "algorithms.md"

# The docs' example: a turn of two tokens, an observation of two, a turn of one.
MASK = torch.tensor([[True, True, False, False, True]])
VALUES = torch.tensor([[0.5, 0.6, 0.3, 0.3, 0.8]])  # the observation's 0.3 must not matter


# --------------------------------------------------------------------------- the peers' conventions, as plain loops


def gae_gap_not_a_step(rewards, values, mask, gamma, lam):
    """veRL's compute_gae_advantage_return: over a masked position the next value and the running advantage are
    carried unchanged."""
    B, T = rewards.shape
    adv = torch.zeros(B, T)
    for i in range(B):
        next_value, running = 0.0, 0.0
        for t in reversed(range(T)):
            delta = rewards[i, t].item() + gamma * next_value - values[i, t].item()
            candidate = delta + gamma * lam * running
            if mask[i, t]:
                next_value, running = values[i, t].item(), candidate
            adv[i, t] = running
    return adv * mask, (adv + values) * mask


def gae_gap_as_steps(rewards, values, mask, gamma, lam):
    """OpenRLHF's get_advantages_and_returns: values and rewards multiplied by the mask, every column a step."""
    B, T = rewards.shape
    r, v = rewards * mask, values * mask
    adv = torch.zeros(B, T)
    for i in range(B):
        running = 0.0
        for t in reversed(range(T)):
            next_value = v[i, t + 1].item() if t < T - 1 else 0.0
            running = r[i, t].item() + gamma * next_value - v[i, t].item() + gamma * lam * running
            adv[i, t] = running
    return adv, adv + v


def returns_reset_at_gaps(rewards, mask, gamma):
    """veRL's compute_reinforce_plus_plus_outcome_advantage (before its whitening): the running return is reset to 0
    after every masked position."""
    B, T = rewards.shape
    out = torch.zeros(B, T)
    for i in range(B):
        running = 0.0
        for t in reversed(range(T)):
            running = rewards[i, t].item() + gamma * running
            out[i, t] = running
            running *= float(mask[i, t])
    return out


def returns_across_gaps(rewards, mask, gamma):
    """OpenRLHF's get_cumulative_returns: rewards multiplied by the mask, every column a step."""
    B, T = rewards.shape
    out = torch.zeros(B, T)
    for i in range(B):
        running = 0.0
        for t in reversed(range(T)):
            running = rewards[i, t].item() * float(mask[i, t]) + gamma * running
            out[i, t] = running
    return out


# --------------------------------------------------------------------------- the worked examples


def test_gae_example_of_the_docs():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]])
    adv, returns = algo.gae(rewards, VALUES, MASK, 1.0, 0.9)
    assert adv[0].tolist() == pytest.approx([0.442, 0.38, 0.0, 0.0, 0.2], abs=1e-6)
    assert returns[0].tolist() == pytest.approx([0.942, 0.98, 0.0, 0.0, 1.0], abs=1e-6)
    verl_adv, verl_returns = gae_gap_not_a_step(rewards, VALUES, MASK, 1.0, 0.9)
    assert verl_adv[MASK].tolist() == pytest.approx(adv[MASK].tolist(), abs=1e-6)
    orlhf_adv, orlhf_returns = gae_gap_as_steps(rewards, VALUES, MASK, 1.0, 0.9)
    assert orlhf_adv[0].tolist() == pytest.approx([0.27442, 0.1938, 0.882, 0.98, 0.2], abs=1e-6)
    assert orlhf_returns[0, :2].tolist() == pytest.approx([0.77442, 0.7938], abs=1e-6)
    # gamma = lam = 1: the TD errors telescope, and the conventions agree on the trained tokens
    one, _ = algo.gae(rewards, VALUES, MASK, 1.0, 1.0)
    assert gae_gap_as_steps(rewards, VALUES, MASK, 1.0, 1.0)[0][MASK].tolist() == pytest.approx(one[MASK].tolist(), abs=1e-6)


def test_returns_example_of_the_docs():
    rewards = torch.tensor([[0.0, 0.5, 0.0, 0.0, 1.0]])
    assert algo.discounted_returns(rewards, MASK, 0.9)[0].tolist() == pytest.approx([1.26, 1.4, 0, 0, 1.0], abs=1e-6)
    assert returns_reset_at_gaps(rewards, MASK, 0.9)[0][MASK[0]].tolist() == pytest.approx([0.45, 0.5, 1.0], abs=1e-6)
    assert returns_across_gaps(rewards, MASK, 0.9)[0].tolist() == pytest.approx([1.1061, 1.229, 0.81, 0.9, 1.0], abs=1e-6)
    # gamma 1: ppokit = OpenRLHF on the trained tokens, veRL's first turn never sees the final score
    ours = algo.discounted_returns(rewards, MASK, 1.0)[MASK]
    assert ours.tolist() == pytest.approx([1.5, 1.5, 1.0]) == returns_across_gaps(rewards, MASK, 1.0)[MASK].tolist()
    assert returns_reset_at_gaps(rewards, MASK, 1.0)[MASK].tolist() == pytest.approx([0.5, 0.5, 1.0])


def test_the_docs_quote_the_examples_numbers():
    text = DOCS.read_text()
    section = text[text.index("## Multi-turn episodes: the gaps between turns"):text.index("## Rollout engines and their logprobs")]
    for number in ("0.442", "0.38", "0.27442", "0.1938", "0.942", "0.98", "0.77442", "0.7938", "1.26", "1.4", "0.45", "1.229", "1.1061"):
        assert re.search(rf"(?<![\d.]){re.escape(number)}(?![\d])", section), number


def test_gae_over_gaps_equals_verls_convention_on_random_episodes():
    """Random multi-span masks (turns, observations, padding): ppokit's vectorised gae equals the plain loop of
    the gap-is-not-a-step recursion to float32 rounding, and differs from the gap-as-steps one."""
    torch.manual_seed(0)
    B, T = 6, 23
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i in range(B):
        t = int(torch.randint(0, 3, ()))
        while t < T - 2:
            turn, gap = int(torch.randint(1, 5, ())), int(torch.randint(1, 4, ()))
            mask[i, t:t + turn] = True
            t += turn + gap
    rewards, values = torch.randn(B, T), torch.randn(B, T)
    adv, returns = algo.gae(rewards, values, mask, 0.97, 0.9)
    want_adv, want_returns = gae_gap_not_a_step(rewards, values, mask, 0.97, 0.9)
    assert torch.allclose(adv, want_adv, atol=1e-5) and torch.allclose(returns, want_returns, atol=1e-5)
    assert not torch.allclose(adv[mask], gae_gap_as_steps(rewards, values, mask, 0.97, 0.9)[0][mask], atol=1e-2)


# --------------------------------------------------------------------------- importance weights


def test_two_sided_token_weights_by_hand():
    trainer = torch.tensor([[-1.0, -2.0, -0.5, -2.0, 0.0, -3.0]])
    engine = torch.tensor([[-1.0, -4.0, -1.0, -1.0, 0.0, -2.5]])
    # exp(trainer - engine) = 1, e^2 (capped to 5), e^0.5, e^-1 (raised to 0.5), padding 1, e^-0.5 = 0.607
    want = [1.0, 5.0, math.exp(0.5), 0.5, 1.0, math.exp(-0.5)]
    assert algo.truncated_is_weights(trainer, engine, cap=5.0, floor=0.5)[0].tolist() == pytest.approx(want, rel=1e-6)
    one_sided = algo.truncated_is_weights(trainer, engine, cap=5.0)
    assert one_sided[0, 3].item() == pytest.approx(math.exp(-1.0), rel=1e-6)  # floor 0 by default: veRL's


def test_sequence_weights_by_hand_and_by_a_plain_loop():
    mask = torch.tensor([[True, True, False, True], [True, False, False, False], [False] * 4])
    trainer = torch.tensor([[-1.0, -2.0, -9.0, -1.0], [-3.0, 0.0, 0.0, 0.0], [0.0] * 4])
    engine = torch.tensor([[-1.5, -2.25, 0.0, -1.0], [-2.0, 0.0, 0.0, 0.0], [0.0] * 4])
    # row 0: sum over the trained tokens 0.5 + 0.25 + 0 = 0.75 (the untrained -9 does not count): e^0.75 = 2.117
    # row 1: -1 -> e^-1 = 0.368; row 2 (no trained token): 1
    weights = algo.truncated_is_sequence_weights(trainer, engine, mask, cap=2.0)
    assert weights.flatten().tolist() == pytest.approx([2.0] * 4 + [math.exp(-1.0)] * 4 + [1.0] * 4, rel=1e-6)
    floored = algo.truncated_is_sequence_weights(trainer, engine, mask, cap=5.0, floor=0.5)
    assert floored[:, 0].tolist() == pytest.approx([math.exp(0.75), 0.5, 1.0], rel=1e-6)
    assert not algo.truncated_is_sequence_weights(trainer.requires_grad_(), engine, mask, 2.0).requires_grad
    # a plain loop of veRL's definition (exp of the clamped log-ratio sum, then the cap) on random tensors
    torch.manual_seed(1)
    trainer, engine = torch.randn(5, 7) * 3, torch.randn(5, 7) * 3
    mask = torch.rand(5, 7) > 0.4
    got = algo.truncated_is_sequence_weights(trainer, engine, mask, cap=3.0)
    for i in range(5):
        total = sum(trainer[i, t].item() - engine[i, t].item() for t in range(7) if mask[i, t])
        want = min(math.exp(max(-20.0, min(20.0, total))), 3.0)
        assert got[i].tolist() == pytest.approx([want] * 7, rel=1e-5)
    # the log-ratio sum is clamped to +-20 before the exp, as veRL's: e^-20 rather than e^-50
    far = algo.truncated_is_sequence_weights(torch.full((1, 5), -10.0), torch.zeros(1, 5), torch.ones(1, 5, dtype=torch.bool), 2.0)
    assert far[0, 0].item() == pytest.approx(math.exp(-20.0), rel=1e-5)


def test_rollout_is_keys():
    from ppokit.config.schema import ROLLOUT_IS, PPOConfig, PPOHyperparams
    from ppokit.engines.correction import IMPORTANCE_WEIGHTS
    from ppokit.errors import UserError

    assert tuple(IMPORTANCE_WEIGHTS) == ROLLOUT_IS
    base = ["model=m", "reward.functions=[sentiment]"]
    with pytest.raises(UserError, match=r"^ppo\.rollout_is_floor \(0\.5\) bounds the weights of ppo\.rollout_is, which is off"):
        PPOHyperparams(rollout_is_floor=0.5).check_combination()
    with pytest.raises(UserError, match=r"ppo\.rollout_is_floor: value 1\.5 is out of range, it must be in \[0, 1\]"):
        PPOConfig.load(None, base + ["ppo.rollout_is=tis", "ppo.rollout_is_floor=1.5"])
    with pytest.raises(UserError, match=r"ppo\.rollout_is: value 'sequence' is out of range, it must be one of tis, tis_sequence"):
        PPOConfig.load(None, base + ["ppo.rollout_is=sequence"])
    PPOConfig.load(None, base + ["ppo.rollout_is=tis_sequence", "ppo.rollout_is_floor=0.5", "ppo.rollout_is_cap=5"]).validate()


# --------------------------------------------------------------------------- through the trainer


@pytest.mark.parametrize("rollout_is, floor, cap", [("tis", 0.9, 2.0), ("tis_sequence", 0.0, 2.0), ("tis_sequence", 0.5, 1.2)])
def test_the_weights_reaching_the_loss(rollout_is, floor, cap, model_dir, prompts_file, tmp_path, monkeypatch):
    """An engine reporting every logprob 0.25 too high (p_engine > p_trainer): the importance weights that reach the
    policy loss are exp(-0.25) per token raised to the floor (tis), or exp(-0.25 x the response's trained tokens)
    per response, clipped (tis_sequence)."""
    from conftest import tiny_ppo_config
    from test_engines import ONE_STEP, _with_engine

    from ppokit.trainer import PPOTrainer

    seen = []
    loss = algo.ppo_loss

    def recording(settings, normalisers, mask, *args, is_weights=None, **kwargs):
        seen.append((mask.clone(), is_weights.clone()))
        return loss(settings, normalisers, mask, *args, is_weights=is_weights, **kwargs)

    monkeypatch.setattr(algo, "ppo_loss", recording)
    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run", rollout_is=rollout_is, rollout_is_floor=floor,
                             rollout_is_cap=cap, **ONE_STEP)
    _with_engine(PPOTrainer(config, show_progress=False), -0.25).step()
    assert seen
    for mask, weights in seen:
        for row, weight in zip(mask, weights):
            if rollout_is == "tis":
                want = torch.full((int(row.sum()),), max(math.exp(-0.25), floor))
            else:
                want = torch.full((int(row.sum()),), min(max(math.exp(-0.25 * int(row.sum())), floor), cap))
            assert torch.allclose(weight[row], want, rtol=1e-5), (weight[row], want)
