"""Peak memory and episodes/s of full fine-tuning vs LoRA vs LoRA with the shared critic.

Same model, data and PPO settings for every mode; each mode runs in a fresh subprocess so
peak RSS (ru_maxrss) belongs to that mode alone. The model is a Llama of ~25M parameters
(hidden 512, 8 layers, vocabulary ~8k) built from a config, the reward is VADER sentiment.
Prints one JSON line. Usage:

    python benchmarks/memory_lora.py [--updates 2] [--response-length 16]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = {
    "full": {},
    # the non-finite guard's per-update CPU copy of trainable weights and optimiser state, switched off
    "full_no_rollback": {"ppo": {"nonfinite_rollback": False}},
    "lora": {"lora": {"r": 16}},
    "lora_shared": {"lora": {"r": 16}, "value_model": "shared"},
}


def build(workdir: Path) -> tuple[Path, Path]:
    import torch

    from ppokit.demos.reviews import make_data
    from ppokit.demos.tiny import tiny_causal_lm, word_tokenizer

    data = make_data(seed=0, n_sft=400, n_prompts=256, n_eval=4)
    # The demo's words plus filler words, for a realistic ~8k vocabulary (the LM head dominates memory at small sizes).
    texts = [r["prompt"] + " " + r["completion"] for r in data["sft"]] + [" ".join(f"w{i}" for i in range(8000))]
    tokenizer = word_tokenizer(texts)
    torch.manual_seed(0)
    model = tiny_causal_lm("llama", tokenizer, hidden=512, layers=8, heads=8, max_positions=512)
    model_dir = workdir / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    prompts = workdir / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in data["prompts"]))
    return model_dir, prompts


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_mode(mode: str, model_dir: str, prompts: str, output: str, updates: int, response_length: int) -> dict:
    import torch

    from ppokit.config.schema import PPOConfig
    from ppokit.config.fields import load_config
    from ppokit.trainer import PPOTrainer

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    baseline = rss_mib()
    batch = 16
    mode_settings = dict(MODES[mode])
    ppo_settings = mode_settings.pop("ppo", {})
    config = load_config(PPOConfig, data={
        "model": model_dir, "output_dir": output, "seed": 0,
        "reward": {"functions": ["sentiment"]}, "data": {"train": prompts},
        "ppo": {"total_episodes": batch * updates, "per_device_train_batch_size": 8, "num_mini_batches": 2,
                "num_ppo_epochs": 2, "response_length": response_length, "temperature": 1.0, "learning_rate": 1e-4,
                "num_sample_generations": 0, "local_rollout_forward_batch_size": batch, **ppo_settings},
        **mode_settings,
    })
    trainer = PPOTrainer(config, show_progress=False)
    after_load = rss_mib()
    storages = {}
    for module in (trainer.model, trainer.ref_model):
        if module is not None:
            for p in module.parameters():
                storages[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    start = time.perf_counter()
    records = trainer.train()
    elapsed = time.perf_counter() - start
    return {
        "peak_rss_mib": round(rss_mib(), 1),
        "rss_after_imports_mib": round(baseline, 1),
        "peak_above_imports_mib": round(rss_mib() - baseline, 1),
        "rss_after_setup_mib": round(after_load, 1),
        "weight_storage_mib": round(sum(storages.values()) / 2**20, 1),
        "trainable_params": trainable,
        "episodes_per_s": round(batch * len(records) / elapsed, 2),
        "seconds": round(elapsed, 1),
        "final_score": round(records[-1]["objective/scores"], 3),
        **{f"{k}_s": round(sum(r[f"time/{k}"] for r in records), 2) for k in ("generation", "forward", "training")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--response-length", type=int, default=16)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--child", nargs=4, metavar=("MODE", "MODEL", "PROMPTS", "OUTPUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_mode(*args.child, args.updates, args.response_length)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, prompts = build(Path(tmp))
        from transformers import AutoConfig

        from ppokit.plan import _stats, _dtype  # the same count the plan command prints

        config = AutoConfig.from_pretrained(model_dir)
        params = _stats(config, False, _dtype(config), None)[0]
        results = {}
        for mode in args.modes.split(","):
            cmd = [sys.executable, __file__, "--updates", str(args.updates), "--response-length", str(args.response_length),
                   "--child", mode, str(model_dir), str(prompts), str(Path(tmp) / mode)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode:
                raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
            results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps({
        "benchmark": "memory_lora", "model": "llama hidden 512, 8 layers", "params": params,
        "vocab": config.vocab_size, "updates": args.updates, "episodes_per_update": 16,
        "response_length": args.response_length, "threads": int(os.environ.get("BENCH_THREADS", "2")), **results,
    }))


if __name__ == "__main__":
    main()
