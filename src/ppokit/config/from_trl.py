"""`ppokit from-trl FILE`: a TRL GRPO config as the ppokit config that trains the same, written out for the user to
read and keep (docs/trl.md).

A TRL GRPO YAML is flat: GRPOConfig's names, transformers' TrainingArguments, TRL's ModelConfig and ScriptArguments.
Each key becomes ppokit's by one rule, the same that `ppokit ppo` states when it refuses such a file:

- a GRPOConfig name: its translation in `trl_grpo_names.TRL_GRPO_EQUIVALENTS` (num_generations: 8 ->
  ppo.num_samples_per_prompt: 8), or a refusal naming the key when ppokit has no equivalent;
- a ppokit key (output_dir, seed, bf16) or a section of ppokit's (reward: ...): as written;
- a name that ppokit spells the same in exactly one section (learning_rate, temperature, chat_template_kwargs): there;
- TRL's model and dataset names (model_name_or_path, dataset_name, lora_r, ...): ppokit's key;
- anything else: refused by name, with the hint `ppokit ppo` gives.

Then what TRL's GRPOTrainer is besides its config (`trl_grpo_names.GRPO_TRAINER`: ppo.advantage_estimator: grpo, which
builds no value model), and GRPOConfig's defaults where ppokit's differ and the file sets none (`TRL_DEFAULTS`), each
line saying where it came from. A value the file sets is never replaced: two keys that set one ppokit key to two values
are refused, naming both, unless one of them only implied it (rollout.engine: vllm for a vLLM option).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import typing
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import yaml

from ppokit.config.schema import PPOConfig
from ppokit.config.fields import build, key_paths, read_yaml, top_level_hint, unwrap_optional
from ppokit.errors import UserError
from ppokit.config.trl_names import (
    GRPO_TRAINER, TRL_GRPO_EQUIVALENTS, TRL_GRPO_NAMES, Equivalent, describe, server_address, yaml_value,
)

# GRPOConfig's defaults (TRL 1.16) that differ from what ppokit does unset: a TRL config that leaves them out trains
# with these, so the translation writes them (tests/test_from_trl.py reads them back from the installed TRL).
TRL_DEFAULTS: dict[str, Any] = {
    "num_generations": 8, "max_completion_length": 512, "num_iterations": 1, "beta": 0.0, "temperature": 1.0,
    "learning_rate": 1e-6, "adam_epsilon": 1e-8,
}

# TRL's ModelConfig and ScriptArguments names with one ppokit key each.
MODEL_AND_DATA = {"model_name_or_path": "model", "dataset_name": "data.train", "lora_r": "lora.r", "lora_alpha": "lora.alpha",
                  "lora_dropout": "lora.dropout", "lora_target_modules": "lora.target_modules"}
SERVER = ("vllm_server_host", "vllm_server_port")  # one rollout.servers address between them
GRPO_TRAINER_NOTE = "TRL's GRPOTrainer: group-relative advantages, no value model"


class Setting(NamedTuple):
    value: Any
    origin: str  # what set it, as the user reads it: `beta: 0.04`, `TRL's default num_iterations: 1`
    implied: bool  # only needed by its origin: a key set explicitly decides it


@dataclasses.dataclass
class Translation:
    settings: dict[str, Setting]  # dotted ppokit key -> its value and origin, in the order set
    lines: list[str]  # the translation, one TRL key a line
    sections: frozenset  # PPOConfig's sections (ppo, data, ...): dotted keys under them are written nested

    def as_yaml(self, source: str) -> str:
        """The ppokit config, each key with a comment saying what set it."""
        top, nested = [], {}
        for key, setting in self.settings.items():
            head, _, leaf = key.partition(".")
            if leaf and head in self.sections:
                nested.setdefault(head, []).append((leaf, setting))
            else:
                top.append((key, setting))
        out = [f"# ppokit's config from the TRL GRPO config {source} (ppokit from-trl); docs/trl.md"]
        out += [_yaml_line(key, key, setting, "") for key, setting in top]
        for section, items in nested.items():
            out.append(f"{section}:")
            out += [_yaml_line(f"{section}.{leaf}", leaf, setting, "  ") for leaf, setting in items]
        return "\n".join(out) + "\n"


def _yaml_line(key: str, leaf: str, setting: Setting, indent: str) -> str:
    """`leaf: value`, with a comment naming what set it unless that is the same key and value (ppokit's own, or a name
    that ppokit spells the same in a section)."""
    value = yaml.safe_dump(setting.value, default_flow_style=True, width=10**9).strip()
    if value.endswith("\n..."):  # a plain scalar's document end marker
        value = value[: -len("\n...")]
    own = setting.origin in (f"{name}: {yaml_value(setting.value)}" for name in (key, leaf))
    return f"{indent}{leaf}: {value}" + ("" if own else f"  # {setting.origin}")


def translate(trl: dict, source: str = "the file") -> Translation:
    """A TRL GRPO config's mapping -> its ppokit translation; UserError naming every key it cannot translate, a line each."""
    hints = typing.get_type_hints(PPOConfig)
    sections = frozenset(f.name for f in dataclasses.fields(PPOConfig) if dataclasses.is_dataclass(unwrap_optional(hints[f.name])[0]))
    top_level = {f.name for f in dataclasses.fields(PPOConfig)}
    elsewhere = key_paths(PPOConfig)
    settings: dict[str, Setting] = {}
    lines: list[str] = []
    refused: list[str] = []
    conflicts: list[str] = []

    def put(key: str, value: Any, origin: str, implied: bool = False) -> None:
        before = settings.get(key)
        if before is None or (before.implied and not implied):
            settings[key] = Setting(value, origin, implied)
        elif before.value != value and not implied:
            conflicts.append(f"  {key}: {yaml_value(before.value)} from `{before.origin}`, {yaml_value(value)} from `{origin}`")

    def put_equivalent(said: Equivalent, origin: str) -> None:
        for key, v in said.settings:
            put(key, v, origin, implied=key in said.implied)
        shown = ", ".join(f"{key}: {yaml_value(v)}" for key, v in said.settings) or "nothing to set"
        lines.append(f"  {origin}  ->  {shown}" + (f" ({said.note})" if said.note else ""))

    use_peft = trl.get("use_peft") is True
    for name, value in trl.items():
        origin = f"{name}: {yaml_value(value)}"
        if not isinstance(name, str):
            refused.append(f"  {name!r}: not a key name")
        elif name in SERVER or name in ("use_peft", "dataset_train_split", "dataset_test_split"):
            continue  # read with the keys they go with, below
        elif name in TRL_GRPO_EQUIVALENTS:
            said = TRL_GRPO_EQUIVALENTS[name](value)
            if isinstance(said, Equivalent):
                put_equivalent(said, origin)
            else:
                refused.append(f"  {origin}: {describe(said)}")
        elif name in TRL_GRPO_NAMES:  # no equivalent
            refused.append(f"  {origin}: {TRL_GRPO_NAMES[name](value)}")
        elif name in top_level:
            if name in sections and isinstance(value, dict):  # a ppokit section written in the file: its keys as written
                for key, v in value.items():
                    put(f"{name}.{key}", v, f"{name}.{key}: {yaml_value(v)}")
            else:
                put(name, value, origin)
        elif name in MODEL_AND_DATA:
            if name.startswith("lora_") and not use_peft:
                lines.append(f"  {origin}  ->  nothing (TRL reads it only with use_peft: true)")
                continue
            key = MODEL_AND_DATA[name]
            if name == "dataset_name" and trl.get("dataset_train_split") not in (None, "train"):
                value = f"{value}:{trl['dataset_train_split']}"
            put(key, value, origin)
            lines.append(f"  {origin}  ->  {key}: {yaml_value(value)}")
        elif len(elsewhere.get(name, [])) == 1:  # the same name in one of ppokit's sections
            key = elsewhere[name][0]
            put(key, value, origin)
            lines.append(f"  {origin}  ->  {key}: {yaml_value(value)}")
        else:
            refused.append(f"  {origin}:{top_level_hint(PPOConfig, name, value) or ' ppokit has no such key'}")
    if use_peft and not any(key.startswith("lora.") or key == "lora" for key in settings):
        put("lora", {}, "use_peft: true")
        lines.append("  use_peft: true  ->  lora: {} (every default)")
    if "dataset_test_split" in trl:
        if "dataset_name" in trl:
            put("data.eval", f"{trl['dataset_name']}:{trl['dataset_test_split']}", f"dataset_test_split: {trl['dataset_test_split']}")
            lines.append(f"  dataset_test_split: {trl['dataset_test_split']}  ->  data.eval: {trl['dataset_name']}:{trl['dataset_test_split']}")
        else:
            refused.append(f"  dataset_test_split: {trl['dataset_test_split']}: a split of dataset_name, which the file does not set")
    if any(name in trl for name in SERVER):
        address = server_address(trl.get("vllm_server_host", "0.0.0.0"), trl.get("vllm_server_port", 8000))
        origin = ", ".join(f"{name}: {yaml_value(trl[name])}" for name in SERVER if name in trl)
        put_equivalent(Equivalent((("rollout.engine", "vllm"), ("rollout.placement", "servers"), ("rollout.servers", [address])),
                                            implied=("rollout.engine", "rollout.placement")), origin)
    for key, value in GRPO_TRAINER:
        put(key, value, GRPO_TRAINER_NOTE)
        lines.append(f"  ({GRPO_TRAINER_NOTE})  ->  {key}: {yaml_value(value)}")
    for name, default in TRL_DEFAULTS.items():
        said = _default_equivalent(name, default, elsewhere)
        if name in trl or any(key in settings for key, _ in said.settings):
            continue  # the file sets it (as TRL's name or as ppokit's)
        put_equivalent(said, f"TRL's default {name}: {yaml_value(default)}")
    problems = []
    if refused:
        problems.append(f"{source}: no ppokit translation for these keys (remove them, or set what they ask by hand):\n" + "\n".join(refused))
    if conflicts:
        problems.append(f"{source}: two keys set one ppokit key to two values:\n" + "\n".join(conflicts))
    if problems:
        raise UserError("\n".join(problems))
    return Translation(settings, lines, sections)


def _default_equivalent(name: str, value: Any, elsewhere: dict) -> Equivalent:
    if name in TRL_GRPO_EQUIVALENTS:
        said = TRL_GRPO_EQUIVALENTS[name](value)
        assert isinstance(said, Equivalent), name
        return said
    return Equivalent(((elsewhere[name][0], value),))


def convert(path: str, output: Optional[str], result: Callable[[str], None]) -> int:
    """`ppokit from-trl PATH [-o OUTPUT]`: the translation on stderr, the ppokit config to OUTPUT (written whole, or not
    at all) or to `result` (the command's stdout); then what the config still lacks for `ppokit ppo` (TRL's reward
    functions are code, not config)."""
    translation = translate(read_yaml(path), path)
    text = translation.as_yaml(path)
    data = yaml.safe_load(text)
    config = build(PPOConfig, data)  # every key a ppokit key: a translation that is not is ppokit's bug, not the user's
    print(f"from-trl: {path}, TRL's GRPO config, as ppokit's:\n" + "\n".join(translation.lines), file=sys.stderr)
    if output is None:
        result(text.rstrip("\n"))
    else:
        _write_whole(Path(output), text)
        print(f"from-trl: wrote {output}", file=sys.stderr)
    try:
        config.validate()
    except UserError as still:
        print(f"from-trl: before `ppokit ppo {output or 'CONFIG'}`: {still}", file=sys.stderr)
    return 0


def _write_whole(path: Path, text: str) -> None:
    if path.is_dir():
        raise UserError(f"-o {path}: is a directory")
    try:
        fd, temporary = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".", prefix=f".{path.name}.")
    except OSError as e:
        raise UserError(f"-o {path}: cannot write in {path.parent} ({e.strerror})") from None
    with os.fdopen(fd, "w") as f:
        f.write(text)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(temporary, 0o666 & ~umask)  # as open() would make it, not mkstemp's owner-only
    os.replace(temporary, path)
