"""`ppokit demo --quick` learns: VADER sentiment of the completions rises under PPO."""

import json

from test_cli import ppokit


def test_quick_demo_raises_the_score(tmp_path):
    result = ppokit("demo", "--quick", "--output", tmp_path / "demo", timeout=600)
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
    # then the report on it, as the README says: one page, its figures, the demo's alarms (none)
    report = ppokit("report", out / "ppo", cwd=tmp_path, timeout=300)
    assert report.returncode == 0, report.stderr[-3000:]
    summary = json.loads(report.stdout)
    assert summary["output"] == "report.html" and (tmp_path / "report.html").stat().st_size > 100_000
    assert len(summary["figures"]) == 7 and summary["runs"][0]["finished"]
    assert summary["runs"][0]["alarms"] == [], summary["runs"][0]["alarms"]
