"""The embedded demo: from nothing to a policy that writes positive movie reviews, on a laptop.

1. generate short movie-review data (half positive, half negative) from a small grammar;
2. train a word-level tokenizer on it and build a tiny Llama-style model from a config;
3. fine-tune it (SFT) so it writes reviews in that style, ending with EOS;
4. run PPO with the VADER sentiment analyser as the reward (its compound score);
5. print completions for the same prompts before and after PPO.

`engine` (`rollout.engine`, default hf) samples the PPO episodes; with an engine that declares the head size it serves
(vllm: 64; its CPU attention serves none under 32) the demo model has that head_dim instead of 16 (`model_heads`).
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch

from ppokit import engines, run_dir
from ppokit.config import DataConfig, PPOConfig, PPOHyperparams, RewardConfig, RolloutConfig
from ppokit.errors import UserError
from ppokit.estimators import ESTIMATORS
from ppokit.models import no_progress_bars
from ppokit.sft import encode_pair, train_sft
from ppokit.tiny import tiny_causal_lm, word_tokenizer
from ppokit.trainer import PPOTrainer

OPENERS = [
    "the movie was", "this film is", "i thought the plot was", "the acting was", "overall the story felt",
    "the ending was", "honestly the cast was", "the soundtrack is", "the director made it", "my friends found it",
    "the second half was", "the dialogue felt", "the characters were", "as a sequel it is", "the visuals were",
    "for a comedy it was", "the script is", "the pacing was", "this thriller was", "the lead actor was",
]
POSITIVE = ["great", "wonderful", "brilliant", "beautiful", "amazing", "funny", "charming", "excellent",
            "fantastic", "delightful", "lovely", "fun", "good", "perfect", "sweet", "clever"]
NEGATIVE = ["boring", "awful", "terrible", "dull", "bad", "horrible", "weak", "stupid", "painful",
            "ugly", "sad", "disappointing", "poor", "annoying", "messy", "lame"]
NOUNS = ["music", "story", "ending", "cast", "plot", "camera work", "humor", "script", "villain", "score"]
ADVERBS = ["really", "very", "so", "quite", "truly", "pretty"]


def _review(rng: random.Random, words: list[str]) -> str:
    a, b = rng.sample(words, 2)
    noun = rng.choice(NOUNS)
    shape = rng.randrange(3)
    if shape == 0:
        return f"{rng.choice(ADVERBS)} {a} and {b} ."
    if shape == 1:
        return f"{a} , and the {noun} was {b} ."
    return f"{rng.choice(ADVERBS)} {a} . the {noun} was {b} too ."


def make_data(seed: int, n_sft: int, n_prompts: int, n_eval: int) -> dict[str, list[dict]]:
    """SFT pairs (balanced sentiment), PPO training prompts and eval prompts."""
    rng = random.Random(seed)
    sft = []
    for i in range(n_sft):
        words = POSITIVE if i % 2 == 0 else NEGATIVE
        sft.append({"prompt": rng.choice(OPENERS), "completion": _review(rng, words)})
    prompts = [{"prompt": rng.choice(OPENERS)} for _ in range(n_prompts)]
    eval_prompts = [{"prompt": OPENERS[i % len(OPENERS)]} for i in range(n_eval)]
    return {"sft": sft, "prompts": prompts, "eval_prompts": eval_prompts}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


SETTINGS = {
    # quick: under a minute on 2 cores; full: a few minutes, a larger model and a longer run.
    True: dict(hidden=64, layers=2, n_sft=2000, sft_epochs=2, n_prompts=1024, total_episodes=1024, batch=32, lr=3e-4),
    False: dict(hidden=128, layers=4, n_sft=6000, sft_epochs=3, n_prompts=4096, total_episodes=4096, batch=64, lr=1e-4),
}


def model_heads(hidden: int, engine: str) -> int:
    """Attention heads of a demo model of width `hidden` sampled by `engine`: 4 for an engine that serves any head
    size (hf: the demo as documented, head_dim 16 in the quick demo); else as many as give the head size the
    engine declares it serves everywhere (`engines.Engine.head_dim`: vllm's 64)."""
    head_dim = engines.ENGINES[engine].head_dim
    return 4 if head_dim is None else max(1, hidden // head_dim)


def estimator_settings(name: str) -> dict:
    """The ppo keys of one estimator's demo: it, with its usual samples per prompt (ppokit.estimators);
    everything else is the same demo."""
    return {"advantage_estimator": name, "num_samples_per_prompt": ESTIMATORS[name].usual_samples_per_prompt}


DEMO_MARKER_KIND = "demo"


def check_demo_output(out: Path, overwrite: bool) -> None:
    """Before any work: may the demo write into `out`? Absent, empty or an earlier demo's folder, and no
    earlier run in its ppo/, else only with `overwrite`: a refusal after minutes of SFT, or data/ and
    sft/ written over someone's own files, is what this prevents."""
    run_dir.check_output_dir(str(out), "demo --output")
    if overwrite or not out.is_dir() or run_dir.is_empty_dir(out):
        return
    if run_dir.marker_kind(out) != DEMO_MARKER_KIND:
        raise UserError(f"demo --output {out}: the folder exists and carries no `ppokit demo` marker (the demo writes data/, sft/ and "
                        "ppo/ into it; a demo folder made before ppokit marked them has none); give another --output, or pass "
                        "--overwrite to write there anyway")
    held = run_dir.holds_run(out / "ppo") if (out / "ppo").is_dir() else None
    if held is not None:
        raise UserError(f"demo --output {out}: {out / 'ppo'} holds {held} from an earlier demo; give another --output, "
                        "or pass --overwrite to replace it")


def demo_folder(output_dir: str | Path, estimator: str, overwrite: bool, engine: str = "hf") -> Path:
    """The demo's output folder, once the estimator, the engine (known and installed) and the folder are
    checked (`check_demo_output`)."""
    if estimator not in ESTIMATORS:
        raise UserError(f"demo --estimator: expected one of {', '.join(ESTIMATORS)}, got {estimator!r}")
    if engine not in engines.ENGINES:
        raise UserError(f"demo --engine: expected one of {', '.join(engines.ENGINES)}, got {engine!r}")
    engines.check_installed(engine)  # before minutes of SFT
    out = Path(output_dir)
    check_demo_output(out, overwrite)
    return out


def prepare_demo(out: Path, quick: bool, seed: int, say, engine: str = "hf") -> Path:
    """Steps 1-3: the data, a tokenizer and a tiny model (shaped for `engine`: `model_heads`), fine-tuned by SFT
    into out/sft; returns out."""
    s = SETTINGS[quick]
    start_demo_folder(out, seed)

    # 1. data
    data = make_data(seed, s["n_sft"], s["n_prompts"], 8)
    for name, rows in data.items():
        write_jsonl(out / "data" / f"{name}.jsonl", rows)
    say(f"[1/4] data: {len(data['sft'])} SFT reviews, {len(data['prompts'])} PPO prompts -> {out / 'data'}")

    # 2. tokenizer and model, 3. SFT
    tokenizer = word_tokenizer([r["prompt"] + " " + r["completion"] for r in data["sft"]])
    examples = lambda: [encode_pair(tokenizer, r["prompt"], r["completion"]) for r in data["sft"]]  # noqa: E731
    sft_tiny_model(out, tokenizer, examples, s, seed, say, heads=model_heads(s["hidden"], engine))
    return out


def start_demo_folder(out: Path, seed: int) -> None:
    """out made and marked as a demo's (`run_dir`); the random stream seeded for steps 1-3."""
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    run_dir.write_marker(out, DEMO_MARKER_KIND)


def sft_tiny_model(out: Path, tokenizer, examples, settings: dict, seed: int, say, what: str = "", *, heads: int) -> None:
    """Steps 2-3 of a demo: a tiny Llama of the demo's size with `heads` attention heads for `tokenizer`, fine-tuned
    on `examples()` (built once the model exists, as the random stream expects), saved with the tokenizer in out/sft."""
    model = tiny_causal_lm("llama", tokenizer, hidden=settings["hidden"], layers=settings["layers"], heads=heads)
    say(f"[2/4] model: tiny Llama, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters "
        f"(head_dim {settings['hidden'] // heads}), vocabulary {len(tokenizer)}")
    losses = train_sft(model, examples(), tokenizer.pad_token_id, epochs=settings["sft_epochs"], batch_size=32, learning_rate=3e-3, seed=seed)
    sft_dir = out / "sft"
    with no_progress_bars():
        model.save_pretrained(sft_dir)
    tokenizer.save_pretrained(sft_dir)
    say(f"[3/4] SFT{what}: loss {losses[0]:.2f} -> {sum(losses[-20:]) / len(losses[-20:]):.2f} over {len(losses)} steps -> {sft_dir}")


def run_demo(
    output_dir: str | Path = "ppokit-demo", quick: bool = False, seed: int = 0, show_progress: bool = True,
    estimator: str = "gae", prepared: str | Path | None = None, overwrite: bool = False, engine: str = "hf",
) -> dict:
    """Run the whole demo; returns a summary with the first and last scores and the time taken.

    estimator: one of ppokit.estimators.ESTIMATORS (ppo.advantage_estimator and its usual number of samples per
    prompt). engine: `rollout.engine` (one of ppokit.engines.ENGINES; the model's shape follows it, `model_heads`).
    prepared: the output folder of an earlier demo with the same `quick`, `seed` and `engine`,
    whose data/ and sft/ are used instead of building them again. overwrite: write into a folder that is
    not an earlier demo's, or replace the run in its ppo/ (`check_demo_output`). The multi-turn demo is
    `ppokit.demo_game.run_game_demo`.
    """
    out = demo_folder(output_dir, estimator, overwrite, engine)
    start = time.perf_counter()
    s = SETTINGS[quick]
    say = (lambda *a: print(*a, file=sys.stderr)) if show_progress else (lambda *a: None)
    base = Path(prepared) if prepared is not None else prepare_demo(out, quick, seed, say, engine)
    torch.manual_seed(seed)

    # 4. PPO against VADER sentiment
    config = PPOConfig(
        model=str(base / "sft"),
        output_dir=str(out / "ppo"),
        seed=seed,
        reward=RewardConfig(functions=["sentiment"]),
        data=DataConfig(train=str(base / "data" / "prompts.jsonl"), eval=str(base / "data" / "eval_prompts.jsonl")),
        rollout=RolloutConfig(engine=engine),
        ppo=PPOHyperparams(
            total_episodes=s["total_episodes"],
            per_device_train_batch_size=s["batch"] // 2,
            gradient_accumulation_steps=1,
            num_mini_batches=2,
            num_ppo_epochs=4,
            response_length=16,
            temperature=1.0,
            learning_rate=s["lr"],
            kl_coef=0.05,
            num_sample_generations=4,
            num_eval_samples=8,
            **estimator_settings(estimator),
        ),
    )
    trainer = PPOTrainer(config, show_progress=show_progress, overwrite=overwrite)
    n = trainer.sizes.samples_per_prompt
    samples = f" ({trainer.sizes.prompts_per_update} prompts x {n} samples)" if n > 1 else ""
    say(f"[4/4] PPO ({estimator}, rollout.engine {engine}): {trainer.sizes.num_updates} updates of {trainer.sizes.batch} episodes{samples}, reward = VADER compound sentiment")
    before = trainer.sample_completions()
    records = trainer.train()
    try:
        after = trainer.sample_completions()
    finally:  # train() closed the engine and these samples built it again: its memory freed now, not at exit
        trainer.rollout_engine.close()
    elapsed = time.perf_counter() - start

    say("\ncompletions before -> after PPO (score):")
    for b, a in zip(before, after):
        say(f"  {b['prompt']!r}\n    before {b['score']:+.2f}  {b['completion']}\n    after  {a['score']:+.2f}  {a['completion']}")
    window = max(1, min(3, len(records) // 4))
    mean_score = lambda rs: sum(r["objective/scores"] for r in rs) / len(rs)  # noqa: E731
    summary = {
        "score_start": mean_score(records[:window]),  # mean over the first updates: one batch is noisy
        "score_end": mean_score(records[-window:]),
        "eval_before": sum(r["score"] for r in before) / len(before),
        "eval_after": sum(r["score"] for r in after) / len(after),
        "estimator": estimator,
        "engine": engine,
        "kl_start": records[0]["objective/kl"],
        "last_kl": records[-1]["objective/kl"],
        "updates": len(records),
        "seconds": round(elapsed, 1),
        "output_dir": str(out),
    }
    say(
        f"\nscore {summary['score_start']:+.3f} -> {summary['score_end']:+.3f} (mean of {window} updates; eval {summary['eval_before']:+.3f} -> "
        f"{summary['eval_after']:+.3f}), KL {summary['last_kl']:.3f}, {elapsed:.0f}s. Run directory: {out / 'ppo'}"
    )
    return summary
