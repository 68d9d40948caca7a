"""PPO throughput; prints one JSON line.

    python benchmarks/ppo_throughput.py [--updates N] [--arch llama] [--estimator gae] [--samples-per-prompt 1]
                                        [--config default|budget|light|compile]
    python benchmarks/ppo_throughput.py --shape reviews|variable [--config default|budget|light|compile] [--padding-free]

--shape fixed (the default, unchanged): a tiny Llama (hidden 128, 4 layers, word-level vocabulary)
built locally, VADER sentiment as the reward, 64 episodes per update, 16-token responses without a
stop token, 4 PPO epochs of 2 minibatches (micro-batches of 32).

--shape reviews: the same, the model first taught the demo reviews (one SFT epoch) so that its responses
end at EOS at varied lengths, up to 32 tokens (a variable shape built in seconds).

--shape variable: the realistic shape of benchmarks/variable_shape.py (32k-token byte-level BPE,
an 11M-parameter SFT'd Llama, prompts of 8-64 tokens, responses that end at EOS at varied lengths up
to 64 tokens), 64 episodes per update, 4 PPO epochs of 2 minibatches of 32 rows, each one
micro-batch (as the fixed shape: so the default and the token budget normalise the loss alike, and
the learning curves can be compared number for number).

--config, cumulative switches (docs/speed.md):
  default  today's defaults (fixed micro-batches, the direct LM head, eager)
  budget   + ppo.max_tokens_per_micro_batch = half of a fixed micro-batch's rows x the longest possible
           row (half its memory bound: sorted rows of similar length share a trimmed micro-batch)
  light    + lm_head_chunk_size (the memory-light LM head)
  compile  + compile: true
--padding-free adds ppo.padding_free to any of them (several episodes per row; benchmarks/padding_free.py
alternates runs with and without it).
--switches budget,head,padding_free,compile,allocator,checkpointing,onednn,compiled_decode,tcmalloc (or "": none) turns on the named switches alone
(not cumulative; on top of --config); benchmarks/switches.py alternates runs of each against the defaults. --budget-tokens N sets the budget of the
budget switch (--config budget and above, --switches budget) to N tokens instead of half a fixed micro-batch's rows x the longest
row; --head-chunk N the light head's lm_head_chunk_size (default 256). checkpointing: gradient_checkpointing (each decoder layer
recomputed in the backward: less memory, one more backbone forward per micro-batch). compiled_decode: rollout.enforce_eager: false
(the hf engine's compiled decoding step, engines/fast_decode.py; its compiling is paid in the warm-up update).
allocator: glibc's malloc told to give freed tensors back to the OS (ppokit/process/allocator.py, opt-in: less RSS, more page
faults; not a config key). tcmalloc: cpu_allocator: tcmalloc (the process starts again with gperftools' malloc preloaded; its own
counts in malloc_mb_at_peak_by_stage). The lightest measured: --config light --padding-free --budget-tokens 4096 --switches
checkpointing,tcmalloc (docs/speed.md).

The first update is a warm-up (and pays any compile) and is not counted. Stage times are seconds per
update (mean over the counted updates); padding_share is the share of padding among the token
positions the training forward passes processed; peak_rss_mb is this process's peak (one process
per configuration), peak_rss_mb_by_stage the peak while each stage ran, and malloc_mb_at_peak_by_stage glibc's count at that
peak (in_use, held: what its heaps keep beyond what is in use). `curve` holds the first updates' metrics, to compare configurations'
learning; minor_page_faults and system_cpu_s are the whole process's (what --switches allocator costs).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from ppokit.training import experience  # noqa: E402
from ppokit.config.schema import DataConfig, PPOConfig, PPOHyperparams, RewardConfig  # noqa: E402
from ppokit.trainer import PPOTrainer  # noqa: E402

try:  # glibc's count of its heaps; the older trees run against this benchmark (docs/speed.md) have none: no count
    from ppokit.process.allocator import heap_usage
except ImportError:
    heap_usage = lambda: None  # noqa: E731

CONFIGS = ("default", "budget", "light", "compile")
LIGHT_HEAD_CHUNK = 256
CURVE_KEYS = ("objective/scores", "objective/kl", "objective/response_length", "loss/policy_avg", "loss/value_avg",
              "policy/approxkl_avg", "policy/entropy_avg")


def fixed_task(work: Path, updates: int, arch: str, stopping: bool = False) -> tuple[PPOConfig, dict]:
    """stopping (--shape reviews): the model first learns the demo reviews (one SFT epoch, seconds), so that its
    responses end at EOS at varied lengths (up to 32 tokens), after prompts of varied lengths."""
    from ppokit.demos.reviews import make_data
    from ppokit.demos.tiny import tiny_causal_lm, word_tokenizer
    from ppokit.training.sft import encode_pair, train_sft

    batch = 64
    torch.manual_seed(0)
    data = make_data(seed=0, n_sft=500, n_prompts=batch * (updates + 1), n_eval=4)
    tokenizer = word_tokenizer(r["prompt"] + " " + r["completion"] for r in data["sft"])
    model = tiny_causal_lm(arch, tokenizer, hidden=128, layers=4, heads=4)
    if stopping:
        examples = [encode_pair(tokenizer, r["prompt"], r["completion"]) for r in data["sft"]]
        train_sft(model, examples, tokenizer.pad_token_id, epochs=1, batch_size=16, learning_rate=3e-3)
    model.save_pretrained(work / "model")
    tokenizer.save_pretrained(work / "model")
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in data["prompts"]))
    config = PPOConfig(
        model=str(work / "model"),
        output_dir=str(work / "run"),
        reward=RewardConfig(functions=["sentiment"]),
        data=DataConfig(train=str(prompts)),
        ppo=PPOHyperparams(
            total_episodes=batch * (updates + 1),
            per_device_train_batch_size=batch // 2,
            num_mini_batches=2,
            num_ppo_epochs=4,
            response_length=32 if stopping else 16,
            temperature=1.0,
            learning_rate=1e-4,
            stop_token="eos" if stopping else None,  # fixed-length responses: the same work every update
            num_sample_generations=0,
        ),
    )
    longest_prompt = max(len(tokenizer(r["prompt"])["input_ids"]) for r in data["prompts"])
    return config, {"batch": batch, "longest_row": longest_prompt + config.ppo.response_length}


def variable_task(work: Path, updates: int) -> tuple[PPOConfig, dict]:
    sys.path.insert(0, str(Path(__file__).parent))
    import variable_shape

    sft = variable_shape.build()
    batch = 64
    prompts = work / "prompts.jsonl"
    variable_shape.write_prompts(prompts, batch * (updates + 1))
    max_prompt = variable_shape.PROMPT_TOKENS[1]
    config = PPOConfig(
        model=str(sft),
        output_dir=str(work / "run"),
        reward=RewardConfig(functions=["sentiment"]),
        data=DataConfig(train=str(prompts), max_prompt_length=max_prompt),
        ppo=PPOHyperparams(
            total_episodes=batch * (updates + 1),
            per_device_train_batch_size=batch // 2,
            num_mini_batches=2,
            num_ppo_epochs=4,
            response_length=variable_shape.RESPONSE_LENGTH,
            temperature=1.0,
            learning_rate=1e-5,
            num_sample_generations=0,
        ),
    )
    return config, {"batch": batch, "longest_row": max_prompt + variable_shape.RESPONSE_LENGTH}


class PhaseRSS:
    """Peak resident memory (MB) while each stage of the trainer runs, sampled every 10 ms from /proc (Linux).
    RSS includes what every earlier stage left allocated: weights, gradients, AdamW state, the rollback copy.
    At each stage's peak, glibc's own count too (`ppokit.process.allocator.heap_usage`: what its blocks in use and what it holds from
    the OS; the rest of the RSS is the interpreter's, the libraries' and the weights mapped from their files)."""

    def __init__(self, trainer):
        self.stage, self.peaks = "setup", {"setup": self._rss()}
        self.heap = {"setup": heap_usage()}
        self.cpu = {}  # stage -> this process's CPU seconds of each call
        # stage 3 is a function of ppokit.training.experience, which the trainer looks up there at every update
        # sampling: the trainer's sampler (stage 1), which the trainer looks up on the sampler at every update
        for owner, name, stage in ((trainer.sampler, "episodes", "sampling"), (experience, "reference_and_values", "forward"),
                                   (trainer, "optimise", "training")):
            setattr(owner, name, self._tagged(getattr(owner, name), stage))
        threading.Thread(target=self._sample, daemon=True).start()

    @staticmethod
    def _rss() -> float:
        try:
            return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        except (OSError, ValueError):
            return 0.0

    def _tagged(self, method, stage):
        def run(*args, **kwargs):
            self.stage, started = stage, time.process_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.stage = "other"
                self.cpu.setdefault(stage, []).append(time.process_time() - started)
        return run

    def _sample(self):
        while True:
            stage, rss = self.stage, self._rss()
            if rss > self.peaks.get(stage, 0.0):
                self.peaks[stage], self.heap[stage] = rss, heap_usage()
            time.sleep(0.01)

    STAGES = ("setup", "sampling", "forward", "training")

    def report(self) -> dict:
        return {k: round(self.peaks.get(k, 0.0), 1) for k in self.STAGES}

    def cpu_report(self) -> dict:
        """{stage: CPU seconds per call} over the calls after the first (the warm-up update's)."""
        return {k: round(sum(v[1:]) / len(v[1:]), 4) if len(v) > 1 else None for k, v in self.cpu.items()}

    def heap_report(self) -> dict:
        """{stage: {"in_use": MB, "held": MB}} at the stage's RSS peak (None outside glibc)."""
        return {k: None if self.heap.get(k) is None else {name: round(v, 1) for name, v in self.heap[k].items()} for k in self.STAGES}


SWITCHES = ("budget", "head", "padding_free", "compile", "allocator", "checkpointing", "onednn", "compiled_decode", "tcmalloc")


def apply_named_switches(config: PPOConfig, names: list[str], longest_row: int, budget_tokens: int | None = None,
                         head_chunk: int = LIGHT_HEAD_CHUNK) -> dict:
    """--switches: each named switch alone (the budget: `budget_tokens`, else half of a fixed micro-batch's rows x the
    longest possible row). -> what the allocator switch set in this process ({} without it)."""
    if "budget" in names:
        config.ppo.max_tokens_per_micro_batch = budget_tokens or config.ppo.per_device_train_batch_size * longest_row // 2
    if "head" in names:
        config.lm_head_chunk_size = head_chunk
    if "padding_free" in names:
        config.ppo.padding_free = True
    if "compile" in names:
        config.compile = True
    if "checkpointing" in names:
        config.gradient_checkpointing = True
    if "onednn" in names:
        config.matmul_backend = "onednn"
    if "compiled_decode" in names:
        config.rollout.enforce_eager = False
    if "tcmalloc" in names:  # main() has started this process again with it
        config.cpu_allocator = "tcmalloc"
    if "allocator" in names:
        from ppokit.process import allocator

        return allocator.settle()
    return {}


def apply_switches(config: PPOConfig, name: str, longest_row: int, budget_tokens: int | None = None, head_chunk: int = LIGHT_HEAD_CHUNK) -> None:
    """--config: the switches up to `name`, cumulative (budget, then the light head, then compile)."""
    apply_named_switches(config, ["budget", "head", "compile"][:CONFIGS.index(name)], longest_row, budget_tokens, head_chunk)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=("fixed", "reviews", "variable"), default="fixed")
    parser.add_argument("--config", choices=CONFIGS, default="default", help="cumulative speed switches (see the module docstring)")
    parser.add_argument("--updates", type=int, default=None, help="updates to time, after one warm-up update (default: 4 fixed, 3 variable)")
    parser.add_argument("--arch", default="llama", help="fixed shape only")
    parser.add_argument("--estimator", default="gae", help="ppo.advantage_estimator")
    parser.add_argument("--samples-per-prompt", type=int, default=1, help="ppo.num_samples_per_prompt (episodes per update stay the same)")
    parser.add_argument("--padding-free", action="store_true", help="ppo.padding_free: several episodes per row (docs/speed.md)")
    parser.add_argument("--switches", default=None, help=f"comma-separated, each alone: {','.join(SWITCHES)}")
    parser.add_argument("--head-chunk", type=int, default=LIGHT_HEAD_CHUNK, help="lm_head_chunk_size of the light head (--config light "
                        "and above, --switches head)")
    parser.add_argument("--budget-tokens", type=int, default=None, help="ppo.max_tokens_per_micro_batch of the budget switch "
                        "(default: half a fixed micro-batch's rows x the longest row)")
    args = parser.parse_args()
    unknown = [name for name in filter(None, (args.switches or "").split(",")) if name not in SWITCHES]
    if unknown:
        parser.error(f"--switches: unknown {', '.join(unknown)} (choose from {', '.join(SWITCHES)})")
    updates = args.updates or (3 if args.shape == "variable" else 4)
    if "tcmalloc" in (args.switches or "").split(","):  # cpu_allocator: tcmalloc, as the ppokit program does it: start again with it preloaded
        from ppokit.process import allocator

        environ = allocator.preload_environment("tcmalloc")
        if environ is not None:
            sys.stdout.flush()
            os.execve(sys.executable, sys.orig_argv, environ)

    with tempfile.TemporaryDirectory(prefix="ppokit-bench-") as tmp:  # the run's model and output go with it
        measure(args, updates, Path(tmp))


def measure(args, updates: int, work: Path) -> None:
    if args.shape in ("fixed", "reviews"):
        config, task = fixed_task(work, updates, args.arch, stopping=args.shape == "reviews")
    else:
        config, task = variable_task(work, updates)
    config.ppo.advantage_estimator, config.ppo.num_samples_per_prompt = args.estimator, args.samples_per_prompt
    apply_switches(config, args.config, task["longest_row"], args.budget_tokens, args.head_chunk)
    if args.padding_free:
        config.ppo.padding_free = True
    settled = apply_named_switches(config, list(filter(None, (args.switches or "").split(","))), task["longest_row"], args.budget_tokens,
                                   args.head_chunk)
    named = args.switches is not None  # (--switches "": the defaults, with the longer line)
    batch = task["batch"]

    torch.manual_seed(0)
    trainer = PPOTrainer(config, show_progress=False)
    phases = PhaseRSS(trainer) if args.shape != "fixed" or args.config != "default" or args.padding_free or named else None
    cpu = []  # this process's CPU seconds of each update: what a machine shared with other work changes least
    run_update = trainer.run_update

    def timed_update():
        started = time.process_time()
        try:
            return run_update()
        finally:
            cpu.append(time.process_time() - started)
    trainer.run_update = timed_update
    start = time.perf_counter()
    records = trainer.train()
    wall = time.perf_counter() - start
    timed = records[1:]
    n = len(timed)
    mean = lambda key: sum(r[key] for r in timed) / n  # noqa: E731
    generated = sum(r["objective/response_length"] * batch for r in timed)
    result = {
        "benchmark": "ppo_throughput",
        "arch": args.arch,
        "estimator": args.estimator,
        "samples_per_prompt": args.samples_per_prompt,
        "parameters_m": round(sum(p.numel() for p in trainer.policy.parameters()) / 1e6, 2),
        "episodes_per_update": batch,
        "response_length": config.ppo.response_length,
        "updates_timed": n,
        "episodes_per_s": round(batch * n / sum(r["time/update"] for r in timed), 2),
        "tokens_per_s": round(generated / sum(r["time/generation"] for r in timed), 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "seconds_per_update": {
            "generation": round(mean("time/generation"), 4),
            "scoring": round(mean("time/scoring"), 4),
            "reference_value_forward": round(mean("time/forward"), 4),
            "training": round(mean("time/training"), 4),
            "total": round(mean("time/update"), 4),
        },
        "wall_s": round(wall, 2),
        "torch_threads": torch.get_num_threads(),
    }
    if args.shape != "fixed" or args.config != "default" or args.padding_free or named:  # the fixed default line keeps its keys
        result = {
            "benchmark": "ppo_throughput", "shape": args.shape, "config": args.config, **{k: v for k, v in result.items() if k != "benchmark"},
            "vocabulary": len(trainer.tokenizer),
            "response_tokens_mean": round(sum(r["objective/response_length"] for r in timed) / n, 1),
            "padding_share": round(mean("perf/padding_share"), 4) if all("perf/padding_share" in r for r in timed) else None,
            "first_update_s": round(records[0]["time/update"], 2),
            "cpu_s_per_update": round(sum(cpu[1:]) / n, 4), "episodes_per_cpu_s": round(batch * n / sum(cpu[1:]), 2),
            # the process's CPU seconds in each stage (sampling, forward, training), per call after the warm-up update
            "cpu_s_by_stage": phases.cpu_report(),
            "peak_rss_mb_by_stage": phases.report(),
            # malloc's count at each stage's RSS peak (glibc's, or tcmalloc's): held - in_use is the freed memory it keeps (docs/speed.md)
            "malloc_mb_at_peak_by_stage": phases.heap_report(),
            # the whole process's: what a fixed mmap threshold (--switches allocator) costs shows here first
            "minor_page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
            "system_cpu_s": round(resource.getrusage(resource.RUSAGE_SELF).ru_stime, 2),
            # getattr: the tree before these switches runs the default configuration too (docs/speed.md)
            "switches": {"max_tokens_per_micro_batch": getattr(config.ppo, "max_tokens_per_micro_batch", None),
                         "lm_head_chunk_size": getattr(config, "lm_head_chunk_size", None), "compile": getattr(config, "compile", False),
                         "padding_free": getattr(config.ppo, "padding_free", False), "allocator": settled,
                         "gradient_checkpointing": getattr(config, "gradient_checkpointing", False),
                         "matmul_backend": getattr(config, "matmul_backend", "aten"), "cpu_allocator": getattr(config, "cpu_allocator", None),
                         "enforce_eager": getattr(getattr(config, "rollout", None), "enforce_eager", True)},
            "curve": [{k: round(r[k], 6) for k in CURVE_KEYS if k in r} for r in records],
        }
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
