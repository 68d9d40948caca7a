"""Episodes/s and peak RSS of PPO with a critic (gae) against critic-free GRPO, on the same prompts.

    python benchmarks/estimators.py [--updates 4] [--samples-per-prompt 4]

Each estimator runs `benchmarks/ppo_throughput.py` (its tiny Llama, 64 episodes per update,
16-token responses, 4 PPO epochs) in a fresh subprocess, so each peak RSS (ru_maxrss) belongs to
that run alone; both use n samples per prompt of the same prompts. grpo builds no value model:
no value forward in stage 3 and no value forward/backward in the PPO epochs. Prints one JSON line.
The children inherit the environment: on a machine shared with other work, OMP_NUM_THREADS=1 keeps
torch's threads from spinning against each other (with 2 threads on a busy 2-core machine an
update was 20x slower).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

THROUGHPUT = Path(__file__).with_name("ppo_throughput.py")


def run(estimator: str, n: int, updates: int) -> dict:
    command = [sys.executable, str(THROUGHPUT), "--updates", str(updates), "--estimator", estimator, "--samples-per-prompt", str(n)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{estimator}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--updates", type=int, default=4, help="updates to time per estimator, after one warm-up update")
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    args = parser.parse_args()
    n = args.samples_per_prompt
    runs = {name: run(name, n, args.updates) for name in ("gae", "grpo")}
    keep = ("episodes_per_s", "peak_rss_mb", "seconds_per_update")
    result = {
        "benchmark": "estimators",
        "samples_per_prompt": n,
        "episodes_per_update": runs["gae"]["episodes_per_update"],
        "updates_timed": runs["gae"]["updates_timed"],
        "parameters_m": runs["gae"]["parameters_m"],
        "torch_threads": runs["gae"]["torch_threads"],
        **{name: {k: r[k] for k in keep} for name, r in runs.items()},
        "grpo_vs_gae_episodes_per_s": round(runs["grpo"]["episodes_per_s"] / runs["gae"]["episodes_per_s"], 3),
        "grpo_vs_gae_peak_rss": round(runs["grpo"]["peak_rss_mb"] / runs["gae"]["peak_rss_mb"], 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
