"""The conversation renderer with real chat templates (the originals trl ships): for each family the prompt carries
the tools' schemas, the context at turn k is what the template renders for the conversation so far (for a reasoning
template: what its prefix-preserving training template renders, earlier reasoning kept as generated), exactly the
model's tokens are trained (a tiny real model's logprobs, read back by a fresh forward), and a call in the family's
own format runs the tool. Also: the start-up checks, in one line each."""

from __future__ import annotations

import json

import pytest
import torch
from chat_families import ADD, FAMILIES, byte_tokenizer, trl_template
from request_engines import ScriptedRequests
from conftest import conversation_renderer

from ppokit.conversation.templates import PLAIN_CHAT_TEMPLATE
from ppokit.engines.base import Sampling
from ppokit.environments import EnvironmentRunner
from ppokit.environments.conversation import conversation_setup
from ppokit.environments.episode_loop import EpisodeLoop
from ppokit.errors import UserError
from ppokit.models.forwards import response_logprobs
from ppokit.data.prompts import as_prompt_dataset
from ppokit.demos.tiny import tiny_causal_lm


@pytest.fixture(scope="module")
def tools_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "arith.py"
    path.write_text(ADD)
    return path


class ForcedEngine(ScriptedRequests):
    """A rollout engine whose turns are given (the same token ids for every request of a submit call), scored by a real
    tiny model: each returned logprob is the model's for that token in its context, as sampling it would have recorded.
    `contexts`: the prompts of each submit call."""

    def __init__(self, model, turns: list[list[int]], pad: int, stop: int):
        super().__init__()
        self.model, self.turns, self.pad_token_id, self.stop, self.contexts = model, turns, pad, stop, self.submitted

    @torch.no_grad()
    def respond(self, request):
        answer = self.turns[len(self.contexts) - 1][: request.sampling.max_new_tokens]
        prompt = list(request.prompt)
        logits = self.model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1: -1].float()
        return answer, torch.log_softmax(logits, -1).gather(1, torch.tensor(answer)[:, None])[:, 0].tolist()


class Answers:
    """A user-role environment: answers every turn with the next word of `replies` (reward 0, done after them)."""

    replies = ["higher", "lower"]

    def reset(self, row):
        self.turn = 0

    def step(self, completion):
        self.turn += 1
        done = self.turn > len(self.replies)
        return (None if done else self.replies[self.turn - 1]), 0.0, done


def _tool_call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _assistant(family, name, text, call=None):
    """The conversation's assistant message for a turn the model wrote (`text`; `call`: the (name, arguments) it calls),
    as the family's template takes it: tool calls as `tool_calls`, reasoning as reasoning_content / thinking."""
    message = {"role": "assistant", "content": text}
    if call is not None:
        message = {"role": "assistant", "content": "", "tool_calls": [_tool_call(*call)]}
        if name == "gptoss":
            message["thinking"] = f"I call {call[0]}."
        elif family.reasoning:
            message["reasoning_content"] = "" if family.template_kwargs.get("enable_thinking") is False else "I need a tool."
    elif family.reasoning and name != "gptoss":
        opened = {"qwen3_5_think": "<think>\n", "deepseek_r1_distill": "<think>\n"}.get(family.template, "")
        closed = "<think>\n\n</think>\n\n" if family.template_kwargs.get("enable_thinking") is False else ""
        message["content"] = opened + closed + text
    return message


def _expected_template(family) -> str:
    """What the turn-k context is compared with: the original template, or for a template that drops earlier
    reasoning, trl's prefix-preserving training variant of it (reasoning always rendered, as the model generated it)."""
    if family.reasoning and family.template != "gptoss":
        return trl_template(f"{family.template}_training")
    return trl_template(family.template)


CASES = [(name, "tool") for name, f in FAMILIES.items() if f.parser] + \
        [(name, "user") for name in FAMILIES if name != "gptoss"]  # gpt-oss re-renders an earlier answer ending in <|end|>, not the <|return|> the model wrote


@pytest.mark.parametrize("name,role", CASES, ids=[f"{n}-{r}" for n, r in CASES])
def test_turn_k_context_is_the_templates_rendering_and_only_the_models_tokens_train(name, role, tools_file):
    family = FAMILIES[name]
    tok = family.tokenizer()
    stop = tok.convert_tokens_to_ids(family.stop)
    question = [{"role": "user", "content": "What is 17 + 25, plus 8?"}]
    if role == "tool":
        data = as_prompt_dataset([{"messages": question}])
        conversation = conversation_setup(tok, chat_template=None, template_kwargs=family.template_kwargs, datasets=[data],
                                          environment="ppokit.environments:Tools", environment_args={"tools": [f"{tools_file}:add"]},
                                          timeout_s=None, max_turns=3, stop_token_id=stop)
        renderer, runner = conversation.renderer, conversation.runner
        assert renderer is not None and runner.notes == [f"environment_args.tool_parser: auto chose {family.parser} "
                                                         f"(the chat template writes {runner.notes[0].split('writes ')[1]}"]
        turns = [family.calling("add", {"a": 17, "b": 25}), family.calling("add", {"a": 42, "b": 8}), family.answer("50")]
        calls = [("add", {"a": 17, "b": 25}), ("add", {"a": 42, "b": 8}), None]
        observations = [[{"role": "tool", "name": "add", "content": "42"}], [{"role": "tool", "name": "add", "content": "50"}]]
    else:
        runner = EnvironmentRunner("answers.py:Answers", Answers, {}, timeout_s=None)
        renderer = conversation_renderer(tok, tok.chat_template, template_kwargs=family.template_kwargs, stop_token_ids=stop)
        renderer.check(needs_tools=False, max_turns=3)
        turns = [family.answer("8"), family.answer("12"), family.answer("10")]
        calls = [None, None, None]
        observations = [[{"role": "user", "content": "higher"}], [{"role": "user", "content": "lower"}]]
    turn_ids = [tok(text, add_special_tokens=False)["input_ids"] + [stop] for text in turns]
    torch.manual_seed(0)
    model = tiny_causal_lm("llama", tok, hidden=32, heads=2, max_positions=2048).eval()
    engine = ForcedEngine(model, turn_ids, tok.pad_token_id, stop)
    prompt_text = renderer.chat.render(question, True) if role == "user" else data.prompts[0]
    prompt = tok(prompt_text, add_special_tokens=False)["input_ids"]
    loop = EpisodeLoop(engine, tok, runner, max_turns=3, max_episode_tokens=4000, pad_token_id=tok.pad_token_id, renderer=renderer)
    sampling = Sampling(max_new_tokens=400, temperature=1.0, stop_token_ids=stop)
    episodes = loop.sample([prompt], [{"prompt": question[0]["content"]}], sampling)

    # the prompt is the template's own rendering, with the tools' schemas
    template = {**family.template_kwargs}
    if role == "tool":
        want_prompt = tok.apply_chat_template(question, tools=renderer.tools, add_generation_prompt=True, tokenize=False, **template)
        assert prompt_text == want_prompt and "add" in prompt_text and "the first number" in prompt_text
    # turn k's context: what the template renders for the conversation so far, generation prompt last
    messages = list(question)
    expected = _expected_template(family)
    for k in (1, 2):
        messages += [_assistant(family, name, turns[k - 1], calls[k - 1]), *observations[k - 1]]
        text = tok.apply_chat_template(messages, chat_template=expected, tools=renderer.tools if role == "tool" else None,
                                       add_generation_prompt=True, tokenize=False, **template)
        assert engine.contexts[k] == [tok(text, add_special_tokens=False)["input_ids"]], (name, role, k)
    # exactly the model's tokens are trained, with the logprobs a fresh forward over the whole episode gives them
    trained = episodes.response_ids[0][episodes.loss_mask[0]].tolist()
    assert trained == sum(turn_ids, []) and episodes.turns.tolist() == [3] and episodes.done.tolist() == [True]
    fresh, _ = response_logprobs(model, episodes.input_ids, episodes.attention_mask.long(), episodes.response_ids, episodes.loss_mask, 1.0)
    mask = episodes.loss_mask
    assert (fresh[mask] - episodes.logprobs[mask]).abs().max() < 1e-4
    # the tool ran: its results are what the model read, and the transcript says so
    if role == "tool":
        said = [t["text"] for t in episodes.transcripts[0] if t["role"] == "tool"]
        assert said == ["42", "50"]


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.parser])
def test_auto_picks_each_familys_own_format(name):
    from ppokit.environments.tool_parsers import detect

    assert detect(trl_template(FAMILIES[name].template))[0] == FAMILIES[name].parser


def _tools_setup(tok, tools_file, args=None, **kw):
    """conversation_setup for chat prompts and the Tools environment with the `add` tool."""
    setup = dict(chat_template=None, template_kwargs={}, datasets=[as_prompt_dataset([{"messages": [{"role": "user", "content": "hi"}]}])],
                 environment="ppokit.environments:Tools", environment_args={"tools": [f"{tools_file}:add"], **(args or {})},
                 timeout_s=None, max_turns=2, stop_token="eos")
    return conversation_setup(tok, **{**setup, **kw})


def test_the_token_that_ends_a_tool_calling_turn_becomes_a_stop_token_and_is_said(tools_file):
    """gpt-oss: EOS <|return|> ends an answer, <|call|> a call; the conversation stops at both (tests/test_stop_tokens.py
    runs such an episode), and says so once."""
    tok = FAMILIES["gptoss"].tokenizer()
    said = []
    conversation = _tools_setup(tok, tools_file, say=said.append)
    call, end = tok.convert_tokens_to_ids("<|call|>"), tok.convert_tokens_to_ids("<|return|>")
    assert conversation.stop_token_ids == (end, call)
    assert "ppo.stop_token: the chat template ends a turn that calls a tool with '<|call|>'; model turns stop at '<|return|>' or '<|call|>'" in said


@pytest.mark.parametrize("template", ["gemma3", "deepseek_r1_distill", "llama3"])
def test_a_template_that_cannot_render_tools_is_refused_at_start_up(template, tools_file):
    family = next(f for f in FAMILIES.values() if f.template == template) if template != "llama3" else FAMILIES["llama3_1"]
    tok = family.tokenizer()
    with pytest.raises(UserError) as error:
        _tools_setup(tok, tools_file, {"tool_parser": "hermes"}, chat_template=trl_template(template))
    message = str(error.value)
    assert message.startswith("data.chat_template: the chat template does not render tools") and "\n" not in message


def test_the_stop_token_at_the_end_of_a_chatml_turn_is_not_written_twice():
    """A turn that ended with <|im_end|> is followed by the rest of the template's closing ("\\n<|im_start|>user..."); a
    turn cut before its stop token gets <|im_end|> from the template first."""
    family = FAMILIES["qwen2_5"]
    tok = family.tokenizer()
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    renderer = conversation_renderer(tok, tok.chat_template, stop_token_ids=stop)
    observation = [{"role": "user", "content": "higher"}]
    stopped = renderer.observation(observation, "higher", True).ids
    cut = renderer.observation(observation, "higher", False).ids
    assert tok.decode(stopped) == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    assert cut == [stop] + stopped


def test_plain_text_prompts_with_tools_are_refused_unless_the_prompts_describe_them(tools_file):
    tok = FAMILIES["qwen2_5"].tokenizer()
    data = as_prompt_dataset(["What is 17 + 25?"])
    args = {"tools": [f"{tools_file}:add"]}
    setup = dict(chat_template=None, template_kwargs={}, environment="ppokit.environments:Tools", timeout_s=None, max_turns=2,
                 stop_token="eos")
    with pytest.raises(UserError, match="prompts of .* are plain text; use chat prompts .* environment_args.tool_schemas: none"):
        conversation_setup(tok, datasets=[data], environment_args=args, **setup)
    said = []
    conversation = conversation_setup(tok, datasets=[data], environment_args={**args, "tool_schemas": "none"}, say=said.append, **setup)
    assert conversation.template is None and data.prompts == ["What is 17 + 25?"]
    assert said == ["environment_args.tool_parser: auto chose hermes (plain-text prompts: no chat template to read the format from)"]


@pytest.mark.parametrize("args,message", [
    ({"tool_parser": "qwen25"}, "environment_args.tool_parser: unknown tool-call format 'qwen25'; use one of auto, hermes, qwen3_coder"),
    ({"timeout_s": float("inf")}, r"environment_args.timeout_s: expected a number of seconds in \(0, \d+\]"),
    ({"timeout_s": 1e12}, r"environment_args.timeout_s: expected a number of seconds in \(0, \d+\]"),
    ({"tool_schemas": "yes"}, "environment_args.tool_schemas: expected one of template, none"),
])
def test_bad_tools_arguments_are_one_line_at_start_up(args, message, tools_file):
    with pytest.raises(UserError, match=message):
        _tools_setup(FAMILIES["qwen2_5"].tokenizer(), tools_file, args)


def test_auto_with_a_template_that_shows_no_call_format_is_one_line(tools_file):
    tok = FAMILIES["gemma3"].tokenizer()
    with pytest.raises(UserError, match=r"^environment_args.tool_parser: auto found no tool-call format .* set one of hermes"):
        EnvironmentRunner.from_config("ppokit.environments:Tools", {"tools": [f"{tools_file}:add"]}, None, chat_template=tok.chat_template)


UNSCHEMABLE = '''
def no_hints(a, b):
    """Add.

    Args:
        a: one
        b: two
    """
    return a + b
'''


def test_a_tool_whose_signature_makes_no_schema_is_one_line(tmp_path):
    (tmp_path / "bad.py").write_text(UNSCHEMABLE)
    with pytest.raises(UserError) as error:
        EnvironmentRunner.from_config("ppokit.environments:Tools", {"tools": [f"{tmp_path}/bad.py:no_hints"]}, None)
    assert str(error.value).startswith("environment_args.tools: tool no_hints: its schema for the chat template cannot be made: ")
    assert "\n" not in str(error.value)


# --------------------------------------------------------------------------- observations as the model reads them


def _renderer(template=PLAIN_CHAT_TEMPLATE, **kw):
    tok = byte_tokenizer(["<|im_start|>", "<|im_end|>", "<pad>"], eos="<|im_end|>", pad="<pad>", chat_template=template)
    return tok, conversation_renderer(tok, template if template is not None else None, stop_token_ids=tok.eos_token_id, **kw)


def test_observation_ids_are_tokenised_once_per_text_and_the_least_recently_used_is_forgotten(monkeypatch):
    """`encode` remembers the ids of the texts it was given last (observations repeat, and each is read twice): the same
    ids as the tokenizer's, the tokenizer called once per text while it is remembered, the text used longest ago
    forgotten first, and a caller changing the list it got changes nothing remembered."""
    import ppokit.conversation.renderer

    tok, renderer = _renderer(template=None)
    asked = []
    real = renderer.tokenizer

    class Counting:
        def __call__(self, text, **kw):
            asked.append(text)
            return real(text, **kw)

        def __getattr__(self, name):
            return getattr(real, name)

    renderer.tokenizer = Counting()
    monkeypatch.setattr(ppokit.conversation.renderer, "ENCODED_KEPT", 2)
    expected = {t: real(t, add_special_tokens=False)["input_ids"] for t in ("higher", "lower", "correct")}
    first = renderer.observation([], "higher", True)
    assert first.ids == expected["higher"] and asked == ["higher"]  # read as the model reads it, then its ids: one call
    first.ids.append(-1)
    assert renderer.encode("higher") == expected["higher"] and asked == ["higher"]
    assert renderer.encode("lower") == expected["lower"] and asked == ["higher", "lower"]
    assert renderer.encode("higher") == expected["higher"]  # now the most recently used
    assert renderer.encode("correct") == expected["correct"]  # forgets "lower", the least recently used
    assert asked == ["higher", "lower", "correct"]
    renderer.encode("higher")
    assert asked == ["higher", "lower", "correct"]
    renderer.encode("lower")
    assert asked == ["higher", "lower", "correct", "lower"]


def test_a_huge_observation_is_cut_to_the_room_before_it_is_tokenised():
    tok, renderer = _renderer()
    said = renderer.observation([], "x" * 20_000_000, True, room=50)
    assert len(said.ids) < 50 * renderer.longest_token() + 50 and said.said[0]["text"] == "x" * (50 * renderer.longest_token() + 1)
    assert said.said[0]["original"].endswith("...") and len(said.said[0]["original"]) < 300


def test_a_lone_surrogate_in_an_observation_reads_as_the_replacement_character():
    tok, renderer = _renderer()
    observation = renderer.observation([], "bad \udcff", True)
    assert tok.decode(observation.ids).endswith("bad \ufffd\nassistant:")
    assert observation.said == [{"role": "user", "text": "bad \ufffd"}]  # the transcript too: it is written to files and pages


def test_words_the_tokenizer_cannot_represent_warn_once_and_the_transcript_shows_what_was_read():
    from ppokit.demos.tiny import word_tokenizer

    tok = word_tokenizer(["user assistant : higher lower"])
    said = []
    renderer = conversation_renderer(tok, PLAIN_CHAT_TEMPLATE, stop_token_ids=tok.eos_token_id, say=said.append)
    first = renderer.observation([], "higher zebra", True)
    renderer.observation([], "lower okapi", True)
    assert first.said == [{"role": "user", "text": "higher <unk>", "original": "higher zebra"}]
    assert len(said) == 1 and "read as <unk> (e.g. 'higher zebra' is read as 'higher <unk>')" in said[0]


def test_a_turns_text_keeps_its_special_tokens_and_drops_its_stop_token():
    tok = byte_tokenizer(["[TOOL_CALLS]", "</s>", "<pad>"], eos="</s>", pad="<pad>")
    renderer = conversation_renderer(tok, None, stop_token_ids=tok.eos_token_id)
    ids = tok('[TOOL_CALLS]add[ARGS]{"a": 1}', add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert renderer.turn_text(ids, stopped=True) == '[TOOL_CALLS]add[ARGS]{"a": 1}'
    assert renderer.turn_text(ids, stopped=False) == '[TOOL_CALLS]add[ARGS]{"a": 1}</s>'


def test_a_template_that_does_not_continue_is_one_line_naming_the_key():
    tok, _ = _renderer()
    # renders the last assistant turn with a marker an earlier one does not have: what follows it is not a continuation
    odd = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if loop.last and m['role'] == 'assistant' %} (last){% endif %}\n"
           "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    renderer = conversation_renderer(tok, odd, stop_token_ids=tok.eos_token_id)
    with pytest.raises(UserError) as error:
        renderer.check(needs_tools=False, max_turns=2)
    assert str(error.value).startswith("data.chat_template: the chat template does not render an observation after an assistant turn")
    assert "\n" not in str(error.value)


# --------------------------------------------------------------------------- through the trainer


@pytest.fixture(scope="module")
def qwen_run(tmp_path_factory, tools_file):
    """A tiny Qwen2 model saved with the qwen2_5 family's tokenizer (Qwen2.5's original template), chat prompts, and a
    config of the built-in Tools environment over them."""
    from ppokit.config.schema import DataConfig, PPOConfig, PPOHyperparams, RewardConfig, RolloutConfig

    root = tmp_path_factory.mktemp("qwen-run")
    tok = FAMILIES["qwen2_5"].tokenizer()
    torch.manual_seed(0)
    tiny_causal_lm("qwen2", tok, hidden=32, heads=2, max_positions=1024).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + {i + 3}?"}]} for i in range(8)]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def config(name, **changes):
        return PPOConfig(model=str(root / "model"), output_dir=str(root / name), reward=RewardConfig(functions=[]),
                         data=DataConfig(train=str(root / "data.jsonl")), environment="ppokit.environments:Tools",
                         environment_args={"tools": [f"{tools_file}:add"]}, rollout=RolloutConfig(max_turns=2),
                         ppo=PPOHyperparams(total_episodes=4, per_device_train_batch_size=4, num_mini_batches=1, response_length=6,
                                            num_sample_generations=0, advantage_estimator="grpo", num_samples_per_prompt=2),
                         **changes)

    return tok, config, root


def test_the_trainers_prompts_carry_the_tools_and_a_run_trains(qwen_run):
    """The first training prompt is Qwen2.5's own rendering with `tools=` (the `# Tools ... <tools>` block: 162 characters
    without it, 849 with it for this question and tool), it is what the policy reads, and a multi-turn update runs."""
    from ppokit.trainer import PPOTrainer

    tok, config, root = qwen_run
    trainer = PPOTrainer(config("run"), show_progress=False)
    question = [{"role": "user", "content": "What is 0 + 3?"}]
    index = next(i for i, row in enumerate(trainer.train_data.columns["messages"]) if row == question)
    want = tok.apply_chat_template(question, tools=trainer.conversation.renderer.tools, add_generation_prompt=True, tokenize=False)
    assert trainer.train_data.prompts[index] == want and "<tools>" in want and len(want) == 849
    assert len(tok.apply_chat_template(question, add_generation_prompt=True, tokenize=False)) == 162
    assert trainer.train_query_ids[index] == tok(want, add_special_tokens=False)["input_ids"]
    records = trainer.train()
    assert len(records) == 1 and records[0]["rollout/turns"] >= 1


def test_data_inspect_and_plan_count_the_prompt_as_the_trainer_reads_it(qwen_run, capsys):
    """`ppokit data inspect --config` and `ppokit plan` render a run's prompts with its conversation (the tools' schemas in
    the prompt): the prompt's token count is the trainer's first prompt's, several times the count without the tools."""
    from ppokit.cli import main
    from ppokit.trainer import PPOTrainer

    tok, config, root = qwen_run
    (root / "one.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "What is 2 + 5?"}]}) + "\n")
    run = config("inspect-run")
    run.data.train = str(root / "one.jsonl")
    run.save(root / "inspect.yaml")
    trainer = PPOTrainer(run, show_progress=False)
    trained = len(trainer.train_query_ids[0])
    capsys.readouterr()
    assert main(["data", "inspect", "--config", str(root / "inspect.yaml"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["lengths"]["prompt"]["max"] == trained and report["stage"] == "ppo"
    assert main(["plan", str(root / "inspect.yaml"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sequence"]["prompt"] == trained
    without = len(tok(tok.apply_chat_template([{"role": "user", "content": "What is 2 + 5?"}], add_generation_prompt=True, tokenize=False))["input_ids"])
    assert trained > 3 * without


@pytest.mark.parametrize("change,message", [
    ({"data": "gemma3"}, "data.chat_template: the chat template does not render tools"),
    ({"environment_args": {"tool_parser": "qwen2"}}, "environment_args.tool_parser: unknown tool-call format 'qwen2'"),
    ({"environment_args": {"timeout_s": 1e12}}, "environment_args.timeout_s: expected a number of seconds in (0, "),
    ({"data": "plain"}, "are plain text; use chat prompts"),
], ids=["no_tools_template", "unknown_parser", "timeout_range", "plain_text"])
def test_bad_conversation_input_stops_the_trainer_before_any_weights_load(qwen_run, tools_file, change, message, monkeypatch):
    from ppokit.models import roles
    from ppokit.trainer import PPOTrainer

    tok, config, root = qwen_run
    run = config(f"bad-{len(message)}")
    if change.get("data") == "gemma3":
        run.data.chat_template = trl_template("gemma3")
        run.environment_args["tool_parser"] = "hermes"
    elif change.get("data") == "plain":
        (root / "plain.jsonl").write_text('{"prompt": "What is 1 + 2?"}\n' * 4)
        run.data.train = str(root / "plain.jsonl")
    else:
        run.environment_args.update(change["environment_args"])
    monkeypatch.setattr(roles, "build_roles", lambda *a, **k: pytest.fail("weights were loaded"))
    with pytest.raises(UserError) as error:
        PPOTrainer(run, show_progress=False)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not (root / run.output_dir).exists()


def test_a_call_marked_by_a_special_token_reaches_the_parser_and_runs(tools_file):
    """Mistral's `[TOOL_CALLS]` is a special token: a turn decoded without special tokens would lose it and end the
    episode as an answer. `step` receives the turn with it, and the mistral format runs the call."""
    from ppokit.environments import Tools

    tok = byte_tokenizer(["[TOOL_CALLS]", "[ARGS]", "</s>", "<pad>"], eos="</s>", pad="<pad>")
    renderer = conversation_renderer(tok, None, stop_token_ids=tok.eos_token_id)
    turn = tok('[TOOL_CALLS]add[ARGS]{"a": 17, "b": 25}', add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert tok.decode(turn, skip_special_tokens=True) == 'add{"a": 17, "b": 25}'  # what the old decoding handed over
    tools = Tools([f"{tools_file}:add"], tool_parser="mistral")
    assert tools.step(renderer.turn_text(turn, stopped=True)) == ("<tool_response>\n42\n</tool_response>", 0.0, False)


class Floods:
    """A tool environment whose every step answers 20 million characters (a tool gone wrong)."""

    observation_role = "tool"

    def reset(self, row):
        return None

    def step(self, completion):
        return "x" * 20_000_000, 0.0, False


def test_a_20_million_character_observation_is_cut_before_it_is_tokenised():
    family = FAMILIES["qwen2_5"]
    tok = family.tokenizer()
    stop = tok.convert_tokens_to_ids(family.stop)
    renderer = conversation_renderer(tok, tok.chat_template, stop_token_ids=stop, observation_role="tool")
    longest, encoded = [0], renderer.encode
    renderer.encode = lambda text: (longest.__setitem__(0, max(longest[0], len(text))), encoded(text))[1]
    turn = tok("7", add_special_tokens=False)["input_ids"] + [stop]
    engine = ForcedEngine(tiny_causal_lm("llama", tok, hidden=32, heads=2, max_positions=2048).eval(), [turn] * 3, tok.pad_token_id, stop)
    loop = EpisodeLoop(engine, tok, EnvironmentRunner("floods.py:Floods", Floods, {}, timeout_s=None), max_turns=3, max_episode_tokens=64,
                       pad_token_id=tok.pad_token_id, renderer=renderer)
    prompt = tok(renderer.chat.render([{"role": "user", "content": "go"}], True), add_special_tokens=False)["input_ids"]
    episodes = loop.sample([prompt], [{"prompt": "go"}], Sampling(max_new_tokens=8, temperature=1.0, stop_token_ids=stop))
    assert episodes.truncated.tolist() == [True] and episodes.turns.tolist() == [1] and episodes.attention_mask.shape[1] == len(prompt) + 64
    assert longest[0] < 64 * renderer.longest_token() + 1000  # the probe conversation around the cut content
    [said] = [t for t in episodes.transcripts[0] if t["role"] == "tool"]
    assert said["cut"] and len(said["text"]) < 100


def test_the_step_deadline_covers_rendering_the_observation():
    tok, renderer = _renderer()

    def slow(*args, **kwargs):
        import time

        time.sleep(5)

    renderer.observation = slow
    runner = EnvironmentRunner("answers.py:Answers", Answers, {}, timeout_s=0.5)
    loop = EpisodeLoop(_StubEngine(tok), tok, runner, max_turns=2, max_episode_tokens=100, pad_token_id=tok.pad_token_id, renderer=renderer)
    episodes = loop.sample([[5, 6]], [{"prompt": "go"}], Sampling(max_new_tokens=4, temperature=1.0, stop_token_ids=tok.eos_token_id))
    assert episodes.environment_errors[0].startswith("environment answers.py:Answers: step did not return within environment_timeout_s=0.5s")


class _StubEngine(ScriptedRequests):
    """Answers every context with one token and the stop token."""

    def __init__(self, tok):
        super().__init__()
        self.tok, self.pad_token_id = tok, tok.pad_token_id

    def respond(self, request):
        return [65, self.tok.eos_token_id], [0.0, 0.0]
