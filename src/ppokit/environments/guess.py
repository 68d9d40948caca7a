"""The demo game `ppokit.environments:GuessNumber`: guess a number from 1 to 16.

The model guesses; the environment answers "higher" (the number is higher than the guess), "lower" or
"correct". Reward 1 on "correct", which ends the episode. Every word is short and plain, so a word-level
tokenizer trained on the generated transcripts (`guess_transcripts`) holds them all.

    rows = guess_rows(seed, n)               # [{"prompt": "guess a number from 1 to 16 .", "target": 11}, ...]
    transcripts = guess_transcripts(seed, n) # the same rows with "turns": [["8", "higher"], ["12", "lower"], ...]
"""

from __future__ import annotations

import random
import re
from typing import Optional

from ppokit.errors import UserError

LOW, HIGH = 1, 16
ANSWERS = ("higher", "lower", "correct")
NOT_A_GUESS = "number"  # the answer to a turn without a number in range: the word the game wants
FIRST_NUMBER = re.compile(r"-?\d+")


def guess_prompt(low: int = LOW, high: int = HIGH) -> str:
    return f"guess a number from {low} to {high} ."


class GuessNumber:
    """environment_args: low (1), high (16), target_column ("target": the row's column that holds the number),
    guess_cost (0: what each turn costs, so that an episode's summed reward is 1 for a win less guess_cost per guess).

    reset: reads the target from the row (an integer in [low, high]); no observation (the prompt says
    what to do). step: the first integer in the turn is the guess; the answer is "higher", "lower" or
    "correct" (reward 1, done); a turn without a number in [low, high] is answered "number" (reward 0);
    every turn's reward less guess_cost.
    """

    def __init__(self, low: int = LOW, high: int = HIGH, target_column: str = "target", guess_cost: float = 0.0):
        if isinstance(low, bool) or isinstance(high, bool) or not isinstance(low, int) or not isinstance(high, int) or low >= high:
            raise UserError(f"environment_args: GuessNumber needs integers low < high, got low={low!r}, high={high!r}")
        if isinstance(guess_cost, bool) or not isinstance(guess_cost, (int, float)) or not 0 <= guess_cost < float("inf"):
            raise UserError(f"environment_args.guess_cost: GuessNumber needs a finite number >= 0, got {guess_cost!r}")
        self.low, self.high, self.target_column, self.guess_cost = low, high, target_column, float(guess_cost)
        self.target: Optional[int] = None

    def reset(self, row: dict) -> None:
        if self.target_column not in row:
            raise UserError(f"GuessNumber: the data has no column {self.target_column!r} (the number to guess); columns: {', '.join(map(str, row))}")
        target = row[self.target_column]
        if isinstance(target, bool) or not isinstance(target, int) or not self.low <= target <= self.high:
            raise ValueError(f"the row's {self.target_column} is {target!r}, not an integer in [{self.low}, {self.high}]")
        self.target = target
        return None

    def step(self, completion: str) -> tuple[str, float, bool]:
        match = FIRST_NUMBER.search(completion)
        guess = int(match.group()) if match else None
        if guess is None or not self.low <= guess <= self.high:
            return NOT_A_GUESS, -self.guess_cost, False
        word, reward, done = answer(guess, self.target)
        return word, reward - self.guess_cost, done


def answer(guess: int, target: int) -> tuple[str, float, bool]:
    """The game's answer to one guess: (word, reward, done)."""
    if guess == target:
        return "correct", 1.0, True
    return ("higher" if target > guess else "lower"), 0.0, False


def guess_rows(seed: int, n: int, low: int = LOW, high: int = HIGH) -> list[dict]:
    """n data rows {"prompt", "target"}, targets drawn uniformly (seeded)."""
    rng = random.Random(seed)
    return [{"prompt": guess_prompt(low, high), "target": rng.randint(low, high)} for _ in range(n)]


STRATEGIES = ("random", "bisect", "sloppy")


def play(target: int, rng: random.Random, low: int = LOW, high: int = HIGH, strategy: str = "random",
         max_turns: Optional[int] = None, p_middle: float = 0.5) -> list[list[str]]:
    """One game as [[guess, answer], ...] with a consistent player: each guess lies in the interval the
    answers so far leave open. strategy "random": uniform in it (about 2 ln n turns); "bisect": its middle
    (at most log2 n + 1 turns); "sloppy": its middle with probability `p_middle`, else one of its two ends
    (a bisecting player who often does not: room for PPO to learn to bisect every time). Stops at "correct"
    or max_turns."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    lo, hi, turns = low, high, []
    while max_turns is None or len(turns) < max_turns:
        guess = _guess(lo, hi, rng, strategy, p_middle)
        word, _, done = answer(guess, target)
        turns.append([str(guess), word])
        if done:
            break
        lo, hi = (guess + 1, hi) if word == "higher" else (lo, guess - 1)
    return turns


def _guess(lo: int, hi: int, rng: random.Random, strategy: str, p_middle: float) -> int:
    if strategy == "random":
        return rng.randint(lo, hi)
    if strategy == "sloppy" and rng.random() >= p_middle:
        return lo if rng.random() < 0.5 else hi
    return (lo + hi) // 2


def guess_transcripts(seed: int, n: int, low: int = LOW, high: int = HIGH, strategy: str = "random",
                      max_turns: Optional[int] = None, p_middle: float = 0.5) -> list[dict]:
    """n SFT transcripts: {"prompt", "target", "turns": [[guess, answer], ...], "messages": chat form}.
    `messages` is the user prompt, then per turn an assistant guess and, unless it is the last turn,
    the answer as a user message (the answer to the last turn ends the episode and is not trained on)."""
    rng = random.Random(seed)
    rows = []
    for row in guess_rows(rng.randrange(2**32), n, low, high):
        turns = play(row["target"], rng, low, high, strategy, max_turns, p_middle)
        messages = [{"role": "user", "content": row["prompt"]}]
        for i, (guess, word) in enumerate(turns):
            messages.append({"role": "assistant", "content": guess})
            if i + 1 < len(turns):
                messages.append({"role": "user", "content": word})
        rows.append({**row, "turns": turns, "messages": messages})
    return rows


def vocabulary(low: int = LOW, high: int = HIGH) -> list[str]:
    """Every word the game's prompts, guesses and answers use (for a word-level tokenizer)."""
    return guess_prompt(low, high).split() + [str(i) for i in range(low, high + 1)] + list(ANSWERS) + [NOT_A_GUESS]
