"""A profile of one PPO update: each stage's share of the update's wall time, and each stage against its arithmetic floor.

    python benchmarks/profile_update.py [--shape fixed|reviews|variable] [--config default|budget|light|compile] [--padding-free]
                                        [--updates 4] [--repeats 3] [--table FILE]

Runs `ppo_throughput.py`'s task (the same model, data, config and switches: `--shape fixed --config default` is the
benchmark's main configuration) through `PPOTrainer.train()`, with 1 warm-up update, `--updates` timed ones and one more
under torch.profiler. Nothing in ppokit is changed: the stages are timed from outside, by wrapping the functions the
trainer looks up at every update (`trainer.sampler.episodes`, `rollout.score`, `experience.reference_and_values`,
`experience.rewards`, `experience.advantages`, `trainer.optimise`, `trainer.step`, `trainer.run_update`, the sinks'
`record`, `objective_metrics`, `evaluation.scored_rows`, the checkpoint writers). The trainer's own `time/*` metrics are
reported beside them (the wrappers' figures agree with them where both exist).

Stages (seconds per update, medians over the timed updates; `share` of the loop's wall time per update):
  sampling          stage 1: the rollout engine's generation (trainer.sampler.episodes)
  scoring           stage 2: the reward sources (rollout.score) and the stage's checks
  reference_values  stage 3: reference logprobs and values (experience.reference_and_values)
  rewards           stage 4: the per-token KL penalty and the scores (experience.rewards)
  advantages        stage 5: experience.advantages
  optimise          stage 6: the PPO epochs (trainer.optimise: forwards, backwards, optimiser steps, the loss statistics)
  step_other        the rest of `step` between stages (the batch bookkeeping of stage 1, trained_on, the learning rates)
  metrics           stage 7 inside `step`: objective_metrics, the KL controller, the samples' rows (evaluation.scored_rows)
  guard             `run_update` around `step`: the non-finite guard's snapshot and random states
  logging           the sinks' record (metrics.jsonl, console, ...)
  loop_other        the rest of the run loop's iteration (stop signals, eval samples when due, checkpoints when due)
The checkpoint and final model written once at the end are reported apart (`end_of_run_save_s`).

Floor: the FLOPs of the matrix multiplications each stage must do on the real tokens (2 x weights x tokens per
forward, twice that for a backward: the weights of every nn.Linear, the output head counted only at the response
positions it must score, the embedding lookup as free; attention's two products, 2 x layers x hidden x T^2 per
causal sequence of T tokens), over the machine's matmul rate (a 1024 x 1024 float32 torch.matmul, measured before
and after the run, on one thread and on the run's threads; the floor takes the best seen). `ratio` = measured / floor. On a machine shared with
other work the wall times grow with the load; with one torch thread (OMP_NUM_THREADS=1) each stage's CPU time of this
process is reported too (`cpu_s`), and `cpu_ratio` sets it against the one-thread matmul rate in CPU time: what the
load changes least. Stages without model
arithmetic (scoring with a reward function, rewards, advantages, the bookkeeping) have no floor.

The profiled update (the last) wraps the largest stage in torch.profiler; its top operators by self CPU time go to
`--table` (default: stderr). With `--repeats N` the script runs itself N times, one process each, in turn, and prints
the per-run figures and their medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if __name__ == "__main__":  # what the `ppokit` program sets before torch loads (docs/speed.md, "CPU threads"); OMP_NUM_THREADS set is kept
    from ppokit.process import cpu_threads

    cpu_threads.settle()

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import ppo_throughput  # noqa: E402

import ppokit.trainer as trainer_module  # noqa: E402
from ppokit.training import evaluation, experience  # noqa: E402
from ppokit.trainer import PPOTrainer  # noqa: E402

STAGES = ("sampling", "scoring", "reference_values", "rewards", "advantages", "optimise", "step_other", "metrics", "guard",
          "logging", "loop_other")
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
PROFILED = {"sampling": "sampler.episodes", "reference_values": "experience.reference_and_values", "optimise": "trainer.optimise",
            "scoring": "rollout.score"}


def matmul_gflops(threads: int, n: int = 1024, repeats: int = 5, clock=time.perf_counter) -> float:
    """The best rate of an n x n float32 matmul on `threads` threads, GFLOP/s of `clock` (wall, or time.process_time:
    this process's CPU time, which a loaded machine's waiting does not count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.matmul(a, b)
        best = float("inf")
        for _ in range(repeats):
            start = clock()
            torch.matmul(a, b)
            best = min(best, clock() - start)
        return 2 * n**3 / max(best, 1e-9) / 1e9
    finally:
        torch.set_num_threads(before)


def matmul_rates() -> dict[str, float]:
    return {"one_thread": matmul_gflops(1), "run_threads": matmul_gflops(torch.get_num_threads()),
            "one_thread_cpu_time": matmul_gflops(1, clock=time.process_time)}


def linear_weights(model: torch.nn.Module) -> tuple[int, int]:
    """(weights of every nn.Linear but the output head, the output head's) of a causal LM or a value model."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_weights = head.weight.numel() if isinstance(head, torch.nn.Linear) else 0
    body = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    return body, head_weights


def attention_shape(model: torch.nn.Module) -> tuple[int, int]:
    config = model.config
    return config.num_hidden_layers, config.hidden_size


def forward_flops(model: torch.nn.Module, lengths: list[int], scored: int) -> float:
    """One forward over sequences of `lengths` real tokens, the output head at `scored` positions (0 for a value model,
    whose one-output head is counted in the body)."""
    body, head = linear_weights(model)
    layers, hidden = attention_shape(model)
    tokens = sum(lengths)
    return 2.0 * body * tokens + 2.0 * head * scored + 2.0 * layers * hidden * sum(t * t for t in lengths)


class Profile:
    """Wraps the trainer's stage functions; keeps each update's stage seconds and token counts."""

    def __init__(self, trainer: PPOTrainer, warmup: int, timed: int, table):
        self.trainer, self.warmup, self.timed, self.table = trainer, warmup, timed, table
        self.updates: list[dict] = []  # per update: stage -> seconds, and its token counts
        self.loop_starts: list[float] = []
        self.end_save = 0.0
        self.profiled_stage = None
        self.top_operators, self.matmul_share = {}, None  # of the profiled stage: operators' shares of its self CPU time
        self.current: dict = {}
        wrap = self._wrap
        trainer.sampler.episodes = wrap(trainer.sampler.episodes, "sampling")
        trainer.batches.rollout.score = wrap(trainer.batches.rollout.score, "scoring")
        self._originals = [(experience, "reference_and_values"), (experience, "rewards"), (experience, "advantages"),
                           (evaluation, "scored_rows"), (trainer_module, "objective_metrics"), (trainer_module, "open_sinks")]
        self._saved = [(owner, name, getattr(owner, name)) for owner, name in self._originals]
        experience.reference_and_values = self._counting(wrap(experience.reference_and_values, "reference_values"))
        experience.rewards = wrap(experience.rewards, "rewards")
        experience.advantages = wrap(experience.advantages, "advantages")
        evaluation.scored_rows = wrap(evaluation.scored_rows, "metrics")
        trainer_module.objective_metrics = wrap(trainer_module.objective_metrics, "metrics")
        open_sinks = trainer_module.open_sinks

        def timed_sinks(*args, **kwargs):
            sinks = open_sinks(*args, **kwargs)
            sinks.record = wrap(sinks.record, "logging")
            return sinks
        trainer_module.open_sinks = timed_sinks
        trainer.optimise = wrap(trainer.optimise, "optimise")
        trainer.step = wrap(trainer.step, "step")
        run_update = trainer.run_update

        def timed_run_update():
            self.loop_starts.append((time.perf_counter(), time.process_time()))
            self.current = {}
            self.updates.append(self.current)
            return wrap(run_update, "run_update")()
        trainer.run_update = timed_run_update
        save_checkpoint, save_final = trainer.save_checkpoint, trainer.save_final
        trainer.save_checkpoint = self._end_save(save_checkpoint, "checkpoint")
        trainer.save_final = self._end_save(save_final, "final")

    def restore(self) -> None:
        for owner, name, original in self._saved:
            setattr(owner, name, original)

    def _end_save(self, method, name):
        def run(*args, **kwargs):
            if len(self.updates) < self.trainer.sizes.num_updates:  # one due under save_steps: the loop's
                return self._wrap(method, "checkpoint")(*args, **kwargs)
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.end_save += time.perf_counter() - start
        return run

    def _wrap(self, function, stage: str):
        def run(*args, **kwargs):
            record = self.current  # the sinks' record of an update comes after its run_update, before the next
            profiling = self.profiled_stage is not None and PROFILED.get(stage) == self.profiled_stage and len(self.updates) == self.warmup + self.timed + 1
            start, cpu = time.perf_counter(), time.process_time()
            try:
                if profiling:
                    from torch.profiler import ProfilerActivity, profile
                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        result = function(*args, **kwargs)
                    print(f"# torch.profiler: {self.profiled_stage} ({stage}) of one update, top operators by self CPU time", file=self.table)
                    averages = prof.key_averages()
                    print(averages.table(sort_by="self_cpu_time_total", row_limit=30), file=self.table)
                    whole = sum(e.self_cpu_time_total for e in averages) or 1.0
                    top = sorted(averages, key=lambda e: -e.self_cpu_time_total)[:10]
                    self.top_operators = {e.key: round(e.self_cpu_time_total / whole, 4) for e in top}
                    self.matmul_share = round(sum(e.self_cpu_time_total for e in averages if e.key in MATMULS) / whole, 4)
                    return result
                return function(*args, **kwargs)
            finally:
                record[stage] = record.get(stage, 0.0) + time.perf_counter() - start
                record[stage + "/cpu"] = record.get(stage + "/cpu", 0.0) + time.process_time() - cpu
                if stage == "run_update" and len(self.updates) == self.warmup + self.timed:
                    self.profiled_stage = PROFILED[self.largest_profilable()]
        return run

    def _counting(self, function):
        def run(episodes, model, ref_model, **kwargs):
            mask, width = episodes.attention_mask, episodes.query_ids.shape[1]
            self.current["lengths"] = mask.sum(1).tolist()
            self.current["response_tokens"] = int(mask[:, width:].sum())
            self.current["trained_tokens"] = int(episodes.loss_mask.sum())
            self.current["prompt_tokens"] = int(mask[:, :width].sum())
            self.current["policy_logprobs"] = bool(kwargs.get("policy_logprobs"))
            return function(episodes, model, ref_model, **kwargs)
        return run

    def largest_profilable(self) -> str:
        seconds = self.stage_seconds()
        return max(PROFILED, key=lambda s: seconds[s])

    def stage_seconds(self, clock: str = "") -> dict[str, float]:
        """Median seconds per update of each stage over the timed updates; clock "/cpu": this process's CPU seconds."""
        rows = self.per_update(clock)
        return {stage: statistics.median(r[stage] for r in rows) for stage in STAGES + ("total",)}

    def per_update(self, clock: str = "") -> list[dict]:
        rows, at = [], 0 if not clock else 1
        for i in range(self.warmup, min(self.warmup + self.timed, len(self.updates))):
            u = self.updates[i]
            get = lambda k: u.get(k + clock, 0.0)  # noqa: E731
            # the loop's iteration: to the next update's start (the last timed update's stages are ranked before it ends)
            total = self.loop_starts[i + 1][at] - self.loop_starts[i][at] if i + 1 < len(self.loop_starts) else get("run_update")
            named = ("sampling", "scoring", "reference_values", "rewards", "advantages", "optimise", "metrics")
            row = {k: get(k) for k in named}
            row["step_other"] = get("step") - sum(row.values())
            row["guard"] = get("run_update") - get("step")
            row["logging"] = get("logging")
            row["loop_other"] = total - get("run_update") - row["logging"]
            row["total"] = total
            rows.append(row)
        return rows


def floors(trainer: PPOTrainer, update: dict, epochs: int) -> dict[str, float]:
    """FLOPs each model stage must do on update's real tokens (module docstring)."""
    policy = trainer.accelerator.unwrap_model(trainer.policy)
    value = trainer.parts.value_model
    lengths, responses, trained = update["lengths"], update["response_tokens"], update["trained_tokens"]
    policy_fwd = forward_flops(policy, lengths, trained)
    value_fwd = forward_flops(value, lengths, 0) if value is not None else 0.0
    ref = trainer.parts.ref_model
    ref_fwd = forward_flops(ref, lengths, trained) if ref is not None else 0.0
    # sampling: each generated token is one forward step (the last one's head included), the prompt one prefill
    sampling = forward_flops(policy, lengths, responses)
    forward = ref_fwd + value_fwd + (policy_fwd if update.get("policy_logprobs") else 0.0)
    return {"sampling": sampling, "reference_values": forward, "optimise": epochs * 3 * (policy_fwd + value_fwd),
            "policy_forward": policy_fwd, "value_forward": value_fwd}


def one_run(args) -> dict:
    table = open(args.table, "a") if args.table else sys.stderr
    rate_before = matmul_rates()
    warmup, timed = 1, args.updates
    with tempfile.TemporaryDirectory(prefix="ppokit-profile-") as tmp:
        work = Path(tmp)
        beyond_warmup = timed + 1  # the tasks make one update more than they are asked for: the warm-up
        if args.shape in ("fixed", "reviews"):
            config, task = ppo_throughput.fixed_task(work, beyond_warmup, "llama", stopping=args.shape == "reviews")
        else:
            config, task = ppo_throughput.variable_task(work, beyond_warmup)
        ppo_throughput.apply_switches(config, args.config, task["longest_row"])
        config.ppo.padding_free = args.padding_free
        torch.manual_seed(0)
        trainer = PPOTrainer(config, show_progress=False)
        profile = Profile(trainer, warmup, timed, table)
        start = time.perf_counter()
        try:
            records = trainer.train()
        finally:
            profile.restore()
        wall = time.perf_counter() - start
    rate_after = matmul_rates()
    rate = {k: max(rate_before[k], rate_after[k]) for k in rate_before}  # the floor: the best rate seen
    seconds, cpu_seconds = profile.stage_seconds(), profile.stage_seconds("/cpu")
    total = seconds["total"]
    measured = [profile.updates[i] for i in range(warmup, warmup + timed)]
    flops = {k: statistics.median(floors(trainer, u, config.ppo.num_ppo_epochs)[k] for u in measured)
             for k in ("sampling", "reference_values", "optimise")}
    gflops = rate["run_threads"]
    stages = {}
    for stage in STAGES:
        entry = {"s": round(seconds[stage], 5), "share": round(seconds[stage] / total, 4),
                 "cpu_s": round(cpu_seconds[stage], 5), "cpu_share": round(cpu_seconds[stage] / cpu_seconds["total"], 4)}
        if stage in flops:
            floor = flops[stage] / 1e9 / gflops
            entry.update({"gflop": round(flops[stage] / 1e9, 3), "floor_s": round(floor, 5), "ratio": round(seconds[stage] / floor, 1)})
            if torch.get_num_threads() == 1:  # CPU seconds against the one-thread rate in CPU time: what load does not change
                entry["cpu_ratio"] = round(cpu_seconds[stage] / (flops[stage] / 1e9 / rate["one_thread_cpu_time"]), 1)
        stages[stage] = entry
    timed_records = records[warmup:warmup + timed]
    trainer_time = {k: round(statistics.median(r[k] for r in timed_records), 5)
                    for k in ("time/generation", "time/scoring", "time/forward", "time/training", "time/update")}
    u = measured[-1]
    padding = [r["perf/padding_share"] for r in timed_records if "perf/padding_share" in r]
    model_floor = sum(flops.values()) / 1e9 / gflops
    cpu_floor = sum(flops.values()) / 1e9 / rate["one_thread_cpu_time"]
    return {
        "benchmark": "profile_update", "shape": args.shape, "config": args.config, "padding_free": args.padding_free,
        "updates_timed": timed, "torch_threads": torch.get_num_threads(),
        "episodes_per_update": task["batch"], "prompt_tokens": u["prompt_tokens"], "response_tokens": u["response_tokens"],
        "padding_share": round(statistics.median(padding), 4) if padding else None,
        "matmul_gflops": {k: round(v, 1) for k, v in rate.items()}, "matmul_gflops_before_after": [rate_before, rate_after],
        "seconds_per_update": round(total, 4), "episodes_per_s": round(task["batch"] / total, 2),
        "stages": stages, "trainer_time": trainer_time,
        "model_stages_floor_s": round(model_floor, 5), "update_over_floor": round(total / model_floor, 1),
        "cpu_seconds_per_update": round(cpu_seconds["total"], 4), "cpu_over_floor": round(cpu_seconds["total"] / cpu_floor, 1),
        "profiled_stage": profile.profiled_stage, "profiled_matmul_share": profile.matmul_share,
        "profiled_top_operators": profile.top_operators, "end_of_run_save_s": round(profile.end_save, 3), "wall_s": round(wall, 2),
    }


def median_of(runs: list[dict]) -> dict:
    """Medians over runs of every stage's seconds, share and ratio, and of the update's totals."""
    out = {"runs": len(runs), "seconds_per_update": statistics.median(r["seconds_per_update"] for r in runs),
           "episodes_per_s": statistics.median(r["episodes_per_s"] for r in runs),
           "update_over_floor": statistics.median(r["update_over_floor"] for r in runs),
           "cpu_over_floor": statistics.median(r["cpu_over_floor"] for r in runs),
           "matmul_gflops": {k: statistics.median(r["matmul_gflops"][k] for r in runs) for k in runs[0]["matmul_gflops"]}, "stages": {}}
    for stage in STAGES:
        out["stages"][stage] = {k: round(statistics.median(r["stages"][stage][k] for r in runs), 5) for k in runs[0]["stages"][stage]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("fixed", "reviews", "variable"), default="fixed")
    parser.add_argument("--config", choices=ppo_throughput.CONFIGS, default="default")
    parser.add_argument("--padding-free", action="store_true")
    parser.add_argument("--updates", type=int, default=4, help="updates timed, after one warm-up (and before the profiled one)")
    parser.add_argument("--repeats", type=int, default=1, help="runs, one process each, in turn; prints each and the medians")
    parser.add_argument("--table", default=None, help="append the torch.profiler table here (default: stderr)")
    args = parser.parse_args()
    if args.repeats == 1:
        print(json.dumps(one_run(args)))
        return
    argv = [a for a in sys.argv[1:]]
    at = argv.index("--repeats")
    del argv[at:at + 2]
    runs = []
    for _ in range(args.repeats):
        out = subprocess.run([sys.executable, __file__, *argv], check=True, stdout=subprocess.PIPE, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(runs[-1]))
    print(json.dumps({"benchmark": "profile_update", "median": median_of(runs)}))


if __name__ == "__main__":
    main()
