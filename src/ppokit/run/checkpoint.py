"""Checkpoints: the whole training state to and from disk, written atomically, for exact resume.

A checkpoint is the folder `output_dir/checkpoints/update-N/`:

    weights and optimiser state, in one of two layouts (`PlainWeights`, or under parallel.strategy
    fsdp `parallel.ShardedWeights`: sharded/, a torch.distributed.checkpoint folder of every process's shards):
    trainable.safetensors with LoRA: every trainable tensor (adapters, heads), what resume reads
    model/               policy + tokenizer as `saving.Saving.models` writes them (the layout of final/:
                         full weights, or adapters for a PEFT model), value model in model/value_model/
    optimizer.pt         optimiser state                       (torch.save; read with weights_only=True)
    scheduler.pt         learning-rate schedule position       (idem)
    rng.pt               Python, NumPy, torch and CUDA RNG states, one entry per process (idem)
    reward_scorer.pt     the reward scorer's state_dict(): per-source normalisation statistics
    metrics.jsonl        the metric records of updates 1..N (metrics.jsonl is rewritten to it on resume)
    samples.jsonl        samples.jsonl as it was after update N
    config.yaml          the run's configuration, compared with the new one on resume
    trainer_state.json   counters, data position, KL controller, versions; written last ("complete": true)

The folder is written under a temporary name and renamed into place (`run_dir.temporary_dir`, `finish_dir`), so a
crash while writing leaves the previous checkpoints as they were; only folders named update-N
whose trainer_state.json says complete count. The data order is a pure function of
(seed, round index) (`prompts.batch_indices`; a round is one update's prompts), so the rounds taken
(`TrainingState.rounds`, the update counter without dynamic sampling) are the data position.

`save_checkpoint` and `load_checkpoint` take what they write and restore, by name: the run's
`TrainingState`, its `TrainedParts` (models, optimiser, schedule, KL controller, reward scorer),
the config, the run's facts (`RunFacts`) and the accelerator. Loading restores the parts in place
and returns the checkpoint's TrainingState; it sets nothing else. Every process calls both: the
weights layout decides which processes write (all of them for shards, the main one otherwise).
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import yaml

from ppokit.run.checkpoint_files import (
    FORMAT,
    DamagedCheckpoint,
    open_safetensors,
    open_torch,
    read_config,
    read_jsonl,
    read_manifest,
    update_of,
)
from ppokit.config.schema import PPOConfig
from ppokit.config.fields import resume_rules
from ppokit.errors import UserError
from ppokit.metrics.sinks import JsonlWriter
from ppokit.process.random_states import rng_state, set_rng_state
from ppokit.run.run_dir import (
    CHECKPOINT_NAME,
    CHECKPOINTS,
    STATE_FILE,
    discard_dir,
    finish_dir,
    full_disk,
    is_marked,
    list_checkpoints,
    skipped_checkpoints,
    move_into_place,
    owned_checkpoint,
    remove_leftovers,
    temporary_dir,
)
from ppokit.run.state import TrainingState
from ppokit.process.strategies import DEFAULT as DEFAULT_STRATEGY, STRATEGIES
from ppokit.metrics.trackers import TrackerState
from ppokit.version import __version__


# Which config keys may differ between a checkpoint and the run that resumes it is declared with each key
# (`doc(..., resume=...)` in ppokit.config.schema): those that change no number the run computes. Every other key
# (and the number of processes, and the contents of the data files) must match unless the user says --resume-force.
RESUME_RULES = resume_rules(PPOConfig)


# --------------------------------------------------------------------------- finding checkpoints


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS


def find_checkpoint(spec: Optional[str], output_dir: str | Path, say: Optional[Callable[[str], None]] = None) -> Path:
    """The checkpoint to resume: `spec` None -> the latest complete one in output_dir/checkpoints;
    a checkpoint folder -> that one; a run folder or a checkpoints folder -> the latest in it.
    `say` is told of each newer checkpoint folder passed over, and why (`run_dir.skipped_checkpoints`)."""
    if spec is None:
        candidates = [checkpoints_dir(output_dir)]
    else:
        path = Path(spec).expanduser()
        if (path / STATE_FILE).exists():
            return path  # read_checkpoint says whether it is complete and whole
        if CHECKPOINT_NAME.match(path.name):
            raise UserError(f"--resume {spec}: not a complete checkpoint (no {STATE_FILE})")
        if not path.is_dir():
            raise UserError(f"--resume {spec}: no such checkpoint or run directory")
        candidates = [path / CHECKPOINTS, path]
    for folder in candidates:
        found = list_checkpoints(folder)
        if found:
            for skipped, why in skipped_checkpoints(folder) if say is not None else ():
                say(f"skipped checkpoint {skipped}: {why}; the latest complete one is {found[-1]}")
            return found[-1]
    damaged = "; ".join(f"{p.name}: {why}" for p, why in skipped_checkpoints(candidates[0]))
    raise UserError(f"--resume: no complete checkpoint in {candidates[0]}{f' ({damaged})' if damaged else ''}; "
                    "nothing to resume (start without --resume)")


def prune_checkpoints(folder: Path, keep: Optional[int]) -> None:
    """Keep the newest `keep` complete checkpoints (never fewer than one); clear leftovers of killed writes.
    Only ppokit's own checkpoint folders are ever deleted (`run_dir.owned_checkpoint`)."""
    remove_leftovers(folder)
    if keep is None:
        return
    for old in list_checkpoints(folder)[: -max(1, keep)]:
        if owned_checkpoint(old):
            shutil.rmtree(old)


# --------------------------------------------------------------------------- weights


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder}: no .safetensors weights (checkpoints are written with safetensors only)")
    state = {}
    for f in files:
        state.update(load_file(f, device="cpu"))
    return state


def load_weights(model: torch.nn.Module, folder: Path) -> None:
    """Load weights written by `save_pretrained` (a full model, or a PEFT model's adapters) into `model`.

    Every trainable tensor must be found (a tied weight saved once under another name counts);
    frozen weights not in the folder (a PEFT base model) are left as they are.
    """
    state = _read_safetensors(folder)
    try:
        if hasattr(model, "peft_config"):
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(model, state)
        else:
            result = model.load_state_dict(state, strict=False)
    except RuntimeError as e:
        raise UserError(f"{folder}: the saved weights do not fit the model: {str(e).splitlines()[0]}") from None
    if result.unexpected_keys:
        raise UserError(f"{folder}: weights the model does not have: {', '.join(result.unexpected_keys[:5])}")
    own = model.state_dict()
    loaded = {own[k].data_ptr() for k in set(own) - set(result.missing_keys)}
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    missing = [k for k in result.missing_keys if k in trainable and own[k].data_ptr() not in loaded]
    if missing:
        raise UserError(f"{folder}: trainable weights missing from the checkpoint: {', '.join(missing[:5])}")


def _load_trainable(parts: "TrainedParts", file: Path) -> None:
    from safetensors.torch import load_file

    saved = load_file(str(file))
    params = parts.trainable_parameters()
    if set(saved) != set(params):
        missing, extra = sorted(set(params) - set(saved)), sorted(set(saved) - set(params))
        raise UserError(f"{file}: does not fit this run's trainable weights (missing: {missing[:3]}, unexpected: {extra[:3]})")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(saved[name])


def _torch_load(path: Path):
    """torch.load that only accepts tensors and plain containers: a checkpoint cannot run code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        raise UserError(f"{path}: cannot be read as a checkpoint file ({str(e).splitlines()[0]})") from None


# --------------------------------------------------------------------------- config comparison


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_differences(saved: dict, current: dict, defaults: dict) -> list[str]:
    """'key (checkpoint A, now B)' for every key whose value differs in a way its declaration (RESUME_RULES)
    does not allow; a value inside a mapping-valued key counts as that key's.

    Keys missing from the saved config (added to ppokit since, or a ppo key the run did not read: PPOConfig.save)
    count as their default.
    """
    normalise = lambda d: _flatten(yaml.safe_load(yaml.safe_dump(d)))  # noqa: E731  (YAML round trip, as saved)
    before = {**normalise(defaults), **normalise(saved)}
    now = normalise(current)
    return [
        f"{key} (checkpoint {before.get(key)!r}, now {now.get(key)!r})"
        for key in sorted(set(before) | set(now))
        if before.get(key) != now.get(key) and not _may_change(key, before.get(key), now.get(key))
    ]


def _may_change(key: str, before: Any, now: Any) -> bool:
    """Whether a resume may change flattened `key` from `before` to `now`: the rule of the key, or of the
    mapping-valued key it lies in; refused when none is declared."""
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        rule = RESUME_RULES.get(".".join(parts[:end]))
        if rule is not None:
            return rule(before, now)
    return False


def data_fingerprint(dataset) -> Optional[str]:
    """sha256 of a prompt dataset's rows: a data file edited between save and resume is noticed."""
    if dataset is None:
        return None
    payload = json.dumps({"prompts": dataset.prompts, "columns": dataset.columns}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


def _versions() -> dict:
    import transformers

    return {"ppokit": __version__, "torch": torch.__version__, "transformers": transformers.__version__}


# --------------------------------------------------------------------------- what a checkpoint holds


@dataclass
class TrainedParts:
    """Everything with a state_dict that a checkpoint saves besides the TrainingState.

    model: the policy and value model under one module (unwrapped, with `.policy` and `.value_model`);
    adapters: the run trains LoRA adapters (resume then reads `trainable.safetensors`).
    """

    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    kl_controller: Any
    scorer: Any
    adapters: bool
    weights: Any = None  # how weights and optimiser state are written: PlainWeights (default) or parallel.ShardedWeights

    def __post_init__(self):
        if self.weights is None:
            self.weights = PlainWeights()

    def trainable_parameters(self) -> dict[str, torch.nn.Parameter]:
        """Every parameter the optimiser updates, by its name under the model (each once)."""
        return {name: p for name, p in self.model.named_parameters() if p.requires_grad}


@dataclass
class RunFacts:
    """What identifies the run a checkpoint belongs to: its data and batch arithmetic."""

    output_dir: Path
    train_data: Any  # PromptDataset
    eval_data: Any  # PromptDataset or None
    batch: int  # episodes per update, over every process
    num_updates: int
    save_total_limit: Optional[int] = None
    samples_per_prompt: int = 1  # an update takes batch / samples_per_prompt prompts


class PlainWeights:
    """Weights and optimiser state as whole tensors, written by the main process: model/ (what final/
    holds), trainable.safetensors with adapters, optimizer.pt. `parallel.ShardedWeights` is the other
    layout, with the same two methods."""

    kind = "plain"

    def save(self, folder: Path, parts: TrainedParts, save_models: Callable[[Path], None], is_main: bool) -> None:
        if not is_main:
            return
        save_models(folder / "model")
        if parts.adapters:
            # With adapters the roles share one base and model/ splits them by role (the shared critic's
            # adapter sits inside the policy); resume reads this one file of exactly what trains instead.
            # It is small: adapters and heads only. Full models are read back from model/ itself.
            from safetensors.torch import save_file

            save_file({k: p.detach().contiguous().cpu() for k, p in parts.trainable_parameters().items()},
                      folder / "trainable.safetensors")
        torch.save(parts.optimizer.state_dict(), folder / "optimizer.pt")

    def load(self, path: Path, parts: TrainedParts) -> None:
        if (path / "trainable.safetensors").exists():
            _load_trainable(parts, path / "trainable.safetensors")
        else:
            load_weights(parts.model.policy, path / "model")
            if parts.model.value_model is not None:  # a critic-free estimator has none
                load_weights(parts.model.value_model, path / "model" / "value_model")
        try:
            parts.optimizer.load_state_dict(_torch_load(path / "optimizer.pt"))
        except (ValueError, KeyError) as e:
            raise UserError(f"{path / 'optimizer.pt'}: does not fit the model's parameters ({e})") from None


# --------------------------------------------------------------------------- save


def save_checkpoint(
    state: TrainingState, parts: TrainedParts, config, run: RunFacts, save_models: Callable[[Path], None], accelerator,
    written: Callable[[Path], None] = lambda path: None,
) -> Path:
    """Write checkpoints/update-<state.update>/ (every process calls this); returns its path.

    save_models(folder) writes the policy, tokenizer and value model as final/ holds them.
    written(path) is called once the checkpoint is complete as far as this process can tell: on the main process as
    soon as it is in place (before the last wait, so a process lost during that wait leaves it named), on the others
    after that wait.
    Saving leaves every RNG as it found it, so a run that saves computes what a run that does not would.
    """
    rng = rng_state()
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        rng_all = gather_object([rng])
    else:
        rng_all = [rng]
    target = checkpoints_dir(run.output_dir) / f"update-{state.update}"
    is_main = accelerator.is_main_process
    # One temporary folder for every process (the weights layout may have each write its shards into it).
    tmp = [str(temporary_dir(target, "checkpoint", replace_unmarked=owned_checkpoint(target))) if is_main else None]
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(tmp)
    try:
        parts.weights.save(Path(tmp[0]), parts, save_models, is_main)
        accelerator.wait_for_everyone()
        if is_main:
            _write(Path(tmp[0]), state, parts, config, run, rng_all, accelerator.num_processes)
            finish_dir(Path(tmp[0]), target)  # may replace it: checked when the temporary folder was made
    except BaseException as e:
        full = discard_dir(Path(tmp[0]), target, e) if is_main else None
        if full is not None:
            found = list_checkpoints(target.parent)
            raise full_disk(full, target, found[-1] if found else None) from None
        raise
    if is_main:
        prune_checkpoints(target.parent, run.save_total_limit)
        written(target)
    accelerator.wait_for_everyone()
    if not is_main:
        written(target)
    set_rng_state(rng)
    return target


def _write(tmp: Path, state: TrainingState, parts: TrainedParts, config, run: RunFacts, rng_all, processes: int) -> None:
    """Everything but the weights and optimiser state, trainer_state.json last."""
    torch.save(parts.scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(rng_all, tmp / "rng.pt")
    torch.save(parts.scorer.state_dict(), tmp / "reward_scorer.pt")
    metrics = JsonlWriter(tmp / "metrics.jsonl")
    metrics.write_many(state.records)
    metrics.close()
    samples = run.output_dir / "samples.jsonl"
    if samples.exists():
        shutil.copyfile(samples, tmp / "samples.jsonl")
    config.save(tmp / "config.yaml")
    saved = {
        "format": FORMAT,
        **state.counters(),
        "num_updates": run.num_updates,
        "data": {
            "seed": config.seed,
            "num_prompts": len(run.train_data),
            "batch": run.batch,
            "samples_per_prompt": run.samples_per_prompt,
            **state.data_position(len(run.train_data), run.batch // run.samples_per_prompt),
            "train_sha256": data_fingerprint(run.train_data),
            "eval_sha256": data_fingerprint(run.eval_data),
        },
        "kl_controller": {"type": type(parts.kl_controller).__name__, **parts.kl_controller.state_dict()},
        "processes": processes,
        "parallel": {"strategy": config.parallel.strategy, "weights": parts.weights.kind},
        "versions": _versions(),
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": sorted(p.name for p in tmp.iterdir()) + [STATE_FILE],
        "complete": True,
    }
    (tmp / STATE_FILE).write_text(json.dumps(saved, indent=2) + "\n")


# --------------------------------------------------------------------------- load


@dataclass
class SavedCheckpoint:
    """A checkpoint as read from disk, every file checked, before anything is restored from it."""

    path: Path
    manifest: dict  # trainer_state.json
    state: TrainingState
    config: dict  # config.yaml
    scheduler: dict
    scorer: dict
    rng: list


def read_checkpoint(path: str | Path) -> SavedCheckpoint:
    """Read and check every file of checkpoint `path`, changing nothing: a damaged file is a
    DamagedCheckpoint naming it, found before resume touches the run folder or the model.

    The optimiser state and the weights are only opened here (zip directory, safetensors header: a
    truncated file fails), not held; `load_checkpoint` reads them when it restores them.
    """
    path = Path(path)
    manifest = read_manifest(path)
    config = read_config(path)
    records = read_jsonl(path, "metrics.jsonl", required=True)
    try:
        state = TrainingState.from_counters(manifest, records, STATE_FILE)
    except UserError as e:
        raise DamagedCheckpoint(path, str(e)) from None
    if len(records) != state.update:
        raise DamagedCheckpoint(path, f"metrics.jsonl: {len(records)} records for {state.update} updates (cut short?)")
    read_jsonl(path, "samples.jsonl", required=False)
    scheduler, scorer, rng = (open_torch(path, name, keep=True) for name in ("scheduler.pt", "reward_scorer.pt", "rng.pt"))
    if not isinstance(rng, list) or not rng or not all(isinstance(r, dict) and {"python", "numpy", "torch"} <= set(r) for r in rng):
        raise DamagedCheckpoint(path, "rng.pt: not a list of RNG states, one per process")
    if not isinstance(scheduler, dict) or "last_epoch" not in scheduler:
        raise DamagedCheckpoint(path, "scheduler.pt: not a learning-rate schedule's state")
    _open_weights(path, manifest.get("parallel"))
    return SavedCheckpoint(path, manifest, state, config, scheduler, scorer, rng)


def _open_weights(path: Path, parallel: Any) -> None:
    """The weight and optimiser files of the layout that wrote them (`PlainWeights`, `parallel.ShardedWeights`), opened."""
    from ppokit.process.parallel import SHARDED_DIR, ShardedWeights, missing_shards

    if isinstance(parallel, dict) and parallel.get("weights") == ShardedWeights.kind:
        if not (path / SHARDED_DIR / ".metadata").is_file():
            raise DamagedCheckpoint(path, f"{SHARDED_DIR}/.metadata: missing")
        problem = missing_shards(path / SHARDED_DIR)  # DCP reads the shards themselves (ShardedWeights.load)
        if problem:
            raise DamagedCheckpoint(path, problem)
        return
    open_torch(path, "optimizer.pt")
    weights = [path / "trainable.safetensors"] if (path / "trainable.safetensors").exists() else None
    critic = path / "model" / "value_model"  # absent for a critic-free estimator (PlainWeights.load asks for it otherwise)
    for folder in (path / "model", *([critic] if critic.is_dir() else [])) if weights is None else ():
        found = sorted(folder.glob("*.safetensors"))
        if not found:
            raise DamagedCheckpoint(path, f"{folder.relative_to(path)}/: no .safetensors weights")
        weights = (weights or []) + found
    for file in weights:
        open_safetensors(path, file)


def load_checkpoint(
    path: str | Path, parts: TrainedParts, config, run: RunFacts, accelerator, force: bool = False,
    say: Callable[[str], None] = print,
) -> TrainingState:
    """Restore `parts` in place from checkpoint `path`; returns the checkpoint's TrainingState.

    Every file is read and checked first (`read_checkpoint`), then the config, the number of
    processes and the data are compared; a difference that changes the result is refused (a
    UserError naming the keys) unless `force`. Only then are the parts restored, and the run folder
    (metrics.jsonl, samples.jsonl, newer checkpoints) is touched last: a resume that fails changes nothing on disk.
    """
    saved = read_checkpoint(path)
    path, manifest = saved.path, saved.manifest
    _check_weights_layout(path, manifest, parts, config)
    differences = config_differences(saved.config, config.to_dict(), PPOConfig().to_dict())
    if manifest["processes"] != accelerator.num_processes:
        differences.append(f"processes (checkpoint {manifest['processes']}, now {accelerator.num_processes})")
    for split, dataset in (("train", run.train_data), ("eval", run.eval_data)):
        if manifest["data"].get(f"{split}_sha256") != data_fingerprint(dataset):
            differences.append(f"data.{split} contents (the prompt rows differ from the checkpoint's)")
    if differences and not force:
        raise UserError(
            f"resume from {path}: the run's settings differ from the checkpoint's in ways that change the result: "
            f"{'; '.join(differences)}. Restore them, or pass --resume-force (resume_from(..., force=True)) to continue anyway"
        )
    if differences:
        refuse_unappliable(differences, config, path)
        say(f"resuming despite differences (--resume-force): {'; '.join(differences)}")
    if manifest["versions"] != _versions():
        say(f"note: checkpoint written with {manifest['versions']}, now {_versions()}; numbers may differ in the last digits")
    continued_updates(run.batch * run.num_updates, run.batch, saved.state, path)  # the resumed run can end at total_episodes
    if config.report_to:  # the trackers read it after the run folder is restored: a damaged one stops the resume now
        TrackerState.load(Path(run.output_dir), resumed=True)

    from ppokit.process.parallel import UnreadableShards

    try:
        parts.weights.load(path, parts)
    except UnreadableShards as e:
        raise DamagedCheckpoint(path, str(e)) from None
    parts.scheduler.load_state_dict(saved.scheduler)
    parts.kl_controller.load_state_dict(manifest["kl_controller"])
    parts.scorer.load_state_dict(saved.scorer)
    if differences:
        apply_forced_hyperparameters(parts, config)

    if accelerator.is_main_process:
        at_end = saved.state.episodes_sampled >= run.batch * run.num_updates  # then final/ is this timeline's own model
        _restore_run_files(path, Path(run.output_dir), saved.state.update, keep_final=at_end)
    accelerator.wait_for_everyone()
    set_rng_state(saved.rng[accelerator.process_index % len(saved.rng)])
    return saved.state


def continued_updates(total_episodes: int, batch: int, state: TrainingState, path: Path) -> int:
    """The number of updates of a run resumed at `state`: the checkpoint's plus those of the episodes left at
    this run's `batch`, so that it ends at ppo.total_episodes also when the batch differs from the checkpoint's
    (another process count, under --resume-force). total_episodes // batch for the same batch."""
    left = total_episodes - state.episodes_sampled
    if left < 0 or left % batch:
        raise UserError(f"resume from {path}: {state.episodes_sampled} of ppo.total_episodes={total_episodes} episodes are done, and "
                        f"the {left} left are not a whole number of this run's updates of {batch} episodes; "
                        "change ppo.total_episodes or the batch size so that they are")
    return state.update + left // batch


# --------------------------------------------------------------------------- --resume-force

# Keys whose checkpointed state would override a forced new value; resume sets them from the config.
APPLIED_ON_FORCE = ("ppo.learning_rate", "ppo.vf_learning_rate", "ppo.adam_epsilon", "ppo.weight_decay", "ppo.kl_coef")


def refuse_unappliable(differences: list[str], config, path: Path) -> None:
    """A forced difference that cannot take effect is refused: the run's config.yaml would record a value it never used."""
    if config.ppo.kl_target is not None and any(d.startswith("ppo.kl_coef ") for d in differences):
        raise UserError(
            f"resume from {path}: ppo.kl_coef is the adaptive KL controller's starting value; the run continues from the "
            "coefficient it adapted to, so a new ppo.kl_coef cannot take effect, even with --resume-force. Restore it"
        )


def apply_forced_hyperparameters(parts: TrainedParts, config) -> None:
    """--resume-force: the optimiser state restored from the checkpoint carries its own learning rate,
    epsilon and weight decay, and a fixed KL controller its own coefficient; the run's config wins.
    The learning rates (the policy's group, then the critic's: `optimise.build_optimiser`) become the
    schedule's base rates, so the schedule continues from the same position at the new peak
    (lr = learning_rate x the schedule's factor at its step)."""
    hp, scheduler = config.ppo, parts.scheduler
    rates = [hp.learning_rate, hp.vf_learning_rate or hp.learning_rate][: len(parts.optimizer.param_groups)]
    scheduler.base_lrs = list(rates)
    for i, (group, rate) in enumerate(zip(parts.optimizer.param_groups, rates)):
        group["initial_lr"] = rate
        group["lr"] = rate * scheduler.lr_lambdas[i](scheduler.last_epoch)
        group["eps"], group["weight_decay"] = hp.adam_epsilon, hp.weight_decay
    scheduler._last_lr = [group["lr"] for group in parts.optimizer.param_groups]
    if config.ppo.kl_target is None:
        parts.kl_controller.load_state_dict({"value": hp.kl_coef})


def _check_weights_layout(path: Path, saved: dict, parts: TrainedParts, config) -> None:
    """A checkpoint's weights are read only by the layout that wrote them, --resume-force or not: whole
    tensors (ddp) and DCP shards (fsdp) are different files. A different process count is another matter:
    shards are resharded on load, whole tensors need none (the config check asks for --resume-force)."""
    written = saved.get("parallel", {"strategy": DEFAULT_STRATEGY, "weights": STRATEGIES[DEFAULT_STRATEGY].checkpoint_weights})
    if written["weights"] != parts.weights.kind:
        raise UserError(
            f"resume from {path}: the checkpoint was written under parallel.strategy {written['strategy']} and this run uses "
            f"{config.parallel.strategy}; a checkpoint's weights and optimiser state can only be read by the strategy that wrote "
            f"them. Resume with parallel.strategy: {written['strategy']}, or start a new run from its model"
        )


def _restore_run_files(path: Path, output_dir: Path, update: int, keep_final: bool = False) -> None:
    """metrics.jsonl and samples.jsonl back to the checkpoint's; newer checkpoints of this run and final/ set aside.

    Records written after the checkpoint (by a process that was killed later) belong to a timeline that
    the resumed run replaces; so do newer checkpoints, which move to checkpoints/superseded/ (only
    ppokit's own: `run_dir.owned_checkpoint`), as does final/ (when ppokit's: marked), which a resumed run killed before
    its own end would otherwise leave looking finished. `keep_final`: the checkpoint is the run's last update,
    so final/ was made from it.
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    superseded = checkpoints_dir(output_dir) / "superseded"
    if not keep_final and is_marked(output_dir / "final"):  # the abandoned timeline's model: the resumed run writes its own at its end
        move_into_place(output_dir / "final", superseded / "final")
    shutil.copyfile(path / "metrics.jsonl", output_dir / "metrics.jsonl")
    if (path / "samples.jsonl").exists():
        shutil.copyfile(path / "samples.jsonl", output_dir / "samples.jsonl")
    else:
        (output_dir / "samples.jsonl").unlink(missing_ok=True)
    folder = checkpoints_dir(output_dir)
    for newer in list_checkpoints(folder):
        if update_of(newer) > update and newer.resolve() != path.resolve() and owned_checkpoint(newer):
            move_into_place(newer, superseded / newer.name)
