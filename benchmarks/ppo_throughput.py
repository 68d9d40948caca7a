"""PPO throughput on a fixed tiny config; prints one JSON line.

    python benchmarks/ppo_throughput.py [--updates N] [--arch llama] [--estimator gae] [--samples-per-prompt 1]

A tiny Llama (hidden 128, 4 layers) built locally, VADER sentiment as the reward, 64 episodes
per update, 16-token responses, 4 PPO epochs of 2 minibatches. The first update is a warm-up
and is not counted. Stage times are seconds per update (mean over the counted updates).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from ppokit.config import DataConfig, PPOConfig, PPOHyperparams, RewardConfig  # noqa: E402
from ppokit.demo import make_data  # noqa: E402
from ppokit.tiny import tiny_causal_lm, word_tokenizer  # noqa: E402
from ppokit.trainer import PPOTrainer  # noqa: E402

BATCH = 64


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--updates", type=int, default=4, help="updates to time, after one warm-up update")
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--estimator", default="gae", help="ppo.advantage_estimator")
    parser.add_argument("--samples-per-prompt", type=int, default=1, help="ppo.num_samples_per_prompt (episodes per update stay 64)")
    args = parser.parse_args()

    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="ppokit-bench-"))
    data = make_data(seed=0, n_sft=500, n_prompts=BATCH * (args.updates + 1), n_eval=4)
    tokenizer = word_tokenizer(r["prompt"] + " " + r["completion"] for r in data["sft"])
    model = tiny_causal_lm(args.arch, tokenizer, hidden=128, layers=4, heads=4)
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
            total_episodes=BATCH * (args.updates + 1),
            per_device_train_batch_size=BATCH // 2,
            num_mini_batches=2,
            num_ppo_epochs=4,
            response_length=16,
            temperature=1.0,
            learning_rate=1e-4,
            stop_token=None,  # fixed-length responses: the same work every update
            num_sample_generations=0,
            advantage_estimator=args.estimator,
            num_samples_per_prompt=args.samples_per_prompt,
        ),
    )
    trainer = PPOTrainer(config, show_progress=False)
    start = time.perf_counter()
    records = trainer.train()
    wall = time.perf_counter() - start
    timed = records[1:]
    n = len(timed)
    mean = lambda key: sum(r[key] for r in timed) / n  # noqa: E731
    generated = sum(r["objective/response_length"] * BATCH for r in timed)
    result = {
        "benchmark": "ppo_throughput",
        "arch": args.arch,
        "estimator": args.estimator,
        "samples_per_prompt": args.samples_per_prompt,
        "parameters_m": round(sum(p.numel() for p in trainer.policy.parameters()) / 1e6, 2),
        "episodes_per_update": BATCH,
        "response_length": 16,
        "updates_timed": n,
        "episodes_per_s": round(BATCH * n / sum(r["time/update"] for r in timed), 2),
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
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
