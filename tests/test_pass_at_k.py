"""pass@k evaluation: the unbiased estimator (Chen et al. 2021) by hand and against the binomial formula, n samples
per eval prompt in evaluate() and the sample generations, the correctness rule, the refusals at start-up."""

import json
import math
import re
import subprocess
import sys

import pytest
import torch
from conftest import tiny_ppo_config

from ppokit.errors import UserError
from ppokit.metrics.values import pass_at_k_metrics
from ppokit.training import algo, evaluation
from ppokit.trainer import PPOTrainer


def test_pass_at_k_by_hand():
    # n = 4 samples, c = 1 correct: pass@1 = 1/4; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 1/2; pass@4 = 1 (n - c < k)
    n, c = torch.tensor([4, 4, 4]), torch.tensor([1, 0, 4])
    assert algo.pass_at_k(n, c, 1).tolist() == [0.25, 0.0, 1.0]
    assert algo.pass_at_k(n, c, 2).tolist() == [0.5, 0.0, 1.0]
    assert algo.pass_at_k(n, c, 4).tolist() == [1.0, 0.0, 1.0]
    # n = 5, c = 2, k = 2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7 (the product form: 1 - (1 - 2/4)(1 - 2/5) = 1 - 0.3)
    assert algo.pass_at_k(torch.tensor([5]), torch.tensor([2]), 2).item() == pytest.approx(0.7, abs=1e-15)


def test_pass_at_k_equals_the_binomial_formula_in_a_plain_loop():
    generator = torch.Generator().manual_seed(0)
    n = torch.randint(1, 40, (200,), generator=generator)
    c = (torch.rand(200, generator=generator) * (n + 1)).long().clamp(max=n)
    for k in (1, 2, 5, 10):
        rows = n >= k
        got = algo.pass_at_k(n[rows], c[rows], k)
        want = [1 - math.comb(int(a) - int(b), k) / math.comb(int(a), k) for a, b in zip(n[rows], c[rows])]
        # float64 products of at most 40 factors: each rounding is 2^-53 relative
        assert got.tolist() == pytest.approx(want, rel=0, abs=40 * 2**-52)


def test_pass_at_k_stays_finite_where_the_binomials_overflow_and_is_not_the_biased_share():
    # C(2000, 1000) overflows float64; the product form does not form it
    got = algo.pass_at_k(torch.tensor([2000]), torch.tensor([3]), 1000).item()
    want = 1 - math.prod((2000 - 3 - i) / (2000 - i) for i in range(1000))  # C(1997,1000)/C(2000,1000), exactly
    assert math.isfinite(got) and got == pytest.approx(want, rel=1e-12)
    # the naive estimate 1 - (1 - c/n)^k is biased: for n = 4, c = 1, k = 2 it gives 0.4375, not 0.5
    assert algo.pass_at_k(torch.tensor([4]), torch.tensor([1]), 2).item() != pytest.approx(1 - (1 - 1 / 4) ** 2)
    with pytest.raises(ValueError):
        algo.pass_at_k(torch.tensor([2]), torch.tensor([1]), 3)


def test_pass_at_k_metrics_group_adjacent_samples_and_count_unscored_as_wrong():
    # two prompts, n = 3: scores [1, 0, None] and [0.5, 1, 1] with threshold 1 -> c = 1 and 2
    metrics = pass_at_k_metrics([1.0, 0.0, None, 0.5, 1.0, 1.0], 3, [1, 2], 1.0)
    assert metrics["eval/pass@1"] == pytest.approx((1 / 3 + 2 / 3) / 2)
    assert metrics["eval/pass@2"] == pytest.approx(((1 - 1 / 3) + 1) / 2)  # 1 - C(2,2)/C(3,2) = 2/3; n - c = 1 < 2: 1
    assert metrics["eval/mean@3"] == pytest.approx((0.5 + 2.5 / 3) / 2)
    assert pass_at_k_metrics([True, False], 2, [1], 1.0)["eval/pass@1"] == 0.5  # a bool reward: True is 1
    assert pass_at_k_metrics([1.0, 0.0], 2, [], 1.0) == {}


def even_words(prompts, completions, **columns):
    """A verifiable reward that returns a bool: the completion has an even number of words."""
    return [len(c.split()) % 2 == 0 for c in completions]


def test_evaluation_samples_n_per_prompt_and_logs_pass_at_k(model_dir, prompts_file, tmp_path):
    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run", eval_samples_per_prompt=3, eval_pass_at_k=[1, 3],
                             num_eval_samples=4, local_rollout_forward_batch_size=8)
    config.data.eval = str(prompts_file)
    trainer = PPOTrainer(config, reward_functions=[even_words], show_progress=False)
    metrics = trainer.evaluate(max_prompts=5)  # 8 rows a call: 2 prompts x 3 samples, three calls
    assert metrics["eval/num_scored"] == 15 and {"eval/pass@1", "eval/pass@3", "eval/mean@3"} <= set(metrics)
    assert metrics["eval/pass@1"] == pytest.approx(metrics["eval/scores"])  # every sample scored: pass@1 = c / n = the mean 0/1 score

    rows = trainer.sample_completions()
    assert [r["prompt"] for r in rows] == [p for p in trainer.eval_data.rows(range(4))[0] for _ in range(3)]
    scores = [r["score"] for r in rows]
    assert set(scores) <= {0.0, 1.0}
    correct = [sum(scores[i:i + 3]) for i in range(0, 12, 3)]
    want = {"eval/scores": sum(scores) / 12, "eval/pass@1": sum(c / 3 for c in correct) / 4,
            "eval/pass@3": sum(c > 0 for c in correct) / 4, "eval/mean@3": sum(correct) / 12}
    assert evaluation.eval_score(rows, evaluation.EvalSamples.of(config.ppo)) == pytest.approx(want)

    records = trainer.train()
    assert {"eval/pass@1", "eval/pass@3", "eval/mean@3"} <= set(records[-1])
    written = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len([r for r in written if r["update"] == records[-1]["update"]]) == 12


@pytest.mark.parametrize("overrides,message", [
    (["ppo.eval_samples_per_prompt=2", "ppo.eval_pass_at_k=[1,4]"], r"ppo.eval_pass_at_k \(\[1, 4\]\): pass@4 needs at least 4 samples"),
    (["ppo.eval_samples_per_prompt=4", "ppo.eval_temperature=0"], "eval_temperature 0 .greedy. would sample 4 identical"),
    (["ppo.eval_correct_threshold=0.5"], "ppo.eval_correct_threshold .0.5. decides"),
    (["ppo.eval_pass_at_k=[2,2]"], "ppo.eval_pass_at_k: value .2, 2. is out of range"),
    (["ppo.eval_samples_per_prompt=4", "ppo.eval_pass_at_k=[1,4]"], "ppo.eval_pass_at_k samples the eval prompts, and this run has none"),
])
def test_bad_pass_at_k_settings_are_one_line_at_start_up_and_leave_no_run_folder(overrides, message, model_dir, prompts_file, tmp_path):
    from ppokit.config.schema import PPOConfig

    with pytest.raises(UserError, match=message):  # the config's own rules as it loads, the eval prompts' at the trainer's start
        config = PPOConfig.load(None, [f"model={model_dir('llama')}", "reward.functions=[sentiment]", f"data.train={prompts_file}",
                                       f"output_dir={tmp_path / 'api-run'}", *overrides])
        PPOTrainer(config, show_progress=False)
    assert not (tmp_path / "api-run").exists()
    out = tmp_path / "run"
    config = tmp_path / "ppo.yaml"
    config.write_text(json.dumps({"model": str(model_dir("llama")), "reward": {"functions": ["sentiment"]},
                                  "data": {"train": str(prompts_file)}, "output_dir": str(out)}))
    result = subprocess.run([sys.executable, "-m", "ppokit", "ppo", str(config), *overrides], capture_output=True, text=True)
    assert result.returncode == 2 and not out.exists()
    errors = [line for line in result.stderr.splitlines() if not line.startswith("plan: ")]  # the preflight's estimate, then the refusal
    assert len(errors) == 1 and errors[0].startswith("ppokit: error: ") and re.search(message, errors[0]), result.stderr


def test_trls_num_generations_eval_is_eval_samples_per_prompt():
    from ppokit.config.from_trl import translate

    translation = translate({"num_generations": 8, "num_generations_eval": 4}, "grpo.yaml")
    assert translation.settings["ppo.eval_samples_per_prompt"].value == 4
    assert any(line.strip().startswith("num_generations_eval: 4  ->  ppo.eval_samples_per_prompt: 4") for line in translation.lines)
