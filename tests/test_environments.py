"""Environments (ppokit.environments): loading by spec, the runner's deadlines and checks, the tool-call
parser and the built-in Tools environment, the demo game. CPU only, no model."""

from __future__ import annotations

import re
import sys
import time

import pytest

from ppokit.config.schema import PPOConfig
from ppokit.environments import (
    BadToolCall,
    EnvironmentFailure,
    EnvironmentRunner,
    EnvironmentTimeout,
    GuessNumber,
    ToolCall,
    Tools,
    guess_rows,
    guess_transcripts,
    load_environment,
    parse_tool_calls,
    run_tool,
)
from ppokit.environments.guess import play, vocabulary
from ppokit.errors import UserError
from ppokit.rewards.sources import RewardError

# A deadline short enough for a fast suite; the bound on the wait allows a machine several times slower.
DEADLINE_S = 0.3
WAIT_BOUND_S = 10.0

ENVS = '''
import threading

RELEASE = threading.Event()  # set by the test to let a hung call return

class Echo:
    def __init__(self, suffix="!"):
        self.suffix = suffix
    def reset(self, row):
        return row["prompt"] + self.suffix
    def step(self, completion):
        return completion.upper(), 0.5, completion == "stop"

class Hangs:
    def reset(self, row):
        return None
    def step(self, completion):
        if completion == "hang":
            RELEASE.wait()
        return None, 1.0, True

class Raises:
    def reset(self, row):
        return None
    def step(self, completion):
        raise KeyError("no such move")

class Returns:
    value = None
    def reset(self, row):
        return None
    def step(self, completion):
        return type(self).value

class NoStep:
    def reset(self, row):
        return None

class BadArgs:
    def __init__(self, level):
        self.level = level
    def reset(self, row):
        return None
    def step(self, completion):
        return None, 0.0, True

not_a_class = 3
'''

TOOLS = '''
import threading

RELEASE = threading.Event()

def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b

def fails(x: str) -> str:
    """Always fails.

    Args:
        x: anything
    """
    raise ValueError("broken tool")

def hangs() -> str:
    """Never returns until released."""
    RELEASE.wait()
    return "late"

def undocumented(x: int):
    return x
'''


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "envs.py"
    path.write_text(ENVS)
    loaded = []
    yield lambda name: (loaded.append(load_environment(f"{path}:{name}")), f"{path}:{name}")[1]
    for cls in loaded:  # let every hung call return, so no thread outlives the test
        sys.modules[cls.__module__].RELEASE.set()


@pytest.fixture
def tools_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(TOOLS)
    yield path
    for module in [m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == str(path)]:
        module.RELEASE.set()


def _runner(spec, args=None, timeout_s=DEADLINE_S, base_dir=None):
    return EnvironmentRunner.from_config(spec, args, timeout_s, base_dir)


# --------------------------------------------------------------------------- loading


@pytest.mark.parametrize(
    "name, message",
    [
        ("Missing", r"^environment '.*envs.py:Missing': .*envs.py has no class Missing$"),
        ("not_a_class", r"^environment '.*envs.py:not_a_class': not_a_class is not a class \(its type is int\)"),
        ("NoStep", r"^environment '.*envs.py:NoStep': class NoStep has no step method"),
    ],
)
def test_a_spec_that_is_not_an_environment_is_one_line_naming_it(tmp_path, name, message):
    (tmp_path / "envs.py").write_text(ENVS)
    with pytest.raises(UserError, match=message) as caught:
        load_environment(f"envs.py:{name}", tmp_path)  # relative to the config's folder
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nowhere.py:Env", r"^environment 'nowhere.py:Env': file nowhere.py not found$"),
        ("no_such_module_x:Env", r"^environment 'no_such_module_x:Env': cannot import module no_such_module_x"),
        ("Env", r"^environment 'Env': expected 'path/to/env.py:ClassName' or 'package.module:ClassName'"),
        ("ppokit.environments:Nope", r"^environment 'ppokit.environments:Nope': ppokit.environments has no class Nope$"),
    ],
)
def test_a_spec_that_does_not_import_is_one_line_naming_it(tmp_path, spec, message):
    with pytest.raises(UserError, match=message) as caught:
        load_environment(spec, tmp_path)
    assert "\n" not in str(caught.value)


def test_a_module_that_fails_as_it_is_imported_names_the_spec(tmp_path):
    (tmp_path / "broken.py").write_text("raise RuntimeError('no GPU here')\n")
    with pytest.raises(UserError, match=r"^environment 'broken.py:Env': importing .*broken.py raised RuntimeError: no GPU here$"):
        load_environment("broken.py:Env", tmp_path)


def test_an_environment_file_imports_the_module_beside_it(tmp_path):
    """env.py imports the scorer.py next to it (a folder that is neither the working directory nor on sys.path): the
    runner's episodes use it; the folder is on the import path only while the file loads."""
    folder = tmp_path / "task"
    folder.mkdir()
    (folder / "neighbour_scorer_a1.py").write_text("def score(text):\n    return float(len(text))\n")
    (folder / "env.py").write_text(
        "from neighbour_scorer_a1 import score\n"
        "class Scored:\n"
        "    def reset(self, row):\n        return None\n"
        "    def step(self, completion):\n        return None, score(completion), True\n")
    try:
        runner = EnvironmentRunner.from_config("task/env.py:Scored", None, None, base_dir=tmp_path)
        [episode] = runner.start_many([{"prompt": "hi"}], ["hi"])
        assert episode.step("four").reward == 4.0
        assert str(folder) not in sys.path
    finally:
        sys.modules.pop("neighbour_scorer_a1", None)


def test_a_neighbour_named_like_a_module_imported_before_is_refused_naming_it(tmp_path):
    """A json.py beside the file: `import json` gives the standard library's (imported first, one module per name),
    not the one beside it; one line says which and what to rename, rather than a run that uses the other module."""
    (tmp_path / "json.py").write_text("def dumps(value):\n    return 'mine'\n")
    (tmp_path / "env.py").write_text("import json\nclass Env:\n    def reset(self, row): return None\n"
                                      "    def step(self, completion): return None, 0.0, True\n")
    with pytest.raises(UserError, match=r"^environment 'env.py:Env': .*env.py imports json, which is already imported from "
                                        r".*json.*rename .*json$"):
        load_environment("env.py:Env", tmp_path)


def test_wrong_environment_args_fail_at_start_in_one_line(env_file):
    with pytest.raises(UserError, match=r"^environment .*envs.py:BadArgs: constructing it raised TypeError: .*level") as caught:
        _runner(env_file("BadArgs"))
    assert not isinstance(caught.value, RewardError)  # a configuration mistake: never skipped by reward.on_error


def test_builtins_load_by_package_name():
    assert load_environment("ppokit.environments:Tools") is Tools
    assert load_environment("ppokit.environments:GuessNumber") is GuessNumber


# --------------------------------------------------------------------------- the runner


def test_an_episode_runs_reset_and_steps_with_checked_results(env_file):
    runner = _runner(env_file("Echo"), {"suffix": "?"})
    assert runner.observation_role == "user" and runner.tools is None
    [episode] = runner.start_many([{"prompt": "hi", "other": 1}], ["hi"])
    assert episode.first.observation == "hi?" and episode.first.messages == [{"role": "user", "content": "hi?"}]
    [step] = runner.step_many([episode], ["go"])
    assert (step.observation, step.reward, step.done) == ("GO", 0.5, False)
    assert episode.step("stop").done is True


def test_a_hung_step_fails_its_episode_not_the_others(env_file):
    runner = _runner(env_file("Hangs"))
    episodes = runner.start_many([{}, {}, {}], ["p0", "p1", "p2"])
    started = time.monotonic()
    outcomes = runner.step_many(episodes, ["ok", "hang", "ok"])
    assert time.monotonic() - started < WAIT_BOUND_S
    assert [o.reward for o in (outcomes[0], outcomes[2])] == [1.0, 1.0]
    assert isinstance(outcomes[1], EnvironmentTimeout)
    assert isinstance(outcomes[1], RewardError)  # reward.on_error applies
    message = str(outcomes[1])
    assert message.startswith(f"environment {runner.spec}: step did not return within environment_timeout_s=0.3s")
    assert message.endswith("; prompt 'p1'") and "\n" not in message


def test_a_step_that_raises_fails_its_episode_naming_the_prompt(env_file):
    runner = _runner(env_file("Raises"))
    [outcome] = runner.step_many(runner.start_many([{}], ["the prompt"]), ["x"])
    assert isinstance(outcome, EnvironmentFailure)
    assert str(outcome) == f"environment {runner.spec}: step raised KeyError: 'no such move'; prompt 'the prompt'"


def test_without_a_deadline_calls_run_in_the_callers_thread(env_file):
    runner = _runner(env_file("Raises"), timeout_s=None)
    [outcome] = runner.step_many(runner.start_many([{}], ["p"]), ["x"])
    assert isinstance(outcome, EnvironmentFailure) and "KeyError" in str(outcome)


@pytest.mark.parametrize(
    "value, message",
    [
        ((None, "0.5", True), r"step returned the reward '0.5' \(a str\); expected a number; prompt 'p'$"),
        ((None, None, True), r"step returned the reward None \(a NoneType\); expected a number"),
        ((None, float("nan"), True), r"step returned the reward nan; expected a finite number"),
        ((None, 1.0, "yes"), r"step returned done='yes' \(a str\); expected True or False"),
        ((3, 1.0, True), r"step returned the observation 3 \(a int\); expected a str or None"),
        (None, r"step returned None; expected \(observation, reward, done\)"),
        (("a", 1.0), r"step returned \('a', 1.0\); expected \(observation, reward, done\)"),
    ],
)
def test_a_malformed_step_result_is_one_line_naming_the_environment_and_value(env_file, value, message):
    spec = env_file("Returns")
    runner = _runner(spec)
    runner.cls.value = value
    [outcome] = runner.step_many(runner.start_many([{}], ["p"]), ["x"])
    assert isinstance(outcome, EnvironmentFailure)
    assert str(outcome).startswith(f"environment {spec}: ") and "\n" not in str(outcome)
    assert re.search(message, str(outcome)), str(outcome)


def test_numpy_rewards_and_flags_are_numbers(env_file):
    np = pytest.importorskip("numpy")
    runner = _runner(env_file("Returns"))
    runner.cls.value = (None, np.float32(0.25), np.bool_(True))
    [step] = runner.step_many(runner.start_many([{}], ["p"]), ["x"])
    assert (step.reward, step.done) == (0.25, True)


# --------------------------------------------------------------------------- tool calls


def test_the_parser_reads_several_calls_and_names_what_is_malformed():
    turn = (
        'let me see <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>'
        "<tool_call>{name: add}</tool_call>"
        '<tool_call>["add"]</tool_call>'
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {'
    )
    calls = parse_tool_calls(turn)
    assert calls[:2] == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("add", {"a": 3, "b": 4})]
    assert all(isinstance(c, BadToolCall) for c in calls[2:]) and len(calls) == 6
    assert calls[2].error.startswith("error: the tool call is not valid JSON (Expecting property name")
    assert "JSON object" in calls[3].error and "arguments of add" in calls[4].error
    assert calls[5].error == "error: the tool call is not closed with </tool_call>"
    assert parse_tool_calls("no calls here") == []


def test_a_tool_call_runs_or_says_what_went_wrong(tools_file):
    from ppokit.environments.tools import load_tools

    tools = load_tools([f"{tools_file}:add", f"{tools_file}:fails", f"{tools_file}:hangs"])
    assert run_tool(tools, ToolCall("add", {"a": 2, "b": 3}), DEADLINE_S) == "5"
    assert run_tool(tools, ToolCall("fails", {"x": "y"}), DEADLINE_S) == "error: fails raised ValueError: broken tool"
    assert run_tool(tools, ToolCall("nope", {}), DEADLINE_S) == "error: there is no tool 'nope'; the tools are add, fails, hangs"
    assert run_tool(tools, ToolCall("add", {"a": 1}), DEADLINE_S) == "error: add: missing a required argument: 'b'"
    started = time.monotonic()
    assert run_tool(tools, ToolCall("hangs", {}), DEADLINE_S) == "error: hangs did not return within 0.3s"
    assert time.monotonic() - started < WAIT_BOUND_S


def test_the_tools_environment_answers_each_call_with_a_tool_message(tools_file):
    runner = _runner("ppokit.environments:Tools", {"tools": ["my_tools.py:add", "my_tools.py:fails", "my_tools.py:hangs"],
                                                   "timeout_s": DEADLINE_S}, timeout_s=WAIT_BOUND_S, base_dir=tools_file.parent)
    assert runner.observation_role == "tool"
    assert [t["function"]["name"] for t in runner.tools] == ["add", "fails", "hangs"]
    assert runner.tools[0]["function"]["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first"}
    [episode] = runner.start_many([{"prompt": "p"}], ["p"])
    assert episode.first.observation is None and episode.first.messages == []
    turn = ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
            '<tool_call>{"name": "fails", "arguments": {"x": "1"}}</tool_call>'
            "<tool_call>{oops}</tool_call>"
            '<tool_call>{"name": "hangs", "arguments": {}}</tool_call>')
    [step] = runner.step_many([episode], [turn])
    assert (step.reward, step.done) == (0.0, False)
    assert [(m["role"], m["name"]) for m in step.messages] == [("tool", "add"), ("tool", "fails"), ("tool", "?"), ("tool", "hangs")]
    contents = [m["content"] for m in step.messages]
    assert contents[0] == "3" and contents[1] == "error: fails raised ValueError: broken tool"
    assert contents[2].startswith("error: the tool call is not valid JSON") and contents[3] == "error: hangs did not return within 0.3s"
    assert step.observation.startswith("<tool_response>\n3\n</tool_response>\n<tool_response>\nerror: fails")
    [last] = runner.step_many([episode], ["the answer is 3"])
    assert (last.observation, last.messages, last.done) == (None, [], True)


def test_the_tools_schemas_render_through_a_chat_template(tools_file, tokenizer):
    runner = _runner("ppokit.environments:Tools", {"tools": [f"{tools_file}:add"]})
    template = ("{% for t in tools %}TOOL {{ t.function.name }}: {{ t.function.description }}\n{% endfor %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "tool", "content": "3"}],
                                         tools=runner.tools, chat_template=template, tokenize=False)
    assert text == "TOOL add: Add two integers.\nuser: hi\ntool: 3\n"


@pytest.mark.parametrize(
    "tools, message",
    [
        (None, r"environment_args.tools: required by ppokit.environments:Tools"),
        ("my_tools.py:add", r"environment_args.tools: expected a list of tools"),
        (["missing.py:add"], r"environment_args.tools: tool 'missing.py:add': file missing.py not found$"),
        (["my_tools.py:nope"], r"environment_args.tools: tool 'my_tools.py:nope': my_tools.py has no function nope$"),
        (["my_tools.py:add", "my_tools.py:add"], r"two tools are named add"),
        (["my_tools.py:undocumented"], r"tool undocumented: its schema for the chat template cannot be made: .*docstring"),
    ],
)
def test_a_tools_list_that_does_not_load_stops_at_start_in_one_line(tools_file, tools, message):
    args = {} if tools is None else {"tools": tools}
    with pytest.raises(UserError, match=message) as caught:
        _runner("ppokit.environments:Tools", args, base_dir=tools_file.parent)
    assert "\n" not in str(caught.value) and not isinstance(caught.value, RewardError)


# --------------------------------------------------------------------------- the demo game


def test_guess_number_answers_higher_lower_correct():
    game = GuessNumber()
    assert game.reset({"prompt": "guess a number from 1 to 16 .", "target": 11}) is None
    assert game.step("8") == ("higher", 0.0, False)
    assert game.step("13 maybe") == ("lower", 0.0, False)
    assert game.step("no idea") == ("number", 0.0, False)
    assert game.step("17") == ("number", 0.0, False)
    assert game.step("11") == ("correct", 1.0, True)


def test_guess_number_charges_guess_cost_for_every_turn():
    game = GuessNumber(guess_cost=0.25)
    game.reset({"prompt": "guess a number from 1 to 16 .", "target": 11})
    assert [game.step(turn) for turn in ("8", "no idea", "11")] == [("higher", -0.25, False), ("number", -0.25, False), ("correct", 0.75, True)]
    for bad in (-0.1, True, "0.1", float("inf"), float("nan")):
        with pytest.raises(UserError, match=r"^environment_args.guess_cost: GuessNumber needs a finite number >= 0, got "):
            GuessNumber(guess_cost=bad)


def test_the_guess_demos_reward_is_what_it_says_1_for_a_win_less_its_cost_per_guess(tmp_path):
    """The demo prints "reward: 1 for a win, less 0.02 per guess": its config scores a game won at the fourth guess
    (a guess and the turn's end are 2 tokens each) 1 - 4 x 0.02, whatever the turns' tokens (it scored 0.86 once: 0.02
    per token)."""
    from ppokit.demos import guess as demo_game
    from ppokit.demos.reviews import estimator_settings
    from ppokit.rewards.environment import EnvironmentReward
    from ppokit.rewards import ScoringBatch, build_scorer

    config = demo_game.game_config(tmp_path, tmp_path, True, 0, estimator_settings("gae"))
    cost = demo_game.SETTINGS[True]["guess_cost"]
    assert cost == 0.02
    game = GuessNumber(**config.environment_args)
    game.reset({"prompt": "guess a number from 1 to 16 .", "target": 11})
    steps = [game.step(guess) for guess in ("8", "12", "10", "11")]
    assert [done for _, _, done in steps] == [False, False, False, True]
    scorer = build_scorer(config.reward, missing_eos_penalty=config.ppo.missing_eos_penalty, environment=EnvironmentReward())
    batch = ScoringBatch(["guess a number from 1 to 16 ."], ["8 higher 12 lower 10 higher 11"], completion_ids=[[5, 2] * 3 + [7]],
                         environment_rewards=[sum(reward for _, reward, _ in steps)], environment_errors=[None])
    assert scorer.score(batch).scores.tolist() == [pytest.approx(1 - 4 * cost, abs=1e-6)]  # float32 of 0.92


def test_guess_number_refuses_a_row_without_a_target():
    runner = _runner("ppokit.environments:GuessNumber")
    [out_of_range] = runner.start_many([{"prompt": "p", "target": 40}], ["q"])
    assert isinstance(out_of_range, EnvironmentFailure) and "not an integer in [1, 16]; prompt 'q'" in str(out_of_range)
    with pytest.raises(UserError, match=r"^GuessNumber: the data has no column 'target' \(the number to guess\); columns: prompt$"):
        runner.start_many([{"prompt": "p"}], ["p"])  # the data's mistake, not the episode's: the run stops


def test_guess_transcripts_are_consistent_games_in_the_games_words():
    rows = guess_transcripts(seed=0, n=200)
    words = set(vocabulary())
    for row in rows:
        game = GuessNumber()
        game.reset(row)
        for guess, word in row["turns"]:
            assert game.step(guess)[0] == word and set(guess.split()) <= words
        assert row["turns"][-1][1] == "correct" and set(row["prompt"].split()) <= words
        assert [m["content"] for m in row["messages"] if m["role"] == "assistant"] == [g for g, _ in row["turns"]]
    bisect = [len(play(t, None, strategy="bisect")) for t in range(1, 17)]
    assert max(bisect) <= 5
    assert sum(len(r["turns"]) for r in rows) / len(rows) > sum(bisect) / len(bisect)  # room for PPO to learn
    assert guess_rows(1, 5) == guess_rows(1, 5) and len({r["target"] for r in guess_rows(1, 100)}) == 16


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.max_turns=0"], r"rollout.max_turns: value 0 is out of range, it must be > 0"),
        (["rollout.max_turns=2"], r"rollout.max_turns \(2\): a second turn needs an environment"),
        (["rollout.turn_rewards=true"], r"rollout.turn_rewards \(True\) is for multi-turn episodes, and `environment` is not set"),
        (["environment_args={tools: [a.py:f]}"], r"environment_args .* is for multi-turn episodes"),
        (["environment=just_a_name"], r"environment: value 'just_a_name' is out of range, it must be 'path/to/env.py:ClassName'"),
    ],
)
def test_episode_keys_are_checked(overrides, message):
    with pytest.raises(UserError, match=message):
        PPOConfig.load(None, ["model=m", "reward.functions=[exact_match]", *overrides]).validate()


def test_an_environment_is_a_reward_source_of_its_own():
    config = PPOConfig.load(None, ["model=m", "environment=ppokit.environments:GuessNumber", "rollout.max_turns=6"]).validate()
    assert config.rollout.max_turns == 6 and config.environment_timeout_s == 60.0
    with pytest.raises(UserError, match="reward.weights has 1 entries for 2 reward sources"):
        PPOConfig.load(None, ["model=m", "reward.functions=[exact_match]", "reward.weights=[1]",
                              "environment=ppokit.environments:GuessNumber"]).validate()


# The Python execution tool and its sandbox: tests/test_sandbox.py.
