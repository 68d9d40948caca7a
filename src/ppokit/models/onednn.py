"""`matmul_backend: onednn`: every plain nn.Linear of the run's models through oneDNN's float32 kernel on a CPU.

On a CPU, torch's float32 `F.linear` calls MKL's sgemm; `torch.ops.mkldnn._linear_pointwise` computes the same
x @ W^T + b with oneDNN's kernels, which on some CPUs (AVX-512 ones measured in docs/speed.md) run the shapes of a small
language model 1.2-1.6x faster, forward and backward. The numbers differ from aten's only in summation order (float
rounding), so the switch is opt-in.

`linear` is the primitive (an autograd Function where gradients flow: forward and both gradients through the oneDNN
op; F.linear where none do); `route_linears`
points each plain `nn.Linear` of a model at it with an instance-level `forward`, which `copy.deepcopy`, `state_dict`,
`save_pretrained` and peft's LoRA layers (whose base_layer is a plain Linear) carry as they are. The memory-light LM head
and the direct head call the output embedding module, so they are routed with it. `check_available` is the start-up
refusal where it cannot apply. `onednn_linear` is the same op as an operator of its own (a compiled graph calls it
as it is) and `linear_for` picks it or `F.linear` for given inputs: the hf engine's compiled decoding step
(`engines/fast_decode.py`, `rollout.enforce_eager: false`) uses them.

Shapes (docs/speed.md, the `matmul_backend` section): oneDNN builds a primitive, with code compiled for it at run time,
for every shape it is called with, and keeps it in two caches (oneDNN's and ideep's, up to 1024 entries each): ~0.55 MB
per shape, taken from the heap whenever a new shape first comes. A run's row counts change from call to call (each
decoding step as rows finish, each micro-batch's tokens, each light-head chunk's tail), so the caches grew all run long
and their blocks, long-lived among the freed activations, kept glibc's heaps from shrinking or reusing their holes (the
variable-shape benchmark's peak RSS: 2.5 GB against aten's 1.3). So: the passes without gradients (sampling, the
reference and value pass) compute through F.linear, which keeps nothing per shape; in training the op computes
`bucket_rows(n, TRAINING_ROWS)` rows (zero rows added, their outputs dropped: 4 shapes per doubling of the row count,
most of them made in the first update); the backward takes the transposes of the weight and of the gradient as strided
views, not copies.
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
    graph calls it as it is. Its rows go by `bucket_rows` (the compiled decoding step calls it with every row count up to the batch's)."""
    return _op(x.reshape(-1, x.shape[-1]), weight, bias).reshape(*x.shape[:-1], weight.shape[0])


@onednn_linear.register_fake
def _(x, weight, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _onednn_linear_setup(ctx, inputs, output):
    x, weight, *bias = inputs  # bias: [] where the call left it out
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bool(bias) and bias[0] is not None


def _onednn_linear_backward(ctx, grad):
    """The products of `_OneDNNLinear.backward`, through the operator itself, so that a compiled graph's backward calls
    oneDNN as it is too (a traced backward cannot call the mkldnn op directly, so the operands are plain copies here):
    grad (..., M) -> grad_x = grad @ weight (..., K), grad_weight = grad^T @ x (M, K), grad_bias = grad summed over rows (M,)."""
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


EXACT_ROWS = 16  # row counts up to this are computed as they are (where no larger floor is asked for)
STEPS_PER_DOUBLING = 4  # above, rounded up to a multiple of 1/4 of the power of two below: under 25% more rows (docs/speed.md)
TRAINING_ROWS = 256  # the fewest rows a product with gradients is computed at: the light head's chunk, so its tails are one shape


def bucket_rows(rows: int, least: int = 1) -> int:
    """The row count oneDNN computes `rows` rows at: `least` where rows <= least; else rows itself up to EXACT_ROWS; else
    rows rounded up to the next multiple of 2^floor(log2(rows)) / STEPS_PER_DOUBLING, so that rows <= bucket <
    rows x (1 + 1 / STEPS_PER_DOUBLING) and there are STEPS_PER_DOUBLING buckets between two powers of two."""
    if rows <= max(least, EXACT_ROWS):
        return max(rows, least)
    step = (1 << (rows.bit_length() - 1)) // STEPS_PER_DOUBLING
    return -(-rows // step) * step


def _plain(weight: torch.Tensor) -> torch.Tensor:
    """weight (M, K) as oneDNN takes it without a copy: contiguous, or the transpose of a contiguous tensor (a view)."""
    return weight if weight.is_contiguous() or weight.t().is_contiguous() else weight.contiguous()


def _kernel(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's x2d (N, K) @ weight (M, K)^T + bias -> (N, M), at the shape given (x2d contiguous)."""
    return torch.ops.mkldnn._linear_pointwise(x2d, _plain(weight), bias, "none", [], "")


def _to_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t (N, C) with rows - N zero rows below -> (rows, C), contiguous."""
    return t.contiguous() if rows == t.shape[0] else F.pad(t, (0, 0, 0, rows - t.shape[0]))


def _first_rows(out: torch.Tensor, rows: int) -> torch.Tensor:
    """out (B, M) cut to its first `rows` rows: a tensor of its own (not a view), its storage out's."""
    return out if out.shape[0] == rows else out.resize_(rows, out.shape[1])


def _op(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, least: int = 1) -> torch.Tensor:
    """x2d (N, K) @ weight (M, K)^T + bias (M,) -> (N, M), by oneDNN over bucket_rows(N, least) rows (the rows added are
    zeros, their outputs dropped)."""
    rows = x2d.shape[0]
    return _first_rows(_kernel(_to_rows(x2d, bucket_rows(rows, least)), weight, bias), rows)


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, bias):
        ctx.save_for_backward(x2d, weight)
        ctx.has_bias = bias is not None
        return _op(x2d, weight, bias, TRAINING_ROWS)

    @staticmethod
    def backward(ctx, grad):
        x2d, weight = ctx.saved_tensors
        rows, k = x2d.shape
        need_x, need_w, need_b = ctx.needs_input_grad
        grad = _to_rows(grad, bucket_rows(rows, TRAINING_ROWS))  # (B, M): zero rows below add nothing to the sums over rows
        grad_x = _first_rows(_kernel(grad, weight.t(), None), rows) if need_x else None  # (B, M) @ (M, K); weight.t(): a view
        grad_w = None
        if need_w:  # (x^T (K, B) @ grad (B, M))^T = grad^T @ x: grad goes as a view; x^T is copied, with zero columns
            x_t = x2d.new_empty(k, grad.shape[0])
            x_t[:, :rows].copy_(x2d.t())
            x_t[:, rows:].zero_()
            grad_w = _kernel(x_t, grad.t(), None).t()
        grad_b = grad.sum(0) if need_b and ctx.has_bias else None
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear through oneDNN where gradients flow: x (..., K), weight (M, K), bias (M,) or None -> (..., M) =
    x @ weight^T + bias.

    Forward, grad_x = grad @ weight and grad_weight = (x^T @ grad)^T by oneDNN, over bucket_rows(rows, TRAINING_ROWS)
    rows (zero rows added); grad_bias = grad summed over rows. Without gradients (no_grad, inference_mode, nothing requiring grad:
    sampling, the reference and value pass), inputs the op does not take (not float32 on a CPU, mixed dtypes, no rows)
    and products under CPU autocast (which computes F.linear at lower precision): F.linear."""
    grads = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    if (not grads or x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.numel() == 0
            or (bias is not None and bias.dtype != torch.float32) or torch.is_autocast_enabled("cpu")):
        return F.linear(x, weight, bias)
    x2d = x.reshape(-1, x.shape[-1])
    if torch.compiler.is_compiling():  # the operator: inductor does not lower the mkldnn op itself (compile: true)
        return onednn_linear(x2d, weight, bias).reshape(*x.shape[:-1], weight.shape[0])
    out = _OneDNNLinear.apply(x2d, weight, bias)
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
