"""GRPO with and without rollout.dynamic_sampling on a task where most groups teach nothing: updates to a score.

    nice -n 10 python benchmarks/dynamic_sampling.py [--updates 30] [--word excellent] [--target 0.3] [--seed 0]

The quick demo's tiny Llama after SFT on the demo reviews (`demos.reviews.prepare_demo`) writes a review; the reward
is 1 when the review has the word `--word` (or, given `a,b`, every one of them) and 0 otherwise. Few reviews have it, so with 4 samples per prompt most
groups score 0, 0, 0, 0: zero advantage under GRPO. Both runs are the same GRPO run (8 prompts x 4 samples per
update, the same seed and prompts) but for rollout.dynamic_sampling, which trains each update on groups that have
spread, sampling further rounds of prompts for them (at most 8 extra). After every update both sample the 64 eval
prompts once each (`eval/scores`, temperature 1). Prints one JSON line: per run the updates until the eval score,
averaged over the last 3 updates, first reaches `--target`, the curve, and what it cost (episodes sampled, seconds).
The machine's load moves the seconds, never the numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

WINDOW = 3  # updates the eval score is averaged over


class HasWord:
    """Reward 1.0 for a completion with every word of `words` (comma-separated), else 0.0 (`has_word` in the metrics)."""

    def __init__(self, words: str):
        self.words, self.__name__ = words.split(","), "has_word"

    def __call__(self, prompts, completions, **columns):
        return [1.0 if all(word in completion.split() for word in self.words) else 0.0 for completion in completions]


def run(sft: Path, data: Path, out: Path, *, dynamic: bool, updates: int, word: str, seed: int, learning_rate: float) -> dict:
    from ppokit import PPOTrainer
    from ppokit.config.schema import DataConfig, PPOConfig, PPOHyperparams, RewardConfig

    config = PPOConfig(
        model=str(sft), output_dir=str(out), seed=seed, reward=RewardConfig(functions=[]),
        data=DataConfig(train=str(data / "prompts.jsonl"), eval=str(data / "eval_prompts.jsonl")),
        ppo=PPOHyperparams(advantage_estimator="grpo", num_samples_per_prompt=4, total_episodes=32 * updates,
                           per_device_train_batch_size=16, num_mini_batches=2, num_ppo_epochs=2, response_length=12,
                           temperature=1.0, learning_rate=learning_rate, kl_coef=0.0, num_sample_generations=updates,
                           num_eval_samples=64, stop_token="eos", save_steps=0),
    )
    config.rollout.dynamic_sampling = dynamic
    if dynamic:
        config.rollout.dynamic_sampling_extra_rounds = 8
    started = time.perf_counter()
    records = PPOTrainer(config, reward_functions=[HasWord(word)], show_progress=False).train()
    seconds = time.perf_counter() - started
    scores = [r["eval/scores"] for r in records]
    smoothed = [sum(scores[max(0, i - WINDOW + 1): i + 1]) / len(scores[max(0, i - WINDOW + 1): i + 1]) for i in range(len(scores))]
    rounds = [r.get("rollout/rounds", 1.0) for r in records]
    return {
        "eval_score": [round(s, 3) for s in scores],
        "eval_score_smoothed": [round(s, 3) for s in smoothed],
        "train_reward": [round(r["reward/has_word"], 3) for r in records],
        "groups_kept": [round(r["rollout/groups_kept"], 3) for r in records] if dynamic else None,
        "rounds_per_update": rounds,
        "episodes_sampled": int(sum(rounds) * 32),
        "seconds": round(seconds, 1),
        "smoothed": smoothed,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--updates", type=int, default=30)
    parser.add_argument("--word", default="excellent", help="the word rewarded; a,b: a review with both (rarer)")
    parser.add_argument("--target", type=float, default=0.3, help="eval score (averaged over 3 updates) to reach")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--runs", default="grpo,grpo_dynamic_sampling", help="which runs (e.g. grpo alone, for more updates)")
    args = parser.parse_args()

    from ppokit.demos.reviews import make_data, prepare_demo, write_jsonl

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        prepare_demo(folder / "demo", quick=True, seed=args.seed, say=lambda line: print(line, file=sys.stderr))
        data = folder / "demo" / "data"
        write_jsonl(data / "eval_prompts.jsonl", make_data(args.seed + 1, 0, 64, 0)["prompts"])  # 64 eval prompts
        runs = {}
        for name, dynamic in (("grpo", False), ("grpo_dynamic_sampling", True)):
            if name not in args.runs.split(","):
                continue
            runs[name] = run(folder / "demo" / "sft", data, folder / name, dynamic=dynamic, updates=args.updates, word=args.word, seed=args.seed,
                               learning_rate=args.learning_rate)
            print(f"{name}: done in {runs[name]['seconds']} s", file=sys.stderr)
    for result in runs.values():
        smoothed = result.pop("smoothed")
        result["updates_to_target"] = next((i + 1 for i, s in enumerate(smoothed) if s >= args.target), None)
    print(json.dumps({"benchmark": "dynamic_sampling", "word": args.word, "target": args.target, "window": WINDOW,
                      "updates": args.updates, "seed": args.seed, "learning_rate": args.learning_rate, "episodes_per_update": 32, **runs}))


if __name__ == "__main__":
    main()
