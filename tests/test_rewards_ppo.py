import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import tiny_ppo_config
from test_rewards_remote import running
from test_rewards_model import tiny_rm

from ppokit.config.schema import PPOConfig
from ppokit.rewards import function_source, make_server
from ppokit.demos.tiny import bpe_tokenizer
from ppokit.trainer import PPOTrainer

TARGET = "great"  # a word of the demo vocabulary that the untrained tiny model emits now and then


def prefers_great(prompts, completions, **columns):
    return [1.0 if TARGET in c.split() else 0.0 for c in completions]


def test_ppo_raises_the_rate_of_the_word_the_reward_prefers(model_dir, prompts_file, tmp_path):
    config = tiny_ppo_config(
        model_dir("llama"), prompts_file, tmp_path / "run", total_episodes=128, per_device_train_batch_size=8,
        num_mini_batches=2, learning_rate=2e-2, num_sample_generations=0,
    )
    trainer = PPOTrainer(config, reward_functions=[prefers_great], show_progress=False)
    records = trainer.train()
    rates = [r["reward/prefers_great"] for r in records]  # fraction of the 16 completions with the word
    print(f"rate of {TARGET!r} per update: {[round(r, 2) for r in rates]}")
    first, last = sum(rates[:2]) / 2, sum(rates[-2:]) / 2
    assert last >= first + 0.3 and last >= 0.4, rates
    # The run records the functions it used; the caller's config is left as it was.
    assert trainer.config.reward.functions == ["prefers_great"] and config.reward.functions == ["sentiment"]
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["reward"]["functions"] == ["prefers_great"]


@pytest.fixture
def other_vocab_rm(tmp_path, demo_data):
    tok = bpe_tokenizer(r["prompt"] + " " + r["completion"] for r in demo_data["sft"])
    path = tmp_path / "rm"
    tiny_rm(tok, seed=4).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_every_source_from_the_config_with_skipped_rows_masked_out(model_dir, prompts_file, tmp_path, other_vocab_rm, monkeypatch):
    (tmp_path / "picky.py").write_text(
        "def picky(prompts, completions, **columns):\n"
        "    # user code with a bug: no score for prompts that start with 'the'\n"
        "    return [float('nan') if p.startswith('the ') else 1.0 for p in prompts]\n"
    )
    monkeypatch.chdir(tmp_path)
    served = function_source({"function": "length", "target": 5, "unit": "words"}, "served")
    with running(make_server(served, port=0)) as url:
        (tmp_path / "ppo.yaml").write_text(yaml.safe_dump({
            "model": str(model_dir("llama")), "output_dir": str(tmp_path / "run"), "seed": 3,
            "data": {"train": str(prompts_file)},
            "reward": {
                "model": str(other_vocab_rm),
                "functions": ["sentiment", {"function": "contains", "name": "likes_great", "required": ["great"]}, "picky.py:picky"],
                "remote": {"url": url, "max_retries": 0, "name": "served_length"},
                "weights": [0.5, 1.0, 2.0, 0.1, 0.2],
                "normalize": [True, False, False, False, True],
                "clip_range": [-3, 3],
                "on_error": "skip",
            },
            "ppo": {"total_episodes": 16, "per_device_train_batch_size": 4, "num_mini_batches": 2, "num_ppo_epochs": 1,
                    "response_length": 8, "temperature": 1.0, "num_sample_generations": 0},
        }))
        trainer = PPOTrainer(PPOConfig.load(tmp_path / "ppo.yaml"), show_progress=False)
        seen = []
        optimise = trainer.optimise
        monkeypatch.setattr(trainer, "optimise", lambda rollout: seen.append(rollout) or optimise(rollout))
        with pytest.warns(UserWarning, match="picky returned nan"):
            records = trainer.train()
    assert trainer.scorer.names == ["reward_model", "sentiment", "likes_great", "picky", "served_length"]
    for r in records:
        for name in trainer.scorer.names:
            assert f"reward/{name}" in r
        assert -3 <= r["objective/scores"] <= 3
    assert set(trainer.scorer.state_dict()["moments"]) == {"reward_model", "served_length"}
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["reward/skipped"] for line in lines] == [r["reward/skipped"] for r in records]
    skipped = sum(r["reward/skipped"] for r in records)
    assert skipped > 0
    for rollout in seen:  # skipped rows take no part in the update: no tokens, no advantage, score 0
        dropped = ~rollout.trained_mask.any(1)
        assert rollout.advantages[dropped].abs().sum() == 0 and rollout.scores[dropped].abs().sum() == 0
    assert sum(int((~rollout.trained_mask.any(1)).sum()) for rollout in seen) == skipped


def test_python_objects_as_sources(model_dir, prompts_file, tmp_path, tokenizer, demo_data):
    from ppokit.rewards import Contains, RemoteReward

    rm_tok = bpe_tokenizer(r["prompt"] + " " + r["completion"] for r in demo_data["sft"])
    rm = tiny_rm(rm_tok, seed=5)
    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run", total_episodes=8, num_sample_generations=0)
    with running(make_server(function_source("sentiment", "k"), port=0)) as url:
        trainer = PPOTrainer(
            config, reward_model=rm, reward_tokenizer=rm_tok, show_progress=False,
            reward_functions=[Contains(required=["great"]), RemoteReward(url, name="vader", max_retries=0)],
        )
        record = trainer.step()
    assert trainer.scorer.names == ["reward_model", "contains", "vader"]
    assert {"reward/reward_model", "reward/contains", "reward/vader"} <= set(record)
    assert trainer.config.reward.functions == ["contains", "vader"] and trainer.config.reward.model is None
    assert config.reward.functions == ["sentiment"]  # the caller's config is left as it was
    # the reward model has another vocabulary, so the critic starts from the policy, not from it
    assert trainer.value_model.get_input_embeddings().num_embeddings == len(tokenizer)


def test_a_reward_function_that_edits_its_arguments_changes_nothing_outside_itself(model_dir, demo_data, tmp_path):
    from ppokit.run import checkpoint

    rows = [{"prompt": r["prompt"], "meta": {"tags": ["t"], "i": i}} for i, r in enumerate(demo_data["prompts"][:16])]
    for name, part in (("train", rows[:12]), ("eval", rows[12:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    seen = []

    def vandal(prompts, completions, meta, **columns):
        n = len(completions)
        prompts[0] = "EDITED prompt"
        completions[:] = ["EDITED"] * n
        for m in meta:
            m["tags"].append("EDITED")
            m["new"] = "EDITED"
        meta.reverse()
        completions.clear()  # was a traceback: the scorer counted 0 completions
        return [1.0] * n

    def witness(prompts, completions, meta, **columns):
        seen.append(json.dumps([prompts, completions, meta]))
        return [0.5] * len(completions)

    def config():
        c = tiny_ppo_config(model_dir("llama"), tmp_path / "train.jsonl", tmp_path / "run", total_episodes=8, save_steps=1)
        c.data.eval = str(tmp_path / "eval.jsonl")
        return c

    trainer = PPOTrainer(config(), reward_functions=[vandal, witness], show_progress=False)
    trainer.train()
    samples = (tmp_path / "run" / "samples.jsonl").read_text()
    assert samples and "EDITED" not in samples and seen and not any("EDITED" in s for s in seen)
    prompts = {r["prompt"] for r in rows}
    assert all(json.loads(line)["prompt"] in prompts for line in samples.splitlines())
    assert trainer.train_data.columns["meta"] == [r["meta"] for r in rows[:12]]
    assert trainer.eval_data.columns["meta"] == [r["meta"] for r in rows[12:]]
    # the data a checkpoint records is the data on disk, so resuming is accepted
    again = PPOTrainer(config(), reward_functions=[vandal, witness], show_progress=False)
    saved = checkpoint.find_checkpoint(None, tmp_path / "run")
    again.resume_from(saved)
    assert saved.name == "update-1" and again.state.update == 1


def test_a_reward_function_past_reward_timeout_s_is_skipped_like_any_failure(model_dir, prompts_file, tmp_path):
    from ppokit.training.guards import NonFiniteStop

    release = threading.Event()

    def stalls(prompts, completions, **columns):
        release.wait(900)  # released at the end of the test: no thread outlives it for long
        return [1.0] * len(completions)

    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run", total_episodes=16, max_skipped_updates=2)
    config.reward.timeout_s, config.reward.on_error = 1.0, "skip"
    trainer = PPOTrainer(config, reward_functions=["sentiment", stalls], show_progress=False)
    t0 = time.monotonic()
    try:
        with pytest.warns(UserWarning, match=r"reward function stalls did not return within reward.timeout_s=1s"):
            with pytest.raises(NonFiniteStop, match=r"2 updates in a row were skipped .*stalls"):
                trainer.train()
    finally:
        release.set()
    assert time.monotonic() - t0 < 600  # the run did not wait for the stalled call (900 s)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line.get("nonfinite/score") for line in lines] == [1, 1]


@pytest.mark.parametrize("stuck", [
    "time.sleep(3600)",
    # a judge model that never answers: its thread is inside torch's C++ code (GIL released) when the
    # program exits, where the interpreter's shutdown used to abort the process (SIGABRT) or hang it
    "x = torch.randn(64, 64)\n    while True:\n        x = (x @ x).tanh()",
], ids=["sleeping", "computing-in-torch"])
def test_a_reward_function_that_sleeps_for_ever_stops_the_run_with_one_line(model_dir, prompts_file, tmp_path, stuck):
    (tmp_path / "sleepy.py").write_text(f"import time\n\nimport torch\n\n\ndef sleepy(prompts, completions, **columns):\n    {stuck}\n")
    (tmp_path / "ppo.yaml").write_text(yaml.safe_dump({
        "model": str(model_dir("llama")), "output_dir": str(tmp_path / "run"), "data": {"train": str(prompts_file)},
        "reward": {"functions": ["sleepy.py:sleepy"], "timeout_s": 2},
        "ppo": {"total_episodes": 8, "per_device_train_batch_size": 4, "num_mini_batches": 2, "response_length": 8},
    }))
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # stopping takes seconds quiet and minutes on a loaded machine; the call it must not wait for takes an hour
    proc = subprocess.run([sys.executable, "-m", "ppokit", "ppo", "ppo.yaml"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "ppokit: error: reward function sleepy did not return within reward.timeout_s=2s (its thread is left running: Python cannot stop it)"
    )


def test_a_finished_run_exits_0_while_the_users_own_thread_computes_in_torch(model_dir, prompts_file, tmp_path):
    """A reward module whose background thread (daemon: it does not hold the program open) is inside torch's C++ code
    when the run ends: the interpreter's shutdown woke it there and the finished run aborted (SIGABRT, "terminate called
    without an active exception", exit 134; under torchrun the whole launch failed). The program ends as the shutdown
    would, up to its atexit handlers, and leaves before that."""
    (tmp_path / "busy.py").write_text(
        "import threading\n\nimport torch\n\n\n"
        "def spin():\n    x = torch.randn(128, 128)\n    while True:\n        x = (x @ x).tanh()\n\n\n"
        "for _ in range(2):\n    threading.Thread(target=spin, daemon=True).start()\n\n\n"
        "def busy(prompts, completions, **columns):\n    return [float(len(c)) for c in completions]\n")
    (tmp_path / "ppo.yaml").write_text(yaml.safe_dump({
        "model": str(model_dir("llama")), "output_dir": str(tmp_path / "run"), "data": {"train": str(prompts_file)},
        "reward": {"functions": ["busy.py:busy"]},
        "ppo": {"total_episodes": 8, "per_device_train_batch_size": 4, "num_mini_batches": 2, "response_length": 8},
    }))
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "ppokit", "ppo", "ppo.yaml"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert "terminate called" not in proc.stderr
    assert (tmp_path / "run" / "final").is_dir() and len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize("timeout_s", [600, None], ids=["worker-thread", "main-thread"])
def test_a_second_sigterm_abandons_an_update_stuck_in_a_reward_function(model_dir, prompts_file, tmp_path, timeout_s):
    (tmp_path / "sleepy.py").write_text(
        "import time\n\nCALLS = 0\n\n"
        "def sleepy(prompts, completions, **columns):\n"
        "    global CALLS\n"
        "    CALLS += 1\n"
        "    if CALLS >= 2:  # update 1 completes (and is saved); update 2 never does\n"
        "        open('sleeping', 'w').close()\n"
        "        time.sleep(3600)\n"
        "    return [0.0] * len(completions)\n"
    )
    out = tmp_path / "run"
    (tmp_path / "ppo.yaml").write_text(yaml.safe_dump({
        "model": str(model_dir("llama")), "output_dir": str(out), "data": {"train": str(prompts_file)},
        "reward": {"functions": ["sleepy.py:sleepy"], "timeout_s": timeout_s},
        "ppo": {"total_episodes": 16, "per_device_train_batch_size": 4, "num_mini_batches": 2, "response_length": 8,
                "save_steps": 1, "num_sample_generations": 0},
    }))
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "stderr.txt"
    proc = subprocess.Popen([sys.executable, "-m", "ppokit", "ppo", "ppo.yaml"], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=log.open("w"))
    try:
        deadline = time.monotonic() + 900  # start-up takes minutes on a loaded machine
        while not (tmp_path / "sleeping").exists():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the run never reached update 2"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        while "finishing update 2" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        assert proc.poll() is None  # the first signal waits for the update, which never ends
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 143, log.read_text()[-3000:]  # at once, not after the hour-long call
        assert time.monotonic() - sent < 300
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = log.read_text()
    assert f"SIGTERM received twice: abandoned update 2; the last complete checkpoint is {out / 'checkpoints' / 'update-1'}" in stderr
    assert "Traceback" not in stderr
