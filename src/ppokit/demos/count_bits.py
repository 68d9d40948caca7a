"""The reasoning-gym demo: a tiny model learns a real task of reasoning-gym (`ppokit demo --environment reasoning-gym`).

1. reasoning-gym's `count_bits` task on the numbers 1 to 31 ("How many 1 bits are there in the binary representation
   of the number 13?"): the PPO prompts are a `reasoning_gym:` data source, the eval prompts the same task from the
   seeds after the training entries' (`ppokit.data.reasoning_gym.eval_source`); the SFT data are other entries of the
   task (seeds before the PPO ones) answered by a sloppy solver, in reasoning-gym's answer format
   `<answer> N </answer>`: right `P_RIGHT` of the time, otherwise any other count the numbers can have;
2. a tokenizer that splits at spaces and writes numbers digit by digit (`ppokit.demos.tiny.spaced_tokenizer`); a tiny
   Llama;
3. SFT on the solver's answers: the model learns the format, and each question's right answer as its likeliest;
4. PPO with the `reasoning_gym` reward: the task's own `score_answer` on the `<answer>` part (1 for the right count).
   The mean score (`objective/scores`, the share of right answers but for reasoning-gym's partial credit for an
   answer that contains the right one) rises.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Optional

from ppokit.demos.reviews import (
    DemoChoice,
    demo_folder,
    demo_start,
    estimator_settings,
    first_and_last,
    model_heads,
    resume_ppo,
    sft_tiny_model,
    start_demo_folder,
    start_ppo,
    write_jsonl,
)

DEFAULT_ESTIMATOR = "gae"  # on the same SFT model, 32 updates: gae 0.31 -> 0.63, grpo 0.36 -> 0.45 (lr 1e-3), 0.29 -> 0.43 (3e-4)
TASK = "count_bits"
TASK_SETTINGS = "min_n=1&max_n=31"  # 31 questions
P_RIGHT = 0.4  # the SFT solver's chance of the right answer; otherwise any other count
ANSWERS = range(1, 6)  # the 1 bits of 1 to 31

# Why count_bits on 31 numbers: the tiny model learns each question's answer as its likeliest from the SFT data and
# the spread over the others as one pattern across questions, which PPO then narrows. reasoning-gym's chain_sum with two
# one-digit terms (200 questions) was tried first: after the same SFT the model answered 0.12 (wrong answers drawn from
# every possible sum) or 0.27 (one or two off) right, below the solver's 0.4, and 32 PPO updates did not move it
# (0.10 -> 0.07, 0.27 -> 0.28): the model had not learned the sums for PPO to sharpen.

SETTINGS = {
    # quick: about a minute on 2 cores (measured niced beside other work: README); full: a larger model, more updates.
    True: dict(hidden=64, layers=2, n_sft=3000, sft_epochs=8, n_prompts=1024, n_eval=32, total_episodes=2048, batch=64, lr=1e-3),
    False: dict(hidden=128, layers=4, n_sft=6000, sft_epochs=8, n_prompts=4096, n_eval=64, total_episodes=8192, batch=64, lr=1e-3),
}


def source(size: int, seed: Optional[int] = None) -> str:
    """The demo's task as a `reasoning_gym:` data source (seed None: the reader's default)."""
    return f"reasoning_gym:{TASK}?size={size}{'' if seed is None else f'&seed={seed}'}&{TASK_SETTINGS}"


def answer_text(number: int) -> str:
    """reasoning-gym's answer format, spaced for the tokenizer: `<answer> 3 </answer>` (its `extract_answer` takes one
    space on either side)."""
    return f"<answer> {number} </answer>"


def solver_rows(seed: int, n: int) -> list[dict]:
    """n entries of the task (seeds seed..seed+n-1) answered by the sloppy solver: {prompt, completion, right}."""
    from ppokit.data.reasoning_gym import read_rows

    rng = random.Random(seed)
    rows = []
    for row in read_rows(source(n, seed)):
        right = rng.random() < P_RIGHT
        answer = int(row["answer"]) if right else rng.choice([a for a in ANSWERS if a != int(row["answer"])])
        rows.append({"prompt": row["prompt"], "completion": " " + answer_text(answer), "right": right})
    return rows


def prepare_task_demo(out: Path, quick: bool, seed: int, say, engine: str = "hf") -> Path:
    """Steps 1-3: the solver's answers, a tokenizer and a tiny model fine-tuned on them, in out/sft."""
    from ppokit.training.sft import encode_pair
    from ppokit.demos.tiny import spaced_tokenizer

    s = SETTINGS[quick]
    start_demo_folder(out, seed)
    sft = solver_rows(seed, s["n_sft"])  # seeds seed .. seed+n_sft-1; PPO's start after them
    write_jsonl(out / "data" / "sft.jsonl", sft)
    say(f"[1/4] data: {len(sft)} entries of reasoning-gym's {TASK} ({TASK_SETTINGS.replace('&', ', ')}) answered by a solver "
        f"right {sum(r['right'] for r in sft) / len(sft):.0%} of the time, otherwise any other count; PPO prompts: "
        f"{source(s['n_prompts'], seed + s['n_sft'])}")
    tokenizer = spaced_tokenizer([r["prompt"] + r["completion"] for r in sft])
    examples = lambda: [encode_pair(tokenizer, r["prompt"], r["completion"]) for r in sft]  # noqa: E731
    sft_tiny_model(out, tokenizer, examples, s, seed, say, " on the solver's answers", heads=model_heads(s["hidden"], engine))
    return out


def task_config(base: Path, out: Path, quick: bool, seed: int, estimator: dict, engine: str = "hf"):
    from ppokit.config.schema import DataConfig, PPOConfig, PPOHyperparams, RewardConfig, RolloutConfig

    s = SETTINGS[quick]
    return PPOConfig(
        model=str(base / "sft"),
        output_dir=str(out / "ppo"),
        seed=seed,
        reward=RewardConfig(functions=["ppokit.rewards:reasoning_gym"]),
        # eval: no seed given, so its entries start after the training entries' (the questions repeat: there are 31)
        data=DataConfig(train=source(s["n_prompts"], seed + s["n_sft"]), eval=source(s["n_eval"])),
        rollout=RolloutConfig(engine=engine),
        ppo=PPOHyperparams(
            total_episodes=s["total_episodes"], per_device_train_batch_size=s["batch"] // 2, gradient_accumulation_steps=1,
            num_mini_batches=2, num_ppo_epochs=4, response_length=6, temperature=1.0, learning_rate=s["lr"], kl_coef=0.01,
            num_sample_generations=4, num_eval_samples=s["n_eval"], **estimator,
        ),
    )


def run_task_demo(output_dir: str | Path | None = None, quick: bool = False, seed: int = 0, show_progress: bool = True,
                  estimator: Optional[str] = None, prepared: str | Path | None = None, overwrite: bool = False, engine: str = "hf",
                  resume: bool = False) -> dict:
    """Steps 1-4 (the arguments as `ppokit.demos.reviews.run_demo`'s; estimator None: DEFAULT_ESTIMATOR); returns the first
    and last mean score of the training batches and of the eval prompts."""
    from ppokit.data.reasoning_gym import library

    library()  # without the package: its one line before any folder or work
    choice = DemoChoice.of("reasoning-gym", quick, seed, estimator, engine)
    out = demo_folder(choice, output_dir, overwrite, resume)
    start = time.perf_counter()
    base, say = demo_start(choice, out, prepared, resume, show_progress, lambda out, say: prepare_task_demo(out, quick, seed, say, engine))
    trainer = start_ppo(task_config(base, out, quick, seed, estimator_settings(choice.estimator), engine), show_progress, overwrite)
    say(f"[4/4] PPO ({choice.estimator}, rollout.engine {engine}): {trainer.sizes.num_updates} updates of {trainer.sizes.batch} "
        f"answers; reward: reasoning-gym's score_answer for {TASK} (1 for the right count)")
    if resume:
        resume_ppo(trainer, say)
    records = trainer.train()
    window, summary = first_and_last(records, score="objective/scores")
    evals = [r["eval/scores"] for r in records if "eval/scores" in r]
    summary = {
        **summary, "eval_start": evals[0] if evals else None, "eval_end": evals[-1] if evals else None,
        "environment": "reasoning-gym", "estimator": choice.estimator, "engine": engine, "updates": len(records),
        "seconds": round(time.perf_counter() - start, 1), "output_dir": str(out),
    }
    eval_line = f"; eval {summary['eval_start']:.2f} -> {summary['eval_end']:.2f}" if evals else ""
    say(f"\nmean score (right answers) {summary['score_start']:.2f} -> {summary['score_end']:.2f} (means over the first and last "
        f"{window} updates){eval_line}, {summary['seconds']:.0f}s. Run directory: {out / 'ppo'}")
    return summary
