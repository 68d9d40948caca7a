"""The learning-rate schedules and AdamW's betas (`optimise.build_optimiser`) against transformers' and torch's own on the
same steps: after the warm-up each schedule is transformers' of its name, bit for bit; the betas reach AdamW's update."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from ppokit.config.schema import PPOConfig, PPOHyperparams
from ppokit.errors import UserError
from ppokit.training.optimise import PolicyAndValue, build_optimiser

BASE = ["model=some/model", "reward.functions=[sentiment]", "data.train=p.jsonl"]
STEPS = 20


def ppokit_rates(hp: PPOHyperparams, warmup: int, steps: int = STEPS) -> list[float]:
    optimizer, scheduler = build_optimiser(PolicyAndValue(nn.Linear(2, 2), None), hp, steps, warmup)
    return _rates(optimizer, scheduler, steps)


def transformers_rates(kind: str, warmup: int, steps: int = STEPS, **kwargs) -> list[float]:
    import transformers

    optimizer = torch.optim.AdamW(nn.Linear(2, 2).parameters(), lr=1.0)
    make = {"linear": transformers.get_linear_schedule_with_warmup, "cosine": transformers.get_cosine_schedule_with_warmup,
            "cosine_with_min_lr": transformers.get_cosine_with_min_lr_schedule_with_warmup}[kind]
    return _rates(optimizer, make(optimizer, warmup, steps, **kwargs), steps)


def _rates(optimizer, scheduler, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("warmup", [0, 4])
@pytest.mark.parametrize("kind, floor", [("linear", None), ("cosine", None), ("cosine_with_min_lr", 0.1), ("cosine_with_min_lr", 0.0)])
def test_each_schedule_is_transformers_own_after_the_warm_up(kind, floor, warmup):
    """The same float operations as transformers' lambdas: equal, not close. The warm-up is ppokit's (i + 1) / warmup
    (its first step moves the weights, where transformers' step 0 has rate 0), the same for every schedule."""
    hp = PPOHyperparams(learning_rate=1.0, lr_scheduler_type=kind, min_lr_rate=floor)
    ours = ppokit_rates(hp, warmup)
    theirs = transformers_rates(kind, warmup, **({"min_lr_rate": floor} if floor is not None else {}))
    assert ours[warmup:] == theirs[warmup:]
    assert ours[:warmup] == [(i + 1) / warmup for i in range(warmup)]
    if kind == "cosine_with_min_lr":
        assert min(ours[warmup:]) >= floor and ours[-1] < ours[warmup + 1]
    if kind == "cosine":  # not the linear one under another name
        assert ours != ppokit_rates(PPOHyperparams(learning_rate=1.0), warmup)


def test_cosine_with_min_lr_keeps_each_groups_floor_a_share_of_its_own_peak():
    """Policy and critic on the same schedule, each group at min_lr_rate x its own peak at the end (transformers' rate)."""
    hp = PPOHyperparams(learning_rate=1e-5, vf_learning_rate=1e-4, lr_scheduler_type="cosine_with_min_lr", min_lr_rate=0.25)
    model = PolicyAndValue(nn.Linear(2, 2), nn.Linear(2, 1))
    optimizer, scheduler = build_optimiser(model, hp, 1000, 0)
    for _ in range(1000):  # to the end of the run: cos(pi) is -1, the rate the floor
        optimizer.step()
        scheduler.step()
    assert scheduler.get_last_lr() == pytest.approx([0.25e-5, 0.25e-4], rel=1e-12)


def test_adam_betas_reach_adamw_as_torch_takes_them():
    """The betas set are AdamW's: the weights after three steps equal torch.optim.AdamW's with those betas, and differ
    from the default betas'."""

    def trained(make_optimizer) -> torch.Tensor:
        torch.manual_seed(0)
        layer = nn.Linear(3, 2)
        optimizer = make_optimizer(layer)
        for step in range(3):
            optimizer.zero_grad()
            (layer(torch.ones(1, 3) * (step + 1)) ** 2).sum().backward()
            optimizer.step()
        return layer.weight.detach().clone()

    hp = PPOHyperparams(learning_rate=0.1, adam_beta1=0.5, adam_beta2=0.75, adam_epsilon=1e-8, lr_scheduler_type="constant")
    ours = trained(lambda layer: build_optimiser(PolicyAndValue(layer, None), hp, 10, 0)[0])
    torch_own = trained(lambda layer: torch.optim.AdamW(layer.parameters(), lr=0.1, betas=(0.5, 0.75), eps=1e-8, weight_decay=0.0))
    defaults = trained(lambda layer: torch.optim.AdamW(layer.parameters(), lr=0.1, eps=1e-8, weight_decay=0.0))
    # fused and for-each AdamW kernels may round differently: a few float32 ulps of weights of order 1
    assert torch.allclose(ours, torch_own, rtol=0, atol=1e-6)
    assert not torch.allclose(ours, defaults, rtol=0, atol=1e-3)


@pytest.mark.parametrize("overrides, message", [
    (["ppo.lr_scheduler_type=cosine_with_min_lr"], "ppo.lr_scheduler_type cosine_with_min_lr needs ppo.min_lr_rate"),
    (["ppo.lr_scheduler_type=cosine", "ppo.min_lr_rate=0.1"],
     "ppo.min_lr_rate (0.1) is the floor of ppo.lr_scheduler_type cosine_with_min_lr, and this run's schedule is cosine"),
    (["ppo.min_lr_rate=0.1"], "ppo.min_lr_rate (0.1) is the floor of ppo.lr_scheduler_type cosine_with_min_lr, and this run's schedule is linear"),
    (["ppo.lr_scheduler_type=cosine_with_min_lr", "ppo.min_lr_rate=1.5"], "ppo.min_lr_rate: value 1.5 is out of range, it must be in [0, 1]"),
    (["ppo.adam_beta1=1.0"], "ppo.adam_beta1: value 1.0 is out of range, it must be in [0, 1)"),
    (["ppo.adam_beta2=-0.1"], "ppo.adam_beta2: value -0.1 is out of range, it must be in [0, 1)"),
    (["ppo.lr_scheduler_type=cosine_with_restarts"], "ppo.lr_scheduler_type: value 'cosine_with_restarts' is out of range, it must be one of linear, constant, "
                                                     "cosine, cosine_with_min_lr"),
])
def test_schedule_and_beta_refusals(overrides, message):
    with pytest.raises(UserError, match=re.escape(message)):
        PPOConfig.load(None, BASE + overrides)


def test_trls_scheduler_names_are_ppokits():
    config = PPOConfig.load(None, BASE + ["ppo.lr_scheduler_type=cosine_with_min_lr", "ppo.min_lr_rate=0.1", "ppo.adam_beta1=0.85",
                                          "ppo.adam_beta2=0.95"])
    assert (config.ppo.lr_scheduler_type, config.ppo.min_lr_rate, config.ppo.adam_beta1, config.ppo.adam_beta2) == (
        "cosine_with_min_lr", 0.1, 0.85, 0.95)
