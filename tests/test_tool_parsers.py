"""Tool-call formats by name (ppokit.environments.tool_parsers): each reads its family's calls, says what is wrong with a
malformed one (the model's to see, never an exception), and never raises on hostile text."""

from __future__ import annotations

import pytest

from ppokit.environments.tool_parsers import PARSERS, BadToolCall, ToolCall, detect, resolve_parser
from ppokit.errors import UserError

SCHEMAS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "number"}, "flag": {"type": "boolean"}, "items": {"type": "array"},
    "note": {"type": "string"}}}}}]


def parse(name, text, schemas=None):
    return PARSERS[name].parse(text, schemas)


@pytest.mark.parametrize("name,text", [
    ("hermes", 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
               '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>'),
    ("qwen3_coder", "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>"
                    "<tool_call><function=add><parameter=a>3</parameter><parameter=b>4</parameter></function></tool_call>"),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add", "arguments": {"a": 3, "b": 4}}'),
    ("pythonic", "[add(a=1, b=2), add(a=3, b=4)]"),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": {"a": 3, "b": 4}}]'),
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]add{"a": 3, "b": 4}'),
    ("openai", '<|channel|>analysis<|message|>Two sums.<|end|><|start|>assistant to=functions.add<|channel|>commentary json'
               '<|message|>{"a": 1, "b": 2}<|call|><|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json'
               '<|message|>{"a": 3, "b": 4}'),
])
def test_each_format_reads_its_calls(name, text):
    calls = parse(name, text, SCHEMAS)
    want_b = (2.0, 4.0) if name == "qwen3_coder" else (2, 4)
    assert calls == [ToolCall("add", {"a": 1, "b": want_b[0]}), ToolCall("add", {"a": 3, "b": want_b[1]})]


def test_a_parameters_key_in_a_hermes_block_is_read_as_the_arguments():
    assert parse("hermes", '<tool_call>{"name": "add", "parameters": {"a": 1}}</tool_call>') == [ToolCall("add", {"a": 1})]


def test_qwen3_coder_values_take_the_schemas_types_and_a_wrong_one_is_the_models_to_see():
    text = ("<tool_call><function=add><parameter=a>\n7\n</parameter><parameter=flag>true</parameter><parameter=items>[1, 2]</parameter>"
            "<parameter=note>\n 12 apples \n</parameter><parameter=other>x</parameter></function></tool_call>")
    assert parse("qwen3_coder", text, SCHEMAS) == [ToolCall("add", {"a": 7, "flag": True, "items": [1, 2], "note": " 12 apples ", "other": "x"})]
    [bad] = parse("qwen3_coder", "<tool_call><function=add><parameter=a>seven</parameter></function></tool_call>", SCHEMAS)
    assert isinstance(bad, BadToolCall) and bad.error.startswith("error: add: parameter a: expected integer, got 'seven'")


@pytest.mark.parametrize("name,text", [
    ("hermes", "The answer is 4."), ("qwen3_coder", "The answer is 4."), ("llama3_json", "The answer is {4}."),
    ("pythonic", "The answer is [4]."), ("mistral", "The answer is 4."), ("openai", "<|channel|>final<|message|>4"),
])
def test_an_answer_is_not_a_call(name, text):
    assert parse(name, text) == []


def test_calls_written_in_the_reasoning_are_not_run():
    thinking = '<think>\nMaybe <tool_call>{"name": "add", "arguments": {"a": 9}}</tool_call>?\n</think>\n\n'
    assert parse("hermes", thinking + "No tool needed.") == []
    assert parse("hermes", thinking + '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>') == [ToolCall("add", {"a": 1})]


@pytest.mark.parametrize("name,text,error", [
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>', "error: the tool call is not valid JSON (Expecting property name"),
    ("hermes", '<tool_call>{"name": "add"', "error: the tool call is not closed with </tool_call>"),
    ("hermes", '<tool_call>{"name": "add"} {"name": "mul"}</tool_call>', "error: the tool call has text after its JSON object"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', "error: a tool call is a JSON object with a name"),
    ("qwen3_coder", "<tool_call><parameter=a>1</parameter></tool_call>", "error: a tool call is <tool_call><function=TOOL>"),
    ("qwen3_coder", "<tool_call><function=add>a=1</function></tool_call>", "error: add: text outside <parameter=...></parameter>"),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1}', "error: the tool call is not valid JSON"),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1}} and then', "error: text after a tool call"),
    ("llama3_json", '{"name": "add", "parameters": [1]}', "error: the arguments of add must be a JSON object"),
    ("pythonic", "[add(1, 2)]", "error: add: name every argument"),
    ("pythonic", "[add(a=x)]", "error: add: an argument is not a literal value"),
    ("pythonic", "[add(a=1)", "error: the tool call is not valid Python"),
    ("mistral", "[TOOL_CALLS]add[ARGS]{'a': 1}", "error: the tool call is not valid JSON"),
    ("mistral", "[TOOL_CALLS]add[ARGS][1, 2]", "error: the arguments of add must be a JSON object"),
    ("openai", "<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{a: 1}<|call|>", "error: the tool call is not valid JSON"),
])
def test_a_malformed_call_is_an_error_text_for_the_model(name, text, error):
    calls = parse(name, text, SCHEMAS)
    assert len(calls) >= 1 and isinstance(calls[-1], BadToolCall) and calls[-1].error.startswith(error), calls


@pytest.mark.parametrize("name,opening", [
    ("hermes", "<tool_call>"), ("qwen3_coder", "<tool_call><function=add><parameter=items>"), ("llama3_json", "<|python_tag|>"),
    ("pythonic", ""), ("mistral", "[TOOL_CALLS]"), ("openai", "<|start|>assistant to=functions.add<|channel|>commentary json<|message|>"),
], ids=lambda value: value if value in PARSERS else "")
@pytest.mark.parametrize("brackets", ["[" * 50_000, "{\"a\":" * 50_000, "(" * 50_000], ids=["brackets", "objects", "parentheses"])
def test_hostile_nesting_is_the_models_error_not_a_recursion_error(name, opening, brackets):
    """`<tool_call>` followed by 50,000 `[` made the JSON parser raise RecursionError out of the run."""
    closing = "</parameter></function></tool_call>" if name == "qwen3_coder" else "</tool_call>" if name == "hermes" else ""
    calls = parse(name, opening + ("[" if name == "pythonic" else "") + brackets + closing, SCHEMAS)
    assert all(isinstance(c, BadToolCall) for c in calls)
    assert name == "pythonic" and brackets.startswith("{") or calls, calls  # "[{"a":..." is no list of calls for pythonic


def test_names_auto_and_their_one_line_refusals():
    assert resolve_parser("llama3_json", None) == (PARSERS["llama3_json"], None)
    assert resolve_parser("auto", '{{ "<tool_call>" }}') == (PARSERS["hermes"], "environment_args.tool_parser: auto chose hermes "
                                                                                  "(the chat template writes <tool_call>)")
    assert resolve_parser("auto", None)[0] is PARSERS["hermes"]
    assert detect("{{ '[TOOL_CALLS]' }}") == ("mistral", "[TOOL_CALLS]")
    with pytest.raises(UserError, match="^environment_args.tool_parser: unknown tool-call format 'json'; use one of auto, hermes"):
        resolve_parser("json", None)
    with pytest.raises(UserError, match="^environment_args.tool_parser: auto found no tool-call format"):
        resolve_parser("auto", "{{ messages }}")
