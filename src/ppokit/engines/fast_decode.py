"""`rollout.enforce_eager: false` with the hf engine: the lock-step decoder's decoding step written here for the Llama
family, its pieces compiled, its products through oneDNN on a CPU.

transformers' decoding step is a module call per norm, projection, activation and attention, with Python between them
(the mask, the rotary table, the cache's bookkeeping), and torch's float32 `linear` on a CPU calls MKL's sgemm, which
on this project's AMD machine runs at under half the rate of oneDNN's kernel for the same product (docs/speed.md).
`DecodeStep` computes the same step from the model's own weights, read at every call (so the optimiser's updates are
seen): each layer's part before attention (norm, query / key / value projections, rotary) and after it (output
projection, residual, norm, the SiLU-gated MLP, residual) are two functions compiled once for all layers (the weights
are arguments, the batch dimension dynamic: rows leaving the batch do not recompile); attention runs eagerly between
them (`scaled_dot_product_attention` over the filled columns of the lock-step decoder's in-place cache,
`hf._PreallocatedLayer`), as transformers' sdpa path calls it for one query a row. Only the decoding steps go through
it: the prompt's forward is transformers' own.

Its arithmetic is the eager step's, but its kernels round differently (fused element-wise code, another matrix
product): its logprobs equal the eager path's within float rounding, not bit for bit. The random stream is the
caller's (the draw is not here).

Where it applies (`why_not`): causal LMs whose decoder is Llama's (model types llama, mistral, qwen2) with full
attention in every layer, a rotary embedding fixed at load, SiLU, and plain `nn.Linear` projections (no LoRA or
quantised layers). The hf engine refuses `enforce_eager: false` elsewhere with one line.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ppokit.models.loading import unwrap_peft
from ppokit.models.onednn import linear_for

MODEL_TYPES = ("llama", "mistral", "qwen2")
ROPE_TYPES = ("default", "linear", "llama3")  # inverse frequencies fixed at load (dynamic / longrope change with the length)
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def why_not(model: nn.Module) -> Optional[str]:
    """None where `DecodeStep` computes the decoding step of `model` (a transformers causal LM, unwrapped), else why
    not, in a few words."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in MODEL_TYPES:
        return f"model type {kind!r} is not one of {', '.join(MODEL_TYPES)}"
    base = getattr(model, "model", None)
    if not isinstance(getattr(base, "layers", None), nn.ModuleList) or not isinstance(getattr(model, "lm_head", None), nn.Linear):
        return f"{type(model).__name__} is not decoder layers and an lm_head"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {config.hidden_act!r} (only silu)"
    if getattr(config, "sliding_window", None) and (kind == "mistral" or getattr(config, "use_sliding_window", False)):
        return "a sliding attention window"
    if set(getattr(config, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        return "layers other than full attention"
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in ROPE_TYPES:
        return f"rope_type {rope!r} (only {', '.join(ROPE_TYPES)})"
    for i, layer in enumerate(base.layers):
        for name in PROJECTIONS:
            module = layer.get_submodule(name)
            if type(module) is not nn.Linear:
                return f"layer {i}'s {name} is a {type(module).__name__}, not a plain nn.Linear (LoRA and quantised layers are not read)"
    return None


def before_attention(linear, x, norm_weight, eps: float, w_q, b_q, w_k, b_k, w_v, b_v, cos, sin, heads: int, kv_heads: int):
    """x: (n, H) a layer's input -> queries (n, kv_heads, heads / kv_heads, D) (each key/value head's queries together,
    as transformers packs them for one query a row), keys and values (n, kv_heads, 1, D): RMSNorm, the projections,
    rotary on queries and keys (cos, sin: (n, D))."""
    h = rms_norm(x, norm_weight, eps)
    q, k, v = linear(h, w_q, b_q), linear(h, w_k, b_k), linear(h, w_v, b_v)
    n = x.shape[0]
    q, k = q.view(n, heads, -1), k.view(n, kv_heads, -1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    d = q.shape[-1]
    return q.reshape(n, kv_heads, heads // kv_heads, d), k.unsqueeze(2), v.view(n, kv_heads, 1, d)


def after_attention(linear, x, attended, w_o, b_o, norm_weight, eps: float, w_gate, b_gate, w_up, b_up, w_down, b_down):
    """x: (n, H) the layer's input, attended: (n, heads x D) attention's output -> the layer's output (n, H)."""
    x = x + linear(attended, w_o, b_o)
    h = rms_norm(x, norm_weight, eps)
    return x + linear(F.silu(linear(h, w_gate, b_gate)) * linear(h, w_up, b_up), w_down, b_down)


def rms_norm(x, weight, eps: float):
    """Llama's RMSNorm: x (..., H) normalised in float32, back in x's dtype, times weight (H,)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecodeStep:
    """One decoding step of a Llama-family causal LM over the lock-step decoder's in-place cache, for any model
    `why_not` accepts (the compiled functions take the weights as arguments; compiled once, on the first call).

    compiled: False runs the same functions eagerly (tests; what compiling adds is measured against it).
    Called with (model, tokens (n,), positions (n,), attention_mask (n, L) including this step's column, cache: a
    transformers cache whose layers are `_PreallocatedLayer`s): writes each layer's new keys and values into the cache
    (column L - 1) and returns the logits (n, 1, V), what `models.forwards.causal_lm_step` returns for one token a row.
    """

    def __init__(self, compiled: bool = True):
        self.before, self.after = compiled_parts() if compiled else (before_attention, after_attention)

    def __call__(self, model, tokens: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor, cache) -> torch.Tensor:
        model = unwrap_peft(model)
        base, config = model.model, model.config
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        x = base.embed_tokens(tokens)
        cos, sin = rotary(base.rotary_emb, positions, x.dtype)
        mask = attention_mask.bool()[:, None, None, :]  # (n, 1, 1, L): the columns each row attends to
        linear = linear_for(x, base.layers[0].mlp.up_proj.weight)
        for layer, kv in zip(base.layers, cache.layers):
            attn, mlp = layer.self_attn, layer.mlp
            norm = layer.input_layernorm
            dynamic_rows(x, cos, sin)
            q, k, v = self.before(linear, x, norm.weight, norm.variance_epsilon, attn.q_proj.weight, attn.q_proj.bias, attn.k_proj.weight,
                                  attn.k_proj.bias, attn.v_proj.weight, attn.v_proj.bias, cos, sin, heads, kv_heads)
            keys, values = kv.update(k, v)
            attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling).reshape(x.shape[0], -1)
            norm = layer.post_attention_layernorm
            dynamic_rows(x, attended)
            x = self.after(linear, x, attended, attn.o_proj.weight, attn.o_proj.bias, norm.weight, norm.variance_epsilon, mlp.gate_proj.weight,
                           mlp.gate_proj.bias, mlp.up_proj.weight, mlp.up_proj.bias, mlp.down_proj.weight, mlp.down_proj.bias)
        head = model.lm_head  # through the same product as the layers' (a 32k vocabulary's head is most of a small model's step)
        return linear(rms_norm(x, base.norm.weight, base.norm.variance_epsilon), head.weight, head.bias).unsqueeze(1)


@functools.cache
def compiled_parts() -> tuple[Callable, Callable]:
    """`before_attention` and `after_attention` through torch.compile, made once a process (every `DecodeStep` shares
    them, and their graphs)."""
    return torch.compile(before_attention, dynamic=False), torch.compile(after_attention, dynamic=False)


def dynamic_rows(*tensors: torch.Tensor) -> None:
    """The first (row) dimension of these compiled functions' inputs is marked dynamic: one graph for every batch size
    the compaction of finished rows leaves (size 1, which torch specialises, gets one graph more)."""
    if tensors[0].shape[0] > 1:
        for t in tensors:
            torch._dynamo.mark_dynamic(t, 0)


def rotary(embedding: nn.Module, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (n,) -> cos, sin (n, D), as transformers' rotary embedding module computes them (its inverse
    frequencies and attention scaling)."""
    freqs = positions[:, None].float() * embedding.inv_freq.to(device=positions.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    scaling = embedding.attention_scaling
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)
