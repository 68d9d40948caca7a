"""What tests/test_gymtext.py and tests/test_openenv.py share: the words game (tests/envs/words_rules.py) trained through
`ppokit ppo` with an environment adapter, and the checks of what it did: the rows with each one's target, the
environments' reset / close log, the run, every sampled episode against the game's rule, every environment closed."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

WAIT_BOUND_S = 60.0  # how long a server may take to start, or a stopped rollout's closes to land, on a loaded machine
LOG_VARIABLE = "PPOKIT_WORDS_LOG"  # where the environments log their resets and closes (envs/words_rules.py)


# The fixtures (a test module takes them as `rows, events = word_game_runs.rows, word_game_runs.events`)


@pytest.fixture
def rows(tmp_path: Path, demo_data) -> Path:
    """8 prompts, each with the seed its episode gets (its target): at least that many words wins (a turn has at most 8)."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": r["prompt"], "seed": 1 + (5 * i) % 16}) + "\n" for i, r in enumerate(demo_data["prompts"][:8])))
    return path


@pytest.fixture
def events(tmp_path: Path, monkeypatch) -> Path:
    """The environments' reset / close log (their instances in this process and a server's), set for this test."""
    path = tmp_path / "events.log"
    monkeypatch.setenv(LOG_VARIABLE, str(path))
    return path


def run_ppo(spec: str, sft_model_dir, rows, tmp_path: Path, environment_args: dict, *overrides) -> int:
    """`ppokit ppo` in this process with the environment `spec`: 2 updates of 4 episodes of up to 3 turns, a sample
    generation -> its exit code."""
    from conftest import tiny_ppo_config

    from ppokit.cli import main

    config = tiny_ppo_config(sft_model_dir, rows, tmp_path / "run", total_episodes=8, per_device_train_batch_size=4,
                             num_sample_generations=1, num_eval_samples=8)
    config.environment = spec
    config.environment_args = environment_args
    config.reward.functions = []
    config.rollout.max_turns = 3
    path = tmp_path / "ppo.yaml"
    config.save(path)
    return main(["ppo", str(path), *overrides])


def one_line_error(code: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("ppokit: error: ")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def check_episodes(run: Path, first: str | None = None):
    """Every sampled episode is the game's rule applied to the model's turns: each turn's reward and done as the game
    gave them, `good` ends it, `bad` is what the model reads after a short turn, at most 3 turns; `first`: reset's
    observation, read after the prompt. Some episodes won, some ran out of turns: both endings were seen."""
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    seeds = {json.loads(line)["prompt"]: json.loads(line)["seed"] for line in (run.parent / "rows.jsonl").read_text().splitlines()}
    assert samples
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
                assert i == len(turns) - 1  # done ends the episode
                ended += 1
            elif i + 1 < len(turns):
                assert turns[i + 1] == {"role": "user", "text": "bad"}
        assert len([t for t in turns if t["role"] == "assistant"]) <= 3
    assert 0 < ended < len(samples)


def check_closed(events: Path, only_reset: bool = False):
    """Each instance that was reset was closed once, after its reset; nothing closed twice. only_reset: every closed
    instance was reset (where instances are made at reset); else instances made and never reset (such as an OpenEnv
    runner's start-up one) are closed too. A stopped rollout closes its episodes on worker threads, not waited for:
    those are given WAIT_BOUND_S."""
    deadline = time.monotonic() + WAIT_BOUND_S
    while True:
        lines = events.read_text().split("\n")[:-1]
        resets = [line.split()[1] for line in lines if line.startswith("reset ")]
        closes = [line.split()[1] for line in lines if line.startswith("close ")]
        if set(resets) <= set(closes) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert resets and len(set(resets)) == len(resets)
    assert sorted(set(closes)) == sorted(closes)  # none twice
    assert set(resets) <= set(closes), f"{len(set(resets) - set(closes))} of {len(resets)} sessions not closed"
    if only_reset:
        assert set(closes) == set(resets)
    for instance in resets:
        assert lines.index(f"reset {instance}") < lines.index(f"close {instance}")


def check_trained(code: int, capsys, run: Path, events: Path, first: str | None = None, only_reset: bool = False) -> str:
    """A run that trained: exit 0 with no traceback, its episodes the game's (`check_episodes`), every environment
    closed (`check_closed`) -> what it wrote on stderr."""
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err, err
    check_episodes(run, first)
    check_closed(events, only_reset)
    return err
