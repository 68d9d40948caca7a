"""Golden metrics: three short runs whose metrics were recorded before the rollout seams (issue 21) and
must stay what they were. On the machine that wrote them they are reproduced bit for bit
(scripts/compare_runs.py checks that against any older commit); here they are compared with a tolerance
that holds across CPUs, whose float32 kernels differ in the last bits.

The tolerance: every metric is a mean, sum or ratio of float32 quantities of magnitude up to ~10
(logprobs, values, scores, losses), each from reductions over at most a few thousand terms, through two
updates whose Adam steps move the weights by lr x (a ratio of such quantities). Kernels that differ in
their summation order move a result by a few ulps x sqrt(terms) of its scale: ~1e-6 relative, ~1e-6
absolute for the differences of logprobs (approxkl, clipfrac's ratios). rtol 1e-4 and atol 1e-5 stay
100x above that, and a change of algorithm moves these numbers by far more (a token sampled otherwise
moves them by ~1e-2). The learning rate is small so that the policy ratio stays well inside the clip
range: a ratio on the clip boundary would make clipfrac (a count) and the gradient (a token in or out)
jump on a last-bit difference. A run whose sampled tokens differ is reported as such: on another CPU a draw can,
rarely, fall on the other side of a token's boundary.

PPOKIT_WRITE_GOLDEN=1 rewrites tests/golden/*.json from the code as it is (only for a change that is
meant to change results; say so in the commit).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from conftest import tiny_ppo_config, with_speed_switches

from ppokit.trainer import PPOTrainer

GOLDEN = Path(__file__).parent / "golden"
RTOL, ATOL = 1e-4, 1e-5
RUNS = {
    "gae": {},
    "grpo_n4": {"advantage_estimator": "grpo", "num_samples_per_prompt": 4},
    "gae_token_budget": {"max_tokens_per_micro_batch": 96},
}


def _run(name: str, sft_model_dir: Path, prompts_file: Path, output_dir: Path) -> dict:
    ppo = dict(RUNS[name])
    budget = ppo.pop("max_tokens_per_micro_batch", None)
    config = tiny_ppo_config(sft_model_dir, prompts_file, output_dir, total_episodes=16, per_device_train_batch_size=8,
                             response_length=12, stop_token="eos", num_sample_generations=1, learning_rate=2e-5, **ppo)
    config = with_speed_switches(config, max_tokens_per_micro_batch=budget)
    records = PPOTrainer(config, show_progress=False).train()
    samples = [json.loads(line) for line in (output_dir / "samples.jsonl").read_text().splitlines()]
    metrics = [{k: v for k, v in r.items() if not k.startswith("time/") and k != "eps"} for r in records]
    return {"metrics": metrics, "completions": [s["completion"] for s in samples]}


@pytest.mark.parametrize("name", list(RUNS))
def test_metrics_are_the_recorded_ones(name, sft_model_dir, prompts_file, tmp_path):
    got = _run(name, sft_model_dir, prompts_file, tmp_path / "run")
    path = GOLDEN / f"{name}.json"
    if os.environ.get("PPOKIT_WRITE_GOLDEN") == "1":
        path.write_text(json.dumps(got, indent=1) + "\n")
        pytest.skip(f"wrote {path}")
    want = json.loads(path.read_text())
    assert got["completions"] == want["completions"], "the sampled completions differ: another token was drawn"
    assert [sorted(r) for r in got["metrics"]] == [sorted(r) for r in want["metrics"]], "the metric names differ"
    for update, (g, w) in enumerate(zip(got["metrics"], want["metrics"]), 1):
        for key, value in w.items():
            assert math.isclose(g[key], value, rel_tol=RTOL, abs_tol=ATOL), f"update {update} {key}: {g[key]!r}, recorded {value!r}"
