"""The policy's full weights, one tensor at a time, under the names of a plain transformers checkpoint:
what an engine holding its own copy of the policy (vLLM) is sent after every optimiser update.

What is gathered depends on how the trainer holds the policy; one function each:
  `local_tensor`     ddp (or one process): every process holds whole weights; sent as they are.
  `gathered_tensor`  fsdp: a weight is a DTensor sharded over the processes; it is gathered whole just
                     before it is sent and dropped after, so a process never holds the whole model
                     twice (its shards + one full weight at a time). Every process must walk the
                     weights in the same order (each all-gather is a collective): each owns an engine.
  `policy_weights`   the walk: a LoRA policy's adapted layers are sent merged (W + scale * B @ A of
                     the policy's adapter only; the shared critic's `value` adapter and its head are
                     not the policy's and are never sent); every other parameter as it is.
  `base_weights`     the same walk with the adapted layers' base weights unmerged, and `adapter_weights` the
                     policy's adapter alone under peft's checkpoint names: what an engine serving the
                     adapter as a LoRA (rollout.lora_merge: false) is sent once, and after every update.
A tied weight (embed_tokens = lm_head) is sent once, under its first name.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from ppokit.errors import UserError
from ppokit.models.loading import POLICY_ADAPTER, unwrap_peft


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """ddp / one process: the weight itself."""
    return tensor.detach()


def gathered_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """fsdp: the whole weight, all-gathered from every process's shard (a collective)."""
    return tensor.detach().full_tensor()


def gather_for(tensor: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The gathering function for the way `tensor` is held."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed
        return local_tensor
    return gathered_tensor if isinstance(tensor, DTensor) else local_tensor


def unwrap(policy: nn.Module) -> nn.Module:
    """The policy without DistributedDataParallel's wrapper."""
    return policy.module if isinstance(policy, nn.parallel.DistributedDataParallel) else policy


def architecture(model: nn.Module) -> str:
    """The model's class name as transformers names it (what vLLM looks architectures up by): under fsdp,
    FSDP2's fully_shard swaps the module's class for a subclass named FSDP<Class>; the class it wraps."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without distributed
        return type(model).__name__
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)).__name__


def policy_weights(policy: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) for every parameter of the causal LM `policy` (a transformers model, or a
    peft model over one), in module order; a LoRA layer's weight merged with the policy's adapter."""
    return _walk(policy, _merged_lora_layer, lambda name, param: (name, gather_for(param)(param)))


def base_weights(policy: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`policy_weights` with each LoRA layer's base weight (and bias) as it is, the adapter left out."""
    def base_layer(name, layer):
        yield from _tensors(name, layer.base_layer)

    return _walk(policy, base_layer, lambda name, param: (name, gather_for(param)(param)))


def adapter_weights(policy: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy adapter's lora_A / lora_B weights of every LoRA layer, in module order, named as peft saves them
    (`base_model.model.<module>.lora_A.weight`): what vLLM reads as a LoRA adapter. The critic's adapter is not sent."""
    def adapter(name, layer):
        if POLICY_ADAPTER not in layer.lora_A:
            return
        _check_servable(name, layer)
        for part in ("lora_A", "lora_B"):
            weight = getattr(layer, part)[POLICY_ADAPTER].weight
            yield f"base_model.model.{name}.{part}.weight", gather_for(weight)(weight)

    return _walk(policy, adapter, lambda name, param: None, others=False)


def policy_weight_metadata(policy: nn.Module) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, whole shape) of what `policy_weights` yields, in the same order, without gathering or merging
    anything (a sharded weight's shape is its whole shape): what a push announces before it sends."""
    def merged(name, layer):
        weight = layer.base_layer.weight
        yield f"{name}.weight", weight.dtype, tuple(weight.shape)
        if getattr(layer.base_layer, "bias", None) is not None:
            yield f"{name}.bias", layer.base_layer.bias.dtype, tuple(layer.base_layer.bias.shape)

    return list(_walk(policy, merged, lambda name, param: (name, param.dtype, tuple(param.shape))))


def _walk(policy: nn.Module, lora_layer: Callable, parameter: Callable, others: bool = True) -> Iterator:
    """The policy's parameters in module order, each once (a tied weight under its first name): `lora_layer(name,
    layer)` for a peft LoRA layer (its sub-modules skipped), `parameter(name, param)` for every other parameter
    (others: False, none of them)."""
    policy = unwrap(policy)
    base = unwrap_peft(policy)
    seen: set[int] = set()
    inside_lora: list[str] = []  # prefix of the LoRA layer whose sub-modules are being skipped
    for name, module in base.named_modules():
        if inside_lora and name.startswith(inside_lora[0] + "."):
            continue
        inside_lora.clear()
        if _is_lora_layer(module):
            inside_lora.append(name)
            yield from lora_layer(name, module)
            continue
        if not others:
            continue
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            yield parameter(_join(name, pname), param)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _is_lora_layer(module: nn.Module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "base_layer")


def _merged_lora_layer(name: str, layer: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A peft LoRA layer -> its base layer's weight with the policy adapter merged in, and its bias.
    W' = W + scaling * (B @ A), transposed for a fan_in_fan_out base (GPT-2's Conv1D): what peft's
    merge_adapter computes, here without touching the model."""
    base_layer = layer.base_layer
    weight = gather_for(base_layer.weight)(base_layer.weight)
    if POLICY_ADAPTER in layer.lora_A:
        _check_servable(name, layer)
        a, b = layer.lora_A[POLICY_ADAPTER].weight, layer.lora_B[POLICY_ADAPTER].weight
        delta = gather_for(b)(b).float() @ gather_for(a)(a).float() * layer.scaling[POLICY_ADAPTER]
        if getattr(layer, "fan_in_fan_out", False):
            delta = delta.T
        weight = (weight.float() + delta).to(weight.dtype)
    yield f"{name}.weight", weight
    if getattr(base_layer, "bias", None) is not None:
        yield f"{name}.bias", gather_for(base_layer.bias)(base_layer.bias)


def _tensors(name: str, module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A plain layer's weight and bias, whole."""
    yield f"{name}.weight", gather_for(module.weight)(module.weight)
    if getattr(module, "bias", None) is not None:
        yield f"{name}.bias", gather_for(module.bias)(module.bias)


def _check_servable(name: str, layer: nn.Module) -> None:
    """A policy LoRA layer the engine can take, merged or as an adapter: plain LoRA (no DoRA) on a linear layer."""
    if getattr(layer, "use_dora", {}).get(POLICY_ADAPTER, False):
        raise UserError("rollout.engine: vllm: a DoRA adapter (lora.use_dora) cannot be sent to the engine; use plain LoRA or rollout.engine: hf")
    if layer.lora_A[POLICY_ADAPTER].weight.dim() != 2:
        raise UserError(f"rollout.engine: vllm: LoRA on {name} ({type(layer.base_layer).__name__}) cannot be sent to the engine; "
                        "adapt linear layers only (lora.target_modules) or use rollout.engine: hf")


PUSH_BUCKET_BYTES = 256 * 2**20  # what one push holds at a time on either side (an engine in another process)


def bucket_bounds(sizes: Sequence[int], bucket_bytes: int) -> list[range]:
    """Consecutive index ranges of tensors of `sizes` bytes, each holding as many tensors as fit in `bucket_bytes`
    (one tensor larger than that alone): how both sides cut one push's stream, from its metadata alone.
    E.g. sizes [4, 4, 4, 9, 1], bucket_bytes 8 -> [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]."""
    bounds, start, held = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and held + size > bucket_bytes:
            bounds.append(range(start, i))
            start, held = i, 0
        held += size
    if start < len(sizes):
        bounds.append(range(start, len(sizes)))
    return bounds


def tensor_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    numel = 1
    for n in shape:
        numel *= int(n)
    return numel * dtype.itemsize
