"""Checkpoints and exact resume: a run interrupted (exception, SIGKILL, SIGTERM/SIGINT, a crash while
writing a checkpoint) and resumed writes the same metrics.jsonl as one that never stopped."""

import json
import os
import shutil
import signal
import subprocess
import sys
import re
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import tiny_ppo_config, with_speed_switches

import ppokit
from ppokit.run import checkpoint, run_dir
from ppokit.cli import main
from ppokit.config.schema import PPOConfig
from ppokit.errors import UserError
from ppokit.trainer import PPOTrainer

# 4 updates of 8 episodes; the adaptive KL controller moves kl_coef every update (its state must survive),
# and samples are drawn at updates 2 and 4 (so sampling's use of the RNG must survive too).
RUN = dict(total_episodes=32, kl_target=0.5, kl_horizon=100)
WALL_CLOCK = ("eps", "time/")
# the only keys allowed to differ between an interrupted and a straight run
SHOWN = ("objective/scores", "objective/kl", "objective/kl_coef", "loss/policy_avg", "lr")


def comparable(path: Path) -> list[dict]:
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)} for r in records]


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


# The same run with the toolbox's estimators: GRPO's groups of 4 samples, and PPO whose critic warms up
# for 3 updates first on its own learning rate (the policy's schedule starts after it).
VARIANTS = {
    "gae": {},
    "grpo_n4": dict(advantage_estimator="grpo", num_samples_per_prompt=4),
    "gae_critic_warmup": dict(critic_warmup_updates=3, vf_learning_rate=3e-3),  # the checkpoint (update 2) is inside the warm-up
    # TRL's cosine with a floor and its AdamW betas: the schedule and the optimiser's state carry over exactly too
    "cosine_min_lr_betas": dict(lr_scheduler_type="cosine_with_min_lr", min_lr_rate=0.1, warmup_steps=2, adam_beta1=0.8, adam_beta2=0.99),
}

# docs/speed.md's switches: trimmed token-budget micro-batches (2 rows of the longest row) and the light LM head.
SPEED = dict(max_tokens_per_micro_batch=28, lm_head_chunk_size=3)


@pytest.fixture(scope="module")
def references(model_dir, prompts_file, tmp_path_factory):
    """variant -> the folder of its 4 updates run straight through (no checkpoint but the final one)."""
    made = {}

    def reference_of(variant: str) -> Path:
        if variant not in made:
            out = made[variant] = tmp_path_factory.mktemp(f"reference-{variant}")
            PPOTrainer(tiny_ppo_config(model_dir("llama"), prompts_file, out, **RUN, **VARIANTS[variant]), show_progress=False).train()
        return made[variant]

    return reference_of


@pytest.fixture(scope="module")
def reference(references):
    return references("gae")


@pytest.fixture(scope="module")
def reference_with_speed_switches(model_dir, prompts_file, tmp_path_factory):
    """The same straight run with the speed switches on."""
    out = tmp_path_factory.mktemp("reference-speed")
    config = with_speed_switches(tiny_ppo_config(model_dir("llama"), prompts_file, out, **RUN), **SPEED)
    PPOTrainer(config, show_progress=False).train()
    return out


def resume_and_finish(config: PPOConfig, path=None) -> PPOTrainer:
    trainer = PPOTrainer(config, show_progress=False)
    trainer.resume_from(path)
    trainer.train()
    return trainer


def train_until_crash_at_optimizer_step(trainer: PPOTrainer, crash_at: int) -> None:
    """trainer.train() with an exception raised instead of optimiser step number `crash_at`."""
    step, calls = trainer.optimizer.step, []

    def crashing_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == crash_at:
            raise RuntimeError("simulated crash")
        return step(*args, **kwargs)

    trainer.optimizer.step = crashing_step
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer.train()


def assert_same_run(run_dir: Path, reference: Path) -> None:
    got, want = comparable(run_dir / "metrics.jsonl"), comparable(reference / "metrics.jsonl")
    assert [r["update"] for r in got] == [1, 2, 3, 4]
    for g, w in zip(got, want):  # shown with `pytest -s`
        print(f"update {g['update']}: " + ", ".join(f"{k} {g[k]!r} vs {w[k]!r}" for k in SHOWN if k in g))
    assert got == want  # every number, bit for bit, except wall-clock time
    assert len({r["objective/kl_coef"] for r in got}) == 4  # the KL controller really adapted
    assert (run_dir / "samples.jsonl").read_text() == (reference / "samples.jsonl").read_text()


@pytest.mark.parametrize("speed", [False, True], ids=["defaults", "speed-switches"])
def test_resume_after_an_exception_mid_update_is_exact(model_dir, prompts_file, tmp_path, request, speed):
    out = tmp_path / "run"

    def config():
        run = tiny_ppo_config(model_dir("llama"), prompts_file, out, save_steps=1, save_total_limit=2, **RUN)
        return with_speed_switches(run, **SPEED) if speed else run

    trainer = PPOTrainer(config(), show_progress=False)
    train_until_crash_at_optimizer_step(trainer, 10)  # 4 optimiser steps per update: update 3 took one
    assert [p.name for p in checkpoint.list_checkpoints(out / "checkpoints")] == ["update-1", "update-2"]

    resumed = resume_and_finish(config())
    assert resumed.state.update == 4 and len(resumed.state.records) == 4
    assert_same_run(out, request.getfixturevalue("reference_with_speed_switches" if speed else "reference"))
    # save_total_limit=2 keeps the newest two; the end of the run always has one.
    assert [p.name for p in checkpoint.list_checkpoints(out / "checkpoints")] == ["update-3", "update-4"]


def test_crash_while_writing_a_checkpoint_leaves_the_previous_one(model_dir, prompts_file, tmp_path, reference, monkeypatch):
    out = tmp_path / "run"
    config = tiny_ppo_config(model_dir("llama"), prompts_file, out, save_steps=1, **RUN)
    real_save = torch.save

    def disk_full_in_update_2(obj, path, *args, **kwargs):
        if ".update-2.tmp" in str(path) and Path(path).name == "scheduler.pt":
            raise OSError(28, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full_in_update_2)
    folder = out / "checkpoints"
    with pytest.raises(UserError, match=(
        f"^no space left on /.* \\(No space left on device\\) while writing {folder / 'update-2'}; "
        f"the last complete checkpoint is {folder / 'update-1'}$"
    )):
        PPOTrainer(config, show_progress=False).train()
    monkeypatch.setattr(torch, "save", real_save)

    assert [p.name for p in checkpoint.list_checkpoints(folder)] == ["update-1"]
    assert not list(folder.glob(".update-*")), "the half-written checkpoint is removed"
    assert checkpoint.find_checkpoint(None, out) == folder / "update-1"
    resume_and_finish(tiny_ppo_config(model_dir("llama"), prompts_file, out, save_steps=1, **RUN))
    assert_same_run(out, reference)


def test_a_process_lost_in_the_wait_after_a_checkpoint_is_written_leaves_that_checkpoint_named(model_dir, prompts_file, tmp_path):
    """The main process has update-2 in place and waits for the others; one of them is gone. The error named
    update-1 (CI: "no checkpoint of this run was written yet" when it was update-1), though update-2 was complete."""
    out = tmp_path / "run"
    trainer = PPOTrainer(tiny_ppo_config(model_dir("llama"), prompts_file, out, save_steps=1, **RUN), show_progress=False)
    written = out / "checkpoints" / "update-2" / checkpoint.STATE_FILE
    wait = trainer.accelerator.wait_for_everyone

    def peer_gone_once_update_2_is_written():
        if written.is_file():
            raise RuntimeError("[gloo] Connection reset by peer")
        wait()

    trainer.accelerator.wait_for_everyone = peer_gone_once_update_2_is_written
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        trainer.train()
    assert trainer.saving.last_checkpoint == out / "checkpoints" / "update-2"
    assert checkpoint.find_checkpoint(None, out) == out / "checkpoints" / "update-2"


def _cli(config_path: Path, log: Path) -> subprocess.Popen:
    """`python -m ppokit ppo CONFIG` with this checkout's code and the test's thread count (same numbers)."""
    src = str(Path(ppokit.__file__).resolve().parents[1])
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-m", "ppokit", "ppo", str(config_path)], env=env,
                            stdout=subprocess.DEVNULL, stderr=log.open("w"))


def _wait_until(condition, proc: subprocess.Popen, log: Path, timeout: float = 900) -> None:  # minutes when loaded
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"ppokit exited with {proc.returncode} too early:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("timed out waiting for the run")
        time.sleep(0.005)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_resume_after_sigkill_mid_update_is_exact(model_dir, prompts_file, tmp_path, references, capsys, variant):
    reference = references(variant)
    out = tmp_path / "run"
    config_path = tmp_path / "ppo.yaml"
    tiny_ppo_config(model_dir("llama"), prompts_file, out, save_steps=2, **RUN, **VARIANTS[variant]).save(config_path)
    log = tmp_path / "stderr.txt"
    proc = _cli(config_path, log)
    metrics = out / "metrics.jsonl"
    _wait_until(lambda: line_count(metrics) >= 3, proc, log)  # update 3 logged: update 4 is under way
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert line_count(metrics) == 3
    assert checkpoint.find_checkpoint(None, out).name == "update-2"  # metrics.jsonl is one update ahead of it

    # Starting over an unfinished run by mistake is refused; so is resuming with a key that changes the result
    # (argparse hands `--resume KEY=VALUE` the override: it must still count as one).
    assert main(["ppo", str(config_path)]) == 2
    assert "unfinished run" in capsys.readouterr().err
    assert main(["ppo", str(config_path), "--resume", "ppo.learning_rate=0.5"]) == 2
    err = capsys.readouterr().err
    assert "ppo.learning_rate (checkpoint 0.001, now 0.5)" in err and "--resume-force" in err
    assert line_count(metrics) == 3  # a refused resume touches nothing

    resume_and_finish(PPOConfig.load(config_path))
    assert_same_run(out, reference)


def test_sigterm_finishes_the_update_writes_a_checkpoint_and_says_how_to_resume(model_dir, prompts_file, tmp_path, reference):
    out = tmp_path / "run"
    config_path = tmp_path / "ppo.yaml"
    tiny_ppo_config(model_dir("llama"), prompts_file, out, **RUN).save(config_path)  # save_steps 0: only the signal saves
    log = tmp_path / "stderr.txt"
    proc = _cli(config_path, log)
    _wait_until(lambda: line_count(out / "metrics.jsonl") >= 1, proc, log)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=600) == 143  # 128 + SIGTERM, the shell's convention
    stderr = log.read_text()
    done = line_count(out / "metrics.jsonl")
    assert 1 <= done < 4
    saved = checkpoint.find_checkpoint(None, out)
    assert saved.name == f"update-{done}"  # the update under way was finished, then saved
    assert f"SIGTERM: stopped after update {done}; checkpoint written to {saved}" in stderr
    assert f"resume with: ppokit ppo {config_path} --resume" in stderr
    resume_and_finish(PPOConfig.load(config_path))
    assert_same_run(out, reference)


def _signal_during_update(monkeypatch, sig, update: int, times: int = 1):
    """Send `sig` to this process `times` times while update `update` is optimising."""
    real_optimise = PPOTrainer.optimise

    def optimise(self, rollout):
        if self.state.update + 1 == update:
            for _ in range(times):
                os.kill(os.getpid(), sig)
        return real_optimise(self, rollout)

    monkeypatch.setattr(PPOTrainer, "optimise", optimise)


def test_sigint_via_the_cli_in_process(model_dir, prompts_file, tmp_path, reference, monkeypatch, capsys, sigint_handled):
    out = tmp_path / "run"
    config_path = tmp_path / "ppo.yaml"
    tiny_ppo_config(model_dir("llama"), prompts_file, out, **RUN).save(config_path)
    _signal_during_update(monkeypatch, signal.SIGINT, update=2)
    assert main(["ppo", str(config_path)]) == 130
    err = capsys.readouterr().err
    assert "SIGINT: finishing update 2" in err
    assert f"SIGINT: stopped after update 2; checkpoint written to {out / 'checkpoints' / 'update-2'}" in err
    assert f"resume with: ppokit ppo {config_path} --resume" in err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the run's handlers are gone, this test's back
    monkeypatch.undo()
    resume_and_finish(PPOConfig.load(config_path))
    assert_same_run(out, reference)


def test_a_second_signal_abandons_the_update(model_dir, prompts_file, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    config_path = tmp_path / "ppo.yaml"
    tiny_ppo_config(model_dir("llama"), prompts_file, out, save_steps=1, **RUN).save(config_path)
    _signal_during_update(monkeypatch, signal.SIGTERM, update=2, times=2)
    assert main(["ppo", str(config_path)]) == 143
    err = capsys.readouterr().err
    assert f"abandoned update 2; the last complete checkpoint is {out / 'checkpoints' / 'update-1'}" in err
    assert [p.name for p in checkpoint.list_checkpoints(out / "checkpoints")] == ["update-1"]
    assert line_count(out / "metrics.jsonl") == 1


def test_resume_refuses_config_changes_that_change_the_result(model_dir, prompts_file, tmp_path, reference):
    saved = reference / "checkpoints" / "update-4"
    changed = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "elsewhere", logging_steps=3, save_steps=5,
                              **{**RUN, "kl_horizon": 50})
    trainer = PPOTrainer(with_speed_switches(changed, **SPEED), show_progress=False)
    with pytest.raises(UserError) as refused:
        trainer.resume_from(saved)
    message = str(refused.value)
    assert "ppo.kl_horizon (checkpoint 100, now 50)" in message
    # A token budget where there was none changes the loss normalisation; the light head only float rounding.
    assert "ppo.max_tokens_per_micro_batch (checkpoint None, now 28)" in message and "lm_head_chunk_size" not in message
    # where the run is written and how often it prints or saves do not change a number: not listed
    assert "output_dir" not in message and "logging_steps" not in message and "save_steps" not in message
    assert trainer.state.update == 0  # nothing was loaded

    trainer.resume_from(saved, force=True)
    assert trainer.state.update == 4 and trainer.state.episodes_sampled == 32
    assert trainer.kl_controller.value == json.loads((saved / "trainer_state.json").read_text())["kl_controller"]["value"]
    assert (tmp_path / "elsewhere" / "metrics.jsonl").read_text() == (saved / "metrics.jsonl").read_text()

    other_data = PPOTrainer(tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "x", **RUN),
                            train_dataset=["a different prompt"] * 8, show_progress=False)
    with pytest.raises(UserError, match="data.train contents"):
        other_data.resume_from(saved)


def test_the_keys_a_resume_may_change_are_those_declared_so_with_the_key():
    # doc(..., resume=...) in ppokit.config.schema; a key without it (any key added later) is refused
    assert set(checkpoint.RESUME_RULES) == {
        "output_dir", "trust_remote_code", "ppo.logging_steps", "ppo.save_steps", "ppo.save_total_limit",
        "ppo.max_skipped_updates", "ppo.nonfinite_rollback", "ppo.max_tokens_per_micro_batch", "parallel.shard_frozen",
        "parallel.wrap_classes", "parallel.unshard_for_generation", "report_to", "run_name", "project",
        "mlflow_tracking_uri", "lm_head_chunk_size", "compile",
        "matmul_backend",  # the same products within float rounding (aten or oneDNN kernels, docs/speed.md)
        "cpu_allocator",  # which malloc serves the memory: no number changes
        "ppo.padding_free",  # the same logprobs and losses within float rounding, as lm_head_chunk_size and compile
        "ppo.shared_prompt",  # the same within float rounding, but for minibatches drawn as whole groups (docs/speed.md)
        # the vLLM engine's memory and speed settings: what it samples is the policy's, whatever they are
        "rollout.gpu_memory_utilization", "rollout.enforce_eager", "rollout.max_model_len", "rollout.sleep",
        "rollout.lora_merge",  # the same samples within float rounding (the adapter sent alone, or merged)
        # where the engine runs and how it is reached: a resumed run may find its servers elsewhere (a lost one replaced)
        "rollout.placement", "rollout.servers", "rollout.server_timeout_s", "rollout.weight_transfer",
    }
    base = PPOConfig(model="m").to_dict()
    changed = {**base, "seed": 7, "project": "other", "ppo": {**base["ppo"], "learning_rate": 1.0, "save_steps": 9}}
    assert checkpoint.config_differences(base, changed, base) == ["ppo.learning_rate (checkpoint 3e-06, now 1.0)", "seed (checkpoint 42, now 7)"]


def test_resume_may_change_a_token_budget_or_the_float_rounding_switches_but_not_the_normalisation():
    base = PPOConfig(model="m").to_dict()
    budget = lambda tokens, **top: {**base, **top, "ppo": {**base["ppo"], "max_tokens_per_micro_batch": tokens}}  # noqa: E731
    assert checkpoint.config_differences(budget(512), budget(2048, compile=True, lm_head_chunk_size=64), base) == []
    assert checkpoint.config_differences(budget(512), budget(None), base) == ["ppo.max_tokens_per_micro_batch (checkpoint 512, now None)"]


def test_checkpoint_files_cannot_run_code(model_dir, prompts_file, tmp_path, reference):
    copy = tmp_path / "update-4"
    shutil.copytree(reference / "checkpoints" / "update-4", copy)
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"state": Payload()}, copy / "optimizer.pt")
    trainer = PPOTrainer(tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run", **RUN), show_progress=False)
    with pytest.raises(UserError, match="optimizer.pt: cannot be read"):
        trainer.resume_from(copy)
    assert not marker.exists()


def test_model_weights_in_pickle_format_cannot_run_code(model_dir, tmp_path):
    """Models load through transformers, which reads .bin weights with torch.load(weights_only=True)."""
    from ppokit.models.loading import load_causal_lm

    folder = tmp_path / "model"
    shutil.copytree(model_dir("llama"), folder, ignore=shutil.ignore_patterns("*.safetensors"))
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"model.embed_tokens.weight": Payload()}, folder / "pytorch_model.bin")
    with pytest.raises(UserError, match="model: could not load .*Weights only load failed"):
        load_causal_lm(str(folder))
    assert not marker.exists()


def test_find_checkpoint_accepts_a_run_folder_and_rejects_incomplete_ones(tmp_path, reference):
    assert checkpoint.find_checkpoint(str(reference), tmp_path) == reference / "checkpoints" / "update-4"
    partial = tmp_path / "checkpoints" / "update-7"
    shutil.copytree(reference / "checkpoints" / "update-4", partial)
    (partial / "trainer_state.json").unlink()  # as if the process died before the manifest was written
    assert checkpoint.list_checkpoints(tmp_path / "checkpoints") == []
    with pytest.raises(UserError, match="not a complete checkpoint"):
        checkpoint.find_checkpoint(str(partial), tmp_path)
    with pytest.raises(UserError, match="no complete checkpoint"):
        checkpoint.find_checkpoint(None, tmp_path)


def test_adapter_weights_round_trip(model_dir, tmp_path):
    """A PEFT (LoRA) model saves adapters only; load_weights puts them back into a fresh one."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    def lora_model():
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(model_dir("llama"))
        return peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

    trained = lora_model()
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p))
    trained.save_pretrained(tmp_path / "adapter")
    assert not list((tmp_path / "adapter").glob("model*.safetensors"))  # adapters only, no base weights
    fresh = lora_model()
    checkpoint.load_weights(fresh, tmp_path / "adapter")
    want = {n: p for n, p in trained.named_parameters() if p.requires_grad}
    got = {n: p for n, p in fresh.named_parameters() if p.requires_grad}
    assert want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want)


def test_adaptive_kl_coefficient_in_the_metrics_follows_the_rule(reference):
    records = comparable(reference / "metrics.jsonl")
    target, horizon, batch = RUN["kl_target"], RUN["kl_horizon"], 8
    assert records[0]["objective/kl_coef"] == 0.05  # ppo.kl_coef is the starting value
    for before, after in zip(records, records[1:]):
        error = min(max(before["objective/kl"] / target - 1, -0.2), 0.2)
        assert after["objective/kl_coef"] == pytest.approx(before["objective/kl_coef"] * (1 + error * batch / horizon))


@pytest.mark.parametrize("value_model", ["shared", None])
def test_resume_is_exact_with_lora_critics_and_reward_normalisation(model_dir, prompts_file, tmp_path, value_model):
    """The state of every role layout (adapters on one base, a separate LoRA critic) and the reward
    normalisation statistics survive a resume."""
    from ppokit.config.schema import LoraConfig

    def config(out, **extra):
        c = tiny_ppo_config(model_dir("llama"), prompts_file, out, total_episodes=24, num_sample_generations=0, learning_rate=1e-2, **extra)
        c.lora = LoraConfig(r=4, alpha=8)
        c.value_model = value_model
        c.reward.normalize = True
        return c

    PPOTrainer(config(tmp_path / "straight"), show_progress=False).train()
    out = tmp_path / "run"
    trainer = PPOTrainer(config(out, save_steps=1), show_progress=False)
    train_until_crash_at_optimizer_step(trainer, 6)  # 4 optimiser steps per update: in update 2
    resume_and_finish(config(out, save_steps=1))
    got, want = comparable(out / "metrics.jsonl"), comparable(tmp_path / "straight" / "metrics.jsonl")
    assert [r["update"] for r in got] == [1, 2, 3]
    assert got == want


@pytest.mark.parametrize("field,value", [("update", -3), ("episode", "8"), ("skipped_updates", None), ("skipped_in_a_row", True)])
def test_training_state_with_a_wrong_counter_is_named(field, value):
    from ppokit.run.state import TrainingState

    saved = {"update": 4, "episode": 32, "skipped_updates": 0, "skipped_in_a_row": 0, "last_nonfinite": None, field: value}
    with pytest.raises(UserError, match=f"trainer_state.json: {field} must be a non-negative integer"):
        TrainingState.from_counters(saved, [], "run/checkpoints/update-4/trainer_state.json")
    restored = TrainingState.from_counters({**saved, field: 2}, [{"update": 1}], "x")
    assert restored.counters()[field] == 2 and restored.records == [{"update": 1}]


# --------------------------------------------------------------------------- damaged checkpoints, failed and forced resumes


@pytest.fixture(scope="module")
def saved_every_update(model_dir, prompts_file, tmp_path_factory):
    """A finished run of 4 updates with a checkpoint after each -> (run folder, its config file)."""
    out = tmp_path_factory.mktemp("every-update") / "run"
    config = tiny_ppo_config(model_dir("llama"), prompts_file, out, save_steps=1, **RUN)
    PPOTrainer(config, show_progress=False).train()
    path = out.parent / "ppo.yaml"
    config.save(path)
    return out, path


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".ppokit.lock"}


def _cut(file: Path, keep: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


def _state(**change):
    def edit(folder: Path) -> None:
        state = json.loads((folder / "trainer_state.json").read_text())
        for key, value in change.items():
            state.pop(key) if value is KeyError else state.__setitem__(key, value)
        (folder / "trainer_state.json").write_text(json.dumps(state))

    return edit


DAMAGE = {
    "weights cut short": (lambda c: _cut(c / "model" / "model.safetensors"),
                          "model/model.safetensors: Error while deserializing header: incomplete metadata, file not fully covered"),
    "value weights missing": (lambda c: (c / "model" / "value_model" / "model.safetensors").unlink(), "model/value_model/: no .safetensors weights"),
    "optimizer cut short": (lambda c: _cut(c / "optimizer.pt"), "optimizer.pt: not a torch.save archive (cut short or overwritten)"),
    "scheduler missing": (lambda c: (c / "scheduler.pt").unlink(), "scheduler.pt: missing"),
    "rng not rng": (lambda c: torch.save({"python": 1}, c / "rng.pt"), "rng.pt: not a list of RNG states, one per process"),
    "config missing": (lambda c: (c / "config.yaml").unlink(), "config.yaml: missing"),
    "config garbage": (lambda c: (c / "config.yaml").write_text("- this\n- is not\n- a config\n"), "config.yaml: list, not a mapping of config keys"),
    "config of another "
    "tool": (lambda c: (c / "config.yaml").write_text("learning_rate: 0.1\nepochs: "
                                                      "3\n"), "config.yaml: unknown config keys: learning_rate (did you mean ppo.learning_rate?); epochs; "
                                                              "known keys here: model, "),
    "config cut short": (lambda c: (c / "config.yaml").write_text("ppo:\n  kl_coef: [0.05\n"), "config.yaml: not valid YAML"),
    "metrics cut short": (lambda c: _cut(c / "metrics.jsonl", 0.9), "metrics.jsonl: line 4 is not valid JSON (cut short?)"),
    "metrics short of records": (lambda c: (c / "metrics.jsonl").write_text((c / "metrics.jsonl").read_text().split("\n", 1)[1]),
                                 "metrics.jsonl: 3 records for 4 updates (cut short?)"),
    "state cut short": (lambda c: _cut(c / "trainer_state.json"), "trainer_state.json: not valid JSON"),
    "state without episode": (_state(episode=KeyError), "trainer_state.json: episode must be a non-negative integer, got None"),
    "state update -3": (_state(update=-3), "trainer_state.json: update must be a non-negative integer, got -3"),
    "state processes text": (_state(processes="two"), "trainer_state.json: processes is 'two', not a positive integer"),
    "state data missing": (_state(data=KeyError), "trainer_state.json: no data"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_named_with_the_one_before_it_and_nothing_changes(saved_every_update, tmp_path, damage, capsys, monkeypatch):
    source, config_path = saved_every_update
    out = tmp_path / "run"
    shutil.copytree(source, out)
    config = tmp_path / "ppo.yaml"
    config.write_text(config_path.read_text().replace(str(source), str(out)))
    latest = out / "checkpoints" / "update-4"
    edit, detail = DAMAGE[damage]
    edit(latest)
    before = files_of(out)
    monkeypatch.setattr(PPOTrainer, "__init__", lambda *a, **k: pytest.fail("a model was loaded"))
    assert main(["ppo", str(config), "--resume", *([str(latest)] if damage == "state cut short" else [])]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"ppokit: error: checkpoint {latest} is damaged: {detail}"), line
    assert line.endswith(f"; the previous complete one is {out / 'checkpoints' / 'update-3'}"), line
    assert files_of(out) == before


def test_resume_latest_says_which_damaged_checkpoint_it_passes_over(saved_every_update, tmp_path, capsys):
    """--resume without a path used to fall back from a checkpoint whose trainer_state.json is cut short to
    the one before it without a word: it names the one skipped and why, then continues from the one before."""
    source, config_path = saved_every_update
    out = tmp_path / "run"
    shutil.copytree(source, out)
    config = tmp_path / "ppo.yaml"
    config.write_text(config_path.read_text().replace(str(source), str(out)))
    shutil.rmtree(out / "final")
    _cut(out / "checkpoints" / "update-4" / "trainer_state.json")
    (out / "checkpoints" / "update-5").mkdir()  # no trainer_state.json at all
    assert main(["ppo", str(config), "--resume"]) == 0
    err = capsys.readouterr().err.splitlines()
    latest = out / "checkpoints" / "update-3"
    assert f"ppokit: skipped checkpoint {out / 'checkpoints' / 'update-4'}: trainer_state.json is not valid JSON (cut short?); " \
           f"the latest complete one is {latest}" in err
    assert f"ppokit: skipped checkpoint {out / 'checkpoints' / 'update-5'}: no trainer_state.json; the latest complete one is {latest}" in err
    assert any(line.startswith(f"ppokit: resumed from {latest} (update 3 of 4)") for line in err)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4 and (out / "final").is_dir()
    # none complete is left: the error lists what is there
    for folder in (out / "checkpoints").glob("update-*"):
        (folder / "trainer_state.json").unlink(missing_ok=True)
    with pytest.raises(UserError, match=r"no complete checkpoint in .*checkpoints \(update-1: no trainer_state.json; update-2: no"):
        checkpoint.find_checkpoint(None, out)


def test_a_failed_resume_changes_nothing_in_the_run(saved_every_update, tmp_path):
    """A corrupt rng.pt used to be read after newer checkpoints had gone to superseded/ and metrics.jsonl was cut."""
    source, _ = saved_every_update
    out = tmp_path / "run"
    shutil.copytree(source, out)
    _cut(out / "checkpoints" / "update-2" / "rng.pt")
    before = files_of(out)
    trainer = PPOTrainer(PPOConfig.load(source.parent / "ppo.yaml", [f"output_dir={out}"]), show_progress=False)
    with pytest.raises(UserError, match=re.escape(
        f"checkpoint {out / 'checkpoints' / 'update-2'} is damaged: rng.pt: not a torch.save archive (cut short or overwritten); "
        f"the previous complete one is {out / 'checkpoints' / 'update-1'}"
    )):
        trainer.resume_from(out / "checkpoints" / "update-2")
    assert files_of(out) == before and trainer.state.update == 0


def test_resume_force_applies_a_new_learning_rate_or_refuses_what_it_cannot_apply(saved_every_update, model_dir, prompts_file, tmp_path):
    source, _ = saved_every_update
    saved = source / "checkpoints" / "update-2"
    straight = comparable(source / "metrics.jsonl")
    changed = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run", **{**RUN, "learning_rate": 5e-4, "adam_epsilon": 1e-6})
    trainer = PPOTrainer(changed, show_progress=False)
    trainer.resume_from(saved, force=True)
    factor = straight[2]["lr"] / 1e-3  # the schedule's factor at update 3's first step, from the run that did not stop
    groups = trainer.optimizer.param_groups  # the policy's and the critic's (vf_learning_rate: null, the same rate)
    assert len(groups) == 2 and all(g["lr"] == pytest.approx(5e-4 * factor) and g["eps"] == 1e-6 for g in groups)
    trainer.train()
    records = comparable(tmp_path / "run" / "metrics.jsonl")
    assert [r["lr"] for r in records[2:]] == [pytest.approx(5e-4 * r["lr"] / 1e-3) for r in straight[2:]]
    recorded = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["ppo"]
    assert (recorded["learning_rate"], recorded["adam_epsilon"]) == (5e-4, 1e-6)  # the values the run used

    adaptive = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "other", **{**RUN, "kl_coef": 0.2})
    with pytest.raises(UserError, match="ppo.kl_coef is the adaptive KL controller's starting value; .* cannot take effect, even with --resume-force"):
        PPOTrainer(adaptive, show_progress=False).resume_from(saved, force=True)
    assert not (tmp_path / "other" / "metrics.jsonl").exists()


DAMAGED_TRACKERS = {
    "empty mapping": ("{}", 'is not a mapping with a "trackers" mapping in it'),
    "a list": ("[]", 'is not a mapping with a "trackers" mapping in it'),
    "entry not a mapping": ('{"trackers": {"tensorboard": 3}}', "trackers.tensorboard is 3, not a mapping"),
    "last_update text": ('{"trackers": {"tensorboard": {"last_update": "abc"}}}', "trackers.tensorboard.last_update is 'abc', not a whole number >= 0"),
    "cut short": ('{"trackers": {"tensorb', "is not valid JSON"),
}


@pytest.mark.parametrize("damage", list(DAMAGED_TRACKERS))
def test_a_damaged_trackers_file_stops_the_resume_before_it_changes_the_run(saved_every_update, tmp_path, damage, capsys):
    """trackers.json used to be read after the resume had cut metrics.jsonl to the checkpoint and moved the newer
    checkpoints to superseded/, and a damaged one then crashed with a traceback."""
    source, config_path = saved_every_update
    out = tmp_path / "run"
    shutil.copytree(source, out)
    text, detail = DAMAGED_TRACKERS[damage]
    (out / "trackers.json").write_text(text)
    before = files_of(out)
    assert main(["ppo", str(config_path), f"output_dir={out}", "report_to=[tensorboard]", "--resume",
                 str(out / "checkpoints" / "update-2")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("ppokit: error:")]
    assert errors == [f"ppokit: error: {out / 'trackers.json'}: {detail}; it records which updates each tracker of report_to was sent. "
                      "Restore it, or delete it to have the trackers start new runs and be sent every update of the run again"], err
    assert files_of(out) == before


def test_a_resume_sets_the_abandoned_timelines_final_model_aside(saved_every_update, tmp_path):
    """A resumed run killed before writing its own final/ used to keep the earlier run's, and the folder looked
    finished. final/ moves to checkpoints/superseded/ with the newer checkpoints; the folder is an unfinished run."""
    source, config_path = saved_every_update
    out = tmp_path / "run"
    shutil.copytree(source, out)
    final = (out / "final" / "model.safetensors").read_bytes()
    trainer = PPOTrainer(PPOConfig.load(config_path, [f"output_dir={out}"]), show_progress=False)
    trainer.resume_from(out / "checkpoints" / "update-2")
    assert not (out / "final").exists()
    assert (out / "checkpoints" / "superseded" / "final" / "model.safetensors").read_bytes() == final
    assert run_dir.holds_run(out) == "an unfinished run (checkpoint update-2 of 4 updates)"
