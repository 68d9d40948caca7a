"""Agents as programs: `agent: path/to/agent.py:FUNCTION` trains an agent written against an OpenAI-compatible API,
unchanged. For each row of a rollout the episode loop calls FUNCTION(row, base_url) (sync, or `async def`) with the URL of
an endpoint that serves this one episode (`agent_endpoint.Endpoint`), and the agent returns the episode's reward (a
number, or a dict with a number under "reward"; its other numbers are logged as `agent/<key>`). `agent: {command: ...}`
runs a program in any language in its place (`AgentCommand`): the URL in its environment, the row on stdin, the reward
its last line of stdout; from there on both forms are one (`AgentRunner.run`, `checked`).

Each call the agent makes is one engine request (`AgentSession.chat` / `.complete`), recorded as (prompt tokens,
sampled tokens, logprobs), sampled with the run's sampling (ppo.temperature, top_k, top_p, min_p: the logprobs must be
of the distribution that trains; a request's own temperature and the like are not read). The calls of an episode make
segments, as the Tools environment makes an episode:

    call 1: messages m1                     -> a new segment: the chat template renders m1 (with the request's tools)
    call 2: m1 + [answer 1 as returned] + o -> the same segment: its context so far + the observation o rendered at the
                                               token level (`ConversationRenderer.observation`); the model's tokens are
                                               never re-tokenised
    call 3: anything else                   -> a new segment (its prompt rendered from text: re-tokenised)

The episode is its segments, each trained as a row of its own (its model turns trained: loss mask on the sampled tokens
only; its observations read). Its last segment stands for the episode (its prompt the episode's, what reward sources
and samples see); the reward sits at its last model token (the last turn's, with rollout.turn_rewards too: the agent
gives one reward) and the advantage is the episode's, computed over its segments together (`training.segments`). Calls per episode, segments per episode
and the re-tokenised share (the share of calls after the first that started a segment: 0 when the agent keeps its
history) are metrics (`agent/calls`, `agent/segments`, `agent/retokenized_share`).

An agent that raises, returns something that is not a reward, or is still running after agent_timeout_s fails its
episode with one line (`reward.on_error` applies); so does a call the engine has not answered in agent_call_timeout_s.
A sync agent runs on a thread of its own (a hung one is left running: Python cannot stop a thread), an async one on the
environments' event loop (cancelled at its deadline), a command in a process group of its own (killed at its deadline);
a command's non-zero exit or a last line that is no reward fails its episode too. Calls to an ended episode's URL are
refused (404).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import os
import shlex
import shutil
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

from ppokit.config.schema import agent_command
from ppokit.conversation.renderer import ConversationRenderer
from ppokit.conversation.templates import Renderer
from ppokit.environments.agent_endpoint import Refused
from ppokit.environments.base import environment_event_loop, prompt_suffix
from ppokit.environments.tool_parsers import ToolParser
from ppokit.errors import UserError
from ppokit.process.workers import raised_text
from ppokit.rewards.sources import as_number
from ppokit.user_code import load_attribute

AGENT_FORMS = "'path/to/agent.py:function' or 'package.module:function'"


@dataclass
class AgentOutcome:
    """What an agent's run returned, checked: its reward and its other numbers (logged as agent/<key>)."""

    reward: float
    numbers: dict[str, float] = field(default_factory=dict)


class AgentFailed(Exception):
    """An agent's run failed in a way its program reports (a command's exit status, what it printed): the message is the
    episode's error line after `agent SPEC: `."""


class AgentFunction:
    """`agent: file.py:FUNCTION`: FUNCTION(row, base_url), an `async def` on the environments' event loop, a sync function
    on a daemon thread of its own. spec: the config's `agent` (how error lines name it)."""

    at_deadline = "a sync agent's thread is left running: Python cannot stop it"

    def __init__(self, spec: str, function: Callable):
        self.spec, self.function = spec, function

    def start(self, row: dict, base_url: str) -> Awaitable:
        """The agent running -> an awaitable of what it returned."""
        loop = asyncio.get_running_loop()
        if inspect.iscoroutinefunction(self.function):
            return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.function(row, base_url), environment_event_loop()))
        answer = loop.create_future()

        def hand_back(value, error):
            if not answer.done():
                answer.set_exception(error) if error is not None else answer.set_result(value)

        def job():
            value, error = None, None
            try:
                value = self.function(row, base_url)
                if inspect.isawaitable(value):  # a sync function that returned a coroutine
                    value = asyncio.run_coroutine_threadsafe(_awaited(value), environment_event_loop()).result()
            except BaseException as e:
                error = e
            try:
                loop.call_soon_threadsafe(hand_back, value, error)
            except RuntimeError:  # the rollout is over (its loop closed): the deadline had failed the episode
                pass

        threading.Thread(target=job, name="ppokit-agent", daemon=True).start()
        return answer


class AgentCommand:
    """`agent: {command: ...}`: a program in any language, run once per episode as a process of its own (in a process
    group of its own, in the working directory) with OPENAI_BASE_URL (the episode's /v1 URL) and OPENAI_API_KEY set in
    its environment and the row as one JSON line on stdin; the last non-empty line of its stdout is what it returns (a
    JSON number, or a JSON object with "reward"). A non-zero exit or another last line fails the episode, naming its
    stderr's last line. At its deadline (or when the rollout stops) its process group is killed, and so is what it
    leaves running in it when it exits. argv: the program and its arguments (`config.schema.agent_command`)."""

    at_deadline = "its process group was killed"

    def __init__(self, argv: list[str]):
        self.argv = list(argv)
        self.spec = f"command {shlex.join(self.argv)!r}"

    async def start(self, row: dict, base_url: str):
        try:
            line = json.dumps(row, ensure_ascii=False) + "\n"
        except (TypeError, ValueError) as e:
            raise AgentFailed(f"its row cannot be written as JSON for its stdin: {e}") from None
        environment = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": API_KEY}
        try:
            process = await asyncio.create_subprocess_exec(*self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                           stderr=asyncio.subprocess.PIPE, env=environment, start_new_session=True)
        except OSError as e:
            raise AgentFailed(f"could not be started: {e.strerror or e}") from None
        # its output read meanwhile (a full pipe would stop it); its exit ends its run, whatever it left holding the pipes
        reading = [asyncio.ensure_future(process.stdout.read()), asyncio.ensure_future(process.stderr.read())]
        try:
            await _fed(process.stdin, line.encode("utf-8"))
            while process.returncode is None:  # Process.wait() would wait for the pipes' ends too
                await asyncio.sleep(EXIT_POLL_S)
            _kill_group(process.pid)
            out, err = [await read for read in reading]
        finally:  # its exit, its deadline or the rollout's stop: nothing of its group outlives the episode
            _kill_group(process.pid)
            for read in reading:
                read.cancel()
            process._transport.close()  # its pipes closed now, even where a process outside its group holds their other ends
        said = _last_line(err)
        said = f"; its stderr's last line: {_short(said, 300)}" if said else ""
        if process.returncode != 0:
            code = process.returncode
            how = f"was killed by signal {_signal_name(-code)}" if code < 0 else f"exited with status {code}"
            raise AgentFailed(how + said)
        last = _last_line(out)
        try:
            value = json.loads(last) if last else None
        except ValueError:
            value = None
        if not isinstance(value, (int, float, dict)) or isinstance(value, bool):
            printed = f"printed {_short(last)} as the last line of its stdout" if last else "printed nothing on its stdout"
            raise AgentFailed(f"{printed}; expected the reward there: a number, or a JSON object with one under \"reward\"{said}")
        return value


API_KEY = "ppokit"  # what a command's OPENAI_API_KEY says: the endpoint takes any key
EXIT_POLL_S = 0.02  # how often a running command's exit is looked for


async def _fed(stdin: asyncio.StreamWriter, data: bytes) -> None:
    """`data` written to a command's stdin, then closed; a command that exits without reading it is no error here."""
    try:
        stdin.write(data)
        await stdin.drain()
        stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group has ended
        pass


def _last_line(data: bytes) -> str:
    lines = [line.strip() for line in data.decode("utf-8", "replace").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


class AgentRunner:
    """The configured agent: its program, its deadlines, and how its calls are rendered and parsed.

    program: the loaded agent (`AgentFunction` or `AgentCommand`, from `load`): how an episode's run is started; what it
    returns is checked the same way for both; timeout_s: agent_timeout_s (the whole run of one episode); call_timeout_s:
    agent_call_timeout_s (one call's answer); parser: the tool-call format (agent_tool_parser); renderer: the run's
    conversation renderer (its tokenizer, chat template and kwargs, stop tokens), the base of the renderer each
    request's tools get."""

    def __init__(self, program: AgentFunction | AgentCommand, *, timeout_s: float, call_timeout_s: float, parser: ToolParser,
                 renderer: ConversationRenderer):
        self.program, self.spec = program, program.spec
        self.timeout_s, self.call_timeout_s, self.parser = timeout_s, call_timeout_s, parser
        self.base = renderer
        self.tokenizer = renderer.tokenizer
        self.max_prompt_tokens: Optional[int] = None  # the longest prompt a call may have (`prompt_limit`, decided at set-up)
        self._renderers: dict[str, ConversationRenderer] = {}
        self._lock = threading.Lock()

    def prompt_limit(self, max_prompt_length: Optional[int], positions: Optional[int], room: int, longest_prompt: int) -> int:
        """The longest prompt an agent's call may have, decided once at set-up (the engine holds a sequence of it + the
        episode's room): data.max_prompt_length, else what the policy's positions leave after the room; a UserError
        when neither is known. Sets `max_prompt_tokens`."""
        if max_prompt_length is not None:
            limit = max_prompt_length
        elif positions is not None and positions - room >= longest_prompt:
            limit = positions - room
        else:
            raise UserError(f"agent {self.spec}: the longest prompt of an agent's call is not known (the policy's config states no "
                            "position limit that leaves room for the episode); set data.max_prompt_length")
        self.max_prompt_tokens = limit
        return limit

    @classmethod
    def load(cls, agent: str | dict, base_dir: Optional[Path]) -> AgentFunction | AgentCommand:
        """The config's `agent` -> its program: `path/to/agent.py:function` loaded, or a command whose program is found
        (on PATH, or as a path from the working directory); one UserError line when it is not."""
        argv = agent_command(agent)
        if argv is not None:
            if shutil.which(argv[0]) is None:
                raise UserError(f"agent.command: the program {argv[0]!r} is not found ({'no executable file there' if os.sep in argv[0] else 'not on PATH'})")
            return AgentCommand(argv)
        return AgentFunction(agent, cls._function(agent, base_dir))

    @staticmethod
    def _function(spec: str, base_dir: Optional[Path]) -> Callable:
        """`path/to/agent.py:function` -> the function; one UserError line when it does not load or is not callable."""
        name, function = load_attribute(spec, base_dir, "agent", "function", AGENT_FORMS)
        if not callable(function) or isinstance(function, type):
            raise UserError(f"agent {spec!r}: {name} is not a function (its type is {type(function).__name__}); an agent is "
                            "called as FUNCTION(row, base_url) for each row")
        try:
            inspect.signature(function).bind({}, "http://host/v1")
        except TypeError as e:
            raise UserError(f"agent {spec!r}: {name} cannot be called as {name}(row, base_url): {e}") from None
        except ValueError:
            pass
        return function

    def renderer(self, tools: Optional[list]) -> ConversationRenderer:
        """The renderer of calls made with `tools` (their schemas in the prompt, as the chat template writes them)."""
        key = json.dumps(tools, sort_keys=True)
        with self._lock:
            found = self._renderers.get(key)
            if found is None:
                chat = self.base.chat
                if chat is None:
                    raise Refused(500, "the run has no chat template to render messages with (set data.chat_template)")
                chat = Renderer(self.tokenizer, chat.template_used or chat.requested, tools=tools or None,
                                template_kwargs=chat.template_kwargs)
                found = self._renderers[key] = ConversationRenderer(self.tokenizer, chat, stop_token_ids=self.base.stop_token_ids,
                                                                    observation_role="tool")
            return found

    # ------------------------------------------------------------------ one episode's run

    async def run(self, row: dict, base_url: str, prompt: Optional[str]):
        """The program's run of one episode under agent_timeout_s -> an AgentOutcome, or the episode's error line (a str)."""
        try:
            value = await asyncio.wait_for(self.program.start(row, base_url), self.timeout_s)
        except asyncio.TimeoutError:
            return f"agent {self.spec}: did not return within agent_timeout_s={self.timeout_s:g}s ({self.program.at_deadline}){prompt_suffix(prompt)}"
        except asyncio.CancelledError:
            raise
        except AgentFailed as e:
            return f"agent {self.spec}: {e}{prompt_suffix(prompt)}"
        except BaseException as e:  # whatever the agent raised, KeyboardInterrupt in its thread included, is its failure
            return f"agent {self.spec}: raised {raised_text(e).splitlines()[0] if str(e) else raised_text(e)}{prompt_suffix(prompt)}"
        return self.checked(value, prompt)

    def checked(self, value: Any, prompt: Optional[str]):
        """What the agent returned -> an AgentOutcome, or the error line (a str)."""
        numbers: dict[str, float] = {}
        reward = value
        if isinstance(value, dict):
            if "reward" not in value:
                return f"agent {self.spec}: returned a dict without a \"reward\" key ({_short(value)}){prompt_suffix(prompt)}"
            reward = value["reward"]
            for key, other in value.items():
                number = None if key == "reward" or other is None else as_number(other)
                if number is not None and math.isfinite(number):
                    numbers[f"agent/{key}"] = number
        number = None if reward is None else as_number(reward)
        if number is None or not math.isfinite(number):
            return (f"agent {self.spec}: returned the reward {_short(reward)} (a {type(reward).__name__}); expected a finite number, "
                    f"or a dict with one under \"reward\"{prompt_suffix(prompt)}")
        return AgentOutcome(number, numbers)


async def _awaited(awaitable):
    return await awaitable


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."

