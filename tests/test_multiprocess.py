"""Several processes on CPU (torchrun, gloo): the run completes without hanging, the batch is split
across processes, metrics are reduced over them, and the main process alone writes the run directory;
the pieces of ppokit.parallel (FSDP2) checked by tests/parallel_checks.py under 1 and 2 processes."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

TORCHRUN = shutil.which("torchrun")
CHECKS = Path(__file__).with_name("parallel_checks.py")
needs_torchrun = pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not on PATH")


def _env(use_cpu: bool = True) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env["PYTHONPATH"]]) if env.get("PYTHONPATH") else src
    if use_cpu:
        env["ACCELERATE_USE_CPU"] = "true"
    return env


def _config(model_dir, prompts_file, tmp_path):
    config = tmp_path / "ppo.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(model_dir("llama")), "output_dir": str(tmp_path / "run"),
        "reward": {"functions": ["sentiment"]}, "data": {"train": str(prompts_file)},
        "ppo": {"total_episodes": 32, "per_device_train_batch_size": 4, "num_mini_batches": 2, "num_ppo_epochs": 2,
                "response_length": 8, "learning_rate": 1e-3, "num_sample_generations": 1, "save_steps": 1},
    }))
    return config


def _launch(config, *extra, use_cpu=True):
    command = [TORCHRUN, "--nproc_per_node", "2", "-m", "ppokit", "ppo", str(config), *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=_env(use_cpu))


@needs_torchrun
def test_two_process_cpu_run_with_checkpoints_and_resume(model_dir, prompts_file, tmp_path):
    config = _config(model_dir, prompts_file, tmp_path)
    result = _launch(config)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # 2 processes x 4 per device x 2 minibatches = 16 episodes per update: 2 updates of 32 episodes
    assert [(r["update"], r["episode"]) for r in records] == [(1, 16), (2, 32)]
    assert len(result.stdout.strip().splitlines()) == 1  # one summary line, from the main process
    assert (tmp_path / "run" / "final" / "value_model").is_dir()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith("update-")) == ["update-1", "update-2"]
    # resuming a finished run trains nothing and says so, on every process, without hanging
    resumed = _launch(config, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "nothing left to train" in resumed.stderr
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


@needs_torchrun
def test_processes_that_do_not_see_each_other_refuse_to_share_a_run_directory(model_dir, prompts_file, tmp_path):
    result = _launch(_config(model_dir, prompts_file, tmp_path), use_cpu=False)  # on CPU accelerate then sees 1 process each
    assert result.returncode != 0
    assert "launched as 2 processes (WORLD_SIZE) but accelerate sees 1" in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# --------------------------------------------------------------------------- ppokit.parallel pieces


@pytest.fixture(scope="module")
def parallel_checks(tmp_path_factory):
    """tests/parallel_checks.py as one process (FSDP over a mesh of one), then as two processes that
    also read the one-process DCP checkpoint (resharding 1 -> 2). Returns (one, two) result folders."""
    if TORCHRUN is None:
        pytest.skip("torchrun is not on PATH")
    one, two = tmp_path_factory.mktemp("fsdp-1"), tmp_path_factory.mktemp("fsdp-2")
    for command, out in (([sys.executable, str(CHECKS), str(one)], one),
                         ([TORCHRUN, "--nproc_per_node", "2", str(CHECKS), str(two), str(one)], two)):
        result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=_env())
        assert result.returncode == 0, result.stderr[-4000:]
    return one, two


def _results(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())


def test_fsdp_step_equals_ddp_step(parallel_checks):
    """3 optimiser steps of forward/backward (2 micro-batches), clipping and AdamW, different rows per process."""
    for folder in parallel_checks:
        step = _results(folder)["step"]
        assert step["max_weight_change"] > 1e-2  # the weights did move
        assert step["max_weight_difference"] < 1e-5
        assert step["fsdp_grad_norms"] == pytest.approx(step["ddp_grad_norms"], rel=1e-5)


def test_fsdp_holds_half_of_the_trainable_state_per_process(parallel_checks):
    shards = _results(parallel_checks[1])["shards"]
    full = shards["0"]["full_elements"]
    assert sum(s["local_elements"] for s in shards.values()) == full
    for s in shards.values():
        assert s["local_elements"] <= full / 2 + 64  # dim-0 shards: a few rows of padding at most
        assert s["optimizer_elements"] == 2 * s["local_elements"]  # AdamW's two moments, sharded alike


def test_generation_under_sharding_gathers_once_per_rollout(parallel_checks):
    for rank, g in _results(parallel_checks[1])["generation"].items():
        assert g["same_tokens_as_whole"] and g["lazy_same_tokens_as_whole"], rank
        assert g["all_gathers_unshard_once"] == g["units"]  # each unit once for the whole rollout
        # without it: every decoder layer again at every one of the 6 decoded tokens
        assert g["all_gathers_per_layer"] >= 6 * (g["units"] - 1)
        assert g["resharded"]


def test_dcp_checkpoint_round_trip_and_resharding(parallel_checks):
    one, two = parallel_checks
    dcp = _results(two)["dcp"]
    assert [f for f in dcp["files"] if f.endswith(".distcp")] == ["__0_0.distcp", "__1_0.distcp"]  # one per process
    assert dcp["moved_by_next_step"] > 1e-4
    assert dcp["reloaded_vs_saved"] == 0.0 and dcp["next_step_vs_replay"] == 0.0
    assert dcp["replayed_grad_norm"] == dcp["next_grad_norm"]
    reshard = _results(two)["reshard"]
    assert reshard == {"from_processes": 1, "max_difference_to_saved": 0.0}


def test_consolidated_save_loads_with_transformers_alone(parallel_checks):
    """final/-style folders written from the sharded model load in a process that imports neither
    ppokit nor torch.distributed's process groups, and hold exactly the full weights."""
    two = parallel_checks[1]
    loaded = two / "loaded.pt"
    probe = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification\n"
        f"policy = AutoModelForCausalLM.from_pretrained({str(two / 'policy')!r})\n"
        f"value = AutoModelForSequenceClassification.from_pretrained({str(two / 'value_model')!r})\n"
        f"AutoModelForCausalLM.from_pretrained({str(two / 'lora_merged')!r})\n"
        "assert 'ppokit' not in sys.modules and not torch.distributed.is_initialized()\n"
        "assert policy.lm_head.weight.data_ptr() == policy.model.embed_tokens.weight.data_ptr()\n"
        f"torch.save({{'policy': policy.state_dict(), 'value_model': value.state_dict()}}, {str(loaded)!r})\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    full, saved = torch.load(two / "consolidated.pt"), torch.load(loaded)
    for role in ("policy", "value_model"):
        for name, tensor in saved[role].items():
            assert torch.equal(tensor, full[f"{role}.{name}"]), (role, name)
    assert not torch.equal(full["policy.model.norm.weight"], torch.load(two / "at_save.pt")["policy.model.norm.weight"])


def test_sharded_lora_run_saves_adapter_and_merged_model(parallel_checks):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(CHECKS.parent))
    import parallel_checks as checks
    from ppokit.models import response_logits
    from ppokit.tiny import word_tokenizer

    two = parallel_checks[1]
    assert _results(two)["lora"]["max_weight_difference"] < 1e-5  # LoRA under FSDP trains as under DDP
    tokenizer = word_tokenizer([" ".join(checks.WORDS)])
    ids, mask = checks.rows(tokenizer, 0)
    expected = torch.load(two / "lora_logits.pt")
    merged = AutoModelForCausalLM.from_pretrained(two / "lora_merged")
    torch.manual_seed(0)
    base = checks.tiny_causal_lm("llama", tokenizer, hidden=32, layers=2, heads=4)
    adapter = PeftModel.from_pretrained(base, two / "lora_policy")
    with torch.inference_mode():
        for model in (merged, adapter):
            assert torch.allclose(response_logits(model, ids, mask, checks.RESPONSE), expected, atol=1e-5)
