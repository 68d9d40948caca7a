"""The fixed shape's throughput for any checkout of ppokit, the old layouts included; prints one JSON line.

    OMP_NUM_THREADS=1 python benchmarks/fixed_shape_any_tree.py TREE [--budget N] [--updates 4] [--set ppo.key=JSON ...]

TREE: a checkout (its `src/` and its own `benchmarks/ppo_throughput.py` are imported, so the task is that tree's
`fixed_task`); the same model, data and config as `ppo_throughput.py`'s main configuration. `--budget N` sets
`ppo.max_tokens_per_micro_batch` (0: none), `--set` any other config key (a value in JSON). Unlike `ppo_throughput.py`
of trees before the switches (ea351f4: its `--config` fails there), it wraps only `run_update`, which every tree has.
Prints `episodes_per_cpu_s` (episodes over this process's CPU seconds of the timed updates), each update's CPU
seconds (the first a warm-up), the trainer's stage times and the last update's metrics (to compare learning).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tree")
    parser.add_argument("--budget", type=int, default=0)
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--set", action="append", default=[], help="key=JSON, e.g. compile=true or ppo.padding_free=true")
    args = parser.parse_args()
    sys.path[:0] = [str(Path(args.tree) / "src"), str(Path(args.tree) / "benchmarks")]
    import torch
    import ppo_throughput
    from ppokit.trainer import PPOTrainer

    with tempfile.TemporaryDirectory(prefix="ppokit-bench-") as tmp:
        config, task = ppo_throughput.fixed_task(Path(tmp), args.updates, "llama")
        if args.budget:
            config.ppo.max_tokens_per_micro_batch = args.budget
        for item in args.set:
            key, value = item.split("=", 1)
            *path, last = key.split(".")
            owner = config
            for name in path:
                owner = getattr(owner, name)
            setattr(owner, last, json.loads(value))
        torch.manual_seed(0)
        trainer = PPOTrainer(config, show_progress=False)
        cpu, run_update = [], trainer.run_update

        def timed_update():
            started = time.process_time()
            try:
                return run_update()
            finally:
                cpu.append(time.process_time() - started)
        trainer.run_update = timed_update
        records = trainer.train()
    timed = records[1:]
    stages = ("time/generation", "time/forward", "time/training", "time/update")
    print(json.dumps({
        "tree": args.tree, "budget": args.budget or None, "set": args.set, "torch_threads": torch.get_num_threads(),
        "episodes_per_cpu_s": round(task["batch"] * len(timed) / sum(cpu[1:]), 2), "cpu_s_per_update": [round(c, 3) for c in cpu],
        "seconds_per_update": {k: round(sum(r[k] for r in timed) / len(timed), 4) for k in stages if k in timed[0]},
        "last": {k: round(records[-1][k], 6) for k in ("objective/scores", "objective/kl", "loss/policy_avg", "loss/value_avg")},
    }))


if __name__ == "__main__":
    main()
