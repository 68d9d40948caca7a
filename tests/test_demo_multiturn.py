"""The multi-turn demos learn: the guessing game (`ppokit demo --quick --environment guess`) and the calculator tool
(`--environment calculator`), each shortened; a demo stopped by Ctrl-C says how to continue and continues with --resume.
(A file of its own, so that the suite's two workers share the demos: tests/test_demo.py has the movie-review demo.)"""

import json
from pathlib import Path

import pytest


# The quick guess demo's SFT, 32 PPO updates instead of 48. With 16 (means of 2 updates, 128 games) the turns' fall
# was within the noise of one update's figure (+-0.2): 3.86 -> 3.48 on one CPU, 3.77 -> 3.63 on another (AVX-512).
SHORT_GAME = dict(total_episodes=2048)


def test_the_guess_demo_learns_to_bisect_and_its_report_shows_the_games(tmp_path, monkeypatch, capsys):
    """`ppokit demo --quick --environment guess`, shortened: the share of games won rises and the turns fall (towards
    bisection's 100% and 3.375), the console says what the reward is in whole, and the report has the episode curves and
    the games turn by turn from before training, the winning turn marked."""
    from ppokit.demos import guess as demo_game
    from ppokit.report import make_report

    monkeypatch.setitem(demo_game.SETTINGS, True, {**demo_game.SETTINGS[True], **SHORT_GAME})
    summary = demo_game.run_game_demo(tmp_path / "games", quick=True)
    print(json.dumps(summary))  # pytest -s: the figures
    err = capsys.readouterr().err
    assert "32 updates of 64 games, up to 5 turns each; reward: 1 for a win, less 0.02 per guess\n" in err
    assert summary["updates"] == 32 and summary["estimator"] == "gae"
    # measured (seeds 0, 1, 2; means of 5 updates): won 78/73/80% -> 97/97/98%, turns 3.78/3.93/3.81 -> 3.40/3.52/3.37;
    # a mean of 5 updates varies by about 0.08, and other CPUs' runs drift apart, hence the margins
    assert summary["success_end"] > summary["success_start"] + 0.1 and summary["success_end"] > 0.85, summary
    assert summary["turns_end"] < summary["turns_start"] - 0.15, summary
    report = make_report([tmp_path / "games" / "ppo"], tmp_path / "report.html")
    assert "episodes" in {Path(p).stem for p in report["figures"]}
    page = (tmp_path / "report.html").read_text()
    assert "(update 0: before training)" in page and "the environment ended the episode" in page
    assert "<td>environment ppokit.environments:GuessNumber</td>" in page


def test_a_demo_stopped_by_ctrl_c_says_how_to_continue_and_continues_with_resume(tmp_path, monkeypatch, capsys):
    """Ctrl-C during the first update: the demo stops after it with its checkpoint and prints the command that
    continues it; that command without --resume says the same; with it the demo runs to its end."""
    import os
    import signal

    from ppokit.demos import guess as demo_game
    from ppokit.cli import main
    from ppokit.environments.guess import GuessNumber
    from ppokit.trainer import PPOTrainer

    monkeypatch.setitem(demo_game.SETTINGS, True, {**demo_game.SETTINGS[True], "n_games": 500, "sft_epochs": 1, "total_episodes": 256})
    real_before, real_step, armed = PPOTrainer.samples_before_training, GuessNumber.step, []

    def before(self):  # training starts after the samples of update 0: from then on, the first game's step presses Ctrl-C
        rows = real_before(self)
        armed.append("on")
        return rows

    def step(self, completion):
        if armed == ["on"]:
            armed.append("sent")
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(self, completion)

    monkeypatch.setattr(PPOTrainer, "samples_before_training", before)
    monkeypatch.setattr(GuessNumber, "step", step)
    out = tmp_path / "games"
    command = ["demo", "--quick", "--environment", "guess", "--output", str(out)]
    assert main(command) == 130
    err = capsys.readouterr().err
    again = f"ppokit demo --quick --environment guess --output {out} --resume"
    assert f"SIGINT: stopped after update 1; checkpoint written to {out / 'ppo' / 'checkpoints' / 'update-1'}" in err
    assert err.rstrip().endswith(f"ppokit: continue the demo with: {again}"), err
    assert main(command) == 2
    assert f"holds an unfinished run (checkpoint update-1 of 4 updates) from an earlier demo; continue it with `{again}`" in capsys.readouterr().err
    assert main(command + ["--resume"]) == 0
    result = capsys.readouterr()
    summary = json.loads(result.out.splitlines()[-1])
    assert summary["updates"] == 4 and f"resumed from {out / 'ppo' / 'checkpoints' / 'update-1'} (update 1 of 4)" in result.err
    assert [json.loads(line)["update"] for line in (out / "ppo" / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


SHORT_CALCULATOR = dict(total_episodes=512)  # the quick calculator demo's SFT, 16 PPO updates


def test_the_calculator_demo_learns_to_call_its_tool(tmp_path, monkeypatch):
    """`ppokit demo --quick --environment calculator`, shortened: the share of right answers and of episodes with a
    valid calculator call rise; the calls the model writes are Hermes calls the parser reads (valid ones ran)."""
    from ppokit.demos import calculator as demo_calculator

    monkeypatch.setitem(demo_calculator.SETTINGS, True, {**demo_calculator.SETTINGS[True], **SHORT_CALCULATOR})
    summary = demo_calculator.run_calculator_demo(tmp_path / "calc", quick=True, show_progress=False)
    print(json.dumps(summary))  # pytest -s: the figures
    assert summary["updates"] == 16
    assert summary["accuracy_end"] > summary["accuracy_start"] + 0.2, summary
    assert summary["valid_calls_end"] > summary["valid_calls_start"] + 0.2, summary
    samples = [json.loads(line) for line in (tmp_path / "calc" / "ppo" / "samples.jsonl").read_text().splitlines()]
    last = [s for s in samples if s["update"] == summary["updates"]]
    ran = [s for s in last if any(t["role"] == "tool" and not t["text"].startswith("error") for t in s["turns"])]
    assert len(ran) >= len(last) // 2, last  # the tool answered most of the last generation's calls


def test_the_calculator_demo_as_an_openai_agent_program_learns_too(tmp_path, monkeypatch):
    """`ppokit demo --quick --environment calculator-agent`, shortened as above: the same task with its episodes made by an
    `openai` tool loop against ppokit's endpoint (`ppokit.demos.calculator:solve`); the right answers (the agent's own
    reward) and the episodes with a call that ran rise, and every call continued its episode (nothing re-tokenised)."""
    pytest.importorskip("openai")
    from ppokit.demos import calculator as demo_calculator

    monkeypatch.setitem(demo_calculator.SETTINGS, True, {**demo_calculator.SETTINGS[True], **SHORT_CALCULATOR})
    summary = demo_calculator.run_calculator_agent_demo(tmp_path / "calc", quick=True, show_progress=False)
    print(json.dumps(summary))  # pytest -s: the figures
    assert summary["updates"] == 16 and summary["environment"] == "calculator-agent"
    assert summary["accuracy_end"] > summary["accuracy_start"] + 0.2, summary
    assert summary["valid_calls_end"] > summary["valid_calls_start"] + 0.2, summary
    records = [json.loads(line) for line in (tmp_path / "calc" / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["agent/retokenized_share"] == 0.0 and r["agent/segments"] == 1.0 for r in records if "agent/segments" in r)
