"""Write everything `ppokit sft / rm / pipeline / data inspect` need to run on a laptop in seconds:
a tiny Llama-style model with a word-level tokenizer, generated movie-review data, and configs.

    python examples/tiny_pipeline.py tiny          # writes tiny/{base,data,*.yaml}
    ppokit data inspect tiny/data/preferences.jsonl --tokenizer tiny/base
    ppokit pipeline tiny/pipeline.yaml             # sft -> rm -> ppo; run it again: every stage is skipped
"""

import json
import random
import sys
from pathlib import Path

import torch
import yaml

from ppokit.demos.reviews import NEGATIVE, OPENERS, POSITIVE, _review, make_data
from ppokit.demos.tiny import tiny_causal_lm, word_tokenizer


def main(out: Path) -> None:
    data = make_data(seed=0, n_sft=400, n_prompts=64, n_eval=8)
    rng = random.Random(1)
    # Preference pairs: the positive review is preferred to the negative one.
    preferences = [{"prompt": rng.choice(OPENERS), "chosen": _review(rng, POSITIVE), "rejected": _review(rng, NEGATIVE)} for _ in range(256)]
    files = {"sft": data["sft"], "preferences": preferences, "prompts": data["prompts"]}
    (out / "data").mkdir(parents=True, exist_ok=True)
    for name, rows in files.items():
        (out / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    tokenizer = word_tokenizer(r["prompt"] + " " + r["completion"] for r in data["sft"])
    torch.manual_seed(0)
    tiny_causal_lm("llama", tokenizer, hidden=64, layers=2, heads=4).save_pretrained(out / "base")
    tokenizer.save_pretrained(out / "base")

    sft = {"model": str(out / "base"), "data": {"train": str(out / "data/sft.jsonl")},
           "train": {"learning_rate": 3e-3, "per_device_train_batch_size": 32, "num_train_epochs": 4}}
    rm = {"data": {"train": str(out / "data/preferences.jsonl")}, "train": {"learning_rate": 1e-3, "per_device_train_batch_size": 16}}
    ppo = {"data": {"train": str(out / "data/prompts.jsonl")},
           "ppo": {"total_episodes": 384, "per_device_train_batch_size": 16, "num_mini_batches": 2, "num_ppo_epochs": 2,
                   "response_length": 12, "temperature": 1.0, "learning_rate": 1e-3, "num_sample_generations": 4}}
    (out / "pipeline.yaml").write_text(yaml.safe_dump({"output_dir": str(out / "runs"), "sft": sft, "rm": rm, "ppo": ppo}, sort_keys=False))
    # The same stages one by one: `ppokit sft tiny/sft.yaml`, then `ppokit rm tiny/rm.yaml`.
    (out / "sft.yaml").write_text(yaml.safe_dump({**sft, "output_dir": str(out / "sft")}, sort_keys=False))
    (out / "rm.yaml").write_text(yaml.safe_dump({**rm, "model": str(out / "sft"), "output_dir": str(out / "rm")}, sort_keys=False))
    print(f"wrote {out}/base, {out}/data, {out}/pipeline.yaml, {out}/sft.yaml, {out}/rm.yaml")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "tiny"))
