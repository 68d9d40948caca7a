"""Agents as programs (`agent: file.py:FUNCTION`, docs/agents.md): a tool-calling loop written with the official `openai`
package, as its docs show it, run against the endpoint ppokit serves each episode. Its episode equals, token for token,
the same conversation through the Tools environment (a tiny real model steered to call `add`, then answer: the trainer's
own parts, hf engine, the same seeds); each call's answer comes back as OpenAI `tool_calls`; a call that does not
continue the last one starts a segment (re-tokenised, counted); the run's temperature samples every call; an agent that
raises, hangs or returns no number fails its episode in one line and the rollout goes on; an ended episode's URL
refuses calls; `ppokit ppo` trains an agent run from a config file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from chat_families import ADD, FAMILIES
from steered import scripted, steer

from ppokit.demos.tiny import tiny_causal_lm

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")

FAMILY = FAMILIES["qwen2_5"]
QUESTION = [{"role": "user", "content": "What is 17 + 25?"}]

# The agent as a user writes it with the openai package: a chat-completions tool loop (its `tools` and the tool results
# as `tool` messages with the call's id), the reward its own check of the final answer.
AGENT = '''
import json

from openai import OpenAI

TOOLS = {tools}


def add(a, b):
    return a + b


def solve(row, base_url):
    client = OpenAI(base_url=base_url, api_key="anything")
    messages = list(row["messages"])
    while True:
        response = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, tool_choice="auto")
        message = response.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            result = add(**json.loads(call.function.arguments))
            messages.append({{"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}})
    return {{"reward": 1.0 if "42" in (message.content or "") else 0.0, "tool_calls": len(messages) - 2}}
'''


def schemas(tmp_path: Path) -> list[dict]:
    from ppokit.environments.tools import load_tools, tool_schemas

    (tmp_path / "arith.py").write_text(ADD)
    return tool_schemas(load_tools([f"{tmp_path}/arith.py:add"]))


def steered_model(tok, tools):
    """A tiny llama steered to write: a hermes call of add(17, 25), then (after the tool's answer) "It is 42."."""
    from conftest import conversation_renderer

    from ppokit.data.lengths import encode_prompt_text

    stop = tok.convert_tokens_to_ids(FAMILY.stop)
    renderer = conversation_renderer(tok, FAMILY.tokenizer().chat_template, tools=tools, stop_token_ids=stop, observation_role="tool")
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt = encode_prompt_text(tok, renderer.prompt(QUESTION))
    call = encode(FAMILY.call("add", {"a": 17, "b": 25})) + [stop]
    observation = renderer.observation([{"role": "tool", "name": "add", "content": "42"}], "42", True).ids
    answer = encode("It is 42.") + [stop]
    onward = encode(" and more")
    episode = prompt + call + observation + answer + onward
    torch.manual_seed(0)
    model = steer(tiny_causal_lm("llama", tok, hidden=32, heads=2, max_positions=2048), scripted(episode, {len(episode) - len(onward) - 1: onward[0]}))
    return model, prompt, call, observation, answer


def trainer_for(tmp_path: Path, name: str, model, tok, **keys):
    from ppokit.config.schema import DataConfig, PPOConfig, PPOHyperparams, RewardConfig, RolloutConfig
    from ppokit.trainer import PPOTrainer

    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"messages": QUESTION}) + "\n")
    ppo = dict(total_episodes=2, per_device_train_batch_size=2, num_mini_batches=1, response_length=96, num_sample_generations=0,
               advantage_estimator="grpo", num_samples_per_prompt=2, stop_token=FAMILY.stop, temperature=1.0)
    ppo.update(keys.pop("ppo", {}))
    config = PPOConfig(output_dir=str(tmp_path / name), reward=RewardConfig(functions=[]), data=DataConfig(train=str(data)),
                       rollout=RolloutConfig(max_turns=4), ppo=PPOHyperparams(**ppo), **keys)
    return PPOTrainer(config, model=model, tokenizer=tok, show_progress=False)


def write_agent(tmp_path: Path, tools, body: str = AGENT) -> str:
    path = tmp_path / "my_agent.py"
    path.write_text(body.format(tools=repr(tools)))
    return f"{path}:solve"


def test_an_openai_tool_loop_gives_the_tools_environments_episode_token_for_token(tmp_path):
    import copy

    tok = FAMILY.tokenizer()
    tools = schemas(tmp_path)
    model, prompt, call, observation, answer = steered_model(tok, tools)
    environment = trainer_for(tmp_path, "env", copy.deepcopy(model), tok, environment="ppokit.environments:Tools",
                              environment_args={"tools": [f"{tmp_path}/arith.py:add"]})
    agent = trainer_for(tmp_path, "agent", model, tok, agent=write_agent(tmp_path, tools))
    got = {}
    for name, trainer in (("env", environment), ("agent", agent)):
        prompts, columns = trainer.train_data.rows([0, 0])
        got[name] = trainer.rollout.sample([prompt, prompt], prompts, columns, update=0)
    env, ag = got["env"], got["agent"]
    for row in range(2):
        real = ag.response_ids[row][ag.attention_mask[row, ag.query_ids.shape[1]:]].tolist()
        assert real == call + observation + answer, tok.decode(real)
        assert ag.response_ids[row][ag.loss_mask[row]].tolist() == call + answer
        assert ag.query_ids[row][ag.query_mask[row]].tolist() == prompt
    for field in ("query_ids", "response_ids", "attention_mask", "loss_mask", "logprobs", "ended", "score_index", "turns"):
        assert torch.equal(getattr(env, field), getattr(ag, field)), field
    # the reward the agent returned sits at the last model token; its other numbers and the calls are metrics
    assert ag.environment_rewards.tolist() == [1.0, 1.0] and ag.environment_errors == [None, None]
    last = ag.score_index.tolist()
    assert [ag.turn_rewards[row, last[row]].item() for row in range(2)] == [1.0, 1.0] and ag.turn_rewards.sum().item() == 2.0
    assert ag.agent_numbers[0] == {"agent/calls": 2.0, "agent/segments": 1.0, "agent/retokenized_share": 0.0, "agent/tool_calls": 2.0}
    records = agent.train()
    assert records[-1]["reward/agent"] == 1.0 and records[-1]["agent/calls"] == 2.0 and records[-1]["agent/retokenized_share"] == 0.0


FORGETFUL = '''
import json

from openai import OpenAI

TOOLS = {tools}


def solve(row, base_url):
    client = OpenAI(base_url=base_url, api_key="anything")
    first = client.chat.completions.create(model="policy", messages=row["messages"], tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    # the history kept as text, not as the answer returned: the next call cannot continue the first at the token level
    messages = row["messages"] + [{{"role": "assistant", "content": "I asked add(17, 25) and it said 42."}},
                                  {{"role": "user", "content": "So what is it?"}}]
    second = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=12)
    with open({record!r}, "a") as f:
        f.write(json.dumps(messages) + "\\n")
    return 0.5
'''


def test_a_call_that_does_not_continue_the_last_starts_a_segment_and_the_last_segment_trains(tmp_path):
    from ppokit.data.lengths import encode_prompt_text

    tok = FAMILY.tokenizer()
    tools = schemas(tmp_path)
    model, prompt, call, observation, answer = steered_model(tok, tools)
    record = tmp_path / "second.jsonl"
    agent = trainer_for(tmp_path, "agent", model, tok, agent=write_agent(tmp_path, tools, FORGETFUL.replace("{record!r}", repr(str(record)))))
    prompts, columns = agent.train_data.rows([0, 0])
    episodes = agent.rollout.sample([prompt, prompt], prompts, columns, update=0)
    second = json.loads(record.read_text().splitlines()[0])
    rendered = agent.conversation.agent.renderer(tools).prompt(second)
    stop = tok.convert_tokens_to_ids(FAMILY.stop)
    for row in range(2):
        # the row is the second segment: its prompt the re-rendered history, its trained tokens the second call's only
        assert episodes.query_ids[row][episodes.query_mask[row]].tolist() == encode_prompt_text(tok, rendered)
        trained = episodes.response_ids[row][episodes.loss_mask[row]].tolist()
        assert 0 < len(trained) <= 12 and stop not in trained[:-1] and trained != call
        assert episodes.turns[row].item() == 1 and episodes.turn_rewards[row].sum().item() == 0.5
        assert episodes.turn_rewards[row, episodes.score_index[row]].item() == 0.5
    assert episodes.agent_numbers[0] == {"agent/calls": 2.0, "agent/segments": 2.0, "agent/retokenized_share": 1.0}


TEMPERATURE = '''
from openai import OpenAI


def solve(row, base_url):
    client = OpenAI(base_url=base_url, api_key="anything")
    # the agent asks for near-greedy sampling; the run's temperature decides (its logprobs are what trains)
    response = client.chat.completions.create(model="policy", messages=row["messages"], temperature=0.01, top_p=0.5,
                                              logprobs=True, max_completion_tokens=6)
    return {{"reward": 0.0, "logprob_sum": sum(t.logprob for t in response.choices[0].logprobs.content)}}
'''


def test_every_call_samples_with_the_runs_temperature_and_returns_its_logprobs(tmp_path):
    from ppokit.models.loading import response_logprobs

    tok = FAMILY.tokenizer()
    torch.manual_seed(1)
    model = tiny_causal_lm("llama", tok, hidden=32, heads=2, max_positions=2048)
    agent = trainer_for(tmp_path, "agent", model, tok, agent=write_agent(tmp_path, [], TEMPERATURE), ppo={"temperature": 2.5})
    prompts, columns = agent.train_data.rows([0, 0])
    prompt = agent.train_query_ids[0]
    episodes = agent.rollout.sample([prompt, prompt], prompts, columns, update=0)
    with torch.no_grad():
        own = response_logprobs(model, episodes.input_ids, episodes.attention_mask, episodes.response_ids, episodes.loss_mask, 2.5)[0]
    mask = episodes.loss_mask
    assert mask.sum().item() > 0
    # the engine's logprobs are the training forward's at ppo.temperature (hf: the same weights; a KV-cached decoding step
    # and one whole forward differ by float32 rounding of logits of magnitude ~10 over two layers, ~1e-5: 1e-4 bounds it)
    assert torch.allclose(episodes.logprobs[mask], own[mask], atol=1e-4)
    # and not those at the temperature the agent asked for
    with torch.no_grad():
        asked = response_logprobs(model, episodes.input_ids, episodes.attention_mask, episodes.response_ids, episodes.loss_mask, 1.0)[0]
    assert (episodes.logprobs[mask] - asked[mask]).abs().max() > 0.05
    # what the endpoint returned the agent is what trains
    for row in range(2):
        assert episodes.agent_numbers[row]["agent/logprob_sum"] == pytest.approx(episodes.logprobs[row][mask[row]].sum().item(), abs=1e-4)
