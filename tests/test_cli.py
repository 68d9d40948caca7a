"""End-to-end runs of the `ppokit` command in a subprocess, and its handling of user errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml


def ppokit(*args, cwd=None, timeout=900):
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "ppokit", *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def write_config(path, model, prompts, output_dir, **extra):
    config = {
        "model": str(model),
        "output_dir": str(output_dir),
        "reward": {"functions": ["sentiment"]},
        "data": {"train": str(prompts)},
        "ppo": {"total_episodes": 16, "per_device_train_batch_size": 4, "num_mini_batches": 2, "num_ppo_epochs": 1,
                "response_length": 6, "learning_rate": 1e-3, "num_sample_generations": 1},
    }
    config.update(extra)
    path.write_text(yaml.safe_dump(config))
    return path


def test_cli_ppo_smoke_with_overrides(model_dir, prompts_file, tmp_path):
    config = write_config(tmp_path / "ppo.yaml", model_dir("gpt2"), prompts_file, tmp_path / "run")
    result = ppokit("ppo", config, "ppo.kl_coef=0.1", "ppo.kl_estimator=k3", "seed=7")
    assert result.returncode == 0, result.stderr
    run = tmp_path / "run"
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["ppo"]["kl_coef"] == 0.1 and resolved["ppo"]["kl_estimator"] == "k3" and resolved["seed"] == 7
    assert resolved["ppo"]["cliprange"] == 0.2  # defaults filled in
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and metrics[-1]["episode"] == 16
    assert (run / "final" / "model.safetensors").exists() and (run / "final" / "value_model" / "model.safetensors").exists()
    assert json.loads(result.stdout.strip().splitlines()[-1])["updates"] == 2
    assert "\r" not in result.stderr and "\x1b" not in result.stderr, result.stderr  # into a pipe: plain lines, no bar
    assert [line.split(" | ")[0] for line in result.stderr.splitlines() if line.startswith("update ")] == ["update 1/2", "update 2/2"]


def _assert_user_error(result, *fragments):
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr
    # One line says it: not echoed first by the plan (as a warning or a skipped estimate).
    assert result.stderr.count(fragments[0]) == 1, result.stderr


def test_cli_user_errors(model_dir, prompts_file, tmp_path):
    model = model_dir("gpt2")
    config = write_config(tmp_path / "ppo.yaml", model, prompts_file, tmp_path / "run")
    _assert_user_error(ppokit("ppo", config, "ppo.kl_coeff=0.1"), "unknown config key ppo.kl_coeff", "did you mean ppo.kl_coef")
    _assert_user_error(ppokit("ppo", config, "ppo.total_episodes=10"), "total_episodes (10) is not a multiple of the batch size (8")
    _assert_user_error(ppokit("ppo", config, f"model={tmp_path}/no-such-model"), "model: model path", "does not exist")
    _assert_user_error(ppokit("ppo", tmp_path / "missing.yaml"), "config file not found")

    bad_data = tmp_path / "bad.jsonl"
    bad_data.write_text('{"prompt": "the movie was"}\n{"prompt": "oops"\n')
    _assert_user_error(ppokit("ppo", config, f"data.train={bad_data}"), f"{bad_data}:2: not valid JSON")
    no_field = tmp_path / "nofield.jsonl"
    no_field.write_text('{"text": "the movie was"}\n')
    _assert_user_error(ppokit("ppo", config, f"data.train={no_field}"), "cannot tell the data format", "prompt")
    missing_in_row = tmp_path / "missing.jsonl"
    missing_in_row.write_text('{"prompt": "the movie was"}\n{"text": "the film"}\n')
    _assert_user_error(ppokit("ppo", config, f"data.train={missing_in_row}"), f"{missing_in_row}:2: missing field(s) prompt")

    raising = tmp_path / "raising.py"
    raising.write_text("def reward(prompts, completions, **kw):\n    raise RuntimeError('boom')\n")
    _assert_user_error(ppokit("ppo", config, f"reward.functions=[{raising}:reward]"), "reward function reward raised RuntimeError: boom")
    assert not (tmp_path / "run" / "final").exists()  # nothing that looks finished


REFUSALS = {  # what refuses the run, as overrides / flags / environment -> exit status, the error's start
    "config value": (["ppo.cliprange=-1"], {}, 2, "ppo.cliprange"),
    "data": (["data.train=missing.jsonl"], {}, 2, "data file not found: missing.jsonl"),
    "reward source": (["reward.functions=[missing.py:judge]"], {}, 2, "reward function 'missing.py:judge'"),
    "resume without a checkpoint": (["--resume"], {}, 2, "--resume"),
    "launch (WORLD_SIZE, one process seen)": ([], {"WORLD_SIZE": "2", "RANK": "0"}, 2, "launched as 2 processes"),
    "plan": ([], {"plan": True}, 3, "plan: "),
}


@pytest.mark.parametrize("existed", [False, True], ids=["new folder", "empty folder of the user's"])
@pytest.mark.parametrize("case", REFUSALS)
def test_a_refused_run_leaves_output_dir_as_it_found_it(case, existed, model_dir, prompts_file, tmp_path, monkeypatch, capsys):
    """Refusals found after the run folder was locked (data, reward source, launch, plan, resume) once left
    it behind holding `.ppokit` and `.ppokit.lock`: an empty run folder for every failed try."""
    from ppokit.cli import main

    args, env, status, error = REFUSALS[case]
    for name, value in env.items():
        if name == "plan":  # a device of 1 KiB: the tiny model does not fit
            monkeypatch.setattr("ppokit.plan.device_memory", lambda: ("cpu test", 1024))
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    if existed:
        run.mkdir()
    config = write_config(tmp_path / "ppo.yaml", model_dir("llama"), prompts_file, run)
    assert main(["ppo", str(config), *args]) == status
    assert f"ppokit: error: {error}" in capsys.readouterr().err
    assert (sorted(run.iterdir()) == [] if existed else not run.exists())
WANDERER = """
import os, sys

os.chdir({elsewhere!r})  # on import, while the trainer is set up, before the run folder is opened


class Wanderer:
    \"\"\"One turn, rewarded 1. Its reset writes partial lines to stdout (print without a newline, os.write to descriptor 1)
    and changes the working directory (again).\"\"\"
    def reset(self, row):
        print("partial line without newline", end="")
        os.write(1, b"raw partial line")
        os.chdir({elsewhere!r})
        return None

    def step(self, completion):
        return None, 1.0, True
"""


@pytest.fixture(scope="module")
def wandering_run(model_dir, prompts_file, tmp_path_factory):
    """`ppokit ppo` with a relative output_dir (run) and the environment above: -> (the command's result, the folder it
    ran in, the folder the environment moved to)."""
    folder = tmp_path_factory.mktemp("wandering")
    elsewhere = folder / "elsewhere"
    elsewhere.mkdir()
    env = folder / "wanderer.py"
    env.write_text(WANDERER.format(elsewhere=str(elsewhere)))
    config = write_config(folder / "ppo.yaml", model_dir("llama"), prompts_file, "run", environment=f"{env}:Wanderer",
                          reward={"functions": []}, report_to=["tensorboard"])
    settings = yaml.safe_load(config.read_text())
    settings["ppo"].update(save_steps=1, num_sample_generations=0)
    config.write_text(yaml.safe_dump(settings))
    return ppokit("ppo", config, cwd=folder), folder, elsewhere


def test_what_user_code_writes_to_stdout_does_not_reach_the_result_line(wandering_run):
    """An environment writing partial lines to stdout (Python's print and os.write on descriptor 1) once glued them to
    the JSON summary: stdout holds the result alone, and what the environment wrote goes to stderr."""
    result, _, _ = wandering_run
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("\n") == 1 and json.loads(result.stdout)["updates"] == 2, result.stdout
    assert "partial line without newline" in result.stderr and "raw partial line" in result.stderr


def test_an_environment_changing_the_working_directory_does_not_split_the_run(wandering_run):
    """output_dir `run`, relative, and an environment that calls os.chdir (on import and in every episode): config,
    metrics, trackers, checkpoints and final/ all land in the run folder as it was when the run started, nothing where
    the environment went."""
    result, folder, elsewhere = wandering_run
    assert result.returncode == 0, result.stderr[-3000:]
    run = folder / "run"
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert (run / "config.yaml").is_file() and (run / "trackers.json").is_file() and (run / "tensorboard").is_dir()
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["update-1", "update-2"]
    assert (run / "final" / "model.safetensors").is_file()
    assert list(elsewhere.iterdir()) == []


def test_a_chat_template_name_ppokit_does_not_ship_is_refused(model_dir, tmp_path, capsys):
    """`data.chat_template: chatml` once trained every chat prompt as the word "chatml" (rc 0): one line naming the
    key, exit 2, and no run folder left behind."""
    from ppokit.cli import main

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"the movie was {w}"}]}) + "\n"
                             for w in ("good", "bad", "long", "short") * 4))
    config = write_config(tmp_path / "ppo.yaml", model_dir("llama"), chats, tmp_path / "run")
    assert main(["ppo", str(config), "data.chat_template=chatml"]) == 2
    err = capsys.readouterr().err
    assert "ppokit: error: data.chat_template: 'chatml' writes no message's content" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "change, message",
    [
        # values the run crashed on after writing config.yaml and empty jsonl files (NaN probabilities, an overflow)
        (["ppo.temperature=1e-46"], "ppo.temperature: value 1e-46 is out of range, it must be >= 1e-30: logits / temperature is computed in float32"),
        (["ppo.temperature=1e-40"], "ppo.temperature: value 1e-40 is out of range, it must be >= 1e-30: "),
        (["ppo.eval_temperature=1e-40"], "ppo.eval_temperature: value 1e-40 is out of range, it must be 0 (greedy) or >= 1e-30: "),
        (["ppo.cliprange_high=1e300"], "ppo.cliprange_high: value 1e+300 is out of range, it must be in (0, 3.4e38]: "),
        # not a list of reward functions, in the file or as an override (was a traceback-free error only once the models were loading)
        ({"reward": {"functions": 7}}, "reward.functions: expected a string or a mapping, got 7"),
        (["reward.functions=[sentiment, 7]"], "reward.functions[1]: expected a string or a mapping, got 7"),
    ],
)
def test_values_a_run_cannot_use_are_one_line_before_anything_is_written(tmp_path, capsys, change, message):
    from ppokit.cli import main

    extra, overrides = (change, []) if isinstance(change, dict) else ({}, change)
    config = write_config(tmp_path / "ppo.yaml", "some/model", tmp_path / "p.jsonl", tmp_path / "run", **extra)
    for command in ("ppo", "plan"):
        assert main([command, str(config), *overrides]) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith(f"ppokit: error: {message}") and captured.err.count("\n") == 1, captured.err
        assert captured.out == ""
    assert not (tmp_path / "run").exists()


def test_user_reward_function_file_and_columns(model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "the movie was", "target": "great"}) + "\n" for _ in range(8)))
    fn = tmp_path / "my_reward.py"
    fn.write_text(
        "def reward(prompts, completions, target, **kw):\n"
        "    assert len(target) == len(completions)\n"
        "    return [float(t in c) for t, c in zip(target, completions)]\n"
    )
    config = write_config(tmp_path / "ppo.yaml", model_dir("llama"), prompts, tmp_path / "run", reward={"functions": [f"{fn}:reward", "sentiment"],
                                                                                                        "weights": [1.0, 0.5]})
    result = ppokit("ppo", config, "ppo.total_episodes=8")
    assert result.returncode == 0, result.stderr
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert "reward/reward" in record and "reward/sentiment" in record
    assert abs(record["objective/scores"] - (record["reward/reward"] + 0.5 * record["reward/sentiment"])) < 1e-5


def test_reward_skip_warning_is_one_line_without_source(model_dir, prompts_file, tmp_path):
    fn = tmp_path / "flaky.py"
    fn.write_text("def flaky(prompts, completions, **kw):\n    return [float('nan') if i == 0 else 1.0 for i in range(len(completions))]\n")
    config = write_config(tmp_path / "ppo.yaml", model_dir("llama"), prompts_file, tmp_path / "run",
                          reward={"functions": [f"{fn}:flaky"], "on_error": "skip"})
    result = ppokit("ppo", config, "ppo.total_episodes=8")
    assert result.returncode == 0, result.stderr
    lines = result.stderr.replace("\r", "\n").splitlines()
    warned = [line for line in lines if "reward.on_error=skip: dropping samples" in line]
    assert len(warned) == 1 and warned[0].startswith("ppokit: warning: "), result.stderr
    assert "UserWarning" not in result.stderr and "_score_source(" not in result.stderr


@pytest.mark.slow
def test_a_run_the_plan_says_cannot_fit_stops_before_loading_weights_unless_forced(model_dir, tmp_path, capsys, monkeypatch):
    from ppokit.cli import main

    prompts = tmp_path / "huge.jsonl"
    prompts.write_text(json.dumps({"prompt": "the movie was " * 750_000}) + "\n" + '{"prompt": "the plot was"}\n' * 15)  # one 10 MB prompt
    # A long-context model: the prompt is within its positions; what it does not fit is the memory.
    config = write_config(tmp_path / "ppo.yaml", model_dir("llama", max_positions=4_000_000), prompts, tmp_path / "run")
    assert main(["ppo", str(config)]) == 3
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert line.startswith("ppokit: error: plan: estimated peak ") and "DOES NOT FIT (prompts up to 2250000 tokens)" in line, err
    assert line.endswith("data.max_prompt_length would cut long prompts. Change the config (see `ppokit plan`), or pass --ignore-plan to start anyway")
    assert not (tmp_path / "run").exists()  # nothing written

    import ppokit.trainer

    class Loaded(Exception):
        pass

    def reached_the_trainer(*args, **kwargs):
        raise Loaded  # --ignore-plan goes on to load the models; the run itself would exhaust this machine

    monkeypatch.setattr(ppokit.trainer, "PPOTrainer", reached_the_trainer)
    with pytest.raises(Loaded):
        main(["ppo", str(config), "--ignore-plan"])
    with pytest.raises(Loaded):
        main(["ppo", str(config), "data.max_prompt_length=16"])  # the plan's way out: it fits


def test_a_prompt_longer_than_the_models_positions_is_one_line_before_any_update(model_dir, prompts_file, tmp_path):
    """A GPT-2-style model with n_positions 64 and an 800-token prompt: was `IndexError: index out of
    range in self` from inside the model; now one line naming the row, the lengths and the key."""
    model = model_dir("gpt2", max_positions=64)
    rows = [json.loads(line) for line in prompts_file.read_text().splitlines()]
    rows[2]["prompt"] = " ".join(["the movie was"] * 266 + ["great"] * 2)  # 800 tokens with the word tokenizer
    prompts = tmp_path / "long.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = write_config(tmp_path / "ppo.yaml", model, prompts, tmp_path / "run")
    result = ppokit("ppo", config)
    _assert_user_error(result, f"data.train ({prompts}:3): the prompt is 800 tokens; with ppo.response_length 6 that is 806, "
                               "over the model's position limit of 64 tokens (n_positions in its config); "
                               "set data.max_prompt_length to at most 58 (it is null)")
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()
    ok = ppokit("ppo", config, "data.max_prompt_length=58", "ppo.num_sample_generations=0", f"output_dir={tmp_path / 'run2'}")
    assert ok.returncode == 0, ok.stderr
    assert "1 of 64 prompts longer than data.max_prompt_length=58 were truncated" in ok.stderr
    report = ppokit("data", "inspect", prompts, "--tokenizer", model, "--response-length", "6", "--json")
    positions = json.loads(report.stdout)["position_limit"]
    assert positions == {"tokens": 64, "key": "n_positions", "rows_over": 1, "first_over": {"where": f"{prompts}:3", "tokens": 806},
                         "fix": "set data.max_prompt_length to at most 58 (it is null)"}


def test_the_command_destroys_the_process_group_it_created_and_keeps_the_callers(model_dir, prompts_file, tmp_path):
    """Left alive to interpreter exit, a gloo group now and then aborted a finished process (SIGABRT,
    "terminate called without an active exception") and so failed a whole torchrun launch. One process
    under fsdp creates a group of one: the command destroys it on the way out, but not a caller's."""
    import torch.distributed as dist

    from ppokit.cli import main

    config = write_config(tmp_path / "ppo.yaml", model_dir("llama"), prompts_file, tmp_path / "run", parallel={"strategy": "fsdp"})
    assert not dist.is_initialized()
    assert main(["ppo", str(config)]) == 0
    assert (tmp_path / "run" / "final").is_dir() and not dist.is_initialized()

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert main(["ppo", str(config), f"output_dir={tmp_path / 'run2'}"]) == 0
        assert dist.is_initialized()  # the caller's group: theirs to end
    finally:
        dist.destroy_process_group()


def test_a_finished_run_continues_as_its_message_says_with_overrides_after_the_flags(model_dir, prompts_file, tmp_path, capsys):
    """`--resume a=1 b=2` and `--overwrite output_dir=x` were "unrecognized arguments"; the finished-run
    message said `--resume` after raising ppo.total_episodes, which resume refuses without --resume-force."""
    from test_run_dir import finished_run

    from ppokit.cli import main

    out, config = finished_run(model_dir, prompts_file, tmp_path)  # 4 updates of 8 episodes
    assert main(["ppo", str(config)]) == 2
    assert "continue it with --resume --resume-force after raising ppo.total_episodes" in capsys.readouterr().err
    assert main(["ppo", str(config), "--resume", "ppo.total_episodes=48", "ppo.logging_steps=1"]) == 2
    assert "ppo.total_episodes (checkpoint 32, now 48)" in capsys.readouterr().err
    assert main(["ppo", str(config), "--resume", "--resume-force", "ppo.total_episodes=48", "ppo.logging_steps=1"]) == 0
    assert [json.loads(line)["update"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5, 6]

    assert main(["ppo", str(config), "--overwrite", f"output_dir={tmp_path / 'other'}", "seed=3", "ppo.total_episodes=8"]) == 0
    assert yaml.safe_load((tmp_path / "other" / "config.yaml").read_text())["seed"] == 3
    with pytest.raises(SystemExit) as refused:  # argparse's own exit for a word that is no override
        main(["ppo", str(config), "--overwrite", "not-an-override"])
    assert refused.value.code == 2 and "unrecognized arguments: not-an-override" in capsys.readouterr().err


HEAVY_MODULES = ("torch", "transformers", "accelerate", "peft", "datasets", "matplotlib", "numpy")
IMPORTED_BY = """
import json, sys
from ppokit.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:  # --help and --version exit from the parser
    code = e.code
print(json.dumps({"code": code, "heavy": [m for m in %r if m in sys.modules]}))
""" % (HEAVY_MODULES,)


DATA_FILES = {  # one file of each stage's data, for `data inspect` without a tokenizer
    "PROMPTS": [{"prompt": "the movie was", "label": 1}],
    "PAIRS": [{"prompt": "the movie was", "completion": " great"}],
    "PREFERENCES": [{"prompt": "the movie was", "chosen": " great", "rejected": " bad"}],
    "CHATS": [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}],
}


@pytest.mark.parametrize("command", [["--help"], ["--version"], ["report", "RUN", "--output", "OUT"], ["report", "--help"],
                                     *(["data", "inspect", name] for name in DATA_FILES), ["from-trl", "TRL_GRPO"]],
                         ids=lambda c: " ".join(c))
def test_the_cheap_commands_import_neither_torch_nor_transformers(tmp_path, command):
    """`ppokit --help`, `--version` and `report` took 4 s and more: the package imported the trainer (torch,
    transformers), and the report matplotlib (2.3 s to import, 3.5 s to draw; it draws SVG itself now). `data
    inspect` without --tokenizer counts characters, yet imported torch and transformers (24-30 s and 390 MB on a
    loaded machine) through the prompt and model helpers. Asserted on what is imported, which is what costs the
    seconds, not on a time."""
    from test_report import healthy_records, write_run

    run = write_run(tmp_path / "run", healthy_records())
    for name, rows in DATA_FILES.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "trl_grpo.yaml").write_text("num_generations: 4\nbeta: 0.04\nlearning_rate: 1.0e-6\n")
    argv = [str(run) if a == "RUN" else str(tmp_path / "report.html") if a == "OUT" else str(tmp_path / "trl_grpo.yaml") if a == "TRL_GRPO" else
            str(tmp_path / f"{a}.jsonl") if a in DATA_FILES else a for a in command]
    result = subprocess.run([sys.executable, "-c", IMPORTED_BY, *argv], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome == {"code": 0, "heavy": []}, (outcome, result.stderr)
    if command == ["--version"]:
        from ppokit.version import __version__

        assert result.stdout.splitlines()[0] == f"ppokit {__version__}"


COMMANDS = ("ppo", "sft", "rm", "pipeline", "plan", "data inspect", "demo", "report", "serve-rm")


@pytest.mark.parametrize("command", [
    *([*c.split(), "--help"] for c in COMMANDS),
    *([c, "CONFIG"] for c in ("ppo", "plan", "sft", "rm", "pipeline")),  # a config with an unknown key
    ["ppo", "CONFIG", "ppo.learning_rate=-1"], ["plan", "CONFIG", "--device-memory", "0"],
    ["data", "inspect", "MISSING"], ["data", "inspect", "MISSING", "MISSING"], ["serve-rm", "sentiment", "--workers", "0"],
], ids=lambda c: " ".join(c))
def test_help_and_mistakes_are_answered_before_any_heavy_import(tmp_path, command):
    """`ppokit plan`, `data inspect` and a config with an unknown key took 30-90 s and 350 MB on a loaded machine: torch
    and transformers were imported before the config was read. A mistake in the config or the arguments, and the help
    of every command, are answered with nothing heavy imported (what costs the seconds), not under a time limit."""
    config = tmp_path / "config.yaml"
    config.write_text("model: m\noutput_dir: out\nlearning_rat: 1\n" if command[1:] == ["CONFIG"] else "model: m\noutput_dir: out\n")
    argv = [str(config) if a == "CONFIG" else str(tmp_path / "none.jsonl") if a == "MISSING" else a for a in command]
    result = subprocess.run([sys.executable, "-c", IMPORTED_BY, *argv], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome == {"code": 0 if "--help" in command else 2, "heavy": []}, (outcome, result.stderr)
    if "--help" not in command:
        assert result.stderr.startswith("ppokit: error: ") and "Traceback" not in result.stderr, result.stderr
        if command[1:] == ["CONFIG"]:
            assert "learning_rat" in result.stderr and "unknown config key" in result.stderr


def test_the_package_api_still_names_the_trainer_and_imports_it_only_when_asked():
    code = ("import sys, ppokit; assert 'torch' not in sys.modules; from ppokit import PPOTrainer, PPOConfig, RewardConfig, "
            "DataConfig, PPOHyperparams, UserError, __version__; import ppokit.trainer; assert PPOTrainer is ppokit.trainer.PPOTrainer; "
            "assert 'PPOTrainer' in dir(ppokit); print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_the_program_acts_on_ctrl_c_before_it_imports_anything_of_its_own_beyond_the_cli():
    """Until `cli.main` installs the program's SIGINT handler, Ctrl-C is Python's: a KeyboardInterrupt traceback. The
    package's `__init__` imported the config (yaml, the engines' keys: 0.2 s quiet, over a second loaded) before that
    line; what runs first is now the cli module and the few standard-library modules it needs."""
    code = "import sys, ppokit.cli; print(sorted(m for m in sys.modules if m.startswith('ppokit') or m == 'yaml'))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.replace("'", '"')) == [
        "ppokit", "ppokit.cli", "ppokit.errors", "ppokit.process", "ppokit.process.cpu_threads", "ppokit.process.interrupts",
        "ppokit.version"]  # ppokit.process: the package, a docstring


def _mapped(pid: int, library: str) -> bool:
    """Whether process `pid` has loaded a shared library whose name holds `library` (Linux's /proc/PID/maps)."""
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


# Moments of a `ppokit ppo` run, each seen from outside, never guessed from a clock: a time measured once drifts
# with the load (under 4x load SIGINT at "start-up + 0.1 s" came in the interpreter's own start-up: rc -2).
CTRL_C_MOMENTS = {
    "the run folder locked (the command's own code, before torch)": lambda proc, out: (out / ".ppokit.lock").exists(),
    "torch's library loaded (inside `import torch`)": lambda proc, out: _mapped(proc.pid, "libtorch"),
    "the tokenizers library loaded (transformers, the model loading)": lambda proc, out: _mapped(proc.pid, "tokenizers"),
    "an update written (training)": lambda proc, out: (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_size > 0,
}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="the moments are seen in /proc/PID/maps")
@pytest.mark.parametrize("moment", list(CTRL_C_MOMENTS))
def test_ctrl_c_at_any_moment_is_one_line_and_exit_130_never_a_traceback(model_dir, prompts_file, tmp_path, sigint_handled, moment):
    """Ctrl-C during `import torch` was a traceback, or an abort (pybind11). SIGINT at moments of the command's own
    code: before torch, during the imports and the model loading it is `ppokit: interrupted` and 130; in training the
    trainer's own handling stops after the update (130, with the resume command); a run that finished first exits 0.
    Never a traceback. (Before the package's first lines run, in the interpreter's start-up, Python's own handler
    applies: no program can answer there.)"""
    import signal
    import time

    from conftest import tiny_ppo_config

    from ppokit.training.batch_sizes import derive

    config, out = tmp_path / "ppo.yaml", tmp_path / "run"
    settings = tiny_ppo_config(model_dir(), prompts_file, out)
    settings.save(config)
    updates = derive(settings.ppo, 1, len(prompts_file.read_text().splitlines())).num_updates
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "ppokit", "ppo", str(config)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    reached, deadline = CTRL_C_MOMENTS[moment], time.monotonic() + 900  # a hang guard, not a speed bound
    while not reached(proc, out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGINT)
    out_text, err = proc.communicate(timeout=900)
    assert "Traceback" not in err and "terminate called" not in err, err
    assert proc.returncode in (130, 0), (proc.returncode, err)
    if proc.returncode == 130:
        last = err.rstrip().splitlines()[-1]
        assert last == "ppokit: interrupted" or last.startswith("ppokit: resume with: ppokit ppo "), err
    else:  # finished before the signal came (a moment late in a short run)
        assert moment.startswith("an update") and json.loads(out_text)["updates"] == updates, (out_text, err)


def test_ctrl_c_reaches_a_program_started_with_sigint_ignored(sigint_handled):
    """A shell without job control (a script, CI, `nohup ppokit ... &`) starts background jobs with SIGINT ignored:
    `kill -INT` then did nothing until training began (the trainer takes SIGINT itself). The program acts on it from
    its first line. serve-rm runs until interrupted: without that it never stops here."""
    import signal

    from conftest import sigint_disposition

    with sigint_disposition(signal.SIG_IGN):  # inherited by the process started here, as from such a shell
        proc = subprocess.Popen([sys.executable, "-m", "ppokit", "serve-rm", "{function: contains, required: [great]}", "--port", "0"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "serving reward source" in proc.stdout.readline()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and err.rstrip().splitlines()[-1] == "ppokit: interrupted" and "Traceback" not in err, err


LOST_IN_A_FINALISER = """
import signal, sys, time
from ppokit import cli

class Finaliser:
    def __del__(self):
        signal.raise_signal(signal.SIGINT)  # its handler runs at once, inside __del__, as a Ctrl-C may land in regex's

def command(args):
    Finaliser()  # dropped at once
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the work the Ctrl-C is to stop
        pass
    return 0

cli._ppo = command
sys.argv = ["ppokit", "ppo", "config.yaml"]
sys.exit(cli.main())
"""


def test_ctrl_c_raised_inside_a_finaliser_still_stops_the_program(sigint_handled):
    """Python cannot raise from a __del__: it printed `Exception ignored in ... regex/_regex_core.py __del__` with a
    KeyboardInterrupt traceback and went on, the Ctrl-C lost. The program sends it again, to land in its own code."""
    result = subprocess.run([sys.executable, "-c", LOST_IN_A_FINALISER], capture_output=True, text=True, timeout=300)
    assert (result.returncode, result.stderr) == (130, "ppokit: interrupted\n")


INTERRUPTED_IMPORT = """
import sys
from pathlib import Path
from ppokit import cli

Path("slow_extension.py").write_text(
    "import signal\\n"
    "signal.raise_signal(signal.SIGINT)  # as if it came while an extension module runs Python callbacks\\n"
    "open('imported', 'w').close()\\n"
)
sys.path.insert(0, ".")

def command(args):
    import time

    import slow_extension  # noqa: F401
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the command's work, which the interrupt stops
        pass
    open("after", "w").close()
    return 0

cli._ppo = command
sys.argv = ["ppokit", "ppo", "config.yaml"]
sys.exit(cli.main())
"""


def test_ctrl_c_during_an_import_stops_the_program_once_the_import_is_done(sigint_handled, tmp_path):
    """Ctrl-C while torch was being imported ended in "terminate called after throwing an instance of
    'pybind11::error_already_set' (KeyboardInterrupt)", SIGABRT: raised inside a callback of an extension module's
    initialisation, it reached C++ that cannot pass it on. SIGINT inside an import is held until the import is done."""
    result = subprocess.run([sys.executable, "-c", INTERRUPTED_IMPORT], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert (result.returncode, result.stderr) == (130, "ppokit: interrupted\n")
    assert (tmp_path / "imported").exists() and not (tmp_path / "after").exists()
