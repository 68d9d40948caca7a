"""What a lean training forward of the Llama family would save on the fixed shape's micro-batch; prints one JSON line.

    OMP_NUM_THREADS=1 python benchmarks/lean_forward.py [--repeats 60] [--onednn]

A measurement, not a feature: ppokit's training forward calls the transformers model, whose every norm, projection,
attention and MLP is a module call with Python between them (the mask, the rotary table, keyword arguments, output
objects). `lean_backbone` below computes the same backbone from the model's own weights with no module calls (the
embedding, RMSNorm, rotary, `scaled_dot_product_attention` with the causal and padding mask the model builds, the
SiLU-gated MLP, the final norm), the element-wise pieces the decoding step of `engines/fast_decode.py` uses, eagerly.

It trains the fixed task two updates (as `micro_batch_cost.py` does), keeps the first micro-batch the optimisation saw,
and calls `optimise.micro_batch_backward` on it (the policy's forward, loss and backward, then the critic's) for each
variant in turn, `--repeats` rounds, in this process's CPU time:

  default      the transformers models (the policy's logits at the R + 1 positions that predict the response)
  lean         both backbones lean; the policy's logits from its own LM head at the same positions
  lean_route   both backbones lean, passed as `backbone_fn` (the policy through the backbone + head route)
  hf_route     the transformers backbones passed as `backbone_fn`: what that route costs apart from the backbone
  compile      `compile: true`'s compiled transformers backbones (`models.compiled`; the first call compiles)

For each: the median ms, the median of the per-round ratios to default, and the gradients' largest difference from
default's relative to the largest gradient. --onednn routes every nn.Linear through oneDNN (`matmul_backend: onednn`)
for all of them, the lean forwards' products too (compile left out: `matmul_backend: onednn` does not go with it).
`pieces` times each piece of one layer alone (forward + backward on the micro-batch's shape, ms a call) and how many a
micro-batch runs (2 models x 4 layers).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import micro_batch_cost  # noqa: E402

from ppokit.engines.fast_decode import rms_norm, rotate_half  # noqa: E402
from ppokit.models import onednn  # noqa: E402
from ppokit.models.compiled import compiled_backbone  # noqa: E402
from ppokit.training import algo, optimise  # noqa: E402


class _Output:
    __slots__ = ("last_hidden_state",)

    def __init__(self, hidden: torch.Tensor):
        self.last_hidden_state = hidden


def lean_backbone(base: torch.nn.Module, linear=F.linear):
    """base: a LlamaModel (the backbone) -> a callable with its call (input_ids, attention_mask (B, L) 0/1, position_ids)
    returning an object whose last_hidden_state (B, L, H) is the backbone's, within float rounding."""
    config = base.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads

    def layer_forward(x, layer, cos, sin, mask):
        attn, mlp = layer.self_attn, layer.mlp
        n, width, _ = x.shape
        h = rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
        q = linear(h, attn.q_proj.weight, attn.q_proj.bias).view(n, width, heads, -1).transpose(1, 2)
        k = linear(h, attn.k_proj.weight, attn.k_proj.bias).view(n, width, kv_heads, -1).transpose(1, 2)
        v = linear(h, attn.v_proj.weight, attn.v_proj.bias).view(n, width, kv_heads, -1).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling, enable_gqa=True)
        x = x + linear(attended.transpose(1, 2).reshape(n, width, -1), attn.o_proj.weight, attn.o_proj.bias)
        h = rms_norm(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
        return x + linear(F.silu(linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias)) * linear(h, mlp.up_proj.weight, mlp.up_proj.bias),
                          mlp.down_proj.weight, mlp.down_proj.bias)

    def run(input_ids, attention_mask, position_ids, use_cache=False):
        x = base.embed_tokens(input_ids)
        freqs = position_ids[..., None].float() * base.rotary_emb.inv_freq
        emb = torch.cat((freqs, freqs), -1)
        scaling = base.rotary_emb.attention_scaling
        cos, sin = (emb.cos() * scaling).to(x.dtype)[:, None], (emb.sin() * scaling).to(x.dtype)[:, None]
        width = input_ids.shape[1]
        mask = torch.ones(width, width, dtype=torch.bool, device=x.device).tril() & attention_mask.bool()[:, None, None, :]
        for layer in base.layers:
            x = layer_forward(x, layer, cos, sin, mask)
        return _Output(rms_norm(x, base.norm.weight, base.norm.variance_epsilon))

    return run


def lean_logprobs(policy, backbone):
    """A stand-in for `optimise.response_logprobs` (its direct branch: logits at the R + 1 last positions) over the lean
    backbone."""
    from ppokit.models.forwards import position_ids_from_mask

    def response_logprobs(model, input_ids, attention_mask, response_ids, trained_mask, temperature, *, with_entropy=False,
                          entropy_grad=False, **_):
        R = response_ids.shape[1]
        hidden = backbone(input_ids, attention_mask.long(), position_ids_from_mask(attention_mask)).last_hidden_state
        logits = policy.lm_head(hidden[:, -R - 1:])[:, :-1]
        logprobs, entropy = algo.logprobs_and_entropy(logits, response_ids, temperature, entropy_grad)
        keep = trained_mask.bool()
        return logprobs.masked_fill(~keep, 0.0), entropy.masked_fill(~keep, 0.0)

    return response_logprobs


def pieces(mb_shape: tuple[int, int], config, repeats: int) -> dict:
    """Each piece of one layer alone, forward + backward at the micro-batch's shape: (ms a call, calls a micro-batch)."""
    n, width = mb_shape
    H, heads, kv, inter = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    D = H // heads
    grad = dict(requires_grad=True)
    x, w = torch.randn(n, width, H, **grad), torch.ones(H, **grad)
    q, k, v = torch.randn(n, heads, width, D, **grad), torch.randn(n, kv, width, D, **grad), torch.randn(n, kv, width, D, **grad)
    g, u = torch.randn(n, width, inter, **grad), torch.randn(n, width, inter, **grad)
    cos, sin = torch.randn(n, 1, width, D), torch.randn(n, 1, width, D)
    mask = torch.ones(width, width, dtype=torch.bool).tril().expand(n, 1, width, width)
    weights = {name: (torch.randn(*shape) * 0.05).requires_grad_() for name, shape in
               dict(q=(H, H), k=(kv * D, H), v=(kv * D, H), o=(H, H), g=(inter, H), u=(inter, H), d=(H, inter)).items()}
    layers = 2 * config.num_hidden_layers
    cases = {
        "rms_norm": (lambda: (rms_norm(x, w, 1e-6),), 2 * layers + 2),
        "rotary (queries and keys)": (lambda: (q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin), layers),
        "sdpa attention": (lambda: (F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),), layers),
        "silu(gate) * up": (lambda: (F.silu(g) * u,), layers),
        "residual add": (lambda: (x + x,), 2 * layers),
        "q, k, v, o products": (lambda: tuple(F.linear(x, weights[name]) for name in "qkvo"), layers),
        "gate, up, down products": (lambda: (F.linear(x, weights["g"]), F.linear(x, weights["u"]), F.linear(g, weights["d"])), layers),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, (fn, _) in cases.items():
            started = time.process_time()
            torch.autograd.backward([out.sum() for out in fn()])
            times[name].append(time.process_time() - started)
    out = {}
    for name, (_, calls) in cases.items():
        ms = sorted(times[name])[len(times[name]) // 2] * 1000
        out[name] = {"ms_per_call": round(ms, 3), "calls_per_micro_batch": calls, "ms_per_micro_batch": round(ms * calls, 2)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--onednn", action="store_true", help="every nn.Linear through oneDNN (matmul_backend: onednn), lean products too")
    args = parser.parse_args()
    backward_of = optimise.micro_batch_backward
    model, mb, hp, normalisers, scale, backward, separately = micro_batch_cost.first_micro_batch()
    policy, critic = model.policy, model.value_model
    linear = F.linear
    if args.onednn:
        onednn.route_linears(policy)
        onednn.route_linears(critic)
        linear = onednn.linear
    lean = (lean_backbone(policy.model, linear), lean_backbone(critic.model, linear))
    own_logprobs = optimise.response_logprobs

    @contextlib.contextmanager
    def variant(name):
        backbones = {"lean": (None, lean[1]), "lean_route": lean, "hf_route": (policy.model, critic.model), "compile": compiled}.get(name, (None, None))
        model.__dict__["backbones"] = backbones
        if name == "lean":
            optimise.response_logprobs = lean_logprobs(policy, lean[0])
        try:
            yield
        finally:
            model.__dict__["backbones"] = (None, None)
            optimise.response_logprobs = own_logprobs

    compiled = (compiled_backbone(policy), compiled_backbone(critic))
    params = list(model.parameters())

    def run(name) -> list:
        with variant(name):
            backward_of(model, mb, hp, normalisers, scale, backward, separately)
        grads = [p.grad.clone() if p.grad is not None else None for p in params]
        model.zero_grad(set_to_none=True)
        return grads

    names = ("default", "lean", "lean_route", "hf_route") + (() if args.onednn else ("compile",))  # onednn's op does not compile
    times, _, gaps = micro_batch_cost.in_turn(run, names, args.repeats)
    middle = args.repeats // 2
    result = {
        "benchmark": "lean_forward", "rows_x_width": list(mb.input_ids.shape), "torch_threads": torch.get_num_threads(), "onednn": args.onednn,
        "variants": {name: {
            "ms": round(sorted(times[name])[middle] * 1000, 2),
            "speedup": round(sorted(d / t for d, t in zip(times["default"], times[name]))[middle], 3),
            "grad_rel_gap": float(f"{gaps[name]:.3g}"),
        } for name in names},
        "pieces": pieces(tuple(mb.input_ids.shape), policy.config, max(args.repeats * 3, 30)),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
