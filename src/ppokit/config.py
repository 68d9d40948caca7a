"""The configuration tree: dataclasses, YAML loading, `a.b=value` overrides, validation.

Every field carries its documentation in `metadata["help"]`; `docs/config.md` is generated
from it (`python -m ppokit.config > docs/config.md`). Names in `PPOHyperparams` follow TRL's
PPOConfig, and so do the defaults unless the help text says why they differ.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Optional

import yaml

from ppokit.errors import UserError


def doc(default: Any = None, help: str = "", *, factory: Any = None, check: Any = None):
    """A dataclass field with its help text and an optional range check `check(value) -> bool`."""
    metadata = {"help": help, "check": check}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


positive = lambda v: v > 0  # noqa: E731
non_negative = lambda v: v >= 0  # noqa: E731
unit_interval = lambda v: 0 <= v <= 1  # noqa: E731


@dataclass
class PPOHyperparams:
    """The `ppo:` section. Names and defaults follow TRL's PPOConfig."""

    total_episodes: Optional[int] = doc(None, "Prompts to sample over the whole run (episodes). Default: `num_train_epochs` passes over the training prompts, rounded down to a whole number of batches. Must be a multiple of the batch size.", check=positive)
    num_train_epochs: int = doc(1, "Passes over the training prompts when `total_episodes` is not set.", check=positive)
    per_device_train_batch_size: int = doc(8, "Micro-batch size of one forward/backward pass on one device.", check=positive)
    gradient_accumulation_steps: int = doc(1, "Micro-batches accumulated per optimiser step.", check=positive)
    num_mini_batches: int = doc(1, "Minibatches (optimiser steps) per PPO epoch. Rollout batch per device = per_device_train_batch_size x gradient_accumulation_steps x num_mini_batches.", check=positive)
    num_ppo_epochs: int = doc(4, "Passes of PPO optimisation over each rollout batch.", check=positive)
    local_rollout_forward_batch_size: int = doc(64, "Rows per forward pass during sampling and scoring (no gradients).", check=positive)
    response_length: int = doc(53, "Maximum new tokens sampled per prompt.", check=positive)
    temperature: float = doc(0.7, "Sampling temperature; logits are divided by it in every logprob computation.", check=positive)
    stop_token: Optional[str] = doc("eos", "Token that ends a response: `eos` (the tokenizer's EOS), any other string that is one token, or null for none. Tokens after it are padding. Differs from TRL (None) because scoring text after EOS is never wanted.")
    stop_token_id: Optional[int] = doc(None, "Token id that ends a response; overrides `stop_token`.", check=non_negative)
    missing_eos_penalty: Optional[float] = doc(None, "Subtracted from the score of responses that never produced the stop token.")
    kl_coef: float = doc(0.05, "Coefficient of the per-token KL penalty (initial value when `kl_target` is set).", check=non_negative)
    kl_estimator: str = doc("k1", "KL estimator in the reward: k1, k2 or k3 (Schulman, 'Approximating KL Divergence').", check=lambda v: v in ("k1", "k2", "k3"))
    kl_target: Optional[float] = doc(None, "Target KL per sequence for the adaptive controller (Ziegler et al. 2019); null keeps `kl_coef` fixed.", check=positive)
    kl_horizon: float = doc(10000, "Horizon (episodes) of the adaptive KL controller.", check=positive)
    cliprange: float = doc(0.2, "Clip range of the policy ratio.", check=positive)
    cliprange_value: float = doc(0.2, "Clip range of the value prediction around its rollout value.", check=positive)
    vf_coef: float = doc(0.1, "Weight of the value loss in the total loss.", check=non_negative)
    gamma: float = doc(1.0, "Discount factor.", check=unit_interval)
    lam: float = doc(0.95, "GAE lambda.", check=unit_interval)
    whiten_rewards: bool = doc(False, "Whiten per-token rewards (variance only, mean kept) before GAE.")
    whiten_advantages: bool = doc(True, "Whiten advantages over real tokens (as TRL always does).")
    learning_rate: float = doc(3e-6, "Peak learning rate of AdamW (policy and value).", check=positive)
    adam_epsilon: float = doc(1e-5, "AdamW epsilon. Differs from transformers' 1e-8: 1e-5 as in 'The N+ Implementation Details of RLHF with PPO'.", check=positive)
    weight_decay: float = doc(0.0, "AdamW weight decay.", check=non_negative)
    max_grad_norm: float = doc(1.0, "Gradient clipping norm (policy and value together); 0 disables.", check=non_negative)
    lr_scheduler_type: str = doc("linear", "Learning-rate schedule over all optimiser steps: linear (decay to 0) or constant.", check=lambda v: v in ("linear", "constant"))
    warmup_steps: int = doc(0, "Optimiser steps of linear warm-up.", check=non_negative)
    logging_steps: int = doc(1, "Print a line every this many updates (metrics.jsonl gets every update).", check=positive)
    save_steps: int = doc(0, "Write a checkpoint every this many updates; 0 saves only at the end.", check=non_negative)
    num_sample_generations: int = doc(10, "How many times over the run to write sample completions to samples.jsonl (and eval scores); 0 disables.", check=non_negative)
    num_eval_samples: int = doc(8, "Prompts (from data.eval, else the current batch) in each sample generation.", check=positive)
    save_total_limit: Optional[int] = doc(None, "Keep only the newest this many complete checkpoints in output_dir/checkpoints (older ones are deleted after each save; the newest complete one never is). null keeps all.", check=positive)
    max_skipped_updates: int = doc(3, "An update with a non-finite score, loss or gradient is rolled back and skipped (counted in `skipped_updates`); after this many in a row the run writes a checkpoint and stops with an error naming the quantity.", check=positive)
    nonfinite_rollback: bool = doc(True, "Undo the optimiser steps a skipped update already took, from a copy of the trainable weights and optimiser state made at the start of every update (CPU memory, about 3x the trainable weights). false: keep them and skip only the rest of the update (for full fine-tunes too large to copy).")

    def derive(self, world_size: int, num_prompts: int) -> "BatchSizes":
        """Batch arithmetic, as TRL does it; raises UserError on inexact division."""
        local_batch = self.per_device_train_batch_size * self.gradient_accumulation_steps * self.num_mini_batches
        batch = local_batch * world_size
        local_mini = local_batch // self.num_mini_batches
        if self.total_episodes is None:
            total = (self.num_train_epochs * num_prompts) // batch * batch
            if total == 0:
                raise UserError(
                    f"ppo.total_episodes: {num_prompts} training prompts x {self.num_train_epochs} epoch(s) "
                    f"is less than one batch of {batch}; add prompts or lower the batch size"
                )
        else:
            total = self.total_episodes
            if total % batch:
                raise UserError(
                    f"ppo.total_episodes ({total}) is not a multiple of the batch size ({batch} = "
                    f"per_device_train_batch_size {self.per_device_train_batch_size} x gradient_accumulation_steps "
                    f"{self.gradient_accumulation_steps} x num_mini_batches {self.num_mini_batches} x processes {world_size})"
                )
        return BatchSizes(
            micro_batch=self.per_device_train_batch_size,
            local_batch=local_batch,
            batch=batch,
            local_mini_batch=local_mini,
            total_episodes=total,
            num_updates=total // batch,
        )


class BatchSizes(NamedTuple):
    """Derived sizes. local_* are per process; batch is the global rollout batch of one update."""

    micro_batch: int
    local_batch: int
    batch: int
    local_mini_batch: int
    total_episodes: int
    num_updates: int


@dataclass
class RewardConfig:
    """The `reward:` section: where scores come from. At least one source is required."""

    model: Optional[str] = doc(None, "Sequence-classification reward model (local path or hub id), one label; scored at the last real token.")
    functions: list[str] = doc(factory=list, help="Reward functions: `path/to/file.py:fn`, `package.module:fn` or a built-in name (`sentiment`). Called as fn(prompts, completions, **columns) -> list[float].")
    weights: Optional[list[float]] = doc(None, "One weight per source, reward model first then functions in order; default all 1.")
    batch_size: int = doc(64, "Rows per reward-model forward pass.", check=positive)


@dataclass
class DataConfig:
    """The `data:` section."""

    train: Optional[str] = doc(None, "Training prompts: a JSONL file with a `prompt` field (other fields are passed to reward functions).")
    eval: Optional[str] = doc(None, "Evaluation prompts, same format; completions and scores go to samples.jsonl.")
    prompt_field: str = doc("prompt", "Name of the prompt column.")
    max_prompt_length: Optional[int] = doc(None, "Prompts longer than this (in tokens) are truncated from the left; the count is reported. null: no limit.", check=positive)


@dataclass
class PPOConfig:
    """Everything a PPO run needs. Load with `PPOConfig.load(path, overrides)` or build directly."""

    model: Optional[str] = doc(None, "Policy to start from (local path or hub id), usually an SFT model.")
    ref_model: Optional[str] = doc(None, "Frozen reference policy; default a frozen copy of `model`.")
    value_model: Optional[str] = doc(None, "Value model (sequence-classification path or id); default the policy's backbone with a fresh scalar head, or the reward model's weights if `reward.model` is set.")
    tokenizer: Optional[str] = doc(None, "Tokenizer path or id; default the one saved with `model`.")
    trust_remote_code: bool = doc(False, "Allow model repositories to run their own Python code.")
    output_dir: str = doc("runs/ppo", "Run directory: config.yaml, metrics.jsonl, samples.jsonl, final/.")
    seed: int = doc(42, "Seed for sampling, data order and initialisation; same seed and config give the same metrics.")
    reward: RewardConfig = doc(factory=RewardConfig, help="Reward sources.")
    data: DataConfig = doc(factory=DataConfig, help="Prompt data.")
    ppo: PPOHyperparams = doc(factory=PPOHyperparams, help="PPO hyperparameters.")

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | None = None) -> "PPOConfig":
        return load_config(cls, path, overrides)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    def validate(self) -> "PPOConfig":
        validate(self)
        if not self.model:
            raise UserError("model: required (a path to a saved causal LM or a hub id)")
        if not self.reward.model and not self.reward.functions:
            raise UserError("reward: set at least one source, reward.model or reward.functions")
        n_sources = int(bool(self.reward.model)) + len(self.reward.functions)
        if self.reward.weights is not None and len(self.reward.weights) != n_sources:
            raise UserError(f"reward.weights has {len(self.reward.weights)} entries for {n_sources} reward sources")
        return self


# --------------------------------------------------------------------------- generic machinery


def _unwrap_optional(tp):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert a YAML / command-line value to the field's type, or raise UserError naming the key."""
    inner, optional = _unwrap_optional(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("null", "none", "~")):
        if optional:
            return None
        raise UserError(f"{key}: may not be null")
    if dataclasses.is_dataclass(inner):
        if isinstance(value, inner):
            return value
        if not isinstance(value, dict):
            raise UserError(f"{key}: expected a mapping of {inner.__name__} keys, got {value!r}")
        return build(inner, value, prefix=f"{key}.")
    if inner is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise UserError(f"{key}: expected true or false, got {value!r}")
    if inner is int:
        if isinstance(value, bool):
            raise UserError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, float) and value.is_integer():
            return int(value)
        try:
            return int(str(value))
        except ValueError:
            raise UserError(f"{key}: expected an integer, got {value!r}") from None
    if inner is float:
        if isinstance(value, bool):
            raise UserError(f"{key}: expected a number, got {value!r}")
        try:
            result = float(value)
        except (TypeError, ValueError):
            raise UserError(f"{key}: expected a number, got {value!r}") from None
        if not math.isfinite(result):
            raise UserError(f"{key}: must be finite, got {value!r}")
        return result
    if inner is str:
        if isinstance(value, (dict, list)):
            raise UserError(f"{key}: expected a string, got {value!r}")
        return str(value)
    origin = typing.get_origin(inner)
    if origin is list:
        (item_tp,) = typing.get_args(inner) or (Any,)
        if not isinstance(value, (list, tuple)):
            value = [value]
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or inner is dict:
        if not isinstance(value, dict):
            raise UserError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if inner is Any:
        return value
    # Unions of several kinds (e.g. str | dict) are taken as given.
    return value


def build(cls, data: dict, prefix: str = ""):
    """Build dataclass `cls` from a mapping; unknown keys are an error naming the key."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise UserError(f"unknown config key {prefix}{key}{hint}; known keys here: {', '.join(names)}")
        kwargs[key] = _coerce(value, hints[key], f"{prefix}{key}")
    return cls(**kwargs)


def validate(obj, prefix: str = "") -> None:
    """Run each field's range check (recursively); raise UserError naming the key."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            validate(value, prefix=f"{key}.")
            continue
        check = f.metadata.get("check")
        if check is not None and value is not None and not check(value):
            raise UserError(f"{key}: value {value!r} is out of range ({f.metadata['help']})")


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], value parsed as YAML)."""
    if "=" not in text:
        raise UserError(f"override {text!r}: expected key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise UserError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_override(data: dict, path: list[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise UserError(f"override {'.'.join(path)}: {part} is not a section")
        node = child
    node[path[-1]] = value


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of config keys at the top level")
    return data


def load_config(cls, path: str | Path | None = None, overrides: list[str] | None = None, data: dict | None = None):
    """YAML file (optional) + overrides -> validated config of type `cls`."""
    merged = dict(data or {})
    if path is not None:
        merged.update(read_yaml(path))
    for text in overrides or []:
        apply_override(merged, *parse_override(text))
    config = build(cls, merged)
    if hasattr(config, "validate"):
        config.validate()
    else:
        validate(config)
    return config


def markdown_reference(cls, prefix: str = "") -> str:
    """Markdown table of every key of `cls` with its default and help text."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        inner, _ = _unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(inner):
            lines.append(f"\n### `{prefix}{f.name}`\n\n{f.metadata['help']}\n")
            lines.append(markdown_reference(inner, prefix=f"{prefix}{f.name}."))
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if not lines or not lines[-1].startswith("|"):
            lines.append("| key | default | meaning |\n|---|---|---|")
        lines.append(f"| `{prefix}{f.name}` | `{default!r}` | {f.metadata['help']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print("# Configuration reference\n\nGenerated by `python -m ppokit.config`. Every key can be set in YAML or as `key.sub=value` on the command line.\n")
    print("## `ppokit ppo`\n")
    print(markdown_reference(PPOConfig))
