"""ppo.padding_free against the padded forwards, alternating; prints JSON lines.

    python benchmarks/padding_free.py [--pairs 3] [--shape reviews] [--config budget] [--updates 3]
    python benchmarks/padding_free.py --in-process [--repeats 10] [--shape reviews] [--config budget]

--in-process: one process, one rollout of the task (captured from a real update), then stage 6 (every PPO epoch,
`optimise.ppo_epochs`, the weights left unmoved: learning rate 0) and stage 3 (`experience.reference_and_values`)
timed over the same episodes, padded and padding-free in turn, `--repeats` times each. The minimum and median of
each side: the minimum is the figure least moved by other work on a shared machine.

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


def in_process(shape: str, config_name: str, repeats: int) -> dict:
    import dataclasses
    import tempfile
    import time

    import torch

    sys.path.insert(0, str(HERE))
    import ppo_throughput

    from ppokit.trainer import PPOTrainer
    from ppokit.training import experience, optimise

    with tempfile.TemporaryDirectory(prefix="ppokit-bench-") as tmp:
        work = Path(tmp)
        if shape == "variable":
            config, task = ppo_throughput.variable_task(work, 1)
        else:
            config, task = ppo_throughput.fixed_task(work, 1, "llama", stopping=shape == "reviews")
        ppo_throughput.apply_switches(config, config_name, task["longest_row"])
        torch.manual_seed(0)
        trainer = PPOTrainer(config, show_progress=False)
        captured, optimise_once = [], trainer.optimise
        trainer.optimise = lambda rollout: captured.append(rollout) or optimise_once(rollout)
        trainer.step()
        rollout, model = captured[0], trainer.accelerator.unwrap_model(trainer.model)
        times: dict[bool, dict[str, list[float]]] = {False: {"training": [], "forward": []}, True: {"training": [], "forward": []}}
        shares = {}
        for repeat in range(repeats):
            for padding_free in ((False, True) if repeat % 2 == 0 else (True, False)):
                hp = dataclasses.replace(config.ppo, padding_free=padding_free)
                model.padding_free = padding_free
                optimizer = torch.optim.SGD([p for p in trainer.model.parameters() if p.requires_grad], lr=0.0)
                scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
                start = time.perf_counter()
                metrics = optimise.ppo_epochs(trainer.model, optimizer, scheduler, rollout, hp, trainer.sizes, trainer.strategy, lambda t: t)
                middle = time.perf_counter()
                experience.reference_and_values(rollout, model, trainer.parts.ref_model, rows=hp.local_rollout_forward_batch_size,
                                                packed=hp.max_tokens_per_micro_batch is not None, temperature=hp.temperature,
                                                chunk_size=config.lm_head_chunk_size, padding_free=padding_free)
                end = time.perf_counter()
                times[padding_free]["training"].append(middle - start)
                times[padding_free]["forward"].append(end - middle)
                shares[padding_free] = round(metrics["perf/padding_share"], 4)
    result = {"benchmark": "padding_free", "mode": "in_process", "shape": shape, "config": config_name, "repeats": repeats,
              "episodes": len(rollout), "load_average": [round(x, 2) for x in os.getloadavg()]}
    for name, side in (("padded", False), ("padding_free", True)):
        result[name] = {stage: {"min_s": round(min(values), 4), "median_s": round(statistics.median(values), 4)}
                        for stage, values in times[side].items()}
        result[name]["padding_share"] = shares[side]
    for stage in ("training", "forward"):
        result[f"{stage}_speedup_min"] = round(result["padded"][stage]["min_s"] / result["padding_free"][stage]["min_s"], 3)
        result[f"{stage}_speedup_median"] = round(result["padded"][stage]["median_s"] / result["padding_free"][stage]["median_s"], 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--shape", choices=("fixed", "reviews", "variable"), default="reviews")
    parser.add_argument("--config", default="budget", help="ppo_throughput.py's --config (cumulative switches)")
    parser.add_argument("--updates", type=int, default=3, help="timed updates per run (after one warm-up)")
    parser.add_argument("--in-process", action="store_true", help="time stages 6 and 3 over one rollout in one process")
    parser.add_argument("--repeats", type=int, default=10, help="--in-process: timings of each side")
    args = parser.parse_args()
    if args.in_process:
        print(json.dumps(in_process(args.shape, args.config, args.repeats)), flush=True)
        return
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
