"""The rollout engines on one GPU (issue 22, "On a GPU"): a ~0.5B Llama, bf16, `rollout.engine: vllm` (with
`rollout.sleep: true`) against `hf`, a few PPO updates each; one JSON line per engine. hf measured on one H200
(docs/rollout.md, "On a GPU"); the vLLM cases not yet run (the machine lent had no vLLM).

    pip install -e ".[vllm]"          # once, on the GPU machine: ppokit and upstream vLLM (its CUDA torch with it)
    python benchmarks/gpu_engines.py [--engines vllm,hf] [--updates 4] [--episodes 64] [--response-length 128]
    python benchmarks/gpu_engines.py --dry-run     # anywhere (no GPU, no vLLM): the model and the configs, printed

The model: a Llama built from a config (nothing from a hub) with the demo's word-level vocabulary, hidden 1024,
32 layers, 16 heads (head_dim 64, 8 key/value heads), MLP 4096: 0.50B parameters, its weights saved in
bfloat16 and trained with `bf16: true`. The updates are `benchmarks/rollout_engines.py`'s PPO mode
(`ppo_config`): `episodes` per update in 2 minibatches, 1 PPO epoch, `response_length` tokens without a
stop token, VADER sentiment as the reward, a critic of the policy's size; `updates` timed updates after
one warm-up. Each engine runs in a process of its own. Per line: episodes_per_s (timed updates),
seconds_per_update by stage, peak GPU memory as torch counts it (torch.cuda.max_memory_allocated /
max_memory_reserved: the trainer's tensors, and vLLM's where they come from torch's allocator) and as
nvidia-smi sees it (memory.used sampled every 0.2 s: everything, vLLM's KV cache included), and the
engine-vs-trainer logprob difference. vLLM takes `rollout.gpu_memory_utilization` (default 0.3) of the
GPU; with sleep it frees its weights and KV cache while the trainer optimises.

Off-policy (issue 30, "on a GPU"): `--engines vllm-k0,vllm-k1` runs the same updates with the vLLM server on GPUs
the trainer does not use (`rollout.placement: separate`: the trainer on the first GPU, the server on the others, so
it needs two or more), `ppo.rollout_is: tis`, `rollout.max_staleness` 0 then 1; k more updates run after the timed
ones so that every timed update samples ahead (a long run's steady state). The goal: vllm-k1's episodes_per_s >=
1.8x vllm-k0's; overlap_s shows the seconds per update that sampling ran beside training.

Expected wall time on one H200: under 5 minutes for both engines (the first vllm update includes nothing
of the engine's start; `first_update_s` and `wall_s` show what the start cost).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rollout_engines  # noqa: E402

MODEL = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=8,
             max_position_embeddings=512, tie_word_embeddings=True)
OFF_POLICY_KEYS = ["rollout.engine=vllm", "rollout.placement=separate", "ppo.rollout_is=tis"]  # the server on GPUs of its own
STALENESS = {"vllm-k0": 0, "vllm-k1": 1}  # the off-policy cases: rollout.max_staleness
ENGINE_KEYS = {"vllm": ["rollout.engine=vllm", "rollout.sleep=true"], "hf": ["rollout.engine=hf"],
               **{case: OFF_POLICY_KEYS + [f"rollout.max_staleness={k}"] for case, k in STALENESS.items()}}
COMMON_KEYS = ["bf16=true"]


def model_config(tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                       bos_token_id=tokenizer.bos_token_id, **MODEL)


def parameter_count(config) -> int:
    """Without allocating any weight (the meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def build_model(config):
    """Random weights drawn on the GPU (seconds, where the CPU would take a minute), stored in bfloat16."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(config).to(torch.bfloat16)


class NvidiaSmiPeak:
    """The most memory.used (MiB) nvidia-smi reported for the visible GPU, polled every `every` seconds in a thread."""

    def __init__(self, every: float = 0.2):
        import os

        self.gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
        self.every, self.peak, self.error = every, 0, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", f"--id={self.gpu}", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10).stdout
                self.peak = max(self.peak, int(out.split()[0]))
            except (OSError, ValueError, IndexError, subprocess.SubprocessError) as e:
                self.error = f"{type(e).__name__}: {e}"
            self._stop.wait(self.every)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_engine(engine: str, args) -> dict:
    import torch

    start = time.perf_counter()
    # k updates after the timed ones, not timed: each timed update then samples ahead, as in a long run
    k = STALENESS.get(engine, 0)
    data, tokenizer = rollout_engines.demo_data(args.episodes * (args.updates + k + 1))
    config = model_config(tokenizer)
    smi = NvidiaSmiPeak()
    records, facts = rollout_engines.ppo_records(
        lambda: build_model(config), tokenizer, data["prompts"], ENGINE_KEYS[engine] + COMMON_KEYS, updates=args.updates + k,
        episodes=args.episodes, response_length=args.response_length)
    records = records[:1 + args.updates]
    smi_peak = smi.stop()
    return dict(benchmark="gpu_engines", engine=engine, device=torch.cuda.get_device_name(), **facts,
                overrides=ENGINE_KEYS[engine] + COMMON_KEYS, response_length=args.response_length,
                **rollout_engines.ppo_figures(records, args.episodes),
                torch_max_allocated_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                torch_max_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2),
                nvidia_smi_peak_gib=round(smi_peak / 1024, 2), nvidia_smi_error=smi.error, wall_s=round(time.perf_counter() - start, 1),
                overlap_s=[round(r.get("time/overlap", 0.0), 2) for r in records[1:]],
                staleness_mean=[r.get("rollout/staleness_mean", 0.0) for r in records[1:]])


def dry_run(args) -> None:
    """The model and each engine's validated config, as the real run would build them; nothing loads or trains."""
    data, tokenizer = rollout_engines.demo_data(args.episodes * (args.updates + 1))
    config = model_config(tokenizer)
    for engine in args.engines.split(","):
        ppo = rollout_engines.ppo_config("<model>", "<prompts.jsonl>", "<run>", ENGINE_KEYS[engine] + COMMON_KEYS, updates=args.updates,
                                         episodes=args.episodes, response_length=args.response_length)
        print(json.dumps(dict(benchmark="gpu_engines", dry_run=True, engine=engine, parameters=parameter_count(config),
                              model={k: getattr(config, k) for k in ("vocab_size", *MODEL)}, prompts=len(data["prompts"]),
                              config=ppo.to_dict())), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="vllm,hf")
    parser.add_argument("--updates", type=int, default=4, help="timed updates per engine, after one warm-up update")
    parser.add_argument("--episodes", type=int, default=64, help="episodes per update")
    parser.add_argument("--response-length", type=int, default=128)
    parser.add_argument("--dry-run", action="store_true", help="print the model and the configs; load and train nothing")
    parser.add_argument("--one", metavar="ENGINE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = set(args.engines.split(",")) - set(ENGINE_KEYS)
    if unknown:
        parser.error(f"--engines: unknown {', '.join(sorted(unknown))} (choose from {', '.join(ENGINE_KEYS)})")
    if args.dry_run:
        dry_run(args)
        return 0
    if args.one:
        print(json.dumps(run_engine(args.one, args)), flush=True)
        return 0
    failed = 0
    for engine in args.engines.split(","):
        sizes = ["--updates", str(args.updates), "--episodes", str(args.episodes), "--response-length", str(args.response_length)]
        failed += not rollout_engines.one_case(__file__, [engine, *sizes], f"gpu_engines: {engine}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
