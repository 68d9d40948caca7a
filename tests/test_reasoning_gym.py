"""reasoning-gym's tasks as data (`reasoning_gym:TASK?size=N&seed=S`, several tasks with weights as its composite) and
the `reasoning_gym` reward (the task's own score_answer), against the installed reasoning-gym."""

import json
import sys

import pytest
import yaml

pytest.importorskip("reasoning_gym")
import reasoning_gym  # noqa: E402
from reasoning_gym.composite import DatasetSpec  # noqa: E402

from ppokit.cli import main  # noqa: E402
from ppokit.data.reasoning_gym import eval_source  # noqa: E402
from ppokit.data.sources import read_source  # noqa: E402
from ppokit.errors import UserError  # noqa: E402
from ppokit.rewards import ReasoningGym, reasoning_gym as reasoning_gym_reward  # noqa: E402

MIX = "reasoning_gym:chain_sum*3,letter_counting?size=60&seed=5&chain_sum.max_terms=2"


def entries(dataset) -> list[dict]:
    return [dataset[i] for i in range(len(dataset))]


def columns(rows: list[dict]) -> dict:
    return {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}


def test_a_task_is_read_entry_by_entry_with_its_size_seed_and_settings():
    rows = read_source("reasoning_gym:chain_sum?size=12&seed=7&max_terms=2").rows
    want = entries(reasoning_gym.create_dataset("chain_sum", size=12, seed=7, max_terms=2))
    assert [(r["prompt"], r["answer"], r["metadata"]) for r in rows] == [(e["question"], e["answer"], e["metadata"]) for e in want]
    assert {r["task"] for r in rows} == {"chain_sum"}
    assert {r["dataset"] for r in rows} == {"reasoning_gym:chain_sum?size=12&seed=7&max_terms=2"}
    other = read_source("reasoning_gym:chain_sum?size=12&seed=8&max_terms=2").rows  # the seed is the one given
    assert [r["prompt"] for r in other] == [e["question"] for e in entries(reasoning_gym.create_dataset("chain_sum", size=12, seed=8, max_terms=2))]
    assert [r["prompt"] for r in other] != [r["prompt"] for r in rows]


def test_several_tasks_are_reasoning_gyms_composite_with_their_weights():
    rows = read_source(MIX).rows
    specs = [DatasetSpec("chain_sum", 3.0, {"max_terms": 2}), DatasetSpec("letter_counting", 1.0, {})]
    want = entries(reasoning_gym.create_dataset("composite", size=60, seed=5, datasets=specs))
    assert [(r["prompt"], r["answer"], r["task"]) for r in rows] == [(e["question"], e["answer"], e["metadata"]["source_dataset"]) for e in want]
    heavy = [r["task"] for r in read_source("reasoning_gym:chain_sum * 9, letter_counting?size=400&seed=1").rows]
    light = [r["task"] for r in read_source("reasoning_gym:chain_sum,letter_counting*9?size=400&seed=1").rows]
    # 400 draws at 0.9: the share is 0.9 +- 0.015 (one standard deviation); at weights 1:1 it would be 0.5
    assert heavy.count("chain_sum") / 400 > 0.85 and light.count("chain_sum") / 400 < 0.15


def test_the_reward_is_the_tasks_own_score_answer_on_the_answer_tag():
    rows = read_source(MIX).rows
    dataset = reasoning_gym.create_dataset("composite", size=60, seed=5,
                                           datasets=[DatasetSpec("chain_sum", 3.0, {"max_terms": 2}), DatasetSpec("letter_counting", 1.0, {})])
    prompts = [r["prompt"] for r in rows]
    right = [f"Thinking... <answer>{r['answer']}</answer>" for r in rows]
    assert reasoning_gym_reward(prompts, right, **columns(rows)) == [1.0] * len(rows)
    # another row's answer, a longer one holding this row's, and no answer tag: each what score_answer says
    wrong = [f"<answer>{rows[i - 1]['answer']}</answer>" for i in range(len(rows))]
    longer = [f"<answer>{r['answer']}0</answer>" for r in rows]
    untagged = [r["answer"] for r in rows]
    for completions, answers in ((wrong, [rows[i - 1]["answer"] for i in range(len(rows))]), (longer, [r["answer"] + "0" for r in rows]),
                                 (untagged, [None] * len(rows))):
        want = [dataset.score_answer(a, dataset[i]) for i, a in enumerate(answers)]
        assert reasoning_gym_reward(prompts, completions, **columns(rows)) == want
        assert want != [1.0] * len(rows)
    assert ReasoningGym(extract="none")(prompts, untagged, **columns(rows)) == [1.0] * len(rows)


def test_an_eval_spec_without_a_seed_starts_after_the_training_entries():
    train = "reasoning_gym:chain_sum?size=100&seed=3"
    assert eval_source(train, "reasoning_gym:chain_sum?size=10") == "reasoning_gym:chain_sum?size=10&seed=103"
    assert eval_source(train, "reasoning_gym:chain_sum?size=10&seed=50") == "reasoning_gym:chain_sum?size=10&seed=50"  # as given
    assert eval_source("prompts.jsonl", "reasoning_gym:chain_sum?size=10") == "reasoning_gym:chain_sum?size=10"
    # entry i of seed S is drawn from Random(S + i): training draws 3..102, eval 103..112
    held = read_source(eval_source(train, "reasoning_gym:chain_sum?size=10")).rows
    assert [r["prompt"] for r in held] == [e["question"] for e in entries(reasoning_gym.create_dataset("chain_sum", size=10, seed=103))]


@pytest.mark.parametrize("spec, message", [
    ("reasoning_gym:chain_sun", "reasoning_gym:chain_sun: reasoning-gym has no task 'chain_sun'; close names: chain_sum, decimal_chain_sum"),
    ("reasoning_gym:chain_sum?foo=1", "task chain_sum has no setting 'foo' (its settings: min_terms, max_terms"),
    ("reasoning_gym:chain_sum?size=0", "size must be a whole number > 0, got '0'"),
    ("reasoning_gym:chain_sum*0,products", "the weight of 'chain_sum' must be a number > 0, got '0'"),
    ("reasoning_gym:chain_sum,products?max_terms=2", "with several tasks a task's setting is written TASK.KEY=VALUE"),
    ("reasoning_gym:chain_sum?min_terms=5&max_terms=2", "reasoning-gym refused the settings (AssertionError: max_terms must be >= min_terms)"),
    ("reasoning_gym:chain_sum?system_prompt=nope", "system_prompt must be one of reasoning-gym's DeepSeekZero, default"),
    ("reasoning_gym:chain_sum?size=10&size=20", "reasoning_gym:chain_sum?size=10&size=20: size is given twice"),
    ("reasoning_gym:chain_sum?max_terms", "expected KEY=VALUE after `?` (joined by `&`), got 'max_terms'"),
])
def test_a_wrong_spec_is_one_line_naming_what_is_wrong(spec, message):
    with pytest.raises(UserError) as caught:
        read_source(spec)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_without_reasoning_gym_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(UserError, match=r"needs the reasoning-gym package, which is not installed: pip install 'ppokit\[reasoning-gym\]'"):
        read_source("reasoning_gym:chain_sum?size=3")


def test_the_demo_without_reasoning_gym_names_the_extra_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    assert main(["demo", "--quick", "--environment", "reasoning-gym", "--output", str(tmp_path / "demo")]) == 2
    assert capsys.readouterr().err.strip() == (
        "ppokit: error: reasoning_gym data needs the reasoning-gym package, which is not installed: pip install 'ppokit[reasoning-gym]'")
    assert not (tmp_path / "demo").exists()


def test_system_prompt_makes_chat_prompts_with_reasoning_gyms_instructions():
    from reasoning_gym.utils import SYSTEM_PROMPTS

    row = read_source("reasoning_gym:chain_sum?size=2&system_prompt=default").rows[0]
    assert row["prompt"][0] == {"role": "system", "content": SYSTEM_PROMPTS["default"]}
    assert row["prompt"][1]["role"] == "user" and row["prompt"][1]["content"].startswith("State the final answer")


def test_data_inspect_shows_the_tasks_rows(capsys):
    assert main(["data", "inspect", MIX]) == 0
    out = capsys.readouterr().out
    first = read_source(MIX).rows[0]
    assert "format         prompt (detected from the columns); read as `ppokit ppo` data" in out
    assert "rows           60" in out and "columns        answer, dataset, metadata, prompt, task" in out
    assert f"  prompt: {first['prompt']!r}" in out and f"  answer: {first['answer']!r}" in out
    assert main(["data", "inspect", MIX, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 60
    assert main(["data", "inspect", "reasoning_gym:chain_sun"]) == 2
    assert capsys.readouterr().err.strip() == (
        "ppokit: error: reasoning_gym:chain_sun: reasoning-gym has no task 'chain_sun'; close names: chain_sum, decimal_chain_sum")


def test_ppokit_ppo_trains_on_a_task_and_records_score_answers_scores(tmp_path, model_dir, capsys):
    """Two updates on a tiny model; each sample's recorded reward is score_answer of its completion's answer tag."""
    from reasoning_gym.utils import extract_answer

    config = tmp_path / "ppo.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(model_dir()), "output_dir": str(tmp_path / "run"), "seed": 1,
        "data": {"train": "reasoning_gym:chain_sum*2,count_bits?size=32&seed=4", "eval": "reasoning_gym:chain_sum*2,count_bits?size=4"},
        "reward": {"functions": ["ppokit.rewards:reasoning_gym"]},
        "ppo": {"total_episodes": 16, "per_device_train_batch_size": 4, "num_mini_batches": 2, "num_ppo_epochs": 1,
                "response_length": 6, "learning_rate": 1e-3, "num_sample_generations": 2, "num_eval_samples": 4},
    }))
    assert main(["ppo", str(config)]) == 0, capsys.readouterr().err
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["update"] for m in metrics] == [1, 2]
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    dataset = reasoning_gym.create_dataset("composite", size=4, seed=36,  # the eval spec: seed 4 + 32
                                           datasets=[DatasetSpec("chain_sum", 2.0, {}), DatasetSpec("count_bits", 1.0, {})])
    assert samples and {s["split"] for s in samples} == {"eval"}
    assert {s["columns"]["dataset"] for s in samples} == {"reasoning_gym:chain_sum*2,count_bits*1?size=4&seed=36"}
    assert {s["columns"]["task"] for s in samples} == {"chain_sum", "count_bits"}
    for sample in samples:
        entry = dataset[sample["columns"]["metadata"]["source_index"]]
        assert sample["prompt"] == entry["question"]
        assert sample["rewards"]["reasoning_gym"] == dataset.score_answer(extract_answer(sample["completion"]), entry)


def test_the_reasoning_gym_demo_runs_from_the_command_line(tmp_path, monkeypatch, capsys):
    """`ppokit demo --quick --environment reasoning-gym`, shortened to two updates on a small SFT: the PPO prompts are a
    reasoning_gym source after the SFT entries, the eval prompts after those, the reward reasoning-gym's score."""
    from ppokit.demos import count_bits
    from ppokit.demos.reviews import DemoChoice

    assert DemoChoice.of("reasoning-gym").default_output() == "ppokit-demo-reasoning-gym"
    monkeypatch.setitem(count_bits.SETTINGS, True, {**count_bits.SETTINGS[True], "n_sft": 200, "sft_epochs": 1, "n_prompts": 64,
                                                   "n_eval": 4, "total_episodes": 128})
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--environment", "reasoning-gym", "--output", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["updates"] == 2 and summary["environment"] == "reasoning-gym" and summary["estimator"] == "gae"
    config = yaml.safe_load((out / "ppo" / "config.yaml").read_text())
    settings = "min_n=1&max_n=31"
    assert config["data"]["train"] == f"reasoning_gym:count_bits?size=64&seed=200&{settings}"  # after the 200 SFT entries
    samples = [json.loads(line) for line in (out / "ppo" / "samples.jsonl").read_text().splitlines()]
    assert {s["columns"]["dataset"] for s in samples} == {f"reasoning_gym:count_bits?size=4&seed=264&{settings}"}
    sft = [json.loads(line) for line in (out / "data" / "sft.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in sft] == [e["question"] for e in entries(reasoning_gym.create_dataset(
        "count_bits", size=200, seed=0, min_n=1, max_n=31))]
    assert all(r["completion"] == f" <answer> {r['completion'].split()[1]} </answer>" for r in sft)


def test_ppokit_plan_reads_a_tasks_prompts(tmp_path, model_dir, capsys):
    """The plan's prompt lengths and batch count come from the task's rows, as for a data file (no 'not found')."""
    config = tmp_path / "ppo.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(model_dir()), "output_dir": str(tmp_path / "run"),
        "data": {"train": "reasoning_gym:count_bits?size=48&max_n=31"}, "reward": {"functions": ["reasoning_gym"]},
        "ppo": {"per_device_train_batch_size": 8, "num_mini_batches": 2, "response_length": 6, "num_train_epochs": 2},
    }))
    assert main(["plan", str(config)]) == 0
    result = capsys.readouterr()
    assert "not found" not in result.out + result.err
    assert "96 episodes = 6 updates" in result.out  # 2 passes over the 48 rows


def test_the_reward_on_data_without_a_tasks_columns_is_refused_in_one_line(tmp_path, model_dir, capsys):
    """Called directly it names what is missing; in a run it stops at start-up, before any model loads."""
    with pytest.raises(UserError, match=r"reasoning_gym: scores the rows of a `reasoning_gym:` data source .* this data has no dataset, metadata$"):
        reasoning_gym_reward(["q"], ["<answer>1</answer>"], answer=["1"])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "2 + 2 =", "answer": "4"}) + "\n")
    config = tmp_path / "ppo.yaml"
    config.write_text(yaml.safe_dump({"model": str(model_dir()), "output_dir": str(tmp_path / "run"), "data": {"train": str(prompts)},
                                      "reward": {"functions": ["ppokit.rewards:reasoning_gym"]},
                                      "ppo": {"total_episodes": 8, "per_device_train_batch_size": 8}}))
    assert main(["ppo", str(config)]) == 2
    assert "reward function reasoning_gym needs the data column(s) dataset, metadata" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
