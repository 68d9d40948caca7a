"""`matmul_backend: onednn`: every plain nn.Linear of the run's models through oneDNN's float32 kernel on a CPU.

On a CPU, torch's float32 `F.linear` calls MKL's sgemm; `torch.ops.mkldnn._linear_pointwise` computes the same
x @ W^T + b with oneDNN's kernels, which on some CPUs (AVX-512 ones measured in docs/speed.md) run the shapes of a small
language model 1.2-1.6x faster, forward and backward. The numbers differ from aten's only in summation order (float
rounding), so the switch is opt-in.

`linear` is the primitive (an autograd Function: forward and both gradients through the oneDNN op); `route_linears`
points each plain `nn.Linear` of a model at it with an instance-level `forward`, which `copy.deepcopy`, `state_dict`,
`save_pretrained` and peft's LoRA layers (whose base_layer is a plain Linear) carry as they are. The memory-light LM head
and the direct head call the output embedding module, so they are routed with it. `check_available` is the start-up
refusal where it cannot apply. `onednn_linear` is the same op as an operator of its own (a compiled graph calls it
as it is) and `linear_for` picks it or `F.linear` for given inputs: the hf engine's compiled decoding step
(`engines/fast_decode.py`, `rollout.enforce_eager: false`) uses them.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

BACKENDS = ("aten", "onednn")


@torch.library.custom_op("ppokit::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias) through oneDNN's kernel (float32 on a CPU), an operator of its own so that a compiled
    graph calls it as it is."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@onednn_linear.register_fake
def _(x, weight, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _onednn_linear_setup(ctx, inputs, output):
    x, weight, *bias = inputs  # bias: [] where the call left it out
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bool(bias) and bias[0] is not None


def _onednn_linear_backward(ctx, grad):
    """The products of `_OneDNNLinear.backward`, through the operator itself, so that a compiled graph's backward calls
    oneDNN as it is too: grad (..., M) -> grad_x = grad @ weight (..., K), grad_weight = grad^T @ x (M, K), grad_bias = grad
    summed over rows (M,)."""
    x, weight = ctx.saved_tensors
    need_x, need_w, *need_b = ctx.needs_input_grad
    grad2d = grad.reshape(-1, grad.shape[-1]).contiguous()
    grad_x = onednn_linear(grad2d, weight.t().contiguous()).reshape(x.shape) if need_x else None
    grad_w = onednn_linear(grad2d.t().contiguous(), x.reshape(-1, x.shape[-1]).t().contiguous()) if need_w else None
    grad_b = grad2d.sum(0) if ctx.has_bias and need_b[0] else None
    return (grad_x, grad_w, grad_b)[:len(ctx.needs_input_grad)]


onednn_linear.register_autograd(_onednn_linear_backward, setup_context=_onednn_linear_setup)


def linear_for(x: torch.Tensor, weight: torch.Tensor) -> Callable:
    """The product for these inputs: oneDNN's for float32 on a CPU with oneDNN (and no autocast, which would compute it at
    lower precision), else torch's `F.linear` (autocast applies to it as in the model's own forward)."""
    cpu_float32 = x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
    return onednn_linear if cpu_float32 and not torch.is_autocast_enabled("cpu") else F.linear


def _op(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2d (N, K) @ weight (M, K)^T + bias (M,) -> (N, M), by oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x2d.contiguous(), weight.contiguous(), bias, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, bias):
        ctx.save_for_backward(x2d, weight)
        ctx.has_bias = bias is not None
        return _op(x2d, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x2d, weight = ctx.saved_tensors
        grad = grad.contiguous()
        need_x, need_w, need_b = ctx.needs_input_grad
        grad_x = _op(grad, weight.t(), None) if need_x else None  # (N, M) @ (M, K) -> (N, K)
        grad_w = _op(grad.t(), x2d.t(), None) if need_w else None  # (M, N) @ (N, K) -> (M, K)
        grad_b = grad.sum(0) if need_b and ctx.has_bias else None
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear through oneDNN: x (..., K), weight (M, K), bias (M,) or None -> (..., M) = x @ weight^T + bias.

    Backward: grad_x = grad @ weight, grad_weight = grad^T @ x (both by the same op), grad_bias = grad summed over rows.
    Without gradients (no_grad, inference_mode, nothing requiring grad) the op is called directly. Inputs the op does
    not take (not float32 on a CPU, mixed dtypes, no rows) and products under CPU autocast (which computes F.linear at
    lower precision) go through F.linear."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.numel() == 0
            or (bias is not None and bias.dtype != torch.float32) or torch.is_autocast_enabled("cpu")):
        return F.linear(x, weight, bias)
    x2d = x.reshape(-1, x.shape[-1])
    grads = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    if torch.compiler.is_compiling():  # the operator: inductor does not lower the mkldnn op itself (compile: true)
        return onednn_linear(x2d.contiguous(), weight.contiguous(), bias).reshape(*x.shape[:-1], weight.shape[0])
    out = _OneDNNLinear.apply(x2d, weight, bias) if grads else _op(x2d, weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _routed_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, module.weight, module.bias)


def is_routed(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _routed_forward


def route_linears(model: nn.Module) -> int:
    """Make each module of `model` whose type is exactly nn.Linear compute through `linear` (an instance-level forward;
    the weights and the state_dict are untouched). Idempotent. -> how many Linear modules are routed now.
    Raises UserError where a Linear's weight is not float32 (the switch is for float32 CPU runs)."""
    from ppokit.errors import UserError

    routed = 0
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        if module.weight.dtype != torch.float32:
            raise UserError(f"matmul_backend: onednn runs float32 weights; {name or 'the model'} is {module.weight.dtype} (set matmul_backend: aten)")
        if not is_routed(module):
            module.forward = functools.partial(_routed_forward, module)
        routed += 1
    return routed


def check_available(*, cuda: bool, mkldnn: bool, strategy: str) -> None:
    """A UserError line where `matmul_backend: onednn` cannot apply: cuda (the run would train on a GPU), mkldnn
    (torch.backends.mkldnn.is_available()), strategy (parallel.strategy; fsdp's sharded weights are not checked with it)."""
    from ppokit.errors import UserError

    if cuda:
        raise UserError("matmul_backend: onednn is for CPU runs and this machine has a CUDA device; set matmul_backend: aten")
    if not mkldnn:
        raise UserError("matmul_backend: onednn needs torch built with oneDNN (torch.backends.mkldnn.is_available() is false); set matmul_backend: aten")
    if strategy == "fsdp":
        raise UserError("matmul_backend: onednn is not checked under parallel.strategy: fsdp; set matmul_backend: aten")
