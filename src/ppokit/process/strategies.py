"""The parallel strategies (`parallel.strategy`), each declared once with its facts: the config's
checks, `ppokit plan`, checkpoints and `ppokit.process.parallel` all read this table, none names a strategy.

Torch-free (reading a config imports it); the classes that do the work are in ppokit.process.parallel,
named here by `implementation`. To add a strategy: one entry here, its class in ppokit.process.parallel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class StrategyFacts:
    name: str
    implementation: str  # the class in ppokit.process.parallel: built as cls(accelerator, settings, bf16=...)
    # Splits the trainable roles' weights, gradients and optimiser state 1/N per process (the frozen roles'
    # too with parallel.shard_frozen) and gathers whole units to run them: `ppokit plan` divides the
    # persistent memory by N and adds the gathered units on top.
    shards: bool
    # How its checkpoints hold weights and optimiser state: "plain" (ppokit.run.checkpoint.PlainWeights,
    # whole tensors from the main process) or "sharded" (parallel.ShardedWeights, DCP, every process its
    # shards). A checkpoint is read only under the layout that wrote it.
    checkpoint_weights: str
    # The parallel.* keys it reads; set under a strategy that does not read them, they are refused.
    keys: tuple[str, ...] = ()
    # Runs bf16 through a mixed-precision policy of its own (named here): accelerate adds no autocast, fp16 is refused.
    own_mixed_precision: Optional[str] = None
    holds_quantized: bool = True  # can hold bitsandbytes-quantised weights
    # The peft releases its LoRA runs need where narrower than lora's own (machine.PEFT_REQUIREMENT), as a pip
    # requirement; `machine.check_machine` refuses others before any weights load.
    lora_peft: Optional[str] = None


DEFAULT = "ddp"
STRATEGIES = {
    s.name: s
    for s in (
        StrategyFacts("ddp", implementation="Replicated", shards=False, checkpoint_weights="plain"),
        StrategyFacts(
            "fsdp", implementation="Sharded", shards=True, checkpoint_weights="sharded",
            keys=("shard_frozen", "cpu_offload", "wrap_classes", "unshard_for_generation"),
            own_mixed_precision="FSDP's MixedPrecisionPolicy", holds_quantized=False,
            # before 0.21 a LoRA model's forward reaches FSDP2's still-sharded embedding ("aten.embedding.default got
            # mixed torch.Tensor and DTensor"; measured with 0.18.0, 0.19.1, 0.20.0; 0.21.0 and 0.21.2 pass)
            lora_peft="peft>=0.21",
        ),
    )
}
NAMES = tuple(STRATEGIES)
# The strategy `ppokit plan` suggests when the models do not fit one device each.
SHARDING = next(s.name for s in STRATEGIES.values() if s.shards)
