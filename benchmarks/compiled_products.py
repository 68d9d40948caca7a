"""`compile: true` with and without `matmul_backend: onednn` on the fixed shape's training micro-batch; prints one JSON line.

    OMP_NUM_THREADS=1 python benchmarks/compiled_products.py [--repeats 40]

Trains `ppo_throughput.py`'s fixed task one update (as `micro_batch_cost.py` does), keeps the first micro-batch the
optimisation saw, and calls `optimise.micro_batch_backward` on it (the policy's forward, loss and backward, then the
critic's) with four copies of the models, round by round in this process's CPU time:

  default         eager, torch's F.linear
  compile         the backbones compiled (`models.compiled`), F.linear
  onednn          eager, every plain nn.Linear routed through oneDNN (`models.onednn.route_linears`)
  compile_onednn  both: the compiled backbones call the `ppokit::onednn_linear` operator, forward and backward

For each: the median ms, the medians of the per-round ratios to default and to compile, the CPU seconds of the first
call (the compile), and the gradients' largest difference from default's relative to the largest gradient.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import micro_batch_cost  # noqa: E402

from ppokit.models import onednn  # noqa: E402
from ppokit.training import optimise  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    model, mb, *rest = micro_batch_cost.first_micro_batch()
    models = {"default": model, "compile": copy.deepcopy(model), "onednn": copy.deepcopy(model), "compile_onednn": copy.deepcopy(model)}
    for name in ("onednn", "compile_onednn"):
        onednn.route_linears(models[name].policy)
        onednn.route_linears(models[name].value_model)
    for name in ("compile", "compile_onednn"):
        models[name].use_compiled_backbones()

    def run(name) -> list:
        pair = models[name]
        optimise.micro_batch_backward(pair, mb, *rest)
        grads = [p.grad.clone() if p.grad is not None else None for p in pair.parameters()]
        pair.zero_grad(set_to_none=True)
        return grads

    times, first_call, gaps = micro_batch_cost.in_turn(run, list(models), args.repeats)
    middle = args.repeats // 2
    median_ratio = lambda base, name: round(sorted(b / t for b, t in zip(times[base], times[name]))[middle], 3)  # noqa: E731
    print(json.dumps({
        "benchmark": "compiled_products", "rows_x_width": list(mb.input_ids.shape), "torch_threads": torch.get_num_threads(),
        "variants": {name: {"ms": round(sorted(times[name])[middle] * 1000, 2), "speedup_vs_default": median_ratio("default", name),
                            "speedup_vs_compile": median_ratio("compile", name), "first_call_cpu_s": round(first_call[name], 1),
                            "grad_rel_gap": float(f"{gaps[name]:.3g}")} for name in models},
    }))


if __name__ == "__main__":
    main()
