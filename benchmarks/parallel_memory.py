"""Per-process memory of 1 process, 2 processes under ddp and 2 processes under fsdp, and episodes/s.

The same PPO run three ways, at the same global batch (16 episodes per update): one process; two
processes under `parallel.strategy: ddp` (every process holds everything); two under `fsdp` (FSDP2
shards the trainable policy and critic, and the frozen reference). The model is a Llama of 23M
parameters (hidden 512, 8 layers, vocabulary ~8k) built from a config; the reward is VADER
sentiment. For each process it reports:

- training_state_mib: its parameters + gradients (at their peak, just before each optimiser step) +
  AdamW state, counted from the tensors it holds (under fsdp: its shards). Expected: fsdp ~ ddp / 2.
- weights_mib: every weight it holds, trainable and frozen (reference included).
- peak_rss_mib: the process's peak resident memory (ru_maxrss), imports and buffers included.

Two-process runs launch with `torchrun --nproc_per_node 2` on gloo (CPU). Prints one JSON line.
Timings from a shared machine are noise; memory counts are not. Usage:

    python benchmarks/parallel_memory.py [--updates 2] [--response-length 16]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_lora import build  # noqa: E402  (the same 23M-parameter Llama and prompts)

BATCH = 16  # global episodes per update, the same in every mode
MODES = {
    "one_process": (1, "ddp"),
    "ddp_2": (2, "ddp"),
    "fsdp_2": (2, "fsdp"),
}


def mib(n: float) -> float:
    return round(n / 2**20, 1)


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def nbytes(tensors) -> int:
    return sum(local(t).numel() * t.element_size() for t in tensors)


def child(strategy: str, model_dir: str, prompts: str, output: str, updates: int, response_length: int) -> None:
    import torch

    from ppokit.config.schema import PPOConfig
    from ppokit.config.fields import load_config
    from ppokit.trainer import PPOTrainer

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = load_config(PPOConfig, data={
        "model": model_dir, "output_dir": output, "seed": 0,
        "reward": {"functions": ["sentiment"]}, "data": {"train": prompts},
        "ppo": {"total_episodes": BATCH * updates, "per_device_train_batch_size": BATCH // 2 // world, "num_mini_batches": 2,
                "num_ppo_epochs": 2, "response_length": response_length, "temperature": 1.0, "learning_rate": 1e-4,
                "num_sample_generations": 0, "local_rollout_forward_batch_size": BATCH, "nonfinite_rollback": False},
        "parallel": {"strategy": strategy},
    })
    trainer = PPOTrainer(config, show_progress=False)
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    peak_grads = [0]

    def count_grads(optimizer, args, kwargs):
        peak_grads[0] = max(peak_grads[0], nbytes(p.grad for p in trainable if p.grad is not None))

    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # under ddp: accelerate's wrapper
    optimizer.register_step_pre_hook(count_grads)
    start = time.perf_counter()
    records = trainer.train()
    elapsed = time.perf_counter() - start
    held = {id(p): p for m in (trainer.model, trainer.ref_model) if m is not None for p in m.parameters()}
    optimizer_state = nbytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    row = {
        "rank": trainer.accelerator.process_index,
        "training_state_mib": mib(nbytes(trainable) + peak_grads[0] + optimizer_state),
        "params_mib": mib(nbytes(trainable)), "grads_mib": mib(peak_grads[0]), "optimizer_mib": mib(optimizer_state),
        "weights_mib": mib(nbytes(held.values())),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "episodes_per_s": round(BATCH * len(records) / elapsed, 2),
    }
    print("BENCH " + json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--response-length", type=int, default=16)
    parser.add_argument("--child", nargs=4, metavar=("STRATEGY", "MODEL", "PROMPTS", "OUTPUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.updates, args.response_length)
        return
    torchrun = shutil.which("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "ACCELERATE_USE_CPU": "true"}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, prompts = build(Path(tmp))
        from transformers import AutoConfig

        from ppokit.plan import _dtype, _stats

        model_config = AutoConfig.from_pretrained(model_dir)
        params = _stats(model_config, False, _dtype(model_config), None)[0]
        for mode, (processes, strategy) in MODES.items():
            launcher = [sys.executable] if processes == 1 else [torchrun, "--nproc_per_node", str(processes)]
            cmd = [*launcher, __file__, "--updates", str(args.updates), "--response-length", str(args.response_length),
                   "--child", strategy, str(model_dir), str(prompts), str(Path(tmp) / mode)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            if out.returncode:
                raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
            rows = sorted((json.loads(line[6:]) for line in out.stdout.splitlines() if line.startswith("BENCH ")), key=lambda r: r["rank"])
            results[mode] = {"processes": processes, "strategy": strategy, "per_process": rows}
    ddp, fsdp = results["ddp_2"]["per_process"][0], results["fsdp_2"]["per_process"][0]
    print(json.dumps({
        "benchmark": "parallel_memory", "model": "llama hidden 512, 8 layers", "params": params,
        "vocab": model_config.vocab_size, "updates": args.updates, "episodes_per_update": BATCH,
        "response_length": args.response_length, **results,
        "fsdp_over_ddp_training_state": round(fsdp["training_state_mib"] / ddp["training_state_mib"], 3),
    }))


if __name__ == "__main__":
    main()
