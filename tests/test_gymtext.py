"""`ppokit.environments:GymText` against the installed skyrl-gym (a BaseTextEnv subclass, tests/envs/gym_words.py) and
GEM's interface (a GEM-style class; a real GEM game where gem-llm imports), each training through `ppokit ppo`: every
turn's reward and done as the environment gave them, the observations the model read, each episode's environment
closed once; bad input in one line."""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import pytest
import word_game_runs
from word_game_runs import check_trained, one_line_error, run_ppo

pytest.importorskip("skyrl_gym", reason="needs ppokit[gym]")

WORDS = Path(__file__).parent / "envs" / "gym_words.py"
SPEC = "ppokit.environments:GymText"
rows, events, ppo = word_game_runs.rows, word_game_runs.events, partial(run_ppo, SPEC)  # the shared fixtures, and the run


def test_a_skyrl_gym_environment_trains_through_ppokit_ppo(sft_model_dir, rows, tmp_path, events, capsys):
    args = {"env": f"{WORDS}:WordsTextEnv", "env_config": {"max_turns": 3}, "extras": {"max_turns": 3}}
    check_trained(ppo(sft_model_dir, rows, tmp_path, args), capsys, tmp_path / "run", events, only_reset=True)


def test_a_gem_style_environment_trains_through_ppokit_ppo(sft_model_dir, rows, tmp_path, events, capsys):
    check_trained(ppo(sft_model_dir, rows, tmp_path, {"env": f"{WORDS}:WordsGemEnv"}), capsys, tmp_path / "run", events, first="the movie", only_reset=True)


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
