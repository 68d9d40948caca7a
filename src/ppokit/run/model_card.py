"""Model cards: a README.md beside every model ppokit saves (a ppo run's final/ and final/merged/, the
sft and rm outputs), in the Hugging Face layout (YAML metadata, then Markdown): what the model was
trained from, on what, against which rewards, with which estimator and settings, how training ended,
and by which ppokit version. The hub reads the metadata (`base_model`, `library_name`, `datasets`);
a reader gets the rest without opening config.yaml.

Plain values in, text out: no torch, no models.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit

import yaml

from ppokit.version import __version__

FILE = "README.md"
# What the card shows of the `ppo:` section (the whole config is the run's config.yaml): those of these keys the run
# read (`PPOHyperparams.unread_keys` says which it did not: the critic's without one, the KL penalty's without
# kl_in_reward, ...) and that are set (not null).
PPO_KEYS = ("learning_rate", "total_episodes", "per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches",
            "num_ppo_epochs", "num_samples_per_prompt", "response_length", "temperature", "grpo_scale_std", "whiten_advantages",
            "kl_coef", "kl_estimator", "kl_target", "kl_in_reward", "kl_loss_coef", "kl_loss_estimator", "kl_clamp", "cliprange",
            "cliprange_low", "cliprange_high", "entropy_coef", "loss_aggregation", "vf_coef", "cliprange_value", "gamma", "lam",
            "vf_learning_rate")
RESULT_PREFIXES = ("objective/", "eval/", "reward/", "teacher/")


@dataclass
class ModelCard:
    """What a README.md says about one saved model."""

    title: str
    location: str  # the folder the card will be in, for the loading example (the model is written under a temporary name)
    summary: str  # one sentence: what this model is and how it was made
    base_model: Optional[str]
    data: dict[str, Optional[str]]  # split -> path or hub dataset name
    training: list[tuple[str, str]]  # rows of the Training table: (what, value)
    hyperparameters: dict[str, Any]  # dotted key -> value as set for the run
    results: dict[str, Any]  # metric -> final value
    results_title: str
    hyperparameters_note: str = ""  # a line under the Hyperparameters table
    task: str = "text-generation"  # the hub's pipeline_tag
    adapter: bool = False  # the folder holds a peft adapter, not full weights
    tags: list[str] = field(default_factory=list)

    def merged(self) -> "ModelCard":
        """The card of final/merged/: the same run, full weights (the adapter merged into the base)."""
        rows = [(what, "the LoRA adapter merged into the base weights") if what == "trained weights" else (what, value)
                for what, value in self.training]
        return dataclasses.replace(self, adapter=False, training=rows, location=str(Path(self.location) / "merged"))

    def write(self, folder: Path) -> None:
        """README.md in `folder` (replacing the one peft writes beside an adapter)."""
        (Path(folder) / FILE).write_text(self.render())

    def render(self) -> str:
        metadata: dict[str, Any] = {}
        if _hub_id(self.base_model):
            metadata["base_model"] = self.base_model
        metadata["library_name"] = "peft" if self.adapter else "transformers"
        metadata["pipeline_tag"] = self.task
        metadata["tags"] = ["ppokit", *self.tags]
        datasets = [d for d in self.data.values() if _hub_id(d)]
        if datasets:
            metadata["datasets"] = [d.split(":")[0].split("@")[0] for d in datasets]
        lines = ["---", yaml.safe_dump(metadata, sort_keys=False).strip(), "---", "", f"# {_text(self.title)}", "",
                 _text(self.summary), "", "## Training", "", "| | |", "|---|---|"]
        lines += [f"| {what} | {value} |" for what, value in self.training]
        lines += ["", "## Hyperparameters", "", "| key | value |", "|---|---|"]
        lines += [f"| `{key}` | {_cell(value)} |" for key, value in self.hyperparameters.items()]
        lines += ["", _text(self.hyperparameters_note)] if self.hyperparameters_note else []
        lines += ["", f"## {self.results_title}", ""]
        if self.results:
            lines += ["| metric | value |", "|---|---|"] + [f"| `{key}` | {_cell(value)} |" for key, value in self.results.items()]
        else:
            lines.append("No metrics were recorded.")
        lines += ["", "## Use", "", "```python", *self._usage(self.location), "```", ""]
        return "\n".join(lines)

    def _usage(self, folder: str) -> list[str]:
        folder = " ".join(folder.split())
        if self.adapter:
            return ["from peft import AutoPeftModelForCausalLM", "from transformers import AutoTokenizer", "",
                    f"model = AutoPeftModelForCausalLM.from_pretrained({folder!r})",
                    f"tokenizer = AutoTokenizer.from_pretrained({folder!r})"]
        auto = "AutoModelForSequenceClassification" if self.task == "text-classification" else "AutoModelForCausalLM"
        return [f"from transformers import {auto}, AutoTokenizer", "",
                f"model = {auto}.from_pretrained({folder!r})",
                f"tokenizer = AutoTokenizer.from_pretrained({folder!r})"]


def ppo_card(config, final_record: Optional[dict], total_updates: int) -> ModelCard:
    """The card of a ppo run's final/ from its config (a PPOConfig) and the last metrics record."""
    hp = config.ppo
    estimator, critic = hp.advantage_estimator, hp.estimator.critic
    training = [
        ("base model", _code(config.model)),
        ("data", _data_cell({"train": config.data.train, "eval": config.data.eval})),
        ("reward", "none: the teacher's alone" if config.teacher and not _has_source(config) else _reward_sources(config.reward)),
        *([("teacher", f"{_code(config.teacher)}: each sampled token's reward less {config.teacher_coef:g} x its reverse KL "
                       "log pi_student - log pi_teacher (on-policy distillation)")] if config.teacher else []),
        ("advantage estimator", f"`{estimator}`: {hp.estimator_description}"),
        ("trained weights", f"a LoRA adapter (r {config.lora.r}, alpha {config.lora.alpha:g}) on the frozen base" if config.lora
         else "all weights"),
    ]
    if critic:
        training.append(("value model", "in value_model/ beside the policy"))
    training.append(("ppokit", f"{__version__} (`ppokit ppo`)"))
    unread = hp.unread_keys()
    hyperparameters = {f"ppo.{k}": getattr(hp, k) for k in PPO_KEYS if k not in unread and getattr(hp, k) is not None}
    if not hp.kl_in_reward:  # still the estimator of the objective/kl it reports
        hyperparameters["ppo.kl_estimator"] = f"{hp.kl_estimator} (of the reported objective/kl only: no KL in the reward)"
    hyperparameters.update({"seed": config.seed, "bf16": config.bf16})
    if config.lora:
        hyperparameters.update({"lora.r": config.lora.r, "lora.alpha": config.lora.alpha, "lora.target_modules": config.lora.target_modules})
    record = final_record or {}
    update = record.get("update")
    title = f"Results (update {update} of {total_updates}, episode {record.get('episode')})" if update is not None else "Results"
    results = {k: v for k, v in record.items() if k.startswith(RESULT_PREFIXES) or k == "skipped_updates"}
    return ModelCard(
        title=_folder_name(config.output_dir), location=str(Path(config.output_dir) / "final"), base_model=config.model,
        data={"train": config.data.train, "eval": config.data.eval},
        summary=f"A policy trained from {_code(config.model)} with reinforcement learning by ppokit {__version__}: "
                f"{hp.estimator_description}.",
        hyperparameters_note="Keys of the `ppo:` section that this run did not read are left out (config.yaml names them)." if unread else "",
        training=training, hyperparameters=hyperparameters, results=results, results_title=title,
        adapter=config.lora is not None, tags=["rlhf", "ppo" if critic else estimator],
    )


def stage_card(stage: str, config, summary: dict) -> ModelCard:
    """The card of an sft or rm output from its config (SFTConfig, RMConfig) and summary."""
    rm = stage == "rm"
    what = "A reward model (one score per sequence, trained on preference pairs with the Bradley-Terry loss)" if rm \
        else "A causal language model fine-tuned on prompt/completion data (supervised)"
    data = {"train": config.data.train, "eval": config.data.eval}
    training = [
        ("base model", _code(config.model)),
        ("data", _data_cell(data) + (f" (format {summary['format']})" if summary.get("format") else "")),
        ("trained weights", "all weights" + (", a new one-label score head" if rm else "")),
        ("ppokit", f"{__version__} (`ppokit {stage}`)"),
    ]
    hyperparameters = {f"train.{k}": v for k, v in dataclasses.asdict(config.train).items()}
    hyperparameters.update({f"data.{k}": getattr(config.data, k) for k in ("max_prompt_length", "max_length")})
    hyperparameters["seed"] = config.seed
    result_keys = ("steps", "last_loss", "eval_loss", "eval_accuracy_before", "eval_accuracy", "eval_margin",
                   "train_rows", "eval_rows", "train_pairs", "eval_pairs")
    results = {k: summary[k] for k in result_keys if summary.get(k) is not None}
    return ModelCard(
        title=_folder_name(config.output_dir), location=str(config.output_dir), summary=f"{what} from {_code(config.model)} by ppokit {__version__}.",
        base_model=config.model, data=data, training=training, hyperparameters=hyperparameters, results=results,
        results_title="Results", task="text-classification" if rm else "text-generation", tags=["reward-model" if rm else "sft"],
    )


def _has_source(config) -> bool:
    reward = config.reward
    return bool(reward.model or reward.functions or reward.remote is not None or config.environment is not None)


def _reward_sources(reward) -> str:
    """Every reward source of a RewardConfig, with its weight when weights are set."""
    sources = []
    if reward.model:
        sources.append(f"reward model {_code(reward.model)}")
    for entry in reward.functions:
        label = entry if isinstance(entry, str) else ", ".join(f"{k}: {v}" for k, v in entry.items())
        sources.append(f"function {_code(label)}")
    if reward.remote is not None and reward.remote.url:
        url = urlsplit(reward.remote.url)  # without a query string, where a token may be
        sources.append(f"remote {_code(f'{url.scheme}://{url.netloc}{url.path}')}")
    if reward.weights is not None:
        sources = [f"{source} × {weight:g}" for source, weight in zip(sources, reward.weights)]
    normalize = reward.normalize
    note = "; each normalised by its running mean and std" if normalize is True else "; normalised per source" if any(normalize or []) else ""
    return "; ".join(sources) + note if sources else "none recorded"


def _data_cell(data: dict[str, Optional[str]]) -> str:
    return "; ".join(f"{split}: {_code(value)}" for split, value in data.items() if value) or "passed as objects (not recorded)"


def _hub_id(value: Optional[str]) -> bool:
    """A hub name (`org/name`, `name`), not a path on this machine: the hub's metadata takes only those."""
    if not value or os.path.exists(value) or value.startswith(("/", ".", "~")):
        return False
    return re.fullmatch(r"[\w.-]+(/[\w.-]+)?([:@][\w.@:-]+)?", value) is not None and not re.search(r"\.(jsonl?|csv|parquet)$", value)


def _folder_name(path: str) -> str:
    return Path(path).resolve().name or str(path)


def _code(value: Optional[str]) -> str:
    """A name or path as code: nothing in it is Markdown or HTML there, but a backtick, a line break or a column separator."""
    if not value:
        return "(not recorded)"
    text = " ".join(str(value).split()).replace("`", "'").replace("|", "\\|")
    return f"`{text}`"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return _text(", ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value))


def _text(value: str) -> str:
    """One table cell or line of Markdown: no line breaks, no column separators, no raw HTML."""
    return " ".join(value.split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
