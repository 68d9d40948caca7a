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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

from ppokit.config.schema import agent_command
from ppokit.conversation.renderer import ConversationRenderer
from ppokit.conversation.templates import Renderer
from ppokit.data.lengths import encode_prompt_text
from ppokit.engines.base import Request, Sampling
from ppokit.environments.agent_endpoint import MODEL_NAME, Refused
from ppokit.environments.base import environment_event_loop, prompt_suffix
from ppokit.environments.tool_parsers import BadToolCall, ToolParser
from ppokit.errors import UserError
from ppokit.process.workers import raised_text
from ppokit.rewards.sources import as_number
from ppokit.training.episodes import Span
from ppokit.user_code import load_attribute

AGENT_FORMS = "'path/to/agent.py:function' or 'package.module:function'"
# what ends a turn's text before its calls, per format (the content returned beside `tool_calls`); formats whose whole
# turn is the call (llama3_json, pythonic, openai) return no content with calls
CALL_MARKERS = {"hermes": "<tool_call>", "qwen3_coder": "<tool_call>", "mistral": "[TOOL_CALLS]"}


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


# --------------------------------------------------------------------------- one episode's calls


@dataclass
class Segment:
    """Calls that continue one another at the token level: a prompt, then model turns and observations (`Span`s)."""

    prompt: list[int]
    spans: list[Span] = field(default_factory=list)
    length: int = 0  # tokens after the prompt
    messages: Optional[list] = None  # chat: its last call's messages and the answer as returned, normalised
    text: Optional[str] = None  # completions: its last call's prompt text and the answer's text
    tools: str = "null"  # the tools its calls were made with (JSON)
    stopped: bool = False  # its last turn ended with a stop token
    truncated: bool = False  # its last turn reached the token budget without ending
    request: Optional[str] = None  # its last request's id, kept by the engine for the next call (hf)
    transcript: list[dict] = field(default_factory=list)

    def context(self) -> list[int]:
        return self.prompt + [token for span in self.spans for token in span.ids]

    def add(self, span: Span) -> None:
        self.spans.append(span)
        self.length += len(span.ids)


class AgentSession:
    """The calls of one episode's agent, answered one at a time in the order they arrive, and what they recorded.

    runner: the `AgentRunner`; ask(request) -> its Sampled (the rollout's `AsyncRequests.complete`); forget(ids): the
    engine lets go of kept requests; seed(call) -> the call's seed (`EpisodeSeeds.of(row, call)`); sampling: the run's
    (its max_new_tokens caps each call); max_calls: rollout.max_turns; room: rollout.max_episode_tokens (a segment's
    tokens after its prompt); name: the request ids' prefix (unique among the rollout's)."""

    def __init__(self, runner: AgentRunner, *, ask: Callable, forget: Callable[[list], None], seed: Callable[[int], Optional[int]],
                 sampling: Sampling, max_calls: int, room: Optional[int], name: str):
        self.runner, self.ask, self.forget, self.seed = runner, ask, forget, seed
        self.sampling, self.max_calls, self.room, self.name = sampling, max_calls, room, name
        self.segments: list[Segment] = []
        self.calls = 0
        self.error: Optional[str] = None  # a failure of ppokit's side of a call (the call's deadline)
        self.failure: Optional[BaseException] = None  # what the engine raised (not the agent's doing): the rollout's to raise
        self.broken = asyncio.Event()
        self._lock = asyncio.Lock()
        self._names: dict[str, str] = {}  # tool-call id -> the tool's name (a tool message's `name` for the template)
        self._kept: Optional[str] = None

    def failed(self, error: BaseException) -> None:
        """ppokit's side of a call failed (the engine, or a bug): the rollout stops with `error` (`broken` wakes the episode)."""
        if self.failure is None:
            self.failure = error
        self.broken.set()

    def end(self) -> None:
        """The episode has ended: what the engine kept for it is let go."""
        if self._kept is not None:
            self.forget([self._kept])
            self._kept = None

    def _left(self, segment: Segment) -> float:
        return math.inf if self.room is None else self.room - segment.length

    # ------------------------------------------------------------------ /v1/chat/completions

    async def chat(self, body: dict) -> dict:
        messages, tools, limit, stops, logprobs = _chat_request(body)
        async with self._lock:
            self._check_calls()
            renderer = self.runner.renderer(tools)
            tools_key = json.dumps(tools, sort_keys=True)
            said = [_normalised(m) for m in messages]
            segment = self._continued(said, tools_key)
            if segment is not None:
                new = [self._for_template(m) for m in messages[len(segment.messages):]]
                try:
                    observation = renderer.observation(new, "\n".join(str(m.get("content") or "") for m in new), segment.stopped,
                                                       self._left(segment))
                except UserError as e:
                    raise Refused(400, f"the chat template cannot render these messages after the model's turn: {e}", "messages") from None
                segment.add(Span(list(observation.ids)))
                segment.transcript += observation.said
                if self._left(segment) <= 0:
                    segment.truncated = True
                    raise Refused(400, f"the episode's token budget (rollout.max_episode_tokens: {self.room}) is spent: the "
                                       "conversation is too long for another call", "messages")
            else:
                try:
                    text = renderer.prompt([self._for_template(m) for m in messages])
                except UserError as e:
                    raise Refused(400, f"the chat template cannot render these messages: {e}", "messages") from None
                segment = self._new_segment(encode_prompt_text(self.runner.tokenizer, text))
                segment.tools = tools_key
                segment.transcript = [{"role": m.get("role", "user"), "text": str(m.get("content") or "")} for m in messages]
            ids, token_logprobs, finish = await self._sample(segment, limit, stops, renderer)
            text = renderer.turn_text(ids, segment.stopped)
            message = self._message(text)
            segment.messages = said + [_normalised(message)]
            segment.transcript.append({"role": "assistant", "text": text})
            if message.get("tool_calls") and finish == "stop":
                finish = "tool_calls"
            choice = {"index": 0, "message": message, "finish_reason": finish,
                      "logprobs": {"content": self._token_logprobs(ids, token_logprobs)} if logprobs else None}
            return {"id": f"chatcmpl-{self.name}-{self.calls}", "object": "chat.completion", "created": int(time.time()),
                    "model": str(body.get("model") or MODEL_NAME), "choices": [choice], "usage": self._usage(segment, ids)}

    def _continued(self, messages: list, tools: str) -> Optional[Segment]:
        """The segment this call continues: its messages are the last call's and its answer as returned, then new
        observations (tool or user messages); None: a new segment starts."""
        if not self.segments:
            return None
        last = self.segments[-1]
        if last.messages is None or last.tools != tools or len(messages) <= len(last.messages):
            return None
        if messages[: len(last.messages)] != last.messages:
            return None
        if any(m[0] not in ("tool", "user") for m in messages[len(last.messages):]):
            return None
        return last

    def _for_template(self, message: dict) -> dict:
        """A message as the chat template takes it: text content, a tool call's arguments as a dict, a tool message's name."""
        out = {key: value for key, value in message.items() if value is not None}
        out["content"] = _text(message.get("content"))
        if message.get("tool_calls"):
            out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                                  "function": {"name": c.get("function", {}).get("name"), "arguments": _arguments(c.get("function", {}).get("arguments"))}}
                                 for c in message["tool_calls"]]
        if message.get("role") == "tool" and "name" not in out and message.get("tool_call_id") in self._names:
            out["name"] = self._names[message["tool_call_id"]]
        return out

    def _message(self, text: str) -> dict:
        """The model's turn as an OpenAI assistant message: the calls the run's tool_parser finds as `tool_calls`, the
        text before them as its content."""
        parser = self.runner.parser
        calls = [c for c in parser.parse(text, None) if not isinstance(c, BadToolCall)]
        if not calls:
            return {"role": "assistant", "content": text}
        marker = CALL_MARKERS.get(parser.name)
        content = text[: text.index(marker)].strip() if marker is not None and marker in text else ""
        tool_calls = []
        for i, call in enumerate(calls):
            call_id = f"call_{self.name}_{self.calls}_{i}"
            self._names[call_id] = call.name
            tool_calls.append({"id": call_id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.arguments)}})
        return {"role": "assistant", "content": content or None, "tool_calls": tool_calls}

    # ------------------------------------------------------------------ /v1/completions

    async def complete(self, body: dict) -> dict:
        prompt, limit, stops, logprobs = _completion_request(body)
        async with self._lock:
            self._check_calls()
            renderer = self.runner.base
            last = self.segments[-1] if self.segments else None
            if isinstance(prompt, list):  # token ids: continued where they start with the last call's context
                context = last.context() if last is not None else None
                if context is not None and len(prompt) > len(context) and prompt[: len(context)] == context:
                    last.add(Span(prompt[len(context):]))
                    segment = last
                else:
                    segment = self._new_segment(prompt)
            elif last is not None and last.text is not None and len(prompt) > len(last.text) and prompt.startswith(last.text):
                last.add(Span(renderer.encode(prompt[len(last.text):])))
                segment = last
            else:
                segment = self._new_segment(encode_prompt_text(self.runner.tokenizer, prompt))
            if self._left(segment) <= 0:
                segment.truncated = True
                raise Refused(400, f"the episode's token budget (rollout.max_episode_tokens: {self.room}) is spent", "prompt")
            ids, token_logprobs, finish = await self._sample(segment, limit, stops, renderer)
            text = renderer.turn_text(ids, segment.stopped)
            segment.text = (prompt if isinstance(prompt, str) else None) and prompt + text
            segment.transcript.append({"role": "assistant", "text": text})
            pieces = [self.runner.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
            choice = {"index": 0, "text": text, "finish_reason": finish,
                      "logprobs": {"tokens": pieces, "token_logprobs": list(token_logprobs), "top_logprobs": None,
                                   "text_offset": _offsets(pieces)} if logprobs is not None else None}
            return {"id": f"cmpl-{self.name}-{self.calls}", "object": "text_completion", "created": int(time.time()),
                    "model": str(body.get("model") or MODEL_NAME), "choices": [choice], "usage": self._usage(segment, ids)}

    # ------------------------------------------------------------------ what every call shares

    def _check_calls(self) -> None:
        if self.calls >= self.max_calls:
            raise Refused(400, f"this episode has made its {self.max_calls} calls (rollout.max_turns): no more are answered")

    def _new_segment(self, prompt: list[int]) -> Segment:
        if not prompt:
            raise Refused(400, "the prompt encodes to no tokens", "prompt")
        limit = self.runner.max_prompt_tokens
        if limit is not None and len(prompt) > limit:
            raise Refused(400, f"the prompt is {len(prompt)} tokens, over the {limit} an agent's call may have (data.max_prompt_length, "
                               "or the policy's positions less the episode's room)", "messages")
        self.end()  # the previous segment's kept keys and values are not continued
        segment = Segment(list(prompt))
        self.segments.append(segment)
        return segment

    async def _sample(self, segment: Segment, limit: Optional[int], stops: list[str], renderer: ConversationRenderer):
        """One engine request for the segment's next model turn (the run's sampling, its budget cut by the request's max
        tokens and the room left), recorded as a model span -> (ids, logprobs, finish reason)."""
        budget = int(min(self.sampling.max_new_tokens, limit or math.inf, self._left(segment)))
        continues = self._kept if self._kept is not None and segment.request == self._kept else None
        request_id = f"{self.name}-{self.calls}"
        seed = self.seed(self.calls)
        sampling = self.sampling if budget == self.sampling.max_new_tokens else _with_budget(self.sampling, budget)
        request = Request(request_id, segment.context(), sampling, seed=seed, keep=seed is not None, continues=continues)
        if continues is not None:
            self._kept = None  # the engine moves what it kept to this request
        self.calls += 1
        try:
            completion = await asyncio.wait_for(self.ask(request), self.runner.call_timeout_s)
        except asyncio.TimeoutError:
            self.error = (f"agent {self.runner.spec}: call {self.calls} was not answered within agent_call_timeout_s="
                          f"{self.runner.call_timeout_s:g}s")
            raise Refused(500, self.error) from None
        except Exception as e:  # the engine failed: every episode's, not this agent's, so the rollout stops with it
            self.failed(e)
            raise Refused(500, f"the rollout engine failed: {raised_text(e)}") from None
        if completion.finish_reason == "abort":
            raise Refused(500, "the engine aborted this call")
        ids, logprobs = list(completion.token_ids), list(completion.logprobs)
        stopped = completion.finish_reason == "stop"
        cut = _stop_cut(ids, stops, self.runner.tokenizer) if stops else None
        if cut is not None:
            ids, logprobs, stopped = ids[:cut], logprobs[:cut], True
        segment.add(Span(ids, logprobs))
        segment.stopped = stopped and cut is None
        segment.truncated = not stopped and self._left(segment) <= 0
        segment.request = request_id
        if seed is not None and cut is None:
            self._kept = request_id
        else:
            self.forget([request_id]) if seed is not None else None
        finish = "stop" if stopped else "length"
        return ids, logprobs, finish

    def _token_logprobs(self, ids: list[int], logprobs: list[float]) -> list[dict]:
        pieces = [self.runner.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
        return [{"token": p, "logprob": lp, "bytes": list(p.encode("utf-8")), "top_logprobs": []} for p, lp in zip(pieces, logprobs)]

    def _usage(self, segment: Segment, ids: list[int]) -> dict:
        prompt = len(segment.context()) - len(ids)
        return {"prompt_tokens": prompt, "completion_tokens": len(ids), "total_tokens": prompt + len(ids)}

    # ------------------------------------------------------------------ what the episode trains

    def numbers(self) -> dict[str, float]:
        """calls, segments, the re-tokenised share and the trained share of this episode (`agent/*` metrics): the last
        is the share of the tokens its calls sampled that its segments' rows train (every segment trains: 1 once any
        call sampled a token)."""
        retokenized = (len(self.segments) - 1) / (self.calls - 1) if self.calls > 1 else 0.0
        sampled = sum(len(span.ids) for segment in self.segments for span in segment.spans if span.logprobs is not None)
        return {"agent/calls": float(self.calls), "agent/segments": float(len(self.segments)), "agent/retokenized_share": retokenized,
                "agent/trained_share": 1.0 if sampled else 0.0}

    def trained(self) -> Optional[Segment]:
        """The segment that stands for the episode: the last (the one the reward is about; the earlier ones train as rows
        of their own); None when the agent made no call."""
        return self.segments[-1] if self.segments else None


def _with_budget(sampling: Sampling, budget: int) -> Sampling:
    from dataclasses import replace

    return replace(sampling, max_new_tokens=budget)


def _stop_cut(ids: list[int], stops: list[str], tokenizer) -> Optional[int]:
    """The number of tokens up to and with the one that completes the first of the request's `stop` strings; None: none."""
    text = ""
    for i, token in enumerate(ids):
        text += tokenizer.decode([token], skip_special_tokens=False)
        if any(stop in text for stop in stops):
            return i + 1
    return None


def _offsets(pieces: list[str]) -> list[int]:
    offsets, at = [], 0
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    return offsets


# --------------------------------------------------------------------------- reading a request


def _chat_request(body: dict):
    _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise Refused(400, "messages: expected a non-empty list of messages, each with a role", "messages")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise Refused(400, "tools: expected a list of tool definitions", "tools")
    choice = body.get("tool_choice")
    if choice not in (None, "auto"):
        raise Refused(400, f"tool_choice: only \"auto\" is served (the model decides, as it learns to), got {choice!r}", "tool_choice")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    return messages, tools or None, _limit(limit), _stops(body.get("stop")), bool(body.get("logprobs"))


def _completion_request(body: dict):
    _common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    token_ids = isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt)
    if not (isinstance(prompt, str) and prompt) and not token_ids:
        raise Refused(400, "prompt: expected one non-empty string or one list of token ids", "prompt")
    return prompt, _limit(body.get("max_tokens")), _stops(body.get("stop")), body.get("logprobs")


def _common(body: dict) -> None:
    if body.get("stream"):
        raise Refused(400, "stream: true is not served; ask without streaming (the episode records the whole answer)", "stream")
    if body.get("n") not in (None, 1):
        raise Refused(400, f"n: only 1 is served (ppokit samples a group as separate episodes: ppo.num_samples_per_prompt), got {body.get('n')!r}", "n")


def _limit(value) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Refused(400, f"max_tokens: expected a positive integer, got {value!r}", "max_tokens")
    return value


def _stops(value) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise Refused(400, f"stop: expected a string or a list of strings, got {value!r}", "stop")
    return stops


def _text(content) -> str:
    """A message's content as text: a string, or the text parts of a list of content parts."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content)


def _arguments(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _normalised(message: dict) -> tuple:
    """What a message says, for comparing a call's messages with the last call's and its answer: its role, its text, its
    calls (names and arguments, ids aside: a client may rename them), a tool message's call id."""
    calls = tuple((c.get("function", {}).get("name"), json.dumps(_arguments(c.get("function", {}).get("arguments")), sort_keys=True))
                  for c in message.get("tool_calls") or [] if isinstance(c, dict))
    return message.get("role"), _text(message.get("content")), calls, message.get("tool_call_id") if message.get("role") == "tool" else None
