"""TRL's own PPOTrainer (TRL 1.12.0, `trl.experimental.ppo`) against ppokit on ppo_throughput.py's fixed task; prints JSON lines.

    python benchmarks/trl_comparison.py [--rounds 3] [--updates 4] [--threads N] [--variants trl default switches]
                                        [--switches budget,head,padding_free] [--budget-tokens 1600]

The task is `ppo_throughput.py --shape fixed` (its default): the tiny Llama (hidden 128, 4 layers, word-level
vocabulary) that `ppo_throughput.fixed_task` builds and saves, its prompts, VADER sentiment of the decoded response
as the reward, 64 episodes per update, 16-token responses without a stop token, 4 PPO epochs of 2 minibatches of 32.
Variants, each run in a process of its own (so each peak RSS is its own):
  trl       TRL 1.12.0's PPOTrainer on that model and those prompts, every hyperparameter read from ppokit's config
            of the task (docs/speed.md, "Against TRL's PPO", lists the mapping), float32 as ppokit's run
  trl_bf16  the same with TRL's own default `bf16: true` (mixed precision by autocast; on a CPU, bf16 matmuls),
            as a TRL user who sets nothing runs it (not in the default --variants; its ratio is to `trl` too)
  default   `ppo_throughput.py --switches ""`: ppokit's defaults
  switches  `ppo_throughput.py --switches SWITCHES --budget-tokens N`: ppokit's speed switches
A round runs every variant once, its order rotated from round to round, so that a change of the machine's load falls
on every variant alike. Each run's line is printed as it ends; the last line holds per variant the medians and per
round the ratio of each ppokit variant to the TRL run of the same round.

What is timed, on both sides alike: the wall time of the updates after the first (a warm-up), per episode; TRL's
updates are timed by a callback between its `on_step_end` calls (the first from `on_train_begin`), ppokit's by its own
`time/update`. `episodes_per_cpu_s` counts this process's CPU seconds over the same updates (the figure a shared
machine changes least). `peak_rss_mb`: the process's peak resident memory. `curve`: each update's mean score and KL.

TRL 1.12.0 is installed on first use with `pip install --no-deps --target $PPOKIT_BENCH_CACHE/trl-1.12.0` (default
cache ~/.cache/ppokit-bench) and put first on the TRL run's PYTHONPATH; the interpreter's own trl is not touched.
--threads N sets OMP_NUM_THREADS=N for every run (default: left as it is, torch's default where unset).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRL_VERSION = "1.12.0"
HERE = Path(__file__).resolve().parent
VARIANTS = ("trl", "trl_bf16", "default", "switches")
CURVE_KEYS = ("objective/scores", "objective/kl")


def trl_dir() -> Path:
    """TRL 1.12.0 in this benchmark's cache, installed there (without dependencies) the first time."""
    cache = Path(os.environ.get("PPOKIT_BENCH_CACHE", Path.home() / ".cache" / "ppokit-bench"))
    target = cache / f"trl-{TRL_VERSION}"
    if not (target / "trl" / "__init__.py").exists():
        cache.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"trl-{TRL_VERSION}-", dir=cache))
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(staging), f"trl=={TRL_VERSION}"],
                       check=True, stdout=sys.stderr)
        staging.rename(target)  # whole or not at all: an interrupted install leaves only a staging folder
    return target


# --------------------------------------------------------------------------- the TRL run (a process of its own)


def sentiment_reward_model(tokenizer, context_length: int):
    """A reward model in the shape TRL's `get_reward` calls: `getattr(model, model.base_model_prefix)(input_ids=...,
    attention_mask=..., ...)`, then `model.score(output.hidden_states[-1])`, read at each row's last response token.
    Its backbone decodes each row's response (the columns after the `context_length` prompt columns: every prompt is
    left-padded to that width) as ppokit's scorer does (padding masked, special tokens skipped) and scores it with
    ppokit's built-in `sentiment` (VADER's compound score); every position of the row carries that score."""
    import torch
    from torch import nn
    from transformers.modeling_outputs import BaseModelOutput

    from ppokit.rewards import sentiment

    class SentimentBackbone(nn.Module):
        def forward(self, input_ids, attention_mask, **unused):
            responses = input_ids[:, context_length:].masked_fill(~attention_mask[:, context_length:].bool(), tokenizer.pad_token_id)
            texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
            scores = torch.tensor(sentiment([""] * len(texts), texts), dtype=torch.float32, device=input_ids.device)
            return BaseModelOutput(hidden_states=(scores[:, None, None].expand(-1, input_ids.shape[1], 1),))

    class SentimentRewardModel(nn.Module):
        base_model_prefix = "backbone"

        def __init__(self):
            super().__init__()
            self.backbone, self.score = SentimentBackbone(), nn.Identity()

    return SentimentRewardModel()


def trl_config(ppo, seed: int, output_dir: str, bf16: bool = False):
    """TRL's PPOConfig with every setting of the run taken from ppokit's `ppo` section of the same task."""
    from trl.experimental.ppo import PPOConfig as TRLPPOConfig

    assert ppo.gradient_accumulation_steps == 1 and ppo.max_tokens_per_micro_batch is None
    return TRLPPOConfig(
        output_dir=output_dir, seed=seed, total_episodes=ppo.total_episodes,
        # ppokit: rollout batch = per_device_train_batch_size (32, a micro-batch) x num_mini_batches (2). TRL's rollout
        # batch is per_device_train_batch_size x gradient_accumulation_steps, split into num_mini_batches; each
        # minibatch's micro-batches are per_device_train_batch_size rows (a minibatch of 32 rows is one), and the
        # optimiser steps once per minibatch with gradient_accumulation_steps 1 (with 2, accelerate would step every
        # second minibatch).
        per_device_train_batch_size=ppo.per_device_train_batch_size * ppo.num_mini_batches, gradient_accumulation_steps=1,
        num_mini_batches=ppo.num_mini_batches, num_ppo_epochs=ppo.num_ppo_epochs,
        local_rollout_forward_batch_size=ppo.local_rollout_forward_batch_size,
        response_length=ppo.response_length, temperature=ppo.temperature, stop_token=ppo.stop_token, stop_token_id=None,
        missing_eos_penalty=ppo.missing_eos_penalty,
        learning_rate=ppo.learning_rate, lr_scheduler_type=ppo.lr_scheduler_type, warmup_steps=ppo.warmup_steps,
        adam_epsilon=ppo.adam_epsilon, adam_beta1=ppo.adam_beta1, adam_beta2=ppo.adam_beta2, weight_decay=ppo.weight_decay,
        max_grad_norm=ppo.max_grad_norm,  # (TRL's PPO loop never clips: accepted, not applied)
        kl_coef=ppo.kl_coef, kl_estimator=ppo.kl_estimator, cliprange=ppo.cliprange, cliprange_value=ppo.cliprange_value,
        vf_coef=ppo.vf_coef, gamma=ppo.gamma, lam=ppo.lam, whiten_rewards=ppo.whiten_rewards,
        # not training: no sample generations, no tracker, no checkpoints; float32 as ppokit's run unless bf16 (TRL's own
        # default, which autocasts)
        num_sample_generations=0, report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True, bf16=bf16,
        use_cpu=bf16 and not _cuda(),  # transformers refuses bf16 on a machine without a GPU unless told to run on the CPU
    )


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run_trl(updates: int, bf16: bool = False) -> dict:
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorWithPadding, TrainerCallback, set_seed
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    if trl.__version__ != TRL_VERSION:
        sys.exit(f"trl_comparison: the TRL run imported trl {trl.__version__} from {trl.__file__}, not {TRL_VERSION}")
    from datasets import Dataset
    from trl.experimental.ppo import PPOTrainer as TRLPPOTrainer

    sys.path.insert(0, str(HERE))
    import ppo_throughput

    from ppokit.data.lengths import encode_prompt_text
    from ppokit.data.prompts import as_prompt_dataset
    from ppokit.models.loading import disable_dropout, value_model_from_policy

    class UpdateClock(TrainerCallback):
        """Wall and CPU clock at the start of training and at the end of each update; each update's logged metrics."""

        def __init__(self):
            self.marks, self.logs = [], []

        def on_train_begin(self, args, state, control, **kwargs):
            self.marks.append((time.perf_counter(), time.process_time()))

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append((time.perf_counter(), time.process_time()))

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    with tempfile.TemporaryDirectory(prefix="ppokit-trl-bench-") as tmp:
        config, task = ppo_throughput.fixed_task(Path(tmp), updates, "llama")  # the model, tokenizer and prompts ppokit trains
        tokenizer = AutoTokenizer.from_pretrained(config.model, padding_side="left")
        prompts = [encode_prompt_text(tokenizer, p) for p in as_prompt_dataset(config.data.train).prompts]
        width = max(len(p) for p in prompts)  # every prompt padded to the longest: the reward model's context_length
        # TRL's PPOTrainer seeds torch itself but draws each epoch's minibatch permutation from NumPy's global generator,
        # which it never seeds (it does not run transformers.Trainer's __init__, which would): seeded here, as a Trainer does
        set_seed(config.seed)
        policy = AutoModelForCausalLM.from_pretrained(config.model)
        value = value_model_from_policy(policy)  # ppokit's critic: the policy's backbone, a zero scalar head
        disable_dropout(value)
        clock = UpdateClock()
        trainer = TRLPPOTrainer(
            args=trl_config(config.ppo, config.seed, str(Path(tmp) / "trl"), bf16), processing_class=tokenizer, model=policy,
            ref_model=None, reward_model=sentiment_reward_model(tokenizer, width), value_model=value,
            train_dataset=Dataset.from_dict({"input_ids": prompts}),
            data_collator=DataCollatorWithPadding(tokenizer, padding="max_length", max_length=width), callbacks=[clock],
        )
        for printer in (PrinterCallback, ProgressCallback):  # the metrics printed to the terminal each update: not training
            trainer.remove_callback(printer)
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
    batch = task["batch"]
    walls = [b[0] - a[0] for a, b in zip(clock.marks, clock.marks[1:])]
    cpus = [b[1] - a[1] for a, b in zip(clock.marks, clock.marks[1:])]
    n = len(walls) - 1
    return {
        "benchmark": "trl_ppo", "trl": trl.__version__, "episodes_per_update": batch, "updates_timed": n,
        "episodes_per_s": round(batch * n / sum(walls[1:]), 2), "episodes_per_cpu_s": round(batch * n / sum(cpus[1:]), 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "seconds_per_update": round(sum(walls[1:]) / n, 4), "first_update_s": round(walls[0], 2), "wall_s": round(wall, 2),
        "torch_threads": torch.get_num_threads(),
        "curve": [{k: round(log[k], 6) for k in CURVE_KEYS} for log in clock.logs if "objective/scores" in log],
    }


# --------------------------------------------------------------------------- the driver


def run_variant(variant: str, args, trl_path: Path) -> dict:
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    if variant.startswith("trl"):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(trl_path), env.get("PYTHONPATH")]))
        env["TRL_EXPERIMENTAL_SILENCE"] = "1"
        command = [sys.executable, str(Path(__file__).resolve()), "--trl-run", "--updates", str(args.updates)]
        command += ["--trl-bf16"] if variant == "trl_bf16" else []
    else:
        command = [sys.executable, str(HERE / "ppo_throughput.py"), "--updates", str(args.updates),
                   "--switches", args.switches if variant == "switches" else ""]
        if variant == "switches" and args.budget_tokens:
            command += ["--budget-tokens", str(args.budget_tokens)]
    out = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True, env=env).stdout
    line = json.loads(out.strip().splitlines()[-1])
    if not variant.startswith("trl"):
        line["seconds_per_update"] = line["seconds_per_update"]["total"]
        line["curve"] = [{k: r[k] for k in CURVE_KEYS} for r in line["curve"]]
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--updates", type=int, default=4, help="timed updates per run, after one warm-up update (ppo_throughput.py's default)")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for every run (default: as set, else torch's default)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["trl", "default", "switches"])
    parser.add_argument("--switches", default="budget,head,padding_free", help="ppo_throughput.py --switches of the `switches` variant")
    parser.add_argument("--budget-tokens", type=int, default=1600, help="ppo.max_tokens_per_micro_batch of its budget switch")
    parser.add_argument("--trl-run", action="store_true", help=argparse.SUPPRESS)  # one TRL run, in this process
    parser.add_argument("--trl-bf16", action="store_true", help=argparse.SUPPRESS)  # ... with TRL's default bf16
    args = parser.parse_args()
    if args.trl_run:
        print(json.dumps(run_trl(args.updates, args.trl_bf16)), flush=True)
        return
    if "trl" not in args.variants:
        parser.error("--variants: trl is the baseline of every ratio")
    trl_path = trl_dir()
    load_before = os.getloadavg()
    results: dict[str, list[dict]] = {v: [] for v in args.variants}
    for r in range(args.rounds):
        for variant in args.variants[r % len(args.variants):] + args.variants[:r % len(args.variants)]:
            line = run_variant(variant, args, trl_path)
            results[variant].append(line)
            print(json.dumps({"round": r, "variant": variant, **{k: line[k] for k in (
                "episodes_per_s", "episodes_per_cpu_s", "peak_rss_mb", "seconds_per_update", "wall_s", "torch_threads", "curve")}}), flush=True)
    summary = {}
    for variant, lines in results.items():
        summary[variant] = {}
        for key in ("episodes_per_s", "episodes_per_cpu_s", "peak_rss_mb"):
            values, base = [line[key] for line in lines], [line[key] for line in results["trl"]]
            summary[variant][key] = round(statistics.median(values), 3)
            if variant != "trl":
                ratios = [round(a / b, 3) for a, b in zip(values, base)]
                summary[variant][key + "_ratio_by_round"] = ratios
                summary[variant][key + "_ratio_median"] = round(statistics.median(ratios), 3)
    print(json.dumps({"benchmark": "trl_comparison", "trl": TRL_VERSION, "rounds": args.rounds, "updates_timed": args.updates,
                      "omp_num_threads": os.environ.get("OMP_NUM_THREADS") if args.threads is None else str(args.threads),
                      "switches": args.switches, "budget_tokens": args.budget_tokens,
                      "load_average_before": [round(x, 2) for x in load_before], "load_average_after": [round(x, 2) for x in os.getloadavg()],
                      "summary": summary}))


if __name__ == "__main__":
    main()
