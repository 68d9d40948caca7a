"""The random states of this process (Python's, NumPy's, torch's CPU and CUDA generators): what a checkpoint
saves, and what building something that reseeds them (a vLLM engine) must put back."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch


def rng_state() -> dict:
    """RNG states of this process, as tensors and plain values (loadable with weights_only=True)."""
    version, keys, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "python": {"version": version, "state": torch.tensor(keys, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "name": np_name, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
            "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_gauss),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state((npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])


@contextlib.contextmanager
def kept():
    """Every random state of this process as it was before the block, whatever the block draws or reseeds."""
    saved = rng_state()
    try:
        yield
    finally:
        set_rng_state(saved)
