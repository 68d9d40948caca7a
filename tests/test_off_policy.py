"""Off-policy rollouts (rollout.max_staleness): the decoupled PPO loss by hand, by a plain loop and as the trainer's loss;
the sampling schedule and its bound; the metrics; the config's refusals. The runs themselves (a vLLM engine beside the
trainer, an exact resume) are in tests/test_engine_vllm_servers.py."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from ppokit.training import algo, sampler
from ppokit.training.episodes import Episodes


def test_decoupled_loss_by_hand():
    """One token, A = 1: pi = 0.6, pi_prox = 0.5, pi_behav = 0.25 -> r = 1.2 (within clip 0.3), w = min(2, 2) = 2, l = -2.4.
    A = -1, pi = 0.8: r = 1.6, clipped at 1.3: l = max(1.6, 1.3) = 1.6, times w = 2 -> 3.2."""
    lp, prox, behav = torch.log(torch.tensor([[0.6, 0.8]])), torch.log(torch.tensor([[0.5, 0.5]])), torch.log(torch.tensor([[0.25, 0.25]]))
    loss, weights = algo.decoupled_policy_loss(lp, prox, behav, torch.tensor([[1.0, -1.0]]), 0.3, 0.3, cap=3.0)
    assert weights[0].tolist() == pytest.approx([2.0, 2.0], rel=1e-6)
    assert loss[0].tolist() == pytest.approx([-2.4, 3.2], rel=1e-5)
    # A = 1 and r = 1.6 over the clip: the clipped 1.3; the weight capped at 1.5
    loss, weights = algo.decoupled_policy_loss(torch.log(torch.tensor([[0.8]])), prox[:, :1], behav[:, :1], torch.tensor([[1.0]]), 0.3, 0.3, cap=1.5)
    assert weights.item() == 1.5 and loss.item() == pytest.approx(-1.3 * 1.5, rel=1e-6)


def test_decoupled_loss_against_a_plain_loop():
    torch.manual_seed(0)
    B, T, lo, hi, cap, floor = 3, 5, 0.2, 0.28, 2.0, 0.5
    lp, prox, behav, adv = (torch.randn(B, T) * 0.3 - 1 for _ in range(3)), None, None, None
    lp, prox, behav = list(lp)
    adv = torch.randn(B, T)
    loss, weights = algo.decoupled_policy_loss(lp, prox, behav, adv, lo, hi, cap, floor)
    for i in range(B):
        for t in range(T):
            r = math.exp(lp[i, t].item() - prox[i, t].item())
            w = min(max(math.exp(prox[i, t].item() - behav[i, t].item()), floor), cap)
            a = adv[i, t].item()
            want = w * max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))
            assert weights[i, t].item() == pytest.approx(w, rel=1e-5)
            assert loss[i, t].item() == pytest.approx(want, rel=1e-4, abs=1e-6)


def test_decoupled_loss_on_policy_is_ppo_and_its_gradient_flows_through_the_current_policy_only():
    torch.manual_seed(1)
    lp = (torch.randn(2, 4) * 0.1 - 1).requires_grad_()
    old, adv = torch.randn(2, 4) * 0.1 - 1, torch.randn(2, 4)
    on_policy, weights = algo.decoupled_policy_loss(lp, old, old, adv, 0.2, 0.2, cap=2.0)
    assert torch.equal(weights, torch.ones_like(weights))
    assert torch.equal(on_policy, algo.policy_loss_per_token(lp, old, adv, 0.2, 0.2)[0])
    on_policy.sum().backward()
    assert lp.grad is not None and lp.grad.abs().sum() > 0


def test_the_trainers_loss_is_the_decoupled_loss():
    """What the trainer computes for stale episodes (the ratio against its recomputed logprobs, `ppo.rollout_is`'s
    weights from them and the engine's: `engines.correction`, `algo.ppo_loss`) is `decoupled_policy_loss`, aggregated."""
    from ppokit.engines.correction import use_trainer_logprobs

    torch.manual_seed(2)
    B, T = 4, 6
    mask = torch.rand(B, T) > 0.2
    behaviour, proximal = torch.randn(B, T) * 0.5 - 2, torch.randn(B, T) * 0.5 - 2
    lp, adv = (proximal + torch.randn(B, T) * 0.1).requires_grad_(), torch.randn(B, T)
    episodes = Episodes(query_ids=torch.zeros(B, 1, dtype=torch.long), response_ids=torch.zeros(B, T, dtype=torch.long),
                        attention_mask=torch.ones(B, T + 1, dtype=torch.bool), loss_mask=mask, logprobs=behaviour.clone(),
                        ended=torch.ones(B, dtype=torch.bool), score_index=torch.zeros(B, dtype=torch.long))
    use_trainer_logprobs(episodes, proximal, "tis", 2.0, lambda x: x)
    settings = algo.LossSettings(cliprange_low=0.2, cliprange_high=0.28)
    norm = algo.loss_normalisers(mask, "token_mean", T)
    terms = algo.ppo_loss(settings, norm, mask, lp, episodes.logprobs, adv, torch.zeros(B, T), is_weights=episodes.rollout_is_weights)
    per_token, _ = algo.decoupled_policy_loss(lp, proximal, behaviour, adv, 0.2, 0.28, cap=2.0)
    want = algo.aggregate(per_token, algo.token_weights(mask, "token_mean"), norm.policy)
    assert torch.equal(episodes.logprobs, proximal)  # the PPO ratio's old logprobs are the proximal policy's
    assert terms.policy.item() == pytest.approx(want.item(), rel=1e-6)


@pytest.mark.parametrize("k, save_steps, want", [
    (0, 0, [0, 1, 2, 3, 4, 5, 6]),
    (1, 0, [0, 0, 1, 2, 3, 4, 5]),
    (2, 0, [0, 0, 0, 1, 2, 3, 4]),
    (1, 3, [0, 0, 1, 3, 3, 4, 6]),  # checkpoints after updates 3 and 6: nothing sampled ahead across them
    (2, 2, [0, 0, 2, 2, 4, 4, 6]),
])
def test_the_sampling_schedule(k, save_steps, want):
    got = [sampler.sampling_version(u, k, save_steps) for u in range(7)]
    assert got == want
    assert all(0 <= u - v <= k for u, v in enumerate(got))


def test_staleness_metrics_and_the_bound():
    assert sampler.staleness_metrics(5, torch.tensor([4, 4, 3, 5]), 2) == {"rollout/staleness_mean": 1.0, "rollout/staleness_max": 2.0}
    with pytest.raises(RuntimeError, match=r"update 6: episodes sampled with weight versions \[2, 4\], outside \[3, 5\]"):
        sampler.staleness_metrics(5, torch.tensor([4, 2]), 2)
    with pytest.raises(RuntimeError, match="outside"):
        sampler.staleness_metrics(5, torch.tensor([6]), 2)


class RecordingEngine:
    """A stand-in for an engine beside the trainer: records the order of pushes and of sampling (which version each
    batch saw), and refuses a push while a batch is being sampled (as `VLLMServersEngine` does)."""

    pad_token_id, device = 0, torch.device("cpu")

    def __init__(self, sample_seconds=0.0):
        self.version, self.sampling, self.events, self.sample_seconds = 0, 0, [], sample_seconds
        self.lock = threading.Lock()

    def sync_weights(self, policy):
        with self.lock:
            if self.sampling:
                raise RuntimeError("weights pushed while requests are in flight")
            self.version += 1
            self.events.append(("push", self.version))

    def release(self):
        pass

    def resume(self):
        pass

    def sample(self, update, engine):
        with self.lock:
            self.sampling += 1
            seen = self.version
        time.sleep(self.sample_seconds)
        with self.lock:
            self.sampling -= 1
            self.events.append(("sampled", update, seen))
        return Episodes(query_ids=torch.zeros(2, 1, dtype=torch.long), response_ids=torch.full((2, 1), update),
                        attention_mask=torch.ones(2, 2, dtype=torch.bool), loss_mask=torch.ones(2, 1, dtype=torch.bool),
                        logprobs=torch.zeros(2, 1), ended=torch.ones(2, dtype=torch.bool), score_index=torch.zeros(2, dtype=torch.long))


class RecordingRollout:
    """The rollout a sampler holds: samples with its engine (a batch sampled ahead: with the `SeededEngine` over it)."""

    def __init__(self, engine):
        self.engine = engine

    def over(self, engine):
        return RecordingRollout(engine)


class RecordingPrompts:
    process = 0

    def sample(self, rollout, update):
        return rollout.engine.sample(update, rollout.engine)


def run_schedule(k, save_steps, updates, start=0, sample_seconds=0.0, train_seconds=0.0):
    engine = RecordingEngine(sample_seconds)
    engine.version = start
    ahead = sampler.build(RecordingRollout(engine), RecordingPrompts(), max_staleness=k, save_steps=save_steps, seed=0)
    records = []
    try:
        for update in range(start, updates):
            episodes, metrics = ahead.episodes(update, updates)
            assert episodes.response_ids[0, 0].item() == update  # the update's own batch
            with ahead.training(None):
                time.sleep(train_seconds)
            version = None if episodes.weight_version is None else episodes.weight_version.tolist()
            records.append({"update": update, "version": version, **metrics})
    finally:
        ahead.close()
    return engine, records


@pytest.mark.parametrize("k, save_steps", [(1, 0), (2, 0), (1, 3), (2, 2)])
def test_each_batch_is_sampled_by_the_version_of_the_schedule_and_tagged_with_it(k, save_steps):
    engine, records = run_schedule(k, save_steps, 7)
    want = [sampler.sampling_version(u, k, save_steps) for u in range(7)]
    seen = {update: version for kind, *rest in engine.events if kind == "sampled" for update, version in [rest]}
    assert [seen[u] for u in range(7)] == want  # what the engine held when the batch was sampled
    assert [r["version"] for r in records] == [[v, v] for v in want]  # what the episodes carry
    assert [r["rollout/staleness_max"] for r in records] == [u - v for u, v in enumerate(want)]


def test_a_resumed_schedule_samples_what_the_straight_one_did_after_a_checkpoint():
    _, straight = run_schedule(1, 3, 7)
    engine, resumed = run_schedule(1, 3, 7, start=3)  # resumed from the checkpoint after update 3: the engine holds version 3
    assert [r["version"] for r in resumed] == [r["version"] for r in straight[3:]]


def test_sampling_overlaps_training_and_is_measured():
    """k = 1 with sampling and training of 0.3 s each: the next batch is sampled while the update trains, and the
    overlap is most of the training time (a bound that holds on a slow machine: the sleeps overlap whatever the load)."""
    _, records = run_schedule(1, 0, 4, sample_seconds=0.3, train_seconds=0.3)
    assert all(r["time/overlap"] > 0.15 for r in records[:-1]), records
    assert records[-1]["time/overlap"] == 0.0  # nothing left to sample during the last update


def test_the_overlap_counts_from_when_the_episodes_were_ready_not_when_the_trainer_woke(monkeypatch):
    """A trainer thread scheduled 0.5 s after its episodes were ready (a loaded machine; seen in CI beside a vLLM server):
    the next batch (0.2 s) was sampled whole in that time, which is still this update's overlap, not 0."""
    from concurrent.futures import Future

    taken = Future.result

    def taken_late(future, timeout=None):
        result = taken(future, timeout)
        if threading.current_thread() is threading.main_thread():
            time.sleep(0.5)
        return result

    monkeypatch.setattr(Future, "result", taken_late)
    _, records = run_schedule(1, 0, 3, sample_seconds=0.2)
    assert all(r["time/overlap"] > 0.15 for r in records[:-1]), records
    assert records[-1]["time/overlap"] == 0.0
    # the wait is until the episodes were ready: the first batch's sampling, not the late wake after it
    assert records[0]["time/generation_wait"] < 0.45, records


def test_the_on_policy_sampler_adds_nothing():
    engine, records = run_schedule(0, 0, 3)
    assert [(kind, *rest) for kind, *rest in engine.events] == [("sampled", 0, 0), ("push", 1), ("sampled", 1, 1), ("push", 2),
                                                                 ("sampled", 2, 2), ("push", 3)]
    assert records == [{"update": u, "version": None} for u in range(3)]  # no tag, no metrics: today's records


def config_with(**rollout):
    from ppokit.config.schema import PPOConfig

    config = PPOConfig()
    config.model, config.reward.functions = "x", ["sentiment"]
    for key, value in rollout.items():
        setattr(config.rollout, key, value)
    return config


@pytest.mark.parametrize("rollout, said", [
    ({}, "rollout.engine hf;"),
    ({"engine": "vllm"}, "rollout.engine vllm with rollout.placement colocated;"),
])
def test_max_staleness_needs_an_engine_beside_the_trainer(rollout, said):
    from ppokit.errors import UserError

    with pytest.raises(UserError) as error:
        config_with(max_staleness=1, **rollout).validate()
    assert str(error.value) == ("rollout.max_staleness: 1 samples while the trainer trains, which needs an engine outside the trainer's "
                                f"process (rollout.engine: vllm with rollout.placement: separate or servers), and this run's is {said} "
                                "set rollout.max_staleness: 0, or rollout.placement")


def test_max_staleness_needs_the_behaviour_correction_and_no_greedy_baseline():
    from ppokit.errors import UserError

    config = config_with(max_staleness=2, engine="vllm", placement="separate")
    with pytest.raises(UserError, match=r"rollout.max_staleness: 2 trains on episodes sampled by older weights, .* set ppo.rollout_is: tis"):
        config.validate()
    config.ppo.rollout_is = "tis"
    config.validate()
    config.ppo.advantage_estimator = "remax"
    with pytest.raises(UserError, match="ppo.advantage_estimator remax samples a greedy baseline"):
        config.validate()
