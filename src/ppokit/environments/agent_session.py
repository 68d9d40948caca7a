"""One episode's calls from an agent (`AgentSession`): each call to the endpoint is one engine request, recorded as
(prompt tokens, sampled tokens, logprobs), and the calls that continue one another at the token level make a segment
(`Segment`). How calls become segments, and which are re-tokenised, is described in `environments.agent`; how the
agent is started and its reward read is `environments.agent.AgentRunner`'s.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from ppokit.conversation.renderer import ConversationRenderer
from ppokit.data.lengths import encode_prompt_text
from ppokit.engines.base import Request, Sampling
from ppokit.environments.agent import AgentRunner
from ppokit.environments.agent_endpoint import MODEL_NAME, Refused
from ppokit.environments.tool_parsers import BadToolCall
from ppokit.errors import UserError
from ppokit.process.workers import raised_text
from ppokit.training.episodes import Span

# what ends a turn's text before its calls, per format (the content returned beside `tool_calls`); formats whose whole
# turn is the call (llama3_json, pythonic, openai) return no content with calls
CALL_MARKERS = {"hermes": "<tool_call>", "qwen3_coder": "<tool_call>", "mistral": "[TOOL_CALLS]"}


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
