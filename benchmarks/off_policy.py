"""Off-policy rollouts: episodes/s of `rollout.max_staleness` 0, 1 and 2 with the vLLM engine beside the trainer
(`rollout.placement: separate`), single-turn and multi-turn; one JSON line per configuration.

    PYTHONPATH=src python benchmarks/off_policy.py [--staleness 0,1,2] [--kinds single,multi] [--size 50m] [--updates 4]

The model and the PPO update of benchmarks/rollout_engines.py (`--modes ppo`): its 50M Llama (hidden 768, 9 layers),
32 episodes per update in 2 minibatches, 1 PPO epoch, a critic of the policy's size, through the real trainer, here
with `rollout.engine: vllm`, `rollout.placement: separate` (a vLLM server process of its own, weights pushed through the
gloo backend after every update) and `ppo.rollout_is: tis` (every k, so that each runs the same loss). single: 32-token
responses, VADER sentiment; multi: the guessing game (`ppokit.environments:GuessNumber`), up to 4 turns of 8 tokens.

One warm-up update, then `updates` timed ones, then k more that are not timed: the timed updates are a long run's
steady state, each sampling ahead for a later one (a run's last k updates have nothing left to sample and would
flatter k >= 1; until 2026-12-03 they were timed). episodes_per_s is the timed updates' episodes over their summed
`time/update` (the wall time of the steps: with k >= 1 it holds the waits for episodes sampled ahead); seconds_each
that time per update; overlap_s the seconds per update that sampling ran while the trainer scored, forwarded and
trained (`time/overlap`), generation_wait_s what the update waited for its episodes. cpu_busy: per timed update, the
share of the whole machine's CPU time that was busy (/proc/stat; on a quiet machine, the trainer's and the server's
work); at_most_x_if_never_idle = 1 / its mean: the most any overlap of the same work could speed an update up on
this machine (every CPU busy all the time). load_avg: the machine's 1- and 5-minute load averages when the
configuration ended. Each configuration runs in a process of its own (the server's start is not timed), with the
CPU threads the `ppokit` program settles (passive OpenMP waiting, threads capped at a cgroup quota; the user's own
settings kept).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
from pathlib import Path

from ppokit.process import cpu_threads

# What the `ppokit` program sets before torch loads (ppokit/process/cpu_threads.py), here where the trainer runs through the API:
# without it, beside other busy processes, the synchronous update's (k = 0) OpenMP threads spun through their time
# slices: the small model's optimisation took 4-50 s instead of 0.2 s.
cpu_threads.settle()

from rollout_engines import PPO_EPISODES, demo_data, one_case, ppo_records, size_model  # noqa: E402

MULTI_TURNS, MULTI_TOKENS = 4, 8


def cpu_ticks() -> tuple[int, int]:
    """(busy, all) CPU ticks of the whole machine since boot (/proc/stat): busy is all but idle and iowait."""
    user, nice, system, idle, iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


class BusyPerUpdate:
    """The share of the machine's CPU time that was busy during each update of a run (an update ends when its record
    reaches the run's metrics.jsonl; polled every 0.05 s). Called with the run folder: a context manager around training."""

    def __init__(self):
        self.shares: list[float] = []

    @contextlib.contextmanager
    def __call__(self, run_folder: Path):
        stop = threading.Event()

        def poll():
            written, last = 0, cpu_ticks()
            while not stop.wait(0.05):
                try:
                    lines = (run_folder / "metrics.jsonl").read_bytes().count(b"\n")
                except OSError:
                    continue
                if lines > written:
                    now = cpu_ticks()
                    self.shares += [(now[0] - last[0]) / max(1, now[1] - last[1])] * (lines - written)
                    written, last = lines, now

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            yield
        finally:
            stop.set()
            poller.join()


def run(size: str, kind: str, k: int, updates: int) -> dict:
    import torch

    # k updates after the timed ones: their batches are the ones the timed updates sample ahead for, so that every timed
    # update overlaps (a run's last k updates have nothing left to sample and would flatter k >= 1)
    total = updates + k
    data, tokenizer = demo_data(PPO_EPISODES * (total + 1))
    overrides = ["rollout.engine=vllm", "rollout.placement=separate", f"rollout.max_staleness={k}", "ppo.rollout_is=tis"]
    prompts, sizes = data["prompts"], {}
    if kind == "multi":
        from ppokit.environments.guess import guess_rows

        prompts = guess_rows(0, PPO_EPISODES * (total + 1))
        overrides += ["environment=ppokit.environments:GuessNumber", "reward.functions=[]", f"rollout.max_turns={MULTI_TURNS}"]
        sizes = {"response_length": MULTI_TOKENS}
    busy = BusyPerUpdate()
    records, facts = ppo_records(lambda: size_model(size, tokenizer), tokenizer, prompts, overrides, updates=total, watch=busy, **sizes)
    timed = records[1:1 + updates]
    busy_share = sum(busy.shares[1:1 + updates]) / updates
    mean = lambda key: round(sum(r.get(key, 0.0) for r in timed) / len(timed), 3)  # noqa: E731
    return dict(benchmark="off_policy", kind=kind, max_staleness=k, size=size, parameters=facts["parameters"],
                episodes_per_update=PPO_EPISODES, updates_timed=len(timed),
                episodes_per_s=round(PPO_EPISODES * len(timed) / sum(r["time/update"] for r in timed), 3),
                seconds_per_update=mean("time/update"), seconds_each=[round(r["time/update"], 2) for r in timed], training_s=mean("time/training"),
                generation_wait_s=mean("time/generation"),
                overlap_s=[round(r.get("time/overlap", 0.0), 2) for r in timed],
                staleness_mean=[r.get("rollout/staleness_mean", 0.0) for r in timed],
                turns=mean("rollout/turns") if kind == "multi" else 1, threads=torch.get_num_threads(),
                cpu_busy=[round(x, 2) for x in busy.shares[1:1 + updates]], at_most_x_if_never_idle=round(1 / busy_share, 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--staleness", default="0,1,2")
    parser.add_argument("--kinds", default="single,multi")
    parser.add_argument("--size", default="50m")
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--one", nargs=2, metavar=("KIND", "K"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        result = run(args.size, args.one[0], int(args.one[1]), args.updates)
        print(json.dumps({**result, "load_avg": [round(x, 1) for x in os.getloadavg()[:2]]}), flush=True)
        return
    for kind in args.kinds.split(","):
        for k in args.staleness.split(","):
            one_case(__file__, [kind, k, "--size", args.size, "--updates", str(args.updates)], f"off_policy: {kind} k={k}")


if __name__ == "__main__":
    main()
