"""ppo.padding_free against the padded forwards, alternating; prints JSON lines.

    python benchmarks/padding_free.py [--pairs 3] [--shape variable] [--config budget] [--updates 3]

Each pair runs `ppo_throughput.py` (one process each, so peak RSS is its own) with the same --shape and
--config, once padded and once with --padding-free, in turn, padded first in even pairs and packed first in odd
ones, so that a machine getting busier or quieter does not favour one side. One line per run (ppo_throughput's,
plus `padding_free`, the pair and the load average before it), then a summary line: the median episodes/s, peak
RSS and training seconds per update of each side, their ratios, the per-pair ratios (their spread says how
noisy the machine was) and the load averages seen.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(shape: str, config: str, updates: int, padding_free: bool) -> dict:
    command = [sys.executable, str(HERE / "ppo_throughput.py"), "--shape", shape, "--config", config, "--updates", str(updates)]
    if padding_free:
        command.append("--padding-free")
    load = os.getloadavg()[0]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    result = json.loads(out)
    result.update(padding_free=padding_free, load_before=round(load, 2))
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--shape", choices=("fixed", "reviews", "variable"), default="reviews")
    parser.add_argument("--config", default="budget", help="ppo_throughput.py's --config (cumulative switches)")
    parser.add_argument("--updates", type=int, default=3, help="timed updates per run (after one warm-up)")
    args = parser.parse_args()
    runs: dict[bool, list[dict]] = {False: [], True: []}
    ratios = []
    for pair in range(args.pairs):
        order = (False, True) if pair % 2 == 0 else (True, False)
        for padding_free in order:
            result = run(args.shape, args.config, args.updates, padding_free)
            result["pair"] = pair
            runs[padding_free].append(result)
            print(json.dumps(result), flush=True)
        ratios.append(runs[True][-1]["episodes_per_s"] / runs[False][-1]["episodes_per_s"])

    def median(side: bool, key: str, sub: str = "") -> float:
        return statistics.median(r[key][sub] if sub else r[key] for r in runs[side])

    summary = {"benchmark": "padding_free", "shape": args.shape, "config": args.config, "pairs": args.pairs}
    for name, side in (("padded", False), ("padding_free", True)):
        summary[name] = {"episodes_per_s": median(side, "episodes_per_s"), "peak_rss_mb": median(side, "peak_rss_mb"),
                         "training_s": median(side, "seconds_per_update", "training"),
                         "forward_s": median(side, "seconds_per_update", "reference_value_forward"),
                         "padding_share": median(side, "padding_share")}
    summary["speed_ratio_median"] = round(statistics.median(ratios), 3)
    summary["speed_ratio_per_pair"] = [round(r, 3) for r in ratios]
    summary["rss_ratio"] = round(summary["padding_free"]["peak_rss_mb"] / summary["padded"]["peak_rss_mb"], 3)
    summary["load_before_runs"] = [r["load_before"] for side in runs.values() for r in side]
    curves = [r["curve"] for r in runs[False][:1] + runs[True][:1]]
    summary["curves_equal_to_printed_digits"] = curves[0] == curves[1] if len(curves) == 2 else None
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
