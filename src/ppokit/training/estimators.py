"""The advantage estimators, each declared once: its advantage function and its traits.

Every reader asks the declaration of `ppo.advantage_estimator` (`ESTIMATORS[name]`, or
`PPOHyperparams.estimator`), never the estimator's name:
  config/schema.py  the key's choices and help text, n >= min_samples_per_prompt, the keys it refuses
  models/roles.py   whether a value model is built (`critic`)
  plan.py           whether the value model costs memory, and whether `value_model: shared` may help
  trainer.py        stage 2 scores a greedy baseline (`greedy_baseline`), stage 5 calls `advantages`
  demos/reviews.py, cli  the demo's --estimator choices and their usual samples per prompt
  run/model_card.py its doc line (`description`: grpo's by its scaling), and the keys it does not read

Adding an estimator is one `Estimator(...)` in `ESTIMATORS` below, its pure tensor function in
`algo.py` (with hand-worked tests), an adapter here calling it, and its row in docs/algorithms.md.

Reading a config must not import torch, and config/schema.py imports this module: so this module imports
neither torch nor `ppokit.training.algo` at load time. Each adapter imports `ppokit.training.algo` when first called
(a stage-5 call, after the trainer has imported torch anyway).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    import torch

# ppo keys read only by the value model: a critic-free estimator refuses them set away from their defaults.
VALUE_MODEL_KEYS = ("vf_learning_rate", "critic_warmup_updates", "vf_coef", "cliprange_value", "lam")

# grpo's division by a standard deviation (ppo.grpo_scale_std): each value the key takes -> what it divides by.
# true/false are ppokit's own; group/batch/none TRL's `scale_rewards` spellings.
GRPO_STD_SCALINGS = {True: "group", "group": "group", "batch": "batch", False: "none", "none": "none"}


def grpo_std_scaling(value: Any) -> str:
    """ppo.grpo_scale_std -> "group" (the group's std), "batch" (the whole batch's) or "none" (Dr. GRPO)."""
    return GRPO_STD_SCALINGS[value]


# What grpo computes under each scaling (the model card's line; "group" is the estimator's own doc).
GRPO_SCALING_DOCS = {
    "batch": "GRPO with the batch's scale (Lite PPO): each reward less its group's mean, divided by the standard deviation of "
             "the whole batch's rewards, no value model",
    "none": "Dr. GRPO: each reward less the mean of its prompt's group of samples, not divided by a standard deviation, no value model",
}


def description(name: str, grpo_scale_std: Any = True) -> str:
    """One phrase saying what estimator `name` computes with these settings (grpo: by ppo.grpo_scale_std)."""
    if name == "grpo":
        return GRPO_SCALING_DOCS.get(grpo_std_scaling(grpo_scale_std), ESTIMATORS[name].doc)
    return ESTIMATORS[name].doc


@dataclass(frozen=True)
class AdvantageInputs:
    """What stage 5 hands every estimator; each reads the part it declares.

    rewards: (B, T) per-token rewards from `algo.shape_rewards`; mask: (B, T) bool, the tokens that
    get advantages; values: (B, T) the critic's values (estimators with `critic`); baseline_scores:
    (B,) the greedy response's score (estimators with `greedy_baseline`); group_size: n, the samples
    of a prompt in adjacent rows; all_reduce: sums a tensor over processes (None: one process).
    """

    rewards: "torch.Tensor"
    mask: "torch.Tensor"
    values: Optional["torch.Tensor"] = None
    gamma: float = 1.0
    lam: float = 0.95
    whiten: bool = True
    group_size: int = 1
    grpo_scale_std: Any = True  # ppo.grpo_scale_std, any key of GRPO_STD_SCALINGS
    baseline_scores: Optional["torch.Tensor"] = None
    all_reduce: Optional[Callable[["torch.Tensor"], "torch.Tensor"]] = None


Advantages = tuple["torch.Tensor", Optional["torch.Tensor"]]  # (advantages (B, T), returns (B, T) or None); padding 0


@dataclass(frozen=True)
class Estimator:
    """One advantage estimator: its function and the facts every other module asks about it."""

    name: str  # the value of ppo.advantage_estimator
    doc: str  # one phrase: the config key's help text, the model card
    function: Callable[[AdvantageInputs], Advantages]  # the adapter calling its pure function in algo.py
    critic: bool = False  # builds and trains a value model; reads `values`, returns value targets
    min_samples_per_prompt: int = 1  # a baseline from the other samples of a prompt needs n >= 2
    usual_samples_per_prompt: int = 1  # the n the demo runs it with
    greedy_baseline: bool = False  # needs the score of one greedy response per prompt (`baseline_scores`)
    discounts: bool = False  # reads ppo.gamma (otherwise an outcome reward: gamma is refused)
    whitens: bool = False  # reads ppo.whiten_advantages (otherwise `whiten_advantages: false` is refused)
    own_keys: tuple[str, ...] = ()  # ppo keys only this estimator reads: refused with every other one

    def advantages(self, rewards, mask, **inputs: Any) -> Advantages:
        """(advantages (B, T), returns (B, T) with a critic, else None) for `AdvantageInputs(rewards, mask, **inputs)`."""
        x = AdvantageInputs(rewards, mask, **inputs)
        if self.critic and x.values is None:
            raise ValueError(f"the {self.name} estimator needs the critic's values")
        if self.greedy_baseline and x.baseline_scores is None:
            raise ValueError(f"the {self.name} estimator needs the greedy responses' scores")
        return self.function(x)

    def unread_keys(self) -> list[tuple[str, str]]:
        """(ppo key, what reads it) for every estimator-related key this one never reads; set away from its
        default, config.check_combination refuses it."""
        unread = []
        if not self.critic:
            unread += [(k, f"the value model, which ppo.advantage_estimator {self.name} does not build") for k in VALUE_MODEL_KEYS]
        if not self.discounts:
            unread.append(("gamma", f"discounting, which ppo.advantage_estimator {self.name} does not do (an outcome reward)"))
        owners: dict[str, list[str]] = {}
        for other in ESTIMATORS.values():
            for key in other.own_keys:
                owners.setdefault(key, []).append(other.name)
        unread += [(key, f"ppo.advantage_estimator {' or '.join(names)} (this run's is {self.name})")
                   for key, names in owners.items() if key not in self.own_keys]
        return unread


# --------------------------------------------------------------------------- adapters: inputs -> algo's pure functions


def _gae(x: AdvantageInputs) -> Advantages:
    """[GAE] with the critic's values; whitened per process if `whiten` (TRL does so)."""
    from ppokit.training import algo

    adv, returns = algo.gae(x.rewards, x.values, x.mask, x.gamma, x.lam)
    return (algo.masked_whiten(adv, x.mask) if x.whiten else adv), returns


def _per_sequence(x: AdvantageInputs, per_sequence: "torch.Tensor") -> Advantages:
    """An outcome estimator's one advantage per response, on every token of it."""
    return per_sequence.unsqueeze(1) * x.mask.to(x.rewards.dtype), None


def _grpo(x: AdvantageInputs) -> Advantages:
    """[GRPO] / [DrGRPO] on the sequence rewards of each group of `group_size`; with grpo_scale_std: batch, the group's
    mean over the standard deviation of every process's batch [LitePPO]."""
    from ppokit.training import algo

    scores, valid = algo.sequence_rewards(x.rewards, x.mask), x.mask.any(-1)
    scaling = grpo_std_scaling(x.grpo_scale_std)
    if scaling == "batch":
        return _per_sequence(x, algo.grpo_advantages_batch_std(scores, valid, x.group_size, x.all_reduce))
    return _per_sequence(x, algo.grpo_advantages(scores, valid, x.group_size, scaling == "group"))


def _rloo(x: AdvantageInputs) -> Advantages:
    """[RLOO] on the sequence rewards of each group."""
    from ppokit.training import algo

    scores, valid = algo.sequence_rewards(x.rewards, x.mask), x.mask.any(-1)
    return _per_sequence(x, algo.rloo_advantages(scores, valid, x.group_size))


def _reinforce_pp(x: AdvantageInputs) -> Advantages:
    """[RPP] discounted return, whitened over every process if `whiten`."""
    from ppokit.training import algo

    return algo.reinforce_pp_advantages(x.rewards, x.mask, x.gamma, x.whiten, x.all_reduce), None


def _remax(x: AdvantageInputs) -> Advantages:
    """[ReMax] return minus the greedy baseline."""
    from ppokit.training import algo

    return algo.remax_advantages(x.rewards, x.mask, x.baseline_scores), None


# --------------------------------------------------------------------------- the table

ESTIMATORS: dict[str, Estimator] = {e.name: e for e in (
    Estimator("gae", "PPO with a learned value model and GAE", _gae, critic=True, discounts=True, whitens=True),
    Estimator("grpo", "GRPO: rewards normalised within each prompt's group of samples, no value model", _grpo,
              min_samples_per_prompt=2, usual_samples_per_prompt=4, own_keys=("grpo_scale_std",)),
    Estimator("rloo", "RLOO: each sample's baseline is the mean reward of the other samples of its prompt, no value model", _rloo,
              min_samples_per_prompt=2, usual_samples_per_prompt=4),
    Estimator("reinforce_pp", "REINFORCE++: discounted return with the KL in the reward, whitened over the global batch, no value model",
              _reinforce_pp, discounts=True, whitens=True),
    Estimator("remax", "ReMax: the baseline is the reward of one extra greedy response per prompt, no value model", _remax,
              greedy_baseline=True),
)}
