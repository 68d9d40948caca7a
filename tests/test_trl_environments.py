"""TRL's environment classes (`ppokit.environments:TRLEnvironment`, trl's `GRPOTrainer(environment_factory=...)`) through
real runs of a tiny ChatML model taught to call a `tally` tool twice and then say "done" (tests/test_multiturn_trainer.py's
`chatml_model`): the class's public methods are the tools, reset's text ends the prompt's last message, get_reward is the
episode's reward; several classes in one run, each row's `environment` column choosing one, each prompt with its tools."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from test_multiturn_trainer import ONE_UPDATE, QUESTIONS, RecordingSource, chatml_model  # noqa: F401 - the fixture

# A class in the style of trl's documentation (docs/source/grpo_trainer.md, "Environments"): reserved reset and
# get_reward, one public method with a Google-style docstring as the tool.
TALLY_ENV = '''
class TallyEnv:
    def reset(self, **kwargs) -> str | None:
        self.count = 0
        return " Tally twice."

    def get_reward(self) -> float:
        return float(self.count)

    def tally(self) -> str:
        """Count one more."""
        self.count += 1
        return "counted"
'''

# trl's documented example class (IncrementEnv, the dataset's `target` column reaching reset), its verdict imported from
# the module beside it.
INCREMENT_ENV = '''
from trl_env_verdicts import reached


class IncrementEnv:
    def reset(self, target, **kwargs) -> None:
        self.counter = 0
        self.target = target

    def get_reward(self) -> float:
        return float(reached(self.counter, self.target))

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter
'''

VERDICTS = "def reached(counter, target):\n    return counter == target\n"


def tally() -> str:
    """Count one more."""


@pytest.fixture(scope="module")
def env_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trl-envs")
    (folder / "tally_env.py").write_text(TALLY_ENV)
    (folder / "increment_env.py").write_text(INCREMENT_ENV)
    (folder / "trl_env_verdicts.py").write_text(VERDICTS)
    yield folder
    sys.modules.pop("trl_env_verdicts", None)


def _rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(model, data, out, environment_args, **extra) -> dict:
    return {"model": str(model), "output_dir": str(out), "seed": 1, "reward": {"functions": []}, "data": {"train": str(data)},
            "ppo": {**ONE_UPDATE, "num_sample_generations": 1, "response_length": 24, "top_k": 1, "learning_rate": 1e-3,
                    "advantage_estimator": "reinforce_pp"},
            "environment": "ppokit.environments:TRLEnvironment", "environment_args": environment_args,
            "environment_timeout_s": 60, "rollout": {"max_turns": 3, "max_episode_tokens": 128}, **extra}


def _samples(run):
    return [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _tally_results(turns) -> int:
    return sum(t["role"] == "tool" and t["text"] == "counted" for t in turns)


def test_a_trl_environment_class_plays_its_episodes_as_trl_renders_them(chatml_model, env_folder, tmp_path):
    """TallyEnv: its tally method is the prompt's one tool; reset's text is appended to the user message (TRL:
    `content + observation`), so every episode is token for token Qwen2.5's template rendering of [user: question +
    " Tally twice.", the model's turns, the tool results] with tally's schema; get_reward (the calls that ran) is the
    environment's reward of each episode."""
    from transformers import AutoTokenizer

    from ppokit.config.schema import PPOConfig
    from ppokit.environments.tools import tool_schemas
    from ppokit.trainer import PPOTrainer

    data = _rows(tmp_path / "questions.jsonl", [{"prompt": [{"role": "user", "content": q}]} for q in QUESTIONS])
    path = tmp_path / "ppo.yaml"
    path.write_text(yaml.safe_dump(sort_keys=False, data=_config(chatml_model, data, tmp_path / "run",
                                                                 {"factory": str(env_folder / "tally_env.py") + ":TallyEnv"})))
    config = PPOConfig.load(path)
    source = RecordingSource()
    PPOTrainer(config, reward_functions=[source], show_progress=False).train()
    tok = AutoTokenizer.from_pretrained(chatml_model)
    samples = _samples(tmp_path / "run")
    assert len(source.episodes) == len(samples) == 8
    for ids, row in zip(source.episodes, samples):
        [question] = [q for q in QUESTIONS if q in row["prompt"]]
        first, *turns = row["turns"]
        assert (first["role"], first["text"]) == ("user", " Tally twice.")  # reset's text, as the transcript shows it
        messages = [{"role": "user", "content": question + " Tally twice."}] + [{"role": t["role"], "content": t["text"]} for t in turns]
        rendered = tok.apply_chat_template(messages, tools=tool_schemas({"tally": tally}), tokenize=False)
        assert tok.decode(ids, skip_special_tokens=False) == rendered.removesuffix("\n")
        assert row["rewards"]["environment"] == _tally_results(turns)  # get_reward: the calls that ran
    assert sum(row["rewards"]["environment"] for row in samples) > 0  # the model did call it


def test_trl_s_example_class_trains_through_ppokit_ppo_importing_its_neighbour(chatml_model, env_folder, tmp_path):
    """`ppokit ppo` with trl's IncrementEnv (whose file imports the module beside it): the dataset's target column reaches
    reset(target=...), get_reward (counter == target) is the only reward source, and the update trains."""
    from ppokit.cli import main

    targets = [0, 1, 2, 0, 3, 0, 1, 2]
    data = _rows(tmp_path / "questions.jsonl", [{"prompt": [{"role": "user", "content": q}], "target": t} for q, t in zip(QUESTIONS, targets)])
    config = tmp_path / "ppo.yaml"
    config.write_text(yaml.safe_dump(sort_keys=False, data=_config(chatml_model, data, tmp_path / "run", {"factory": "increment_env.py:IncrementEnv"})))
    import os
    here = os.getcwd()
    os.chdir(env_folder)  # the spec is relative to the working directory; the folder is not on sys.path
    try:
        assert main(["ppo", str(config)]) == 0
    finally:
        os.chdir(here)
    [record] = _metrics(tmp_path / "run")
    samples = _samples(tmp_path / "run")
    for row in samples:  # the model calls tally, which IncrementEnv has not: the counter stays 0 unless it called increment
        calls = [t for t in row["turns"] if t["role"] == "tool" and not t["text"].startswith("error")]
        counter = int(calls[-1]["text"]) if calls else 0
        assert row["rewards"]["environment"] == float(counter == row["columns"]["target"])
        assert "increment" in row["prompt"] and "tally" not in row["prompt"]  # its tools, from its methods
    assert record["reward/environment"] == pytest.approx(sum(r["rewards"]["environment"] for r in samples) / 8)
    assert record["reward/environment"] > 0 and "loss/policy_avg" in record


def test_several_trl_environments_each_row_choosing_one_show_only_their_tools(chatml_model, env_folder, tmp_path):
    """factories {tally: TallyEnv, increment: IncrementEnv}, the rows alternating by their environment column: each
    prompt shows its class's tool only, each episode plays its class (tally's results only in tally's episodes), and the
    update's metrics have env/<name>/episodes, turns, done_rate, reward and score for each."""
    from ppokit.cli import main

    rows = [{"prompt": [{"role": "user", "content": q}], "environment": "tally" if i % 2 else "increment", "target": 0}
            for i, q in enumerate(QUESTIONS)]
    data = _rows(tmp_path / "questions.jsonl", rows)
    config = tmp_path / "ppo.yaml"
    factories = {"tally": str(env_folder / "tally_env.py") + ":TallyEnv", "increment": str(env_folder / "increment_env.py") + ":IncrementEnv"}
    config.write_text(yaml.safe_dump(sort_keys=False, data=_config(chatml_model, data, tmp_path / "run", {"factories": factories})))
    assert main(["ppo", str(config)]) == 0
    samples = _samples(tmp_path / "run")
    [record] = _metrics(tmp_path / "run")
    assert len(samples) == 8
    for row in samples:
        tools = ('"name": "tally"', '"name": "increment"')
        shown, hidden = tools if row["columns"]["environment"] == "tally" else tools[::-1]
        assert shown in row["prompt"] and hidden not in row["prompt"], row["prompt"]
        if row["columns"]["environment"] == "increment":
            assert _tally_results(row["turns"]) == 0 and row["turns"][0]["role"] == "assistant"  # IncrementEnv's reset: no text
        else:
            assert row["turns"][0]["text"] == " Tally twice." and row["rewards"]["environment"] == _tally_results(row["turns"])
    for name in ("tally", "increment"):
        mine = [r for r in samples if r["columns"]["environment"] == name]
        assert record[f"env/{name}/episodes"] == len(mine) == 4
        assert record[f"env/{name}/reward"] == pytest.approx(sum(r["rewards"]["environment"] for r in mine) / 4)
        assert record[f"env/{name}/turns"] == pytest.approx(sum(t["role"] == "assistant" for r in mine for t in r["turns"]) / 4)
        assert {f"env/{name}/done_rate", f"env/{name}/score"} <= set(record)
    assert record["env/tally/reward"] > 0


@pytest.mark.parametrize("row, message", [
    ({"prompt": "count the cats"}, r"questions.jsonl:2: the row has no environment column, which chooses its environment "
                                   r"among environment_args.factories \(tally, increment\)"),
    ({"prompt": "count the cats", "environment": "chess"},
     r"questions.jsonl:2: the row's environment 'chess' is not one of environment_args.factories \(tally, increment\)"),
])
def test_a_row_that_chooses_no_environment_is_one_line_at_start(chatml_model, env_folder, tmp_path, capsys, row, message):
    """Several factories: a row without the environment column, or naming another, stops `ppokit ppo` before any weights
    load, in one line naming the file and line, no traceback, no run folder."""
    import re

    from ppokit.cli import main

    data = _rows(tmp_path / "questions.jsonl", [{"prompt": [{"role": "user", "content": "count the dogs"}], "environment": "tally"},
                                                {**row, "prompt": [{"role": "user", "content": row["prompt"]}]}])
    config = tmp_path / "ppo.yaml"
    factories = {"tally": str(env_folder / "tally_env.py") + ":TallyEnv", "increment": str(env_folder / "increment_env.py") + ":IncrementEnv"}
    config.write_text(yaml.safe_dump(sort_keys=False, data=_config(chatml_model, data, tmp_path / "run", {"factories": factories})))
    assert main(["ppo", str(config)]) != 0
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


SHOUT = '''
def shout(text: str) -> dict:
    """Say it louder.

    Args:
        text: What to say.
    """
    return {"said": text.upper()}
'''


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_standalone_tools_join_each_class_s_methods_and_results_read_as_trl_s_str(env_folder, tmp_path):
    """TRL's `tools=` beside the factories: every class's prompt shows them before its methods; a turn runs either; a
    result is str(result) as TRL makes it (a dict as Python writes it, not JSON); reset gets the row without its
    environment column; get_reward reads the instance's state."""
    from ppokit.environments import TRLEnvironment

    (tmp_path / "shout_tool.py").write_text(SHOUT)
    env = TRLEnvironment(factories={"tally": str(env_folder / "tally_env.py") + ":TallyEnv",
                                    "increment": str(env_folder / "increment_env.py") + ":IncrementEnv"},
                         tools=[str(tmp_path / "shout_tool.py") + ":shout"])
    assert [s["function"]["name"] for s in env.tools_for({"environment": "tally"})] == ["shout", "tally"]
    assert [s["function"]["name"] for s in env.tools_for({"environment": "increment"})] == ["shout", "increment"]
    assert env.reset({"environment": "increment", "target": 1, "prompt": "p"}) is None
    observation, reward, done = env.step(call("shout", text="hi") + "\n" + call("increment", step=1) + "\n" + call("tally"))
    assert [m["content"] for m in env.observation_messages(observation)] == [
        "{'said': 'HI'}", "1", "error: there is no tool 'tally'; the tools are shout, increment"]
    assert (reward, done, env.get_reward()) == (0.0, False, 1.0)
    assert env.step("no call")[2] is True
    with pytest.raises(ValueError, match=r"^the row has no environment column"):  # a row the start did not see: the episode's error
        env.reset({"prompt": "p"})


@pytest.mark.parametrize("source, message", [
    ("class NoReset:\n    def act(self, x: int) -> int:\n        '''Act.\n\n        Args:\n            x: a number\n        '''\n",
     r"environment_args.factory: '.*bad_env.py:Env': NoReset has no reset method"),
    ("class Undocumented:\n    def reset(self, **kw):\n        return None\n    def act(self, x):\n        return x\n",
     r"environment_args.factory: .*bad_env.py:Env: tool act: its schema for the chat template cannot be made"),
])
def test_a_class_trl_could_not_use_is_one_line_at_start(tmp_path, source, message):
    from ppokit.environments import TRLEnvironment
    from ppokit.errors import UserError

    (tmp_path / "bad_env.py").write_text(source + "\nEnv = " + source.split()[1].split(":")[0] + "\n")
    with pytest.raises(UserError, match=message) as caught:
        TRLEnvironment(factory=str(tmp_path / "bad_env.py") + ":Env")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("name", ["tally", "increment"])
def test_data_inspect_and_plan_count_a_row_s_prompt_with_its_own_tools(chatml_model, env_folder, tmp_path, capsys, name):
    """`ppokit data inspect --config` and `ppokit plan` read the same per-row decision as the run: a row choosing
    `name` is counted as the template renders it with that class's tools only."""
    from transformers import AutoTokenizer

    from ppokit.cli import main
    from ppokit.environments import TRLEnvironment

    question = [{"role": "user", "content": "count the cats"}]
    data = _rows(tmp_path / "one.jsonl", [{"prompt": question, "environment": name, "target": 0}])
    factories = {"tally": str(env_folder / "tally_env.py") + ":TallyEnv", "increment": str(env_folder / "increment_env.py") + ":IncrementEnv"}
    config = tmp_path / "ppo.yaml"
    config.write_text(yaml.safe_dump(sort_keys=False, data=_config(chatml_model, data, tmp_path / "run", {"factories": factories})))
    tok = AutoTokenizer.from_pretrained(chatml_model)
    own = TRLEnvironment(factories=factories).tools_for({"environment": name})
    want = len(tok(tok.apply_chat_template(question, tools=own, add_generation_prompt=True, tokenize=False), add_special_tokens=False)["input_ids"])
    capsys.readouterr()
    assert main(["data", "inspect", "--config", str(config), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["lengths"]["prompt"]["max"] == want
    assert main(["plan", str(config), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sequence"]["prompt"] == want


def test_a_class_without_get_reward_and_no_other_source_is_refused_at_start(chatml_model, tmp_path, capsys):
    """TRL refuses a run with no reward source ("Pass `reward_funcs`, or an `environment_factory` whose environment
    defines a `get_reward` method"): ppokit too, in one line before any weights load, no run folder."""
    from ppokit.cli import main

    (tmp_path / "silent_env.py").write_text("class Silent:\n    def reset(self, **kwargs):\n        return None\n")
    data = _rows(tmp_path / "questions.jsonl", [{"prompt": [{"role": "user", "content": "count the cats"}]}])
    config = tmp_path / "ppo.yaml"
    config.write_text(yaml.safe_dump(sort_keys=False, data=_config(chatml_model, data, tmp_path / "run",
                                                                    {"factory": str(tmp_path / "silent_env.py") + ":Silent"})))
    assert main(["ppo", str(config)]) != 0
    err = capsys.readouterr().err
    assert "no class of it defines get_reward, and the reward: section names no other source" in err, err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_the_conventions_read_here_are_the_installed_trl_s():
    """What TRLEnvironment mirrors, read back from the installed trl's GRPOTrainer (trl >= 1.16, a dev extra): the tools
    are the class's functions but reset, get_reward and `_` names; reset gets the row without its environment column when
    several are named; reset's string is appended to the last message's content; a tool's result is str(result); the
    environment column chooses. A trl that changes one of these fails here, naming it."""
    trl = pytest.importorskip("trl")
    import inspect

    source = inspect.getsource(trl.GRPOTrainer)
    facts = {
        "tools: public functions of the class": 'if member_name not in ("reset", "get_reward") and not member_name.startswith("_")',
        "tools: read from the class": "inspect.getmembers(type(environment), predicate=inspect.isfunction)",
        "reset's keywords": 'reset_kwargs = {k: v for k, v in x.items() if k != "environment"} if self._multi_environment else x',
        "reset's text appended": 'prompts[i] = prompt[:-1] + [{**prompt[-1], "content": content + observation}]',
        "the environment column": 'self._batch_environments = [x.get("environment") if self._multi_environment else None for x in inputs]',
        "a result's text": "content = result if isinstance(result, list) else str(result)",
        "get_reward: weight 1": "self.reward_weights = torch.cat([self.reward_weights, torch.ones(1)])",
    }
    assert [what for what, line in facts.items() if line not in source] == []


def test_the_report_shows_get_reward_on_the_episode_s_last_turn():
    from ppokit.report.page import _turn_outcome

    assert _turn_outcome({"role": "assistant", "text": "done", "done": True, "final_reward": 2.0}) == (
        " <i>(get_reward +2.00; the environment ended the episode)</i>")
    assert _turn_outcome({"role": "assistant", "text": "4", "final_reward": 0.0}) == " <i>(get_reward +0.00)</i>"


ASYNC_ENV = '''
import asyncio


class Remote:
    def reset(self, **kwargs) -> None:
        self.total = 0

    async def get_reward(self) -> float:
        await asyncio.sleep(0)
        return float(self.total)

    async def add(self, a: int) -> int:
        """Add to the total on a remote service.

        Args:
            a: How much to add.
        """
        await asyncio.sleep(0)
        self.total += a
        return self.total
'''


def test_async_tools_and_get_reward_run_to_their_end_through_the_runner(tmp_path):
    """TRL allows `async def` tools and get_reward: a call waits for the coroutine's result (on the environments' event
    loop), and the episode's final reward is the awaited value, checked like a step's."""
    from ppokit.environments import EnvironmentRunner

    (tmp_path / "remote_env.py").write_text(ASYNC_ENV)
    runner = EnvironmentRunner.from_config("ppokit.environments:TRLEnvironment", {"factory": "remote_env.py:Remote"}, 30,
                                           base_dir=tmp_path)
    assert [s["function"]["name"] for s in runner.tools] == ["add"]
    episode = runner.start({"prompt": "p"}, "p")
    step = episode.step(call("add", a=2) + "\n" + call("add", a=3))
    assert [m["content"] for m in step.messages] == ["2", "5"]
    assert episode.final_reward() == 5.0
