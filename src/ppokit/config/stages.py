"""The configs of the supervised stages and the pipeline (`ppokit sft`, `ppokit rm`, `ppokit pipeline`): each section a
dataclass, each key with its help text and range check, as `ppokit.config.schema` declares `ppokit ppo`'s."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from ppokit.config.fields import ConfigFile, doc, one_of, validate
from ppokit.config.schema import DATA_FORMATS, TRL_STAGE_NAMES, a_path, fraction, non_negative, positive, seed_range
from ppokit.errors import UserError


@dataclass
class StageDataConfig:
    """The `data:` section of `ppokit sft` and `ppokit rm`."""

    train: Optional[str] = doc(None, "Training data: a .jsonl/.json/.csv/.parquet file, a datasets.save_to_disk folder (`folder:split` picks a split) or a hub "
                                     "dataset name (`name`, `name:split`, `name@config:split`). See docs/data.md.")
    eval: Optional[str] = doc(None, "Held-out data in the same forms as `train`; when set, `eval_fraction` is not used.")
    eval_fraction: float = doc(0.05, "When `eval` is not set: share of the training rows held out for evaluation (a seeded shuffle, at least one row); 0: no "
                                     "evaluation.", check=fraction)
    format: str = doc("auto", "Row format: "
                              "auto (detected from the columns), prompt_completion, messages, alpaca (sft) or preference (rm).", check=one_of(DATA_FORMATS))
    chat_template: Optional[str] = doc(None, "Template for chat rows: null/auto (the tokenizer's, else the plain fallback `role: content` lines), plain, "
                                             "tokenizer, a .jinja file or Jinja text. The output's config.yaml records the template used, and the saved "
                                             "tokenizer carries it.")
    max_prompt_length: Optional[int] = doc(256, "Prompts longer than this (tokens) keep their last max_prompt_length tokens (truncated from the left); the "
                                                "count is reported. null: no limit.", check=positive)
    max_length: Optional[int] = doc(512, "Limit on prompt + completion tokens (EOS included): longer completions are cut on the right; a row whose prompt "
                                         "leaves no room for a completion token is dropped; counts are reported. null: no limit.", check=positive)


@dataclass
class SupervisedHyperparams:
    """The `train:` section of `ppokit rm` (and, with `completion_only_loss`, of `ppokit sft`)."""

    num_train_epochs: float = doc(1.0, "Passes over the training rows (fractions allowed).", check=positive)
    per_device_train_batch_size: int = doc(8, "Rows per optimiser step (for rm: preference pairs, so twice as many sequences).", check=positive)
    learning_rate: float = doc(2e-5, "Peak learning rate of AdamW, decayed linearly to 0.", check=positive)
    weight_decay: float = doc(0.0, "AdamW weight decay.", check=non_negative)
    max_grad_norm: float = doc(1.0, "Gradient clipping norm; 0 disables.", check=non_negative)
    eval_steps: int = doc(0, "Evaluate every this many optimiser steps; 0: only at the end.", check=non_negative)
    logging_steps: int = doc(10, "Print a line every this many steps (metrics.jsonl gets every step).", check=positive)
    eval_batch_size: int = doc(32, "Rows per forward pass during evaluation.", check=positive)


@dataclass
class SFTHyperparams(SupervisedHyperparams):
    """The `train:` section of `ppokit sft`."""

    completion_only_loss: bool = doc(True, "Loss on completion tokens only (prompt tokens masked); false trains on the prompt too.")


def _stage_config(name: str, command: str, *, model: str, output_dir: tuple[str, str], seed: str, data: str,
                  train: type, what: str) -> type:
    """The config class of a supervised stage (`ppokit sft`, `ppokit rm`): the same keys in the same order,
    each with the stage's own help text where they differ. `what`: the model, named when `model` is missing."""

    def check(self):
        validate(self)
        if not self.model:
            raise UserError(f"model: required (the {what})")
        if not self.data.train:
            raise UserError("data.train: required (a data file, a save_to_disk folder or a hub dataset name)")
        return self

    fields = [
        ("model", Optional[str], doc(None, model)),
        ("tokenizer", Optional[str], doc(None, "Tokenizer path or id; default the one saved with `model`. Without a pad token, EOS pads.")),
        ("trust_remote_code", bool, doc(False, "Allow model repositories to run their own Python code.")),
        ("output_dir", str, doc(output_dir[0], output_dir[1], check=a_path)),
        ("seed", int, doc(42, seed, check=seed_range)),
        ("data", StageDataConfig, doc(factory=StageDataConfig, help=data)),
        ("train", train, doc(factory=train, help="Optimisation.")),
    ]
    namespace = {"__doc__": f"Everything `ppokit {command}` needs.", "__module__": __name__, "OTHER_NAMES": TRL_STAGE_NAMES,
                 "validate": check}
    return dataclasses.make_dataclass(name, fields, bases=(ConfigFile,), namespace=namespace)


SFTConfig = _stage_config(
    "SFTConfig", "sft", model="Causal LM to fine-tune (local path or hub id).",
    output_dir=("runs/sft", "Where the model, tokenizer, config.yaml, metrics.jsonl and summary.json go; written to a temporary folder and renamed into place "
                            "when complete."),
    seed="Seed for the eval split, data order and initialisation.", data="Training data.", train=SFTHyperparams,
    what="causal LM to fine-tune",
)
RMConfig = _stage_config(
    "RMConfig", "rm", model="Model to start from: usually the SFT model (a causal LM: its backbone gets a new one-label score head), or a reward model to "
                            "train further.",
    output_dir=("runs/rm", "Where the reward model (usable as ppo `reward.model` and `value_model`), tokenizer, config.yaml, metrics.jsonl and summary.json "
                           "go; written to a temporary folder and renamed into place when complete."),
    seed="Seed for the eval split, data order and the score head's initialisation.", data="Preference data.", train=SupervisedHyperparams,
    what="model to start from, usually the SFT output",
)


@dataclass
class PipelineConfig(ConfigFile):
    """`ppokit pipeline`: sections sft, rm and ppo, each the config of that stage."""

    output_dir: str = doc("runs/pipeline", "A stage without its own output_dir writes to <output_dir>/<stage>.", check=a_path)
    sft: Optional[dict] = doc(None, "The `ppokit sft` config (same keys). Its output is rm's `model` and ppo's `model` unless they are set.")
    rm: Optional[dict] = doc(None, "The `ppokit rm` config. Its output is ppo's `reward.model` and `value_model` unless they are set.")
    ppo: Optional[dict] = doc(None, "The `ppokit ppo` config.")

    def validate(self) -> "PipelineConfig":
        validate(self)
        if not (self.sft or self.rm or self.ppo):
            raise UserError("pipeline: no stages; add sft:, rm: and/or ppo: sections")
        return self
