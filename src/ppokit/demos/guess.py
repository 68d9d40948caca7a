"""The guessing-game demo: a tiny model learns to play a game over turns (`ppokit demo --environment guess`).

1. games of the built-in GuessNumber environment (a number from 1 to 16; it answers "higher",
   "lower" or "correct") by a sloppy player: it guesses the middle of what the answers leave open only
   half the time, otherwise one of its two ends (`ppokit.environments.guess.play`, strategy "sloppy");
2. train a word-level tokenizer on the game's words and build a tiny Llama-style model;
3. fine-tune it (SFT) on the games, its own turns only: it plays like that player;
4. run PPO with the game as the environment: the episode's reward is the game's, 1 for a win, less 0.02 per
   guess (GuessNumber's guess_cost). The share of games won within the turn limit (`env/done_rate`) rises and the mean number
   of turns falls, towards bisection's (every game won, 3.375 turns on average).

Why a sloppy player rather than one guessing anywhere in what is left: the model learns from the games
to follow the answers (which numbers are still open, where the middle of them is) and to choose between a
few moves, and PPO finds which one wins; a player guessing uniformly teaches a spread over every open
number, which the tiny model imitates poorly (it wins half its games after SFT) and PPO narrows slowly.
"""

from __future__ import annotations

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

GAME = "ppokit.environments:GuessNumber"
MAX_TURNS = 5
DEFAULT_ESTIMATOR = "gae"
P_MIDDLE = 0.5  # the SFT player's chance of guessing the middle of what is left

SETTINGS = {
    # quick: about a minute of CPU (one thread, measured on a loaded machine); full: a larger model, more games and more updates.
    True: dict(hidden=64, layers=2, n_games=3000, sft_epochs=6, n_prompts=512, total_episodes=3072, batch=64, lr=3e-4,
               guess_cost=0.02),
    False: dict(hidden=128, layers=4, n_games=6000, sft_epochs=6, n_prompts=2048, total_episodes=8192, batch=64, lr=3e-4,
                guess_cost=0.02),
}


def sft_examples(tokenizer, games: list[dict]) -> list[tuple[list[int], list[int]]]:
    """One example per game (`guess_transcripts`): the prompt, then each guess and EOS (trained on) and the
    answer after it (read, not trained on); the answer to the last turn ends the game and is not there."""
    from ppokit.training.sft import IGNORE_INDEX, build_example

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


def eval_rows() -> list[dict]:
    """The eval games: every number once, so that the eval score is the share of all 16 the policy wins (less its
    guesses' cost), and the report shows the same games at each sample generation."""
    from ppokit.environments.guess import HIGH, LOW, guess_prompt

    return [{"prompt": guess_prompt(), "target": t} for t in range(LOW, HIGH + 1)]


def prepare_game_demo(out: Path, quick: bool, seed: int, say, engine: str = "hf") -> Path:
    """Steps 1-3: the game's data, a tokenizer and a tiny model (shaped for `engine`: `ppokit.demos.reviews.model_heads`)
    fine-tuned on played games, in out/sft."""
    from ppokit.environments.guess import guess_rows, guess_transcripts, vocabulary
    from ppokit.demos.tiny import word_tokenizer

    s = SETTINGS[quick]
    start_demo_folder(out, seed)
    games = guess_transcripts(seed, s["n_games"], strategy="sloppy", max_turns=MAX_TURNS, p_middle=P_MIDDLE)
    write_jsonl(out / "data" / "games.jsonl", games)
    write_jsonl(out / "data" / "prompts.jsonl", guess_rows(seed + 1, s["n_prompts"]))
    write_jsonl(out / "data" / "eval_prompts.jsonl", eval_rows())
    won = sum(game["turns"][-1][1] == "correct" for game in games) / len(games)
    say(f"[1/4] data: {len(games)} games of a player who guesses the middle of what the answers leave open {P_MIDDLE:.0%} of the "
        f"time and one of its ends otherwise ({won:.0%} won within {MAX_TURNS} turns, {sum(len(g['turns']) for g in games) / len(games):.2f} "
        f"turns each), {s['n_prompts']} PPO prompts -> {out / 'data'}")

    tokenizer = word_tokenizer([" ".join(vocabulary())])
    sft_tiny_model(out, tokenizer, lambda: sft_examples(tokenizer, games), s, seed, say, " on the games",
                   heads=model_heads(s["hidden"], engine))
    return out


def game_config(base: Path, out: Path, quick: bool, seed: int, estimator: dict, engine: str = "hf"):
    from ppokit.config.schema import DataConfig, PPOConfig, PPOHyperparams, RolloutConfig

    s = SETTINGS[quick]
    return PPOConfig(
        model=str(base / "sft"),
        output_dir=str(out / "ppo"),
        seed=seed,
        environment=GAME,
        environment_args={"guess_cost": s["guess_cost"]},  # a little per guess: winning sooner scores more
        rollout=RolloutConfig(engine=engine, max_turns=MAX_TURNS, max_episode_tokens=8 * MAX_TURNS),
        data=DataConfig(train=str(base / "data" / "prompts.jsonl"), eval=str(base / "data" / "eval_prompts.jsonl")),
        ppo=PPOHyperparams(
            total_episodes=s["total_episodes"], per_device_train_batch_size=s["batch"] // 2, gradient_accumulation_steps=1,
            num_mini_batches=2, num_ppo_epochs=4, response_length=3, temperature=1.0, learning_rate=s["lr"], kl_coef=0.01,
            num_sample_generations=4, num_eval_samples=len(eval_rows()), **estimator,
        ),
    )


def run_game_demo(output_dir: str | Path | None = None, quick: bool = False, seed: int = 0, show_progress: bool = True,
                  estimator: Optional[str] = None, prepared: str | Path | None = None, overwrite: bool = False, engine: str = "hf",
                  resume: bool = False) -> dict:
    """Steps 1-4 of the game (the arguments as `ppokit.demos.reviews.run_demo`'s; estimator None: DEFAULT_ESTIMATOR); returns
    the first and last share of games won and mean turns."""
    choice = DemoChoice.of("guess", quick, seed, estimator, engine)
    out = demo_folder(choice, output_dir, overwrite, resume)
    start = time.perf_counter()
    base, say = demo_start(choice, out, prepared, resume, show_progress, lambda out, say: prepare_game_demo(out, quick, seed, say, engine))
    trainer = start_ppo(game_config(base, out, quick, seed, estimator_settings(choice.estimator), engine), show_progress, overwrite)
    say(f"[4/4] PPO ({choice.estimator}, rollout.engine {engine}): {trainer.sizes.num_updates} updates of {trainer.sizes.batch} games, "
        f"up to {MAX_TURNS} turns each; reward: 1 for a win, less {SETTINGS[quick]['guess_cost']:g} per guess")
    if resume:
        resume_ppo(trainer, say)
    records = trainer.train()
    window, summary = first_and_last(records, success="env/done_rate", turns="rollout/turns")
    summary = {
        **summary, "environment": "guess", "estimator": choice.estimator, "engine": engine, "updates": len(records),
        "seconds": round(time.perf_counter() - start, 1), "output_dir": str(out),
    }
    say(f"\ngames won within {MAX_TURNS} turns {summary['success_start']:.0%} -> {summary['success_end']:.0%}, mean turns "
        f"{summary['turns_start']:.2f} -> {summary['turns_end']:.2f} (means over the first and last {window} updates; bisection wins "
        f"every game in 3.38 turns on average), {summary['seconds']:.0f}s. Run directory: {out / 'ppo'}")
    return summary
