"""The words game both test environments play (gym_words.py as SkyRL-gym and GEM classes, openenv_words.py as an OpenEnv
Environment): say at least N words. A turn of N or more words is answered `good` (reward 1, done); a shorter one `bad`
(reward words / 10). Every reset and close is logged as a line `reset ID` / `close ID` to the file $PPOKIT_WORDS_LOG, if
set (tests/word_game_runs.py reads it)."""

import os


def log(line: str) -> None:
    path = os.environ.get("PPOKIT_WORDS_LOG")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def play(target: int, text: str) -> tuple[str, float, bool, int]:
    """A turn's text -> (reply, reward, done, its words)."""
    words = len(text.split())
    if words >= target:
        return "good", 1.0, True, words
    return "bad", words / 10, False, words
