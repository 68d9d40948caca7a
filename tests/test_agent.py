"""Agents as programs (`agent: file.py:FUNCTION`, docs/agents.md): a tool-calling loop written with the official `openai`
package, as its docs show it, run against the endpoint ppokit serves each episode. Its episode equals, token for token,
the same conversation through the Tools environment (a tiny real model steered to call `add`, then answer: the trainer's
own parts, hf engine, the same seeds); each call's answer comes back as OpenAI `tool_calls`; a call that does not
continue the last one starts a segment (re-tokenised, counted, a row of its own: tests/test_agent_segments.py); the run's temperature
samples every call; an agent that raises, hangs or returns no number fails its episode in one line and the rollout goes on; an ended episode's URL
refuses calls; `ppokit ppo` trains an agent run from a config file; the OpenAI Agents SDK's own loop keeps one segment.
The command form (`agent: {command: ...}`, a program of its own per episode) makes the function form's episodes token
for token, fails its episode in one line on a non-zero exit, a last line that is no reward or its deadline (its process
group killed), and is checked before any work."""

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
    rollout = {"max_turns": 4, **keys.pop("rollout", {})}
    config = PPOConfig(output_dir=str(tmp_path / name), reward=RewardConfig(functions=[]), data=DataConfig(train=str(data)),
                       rollout=RolloutConfig(**rollout), ppo=PPOHyperparams(**ppo), **keys)
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
    assert ag.agent_numbers[0] == {"agent/calls": 2.0, "agent/segments": 1.0, "agent/retokenized_share": 0.0, "agent/trained_share": 1.0,
                                   "agent/tool_calls": 2.0}
    records = agent.train()
    assert records[-1]["reward/agent"] == 1.0 and records[-1]["agent/calls"] == 2.0 and records[-1]["agent/retokenized_share"] == 0.0


def saved_policy(tmp_path: Path) -> Path:
    """A tiny llama (seed 0) and the qwen2.5 tokenizer saved as tmp_path/policy, for a config's `model`."""
    tok = FAMILY.tokenizer()
    torch.manual_seed(0)
    model_path = tmp_path / "policy"
    tiny_causal_lm("llama", tok, hidden=32, heads=2, max_positions=1024).save_pretrained(model_path)
    tok.save_pretrained(model_path)
    return model_path


def ppokit_ppo_updates(tmp_path: Path, script: str, rollout: dict, ppo: dict, agent="agent.py:solve") -> list[dict]:
    """`ppokit ppo config.yaml` in a process of its own, in tmp_path, with `agent` (its program, `script`, written to
    agent.py) over 2 prompts of a tiny llama -> the metrics records of its updates. Checks it exited 0, saved its final
    model, and wrote `agent` back into its config.yaml as given."""
    import os

    import yaml

    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"Say something {i}"}) + "\n" for i in range(2)))
    (tmp_path / "agent.py").write_text(script)
    config = {"model": str(saved_policy(tmp_path)), "output_dir": str(tmp_path / "run"), "agent": agent,
              "data": {"train": "data.jsonl"}, "rollout": rollout,
              "ppo": {"total_episodes": 8, "response_length": 8, "num_sample_generations": 0, "num_samples_per_prompt": 2,
                      "stop_token": FAMILY.stop, **ppo}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    result = subprocess.run([sys.executable, "-m", "ppokit", "ppo", "config.yaml"], capture_output=True, text=True, cwd=tmp_path,
                            env=os.environ, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "run" / "final").is_dir()
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["agent"] == agent
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "reward/agent" in r]


def ppokit_ppo_with_agent(tmp_path: Path, agent, script: str) -> list[dict]:
    """`ppokit_ppo_updates` of 2 GRPO updates of 4 episodes (2 rows x 2), 3 agents at once."""
    updates = ppokit_ppo_updates(tmp_path, script, {"max_concurrent_episodes": 3},
                                 {"per_device_train_batch_size": 4, "num_mini_batches": 1, "advantage_estimator": "grpo"}, agent)
    assert len(updates) == 2
    return updates


# The same agent as a program of its own (`agent: {command: [...]}`): the row on stdin, the endpoint and a key from
# OPENAI_BASE_URL / OPENAI_API_KEY (which the openai client reads itself), the reward as stdout's last line.
COMMAND = AGENT.replace('OpenAI(base_url=base_url, api_key="anything")', "OpenAI()") + """

if __name__ == "__main__":
    import os
    import sys

    row = json.loads(sys.stdin.readline())
    print("the agent's own log line, not its reward")
    print(json.dumps(solve(row, os.environ["OPENAI_BASE_URL"])))
"""


def test_a_command_agent_gives_the_function_agents_episodes_token_for_token(tmp_path):
    """The function form and the command form differ only in how the reward comes back: the same tool loop run as a
    process of its own makes the same episodes (tokens, masks, logprobs), reward and agent/* numbers."""
    import copy

    tok = FAMILY.tokenizer()
    tools = schemas(tmp_path)
    model, prompt, call, observation, answer = steered_model(tok, tools)
    function = trainer_for(tmp_path, "function", copy.deepcopy(model), tok, agent=write_agent(tmp_path, tools))
    (tmp_path / "command_agent.py").write_text(COMMAND.format(tools=repr(tools)))
    command = trainer_for(tmp_path, "command", model, tok, agent={"command": [sys.executable, str(tmp_path / "command_agent.py")]})
    got = {}
    for name, trainer in (("function", function), ("command", command)):
        prompts, columns = trainer.train_data.rows([0, 0])
        got[name] = trainer.rollout.sample([prompt, prompt], prompts, columns, update=0)
    fn, cmd = got["function"], got["command"]
    assert cmd.environment_errors == [None, None], cmd.environment_errors
    for row in range(2):
        real = cmd.response_ids[row][cmd.attention_mask[row, cmd.query_ids.shape[1]:]].tolist()
        assert real == call + observation + answer, tok.decode(real)
    for field in ("query_ids", "response_ids", "attention_mask", "loss_mask", "logprobs", "ended", "score_index", "turns", "turn_rewards"):
        assert torch.equal(getattr(fn, field), getattr(cmd, field)), field
    assert cmd.environment_rewards.tolist() == fn.environment_rewards.tolist() == [1.0, 1.0]
    assert cmd.agent_numbers == fn.agent_numbers and cmd.agent_numbers[0]["agent/tool_calls"] == 2.0


# A command's faults, stdlib only (a fast start): each row says what its run does after one call to its endpoint.
COMMAND_FAULTS = """
import json
import os
import subprocess
import sys
import time
import urllib.request

row = json.loads(sys.stdin.readline())
body = json.dumps({"model": "policy", "messages": row["messages"], "max_tokens": 4}).encode()
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body,
                                 headers={"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
json.load(urllib.request.urlopen(request, timeout=120))
mode = row["mode"]


def leave_running(out):  # a process of the command's own group, its pid where the test reads it
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdout=out, stderr=out)
    with open(row["pidfile"], "w") as f:
        f.write(str(child.pid))


if mode == "ok":  # returns, leaving a process behind that holds its pipes: its exit ends its run, and the process
    leave_running(None)
    print(json.dumps({"reward": row["value"], "api_key": float(os.environ["OPENAI_API_KEY"] == "ppokit")}))
elif mode == "exits":
    print("0.75")
    print("Traceback (most recent call last):\\nValueError: the agent's own bug", file=sys.stderr)
    sys.exit(1)
elif mode == "garbage":
    print("0.5 points, I think")
    print("warning: unsure", file=sys.stderr)
elif mode == "no_reward":
    print(json.dumps({"score": 1.0}))
elif mode == "hangs":
    leave_running(None)
    time.sleep(600)
"""


def dead(pid: int) -> bool:
    """The process has ended (gone, or a zombie nobody reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_a_command_that_fails_fails_its_episode_in_one_line_and_the_rollout_goes_on(tmp_path):
    """A command that exits non-zero, prints no reward as its last line, returns a dict without one, or outlives
    agent_timeout_s fails its episode in one line naming the command (and its stderr's last line); the others train.
    At the deadline its whole process group is killed, and what a command leaves running when it exits too."""
    import time

    from ppokit.config.schema import DataConfig, PPOConfig, PPOHyperparams, RewardConfig, RolloutConfig
    from ppokit.trainer import PPOTrainer

    tok = FAMILY.tokenizer()
    torch.manual_seed(1)
    model = tiny_causal_lm("llama", tok, hidden=32, heads=2, max_positions=2048)
    modes = ["ok", "exits", "garbage", "no_reward", "hangs"]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Row {mode}"}], "mode": mode, "value": 0.25,
                                        "pidfile": str(tmp_path / f"{mode}.pid")}) + "\n" for mode in modes))
    (tmp_path / "faults.py").write_text(COMMAND_FAULTS)
    # the deadline only the hanging row reaches: the others take well under a second here (python's start and one call)
    config = PPOConfig(output_dir=str(tmp_path / "run"), reward=RewardConfig(functions=[], on_error="skip"), data=DataConfig(train=str(data)),
                       rollout=RolloutConfig(max_turns=2, max_concurrent_episodes=5), agent={"command": [sys.executable, "faults.py"]},
                       agent_timeout_s=15.0, ppo=PPOHyperparams(total_episodes=5, per_device_train_batch_size=5, num_mini_batches=1,
                                                               response_length=8, num_sample_generations=0, stop_token=FAMILY.stop))
    trainer = PPOTrainer(config, model=model, tokenizer=tok, show_progress=False)
    prompts, columns = trainer.train_data.rows(list(range(5)))
    import os

    here = os.getcwd()
    os.chdir(tmp_path)  # a command runs in the working directory: `faults.py` is read from there
    try:
        started = time.monotonic()
        episodes = trainer.rollout.sample([trainer.train_query_ids[i] for i in range(5)], prompts, columns, update=0)
        took = time.monotonic() - started
    finally:
        os.chdir(here)
    name = f"agent command '{sys.executable} faults.py'"
    errors = dict(zip(modes, episodes.environment_errors))
    assert errors["ok"] is None and episodes.environment_rewards[0].item() == 0.25 and episodes.agent_numbers[0]["agent/api_key"] == 1.0
    assert errors["exits"].startswith(f"{name}: exited with status 1; its stderr's last line: \"ValueError: the agent's own bug\"; prompt ")
    assert errors["garbage"].startswith(f"{name}: printed '0.5 points, I think' as the last line of its stdout; expected the reward there: a "
                                        "number, or a JSON object with one under \"reward\"; its stderr's last line: 'warning: unsure'; prompt ")
    assert errors["no_reward"].startswith(f"{name}: returned a dict without a \"reward\" key ({{'score': 1.0}}); prompt ")
    assert errors["hangs"].startswith(f"{name}: did not return within agent_timeout_s=15s (its process group was killed); prompt ")
    assert all("\n" not in e for e in errors.values() if e)
    assert 15.0 <= took < 100.0  # the deadline, not the left processes' 600 s: nothing waits for the pipes they hold
    for mode in ("ok", "hangs"):
        pid = int((tmp_path / f"{mode}.pid").read_text())
        deadline = time.monotonic() + 60
        while not dead(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert dead(pid), mode
    scored = trainer.rollout.score(episodes, prompts, columns)
    assert scored.valid.tolist() == [True, False, False, False, False]


def test_an_agent_command_is_checked_before_any_work(tmp_path):
    """`agent: {command: ...}`: a list as written, a string split as a shell splits words (no shell); other keys, no
    program, a string that does not split, a program not found: one line each before any model loads."""
    from ppokit.config.schema import PPOConfig, agent_command
    from ppokit.environments.agent import AgentCommand, AgentRunner
    from ppokit.errors import UserError

    base = ["model=m", "data.train=d.jsonl"]
    config = PPOConfig.load(None, base + ["agent={command: [python, agent.py, --tries, 3]}"]).validate()
    assert config.agent == {"command": ["python", "agent.py", "--tries", 3]} and agent_command(config.agent) == ["python", "agent.py", "--tries", "3"]
    assert agent_command({"command": "python -u 'my agent.py' --name \"a b\""}) == ["python", "-u", "my agent.py", "--name", "a b"]
    assert PPOConfig.load(None, base + ["reward.functions=[sentiment]", "agent=null"]).validate().agent is None
    for value, message in [("{cmd: x, env: y}", r"^agent: unknown keys 'cmd', 'env'; an agent's mapping takes command "),
                           ("{command: []}", r"^agent.command: names no program"),
                           ("{}", r"^agent.command: expected a list of strings .* got None$"),
                           ("{command: {a: 1}}", r"^agent.command: expected a list of strings"),
                           ("{command: 'python \"a.py'}", r"^agent.command: 'python \"a.py' cannot be split into words: No closing quotation$"),
                           ("[python, a.py]", r"^agent: expected a string or a mapping")]:
        with pytest.raises(UserError, match=message):
            PPOConfig.load(None, base + [f"agent={value}"]).validate()
    with pytest.raises(UserError, match=r"^agent \(\{'command': 'x'\}\) and environment \('ppokit.environments:Tools'\) are both set"):
        PPOConfig.load(None, base + ["agent={command: x}", "environment=ppokit.environments:Tools"]).validate()
    with pytest.raises(UserError, match=r"^agent.command: the program 'no-such-agent-program' is not found \(not on PATH\)$"):
        AgentRunner.load({"command": "no-such-agent-program --x"}, tmp_path)
    with pytest.raises(UserError, match=r"^agent.command: the program '\./missing.py' is not found \(no executable file there\)$"):
        AgentRunner.load({"command": ["./missing.py"]}, tmp_path)
    program = AgentRunner.load({"command": [sys.executable, "agent.py"]}, tmp_path)
    assert isinstance(program, AgentCommand) and program.spec == f"command '{sys.executable} agent.py'"


SIMPLE_COMMAND = """
import json
import os
import sys

from openai import OpenAI

row = json.loads(sys.stdin.readline())
client = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY: the episode's endpoint, set by ppokit
text = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}]).choices[0].message.content or ""
print(json.dumps({"reward": float("a" in text), "length": len(text), "row": float(row["prompt"].startswith("Say something"))}))
"""


def test_ppokit_ppo_trains_a_command_agent_written_with_openai_from_a_config_file(tmp_path):
    import shlex

    updates = ppokit_ppo_with_agent(tmp_path, {"command": f"{shlex.quote(sys.executable)} agent.py"}, SIMPLE_COMMAND)
    assert all(r["agent/calls"] == 1.0 and r["agent/segments"] == 1.0 and r["agent/row"] == 1.0 and 0 <= r["agent/length"] for r in updates)


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


def test_a_call_that_does_not_continue_the_last_starts_a_segment_and_both_segments_train(tmp_path):
    from ppokit.data.lengths import encode_prompt_text
    from ppokit.training.episodes import with_segment_rows

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
        # the episode's row is its last segment: its prompt the re-rendered history, its trained tokens the second call's
        assert episodes.query_ids[row][episodes.query_mask[row]].tolist() == encode_prompt_text(tok, rendered)
        trained = episodes.response_ids[row][episodes.loss_mask[row]].tolist()
        assert 0 < len(trained) <= 12 and stop not in trained[:-1] and trained != call
        assert episodes.turns[row].item() == 1 and episodes.turn_rewards[row].sum().item() == 0.5
        assert episodes.turn_rewards[row, episodes.score_index[row]].item() == 0.5
    # the first segment (the call) becomes a row of its own after scoring: its prompt the episode's first, its sampled
    # tokens trained, no reward on it; every sampled token trains
    rows = with_segment_rows(episodes, tok.pad_token_id)
    assert len(rows) == 4 and rows.episode_index.tolist() == [0, 1, 0, 1] and rows.is_episode.tolist() == [True, True, False, False]
    for row in (2, 3):
        assert rows.query_ids[row][rows.query_mask[row]].tolist() == prompt
        assert rows.response_ids[row][rows.loss_mask[row]].tolist() == call and rows.turn_rewards[row].sum().item() == 0.0
    for row in range(2):
        assert episodes.agent_numbers[row] == {"agent/calls": 2.0, "agent/segments": 2.0, "agent/retokenized_share": 1.0,
                                               "agent/trained_share": 1.0}


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
    from ppokit.models.forwards import response_logprobs

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


FAULTS = '''
import time

from openai import BadRequestError, NotFoundError, OpenAI

URLS = []


def solve(row, base_url):
    client = OpenAI(base_url=base_url, api_key="anything", max_retries=0)
    URLS.append(base_url)
    client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=4)
    mode = row["mode"]
    if mode == "raises":
        raise RuntimeError("the agent's own bug")
    if mode == "hangs":
        time.sleep(20)
    if mode == "text":
        return "fine"
    if mode == "leaky":  # an ended episode's URL
        try:
            OpenAI(base_url=URLS[0], api_key="anything", max_retries=0).chat.completions.create(model="policy", messages=row["messages"])
        except NotFoundError as e:
            return {{"reward": 1.0, "refused": float("ended" in e.body["message"])}}
        return 0.0
    checks = {{}}
    for name, asked in (("stream", {{"stream": True}}), ("n", {{"n": 2}}), ("tool_choice", {{"tool_choice": "required"}})):
        try:
            client.chat.completions.create(model="policy", messages=row["messages"], **asked)
        except BadRequestError as e:
            checks[name] = float(e.status_code == 400 and e.body["param"] == name and e.body["type"] == "invalid_request_error")
    checks["models"] = float([m.id for m in client.models.list()] == ["ppokit-policy"])
    text = client.completions.create(model="policy", prompt="Once upon a time", max_tokens=3)
    checks["completions"] = float(text.choices[0].finish_reason in ("stop", "length") and text.usage.completion_tokens <= 3)
    return {{"reward": 1.0, **checks}}
'''


def test_an_agent_that_fails_fails_its_episode_in_one_line_and_the_rollout_goes_on(tmp_path):
    from ppokit.config.schema import DataConfig, PPOConfig, PPOHyperparams, RewardConfig, RolloutConfig
    from ppokit.trainer import PPOTrainer

    tok = FAMILY.tokenizer()
    torch.manual_seed(1)
    model = tiny_causal_lm("llama", tok, hidden=32, heads=2, max_positions=2048)
    modes = ["checks", "raises", "hangs", "text", "leaky"]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Row {mode}"}], "mode": mode}) + "\n" for mode in modes))
    config = PPOConfig(output_dir=str(tmp_path / "run"), reward=RewardConfig(functions=[], on_error="skip"), data=DataConfig(train=str(data)),
                       rollout=RolloutConfig(max_turns=8, max_concurrent_episodes=1), agent=write_agent(tmp_path, [], FAULTS),
                       # 6 s: the "checks" agent makes eight requests, room for a machine several times slower than a quiet one
                       agent_timeout_s=6.0, ppo=PPOHyperparams(total_episodes=5, per_device_train_batch_size=5, num_mini_batches=1,
                                                              response_length=8, num_sample_generations=0, stop_token=FAMILY.stop))
    trainer = PPOTrainer(config, model=model, tokenizer=tok, show_progress=False)
    prompts, columns = trainer.train_data.rows(list(range(5)))
    episodes = trainer.rollout.sample([trainer.train_query_ids[i] for i in range(5)], prompts, columns, update=0)
    errors = episodes.environment_errors
    assert errors[0] is None and errors[4] is None
    assert errors[1].startswith(f"agent {config.agent}: raised RuntimeError: the agent's own bug; prompt ")
    assert errors[2].startswith(f"agent {config.agent}: did not return within agent_timeout_s=6s")
    assert errors[3].startswith(f"agent {config.agent}: returned the reward 'fine' (a str); expected a finite number")
    assert all("\n" not in e for e in errors if e)
    # the refused requests are no calls; the /v1/completions call starts a second segment
    assert episodes.agent_numbers[0] == {"agent/calls": 2.0, "agent/segments": 2.0, "agent/retokenized_share": 1.0, "agent/stream": 1.0,
                                         "agent/trained_share": 1.0,
                                         "agent/n": 1.0, "agent/tool_choice": 1.0, "agent/models": 1.0, "agent/completions": 1.0}
    assert episodes.agent_numbers[4]["agent/refused"] == 1.0
    scored = trainer.rollout.score(episodes, prompts, columns)
    assert scored.valid.tolist() == [True, False, False, False, True] and scored.scores[[0, 4]].tolist() == [1.0, 1.0]


def test_agent_keys_are_refused_where_they_would_not_be_read(tmp_path):
    from ppokit.config.schema import PPOConfig
    from ppokit.errors import UserError

    with pytest.raises(UserError, match=r"^agent \('a.py:f'\) and environment \('ppokit.environments:Tools'\) are both set"):
        PPOConfig.load(None, ["model=m", "data.train=d.jsonl", "agent=a.py:f", "environment=ppokit.environments:Tools"]).validate()
    with pytest.raises(UserError, match=r"^agent_timeout_s \(5.0\) is for an agent program, and `agent` is not set"):
        PPOConfig.load(None, ["model=m", "data.train=d.jsonl", "reward.functions=[sentiment]", "agent_timeout_s=5"]).validate()
    with pytest.raises(UserError, match=r"^environment_args .* is for an environment, and an `agent` makes the episodes"):
        PPOConfig.load(None, ["model=m", "data.train=d.jsonl", "agent=a.py:f", "environment_args={tools: [x]}"]).validate()
    with pytest.raises(UserError, match="agent_tool_parser"):
        PPOConfig.load(None, ["model=m", "data.train=d.jsonl", "agent=a.py:f", "agent_tool_parser=nope"]).validate()


SIMPLE = '''
import asyncio

from openai import AsyncOpenAI


async def solve(row, base_url):
    client = AsyncOpenAI(base_url=base_url, api_key="anything")
    response = await client.chat.completions.create(model="policy", messages=[{{"role": "user", "content": row["prompt"]}}])
    return {{"reward": float("a" in (response.choices[0].message.content or "")), "length": len(response.choices[0].message.content or "")}}
'''


def test_ppokit_ppo_trains_an_async_openai_agent_from_a_config_file(tmp_path):
    updates = ppokit_ppo_with_agent(tmp_path, "agent.py:solve", SIMPLE.format())
    assert all(r["agent/calls"] == 1.0 and r["agent/segments"] == 1.0 and 0 <= r["agent/length"] for r in updates)


AGENTS_SDK = '''
from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

set_tracing_disabled(True)  # no traces sent anywhere


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


async def solve(row, base_url):
    model = OpenAIChatCompletionsModel(model="policy", openai_client=AsyncOpenAI(base_url=base_url, api_key="anything"))
    result = await Runner.run(Agent(name="adder", model=model, tools=[add]), row["messages"][0]["content"], max_turns=3)
    return float("42" in str(result.final_output))
'''


def test_an_openai_agents_sdk_agent_keeps_one_segment_and_trains(tmp_path):
    """The OpenAI Agents SDK's own loop (Runner.run over its chat-completions model) against the endpoint: the tool call
    comes back as tool_calls the SDK runs, its next call continues the episode at the token level, and the reward lands.
    openai-agents is in the dev extras, so CI runs it; skipped only where it is not installed."""
    pytest.importorskip("agents")

    tok = FAMILY.tokenizer()
    namespace: dict = {}
    exec(AGENTS_SDK.replace("set_tracing_disabled(True)", ""), namespace)
    add = namespace["add"]  # the tool as the SDK sends it to a chat-completions endpoint
    tools = [{"type": "function", "function": {"name": add.name, "description": add.description, "parameters": add.params_json_schema,
                                               "strict": add.strict_json_schema}}]
    model, prompt, call, observation, answer = steered_model(tok, tools)
    (tmp_path / "sdk_agent.py").write_text(AGENTS_SDK)
    trainer = trainer_for(tmp_path, "agent", model, tok, agent=f"{tmp_path}/sdk_agent.py:solve")
    prompts, columns = trainer.train_data.rows([0, 0])
    episodes = trainer.rollout.sample([prompt, prompt], prompts, columns, update=0)
    assert episodes.environment_errors == [None, None]
    for row in range(2):
        assert episodes.query_ids[row][episodes.query_mask[row]].tolist() == prompt
        real = episodes.response_ids[row][episodes.attention_mask[row, episodes.query_ids.shape[1]:]].tolist()
        assert real == call + observation + answer, tok.decode(real)
    assert episodes.environment_rewards.tolist() == [1.0, 1.0]
    assert episodes.agent_numbers[0] == {"agent/calls": 2.0, "agent/segments": 1.0, "agent/retokenized_share": 0.0, "agent/trained_share": 1.0}


ONE_CALL = '''
from openai import OpenAI


def solve(row, base_url):
    OpenAI(base_url=base_url, api_key="anything", max_retries=0).chat.completions.create(model="policy", messages=row["messages"])
    return 1.0
'''


def test_a_call_not_answered_within_agent_call_timeout_s_fails_its_episode(tmp_path):
    tok = FAMILY.tokenizer()
    torch.manual_seed(1)
    model = tiny_causal_lm("llama", tok, hidden=32, heads=2, max_positions=2048)
    # a deadline no engine step meets: the call is answered 500, its request aborted, the episode failed with that line
    trainer = trainer_for(tmp_path, "agent", model, tok, agent=write_agent(tmp_path, [], ONE_CALL), agent_call_timeout_s=1e-6)
    prompts, columns = trainer.train_data.rows([0, 0])
    episodes = trainer.rollout.sample([trainer.train_query_ids[0]] * 2, prompts, columns, update=0)
    for error in episodes.environment_errors:
        assert error.startswith(f"agent {trainer.config.agent}: call 1 was not answered within agent_call_timeout_s=1e-06s; prompt ")
    assert trainer.rollout.engine.unfinished() == 0


CONCURRENT = '''
import threading
import time

from openai import OpenAI

LOCK = threading.Lock()
RUNNING = [0, 0]  # now, most at once


def solve(row, base_url):
    with LOCK:
        RUNNING[0] += 1
        RUNNING[1] = max(RUNNING)
    try:
        OpenAI(base_url=base_url, api_key="anything", max_retries=0).chat.completions.create(model="policy", messages=row["messages"])
        time.sleep(0.3)  # the agent's own work: the other lane's agent runs meanwhile
        return {{"reward": 0.0, "most_at_once": RUNNING[1]}}
    finally:
        with LOCK:
            RUNNING[0] -= 1
'''


def test_at_most_max_concurrent_episodes_agents_run_at_once(tmp_path):
    tok = FAMILY.tokenizer()
    torch.manual_seed(1)
    model = tiny_causal_lm("llama", tok, hidden=32, heads=2, max_positions=2048)
    trainer = trainer_for(tmp_path, "agent", model, tok, agent=write_agent(tmp_path, [], CONCURRENT), rollout={"max_concurrent_episodes": 2})
    prompts, columns = trainer.train_data.rows([0] * 6)
    episodes = trainer.rollout.sample([trainer.train_query_ids[0]] * 6, prompts, columns, update=0)
    assert episodes.environment_errors == [None] * 6
    most = max(numbers["agent/most_at_once"] for numbers in episodes.agent_numbers)
    assert most == 2  # never more than the bound; the second lane's agent starts while the first's sleeps


RESUMED = '''
from openai import OpenAI


def solve(row, base_url):
    client = OpenAI(base_url=base_url, api_key="anything", max_retries=0)
    message = client.chat.completions.create(model="policy", messages=[{{"role": "user", "content": row["prompt"]}}]).choices[0].message
    follow = client.chat.completions.create(model="policy", messages=[{{"role": "user", "content": row["prompt"]}}, message,
                                                                      {{"role": "user", "content": "Again."}}]).choices[0].message
    return float(len(follow.content or "") % 3 == 0)
'''


def resumed_and_straight(tmp_path: Path, agent: str, **ppo) -> list[dict]:
    """An agent run (my_agent.py:solve, `agent`'s text; rloo, 2 optimiser steps per update) crashed in its second update and
    resumed, against the same run straight through: the resumed run's metrics, asserted equal to the straight run's."""
    from test_checkpoint import comparable, resume_and_finish, train_until_crash_at_optimizer_step

    from ppokit.config.schema import DataConfig, PPOConfig, PPOHyperparams, RewardConfig, RolloutConfig
    from ppokit.trainer import PPOTrainer

    model_path = saved_policy(tmp_path)
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"Say {i}"}) + "\n" for i in range(4)))
    write_agent(tmp_path, [], agent)

    def config(out):
        return PPOConfig(model=str(model_path), output_dir=str(out), agent=f"{tmp_path}/my_agent.py:solve",
                         reward=RewardConfig(functions=[]), data=DataConfig(train=str(tmp_path / "data.jsonl")),
                         rollout=RolloutConfig(max_turns=2, max_concurrent_episodes=3, max_episode_tokens=64),
                         ppo=PPOHyperparams(total_episodes=12, per_device_train_batch_size=2, num_mini_batches=2, num_ppo_epochs=1, response_length=6,
                                            save_steps=1, stop_token=FAMILY.stop, advantage_estimator="rloo", num_samples_per_prompt=2, **ppo))

    PPOTrainer(config(tmp_path / "straight"), show_progress=False).train()
    crashed = PPOTrainer(config(tmp_path / "crashed"), show_progress=False)
    train_until_crash_at_optimizer_step(crashed, 4)  # 2 optimiser steps per update: in the second update
    resume_and_finish(config(tmp_path / "crashed"))
    got, want = comparable(tmp_path / "crashed" / "metrics.jsonl"), comparable(tmp_path / "straight" / "metrics.jsonl")
    assert [r["update"] for r in got] == [1, 2, 3] and got == want  # every number, bit for bit, but wall-clock time
    return got


def test_an_agent_run_resumed_after_a_crash_is_the_run_it_would_have_been(tmp_path):
    got = resumed_and_straight(tmp_path, RESUMED, num_sample_generations=1, num_eval_samples=2)
    assert all(r["agent/calls"] == 2.0 and r["agent/segments"] == 1.0 for r in got)
    assert (tmp_path / "crashed" / "samples.jsonl").read_text() == (tmp_path / "straight" / "samples.jsonl").read_text()



class FailingSession:
    """An episode's session whose chat call fails on ppokit's side (a bug, not the request's fault), and whose completion
    call waits until the episode is closed under it."""

    def __init__(self):
        import asyncio

        self.failures: list[BaseException] = []
        self.waiting = asyncio.Event()

    async def chat(self, body):
        raise RuntimeError("ppokit's own bug")

    async def complete(self, body):
        import asyncio

        self.waiting.set()
        await asyncio.sleep(60)

    def failed(self, error):
        self.failures.append(error)


def test_the_endpoint_answers_every_error_in_openais_form_and_stops_cleanly_inside_the_rollouts_loop(monkeypatch):
    """The endpoint alone (starlette on uvicorn, in the caller's event loop): ppokit's own failure under a call is a 500 in
    OpenAI's form and reaches the session; an unknown route, a body that is not JSON or is over the limit, an ended
    episode's URL and a call cut by the episode's end are refused in OpenAI's form; the trainer's SIGINT handler stays
    the trainer's while it serves; once stopped its port takes no connection."""
    import asyncio
    import signal
    import socket

    import httpx

    from ppokit.environments import agent_endpoint
    from ppokit.environments.agent_endpoint import Endpoint

    from ppokit.process.workers import run_coroutine

    monkeypatch.setattr(agent_endpoint, "BODY_LIMIT", 1000)
    handler = signal.getsignal(signal.SIGINT)

    async def main():  # run as a rollout runs (process.workers.run_coroutine: a loop of its own in this, the main, thread)
        endpoint = Endpoint()
        await endpoint.start()
        session = FailingSession()
        url = endpoint.open(session)
        assert signal.getsignal(signal.SIGINT) is handler
        async with httpx.AsyncClient(timeout=30) as client:
            got = {}
            answer = await client.post(f"{url}/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            got["failure"] = answer.status_code, answer.json()
            answer = await client.get(f"http://127.0.0.1:{endpoint.port}/v1/models")
            got["route"] = answer.status_code, answer.json()["error"]["type"]
            answer = await client.post(f"{url}/chat/completions", content=b"{not json")
            got["json"] = answer.status_code, answer.json()["error"]["type"]
            answer = await client.post(f"{url}/chat/completions", content=b" " * 1001)
            got["size"] = answer.status_code, answer.json()["error"]["type"]
            call = asyncio.ensure_future(client.post(f"{url}/completions", json={"prompt": "x"}))
            await session.waiting.wait()
            endpoint.close(url)
            answer = await call
            got["cut"] = answer.status_code, answer.json()["error"]["message"]
            answer = await client.get(f"{url}/models")
            got["ended"] = answer.status_code, answer.json()["error"]["message"]
        await endpoint.stop()
        return got, session.failures, endpoint.port

    got, failures, port = run_coroutine(main)
    assert got["failure"] == (500, {"error": {"message": "ppokit could not answer this call: RuntimeError: ppokit's own bug",
                                              "type": "server_error", "param": None, "code": None}})
    assert [str(e) for e in failures] == ["ppokit's own bug"]
    assert got["route"] == (404, "not_found_error")
    assert got["json"] == (400, "invalid_request_error") and got["size"] == (413, "invalid_request_error")
    assert got["cut"] == (404, "this episode ended while the call was answered")
    assert got["ended"] == (404, "this episode has ended (or never was): its URL serves no more calls")
    assert signal.getsignal(signal.SIGINT) is handler
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)


def test_the_agent_demo_without_openai_is_refused_in_one_line_before_any_work(tmp_path, monkeypatch):
    """The calculator-agent demo's agent is written with the openai package: without it, one line naming it and nothing
    made (the endpoint itself needs nothing beyond ppokit's own dependencies)."""
    from ppokit.demos.calculator import run_calculator_agent_demo
    from ppokit.errors import UserError

    monkeypatch.setitem(sys.modules, "openai", None)  # as if not installed: importlib finds no spec
    with pytest.raises(UserError, match=r"^demo --environment calculator-agent: its agent is written with the openai package; pip install openai$"):
        run_calculator_agent_demo(tmp_path / "calc", quick=True, show_progress=False)
    assert not (tmp_path / "calc").exists()
