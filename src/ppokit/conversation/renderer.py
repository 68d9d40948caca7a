"""The conversation renderer: how a run's episodes become token ids, decided once, before any weights load.

    renderer = ConversationRenderer(tokenizer, Renderer(tokenizer, template, tools=...), stop_token_ids=..., observation_role=...)
    renderer.check()                                       # start-up: one UserError line naming data.chat_template
    renderer.stop_token_ids                                # what ends a model turn, decided by check()
    renderer.prompt(messages) -> str                       # a chat prompt, with the tools' schemas (`tools=`)
    renderer.first(prompt_ids, messages) -> (ids, ids)     # reset's observation after the prompt
    renderer.observation(messages, text, stopped, room)    # a step's observation after a model turn -> Observation
    renderer.turn_text(ids, stopped) -> str                # the text an environment's step receives

Prompts and observations go through the same template with the same `tools=` and template kwargs
(`data.chat_template_kwargs`, e.g. `enable_thinking`). The model's own turns are never re-rendered or re-tokenised:
an episode's context is the prompt's ids, then each model turn's ids as sampled, then the observation's ids. Those
are computed at the token level, as TRL's GRPO tool loop does: the template renders a probe conversation ending in
an assistant turn followed by the observation's messages and the generation prompt, and the observation's ids are
the ids of that rendering after the assistant turn's end (the stop token that ended it: the model wrote it, so it is
not written twice; a turn cut before its stop token gets it from here).

A model turn ends at any of the run's stop tokens (ppo.stop_token), and where the template ends a turn that calls a
tool with another special token than the ones that end an answer (gpt-oss: `<|call|>` after a call, `<|return|>`
after an answer), `check` adds that token: turns then stop at either (`stop_token_ids`, decided at start-up, read by
every engine's sampling).

Only the text after the probe turn's content is compared, so templates that render a last assistant turn differently from an earlier one (Qwen3's empty
`<think></think>`, reasoning dropped from earlier turns) work: what comes after a turn does not depend on it.

Without a chat template (plain-text prompts) an observation is its text as it is, after the turn's tokens.

Each observation call renders one probe conversation and tokenises its text from the turn's end (about a
millisecond for Qwen's template on a loaded 2-core machine, benchmarks/conversation.py); its content is first made safe (lone surrogates replaced) and cut to
what the episode's room can hold
(characters, then tokens), so a tool answering 20 million characters costs no more than the room.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

from ppokit.conversation.templates import Messages, Renderer
from ppokit.errors import UserError

PROBE_QUESTION = "ppokit probe question"
PROBE_TURN = "ppokit-probe-turn-5b1e9c"  # the probe assistant turn's content: found once in a rendering, never changed by it
PROBE_RESULT = "ppokit probe result"
WHERE = "data.chat_template"
ENCODED_KEPT = 4096  # texts whose ids `ConversationRenderer.encode` remembers


@dataclass
class Observation:
    """What the model reads after a turn: `ids`, and `said`, the transcript entries (samples.jsonl's `turns`): each
    message's role and the text the model read (cut to the room, lone surrogates replaced, words the tokenizer cannot
    represent shown as it reads them), `original` beside it where that differs from what the environment said."""

    ids: list[int]
    said: list[dict] = field(default_factory=list)


class ConversationRenderer:
    """Prompts and observations of one run through one template (see the module docstring).

    tokenizer: the policy's; chat: the chat template's renderer (`chat.Renderer`: the resolved template, the
    environment's tools' JSON schemas, the extra template variables), or None for plain-text prompts; stop_token_ids:
    the tokens that end a model turn, a tuple (`engines.base.stop_ids`; ppo.stop_token: `models.resolve_stop_token`;
    `check` may add the one the template ends a tool-calling turn with);
    observation_role: the role an observation is rendered as ("user" or "tool"); say: where notes go (a warning shown once: observation words the tokenizer
    reads as its unknown token).
    """

    def __init__(self, tokenizer, chat: Optional[Renderer], *, stop_token_ids: tuple[int, ...] = (), observation_role: str = "user",
                 say: Callable[[str], None] = lambda message: None):
        self.tokenizer, self.chat = tokenizer, chat
        self.tools = chat.tools if chat is not None else None
        self.observation_role, self.say = observation_role, say
        self.stop_token_ids: tuple[int, ...] = tuple(stop_token_ids)
        self._lock = threading.Lock()  # a fast tokenizer is called from the environment's worker threads
        self._encoded: dict[str, tuple[int, ...]] = {}  # text -> ids, oldest use first (`encode`)
        self._turn_ends: dict[tuple, tuple[dict, str, Optional[int]]] = {}  # per shape of observation: (probe turn, closing, its stop id)
        self._longest_token: Optional[int] = None
        self._prompt_probe: Optional[tuple[str, list[int]]] = None
        self._append_probe: Optional[tuple[str, list[int]]] = None  # `appended`'s probe: its text to the content's end, the ids after
        self._heads: dict[str, list[int]] = {}  # ids of the probe text before an observation, by text
        self._short = False  # observations tokenised the short way (`_suffix`), once `check` found it exact
        self._warned_unknown = False
        self._unknown_id = getattr(tokenizer, "unk_token_id", None)  # read once: a tokenizer's attributes are slow to look up
        self.first_observation_problem: Optional[str] = None  # set by check(): why a reset observation cannot follow a prompt

    # ------------------------------------------------------------------ prompts

    def prompt(self, messages: Messages, tools: Optional[list[dict]] = None) -> str:
        """A chat prompt with the generation prompt, the tools' schemas in it (as the template writes them): the
        renderer's, or `tools`, a row's own (an environment whose rows choose among several, each with its tools)."""
        return self.chat.render(messages, add_generation_prompt=True, tools=tools)

    def encode(self, text: str) -> list[int]:
        """text's token ids, remembered for the last `ENCODED_KEPT` texts: an environment's observations repeat (a
        game's "higher"), and each is read twice (what the model reads, then its ids); tokenising is the largest
        share of an environment call's time on the loop's worker threads."""
        with self._lock:
            ids = self._encoded.pop(text, None)
            if ids is None:
                ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
                if len(self._encoded) >= ENCODED_KEPT:
                    del self._encoded[next(iter(self._encoded))]  # the least recently used
            self._encoded[text] = ids  # the last used at the end
            return list(ids)

    # ------------------------------------------------------------------ model turns

    def turn_text(self, ids: list[int], stopped: bool) -> str:
        """The text of a model turn as an environment's `step` receives it: the turn's tokens decoded with special
        tokens kept (tool-call markers such as `<|python_tag|>` or `[TOOL_CALLS]` are special in some tokenizers),
        without the stop token that ended it (whichever of `stop_token_ids`)."""
        if stopped and ids:  # a stopped turn's last token is its stop token
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # ------------------------------------------------------------------ observations

    def first(self, prompt: list[int], messages: list[dict], text: str, room: Optional[float] = None) -> tuple[list[int], Observation]:
        """reset's observation after a prompt (token ids) -> (the prompt's ids without its generation prompt, what
        follows them). Plain text: the prompt as it is, the observation's text after it. Chat: the observation is
        the next message of the prompt's conversation, so that prompt + observation is what the template renders for
        [prompt's messages..., observation's messages] with the generation prompt: the prompt's own generation
        prompt (its last tokens) moves after the observation."""
        messages, said = self._safe(messages, text, room)
        if self.chat is None:
            return prompt, Observation(self.encode(said[0]["text"]), said)
        if self.first_observation_problem is not None:
            raise UserError(self.first_observation_problem)
        probe = [{"role": "user", "content": PROBE_QUESTION}]
        if self._prompt_probe is None:  # the probe prompt without and with its generation prompt: the same for every call
            closed = self.chat.render(probe, False, strip_bos=False)
            self._prompt_probe = closed, self._tail_ids(self.chat.render(probe, True, strip_bos=False), len(closed))
        closed, generation = self._prompt_probe
        rendered = self.chat.render(probe + messages, True, strip_bos=False)
        if not rendered.startswith(closed) or prompt[len(prompt) - len(generation):] != generation:
            raise UserError(f"{WHERE}: the chat template does not render an observation from reset as the next message after "
                            "the prompt (set data.chat_template=plain or another template)")
        return prompt[: len(prompt) - len(generation)], Observation(self._tail_ids(rendered, len(closed)), said)

    def appended(self, prompt: list[int], messages: list[dict], text: str, room: Optional[float] = None) -> tuple[list[int], Observation]:
        """reset's text appended to the content of the prompt's last message (TRL's environment classes) -> (the prompt's
        ids up to the end of that content, what follows them), so that prompt + observation is what the template renders
        for the prompt's messages with the text added to the last one's content: the text, then the rest of the prompt
        (the message's end, the generation prompt). The last message must be one the template ends as a user
        message. Plain text: the prompt as it is, the text after it. `messages` is not read: the text is the message's."""
        safe, said = self._safe([{"role": "user", "content": text}], text, room)
        if self.chat is None:
            return prompt, Observation(self.encode(said[0]["text"]), said)
        content = safe[0]["content"]  # cut to what the room holds, lone surrogates replaced
        if self._append_probe is None:  # the probe prompt up to its content's end, and the ids after it: the same every call
            closed = self.chat.render([{"role": "user", "content": PROBE_QUESTION}], True, strip_bos=False)
            cut = closed.index(PROBE_QUESTION) + len(PROBE_QUESTION)
            self._append_probe = closed[:cut], self._tail_ids(closed, cut)
        head, rest = self._append_probe
        rendered = self.chat.render([{"role": "user", "content": PROBE_QUESTION + content}], True, strip_bos=False)
        if not rendered.startswith(head) or not rest or prompt[len(prompt) - len(rest):] != rest:
            raise UserError(f"{WHERE}: reset's text cannot be appended to the prompt's last message: the prompt does not end "
                            "as the template ends a user message (TRL's environment classes append it there)")
        return prompt[: len(prompt) - len(rest)], Observation(self._tail_ids(rendered, len(head)), said)

    def observation(self, messages: list[dict], text: str, stopped: bool, room: Optional[float] = None) -> Observation:
        """A step's observation after a model turn (`stopped`: the turn ended with the stop token) -> its ids and
        transcript. `messages`: the observation's chat messages (`Step.messages`); `text`: its text (plain-text
        prompts use it); `room`: the tokens the episode has left (the content is cut to what that can hold)."""
        messages, said = self._safe(messages, text, room)
        if self.chat is None:
            return Observation(self.encode(said[0]["text"]), said)
        return Observation(self._suffix(messages, stopped), said)

    def _suffix(self, messages: list[dict], stopped: bool, exact: bool = False) -> list[int]:
        """The observation's ids after a turn. Exact: tokenised within the whole probe rendering, tools included. The
        short way (once `check` found it gives the same ids): the probe rendered without the tools' schemas, and only
        its text from the turn's end tokenised (the closing's ids, known, taken off) -- a few times less work."""
        shape = _shape(messages)
        if shape not in self._turn_ends:
            self._turn_ends[shape] = self._probe_turn(messages)
        turn, closing, stop = self._turn_ends[shape]
        short = self._short and not exact
        full = self.chat.render([{"role": "user", "content": PROBE_QUESTION}, turn, *messages], True, strip_bos=False, with_tools=not short)
        start = full.find(PROBE_TURN)
        after = start + len(PROBE_TURN)
        if start < 0 or full.find(PROBE_TURN, after) >= 0 or not full.startswith(closing, after):
            raise UserError(f"{WHERE}: the chat template does not render an observation after an assistant turn as a "
                            "continuation of it (set data.chat_template=plain or another template)")
        # Without a stop token of its own the template closes a turn with text (the plain template's newline): it follows.
        cut = after + len(closing) if stop is not None else after
        ids = self._tail_ids(full, cut, start=after if short else 0)
        return ids if stopped or stop is None else [stop] + ids

    def _probe_turn(self, messages: list[dict], adding: bool = False) -> tuple[dict, str, Optional[int]]:
        """The probe assistant turn before `messages`, the text the template closes it with (up to and with the stop
        token when it writes one), and that stop token's id (None: it writes none). Tried without tool calls first;
        some templates (gpt-oss) render a tool message only after a call by name. `adding` (start-up only): a turn
        that calls a tool, closed by the template with a special token that is not a stop token, makes it one."""
        plain = {"role": "assistant", "content": PROBE_TURN}
        calls = [{"type": "function", "function": {"name": m.get("name") or "tool", "arguments": {}}} for m in messages if m.get("role") == "tool"]
        candidates = [plain] + ([{**plain, "tool_calls": calls}] if calls else [])
        problem = "it renders no assistant turn before the observation"
        for turn in candidates:
            try:
                closed = self.chat.render([{"role": "user", "content": PROBE_QUESTION}, turn], False, strip_bos=False)
                self.chat.render([{"role": "user", "content": PROBE_QUESTION}, turn, *messages], True, strip_bos=False)
            except UserError as e:
                problem = str(e).removeprefix(f"{WHERE}: ")
                continue
            if closed.count(PROBE_TURN) != 1:
                continue
            tail = closed[closed.index(PROBE_TURN) + len(PROBE_TURN):]
            found = self._last_stop(tail)
            if found is None and turn is not plain and adding:
                self._add_closing_stop(closed)
                found = self._last_stop(tail)
            if found is not None:
                end, stop = found
                return turn, tail[:end], stop
            if turn is plain:
                return turn, tail, None
            said = " or ".join(repr(self._text(i)) for i in self.stop_token_ids) or "(none)"
            raise UserError(f"{WHERE}: the chat template does not end an assistant turn that calls a tool with the stop token "
                            f"{said} (ppo.stop_token); set ppo.stop_token to the token that ends such a turn")
        raise UserError(f"{WHERE}: the chat template cannot render a {messages[0].get('role')} message after an assistant turn "
                        f"({problem})")

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _last_stop(self, tail: str) -> Optional[tuple[int, int]]:
        """Where the last stop token written in `tail` (text after a turn's content) ends, and its id; None: none is."""
        found = [(tail.rindex(text) + len(text), i) for i in self.stop_token_ids if (text := self._text(i)) and text in tail]
        return max(found) if found else None

    def _add_closing_stop(self, closed: str) -> None:
        """The token a rendering of a closed tool-calling turn ends with, made a stop token when it is a special token of
        the tokenizer (gpt-oss's `<|call|>`): the model ends such a turn with it. Said once."""
        ids = self.encode(closed)
        last = ids[-1] if ids else None
        special = set(getattr(self.tokenizer, "all_special_ids", [])) | {
            i for i, token in getattr(self.tokenizer, "added_tokens_decoder", {}).items() if getattr(token, "special", False)}
        if last is None or last not in special or last in self.stop_token_ids:
            return
        before = " or ".join(repr(self._text(i)) for i in self.stop_token_ids) or "none"
        self.stop_token_ids += (last,)
        self.say(f"ppo.stop_token: the chat template ends a turn that calls a tool with {self._text(last)!r}; model turns stop "
                 f"at {before} or {self._text(last)!r}")

    def _tail_ids(self, text: str, cut: int, start: int = 0) -> list[int]:
        """The ids of text[cut:] as they are in the ids of text[start:] (the tokenisation at the token level); the text
        after `cut` alone when the cut falls inside a token. The head's ids are kept (the same probe every call)."""
        head_text = text[start:cut]
        head = self._heads.get(head_text)
        if head is None:
            head = self._heads[head_text] = self.encode(head_text)
        whole = self.encode(text[start:])
        if whole[: len(head)] == head:
            return whole[len(head):]
        return self.encode(text[cut:])

    # ------------------------------------------------------------------ what the content can be

    def _safe(self, messages: list[dict], text: str, room: Optional[float]) -> tuple[list[dict], list[dict]]:
        """The observation's messages made safe to render (lone surrogates replaced, each content cut to the characters
        `room` tokens can hold) -> (those messages, their transcript entries: the text the model reads)."""
        limit = None if room is None or room == float("inf") else int(max(room, 0) * self.longest_token()) + 1
        messages = messages or [{"role": self.observation_role, "content": text}]
        if self.chat is None:
            messages = [{"role": messages[0].get("role", self.observation_role), "content": text}]
        safe, said = [], []
        for message in messages:
            original = message.get("content")
            content = readable(str(original if original is not None else ""))
            if limit is not None and len(content) > limit:
                content = content[:limit]
            safe.append({**message, "content": content})
            entry = {"role": message.get("role", self.observation_role), "text": self._as_read(content)}
            shown = readable(_preview(str(original)))  # what the environment said, writable anywhere (no lone surrogates)
            if entry["text"] != shown:
                entry["original"] = shown
            said.append(entry)
        return safe, said

    def longest_token(self) -> int:
        """The most characters one token of the vocabulary stands for (bounds the characters `room` tokens can read)."""
        if self._longest_token is None:
            self._longest_token = max([len(token) for token in self.tokenizer.get_vocab()] + [1])
        return self._longest_token

    def _as_read(self, content: str) -> str:
        """The content as the model reads it: where the tokenizer maps words to its unknown token, the decoded ids (the
        first time, a warning with an example)."""
        unknown = self._unknown_id
        if unknown is None or not content:
            return content
        ids = self.encode(content)
        if unknown not in ids:
            return content
        read = self.tokenizer.decode(ids, skip_special_tokens=False)
        if not self._warned_unknown:
            self._warned_unknown = True
            self.say(f"observation text the tokenizer cannot represent is read as {self.tokenizer.unk_token} "
                     f"(e.g. {_preview(content, 60)!r} is read as {_preview(read, 60)!r}); samples.jsonl shows what the model read")
        return read

    # ------------------------------------------------------------------ the start-up check

    def check(self, needs_tools: bool, max_turns: int, what: str = "the environment") -> None:
        """Every rendering the run will do, tried once now (one UserError line naming data.chat_template, never at the
        first rollout): with `needs_tools`, the prompt must carry every tool's name; with more than one turn, an
        observation of `observation_role` must follow a turn that ended with its stop token and one that was cut (and
        the stop tokens are decided: a tool-calling turn's own is added, `_add_closing_stop`); a
        reset observation after a prompt is tried too, and what fails is kept (`first_observation_problem`), said as a
        note, and raised only for an episode whose reset returns an observation."""
        if self.chat is None:
            return
        question = [{"role": "user", "content": PROBE_QUESTION}]
        prompt = self.prompt(question)
        if needs_tools:
            names = [schema.get("function", schema).get("name", "") for schema in self.tools or []]
            missing = [name for name in names if name not in prompt]
            if missing:
                raise UserError(f"{WHERE}: the chat template does not render tools (the prompt it renders with tools= lacks "
                                f"{', '.join(missing)}), so the model would never learn of them; use a template that renders "
                                "`tools` (e.g. Qwen2.5's, Llama 3.1's) or set environment_args.tool_schemas: none if the prompts "
                                "describe the tools themselves")
        probe = self._probe_messages()
        try:  # the turn before an observation, and with it the stop tokens (a tool-calling turn's own, added here)
            self._turn_ends[_shape(probe)] = self._probe_turn(probe, adding=True)
        except UserError:
            if max_turns > 1:
                raise
        if max_turns > 1:
            stopped = self._suffix(probe, True, exact=True)
            cut = self._suffix(probe, False, exact=True)
            if not stopped:
                raise UserError(f"{WHERE}: the chat template renders nothing for an observation after an assistant turn")
            self._short = True
            self._short = self._suffix(probe, True) == stopped and self._suffix(probe, False) == cut
        try:
            closed = self.chat.render(question, False, strip_bos=False)
            if not self.chat.render(question + self._probe_messages(), True, strip_bos=False).startswith(closed):
                raise UserError("it does not render one as the next message after the prompt")
        except UserError as e:
            self.first_observation_problem = (f"{WHERE}: the chat template cannot render an observation from reset after the prompt "
                                              f"({str(e).removeprefix(WHERE + ': ')}); {what}'s reset must return None")

    def _probe_messages(self) -> list[dict]:
        if self.observation_role == "tool":
            name = (self.tools or [{}])[0].get("function", {}).get("name", "tool")
            return [{"role": "tool", "name": name, "content": PROBE_RESULT}]
        return [{"role": "user", "content": PROBE_RESULT}]


def _shape(messages: list[dict]) -> tuple:
    """What the turn before an observation depends on: its messages' roles and names."""
    return tuple((m.get("role"), m.get("name")) for m in messages)


def readable(text: str) -> str:
    """`text` with lone surrogates (text no tokenizer can encode, e.g. bytes decoded with surrogateescape) replaced by U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _preview(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
