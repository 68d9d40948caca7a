"""The multi-turn demo: a tiny model learns to play a guessing game (`ppokit demo --environment guess`).

1. games of the built-in GuessNumber environment (a number from 1 to 16; it answers "higher",
   "lower" or "correct") by a player that guesses at random within what the answers allow;
2. train a word-level tokenizer on the transcripts and build a tiny Llama-style model;
3. fine-tune it (SFT) on the transcripts, its own turns only, so that it knows the format;
4. run PPO with the game as the environment: the episode's reward is the environment's. The share
   of games won within the turn limit (`env/done_rate`) rises and the mean number of turns falls.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from ppokit.config import DataConfig, PPOConfig, PPOHyperparams, RewardConfig, RolloutConfig
from ppokit.demo import demo_folder, estimator_settings, model_heads, sft_tiny_model, start_demo_folder, write_jsonl
from ppokit.sft import IGNORE_INDEX, build_example
from ppokit.tiny import word_tokenizer

GAME = "ppokit.environments:GuessNumber"
MAX_TURNS = 5

SETTINGS = {
    # quick: about 4 minutes on 2 cores (measured: won 49% -> 58%, turns 4.17 -> 4.02 with gae); full: larger and longer.
    True: dict(hidden=64, layers=2, n_games=3000, sft_epochs=2, n_prompts=512, total_episodes=3072, batch=64, lr=3e-4,
                length_penalty=0.02),
    False: dict(hidden=128, layers=4, n_games=6000, sft_epochs=3, n_prompts=2048, total_episodes=8192, batch=64, lr=3e-4,
                 length_penalty=0.02),
}


def sft_examples(tokenizer, games: list[dict]) -> list[tuple[list[int], list[int]]]:
    """One example per game (`guess_transcripts`): the prompt, then each guess and EOS (trained on) and the
    answer after it (read, not trained on); the answer to the last turn ends the game and is not there."""
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    examples = []
    for game in games:
        ids, labels = build_example(encode(game["prompt"]), [])
        for i, (guess, word) in enumerate(game["turns"]):
            turn = encode(guess) + [tokenizer.eos_token_id]
            ids, labels = ids + turn, labels + turn
            if i + 1 < len(game["turns"]):
                seen = encode(word)
                ids, labels = ids + seen, labels + [IGNORE_INDEX] * len(seen)
        examples.append((ids, labels))
    return examples


def prepare_game_demo(out: Path, quick: bool, seed: int, say, engine: str = "hf") -> Path:
    """Steps 1-3: the game's data, a tokenizer and a tiny model (shaped for `engine`: `ppokit.demo.model_heads`)
    fine-tuned on played games, in out/sft."""
    from ppokit.environments.guess import guess_rows, guess_transcripts, vocabulary

    s = SETTINGS[quick]
    start_demo_folder(out, seed)
    games = guess_transcripts(seed, s["n_games"], strategy="random", max_turns=MAX_TURNS)
    write_jsonl(out / "data" / "games.jsonl", games)
    write_jsonl(out / "data" / "prompts.jsonl", guess_rows(seed + 1, s["n_prompts"]))
    won = sum(game["turns"][-1][1] == "correct" for game in games) / len(games)
    say(f"[1/4] data: {len(games)} games of a player guessing at random within what the answers allow ({won:.0%} won within "
        f"{MAX_TURNS} turns, {sum(len(g['turns']) for g in games) / len(games):.2f} turns each), {s['n_prompts']} PPO prompts -> {out / 'data'}")

    tokenizer = word_tokenizer([" ".join(vocabulary())])
    sft_tiny_model(out, tokenizer, lambda: sft_examples(tokenizer, games), s, seed, say, " on the games",
                   heads=model_heads(s["hidden"], engine))
    return out


def game_config(base: Path, out: Path, quick: bool, seed: int, estimator: dict, engine: str = "hf") -> PPOConfig:
    s = SETTINGS[quick]
    return PPOConfig(
        model=str(base / "sft"),
        output_dir=str(out / "ppo"),
        seed=seed,
        environment=GAME,
        rollout=RolloutConfig(engine=engine, max_turns=MAX_TURNS, max_episode_tokens=8 * MAX_TURNS),
        reward=RewardConfig(length_penalty=s["length_penalty"]),  # a little per model token: winning sooner scores more
        data=DataConfig(train=str(base / "data" / "prompts.jsonl")),
        ppo=PPOHyperparams(
            total_episodes=s["total_episodes"], per_device_train_batch_size=s["batch"] // 2, gradient_accumulation_steps=1,
            num_mini_batches=2, num_ppo_epochs=4, response_length=3, temperature=1.0, learning_rate=s["lr"], kl_coef=0.01,
            num_sample_generations=4, **estimator,
        ),
    )


def run_game_demo(output_dir: str | Path = "ppokit-demo", quick: bool = False, seed: int = 0, show_progress: bool = True,
                  estimator: str = "gae", prepared: str | Path | None = None, overwrite: bool = False, engine: str = "hf") -> dict:
    """Steps 1-4 of the game (the arguments as `ppokit.demo.run_demo`'s); returns the first and last success rate and turns."""
    out = demo_folder(output_dir, estimator, overwrite, engine)
    from ppokit.trainer import PPOTrainer

    start = time.perf_counter()
    say = (lambda *a: print(*a, file=sys.stderr)) if show_progress else (lambda *a: None)
    base = Path(prepared) if prepared is not None else prepare_game_demo(out, quick, seed, say, engine)
    torch.manual_seed(seed)
    trainer = PPOTrainer(game_config(base, out, quick, seed, estimator_settings(estimator), engine), show_progress=show_progress,
                         overwrite=overwrite)
    say(f"[4/4] PPO ({estimator}, rollout.engine {engine}): {trainer.sizes.num_updates} updates of {trainer.sizes.batch} games, up to {MAX_TURNS} turns each, "
        "reward = the game's")
    records = trainer.train()
    window = max(1, len(records) // 6)  # one batch's win rate is noisy: means over the first and last sixth
    mean = lambda key, rs: sum(r[key] for r in rs) / len(rs)  # noqa: E731
    summary = {
        "success_start": mean("env/done_rate", records[:window]), "success_end": mean("env/done_rate", records[-window:]),
        "turns_start": mean("rollout/turns", records[:window]), "turns_end": mean("rollout/turns", records[-window:]),
        "environment": "guess", "estimator": estimator, "engine": engine, "updates": len(records),
        "seconds": round(time.perf_counter() - start, 1), "output_dir": str(out),
    }
    say(f"\ngames won within {MAX_TURNS} turns {summary['success_start']:.0%} -> {summary['success_end']:.0%}, mean turns "
        f"{summary['turns_start']:.2f} -> {summary['turns_end']:.2f} (mean of {window} updates), {summary['seconds']:.0f}s. "
        f"Run directory: {out / 'ppo'}")
    return summary
