"""The environment protocol, loading an environment by name, and running its code under a deadline.

An environment answers the model in a multi-turn episode (a game, a tool, an interpreter). The user
names its class in the config (`environment: path/to/env.py:ClassName` or `package.module:ClassName`,
`environment_args: {...}` for its constructor); one instance serves one episode:

    env = cls(**environment_args)
    observation = env.reset(row)                     # str or None, appended after the prompt
    observation, reward, done = env.step(completion) # after each model turn (its text, special tokens kept)
    env.close()                                      # optional: once, when its episode ends however it ends

`reset`, `step` and `close` may be `async def` (an environment that waits on a remote service): their coroutines run on one
event loop shared by every episode (a thread of its own), under the same deadline.

`EnvironmentRunner` is what the episode loop holds: it makes the instances and calls them in worker
threads under `environment_timeout_s` (`ThreadCall`, or `EnvironmentCalls`' threads kept between calls), checks what they return, and turns every
failure into an `EnvironmentFailure` (a RewardError, so `reward.on_error` applies: skip that episode
or stop the run) whose one-line message names the environment, the call and the episode's prompt.
A hung call fails its episode; its thread is left running (Python cannot stop a thread; a hung coroutine is
cancelled). Whatever the code raises is its failure, KeyboardInterrupt and other BaseExceptions included: only a
stop request that reaches the main thread (Ctrl-C) passes through (`process.workers.code_raised`). `EnvironmentCalls`
runs the calls of many episodes at once, each awaited by its episode's coroutine (the episode loop's environment calls).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import statistics
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Optional, Protocol, runtime_checkable

from ppokit.errors import UserError
from ppokit.rewards.environment import EnvironmentFailure
from ppokit.rewards.sources import as_number
from ppokit.user_code import load_attribute
from ppokit.process.workers import DeadlineExceeded, ThreadCall, WorkerThreads, code_raised, outside_event_loop, raised_text, run_coroutine

BUILTIN_ENVIRONMENTS = ("ppokit.environments:Tools", "ppokit.environments:GuessNumber", "ppokit.environments:TRLEnvironment",
                        "ppokit.environments:OpenEnv", "ppokit.environments:GymText")
SPEC_FORMS = "'path/to/env.py:ClassName' or 'package.module:ClassName' (built-in: " + ", ".join(BUILTIN_ENVIRONMENTS) + ")"


@runtime_checkable
class Environment(Protocol):
    """What answers the model in an episode. One instance per episode, built as cls(**environment_args).

    Optional attributes the episode loop reads (the built-in Tools environment sets them):
      observation_role: str = "user"    the chat role an observation is rendered as ("user" or "tool")
      tools: list[dict] | None          JSON schemas passed to the chat template as `tools=` (class or
                                        instance attribute; read once from a first instance)
      observation_messages(observation) -> list[dict]   the chat messages for one observation, when it
                                        is more than one message (several tool results)
      get_reward() -> float             the episode's reward from its own state, asked once when the episode has
                                        ended (TRL's name), added to its step rewards; may be `async def`
      reset_appends: bool = False       reset's text is appended to the prompt's last message (TRL's) instead of
                                        following it as a message of its own
      tools_for(row), environment_for(row), environment_names   rows that choose among several environments
                                        (TRLEnvironment's factories): a row's tools, its environment's name, the names
    """

    def reset(self, row: dict) -> Optional[str]:
        """row: the data row (the prompt and every other column). Returns the first observation,
        appended after the prompt, or None for none. May be `async def`."""
        ...

    def step(self, completion: str) -> tuple[Optional[str], float, bool]:
        """The model's turn as text (`ConversationRenderer.turn_text`: its special tokens kept, such as a tool call's
        marker, the stop token that ended it not included) -> (observation or None, reward, done). May be `async def`."""
        ...

    # Optional: close() (or `async def close`), called once when the episode ends, whatever ended it (done, a failed
    # call, a deadline, max_turns, the token budget), under the deadline; what it raises is said, not fatal.


class EnvironmentTimeout(EnvironmentFailure):
    """An environment call did not return within `environment_timeout_s`."""


def load_environment(spec: str, base_dir: Optional[Path] = None) -> type:
    """`path/to/env.py:ClassName` or `package.module:ClassName` -> the class; a one-line UserError
    naming the spec when it does not import, is not a class, or lacks a callable reset or step."""
    name, cls = load_attribute(spec, base_dir, "environment", "class", SPEC_FORMS)
    if not isinstance(cls, type):
        raise UserError(f"environment {spec!r}: {name} is not a class (its type is {type(cls).__name__}); an instance per episode is made as "
                        f"{name}(**environment_args)")
    missing = [method for method in ("reset", "step") if not callable(getattr(cls, method, None))]
    if missing:
        raise UserError(f"environment {spec!r}: class {name} has no {' or '.join(missing)} method; an environment needs reset(row) and step(completion) "
                        "(docs/environments.md)")
    return cls


@dataclass
class Step:
    """What one `step` returned, checked: the observation (None: none), its chat messages, the reward, done."""

    observation: Optional[str]
    reward: float
    done: bool
    messages: list[dict] = field(default_factory=list)  # [] when observation is None
    rendered: Any = None  # what the episode loop made of it within the step's deadline (its tokens), or None


def _short(text: Any, limit: int = 120) -> str:
    text = repr(text)
    return text if len(text) <= limit else text[:limit] + "..."


class EnvironmentRunner:
    """Makes one environment instance per episode and runs its calls under a deadline.

    spec: the config's `environment` (for messages); cls: the loaded class; args: `environment_args`;
    timeout_s: `environment_timeout_s` (None: call in the caller's thread, no limit); base_dir: the config
    file's folder, passed as `base_dir` to a constructor that declares that parameter (unless args set it).

        runner = EnvironmentRunner.from_config(spec, args, timeout_s, base_dir)
        runner.tools, runner.observation_role           # for rendering prompts and observations
        runner.tools_for(row), runner.environment_for(row)  # what a row uses, when rows choose among several environments
        episodes = runner.start_many(rows, prompts)     # per row: an EpisodeEnvironment or an EnvironmentFailure
        steps = runner.step_many(episodes, completions) # per episode: a Step or an EnvironmentFailure
    """

    def __init__(self, spec: str, cls: type, args: Optional[dict] = None, timeout_s: Optional[float] = 60.0,
                 base_dir: Optional[Path] = None, chat_template: Optional[str] = None):
        self.spec = spec
        self.cls = cls
        self.args = dict(args or {})
        if base_dir is not None and "base_dir" not in self.args and _declares(cls, "base_dir"):
            self.args["base_dir"] = str(base_dir)  # for relative paths in its arguments (Tools' tool files)
        if "chat_template" not in self.args and _declares(cls, "chat_template"):
            self.args["chat_template"] = chat_template  # the run's template (None: plain-text prompts): Tools reads its call format there
        self.timeout_s = timeout_s
        self.recent_call_s: deque[float] = deque(maxlen=64)  # how long its last calls on `EnvironmentCalls`' threads took
        # One instance made now: a wrong environment_args (or a tools list that does not import) fails at
        # start, in one line, rather than in the first episode; and it tells the tools and the role.
        try:
            probe = self._call(lambda: cls(**self.args), "constructing it", prompt=None)
        except EnvironmentFailure as e:
            raise UserError(str(e)) from None
        self.probe = probe  # what the row's choices are asked of (`tools_for`, `environment_for`; closed below, these read its class's tables)
        self.tools: Optional[list[dict]] = getattr(probe, "tools", None)
        self.observation_role: str = getattr(probe, "observation_role", "user")
        self.reset_appends: bool = bool(getattr(probe, "reset_appends", False))  # reset's text ends the prompt's last message
        self.environment_names: list[str] = list(getattr(probe, "environment_names", None) or [])  # rows choose among these
        self.gives_rewards: bool = bool(getattr(probe, "gives_rewards", True))
        self.notes: list[str] = list(getattr(probe, "notes", None) or [])  # what it has to tell the user at start (Tools: the call format chosen)
        EpisodeEnvironment(self, probe, None).close()  # it never plays: what it opened is closed now
        if self.observation_role not in ("user", "tool"):
            raise UserError(f"environment {spec}: observation_role must be 'user' or 'tool', got {self.observation_role!r}")

    # ------------------------------------------------------------------ what each row uses, decided here once

    @property
    def chooses_per_row(self) -> bool:
        """Whether rows choose among several environments (the environment's `tools_for`): their prompts differ in tools."""
        return callable(getattr(self.probe, "tools_for", None))

    def tools_for(self, row: dict) -> Optional[list[dict]]:
        """The tools a row's prompt shows (JSON schemas; None: none): the environment's `tools_for(row)`, else `tools`.
        A row that chooses no environment is a UserError line (the caller names the row)."""
        return self.probe.tools_for(row) if self.chooses_per_row else self.tools

    def environment_for(self, row: dict) -> Optional[str]:
        """The name of the environment a row's episode uses, among `environment_names`, for its metrics; None with one
        environment, or for a row that chooses none (its reset fails the episode)."""
        choose = getattr(self.probe, "environment_for", None)
        if choose is None:
            return None
        try:
            return choose(row)
        except Exception:  # noqa: BLE001 - its episode says why
            return None

    @classmethod
    def from_config(cls, spec: str, args: Optional[dict], timeout_s: Optional[float], base_dir: Optional[Path] = None,
                    chat_template: Optional[str] = None) -> "EnvironmentRunner":
        return cls(spec, load_environment(spec, base_dir), args, timeout_s, base_dir, chat_template)

    # ------------------------------------------------------------------ one episode at a time

    def start(self, row: dict, prompt: Optional[str] = None, watched: bool = False) -> "EpisodeEnvironment":
        """A new instance for one episode, reset on `row`; `prompt` names the episode in errors; watched: the caller
        keeps the deadline (`EnvironmentCalls`)."""
        return self.episode(prompt).start(row, watched)

    def episode(self, prompt: Optional[str] = None) -> "EpisodeEnvironment":
        """One episode's environment, not made yet (`EpisodeEnvironment.start` makes and resets it): the episode loop holds
        it before the reset so that it can close whatever instance the reset made, the reset failing or not."""
        return EpisodeEnvironment(self, None, prompt)

    # ------------------------------------------------------------------ many episodes at once

    def start_many(self, rows: list[dict], prompts: Optional[list[str]] = None) -> list:
        """`start` for every row, the calls running side by side; per row an EpisodeEnvironment or the
        EnvironmentFailure it raised (the caller applies reward.on_error)."""
        prompts = prompts if prompts is not None else [None] * len(rows)
        return self._side_by_side([partial(self.start, r, p) for r, p in zip(rows, prompts)], "reset", prompts)

    def step_many(self, episodes: list["EpisodeEnvironment"], completions: list[str], render: Optional[list] = None) -> list:
        """episode.step(completion, render) for each, side by side; per episode a Step or an EnvironmentFailure.
        render: per episode None or a function of its Step run within the same deadline (what the model reads of
        the observation: `Step.rendered`)."""
        render = render if render is not None else [None] * len(episodes)
        calls = [partial(e.step, c, r) for e, c, r in zip(episodes, completions, render)]
        return self._side_by_side(calls, "step", [e.prompt for e in episodes])

    def _side_by_side(self, calls: list, what: str, prompts: list) -> list:
        """Every call's outcome, in order, the calls running side by side (`EnvironmentCalls`)."""
        running = self.side_by_side(threaded=len(calls) > 1)

        async def every():
            return await asyncio.gather(*(running.run(call, what, prompt) for call, prompt in zip(calls, prompts)))

        return run_coroutine(every)

    def side_by_side(self, threaded: bool = True) -> "EnvironmentCalls":
        """Calls of this runner's environments that run side by side (in the event loop's thread, one at a time, without
        a deadline: environment_timeout_s null)."""
        return EnvironmentCalls(self, threaded=threaded and self.timeout_s is not None)

    def settled(self, value):
        """What an `async def` reset or step returned, run to its end on the environments' event loop (one thread
        shared by every episode's coroutines); any other value as it is. It waits at most the deadline, after which
        the coroutine is cancelled (the caller's deadline has failed its episode meanwhile), and a wait that ends
        otherwise (Ctrl-C in the caller's thread) cancels it too."""
        if not inspect.isawaitable(value):
            return value
        future = asyncio.run_coroutine_threadsafe(_awaited(value), environment_event_loop())
        try:
            return future.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise DeadlineExceeded() from None
        except BaseException:
            future.cancel()
            raise

    # ------------------------------------------------------------------ the checks

    def _call(self, fn, what: str, prompt: Optional[str], watched: bool = False):
        """fn() under the deadline (watched: in this thread, its caller keeps the deadline: `EnvironmentCalls`);
        EnvironmentFailure (or EnvironmentTimeout) naming `what` and the prompt. A UserError the environment
        raises itself (its own one-line complaint) passes through: it stops the run."""
        call = None
        try:
            if self.timeout_s is None or watched:
                return fn()
            call = ThreadCall(fn, name=f"ppokit-env-{what.split()[0]}")
            return call.result(self.timeout_s)
        except DeadlineExceeded:
            raise self.timed_out(what, prompt) from None
        except (UserError, EnvironmentFailure):
            raise
        except BaseException as e:  # KeyboardInterrupt or another BaseException the environment raised is its failure too
            if not code_raised(e, call):
                raise  # a stop request (Ctrl-C, ppokit's second signal) that reached the main thread while it ran the code
            raise EnvironmentFailure(f"environment {self.spec}: {what} raised {raised_text(e)}{prompt_suffix(prompt)}") from e

    def timed_out(self, what: str, prompt: Optional[str]) -> "EnvironmentTimeout":
        return EnvironmentTimeout(f"environment {self.spec}: {what} did not return within environment_timeout_s={self.timeout_s:g}s "
                                  f"(its thread is left running: Python cannot stop it){prompt_suffix(prompt)}")

    def _check_observation(self, env, observation, what: str, prompt: Optional[str]) -> Step:
        if observation is not None and not isinstance(observation, str):
            raise EnvironmentFailure(f"environment {self.spec}: {what} returned the observation {_short(observation)} "
                                     f"(a {type(observation).__name__}); expected a str or None{prompt_suffix(prompt)}")
        return Step(observation, 0.0, False, self._messages(env, observation, what, prompt))

    def _messages(self, env, observation: Optional[str], what: str, prompt: Optional[str]) -> list[dict]:
        if observation is None:
            return []
        render = getattr(env, "observation_messages", None)
        if render is None:
            return [{"role": self.observation_role, "content": observation}]
        messages = self._call(lambda: render(observation), f"observation_messages after {what}", prompt)
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            where = prompt_suffix(prompt)
            raise EnvironmentFailure(f"environment {self.spec}: observation_messages returned {_short(messages)}; expected a list of {{role, content}} "
                                     f"dicts{where}")
        return messages

    def check_reward(self, reward, what: str, prompt: Optional[str]) -> float:
        """A reward `what` returned -> a finite float; EnvironmentFailure naming the environment and the value otherwise."""
        number = None if reward is None else as_number(reward)  # None would read as NaN: a forgotten return
        if number is None:
            raise EnvironmentFailure(f"environment {self.spec}: {what} returned the reward {_short(reward)} (a {type(reward).__name__}); "
                                     f"expected a number{prompt_suffix(prompt)}")
        if not math.isfinite(number):
            raise EnvironmentFailure(f"environment {self.spec}: {what} returned the reward {number}; expected a finite number{prompt_suffix(prompt)}")
        return number

    def check_step(self, env, result, prompt: Optional[str]) -> Step:
        """step's return value -> a Step; EnvironmentFailure naming the environment and the value otherwise."""
        if not isinstance(result, (tuple, list)) or len(result) != 3:
            raise EnvironmentFailure(f"environment {self.spec}: step returned {_short(result)}; expected (observation, reward, done){prompt_suffix(prompt)}")
        observation, reward, done = result
        number = self.check_reward(reward, "step", prompt)
        if not _is_flag(done):
            raise EnvironmentFailure(f"environment {self.spec}: step returned done={_short(done)} (a {type(done).__name__}); "
                                     f"expected True or False{prompt_suffix(prompt)}")
        step = self._check_observation(env, observation, "step", prompt)
        step.reward, step.done = number, bool(done)
        return step


class EpisodeEnvironment:
    """One episode's environment instance (None until `start` has made it). `first`: reset's observation as a Step
    (reward 0, not done)."""

    def __init__(self, runner: EnvironmentRunner, env: Any, prompt: Optional[str]):
        self.runner = runner
        self.env = env
        self.prompt = prompt
        self.first: Optional[Step] = None
        self._lock = threading.Lock()  # between a constructor that returns late and the episode's close
        self._closed = False

    def start(self, row: dict, watched: bool = False) -> "EpisodeEnvironment":
        """Make the instance and reset it on `row`, under one deadline; -> self. The instance is held as soon as it is
        made, so that `close` closes it even when its reset fails; one made after the episode was closed (a constructor
        past its deadline) is closed at once."""
        runner = self.runner

        def make_and_reset():
            env = runner.cls(**runner.args)
            with self._lock:
                late, self.env = self._closed, env
            if late:
                self.close()
                raise DeadlineExceeded()
            return runner.settled(env.reset(dict(row)))

        observation = runner._call(make_and_reset, "reset", self.prompt, watched)
        self.first = runner._check_observation(self.env, observation, "reset", self.prompt)
        return self

    def close(self, watched: bool = False) -> Optional[str]:
        """The instance's `close()` (sync or async), once, under the deadline; -> None, or the line that says what went
        wrong (also written on stderr): a close that fails does not fail its episode, which has ended."""
        with self._lock:
            env, self._closed = self.env, True
            self.env = None
        close = getattr(env, "close", None)
        if not callable(close):
            return None
        runner = self.runner
        try:
            runner._call(lambda: runner.settled(close()), "close", self.prompt, watched)
        except (EnvironmentFailure, UserError) as e:
            line = str(e) if isinstance(e, EnvironmentFailure) else f"environment {runner.spec}: close raised {e}{prompt_suffix(self.prompt)}"
            return close_failed(line)
        return None

    def step(self, completion: str, render=None, watched: bool = False) -> Step:
        """step(completion), checked; with `render`, render(step) too (`Step.rendered`), all under one deadline:
        everything a step costs (the environment's code, its observation's messages, their tokens); watched: the
        caller keeps the deadline (`EnvironmentCalls`)."""

        def whole():
            step = self.runner.check_step(self.env, self.runner.settled(self.env.step(completion)), self.prompt)
            if render is not None and step.observation is not None:
                step.rendered = render(step)
            return step

        return self.runner._call(whole, "step", self.prompt, watched)

    def final_reward(self, watched: bool = False) -> Optional[float]:
        """The episode's reward from the environment's own state, asked once when the episode has ended: its
        `get_reward()` (TRL's name; sync or async), checked (a finite number), under the deadline; None without one."""
        get_reward = getattr(self.env, "get_reward", None)
        if not callable(get_reward):
            return None
        return self.runner._call(lambda: self.runner.check_reward(self.runner.settled(get_reward()), "get_reward", self.prompt),
                                 "get_reward", self.prompt, watched)


class EnvironmentCalls:
    """Calls of an environment's code (`EnvironmentRunner.start`, `EpisodeEnvironment.step`: each checked and under its
    own deadline) awaited by the episodes of one rollout, on the event loop that runs them.

        value = await calls.run(call, what, prompt)  # call(watched=...) -> its value; its EnvironmentFailure returned
        await calls.settle(most_s)                   # the calls started since the last settle, waited for briefly

    threaded: each call on a worker thread (`WorkerThreads`: threads kept between calls, so that a small call does not
    pay for a thread's start), its deadline kept by the event loop: a call still running `timeout_s` after it started
    is answered with the runner's EnvironmentTimeout (N slow calls cost one deadline, not N), and what it returns later
    is dropped. False: each call at once, in the event loop's thread (as in a thread without one: `outside_event_loop`),
    under the runner's own deadline. What a call raises besides its failure (a UserError the environment raised itself:
    it stops the run) is raised by `run`.
    """

    def __init__(self, runner: "EnvironmentRunner", threaded: bool):
        self.runner, self.threaded = runner, threaded
        self._fresh: set[asyncio.Future] = set()  # calls started since the last settle, not yet back with their episode
        self._returned: set[asyncio.Future] = set()  # calls back from their thread (or past their deadline), not yet with their episode
        self._settling: set[asyncio.Future] = set()  # those the running settle waits for
        self._settled: Optional[asyncio.Future] = None  # its wake-up

    async def run(self, call, what: str, prompt: Optional[str]):
        if not self.threaded:
            return outside_event_loop(partial(_outcome, call))
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        started = time.monotonic()

        def hand_back(value, took: Optional[float] = None) -> None:
            if not answer.done():  # done: it timed out already, or its episode was stopped
                answer.set_result(value)
                self._returned.add(answer)
                if took is not None:
                    self.runner.recent_call_s.append(took)

        def job():
            try:
                value = _outcome(partial(call, watched=True))
            except BaseException as e:  # the episode's to raise, not this thread's to swallow
                value = _Raised(e)
            try:
                loop.call_soon_threadsafe(hand_back, value, time.monotonic() - started)
            except RuntimeError:  # its rollout is over (the loop closed): its deadline had passed
                pass

        deadline = loop.call_later(self.runner.timeout_s, lambda: hand_back(self.runner.timed_out(what, prompt)))
        self._fresh.add(answer)
        _ENVIRONMENT_WORKERS.run(job)
        try:
            value = await answer
        finally:
            deadline.cancel()
            self._back(answer)
        if isinstance(value, _Raised):
            raise value.error
        return value

    def _back(self, answer: asyncio.Future) -> None:
        """A call's value is back with its episode, which goes on in this task up to its next request or its end."""
        self._fresh.discard(answer)
        self._returned.discard(answer)
        self._settling.discard(answer)
        if not self._settling and self._settled is not None and not self._settled.done():
            self._settled.set_result(None)

    async def settle(self, most_s: float) -> None:
        """Wait until the calls that have returned are back with their episodes, and the calls started since the last
        settle too (so that their next requests join the next engine step instead of the one after): these twice the
        median time of the environment's recent calls, if that is within most_s (the last engine step's time), and not
        at all otherwise (calls that usually take longer than a step are not waited for)."""
        fresh, self._fresh = self._fresh, set()
        wait_s = self._patience(most_s) if fresh else 0.0
        self._settling = (fresh if wait_s > 0 else set()) | self._returned
        if not self._settling:
            return
        self._settled = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(self._settled, wait_s if wait_s > 0 else None)
        except asyncio.TimeoutError:
            pass
        finally:
            self._settling, self._settled = set(), None

    def _patience(self, most_s: float) -> float:
        recent = self.runner.recent_call_s
        wait_s = 2 * statistics.median(recent) if recent else math.inf
        return wait_s if wait_s <= most_s else 0.0


_ENVIRONMENT_WORKERS = WorkerThreads("ppokit-env")


def close_later(episode: "EpisodeEnvironment") -> None:
    """episode.close() on a worker thread, not waited for (a rollout that is stopping does not wait for its closes)."""
    _ENVIRONMENT_WORKERS.run(episode.close)


@dataclass
class _Raised:
    error: BaseException


_EVENT_LOOP: Optional[asyncio.AbstractEventLoop] = None
_EVENT_LOOP_LOCK = threading.Lock()


def environment_event_loop() -> asyncio.AbstractEventLoop:
    """The event loop every `async def` reset/step runs on, in a daemon thread of its own, started at first use."""
    global _EVENT_LOOP
    with _EVENT_LOOP_LOCK:
        if _EVENT_LOOP is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="ppokit-env-async", daemon=True).start()
            _EVENT_LOOP = loop
        return _EVENT_LOOP


async def _awaited(awaitable):
    return await awaitable


def close_failed(line: str) -> str:
    """Say on stderr that an episode's close failed (its episode had ended: it keeps what it played); -> the line."""
    print(f"ppokit: warning: {line} (after its episode ended: the episode counts)", file=sys.stderr)
    return line


def prompt_suffix(prompt: Optional[str]) -> str:
    """'; prompt ...' naming the episode in an error line, or nothing."""
    return "" if prompt is None else f"; prompt {_short(prompt)}"


def _declares(cls: type, parameter: str) -> bool:
    try:
        return parameter in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False


def _outcome(call):
    """call() or the EnvironmentFailure it raised (any other exception propagates)."""
    try:
        return call()
    except EnvironmentFailure as e:
        return e


def _is_flag(value) -> bool:
    """True/False or a NumPy bool; not 1, not 'yes', not None (a forgotten return)."""
    kind = type(value)
    return isinstance(value, bool) or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"))  # NumPy 2 / 1
