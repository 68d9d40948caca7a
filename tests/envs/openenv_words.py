"""A small OpenEnv environment in OpenEnv's template style (an Action and an Observation subclass, an Environment with
reset / step / state / close), for tests/test_openenv.py: the words game (words_rules.py: say at least N words), N the
reset's seed (the data row's `seed` column). Every reset and close is logged to $PPOKIT_WORDS_LOG, if set.

    python openenv_words.py PORT [MAX_CONCURRENT_ENVS]   # served by openenv's create_app on 127.0.0.1:PORT
"""

import sys
from typing import Optional
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field
from words_rules import log, play


class WordsAction(Action):
    message: str = Field(..., description="the model's turn")


class WordsObservation(Observation):
    reply: str = Field(default="", description="good or bad")
    words: int = Field(default=0, description="the words of the turn")


class WordsEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self):
        super().__init__()
        self.id = uuid4().hex
        self._state = State(episode_id=self.id, step_count=0)
        self.target = 1

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None) -> WordsObservation:
        self.target = 1 if seed is None else int(seed)
        self._state = State(episode_id=episode_id or self.id, step_count=0)
        log(f"reset {self.id}")
        return WordsObservation(reply="", words=0, done=False, reward=0.0)

    def step(self, action: WordsAction) -> WordsObservation:  # type: ignore[override]
        self._state.step_count += 1
        reply, reward, done, words = play(self.target, action.message)
        return WordsObservation(reply=reply, words=words, done=done, reward=reward)

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        log(f"close {self.id}")


class SharedWordsEnvironment(WordsEnvironment):
    """The same game, left at OpenEnv's default SUPPORTS_CONCURRENT_SESSIONS = False."""

    SUPPORTS_CONCURRENT_SESSIONS: bool = False


def raising_action(text: str) -> WordsAction:
    raise ValueError("no words today")


if __name__ == "__main__":
    import uvicorn
    from openenv.core.env_server.http_server import create_app

    port, sessions = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 64
    app = create_app(WordsEnvironment, WordsAction, WordsObservation, env_name="words", max_concurrent_envs=sessions)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


class GenericWordsEnvironment(Environment[WordsAction, WordsObservation, State]):
    """The game with step unannotated: its Action class is the generics' first argument."""

    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self):
        super().__init__()
        self.game = WordsEnvironment()

    def reset(self, seed=None, episode_id=None, **kwargs):
        return self.game.reset(seed, episode_id)

    def step(self, action, timeout_s=None, **kwargs):
        return self.game.step(action)

    @property
    def state(self):
        return self.game.state


class UntypedWordsEnvironment(Environment):
    """Neither an annotation nor generics: ppokit cannot tell its Action class."""

    reset = GenericWordsEnvironment.reset
    step = GenericWordsEnvironment.step
    state = GenericWordsEnvironment.state
    __init__ = GenericWordsEnvironment.__init__


def words_action(text: str) -> WordsAction:
    return WordsAction(message=text.upper())


def words_text(observation: WordsObservation) -> str:
    return f"{observation.reply} {observation.words}"
