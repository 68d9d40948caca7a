"""The multi-turn demo: a tiny model learns to play a guessing game (`ppokit demo --environment guess`).

1. play games of the built-in GuessNumber environment (a number from 1 to 16; it answers "higher",
   "lower" or "correct") with a scripted player that half the time ignores the answers;
2. train a word-level tokenizer on the transcripts and build a tiny Llama-style model;
3. fine-tune it (SFT) on the transcripts, its own turns only, so that it knows the format;
4. run PPO with the game as the environment: the episode's reward is the environment's. The share
   of games won within the turn limit (`env/done_rate`) rises and the mean number of turns falls.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch

from ppokit import run_dir
from ppokit.config import DataConfig, PPOConfig, PPOHyperparams, RewardConfig, RolloutConfig
from ppokit.models import no_progress_bars
from ppokit.sft import build_example, train_sft
from ppokit.tiny import tiny_causal_lm, word_tokenizer

GAME = "ppokit.environments:GuessNumber"
LOW, HIGH, MAX_TURNS = 1, 16, 5
PROMPT = f"guess a number from {LOW} to {HIGH} ."

SETTINGS = {
    # quick: a few minutes on 2 cores; full: a larger model and a longer run.
    True: dict(hidden=64, layers=2, n_games=3000, sft_epochs=2, n_prompts=512, total_episodes=1024, batch=32, lr=1e-3),
    False: dict(hidden=128, layers=4, n_games=6000, sft_epochs=3, n_prompts=2048, total_episodes=4096, batch=64, lr=5e-4),
}


def game_rows(rng: random.Random, n: int) -> list[dict]:
    """Data rows of the game: the prompt and the secret number GuessNumber reads (`number`)."""
    return [{"prompt": PROMPT, "number": rng.randint(LOW, HIGH)} for _ in range(n)]


def noisy_player(rng: random.Random, ignore: float = 0.5):
    """A player that guesses within what the answers so far allow, but `ignore` of the time anywhere."""
    low, high = LOW, HIGH

    def turn(last_guess, observation):
        nonlocal low, high
        if observation is not None and "higher" in observation:
            low = max(low, last_guess + 1)
        elif observation is not None and "lower" in observation:
            high = min(high, last_guess - 1)
        if rng.random() < ignore or low > high:
            return rng.randint(LOW, HIGH)
        return rng.randint(low, high)

    return turn


def play(runner, rows: list[dict], rng: random.Random) -> list[list[tuple[str, str | None]]]:
    """Each row's game with the noisy player -> its turns: (the player's guess, the observation after it
    or None after the last turn)."""
    games = []
    for row in rows:
        episode = runner.start(row, row["prompt"])
        player, guess, observation, turns = noisy_player(rng), None, None, []
        for t in range(MAX_TURNS):
            guess = player(guess, observation)
            step = episode.step(str(guess))
            observation = step.observation
            last = step.done or t + 1 == MAX_TURNS
            turns.append((str(guess), None if last else observation))
            if last:
                break
        games.append(turns)
    return games


def sft_examples(tokenizer, rows: list[dict], games) -> list[tuple[list[int], list[int]]]:
    """One example per game: the prompt, then each guess and EOS (trained on) and the observation after it (not)."""
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    examples = []
    for row, turns in zip(rows, games):
        ids, labels = build_example(encode(row["prompt"]), [])
        for guess, observation in turns:
            turn = encode(guess) + [tokenizer.eos_token_id]
            ids, labels = ids + turn, labels + turn
            if observation is not None:
                seen = encode(observation)
                ids, labels = ids + seen, labels + [-100] * len(seen)
        examples.append((ids, labels))
    return examples


def prepare_game_demo(out: Path, quick: bool, seed: int, say) -> Path:
    """Steps 1-3: the game's data, a tokenizer and a tiny model fine-tuned on played games, in out/sft."""
    from ppokit.demo import DEMO_MARKER_KIND, _write_jsonl
    from ppokit.environments.base import EnvironmentRunner

    s, rng = SETTINGS[quick], random.Random(seed)
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    run_dir.write_marker(out, DEMO_MARKER_KIND)
    runner = EnvironmentRunner.from_config(GAME, {}, None)
    sft_rows = game_rows(rng, s["n_games"])
    games = play(runner, sft_rows, rng)
    _write_jsonl(out / "data" / "prompts.jsonl", game_rows(rng, s["n_prompts"]))
    say(f"[1/4] data: {len(games)} games played by a noisy player ({sum(len(t) for t in games) / len(games):.2f} turns each), "
        f"{s['n_prompts']} PPO prompts -> {out / 'data'}")

    texts = [PROMPT] + [" ".join(f"{g} {o or ''}" for g, o in turns) for turns in games] + [" ".join(map(str, range(LOW, HIGH + 1)))]
    tokenizer = word_tokenizer(texts)
    model = tiny_causal_lm("llama", tokenizer, hidden=s["hidden"], layers=s["layers"], heads=4)
    say(f"[2/4] model: tiny Llama, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, vocabulary {len(tokenizer)}")

    examples = sft_examples(tokenizer, sft_rows, games)
    losses = train_sft(model, examples, tokenizer.pad_token_id, epochs=s["sft_epochs"], batch_size=32, learning_rate=3e-3, seed=seed)
    sft_dir = out / "sft"
    with no_progress_bars():
        model.save_pretrained(sft_dir)
    tokenizer.save_pretrained(sft_dir)
    say(f"[3/4] SFT on the games: loss {losses[0]:.2f} -> {sum(losses[-20:]) / len(losses[-20:]):.2f} over {len(losses)} steps -> {sft_dir}")
    return out


def game_config(base: Path, out: Path, quick: bool, seed: int, estimator: dict) -> PPOConfig:
    s = SETTINGS[quick]
    return PPOConfig(
        model=str(base / "sft"),
        output_dir=str(out / "ppo"),
        seed=seed,
        environment=GAME,
        rollout=RolloutConfig(max_turns=MAX_TURNS, max_episode_tokens=8 * MAX_TURNS),
        reward=RewardConfig(),
        data=DataConfig(train=str(base / "data" / "prompts.jsonl")),
        ppo=PPOHyperparams(
            total_episodes=s["total_episodes"], per_device_train_batch_size=s["batch"] // 2, gradient_accumulation_steps=1,
            num_mini_batches=2, num_ppo_epochs=4, response_length=3, temperature=1.0, learning_rate=s["lr"], kl_coef=0.01,
            num_sample_generations=0, **estimator,
        ),
    )


def run_game_demo(out: Path, quick: bool, seed: int, show_progress: bool, estimator: str, prepared, overwrite: bool) -> dict:
    """Steps 1-4 (`ppokit.demo.run_demo` with environment='guess'); returns the first and last success rate and turns."""
    from ppokit.demo import ESTIMATORS
    from ppokit.trainer import PPOTrainer

    start = time.perf_counter()
    say = (lambda *a: print(*a, file=sys.stderr)) if show_progress else (lambda *a: None)
    base = Path(prepared) if prepared is not None else prepare_game_demo(out, quick, seed, say)
    torch.manual_seed(seed)
    trainer = PPOTrainer(game_config(base, out, quick, seed, ESTIMATORS[estimator]), show_progress=show_progress, overwrite=overwrite)
    say(f"[4/4] PPO ({estimator}): {trainer.sizes.num_updates} updates of {trainer.sizes.batch} games, up to {MAX_TURNS} turns each, "
        "reward = the game's")
    records = trainer.train()
    window = max(1, min(3, len(records) // 4))
    mean = lambda key, rs: sum(r[key] for r in rs) / len(rs)  # noqa: E731
    summary = {
        "success_start": mean("env/done_rate", records[:window]), "success_end": mean("env/done_rate", records[-window:]),
        "turns_start": mean("rollout/turns", records[:window]), "turns_end": mean("rollout/turns", records[-window:]),
        "environment": "guess", "estimator": estimator, "updates": len(records),
        "seconds": round(time.perf_counter() - start, 1), "output_dir": str(out),
    }
    say(f"\ngames won within {MAX_TURNS} turns {summary['success_start']:.0%} -> {summary['success_end']:.0%}, mean turns "
        f"{summary['turns_start']:.2f} -> {summary['turns_end']:.2f} (mean of {window} updates), {summary['seconds']:.0f}s. "
        f"Run directory: {out / 'ppo'}")
    return summary
