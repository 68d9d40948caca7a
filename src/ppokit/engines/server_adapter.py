"""The vLLM servers' copy of the policy's LoRA adapter (`rollout.lora_merge: false` with `rollout.placement` separate or
servers), as `engines.vllm.AdapterSync` is the colocated engine's: at every sync the adapter is written to a folder the
servers read, loaded on every server under the name of the weights' version, and the one it replaces unloaded and
deleted. Requests name the adapter by that name (`adapter_name`)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from torch import nn

from ppokit.engines.vllm import AdapterSync

ADAPTER_PREFIX = "policy-"


def adapter_name(version: int) -> str:
    """The name the servers hold the policy's adapter under, with the weights of `version` (AdapterSync's: one id a sync)."""
    return f"{ADAPTER_PREFIX}{version}"


class ServerAdapter:
    """The adapter's folders (one a sync, in a temporary folder of this engine's) and its loading on the servers."""

    def __init__(self, policy: nn.Module):
        self.sync = AdapterSync(policy, Path(tempfile.mkdtemp(prefix="ppokit-lora-")))

    def send(self, policy: nn.Module, version: int, client, rank: int) -> int:
        """The policy's adapter, written (every process: a sharded one is gathered) and loaded on every server through
        `client` (process 0) under the name of `version`, in place of the last one -> the bytes written."""
        sent, replaced = self.sync.write(policy)
        new = self.sync.request
        if new.lora_name != adapter_name(version):
            raise RuntimeError(f"rollout engine: adapter {new.lora_name} written for weights of version {version}")
        if rank == 0:
            client.swap_lora_adapter((new.lora_name, new.lora_path), replaced.lora_name if replaced is not None else None)
        if replaced is not None:  # the servers hold what they loaded in memory
            shutil.rmtree(replaced.lora_path, ignore_errors=True)
        return sent

    def close(self) -> None:
        shutil.rmtree(self.sync.folder, ignore_errors=True)
