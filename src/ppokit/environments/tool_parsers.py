"""Tool-call formats by name: a model turn's text (special tokens kept) -> the calls it makes.

The names are vLLM's `--tool-call-parser` names, so a user picks the one they serve the model with:

    hermes        Qwen2.5, Qwen3, Hermes   <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>, several per turn
    qwen3_coder   Qwen3-Coder, Qwen3.5     <tool_call><function=add><parameter=a>1</parameter></function></tool_call>
    llama3_json   Llama 3.1 / 3.2          [<|python_tag|>]{"name": "add", "parameters": {"a": 1}}, several joined by ';'
    pythonic      Llama 3.2 / 4 (pythonic) [add(a=1), mul(a=2, b=3)]
    mistral       Mistral                  [TOOL_CALLS][{"name": "add", "arguments": {...}}]  or  [TOOL_CALLS]add[ARGS]{...}
    openai        gpt-oss (harmony)        <|start|>assistant to=functions.add<|channel|>commentary json<|message|>{...}<|call|>
    auto          the one the chat template writes (`detect`)

A parser reads the turn as the model wrote it, special tokens kept (a tokenizer that registers `<|python_tag|>`
or `[TOOL_CALLS]` as special would otherwise lose the marker), without the stop token that ended it. Reasoning
comes first and is not searched for calls: in a turn holding `</think>`, only the text after the last one is.

Every call the model got wrong (JSON that does not parse or nests too deeply, a call without a name, arguments
that are not named, a call left open) is a `BadToolCall` whose `error` goes back to the model as that call's
result. Nothing here raises on what a model writes.

Why not transformers' `tokenizer.parse_response` (tried, transformers 5.24 with TRL's response schemas): one
malformed call fails the whole turn (the good calls with it, and the model is told nothing about which), a call
cut before `</tool_call>` is returned as a call, a `"parameters"` key is kept under that name, 50,000 `[` after
`<tool_call>` raise RecursionError, and the schemas ship with TRL, not with the checkpoints' tokenizers.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from ppokit.errors import UserError


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict


@dataclass(frozen=True)
class BadToolCall:
    """Something the model meant as a call that is not one: `error` is the text it gets back as its result."""

    text: str
    error: str
    name: Optional[str] = None  # the name, when one could be read


Call = Union[ToolCall, BadToolCall]
Schemas = Optional[list[dict]]  # the tools' JSON schemas (`tools.tool_schemas`), for formats whose arguments are text

_DECODER = json.JSONDecoder()
_UNREADABLE = (ValueError, RecursionError, MemoryError, SyntaxError, OverflowError)  # what a hostile text raises in json/ast


def _answer_part(text: str) -> str:
    """The turn after its reasoning: the text after the last `</think>`, or all of it."""
    cut = text.rfind("</think>")
    return text if cut < 0 else text[cut + len("</think>"):]


def _json_value(text: str, start: int = 0) -> tuple[Any, int]:
    """(the JSON value at text[start:] after whitespace, the index after it); ValueError/RecursionError when there is none."""
    while start < len(text) and text[start].isspace():
        start += 1
    return _DECODER.raw_decode(text, start)


def _unreadable(body: str, e: BaseException, form: str, language: str = "JSON") -> BadToolCall:
    if isinstance(e, json.JSONDecodeError):
        why = f"{e.msg} at line {e.lineno} column {e.colno}"
    elif isinstance(e, (RecursionError, MemoryError)):
        why = "it nests too deeply to read"
    else:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
    return BadToolCall(body, f"error: the tool call is not valid {language} ({why}); write {form}")


def _call_from_object(value: Any, body: str, form: str, names: tuple[str, ...] = ("arguments", "parameters")) -> Call:
    """{"name": str, "arguments" (or "parameters"): object or a JSON string of one} -> a ToolCall."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return BadToolCall(body, f"error: a tool call is a JSON object with a name: {form}")
    name = value["name"]
    arguments = next((value[key] for key in names if key in value), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except _UNREADABLE:
            pass
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return BadToolCall(body, f"error: the arguments of {name} must be a JSON object of named arguments", name)
    return ToolCall(name, arguments)


# --------------------------------------------------------------------------- the formats

HERMES_FORM = '<tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>'
_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str, schemas: Schemas = None) -> list[Call]:
    """Every <tool_call>...</tool_call> block: one JSON object {"name", "arguments"} each ("parameters" is read
    as the arguments when "arguments" is absent; the arguments may be a JSON string of an object). A block left
    open at the end of the turn (the turn was cut) is a BadToolCall."""
    calls: list[Call] = []
    for match in _HERMES.finditer(_answer_part(text)):
        body = match.group(1).strip()
        if not match.group(2):
            calls.append(BadToolCall(body, "error: the tool call is not closed with </tool_call>"))
            continue
        try:
            value, end = _json_value(body)
        except _UNREADABLE as e:
            calls.append(_unreadable(body, e, HERMES_FORM))
            continue
        if body[end:].strip():
            calls.append(BadToolCall(body, f"error: the tool call has text after its JSON object; write {HERMES_FORM}"))
            continue
        calls.append(_call_from_object(value, body, HERMES_FORM))
    return calls


QWEN3_CODER_FORM = "<tool_call><function=TOOL><parameter=NAME>value</parameter></function></tool_call>"
_CODER_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>(.*?)</function>\s*$", re.DOTALL)
_CODER_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)


def parse_qwen3_coder(text: str, schemas: Schemas = None) -> list[Call]:
    """Qwen3-Coder's XML calls (Qwen3.5's templates teach the same). A parameter's value is text; it becomes the
    type the tool's schema gives it (integer, number, boolean, object, array, null), and stays text for a string
    or a parameter the schema does not name."""
    types = _parameter_types(schemas)
    calls: list[Call] = []
    for match in _HERMES.finditer(_answer_part(text)):
        body = match.group(1)
        if not match.group(2):
            calls.append(BadToolCall(body.strip(), "error: the tool call is not closed with </tool_call>"))
            continue
        function = _CODER_FUNCTION.match(body)
        if function is None or not function.group(1).strip():
            calls.append(BadToolCall(body.strip(), f"error: a tool call is {QWEN3_CODER_FORM}"))
            continue
        name, inner = function.group(1).strip(), function.group(2)
        arguments, bad = {}, None
        for parameter in _CODER_PARAMETER.finditer(inner):
            key = parameter.group(1).strip()
            value = _strip_one_newline(parameter.group(2))
            converted = _typed(value, types.get(name, {}).get(key))
            if isinstance(converted, BadToolCall):
                bad = BadToolCall(body.strip(), f"error: {name}: parameter {key}: {converted.error}", name)
                break
            arguments[key] = converted
        leftover = _CODER_PARAMETER.sub("", inner).strip()
        if bad is None and leftover:
            bad = BadToolCall(body.strip(), f"error: {name}: text outside <parameter=...></parameter>; write {QWEN3_CODER_FORM}", name)
        calls.append(bad or ToolCall(name, arguments))
    return calls


def _strip_one_newline(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _parameter_types(schemas: Schemas) -> dict[str, dict[str, str]]:
    """{tool: {parameter: JSON type}} from the tools' schemas."""
    types: dict[str, dict[str, str]] = {}
    for schema in schemas or []:
        function = schema.get("function", schema)
        properties = (function.get("parameters") or {}).get("properties") or {}
        types[function.get("name", "")] = {key: spec.get("type") for key, spec in properties.items() if isinstance(spec, dict)}
    return types


def _typed(value: str, kind: Any) -> Any:
    """A parameter's text as the schema's type; a BadToolCall (its error) when it is not one."""
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is None or "string" in kinds:
        return value
    stripped = value.strip()
    try:
        if "integer" in kinds:
            return int(stripped)
        if "number" in kinds:
            return float(stripped)
        if "boolean" in kinds:
            if stripped.lower() in ("true", "false"):
                return stripped.lower() == "true"
            raise ValueError("expected true or false")
        if "null" in kinds and stripped.lower() in ("null", "none"):
            return None
        return json.loads(stripped)  # object, array
    except _UNREADABLE as e:
        message = "it nests too deeply to read" if isinstance(e, (RecursionError, MemoryError)) else str(e).splitlines()[0]
        return BadToolCall(value, f"expected {'/'.join(map(str, kinds))}, got {stripped[:40]!r} ({message})")


LLAMA3_FORM = '{"name": "TOOL", "parameters": {...}}'


def parse_llama3_json(text: str, schemas: Schemas = None) -> list[Call]:
    """Llama 3.1/3.2's JSON calls: the turn is the call(s) -- after an optional `<|python_tag|>`, one JSON object
    {"name", "parameters"} ("arguments" is read too), several joined by ';'. A turn that is prose is an answer, not
    a call; a turn that begins with `{` or `<|python_tag|>` and does not parse is a BadToolCall."""
    body = _answer_part(text).strip()
    tagged = body.startswith("<|python_tag|>")
    if tagged:
        body = body[len("<|python_tag|>"):].strip()
    elif not body.startswith("{"):
        return []
    calls: list[Call] = []
    position = 0
    while True:
        start = position
        try:
            value, position = _json_value(body, position)
        except _UNREADABLE as e:
            calls.append(_unreadable(body[start:].strip(), e, LLAMA3_FORM))
            return calls
        calls.append(_call_from_object(value, body[start:position].strip(), LLAMA3_FORM, ("parameters", "arguments")))
        rest = body[position:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            calls.append(BadToolCall(rest, f"error: text after a tool call; write one call {LLAMA3_FORM}, or several joined by ';'"))
            return calls
        position = len(body) - len(rest) + 1


PYTHONIC_FORM = "[tool(name=value, ...), ...]"


def parse_pythonic(text: str, schemas: Schemas = None) -> list[Call]:
    """A Python list of calls with keyword arguments whose values are literals: `[add(a=1, b=2), lookup(q="x")]`
    (after an optional `<|python_tag|>`). A turn that does not begin with `[` is an answer."""
    body = _answer_part(text).strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    if not body.startswith("["):
        return []
    try:
        tree = ast.parse(body, mode="eval").body
    except _UNREADABLE as e:
        return [_unreadable(body, e, PYTHONIC_FORM, "Python")]
    if not isinstance(tree, ast.List) or not tree.elts:
        return [BadToolCall(body, f"error: tool calls are a list of calls, {PYTHONIC_FORM}")]
    calls: list[Call] = []
    for element in tree.elts:
        source = ast.get_source_segment(body, element) or body
        if not isinstance(element, ast.Call) or not isinstance(element.func, ast.Name):
            calls.append(BadToolCall(source, f"error: each item is a call by name, {PYTHONIC_FORM}"))
            continue
        name = element.func.id
        if element.args or any(k.arg is None for k in element.keywords):
            calls.append(BadToolCall(source, f"error: {name}: name every argument ({PYTHONIC_FORM})", name))
            continue
        try:
            calls.append(ToolCall(name, {k.arg: ast.literal_eval(k.value) for k in element.keywords}))
        except _UNREADABLE as e:
            calls.append(BadToolCall(source, "error: "
                                             f"{name}: an argument is not a literal value ({str(e).splitlines()[0] if str(e) else type(e).__name__})", name))
    return calls


MISTRAL_FORM = '[TOOL_CALLS]TOOL[ARGS]{...} or [TOOL_CALLS][{"name": "TOOL", "arguments": {...}}]'
_MISTRAL_NAME = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*(?:\[CALL_ID\]\s*\w+\s*)?(?:\[ARGS\])?")


def parse_mistral(text: str, schemas: Schemas = None) -> list[Call]:
    """Mistral's calls after each `[TOOL_CALLS]`: a JSON list of {"name", "arguments"} (tokenizers before v11), or
    `name[ARGS]{...}` (v11 and later; `name{...}` is read too). Text before the first marker is the answer part."""
    segments = _answer_part(text).split("[TOOL_CALLS]")[1:]
    calls: list[Call] = []
    for segment in segments:
        body = segment.strip()
        if body.startswith("["):
            try:
                value, end = _json_value(body)
            except _UNREADABLE as e:
                calls.append(_unreadable(body, e, MISTRAL_FORM))
                continue
            items = value if isinstance(value, list) else [value]
            calls += [_call_from_object(item, body, MISTRAL_FORM) for item in items] or [BadToolCall(body, f"error: no call in the list; write {MISTRAL_FORM}")]
            continue
        named = _MISTRAL_NAME.match(body)
        if named is None:
            calls.append(BadToolCall(body, f"error: a tool call is {MISTRAL_FORM}"))
            continue
        calls.append(_named_call(named.group(1), body, named.end(), MISTRAL_FORM))
    return calls


def _named_call(name: str, body: str, start: int, form: str) -> Call:
    """A call whose name was read, its arguments the JSON object at body[start:] (none there: no arguments)."""
    if not body[start:].strip():
        return ToolCall(name, {})
    try:
        arguments, end = _json_value(body, start)
    except _UNREADABLE as e:
        return _unreadable(body, e, form)
    if not isinstance(arguments, dict):
        return BadToolCall(body, f"error: the arguments of {name} must be a JSON object of named arguments", name)
    return ToolCall(name, arguments)


OPENAI_FORM = "<|start|>assistant to=functions.TOOL<|channel|>commentary json<|message|>{...}<|call|>"
_HARMONY_MESSAGE = re.compile(r"(.*?)<\|message\|>(.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|$)", re.DOTALL)
_HARMONY_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


def parse_openai(text: str, schemas: Schemas = None) -> list[Call]:
    """gpt-oss's harmony messages: a message whose header names a recipient `to=functions.TOOL` (in the role part or
    after the channel) is a call, its body the JSON arguments. Messages follow one another after `<|start|>`; the
    turn's first message begins at the text's start (the generation prompt wrote `<|start|>assistant`)."""
    calls: list[Call] = []
    for message in text.split("<|start|>"):
        match = _HARMONY_MESSAGE.match(message)
        if match is None:
            continue
        recipient = _HARMONY_RECIPIENT.search(match.group(1))
        if recipient is None:
            continue
        calls.append(_named_call(recipient.group(1), match.group(2).strip(), 0, OPENAI_FORM))
    return calls


# --------------------------------------------------------------------------- by name


@dataclass(frozen=True)
class ToolParser:
    """A format by name: `parse(text, schemas)`, the form it teaches in an error text, and the marker that gives it away
    in a chat template (`detect`)."""

    name: str
    parse: Callable[[str, Schemas], list[Call]]
    form: str
    models: str


PARSERS: dict[str, ToolParser] = {p.name: p for p in (
    ToolParser("hermes", parse_hermes, HERMES_FORM, "Qwen2.5, Qwen3, Hermes"),
    ToolParser("qwen3_coder", parse_qwen3_coder, QWEN3_CODER_FORM, "Qwen3-Coder, Qwen3.5"),
    ToolParser("llama3_json", parse_llama3_json, LLAMA3_FORM, "Llama 3.1, 3.2"),
    ToolParser("pythonic", parse_pythonic, PYTHONIC_FORM, "Llama 3.2/4 pythonic"),
    ToolParser("mistral", parse_mistral, MISTRAL_FORM, "Mistral"),
    ToolParser("openai", parse_openai, OPENAI_FORM, "gpt-oss"),
)}
PARSER_NAMES = ("auto", *PARSERS)

# What a chat template writes, in the order tried: the first marker found names the format (qwen3_coder's
# `<function=` inside `<tool_call>` before hermes's bare `<tool_call>`).
_MARKERS = (
    ("qwen3_coder", ("<function=",), "<function=...> inside <tool_call>"),
    ("hermes", ("<tool_call>",), "<tool_call>"),
    ("mistral", ("[TOOL_CALLS]",), "[TOOL_CALLS]"),
    ("openai", ("to=functions.", "<|call|>"), "to=functions. ... <|call|>"),
    ("llama3_json", ("<|python_tag|>", '"parameters"'), '<|python_tag|> / {"name": ..., "parameters": ...}'),
)


def detect(template: Optional[str]) -> Optional[tuple[str, str]]:
    """(the format a chat template writes, the marker that says so), or None when it shows none of them."""
    for name, markers, shown in _MARKERS:
        if template and any(marker in template for marker in markers):
            if name == "qwen3_coder" and "<tool_call>" not in template:
                continue
            return name, shown
    return None


def resolve_parser(name: Any, template: Optional[str], where: str = "environment_args.tool_parser") -> tuple[ToolParser, Optional[str]]:
    """The parser a config names -> (it, a one-line note when `auto` chose it, else None). `auto` reads the chat template
    (None: plain-text prompts, no template to read: hermes, the form docs/environments.md teaches for plain text).
    UserError (one line) for an unknown name, or `auto` with a template that shows no known format."""
    if not isinstance(name, str) or name not in PARSER_NAMES:
        raise UserError(f"{where}: unknown tool-call format {name!r}; use one of {', '.join(PARSER_NAMES)} (vLLM's --tool-call-parser names)")
    if name != "auto":
        return PARSERS[name], None
    if template is None:
        return PARSERS["hermes"], f"{where}: auto chose hermes (plain-text prompts: no chat template to read the format from)"
    found = detect(template)
    if found is None:
        raise UserError(f"{where}: auto found no tool-call format it knows in the chat template (data.chat_template); "
                        f"set one of {', '.join(PARSERS)}")
    return PARSERS[found[0]], f"{where}: auto chose {found[0]} (the chat template writes {found[1]})"
