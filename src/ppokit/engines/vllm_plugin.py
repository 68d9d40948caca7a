"""ppokit's vLLM plugin (pyproject.toml: the `vllm.general_plugins` entry point `ppokit`): vLLM calls `register` in
each of its processes (API server, engine core, workers), so the weight-transfer backend `gloo`
(`ppokit.engines.weight_transfer`) is known to a server started with vLLM's own CLI wherever ppokit is installed.
Light on purpose: it names the backend's classes by module path; their module is imported when a backend is made."""

from __future__ import annotations

BACKEND = "gloo"
MODULE = "ppokit.engines.weight_transfer"


def register() -> None:
    """Register `gloo` with vLLM's two weight-transfer factories (once per process: vLLM may load plugins again)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, cls in ((WeightTransferEngineFactory, "GlooWeightTransferEngine"),
                         (WeightTransferTrainerFactory, "GlooTrainerWeightTransferEngine")):
        if BACKEND not in factory._registry:
            factory.register_engine(BACKEND, MODULE, cls)
