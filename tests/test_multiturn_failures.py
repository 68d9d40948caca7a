"""An environment's or a tool's own failures that are not ordinary exceptions (KeyboardInterrupt, other
BaseExceptions) and a reset observation that leaves the model no room: each is one line naming the
environment, through the runner, the loop and a real run of the CLI."""

from __future__ import annotations

import signal

import pytest

from ppokit.environments import EnvironmentFailure, EnvironmentRunner, load_environment
from ppokit.environments.tools import ToolCall, load_tools, run_tool
from ppokit.errors import TrainingInterrupted

ENVS = '''
class Halt(BaseException):
    """Not an Exception: what a library's own stop signal may look like."""

class Interrupts:
    def reset(self, row):
        return None
    def step(self, completion):
        raise KeyboardInterrupt

class Halts:
    def reset(self, row):
        return None
    def step(self, completion):
        raise Halt("the game engine stopped")

class HaltsAtReset:
    def reset(self, row):
        raise Halt()
    def step(self, completion):
        return None, 0.0, True

class StopsTheRun:
    """Raises ppokit's own stop, as its signal handler does when a second Ctrl-C arrives while this code runs."""
    def reset(self, row):
        return None
    def step(self, completion):
        from ppokit.errors import TrainingInterrupted
        raise TrainingInterrupted(2, 0, None, abandoned=True)

class LongWelcome:
    """reset's observation: `welcome` words (a data column), then one step and done."""
    def reset(self, row):
        return " ".join(["good"] * int(row.get("welcome", 3)))
    def step(self, completion):
        return None, 1.0, True
'''

TOOLS = '''
def interrupts(x: int) -> int:
    """Raises KeyboardInterrupt.

    Args:
        x: anything
    """
    raise KeyboardInterrupt
'''


def caught(call):
    """call(); an exception escaping it (a KeyboardInterrupt would end the whole test run) fails this test instead."""
    try:
        return call()
    except BaseException as e:  # noqa: B036
        pytest.fail(f"{type(e).__name__} escaped: {e}")


@pytest.fixture
def spec(tmp_path):
    path = tmp_path / "envs.py"
    path.write_text(ENVS)
    return lambda name: f"{path}:{name}"


@pytest.mark.parametrize("timeout_s", [5.0, None], ids=["worker_thread", "callers_thread"])
@pytest.mark.parametrize("name, said", [("Interrupts", "step raised KeyboardInterrupt; prompt 'p'"),
                                        ("Halts", "step raised Halt: the game engine stopped; prompt 'p'")])
def test_an_environment_raising_a_base_exception_fails_its_episode_in_one_line(spec, name, said, timeout_s, monkeypatch):
    """Under a run SIGINT has ppokit's handler, so a KeyboardInterrupt inside environment code is the code's own."""
    monkeypatch.setattr(signal, "getsignal", lambda sig: signal.SIG_IGN)  # as under StopSignals: SIGINT raises nothing
    runner = EnvironmentRunner.from_config(spec(name), {}, timeout_s)
    [outcome] = caught(lambda: runner.step_many(runner.start_many([{}], ["p"]), ["x"]))
    assert isinstance(outcome, EnvironmentFailure)
    assert str(outcome) == f"environment {spec(name)}: {said}"


def test_a_base_exception_at_reset_fails_the_episode(spec):
    runner = EnvironmentRunner.from_config(spec("HaltsAtReset"), {}, 5.0)
    [outcome] = caught(lambda: runner.start_many([{}], ["p"]))
    assert isinstance(outcome, EnvironmentFailure) and str(outcome) == f"environment {spec('HaltsAtReset')}: reset raised Halt; prompt 'p'"


@pytest.fixture
def default_sigint():
    """Python's own SIGINT handler for the test (a background job starts with SIGINT ignored), restored after."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_real_stop_request_in_the_callers_thread_passes_through(spec, default_sigint):
    """Without a deadline the environment runs in the main thread: there a KeyboardInterrupt under Python's own SIGINT
    handler may be the user's Ctrl-C, and ppokit's second-signal stop is always the run's; neither is the episode's."""
    runner = EnvironmentRunner.from_config(spec("Interrupts"), {}, None)
    with pytest.raises(KeyboardInterrupt):
        runner.step_many(runner.start_many([{}], ["p"]), ["x"])
    runner = EnvironmentRunner.from_config(spec("StopsTheRun"), {}, None)
    with pytest.raises(TrainingInterrupted):
        runner.step_many(runner.start_many([{}], ["p"]), ["x"])


@pytest.mark.parametrize("timeout_s", [5.0, None])
def test_a_tool_raising_keyboard_interrupt_is_the_tools_error_text(tmp_path, timeout_s, monkeypatch):
    monkeypatch.setattr(signal, "getsignal", lambda sig: signal.SIG_IGN)
    path = tmp_path / "tools.py"
    path.write_text(TOOLS)
    tools = load_tools([f"{path}:interrupts"])
    assert caught(lambda: run_tool(tools, ToolCall("interrupts", {"x": 1}), timeout_s)) == "error: interrupts raised KeyboardInterrupt"


# --------------------------------------------------------------------------- through a run


def _run(model_dir, prompts_file, tmp_path, environment, *overrides):
    """`ppokit ppo` in-process on the tiny model with `environment`: (exit code, stderr)."""
    from conftest import tiny_ppo_config

    from ppokit.cli import main

    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run", total_episodes=16, num_sample_generations=0)
    config.environment = environment
    config.reward.functions = []
    path = tmp_path / "ppo.yaml"
    config.save(path)
    return main(["ppo", str(path), *overrides])


def test_keyboard_interrupt_inside_step_stops_the_run_in_one_line_naming_the_environment(model_dir, prompts_file, tmp_path, spec, capsys):
    code = _run(model_dir, prompts_file, tmp_path, spec("Interrupts"))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("ppokit: error")]
    assert code == 2, err
    assert lines and lines[0].startswith(f"ppokit: error: environment {spec('Interrupts')}: step raised KeyboardInterrupt; prompt ")
    assert "interrupted" not in err and "Traceback" not in err


def test_an_environment_base_exception_is_one_line_not_a_traceback(model_dir, prompts_file, tmp_path, spec, capsys):
    code = _run(model_dir, prompts_file, tmp_path, spec("Halts"))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"ppokit: error: environment {spec('Halts')}: step raised Halt: the game engine stopped; prompt " in err


def test_a_reset_observation_that_fills_the_budget_is_refused_not_trained_as_nothing(model_dir, prompts_file, tmp_path, spec, capsys):
    """rollout.max_episode_tokens 24 and a 30-word welcome: no room for a model turn. The run stops with one line
    (reward.on_error: raise) instead of finishing with rc 0 having trained on no token."""
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(f'{{"prompt": "the movie was", "welcome": {30 if i % 2 else 3}}}\n' for i in range(16)))
    code = _run(model_dir, jsonl, tmp_path, spec("LongWelcome"), "rollout.max_turns=3", "rollout.max_episode_tokens=24")
    err = capsys.readouterr().err
    assert code == 2, err
    assert (f"environment {spec('LongWelcome')}: reset's observation fills the episode's whole budget "
            "(rollout.max_episode_tokens: 24 tokens after the prompt) and leaves no room for a model turn; shorten the "
            "observation or raise rollout.max_episode_tokens; prompt 'the movie was'") in err
    assert not (tmp_path / "run" / "final").exists()


def test_with_on_error_skip_only_the_episodes_without_room_leave_the_update(model_dir, prompts_file, tmp_path, spec, capsys):
    import json

    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(f'{{"prompt": "the movie was", "welcome": {30 if i % 2 else 3}}}\n' for i in range(16)))
    code = _run(model_dir, jsonl, tmp_path, spec("LongWelcome"), "rollout.max_turns=3", "rollout.max_episode_tokens=24",
                "reward.on_error=skip")
    err = capsys.readouterr().err
    assert code == 0, err
    assert "reset's observation fills the episode's whole budget" in err  # the skip warning names why
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # 16 rows, each once over the 2 updates of 8 episodes: the 8 rows with the long welcome are the ones skipped
    assert len(records) == 2 and sum(r["reward/skipped"] for r in records) == 8 and all(r["reward/skipped"] < 8 for r in records)
    assert all(r["rollout/model_tokens"] > 0 for r in records)


def test_the_loop_fails_only_the_episode_whose_reset_fills_the_budget(spec):
    """The loop itself: the other episodes run their turns."""
    import torch

    from test_multiturn import ScriptedEngine, ids, sampling

    from ppokit.environments.episode_loop import EpisodeLoop
    from ppokit.demos.tiny import word_tokenizer

    tok = word_tokenizer(["good the movie was 7"])
    eos, seven = tok.eos_token_id, ids(tok, "7")[0]
    runner = EnvironmentRunner(spec("LongWelcome"), load_environment(spec("LongWelcome")), {}, timeout_s=None)
    loop = EpisodeLoop(ScriptedEngine([seven, eos], tok.pad_token_id, eos), tok, runner, max_turns=2, max_episode_tokens=6,
                       pad_token_id=tok.pad_token_id)
    rows = [{"prompt": "a", "welcome": 6}, {"prompt": "b", "welcome": 2}, {"prompt": "c", "welcome": 9},
            {"prompt": "d", "welcome": 700_000}]  # 3.5 million characters: cut to the room before it is tokenised
    episodes = loop.sample([ids(tok, "the movie was")] * 4, rows, sampling(tok))
    errors, rewards = episodes.environment_errors, episodes.environment_rewards
    assert errors[0].startswith(f"environment {spec('LongWelcome')}: reset's observation fills the episode's whole budget")
    assert errors[0].endswith("; prompt 'a'") and errors[1] is None
    assert "reset's observation fills" in errors[2] and errors[2].endswith("; prompt 'c'")
    assert "reset's observation fills" in errors[3] and errors[3].endswith("; prompt 'd'")
    assert episodes.model_tokens.tolist() == [0, 2, 0, 0] and torch.isnan(rewards[[0, 2, 3]]).all() and rewards[1] == 1.0
    assert episodes.loss_mask[1].sum() == 2
