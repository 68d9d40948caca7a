"""Sampling speed and memory of the rollout engines (`rollout.engine`: hf, vllm); one JSON line per configuration.

    python benchmarks/rollout_engines.py [--sizes small,50m] [--engines hf,vllm] [--repeats 3]

Two Llamas built locally with head_dim 64 (vLLM's CPU attention needs >= 32) and the demo's word-level
vocabulary: `small` (hidden 128, 2 layers, 2 heads: ~0.3M parameters) and `50m` (hidden 768, 9 layers,
12 heads: ~50M). 64 prompts of the demo task x 64 new tokens, temperature 1, no stop token (every
row decodes all 64 tokens), float32. Each configuration runs in a process of its own; one warm-up
generate, then `repeats` timed ones: tokens_per_s is the median (best beside it). peak_rss_mb is the
process's peak (model, engine and KV cache included); sync_s (vllm) the median time of one
`sync_weights` (every weight sent into the running engine). vLLM on CPU: in-process, eager, KV cache
sized for the batch.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

SIZES = {"small": dict(hidden=128, layers=2, heads=2), "50m": dict(hidden=768, layers=9, heads=12)}
PROMPTS, NEW_TOKENS = 64, 64


def run_one(size: str, engine_name: str, repeats: int) -> dict:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from ppokit.demo import make_data
    from ppokit.engines.base import Sampling
    from ppokit.models import left_pad
    from ppokit.engines.hf import HFSampler
    from ppokit.tiny import tiny_causal_lm, word_tokenizer

    data = make_data(seed=0, n_sft=400, n_prompts=PROMPTS, n_eval=4)
    tokenizer = word_tokenizer(r["prompt"] + " " + r["completion"] for r in data["sft"])
    torch.manual_seed(0)
    model = tiny_causal_lm("llama", tokenizer, max_positions=256, **SIZES[size]).eval()
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in data["prompts"]]
    pad = tokenizer.pad_token_id
    sync_s = None
    if engine_name == "hf":
        query_ids, query_mask = left_pad(prompts, pad)
        sampler = HFSampler(model, NEW_TOKENS, 1.0, None, pad, batch_size=PROMPTS)

        def generate():
            return sampler.sample(query_ids, query_mask).loss_mask.sum().item()
    else:
        from ppokit.engines.vllm import VLLMEngine

        engine = VLLMEngine(model, pad, max(map(len, prompts)) + NEW_TOKENS, max_num_seqs=PROMPTS)
        sampling = Sampling(NEW_TOKENS, 1.0, None)

        def generate():
            return engine.generate(prompts, sampling).loss_mask.sum().item()

        syncs = []
        for _ in range(repeats):
            start = time.perf_counter()
            engine.sync_weights(model)
            syncs.append(time.perf_counter() - start)
        sync_s = round(statistics.median(syncs), 3)
    generate()  # warm-up
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = generate()
        rates.append(tokens / (time.perf_counter() - start))
    params = sum(p.numel() for p in model.parameters())
    return dict(engine=engine_name, size=size, parameters=params, prompts=PROMPTS, new_tokens=NEW_TOKENS,
                tokens_per_s=round(statistics.median(rates), 1), best_tokens_per_s=round(max(rates), 1),
                sync_s=sync_s, peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                threads=torch.get_num_threads())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="small,50m")
    parser.add_argument("--engines", default="hf,vllm")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", nargs=2, metavar=("SIZE", "ENGINE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(*args.one, args.repeats)), flush=True)
        return
    for size in args.sizes.split(","):
        for engine in args.engines.split(","):
            result = subprocess.run([sys.executable, __file__, "--one", size, engine, "--repeats", str(args.repeats)],
                                    capture_output=True, text=True)
            lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
            if result.returncode or not lines:
                print(f"rollout_engines: {size} {engine} failed:\n{result.stderr[-2000:]}", file=sys.stderr)
                continue
            print(lines[-1], flush=True)


if __name__ == "__main__":
    main()
