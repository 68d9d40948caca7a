"""`ppokit pipeline CONFIG.yaml`: sft -> rm -> ppo from one file, each stage's output wired into the next.

The sections `sft:`, `rm:` and `ppo:` are each that stage's own config. Unless set:
    sft.output_dir, rm.output_dir, ppo.output_dir   <output_dir>/sft, /rm, /ppo
    rm.model, ppo.model                             the sft output
    ppo.reward.model, ppo.value_model               the rm output
All three configs are built and validated before anything trains. A stage is skipped when its
output is complete (sft, rm: the folder exists, since it appears only by a rename when the stage
finishes; ppo: final/ exists) and the config.yaml recorded there matches the one asked for, and
no earlier stage ran in this invocation. So a crashed pipeline restarts at the stage that crashed.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable, Optional


from ppokit.config.schema import PPOConfig
from ppokit.config.stages import PipelineConfig, RMConfig, SFTConfig
from ppokit.config.fields import apply_override, build, parse_override, read_yaml
from ppokit.errors import UserError
from ppokit.run.run_dir import check_output_dir, check_replaceable, check_run_folder, marker_kind

STAGES = ("sft", "rm", "ppo")
CONFIG_CLASSES = {"sft": SFTConfig, "rm": RMConfig, "ppo": PPOConfig}


def wire(pipeline: PipelineConfig) -> dict[str, dict]:
    """The sections present, with output directories and the inputs from earlier stages filled in."""
    base = Path(pipeline.output_dir)
    sections = {s: copy.deepcopy(getattr(pipeline, s)) for s in STAGES if getattr(pipeline, s) is not None}
    for stage, section in sections.items():
        section.setdefault("output_dir", str(base / stage))
    if "sft" in sections:
        sft_out = sections["sft"]["output_dir"]
        for stage in ("rm", "ppo"):
            if stage in sections and not sections[stage].get("model"):
                sections[stage]["model"] = sft_out
    if "rm" in sections and "ppo" in sections:
        rm_out, ppo = sections["rm"]["output_dir"], sections["ppo"]
        reward = ppo.setdefault("reward", {}) or {}
        ppo["reward"] = reward
        if not reward.get("model"):
            reward["model"] = rm_out
        if not ppo.get("value_model"):
            ppo["value_model"] = rm_out
    return sections


def differences(requested: Any, recorded: Any, key: str = "") -> list[str]:
    """Keys where the recorded config differs from the requested one. A null in the request
    ('let the stage choose') matches whatever the stage recorded."""
    if requested is None:
        return []
    if isinstance(requested, dict) and isinstance(recorded, dict):
        found = []
        for k in requested:
            found += differences(requested[k], recorded.get(k), f"{key}.{k}" if key else k)
        return found
    return [] if requested == recorded else [key or "<root>"]


def completed_output(stage: str, output_dir: Path) -> Optional[Path]:
    """config.yaml of a completed output, or None when the stage has not completed there."""
    done = (output_dir / "final").is_dir() if stage == "ppo" else output_dir.is_dir()
    recorded = output_dir / "config.yaml"
    return recorded if done and recorded.is_file() else None


def run_stage(stage: str, config, show_progress: bool, overwrite: bool = False) -> dict:
    # The stages import torch and transformers: here, so that a mistake in the configs is answered before that.
    from ppokit.stages.rm import run_rm
    from ppokit.stages.sft import run_sft
    from ppokit.trainer import PPOTrainer

    if stage == "sft":
        return run_sft(config, show_progress, overwrite)
    if stage == "rm":
        return run_rm(config, show_progress, overwrite)
    records = PPOTrainer(config, show_progress=show_progress, overwrite=overwrite).train()
    return {
        "stage": "ppo",
        "output_dir": config.output_dir,
        "updates": len(records),
        "first_score": records[0]["objective/scores"],
        "last_score": records[-1]["objective/scores"],
        "scores": [r["objective/scores"] for r in records],
        "last_kl": records[-1]["objective/kl"],
    }


def run_pipeline(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    data: dict | None = None,
    show_progress: bool = True,
    runner: Callable[[str, Any, bool, bool], dict] = run_stage,
    overwrite: bool = False,
) -> dict:
    """Run (or skip) each stage in order; -> {stage: summary}, a skipped stage's summary has skipped=True.
    `overwrite`: a stage may replace an output folder that ppokit did not write."""
    raw = dict(data or {})
    if path is not None:
        raw.update(read_yaml(path))
    for text in overrides or []:
        apply_override(raw, *parse_override(text))
    pipeline = build(PipelineConfig, raw).validate()
    sections = wire(pipeline)
    configs = {}
    for stage, section in sections.items():
        try:
            configs[stage] = build(CONFIG_CLASSES[stage], section).validate()
        except UserError as e:
            raise UserError(f"{stage}: {e}") from None
    for stage, config in configs.items():  # every output folder, before anything trains
        try:
            if stage == "ppo":
                check_run_folder(config.output_dir, overwrite)
            else:
                check_replaceable(check_output_dir(config.output_dir), overwrite)
        except UserError as e:
            raise UserError(f"{stage}: {e}") from None
    from ppokit.stages.common import printer

    say = printer(show_progress, "pipeline")
    summaries: dict[str, dict] = {}
    earlier_ran = False
    for stage, config in configs.items():
        out = Path(config.output_dir)
        recorded = completed_output(stage, out)
        if recorded is not None and not earlier_ran:
            try:
                # built, so that keys the record leaves out (a ppo run's unread keys, PPOConfig.save) are their defaults
                changed = differences(config.to_dict(), build(type(config), read_yaml(recorded)).to_dict())
            except UserError as e:  # a damaged record: the output cannot be trusted to match
                changed = [f"its config.yaml is unreadable: {e}"]
            if not changed:
                say(f"{stage}: skipped, {out} is complete and was made with this config")
                summaries[stage] = {"stage": stage, "output_dir": str(out), "skipped": True}
                continue
            say(f"{stage}: {out} was made with a different config ({', '.join(changed[:5])}); running again")
        elif recorded is not None:
            say(f"{stage}: running again, an earlier stage produced new output")
        else:
            say(f"{stage}: running -> {out}")
        # Running a stage again replaces its earlier output; a ppo run's stays whole until the new one has a checkpoint.
        replace = overwrite or (stage == "ppo" and marker_kind(out) == "ppo-run")
        summaries[stage] = runner(stage, config, show_progress, replace)
        earlier_ran = True
    return summaries
