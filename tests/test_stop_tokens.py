"""Several stop tokens: gpt-oss ends a turn that calls a tool with <|call|> and an answer with <|return|>. The
conversation decides the stop tokens once, at start-up (ppo.stop_token, plus the token the template ends a
tool-calling turn with), and every engine ends a response at the first of them it samples.

The gpt-oss episode runs through the trainer's own parts (its conversation, its hf engine, its rollout) with trl's
original gpt-oss template and a tiny real Llama whose logits carry a bias by position towards a scripted episode (a
random tiny model never writes a harmony tool call): the script goes on past each stop token, so an engine that
ignored a stop token would sample on into it."""

from __future__ import annotations

import json

import pytest
import torch
from chat_families import ADD, FAMILIES, byte_tokenizer
from steered import steer
from conftest import conversation_renderer

from ppokit.training import algo
from ppokit.engines.base import Request, Sampling, complete
from ppokit.engines.hf import HFEngine
from ppokit.errors import UserError
from ppokit.demos.tiny import tiny_causal_lm

pytestmark = pytest.mark.transformers_pins  # CI runs this file under vLLM's transformers pin too (.ci/vllm-env)


# --------------------------------------------------------------------------- the pure function


def test_truncate_after_stop_ends_at_the_first_of_several_stop_tokens_as_a_plain_loop_does():
    torch.manual_seed(0)
    ids = torch.randint(0, 6, (64, 9))
    stops = (2, 5)
    out, mask = algo.truncate_after_stop(ids, stops, pad_token_id=9)
    for row, kept, real in zip(ids.tolist(), out.tolist(), mask.tolist()):
        end = next((i for i, t in enumerate(row) if t in stops), len(row) - 1)
        assert kept == row[: end + 1] + [9] * (len(row) - end - 1) and real == [i <= end for i in range(len(row))]
    one, one_mask = algo.truncate_after_stop(ids, (2,), 9)  # one stop token: what `== stop` gave, bit for bit
    stop_at = algo.first_true_index(ids == 2)
    assert torch.equal(one_mask, torch.arange(9)[None] <= stop_at[:, None])


# --------------------------------------------------------------------------- the hf engine's two decoders


@pytest.fixture(scope="module")
def policy(tokenizer):
    torch.manual_seed(0)
    return tiny_causal_lm("llama", tokenizer).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer, demo_data):
    return [tokenizer(r["prompt"])["input_ids"][:14] for r in demo_data["prompts"][:6]]


def _engine(policy, tokenizer):
    return HFEngine(policy, tokenizer.pad_token_id, torch.device("cpu"), rows_per_forward=4, max_sequence=48)


@pytest.mark.parametrize("seeded", [False, True], ids=["lock-step", "slot-decoder"])
def test_each_hf_decoder_ends_a_response_at_the_first_of_its_stop_tokens(policy, tokenizer, prompts, seeded):
    def run(stops):
        requests = [Request(f"r{i}", p, Sampling(16, 1.0, stops), seed=i if seeded else None) for i, p in enumerate(prompts)]
        torch.manual_seed(3)
        return complete(_engine(policy, tokenizer), requests)

    free = run(())
    stops = (free[0].token_ids[9], free[1].token_ids[4])
    got = run(stops)
    ends = 0
    for f, g in zip(free, got):
        at = next((i for i, t in enumerate(f.token_ids) if t in stops), None)
        want = f.token_ids if at is None else f.token_ids[: at + 1]
        assert (g.finish_reason, g.token_ids) == ("length" if at is None else "stop", want)
        ends += at is not None and f.token_ids[at] == stops[0]
        # seeded: bit for bit; lock-step: rows that ended leave the forward batch, which moves the last bits of a matmul
        assert g.logprobs == f.logprobs[: len(want)] if seeded else torch.allclose(torch.tensor(g.logprobs), torch.tensor(f.logprobs[: len(want)]), atol=1e-4)
    assert ends  # the first stop token ended a response on its own, not only the second
    if not seeded:  # generate's Episodes: ended where a stop token ended the response
        torch.manual_seed(3)
        episodes = _engine(policy, tokenizer).generate(prompts, Sampling(16, 1.0, stops))
        assert episodes.ended.tolist() == [g.finish_reason == "stop" for g in got]


# --------------------------------------------------------------------------- the conversation decides them


def test_a_tool_calling_turn_ending_with_no_stop_token_or_special_token_is_one_line(tmp_path):
    """A template that ends a tool-calling turn with plain text (no special token to stop at) is refused at start-up."""
    template = ("{% for m in messages %}{% if m.role == 'assistant' %}A: {{ m.content }}{% if m.tool_calls %} CALLED{% else %}</s>"
                "{% endif %}{% elif m.role == 'tool' %}T: {{ m.content }}</s>{% else %}{{ m.role }}: {{ m.content }}</s>{% endif %}"
                "{% endfor %}{% if tools %}tools: {{ tools | tojson }}{% endif %}{% if add_generation_prompt %}A: {% endif %}")
    tok = byte_tokenizer(["</s>", "<pad>"], eos="</s>", pad="<pad>", chat_template=template)
    renderer = conversation_renderer(tok, template, stop_token_ids=tok.eos_token_id, observation_role="tool",
                                    tools=[{"type": "function", "function": {"name": "add"}}])
    with pytest.raises(UserError) as error:
        _probe_call_turn(renderer)
    assert str(error.value).startswith("data.chat_template: the chat template does not end an assistant turn that calls a tool "
                                       "with the stop token '</s>'") and "\n" not in str(error.value)
    assert renderer.stop_token_ids == (tok.eos_token_id,)


def _probe_call_turn(renderer):
    """The probe of a tool-calling turn alone (what `_probe_turn` tries once the plain turn cannot precede a tool message)."""
    chat = renderer.chat
    render = chat.render

    def no_plain_before_a_tool(messages, *args, **kwargs):
        if any(m.get("role") == "tool" for m in messages) and not any(m.get("tool_calls") for m in messages):
            raise UserError("data.chat_template: rendering failed (no call before the tool message)")
        return render(messages, *args, **kwargs)

    chat.render = no_plain_before_a_tool
    try:
        return renderer._probe_turn([{"role": "tool", "name": "add", "content": "x"}], adding=True)
    finally:
        chat.render = render


# --------------------------------------------------------------------------- a gpt-oss episode through the trainer's parts


def test_a_gpt_oss_episode_stops_at_call_then_at_return_through_the_trainers_parts(tmp_path):
    from ppokit.config.schema import DataConfig, PPOConfig, PPOHyperparams, RewardConfig, RolloutConfig
    from ppokit.trainer import PPOTrainer

    family = FAMILIES["gptoss"]
    tok = family.tokenizer()  # EOS <|return|>: ppo.stop_token eos
    call_id, return_id = tok.convert_tokens_to_ids("<|call|>"), tok.convert_tokens_to_ids("<|return|>")
    (tmp_path / "arith.py").write_text(ADD)
    question = [{"role": "user", "content": "What is 17 + 25?"}]
    (tmp_path / "data.jsonl").write_text(json.dumps({"messages": question}) + "\n")
    config = PPOConfig(output_dir=str(tmp_path / "run"), reward=RewardConfig(functions=[]), data=DataConfig(train=str(tmp_path / "data.jsonl")),
                       environment="ppokit.environments:Tools", environment_args={"tools": [f"{tmp_path}/arith.py:add"]},
                       rollout=RolloutConfig(max_turns=3),
                       ppo=PPOHyperparams(total_episodes=2, per_device_train_batch_size=2, num_mini_batches=1, response_length=160,
                                          num_sample_generations=0, advantage_estimator="grpo", num_samples_per_prompt=2))

    # the episode the model is steered to write: a call ended by <|call|>, the tool's answer, an answer ended by <|return|>;
    # past each stop token the script goes on (what an engine that ignored it would sample)
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt_text = tok.apply_chat_template(question, tools=_schemas(tmp_path), add_generation_prompt=True, tokenize=False)
    prompt = encode(prompt_text)
    call = encode(family.calling("add", {"a": 17, "b": 25})) + [call_id]
    observation = encode('<|start|>functions.add to=assistant<|channel|>commentary<|message|>"42"<|end|><|start|>assistant')
    answer = encode(family.answer("42")) + [return_id]
    onward = encode("<|start|>assistant<|channel|>final<|message|>and more")
    episode = prompt + call + observation + answer + onward
    script = {p: episode[p + 1] for p in range(len(episode) - 1)}
    script[len(prompt) + len(call) - 1] = onward[0]  # after <|call|>: the script goes on instead of the tool's answer
    torch.manual_seed(0)
    model = steer(tiny_causal_lm("llama", tok, hidden=32, heads=2, max_positions=4096), script)

    trainer = PPOTrainer(config, model=model, tokenizer=tok, show_progress=False)
    assert trainer.stop_token_ids == (return_id, call_id)
    assert trainer.rollout.sampling["train"].stop_token_ids == (return_id, call_id)
    assert trainer.train_query_ids[0] == prompt  # the template's own prompt, with the tools' schemas
    prompts, columns = trainer.train_data.rows([0, 0])
    episodes = trainer.rollout.sample([prompt, prompt], prompts, columns)
    for row in range(2):
        trained = episodes.response_ids[row][episodes.loss_mask[row]].tolist()
        real = episodes.response_ids[row][episodes.attention_mask[row, len(prompt):]].tolist()
        assert trained == call + answer and real == call + observation + answer, tok.decode(real)
    assert episodes.turns.tolist() == [2, 2] and episodes.done.tolist() == [True, True] and episodes.ended.tolist() == [True, True]
    assert [t["text"] for t in episodes.transcripts[0] if t["role"] == "tool"] == ["42"]
    # the context of turn 2 is what the template renders for the conversation so far, as the model reads it
    messages = question + [{"role": "assistant", "content": "", "thinking": "I call add.",
                            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 17, "b": 25}}}]},
                           {"role": "tool", "name": "add", "content": "42"}]
    turn_2 = tok.apply_chat_template(messages, tools=_schemas(tmp_path), add_generation_prompt=True, tokenize=False)
    assert encode(turn_2) == prompt + call + observation
    # and the update trains on it: the completions reward functions see end with the answer, without <|return|>
    records = trainer.train()
    assert records[0]["rollout/turns"] == 2 and records[0]["env/done_rate"] == 1.0


def _schemas(folder):
    from ppokit.environments.tools import load_tools, tool_schemas

    return tool_schemas(load_tools([f"{folder}/arith.py:add"]))
