"""`ppokit.environments:GymText` against the installed skyrl-gym (a BaseTextEnv subclass, tests/envs/gym_words.py) and
GEM's interface (a GEM-style class; a real GEM game where gem-llm imports), each training through `ppokit ppo`: every
turn's reward and done as the environment gave them, the observations the model read, each episode's environment
closed once; bad input in one line."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("skyrl_gym", reason="needs ppokit[gym]")

WORDS = Path(__file__).parent / "envs" / "gym_words.py"
SPEC = "ppokit.environments:GymText"
WAIT_BOUND_S = 60.0


@pytest.fixture
def rows(tmp_path, demo_data):
    """8 prompts, each with its target: at least that many words wins (a turn has at most 8)."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": r["prompt"], "seed": 1 + (5 * i) % 16}) + "\n" for i, r in enumerate(demo_data["prompts"][:8])))
    return path


@pytest.fixture
def events(tmp_path, monkeypatch):
    path = tmp_path / "events.log"
    monkeypatch.setenv("PPOKIT_GYM_LOG", str(path))
    return path


def ppo(sft_model_dir, rows, tmp_path, environment_args, *overrides):
    from conftest import tiny_ppo_config

    from ppokit.cli import main

    config = tiny_ppo_config(sft_model_dir, rows, tmp_path / "run", total_episodes=8, per_device_train_batch_size=4,
                             num_sample_generations=1, num_eval_samples=8)
    config.environment = SPEC
    config.environment_args = environment_args
    config.reward.functions = []
    config.rollout.max_turns = 3
    path = tmp_path / "ppo.yaml"
    config.save(path)
    return main(["ppo", str(path), *overrides])


def check_episodes(run: Path, first: str | None = None):
    """Each turn's reward and done are the game's rule on the model's text; `bad` is what the model reads after a short
    turn; `first`: reset's observation, read after the prompt."""
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    seeds = {json.loads(line)["prompt"]: json.loads(line)["seed"] for line in (run.parent / "rows.jsonl").read_text().splitlines()}
    ended = 0
    for sample in samples:
        turns, target = sample["turns"], seeds[sample["prompt"]]
        if first is not None:
            assert turns[0] == {"role": "user", "text": first}
            turns = turns[1:]
        for i, turn in enumerate(turns):
            if turn["role"] != "assistant":
                continue
            words = len(turn["text"].split())
            won = words >= target
            assert turn["reward"] == pytest.approx(1.0 if won else words / 10), turn
            assert turn.get("done", False) == won, turn
            if won:
                assert i == len(turns) - 1
                ended += 1
            elif i + 1 < len(turns):
                assert turns[i + 1] == {"role": "user", "text": "bad"}
    assert samples and 0 < ended < len(samples)


def check_closed(events: Path):
    """Each environment that was reset was closed once, after its reset."""
    deadline = time.monotonic() + WAIT_BOUND_S
    while True:
        lines = events.read_text().split("\n")[:-1]
        resets = [line.split()[1] for line in lines if line.startswith("reset ")]
        closes = [line.split()[1] for line in lines if line.startswith("close ")]
        if set(resets) <= set(closes) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert resets and sorted(resets) == sorted(closes)  # each once; none made without its reset (they are made there)
    for instance in resets:
        assert lines.index(f"reset {instance}") < lines.index(f"close {instance}")


def test_a_skyrl_gym_environment_trains_through_ppokit_ppo(sft_model_dir, rows, tmp_path, events, capsys):
    code = ppo(sft_model_dir, rows, tmp_path, {"env": f"{WORDS}:WordsTextEnv", "env_config": {"max_turns": 3}, "extras": {"max_turns": 3}})
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err, err
    check_episodes(tmp_path / "run")
    check_closed(events)


def test_a_gem_style_environment_trains_through_ppokit_ppo(sft_model_dir, rows, tmp_path, events, capsys):
    code = ppo(sft_model_dir, rows, tmp_path, {"env": f"{WORDS}:WordsGemEnv"})
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err, err
    check_episodes(tmp_path / "run", first="the movie")
    check_closed(events)


def test_a_real_gem_game_runs_through_ppokit_ppo(sft_model_dir, rows, tmp_path, capsys):
    """GEM's own GuessTheNumber by its id, where gem-llm imports (it is not in the dev extras: gem-llm 0.1.0 pins
    reasoning-gym 0.1.23)."""
    pytest.importorskip("gem", reason="gem-llm is not installed")
    code = ppo(sft_model_dir, rows, tmp_path, {"env": "game:GuessTheNumber-v0-easy"}, "rollout.max_episode_tokens=200")
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err, err
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert all(s["turns"][0]["role"] == "user" and "Guess The Number" in s["turns"][0].get("original", s["turns"][0]["text"])
               for s in samples)
    assert all(t["role"] != "assistant" or "reward" in t for s in samples for t in s["turns"])


def one_line_error(code: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("ppokit: error: ")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("args, said", [
    ({}, "environment_args.env is required"),
    ({"env": "gsm8kk"}, "'gsm8kk' is not a class nor an id of"),
    ({"env": f"{WORDS}:log"}, "log is not a class"),
    ({"env": f"{WORDS}:WordsGemEnv", "env_config": {"a": 1}}, "environment_args.env_config and .extras are SkyRL-gym's"),
], ids=["nothing_named", "unknown_id", "not_a_class", "env_config_for_gem"])
def test_bad_input_is_one_line_at_the_start_and_leaves_no_run_folder(sft_model_dir, rows, tmp_path, args, said, capsys):
    line = one_line_error(ppo(sft_model_dir, rows, tmp_path, args), capsys.readouterr().err)
    assert said in line
    assert not (tmp_path / "run").exists()


def test_the_unknown_id_names_the_close_ones(sft_model_dir, rows, tmp_path, capsys):
    line = one_line_error(ppo(sft_model_dir, rows, tmp_path, {"env": "gsm8kk"}), capsys.readouterr().err)
    assert "close: gsm8k" in line


class NotInstalled:
    """A meta path finder for which `package` is not installed, as on a machine without it."""

    def __init__(self, package: str):
        self.package = package

    def find_spec(self, name, path=None, target=None):
        if name == self.package or name.startswith(self.package + "."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def test_skyrl_gym_missing_names_the_extra(sft_model_dir, rows, tmp_path, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "skyrl_gym" or m.startswith("skyrl_gym.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [NotInstalled("skyrl_gym"), *sys.meta_path])
    line = one_line_error(ppo(sft_model_dir, rows, tmp_path, {"env": f"{WORDS}:WordsTextEnv"}), capsys.readouterr().err)
    assert "No module named 'skyrl_gym'" in line and line.endswith("pip install 'ppokit[gym]'")
    assert not (tmp_path / "run").exists()
