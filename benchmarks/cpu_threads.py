"""CPU threads beside other work (ppokit/process/cpu_threads.py); prints one JSON line per setting and number of busy processes.

    python benchmarks/cpu_threads.py [--busy 0 4] [--hidden 64] [--updates 6] [--settings torch ppokit one-thread]

Each line times one workload in a fresh process: an "update" of a tiny Llama (hidden --hidden, 2 layers, 2000-token
vocabulary): 32 prompts of 16 tokens sampled 16 new tokens with the KV cache, then 4 AdamW steps on the 32 rows of 32
tokens (2 epochs of 2 minibatches), as a PPO update does on CPU. The first update is a warm-up. Beside it run --busy
processes that only spin (as `yes > /dev/null`), started before and stopped after. Settings:

  torch      torch's defaults: as many threads as CPUs seen, OpenMP's default waiting (spinning)
  ppokit     what the `ppokit` program sets (cpu_threads.settle: passive waiting; threads capped at a cgroup quota)
  one-thread OMP_NUM_THREADS=1

`slowdown` is s_per_update over the same setting's with no busy process in this invocation (when --busy has 0).
load_avg is /proc/loadavg's first two figures at the start and end of the line's run: figures measured on a machine
shared with other work are of that load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

WORKLOAD = r"""
import json, sys, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM

hidden, updates = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=max(1, hidden // 32),
                     num_key_value_heads=max(1, hidden // 64), vocab_size=2000, max_position_embeddings=256)
model = LlamaForCausalLM(config)
optimizer = torch.optim.AdamW(model.parameters(), 1e-4)
prompts = torch.randint(3, 2000, (32, 16))


def update():
    model.eval()
    with torch.no_grad():
        past, ids, rows = None, prompts, [prompts]
        for _ in range(16):
            out = model(ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            ids = torch.multinomial(torch.softmax(out.logits[:, -1].float(), -1), 1)
            rows.append(ids)
    sequences = torch.cat(rows, 1)
    model.train()
    for _ in range(2):
        for half in sequences.split(16):
            loss = model(half, labels=half).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()


update()
start = time.perf_counter()
for _ in range(updates):
    update()
print(json.dumps({"s_per_update": (time.perf_counter() - start) / updates, "threads": torch.get_num_threads()}))
"""


def environment(setting: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    if setting == "ppokit":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
        from ppokit.process import cpu_threads

        cpu_threads.settle(env)
    elif setting == "one-thread":
        env["OMP_NUM_THREADS"] = "1"
    return env


def load() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:2]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 4])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--updates", type=int, default=6)
    parser.add_argument("--settings", nargs="+", default=["torch", "ppokit", "one-thread"], choices=["torch", "ppokit", "one-thread"])
    parser.add_argument("--timeout", type=float, default=900, help="seconds one line may take (a collapsed run is reported as such)")
    args = parser.parse_args()
    alone = {}
    for busy in args.busy:
        for setting in args.settings:
            spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
            try:
                before = load()
                start = time.perf_counter()
                try:
                    result = subprocess.run([sys.executable, "-c", WORKLOAD, str(args.hidden), str(args.updates)], env=environment(setting),
                                            capture_output=True, text=True, timeout=args.timeout, check=True)
                    line = json.loads(result.stdout.strip().splitlines()[-1])
                except subprocess.TimeoutExpired:
                    line = {"s_per_update": None, "threads": None, "timed_out_after_s": args.timeout}
            finally:
                for spinner in spinners:
                    spinner.kill()
                    spinner.wait()
            if busy == 0:
                alone[setting] = line["s_per_update"]
            base = alone.get(setting)
            slowdown = round(line["s_per_update"] / base, 2) if base and line["s_per_update"] else None
            print(json.dumps({"benchmark": "cpu_threads", "setting": setting, "busy": busy, "hidden": args.hidden, "cpus": os.cpu_count(),
                              **{k: round(v, 4) if isinstance(v, float) else v for k, v in line.items()}, "slowdown": slowdown,
                              "wall_s": round(time.perf_counter() - start, 1), "load_avg": [before, load()]}), flush=True)


if __name__ == "__main__":
    main()
