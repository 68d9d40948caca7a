"""A checkpoint's files read back, each one checked: a file that is missing, cut short or not what
ppokit wrote is a `DamagedCheckpoint` naming it and the checkpoint to fall back to, and
trainer_state.json is checked key by key. `checkpoint.read_checkpoint` puts these together."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch

from ppokit.config.schema import PPOConfig
from ppokit.config.fields import build, parse_yaml_text
from ppokit.errors import UserError
from ppokit.run.run_dir import CHECKPOINT_NAME, STATE_FILE, list_checkpoints

FORMAT = 1  # of trainer_state.json and the files beside it; this ppokit reads (and writes) only this one


class DamagedCheckpoint(UserError):
    """A checkpoint file is missing, cut short or not what ppokit wrote; names the file and the checkpoint to fall back to."""

    def __init__(self, path: Path, detail: str):
        earlier = [p for p in list_checkpoints(path.parent) if update_of(p) < update_of(path)]
        fallback = f"the previous complete one is {earlier[-1]}" if earlier else "there is no earlier complete checkpoint"
        first, *more = detail.splitlines() or [""]  # one line, whose end names the fallback (a config's unknown keys are a line each)
        super().__init__(f"checkpoint {path} is damaged: {' '.join([first, '; '.join(line.strip() for line in more)]).strip()}; {fallback}")


def update_of(path: Path) -> int:
    m = CHECKPOINT_NAME.match(Path(path).name)
    return int(m.group(1)) if m else -1


MANIFEST_TYPES = {"format": int, "num_updates": int, "processes": int, "data": dict, "kl_controller": dict, "versions": dict}


def read_manifest(path: Path) -> dict:
    file = path / STATE_FILE
    if not file.exists():
        raise UserError(f"{path}: not a complete checkpoint (no {STATE_FILE})")
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DamagedCheckpoint(path, f"{STATE_FILE}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("complete") is not True:
        raise UserError(f"{path}: not a complete checkpoint ({STATE_FILE} is not marked complete)")
    if manifest.get("format") != FORMAT:
        raise UserError(f"{path}: checkpoint format {manifest.get('format')!r}; this ppokit reads format {FORMAT}")
    for key, kind in MANIFEST_TYPES.items():
        value = manifest.get(key)
        if key not in manifest:
            raise DamagedCheckpoint(path, f"{STATE_FILE}: no {key}")
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < (1 if key == "processes" else 0)):
            raise DamagedCheckpoint(path, f"{STATE_FILE}: {key} is {value!r}, not a {'positive' if key == 'processes' else 'non-negative'} "
                                          f"{'integer' if kind is int else 'mapping'}")
    if not isinstance(manifest["kl_controller"].get("value"), (int, float)):
        raise DamagedCheckpoint(path, f"{STATE_FILE}: kl_controller.value is {manifest['kl_controller'].get('value')!r}, not a number")
    layout = manifest.get("parallel")
    if layout is not None and not (isinstance(layout, dict) and isinstance(layout.get("strategy"), str) and isinstance(layout.get("weights"), str)):
        raise DamagedCheckpoint(path, f"{STATE_FILE}: parallel is {layout!r}, not {{strategy, weights}}")
    if isinstance(manifest.get("update"), int) and manifest["update"] > manifest["num_updates"]:
        raise DamagedCheckpoint(path, f"{STATE_FILE}: update {manifest['update']} is past the run's {manifest['num_updates']} updates")
    return manifest


def read_config(path: Path) -> dict:
    file = path / "config.yaml"
    if not file.exists():
        raise DamagedCheckpoint(path, "config.yaml: missing")
    try:
        saved = parse_yaml_text(file.read_text(encoding="utf-8"), Path("config.yaml"))
        if not isinstance(saved, dict):
            raise UserError(f"config.yaml: {type(saved).__name__}, not a mapping of config keys")
        build(PPOConfig, saved)  # every key and value a config may hold; the comparison comes later
    except UnicodeDecodeError:
        raise DamagedCheckpoint(path, "config.yaml: not UTF-8 text") from None
    except UserError as e:
        detail = str(e) if str(e).startswith("config.yaml") else f"config.yaml: {e}"
        raise DamagedCheckpoint(path, detail) from None
    return saved


def read_jsonl(path: Path, name: str, required: bool) -> list[dict]:
    file = path / name
    if not file.exists():
        if required:
            raise DamagedCheckpoint(path, f"{name}: missing")
        return []
    records = []
    for number, line in enumerate(file.read_bytes().split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise DamagedCheckpoint(path, f"{name}: line {number} is not valid JSON (cut short?)") from None
        if not isinstance(record, dict):
            raise DamagedCheckpoint(path, f"{name}: line {number} is not a JSON object")
        records.append(record)
    return records


def open_torch(path: Path, name: str, keep: bool = False):
    """Check a torch.save file (mapped, not read); `keep`: load it for real (the small files)."""
    import zipfile

    file = path / name
    if not file.exists():
        raise DamagedCheckpoint(path, f"{name}: missing")
    if not zipfile.is_zipfile(file):
        raise DamagedCheckpoint(path, f"{name}: not a torch.save archive (cut short or overwritten)")
    try:
        loaded = torch.load(file, map_location="cpu", weights_only=True, mmap=not keep)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as e:
        raise DamagedCheckpoint(path, f"{name}: cannot be read ({str(e).splitlines()[0]})") from None
    return loaded if keep else None


def open_safetensors(path: Path, file: Path) -> None:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), "pt") as f:
            f.keys()
    except (SafetensorError, OSError) as e:
        raise DamagedCheckpoint(path, f"{file.relative_to(path)}: {e}") from None
