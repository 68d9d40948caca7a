"""What a run's switches need of this machine, checked before any weights load (`check_machine`): a package (peft for
lora, bitsandbytes for quantization, a tracker's), a CUDA device (quantization, fp16), a compiler (compile), a writable
tracker store. Apart from `PPOConfig.validate`, which reads the config alone (`ppokit plan` plans for other machines)."""

from __future__ import annotations

from typing import Optional, Sequence

from ppokit.errors import UserError
from ppokit.process import allocator
from ppokit.process.strategies import STRATEGIES
from ppokit.metrics.trackers import check_usable

# The peft releases lora works with under transformers 5 (pyproject.toml's extras say the same; tests/test_config.py
# checks): before 0.15 an adapter on a critic that shares the policy's base fails ("Target module Identity() is not
# supported"); 0.16 and 0.17 do not import (they import transformers' HybridCache, gone in 5.0). A strategy may need
# newer ones (strategies.StrategyFacts.lora_peft).
PEFT_REQUIREMENT = "peft>=0.15,!=0.16.*,!=0.17.*"


def check_machine(*, lora: bool, quantization: Optional[str], fp16: bool, compile: bool, strategy: str,
                  report_to: Sequence[str], matmul_backend: str = "aten", cpu_allocator: Optional[str] = None) -> None:
    """One UserError line when a switch needs what this machine lacks. lora: whether `lora` is set; quantization,
    fp16, compile, report_to, matmul_backend, cpu_allocator: those keys; strategy: parallel.strategy (the peft its LoRA
    runs need)."""
    import torch

    if cpu_allocator is not None and not allocator.loaded(cpu_allocator):  # the program has started itself again with it (cli)
        allocator.preload_environment(cpu_allocator)  # not installed: that line first
        raise UserError(f"cpu_allocator: {cpu_allocator}: this process runs without it; `ppokit ppo` starts itself again with it, elsewhere (ppokit "
                        f"pipeline, a Python caller) start the interpreter with LD_PRELOAD naming lib{allocator.PRELOADS[cpu_allocator][0]}.so, or set "
                        "cpu_allocator: null")

    if lora:
        _check_peft(PEFT_REQUIREMENT, "lora")
        sharded = STRATEGIES[strategy].lora_peft
        if sharded is not None:
            _check_peft(sharded, f"lora under parallel.strategy: {strategy}")
    if quantization is not None:
        if not torch.cuda.is_available():
            raise UserError(
                f"quantization: {quantization} needs a CUDA device (bitsandbytes kernels) and this machine has none; "
                "set quantization: null (the plan command shows what fits without it)"
            )
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise UserError(f"quantization: {quantization} needs bitsandbytes: pip install 'ppokit[quantization]'") from None
    if fp16 and not torch.cuda.is_available():
        raise UserError("fp16: float16 mixed precision needs a CUDA device; use bf16: true on this machine")
    if compile:
        from ppokit.models.compiled import check_available

        check_available("cuda" if torch.cuda.is_available() else "cpu")
    if matmul_backend == "onednn":
        from ppokit.models.onednn import check_available as check_onednn

        check_onednn(cuda=torch.cuda.is_available(), mkldnn=torch.backends.mkldnn.is_available(), strategy=strategy)
    check_usable(report_to)  # a missing tracker package or an unwritable store is one line, not a late crash


def _check_peft(requirement: str, what: str) -> None:
    """A UserError unless the installed peft meets `requirement` (a pip requirement: `PEFT_REQUIREMENT`, a strategy's
    `lora_peft`), read from its metadata, as some releases that do not work fail on import. what: the setting, for the line."""
    from importlib import metadata

    from packaging.requirements import Requirement

    wanted = Requirement(requirement)
    try:
        installed = metadata.version("peft")
    except metadata.PackageNotFoundError:
        raise UserError("lora: needs the peft package: pip install 'ppokit[lora]'") from None
    if not wanted.specifier.contains(installed, prereleases=True):
        raise UserError(f"{what}: peft {installed} is installed and does not work with it (it needs {requirement}; "
                        f"docs/memory.md says why): pip install '{requirement}'")
