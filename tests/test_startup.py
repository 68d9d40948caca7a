"""`ppokit plan` exits 2 with `ppokit ppo`'s own line wherever the run refuses a config before loading weights: both run
the same start-up checks (`ppokit.training.startup`), and neither leaves a run folder (or anything else) behind."""

import ast
import inspect
import json
import textwrap

import pytest
import torch
import yaml

from ppokit.training import startup
from ppokit.cli import main
from ppokit.errors import UserError

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without CUDA refuses")

# case -> (overrides, the start of the one error line); files the cases read are written by `files`
REFUSALS = {
    "reward file missing": (["reward.functions=[missing.py:judge]"], "reward function 'missing.py:judge': file missing.py not found"),
    "reward function needs a column the data lacks": (["reward.functions=[rewards.py:needs_answer]"],
                                                      "reward function needs_answer needs the data column(s) answer, which data.train"),
    "reward function without a parameter ppokit passes": (["reward.functions=[{function: rewards.py:two, scale: 2}]"],
                                                          "reward function two (rewards.py:1) has no parameter for the keyword argument(s) scale"),
    "reward function with one positional parameter": (["reward.functions=[rewards.py:one]"],
                                                      "reward function one (rewards.py:4) takes 1 positional parameter(s)"),
    "quantization on a machine without CUDA": pytest.param(["quantization=4bit", "lora={}"], "quantization: 4bit needs a CUDA device",
                                                           marks=CPU_ONLY),
    "fp16 on a machine without CUDA": pytest.param(["fp16=true"], "fp16: float16 mixed precision needs a CUDA device", marks=CPU_ONLY),
    "output_dir is the current directory": (["output_dir=."], "output_dir: . is the current directory"),
    "output_dir is a file": (["output_dir=notes.txt"], "output_dir: notes.txt is a file, not a folder"),
    "output_dir is another tool's folder": (["output_dir=theirs"], "output_dir: theirs exists and is not a ppokit run folder"),
    "token budget below the longest row": (["ppo.max_tokens_per_micro_batch=4"],
                                           "ppo.max_tokens_per_micro_batch=4 is smaller than the longest row this run can produce"),
    "data file missing": (["data.train=missing.jsonl"], "data file not found: missing.jsonl"),
    "no data": (["data.train=null"], "data.train: required"),
    "fewer prompts than one batch": (["ppo.total_episodes=null", "ppo.per_device_train_batch_size=64"],
                                     "ppo.total_episodes: 64 training prompts x 1 epoch(s) is less than one batch of 128"),
    "reward.weights for more sources than there are": (["reward.weights=[1,2]"], "reward.weights has 2 entries for 1 reward sources"),
    "remote scorer's URL": (["reward.remote.url=ftp://scores"], "reward.remote.url: scheme ftp:// is not supported"),
    "dynamic sampling with one sample per prompt": (["rollout.dynamic_sampling=true"],
                                                    "rollout.dynamic_sampling drops the groups of samples of one prompt whose score has no "
                                                    "spread, and ppo.num_samples_per_prompt is 1 (no groups); set it to 2 or more"),
    "dynamic sampling on a metric no source has": (["rollout.dynamic_sampling=true", "ppo.num_samples_per_prompt=2",
                                                    "rollout.dynamic_sampling_metric=accuracy"],
                                                   "rollout.dynamic_sampling_metric: "
                                                   "'accuracy' is neither `score` nor a reward source of this run (sentiment)"),
    "a dynamic sampling key without dynamic sampling": (["rollout.dynamic_sampling_extra_rounds=2"],
                                                        "rollout.dynamic_sampling_extra_rounds (2) is read only with rollout.dynamic_sampling: true"),
}

REWARDS_PY = """def two(prompts, completions):
    return [0.0] * len(prompts)

def one(texts):
    return [0.0] * len(texts)

def needs_answer(prompts, completions, answer):
    return [0.0] * len(prompts)
"""


@pytest.fixture
def run_folder(model_dir, prompts_file, tmp_path, monkeypatch):
    """A config of a run the tiny model can make, in a working directory of its own (with the files the cases name)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rewards.py").write_text(REWARDS_PY)
    (tmp_path / "notes.txt").write_text("mine\n")
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "data.csv").write_text("a,b\n")
    config = {
        "model": str(model_dir("llama")), "output_dir": "run", "reward": {"functions": ["sentiment"]},
        "data": {"train": str(prompts_file)},
        "ppo": {"total_episodes": 16, "per_device_train_batch_size": 4, "num_mini_batches": 2, "num_ppo_epochs": 1,
                "response_length": 4, "num_sample_generations": 0},
    }
    (tmp_path / "ppo.yaml").write_text(yaml.safe_dump(config))
    return tmp_path


def files_under(folder):
    """Every path under `folder` with its contents (bytecode caches of the imported reward file aside)."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None
            for p in sorted(folder.rglob("*")) if "__pycache__" not in p.parts}


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("ppokit: error: ")]


def refused_alike(folder, args, capsys) -> tuple[str, str]:
    """`ppokit plan` and `ppokit ppo` on ppo.yaml with `args`: both exit 2, and nothing under `folder` changes (no
    run folder made or left). -> (the plan's first error line, ppo's one error line)."""
    before = files_under(folder)
    assert main(["plan", "ppo.yaml", *args]) == 2
    plan = errors(capsys.readouterr().err)
    assert files_under(folder) == before  # the plan writes nothing
    assert main(["ppo", "ppo.yaml", *args]) == 2
    ppo = errors(capsys.readouterr().err)
    assert files_under(folder) == before  # refused before anything was written, or removed again
    assert len(ppo) == 1 and plan, (plan, ppo)
    return plan[0], ppo[0]


@pytest.mark.parametrize("args, message", list(REFUSALS.values()), ids=list(REFUSALS))
def test_plan_refuses_what_ppo_refuses_with_its_line(run_folder, capsys, args, message):
    """The probe's cases (issue 47: `plan` said "fits" and `ppo` refused) and the other refusals of the run's start-up."""
    plan, ppo = refused_alike(run_folder, args, capsys)
    assert plan == ppo and ppo.startswith(f"ppokit: error: {message}"), (plan, ppo)


@pytest.mark.parametrize("case", ["token budget below the longest row", "reward file missing", "output_dir is the current directory"])
def test_a_run_that_does_not_fit_and_is_refused_says_the_refusal_as_plan_does(run_folder, capsys, monkeypatch, case):
    """`ppokit ppo`'s own plan (the preflight) stopped a run that does not fit with exit 3 while `ppokit plan` said the
    config's refusal (exit 2): both now say the refusal."""
    monkeypatch.setattr("ppokit.plan.device_memory", lambda: ("cpu test", 1024))  # a device of 1 KiB: nothing fits
    args, message = REFUSALS[case]
    plan, ppo = refused_alike(run_folder, args, capsys)
    assert plan == ppo and ppo.startswith(f"ppokit: error: {message}"), (plan, ppo)


def test_plan_still_prints_its_estimate_beside_the_refusal(run_folder, capsys):
    """A refusal leaves the estimate for the device planned for (with data.train missing, on assumed prompt lengths):
    the run's refusal is the plan's first stop, exit 2."""
    assert main(["plan", "ppo.yaml", "bf16=true", "data.train=missing.jsonl", "--json", "--device-memory", "24"]) == 2
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["stops"][0] == "data file not found: missing.jsonl" and report["fits"]
    assert errors(captured.err)[0] == "ppokit: error: data file not found: missing.jsonl"


def test_plan_overwrite_checks_output_dir_as_ppo_overwrite_does(run_folder):
    """A folder ppokit did not make, refused without --overwrite (above), is taken with it, as `ppokit ppo --overwrite`
    takes it (tests/test_run_dir.py); the plan leaves it as it was."""
    before = files_under(run_folder)
    assert main(["plan", "ppo.yaml", "output_dir=theirs", "--overwrite"]) == 0
    assert files_under(run_folder) == before


# Each call that can refuse in the start-up checks -> where it is looked up when called (each is imported in the function).
STEPS = {
    "check_python_tool": "ppokit.environments.python_tool.check_config",
    "launched_processes": "ppokit.process.launcher.launched_processes",
    "derive": "ppokit.training.batch_sizes.derive",
    "check_machine": "ppokit.process.machine.check_machine",
    "load_prompt_data": "ppokit.data.prompts.load_prompt_data",
    "policy_tokenizer": "ppokit.models.loading.policy_tokenizer",
    "check_run_folder": "ppokit.run.run_dir.check_run_folder",
    "conversation_for": "ppokit.environments.conversation.conversation_for",
    "encode_prompts": "ppokit.data.lengths.encode_prompts",
    "check_budget": "ppokit.data.lengths.check_budget",
    "check_sources": "ppokit.rewards.check_sources",
    "check_teacher": "ppokit.models.loading.check_teacher",
}
NOT_CHECKS = {"UserError", "cwd", "len", "bool", "set", "Start"}


def calls_in(function) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return {node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute))}


def test_every_start_up_check_refuses_both_commands(run_folder, capsys, monkeypatch):
    """Each call of `startup.check_config` and `startup.prepare` is made to refuse in turn: `ppokit ppo` and
    `ppokit plan` both stop on it with its line, and nothing is left behind. The list is read from the functions'
    own code, so a check added there is tried here too, and one dropped (or one left out of a command) fails."""
    assert calls_in(startup.check_config) | calls_in(startup.prepare) == set(STEPS) | NOT_CHECKS
    teacher = [f"teacher={yaml.safe_load((run_folder / 'ppo.yaml').read_text())['model']}"]  # so that check_teacher runs too
    for name, target in STEPS.items():
        with monkeypatch.context() as patch:
            def refuse(*args, name=name, **kwargs):
                raise UserError(f"refused by {name}")

            patch.setattr(target, refuse)
            plan, ppo = refused_alike(run_folder, teacher, capsys)
        assert plan == ppo == f"ppokit: error: refused by {name}", (name, plan, ppo)
