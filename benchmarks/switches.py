"""Each speed switch alone and all together, against the defaults: runs of `ppo_throughput.py` in turn; prints JSON lines.

    python benchmarks/switches.py [--shape fixed|reviews|variable] [--rounds 3] [--updates N] [--variants default budget head padding_free all]

A round runs every variant once, one process each (so each peak RSS is its own), in an order rotated from round to
round, so that a change of the machine's load falls on every variant alike. Variants (`ppo_throughput.py --switches`):
  default       the defaults
  budget        ppo.max_tokens_per_micro_batch (half a fixed micro-batch's rows x the longest possible row)
  head          lm_head_chunk_size (the memory-light LM head)
  padding_free  ppo.padding_free
  all           the three together
Each run's line is printed as it ends; the last line holds, per variant, the median episodes/s and peak RSS and, per
round, its ratio to the default's run of the same round ("never loses" on a shape: every round's speed ratio >= 1
within the run-to-run spread). `episodes_per_cpu_s` counts this process's CPU time of the timed updates instead of
their wall time: on a machine shared with other work, run with OMP_NUM_THREADS=1, it is the figure the load changes least.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

VARIANTS = {"default": "", "budget": "budget", "head": "head", "padding_free": "padding_free", "all": "budget,head,padding_free"}


def run(shape: str, switches: str, updates: int | None) -> dict:
    command = [sys.executable, str(Path(__file__).parent / "ppo_throughput.py"), "--shape", shape]
    command += ["--switches", switches]
    if updates:
        command += ["--updates", str(updates)]
    out = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("fixed", "reviews", "variable"), default="fixed")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--updates", type=int, default=None, help="ppo_throughput.py's timed updates per run")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args()
    if "default" not in args.variants:
        parser.error("--variants: the default is the baseline of every ratio")
    results: dict[str, list[dict]] = {v: [] for v in args.variants}
    for r in range(args.rounds):
        order = args.variants[r % len(args.variants):] + args.variants[:r % len(args.variants)]
        for variant in order:
            line = run(args.shape, VARIANTS[variant], args.updates)
            results[variant].append(line)
            print(json.dumps({"round": r, "variant": variant, "episodes_per_s": line["episodes_per_s"], "peak_rss_mb": line["peak_rss_mb"],
                              "episodes_per_cpu_s": line["episodes_per_cpu_s"], "seconds_per_update": line["seconds_per_update"],
                              "padding_share": line["padding_share"]}), flush=True)
    summary = {}
    for variant, lines in results.items():
        summary[variant] = {}
        for key in ("episodes_per_s", "episodes_per_cpu_s", "peak_rss_mb"):
            values, base = [line[key] for line in lines], [line[key] for line in results["default"]]
            summary[variant][key] = statistics.median(values)
            summary[variant][key + "_ratio_by_round"] = [round(a / b, 3) for a, b in zip(values, base)]
    print(json.dumps({"benchmark": "switches", "shape": args.shape, "rounds": args.rounds, "summary": summary}))


if __name__ == "__main__":
    main()
