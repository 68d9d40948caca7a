"""Several processes on CPU (torchrun, gloo): the run completes without hanging, the batch is split
across processes, metrics are reduced over them, and the main process alone writes the run directory;
the pieces of ppokit.process.parallel (FSDP2) checked by tests/parallel_checks.py under 1 and 2 processes."""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import assert_float32_close

from ppokit.process import parallel

# The torchrun of the environment running the tests (a venv's, as .ci/vllm-env's), else the one on PATH.
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
CHECKS = Path(__file__).with_name("parallel_checks.py")
needs_torchrun = pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not on PATH")


def _env(use_cpu: bool = True) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env["PYTHONPATH"]]) if env.get("PYTHONPATH") else src
    if use_cpu:
        env["ACCELERATE_USE_CPU"] = "true"
    return env


WALL_CLOCK = ("eps", "time/")
# Metrics that count tokens on either side of a threshold: a value at the clip boundary can fall either
# way with float rounding (val/clipfrac_avg compares old + clamp(new - old) with new, which differ by
# rounding even inside the range), so two strategies may differ by a token here and there.
COUNTS = ("val/clipfrac_avg", "policy/clipfrac_avg")


def _config(model_dir, prompts_file, folder: Path, strategy: str = "ddp", **ppo) -> Path:
    """4 updates of 16 episodes (2 processes x 4 per device x 2 minibatches), a checkpoint every 2."""
    config = folder / f"ppo-{strategy}.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(model_dir("llama")), "output_dir": str(folder / f"run-{strategy}"),
        # eval prompts: sample generations sample (under fsdp: gather the policy) inside inference mode too
        "reward": {"functions": ["sentiment"]}, "data": {"train": str(prompts_file), "eval": str(prompts_file)},
        "parallel": {"strategy": strategy},
        "ppo": {"total_episodes": 64, "per_device_train_batch_size": 4, "num_mini_batches": 2, "num_ppo_epochs": 2,
                "response_length": 8, "learning_rate": 1e-3, "num_sample_generations": 2, "save_steps": 2, **ppo},
    }))
    return config


def _launch(config, *extra, use_cpu=True, processes=2, port=None, env=None):
    """port: the rendezvous's (default a free one, so that runs beside other tests or a CI run never meet at torchrun's
    29500); env: variables added to the processes' environment."""
    command = [*_torchrun(processes, port), "-m", "ppokit", "ppo", str(config), *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=900, env={**_env(use_cpu), **(env or {})})


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _comparable(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)} for r in _records(run_dir)]


@pytest.fixture(scope="module")
def runs(model_dir, prompts_file, tmp_path_factory):
    """The same 2-process run under ddp and under fsdp: {strategy: (config path, run directory)}."""
    if TORCHRUN is None:
        pytest.skip("torchrun is not on PATH")
    folder = tmp_path_factory.mktemp("runs")
    out = {}
    for strategy in ("ddp", "fsdp"):
        config = _config(model_dir, prompts_file, folder, strategy)
        result = _launch(config)
        assert result.returncode == 0, result.stderr[-3000:]
        assert len(result.stdout.strip().splitlines()) == 1  # one summary line, from the main process
        out[strategy] = (config, folder / f"run-{strategy}")
    return out


def test_two_process_cpu_run_with_checkpoints_and_resume(runs):
    config, run = runs["ddp"]
    # 2 processes x 4 per device x 2 minibatches = 16 episodes per update: 4 updates of 64 episodes
    assert [(r["update"], r["episode"]) for r in _records(run)] == [(1, 16), (2, 32), (3, 48), (4, 64)]
    assert (run / "final" / "value_model").is_dir()
    assert all(-1.0 <= r["val/explained_variance"] <= 1.0 for r in _records(run))  # reduced over both processes' tokens
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("update-")) == ["update-2", "update-4"]
    # The main process alone holds the run lock (a second holder would have stopped with "in use by another ppokit run").
    assert len((run / ".ppokit.lock").read_text().split()) == 1
    # resuming a finished run trains nothing and says so, on every process, without hanging
    resumed = _launch(config, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "nothing left to train" in resumed.stderr
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4


def _optimizer_steps(checkpoint_dir: Path) -> set[int]:
    state = torch.load(checkpoint_dir / "optimizer.pt", weights_only=True)["state"]
    return {int(s["step"]) for s in state.values()}


def test_two_processes_follow_the_one_process_learning_rate_schedule(runs, model_dir, prompts_file, tmp_path):
    """The same global batch (16) on one process: the lr column, update by update, and the number of
    optimiser steps are the same. (accelerate's scheduler wrapper once stepped the schedule once per
    process per step: with 2 processes the rate reached 0 halfway through the run.)"""
    from ppokit.config.schema import PPOConfig
    from ppokit.trainer import PPOTrainer

    config_path, run = runs["ddp"]
    one = PPOConfig.load(config_path, [f"output_dir={tmp_path / 'one'}", "ppo.per_device_train_batch_size=8"])
    PPOTrainer(one, show_progress=False).train()
    two_lr, one_lr = [r["lr"] for r in _records(run)], [r["lr"] for r in _records(tmp_path / "one")]
    print(f"lr, 1 process: {one_lr}\nlr, 2 processes: {two_lr}")  # shown with pytest -s
    assert two_lr == one_lr == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4])
    steps = 4 * 2 * 2  # updates x epochs x minibatches
    assert _optimizer_steps(run / "checkpoints" / "update-4") == _optimizer_steps(tmp_path / "one" / "checkpoints" / "update-4") == {steps}


def test_ddp_and_fsdp_give_the_same_metrics(runs):
    """Same samples, gradients equal up to float rounding: every metric within 1e-4 relative over 4 updates."""
    ddp, fsdp = _comparable(runs["ddp"][1]), _comparable(runs["fsdp"][1])
    assert [r["update"] for r in fsdp] == [1, 2, 3, 4] and set(ddp[0]) == set(fsdp[0])
    worst = {}
    for d, f in zip(ddp, fsdp):
        for key in d:
            if key in COUNTS:
                assert f[key] == pytest.approx(d[key], abs=0.02), key  # a token or two either side of a clip boundary
            else:
                assert f[key] == pytest.approx(d[key], rel=1e-4, abs=1e-6), key
                worst[key] = max(worst.get(key, 0.0), abs(f[key] - d[key]) / max(abs(d[key]), 1e-12))
    print("largest relative differences:", sorted(worst.items(), key=lambda kv: -kv[1])[:6])
    # the same completions were sampled and scored
    assert (runs["ddp"][1] / "samples.jsonl").read_text() == (runs["fsdp"][1] / "samples.jsonl").read_text()


def test_ddp_with_padding_free_forwards_gives_the_padded_metrics(runs, model_dir, prompts_file, tmp_path):
    """ppo.padding_free under ddp, 2 processes (one forward of both models per micro-batch): every metric equals the
    padded ddp run's within float rounding, as fsdp's does, with less padding processed."""
    result = _launch(_config(model_dir, prompts_file, tmp_path, "ddp", padding_free=True))
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_padded_metrics(runs["ddp"][1], tmp_path / "run-ddp")


def _assert_padded_metrics(padded_run: Path, packed_run: Path, packed: bool = True) -> None:
    """A padding-free run's metrics equal the padded run's, update by update, with less padding processed. The forwards
    differ only in float32 summation order (a few ulps of each hidden state, the logits and gradients after them, against
    metrics of order 1e-2..1e1): 1e-4 relative leaves room for that rounding through 4 updates of AdamW, whose steps
    are lr-sized whatever the gradient's size; counts may move by a token at a clip boundary. packed False: two runs of
    the same layout (a compiled and an eager one), the same rule and the same padding."""
    padded, other = _comparable(padded_run), _comparable(packed_run)
    assert [r["update"] for r in other] == [1, 2, 3, 4] and set(other[0]) == set(padded[0])
    for d, f in zip(padded, other):
        for key in d:
            if key == "perf/padding_share" and packed:
                assert f[key] <= d[key]
            elif key in COUNTS:
                assert f[key] == pytest.approx(d[key], abs=0.02), key  # a token or two either side of a clip boundary
            else:
                assert f[key] == pytest.approx(d[key], rel=1e-4, abs=1e-6), key
    if packed:
        assert sum(r["perf/padding_share"] for r in other) < sum(r["perf/padding_share"] for r in padded)


@pytest.mark.parametrize("variant", ["full", "lora"])
def test_fsdp_with_padding_free_forwards_gives_the_padded_metrics(request, model_dir, prompts_file, tmp_path, variant):
    """ppo.padding_free under fsdp, 2 processes: the tiny Llama's head is tied to its embeddings, so both sit in the
    root unit that FSDP gathers only in the model's own forward; the packed policy and reference forwards run the head
    there. Every metric equals the padded fsdp run's within float rounding over 4 updates. full: every weight trained
    (the tied head's gradients reduce-scattered), with the memory-light head (lm_head_chunk_size) on the packed rows;
    lora: adapters, the critic on the policy's base (value_model: shared, read through the causal LM's forward)."""
    for name in ("padded", "packed"):
        (tmp_path / name).mkdir()
    if variant == "full":
        padded_run = request.getfixturevalue("runs")["fsdp"][1]  # the module's padded fsdp run
        config = _config(model_dir, prompts_file, tmp_path / "packed", "fsdp", padding_free=True)
        config.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()), "lm_head_chunk_size": 3}))
    else:
        lora = {"lora": {"r": 4, "alpha": 8}, "value_model": "shared"}
        configs = [_config(model_dir, prompts_file, tmp_path / name, "fsdp", padding_free=name == "packed") for name in ("padded", "packed")]
        for config in configs:
            config.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()), **lora}))
        result = _launch(configs[0])
        assert result.returncode == 0, result.stderr[-3000:]
        padded_run, config = tmp_path / "padded" / "run-fsdp", configs[1]
    result = _launch(config)
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_padded_metrics(padded_run, tmp_path / "packed" / "run-fsdp")


@pytest.mark.slow
def test_a_compiled_fsdp_run_gives_the_eager_fsdp_metrics(model_dir, prompts_file, tmp_path):
    """compile: true under fsdp, 2 processes: the tiny Llama's head is tied to its embeddings, in the root unit FSDP
    gathers only in the causal LM's own forward, so the compiled backbone runs inside that forward (calling it on its
    own met sharded embeddings at the first training forward). Every metric equals the eager fsdp run's within float
    rounding over 4 updates (inductor's kernels sum in their own order). GRPO, no critic: the graphs inductor wrote
    with the decoder layers' norm in them are the policy's, so its backbone was compiled, not run eagerly."""
    for name, compiled in (("eager", False), ("compiled", True)):
        (tmp_path / name).mkdir()
        config = _config(model_dir, prompts_file, tmp_path / name, "fsdp", advantage_estimator="grpo", num_samples_per_prompt=2)
        config.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()), "compile": compiled}))
        result = _launch(config, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / name / "inductor")})
        assert result.returncode == 0, result.stderr[-3000:]
    def compiled_rms_norms(name):  # the Llama's RMSNorm (x * rsqrt(mean(x^2) + eps)); compile's probe at start is a tanh
        return [path for path in (tmp_path / name / "inductor").rglob("*") if path.is_file() and b"rsqrt" in path.read_bytes()]

    assert compiled_rms_norms("compiled") and not compiled_rms_norms("eager")
    _assert_padded_metrics(tmp_path / "eager" / "run-fsdp", tmp_path / "compiled" / "run-fsdp", packed=False)


def test_fsdp_with_the_shared_prompt_gives_the_ddp_metrics(model_dir, prompts_file, tmp_path):
    """ppo.shared_prompt under fsdp, 2 processes (GRPO, groups of 2): a group's rows are one row with a 4-D mask, its
    policy and reference forwards inside the causal LM's own forward (the tied head in FSDP's root unit). Every metric
    equals the same run's under ddp within float rounding over 4 updates, the same samples scored. (Against the separate
    layout a run differs by design: that shuffle draws rows one by one, other minibatches and other random draws; the
    logprobs and gradients of both layouts under fsdp are checked equal in parallel_checks.)"""
    grpo = dict(advantage_estimator="grpo", num_samples_per_prompt=2, shared_prompt=True)
    for strategy in ("ddp", "fsdp"):
        result = _launch(_config(model_dir, prompts_file, tmp_path, strategy, **grpo))
        assert result.returncode == 0, result.stderr[-3000:]
    _assert_padded_metrics(tmp_path / "run-ddp", tmp_path / "run-fsdp", packed=False)
    assert (tmp_path / "run-ddp" / "samples.jsonl").read_text() == (tmp_path / "run-fsdp" / "samples.jsonl").read_text()


def test_an_fsdp_checkpoint_is_sharded_and_final_is_one_plain_model(runs):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    run = runs["fsdp"][1]
    saved = run / "checkpoints" / "update-2"
    assert sorted(p.name for p in (saved / "sharded").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (saved / "model").exists() and not (saved / "optimizer.pt").exists()
    assert json.loads((saved / "trainer_state.json").read_text())["parallel"] == {"strategy": "fsdp", "weights": "sharded"}
    policy = AutoModelForCausalLM.from_pretrained(run / "final")
    AutoModelForSequenceClassification.from_pretrained(run / "final" / "value_model")
    ddp_policy = AutoModelForCausalLM.from_pretrained(runs["ddp"][1] / "final")
    for (name, a), b in zip(policy.state_dict().items(), ddp_policy.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-5), name  # the same training, consolidated


def test_resume_refuses_another_strategy_or_process_count(runs, capsys, tmp_path):
    from ppokit.cli import main

    ddp_config, _ = runs["ddp"]
    fsdp_config, fsdp_run = runs["fsdp"]
    checkpoint = fsdp_run / "checkpoints" / "update-2"
    # Into new folders: resuming another folder's checkpoint over a run of the folder's own is refused before all this.
    elsewhere = [f"output_dir={tmp_path / 'a'}"]
    # an fsdp checkpoint resumed under ddp: refused, --resume-force or not (the files are another layout)
    assert main(["ppo", str(ddp_config), *elsewhere, "--resume", str(checkpoint), "--resume-force"]) == 2
    err = capsys.readouterr().err
    assert "the checkpoint was written under parallel.strategy fsdp and this run uses ddp" in err
    # the same strategy with another process count: refused naming both counts, unless --resume-force
    assert main(["ppo", str(fsdp_config), "parallel.strategy=ddp", f"output_dir={tmp_path / 'b'}", "--resume",
                 str(runs["ddp"][1] / "checkpoints" / "update-2")]) == 2
    err = capsys.readouterr().err
    assert "processes (checkpoint 2, now 1)" in err and "--resume-force" in err


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun(processes: int = 2, port: int | None = None) -> list[str]:
    """torchrun on one machine, its rendezvous on `port` (default: a free one)."""
    return [TORCHRUN, "--nproc_per_node", str(processes), "--master_port", str(port or _free_port())]


def _two_nodes(config: Path, *extra: str, log: Path, per_node=((), ())) -> list[subprocess.Popen]:
    """Two "nodes" of one process each on this machine, meeting at a rendezvous on a loopback port:
    what `torchrun --nnodes 2 --node_rank R --master_addr HOST --master_port PORT` does across machines.
    per_node: more arguments for node 0 and node 1."""
    port = _free_port()
    return [
        subprocess.Popen(
            [TORCHRUN, "--nnodes", "2", "--node_rank", str(rank), "--nproc_per_node", "1", "--master_addr", "127.0.0.1",
             "--master_port", str(port), "-m", "ppokit", "ppo", str(config), *extra, *per_node[rank]],
            env=_env(), stdout=subprocess.DEVNULL, stderr=log.with_suffix(f".{rank}").open("w"), start_new_session=True,
        )
        for rank in (0, 1)
    ]


def _wait(nodes: list[subprocess.Popen], log: Path, timeout: float = 240) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(n.poll() is None for n in nodes) and time.monotonic() < deadline:
        time.sleep(0.05)
    for n in nodes:
        if n.poll() is None:
            os.killpg(n.pid, signal.SIGKILL)
            raise AssertionError(f"two-node run timed out:\n{log.with_suffix('.0').read_text()[-3000:]}")
    return [n.returncode for n in nodes]


def test_two_nodes_fsdp_killed_after_a_checkpoint_and_resumed_equal_the_straight_run(runs, tmp_path):
    """Two one-process "nodes" run the fsdp config; both are killed with SIGKILL during update 4 (after the
    checkpoint of update 2), resumed on two nodes, and the run's metrics.jsonl and samples.jsonl are the
    straight single-node 2-process run's, every key but wall-clock time."""
    config_path, straight = runs["fsdp"]
    config = yaml.safe_load(config_path.read_text())
    config["output_dir"] = str(tmp_path / "run")
    (tmp_path / "ppo.yaml").write_text(yaml.safe_dump(config))
    log, metrics = tmp_path / "node", tmp_path / "run" / "metrics.jsonl"
    nodes = _two_nodes(tmp_path / "ppo.yaml", log=log)
    deadline = time.monotonic() + 900
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):  # update 3 logged: 4 under way
        assert all(n.poll() is None for n in nodes) and time.monotonic() < deadline, log.with_suffix(".0").read_text()[-3000:]
        time.sleep(0.005)
    for n in nodes:
        os.killpg(n.pid, signal.SIGKILL)  # the launcher and its worker, on both nodes
    assert _wait(nodes, log) == [-signal.SIGKILL] * 2
    assert len(metrics.read_text().splitlines()) == 3
    from ppokit.run import checkpoint

    assert checkpoint.find_checkpoint(None, tmp_path / "run").name == "update-2"

    assert _wait(_two_nodes(tmp_path / "ppo.yaml", "--resume", log=log), log) == [0, 0], log.with_suffix(".0").read_text()[-3000:]
    assert "resumed from" in log.with_suffix(".0").read_text()
    assert _comparable(tmp_path / "run") == _comparable(straight)
    assert (tmp_path / "run" / "samples.jsonl").read_text() == (straight / "samples.jsonl").read_text()
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()


@needs_torchrun
def test_two_nodes_whose_output_dirs_are_not_one_folder_refuse_together(model_dir, prompts_file, tmp_path):
    """Node 1's output_dir is not the folder node 0 writes in (as two machines without a shared file system):
    under fsdp each node used to write its shards of every checkpoint into its own folder and exit 0, node 0's
    checkpoints marked complete without node 1's shards. Both stop before training, with the same one line."""
    config = _config(model_dir, prompts_file, tmp_path, "fsdp", total_episodes=16, save_steps=0, num_sample_generations=0)
    log = tmp_path / "node"
    nodes = _two_nodes(config, log=log, per_node=([f"output_dir={tmp_path / 'node-0'}"], [f"output_dir={tmp_path / 'node-1'}"]))
    assert _wait(nodes, log) == [1, 1]  # torchrun's status when its process exits non-zero
    lines = [_error_lines(log.with_suffix(f".{rank}").read_text()) for rank in (0, 1)]
    assert lines[0] == lines[1] and len(lines[0]) == 1, lines
    assert lines[0][0].startswith(f"ppokit: error: process 1: output_dir: this process (on {socket.gethostname()}) does not see the run "
                                  f"folder {tmp_path / 'node-0'} that process 0 writes in, at {tmp_path / 'node-1'} (its output_dir)"), lines[0]
    for rank in (0, 1):
        assert not _worker_tracebacks(log.with_suffix(f".{rank}").read_text())
    assert not (tmp_path / "node-0" / "metrics.jsonl").exists() and not (tmp_path / "node-0" / parallel.SHARED_MARKER).exists()


@needs_torchrun
def test_processes_that_do_not_see_each_other_refuse_to_share_a_run_directory(model_dir, prompts_file, tmp_path):
    result = _launch(_config(model_dir, prompts_file, tmp_path), use_cpu=False)  # on CPU accelerate then sees 1 process each
    assert result.returncode != 0
    assert "launched as 2 processes (WORLD_SIZE) but accelerate sees 1" in result.stderr
    assert not (tmp_path / "run-ddp").exists()  # README: refused "before anything is written"


def test_accelerate_launch_of_two_processes_that_starts_one_is_refused(model_dir, prompts_file, tmp_path):
    """Without GPUs, `accelerate launch --num_processes 2` (the README's line) starts one process; it once
    trained alone, with twice the updates. The real launcher, with no accelerate config file of the user's."""
    config = _config(model_dir, prompts_file, tmp_path)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "-m", "ppokit", "ppo", str(config)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**_env(use_cpu=False), "HF_HOME": str(tmp_path / "hf")})
    assert result.returncode != 0
    # accelerate (1.16) raises its CalledProcessError from a RuntimeError holding the tail of the child's stderr: the
    # child's lines come once as written, and again in the launcher's traceback that follows them.
    child_stderr = result.stderr.split("\nRuntimeError: ")[0]
    assert _error_lines(child_stderr) == [
        "ppokit: error: accelerate launch was asked for several processes but started one (MASTER_ADDR is set, WORLD_SIZE is not): "
        "without GPUs `accelerate launch --num_processes N` runs a single process; "
        "on CPU launch with: ACCELERATE_USE_CPU=true torchrun --nproc_per_node N -m ppokit ppo CONFIG"
    ]
    assert not (tmp_path / "run-ddp").exists()


# --------------------------------------------------------------------------- ppokit.process.parallel pieces


@pytest.fixture(scope="module")
def parallel_checks(tmp_path_factory):
    """tests/parallel_checks.py as one process (FSDP over a mesh of one), then as two processes that
    also read the one-process DCP checkpoint (resharding 1 -> 2). Returns (one, two) result folders."""
    if TORCHRUN is None:
        pytest.skip("torchrun is not on PATH")
    one, two = tmp_path_factory.mktemp("fsdp-1"), tmp_path_factory.mktemp("fsdp-2")
    for command, out in (([sys.executable, str(CHECKS), str(one)], one),
                         ([*_torchrun(), str(CHECKS), str(two), str(one)], two)):
        result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=_env())
        assert result.returncode == 0, result.stderr[-4000:]
    return one, two


def _results(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())


def test_fsdp_step_equals_ddp_step(parallel_checks):
    """3 optimiser steps of forward/backward (2 micro-batches), clipping and AdamW, different rows per process."""
    for folder in parallel_checks:
        step = _results(folder)["step"]
        assert step["max_weight_change"] > 1e-2  # the weights did move
        assert step["max_weight_difference"] < 1e-5 and step["offload_max_weight_difference"] < 1e-5  # parallel.cpu_offload too
        assert step["fsdp_grad_norms"] == pytest.approx(step["ddp_grad_norms"], rel=1e-5)
        assert step["offload_grad_norms"] == pytest.approx(step["ddp_grad_norms"], rel=1e-5)


def test_packed_and_light_heads_of_a_sharded_policy_equal_the_whole_policys(parallel_checks):
    """ppo.padding_free, ppo.shared_prompt (two rows with a common prompt as one row, a 4-D mask) and lm_head_chunk_size
    on a policy sharded by FSDP, its head tied to its embeddings (FSDP's root unit, gathered only in the model's own
    forward) or not: each process's logprobs, and the gradients after the reduce-scatter, equal the whole policy's padded
    computation over every process's rows; a frozen sharded copy's logprobs too."""
    for folder in parallel_checks:
        for tied, routes in torch.load(folder / "head_routes.pt").items():
            assert routes["resharded"], tied
            for name in ("packed", "light", "packed_light", "shared", "shared_light", "frozen_packed"):
                got, want = routes[name]["logprobs"]
                assert_float32_close(got, want, terms=routes["vocab"] * routes["hidden"])  # a logit sums over the hidden size, a softmax over the vocabulary
                grads = routes[name].get("grads", {})
                assert name == "frozen_packed" or {"model.embed_tokens.weight", "model.norm.weight"} <= set(grads)  # every weight
                for weight, (got, want) in grads.items():
                    assert want.abs().max() > 0, (tied, name, weight)
                    assert_float32_close(got, want, terms=routes["tokens"] * routes["hidden"], scale=want.abs().max().item())


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
        # requests stepped by each process on its own (1 request of 3 tokens here, 4 of 7-10 there): no collective
        assert g["requests_same_tokens_as_whole"] and g["requests_all_gathers"] == 0, rank
    assert sorted(g["requests_tokens"] for g in _results(parallel_checks[1])["generation"].values()) == [3, 34]


def test_dcp_checkpoint_round_trip_and_resharding(parallel_checks):
    one, two = parallel_checks
    dcp = _results(two)["dcp"]
    assert [f for f in dcp["files"] if f.endswith(".distcp")] == ["__0_0.distcp", "__1_0.distcp"]  # one per process
    assert dcp["moved_by_next_step"] > 1e-4
    assert dcp["reloaded_vs_saved"] == 0.0 and dcp["next_step_vs_replay"] == 0.0
    assert dcp["replayed_grad_norm"] == dcp["next_grad_norm"]
    rollback = _results(two)["rollback"]  # the non-finite guard's snapshot under fsdp
    assert rollback["moved"] > 1e-4 and rollback["restored_vs_before"] == 0.0
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


def test_the_shared_critic_under_fsdp_keeps_the_root_unit_gathered_and_trains_as_under_ddp(parallel_checks):
    """value_model: shared under fsdp, peft's set_adapter made to reshard every unit first as peft 0.22's does: the
    critic's switch to its adapter and back inside the training forward leaves the policy's root unit gathered for the
    backward (resharded, that backward read freed memory: SIGSEGV), and 3 steps of both roles equal ddp's, the
    critic's adapter and head trained."""
    for folder in parallel_checks:
        critic = _results(folder)["shared_critic"]
        assert critic["root_gathered_after_critic_forward"]
        assert critic["critic_adapter_moved"] and critic["critic_head_moved"]
        assert critic["max_weight_difference"] < 1e-5  # as test_fsdp_step_equals_ddp_step: float rounding through 3 AdamW steps
        assert critic["fsdp_grad_norms"] == pytest.approx(critic["ddp_grad_norms"], rel=1e-5)


def test_sharded_lora_run_saves_adapter_and_merged_model(parallel_checks):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(CHECKS.parent))
    import parallel_checks as checks
    from ppokit.models.forwards import response_logits
    from ppokit.demos.tiny import word_tokenizer

    two = parallel_checks[1]
    assert _results(two)["lora"]["max_weight_difference"] < 1e-5  # LoRA (+ gradient checkpointing) under FSDP trains as under DDP
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


REWARD_THAT_LOGS = """
import json, os

def logged_length(prompts, completions, row, **columns):
    with open({log!r} + "-" + os.environ["RANK"], "a") as f:
        f.write(json.dumps(row) + "\\n")
    return [len(c) / 40 for c in completions]
"""


@needs_torchrun
def test_two_processes_keep_each_prompts_samples_together_for_grpo(model_dir, prompts_file, tmp_path):
    """GRPO's group statistics need a prompt's n samples in one place: each process takes whole prompts."""
    log = tmp_path / "scored"
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_THAT_LOGS.format(log=str(log)))
    numbered = tmp_path / "prompts.jsonl"  # prompt texts repeat in the demo data; a row number tells the rows apart
    rows = [json.loads(line) for line in prompts_file.read_text().splitlines()]
    numbered.write_text("".join(json.dumps({**r, "row": i}) + "\n" for i, r in enumerate(rows)))
    config = _config(model_dir, numbered, tmp_path, total_episodes=32, save_steps=0, num_sample_generations=0,
                     advantage_estimator="grpo", num_samples_per_prompt=4)
    settings = yaml.safe_load(config.read_text())
    settings["reward"]["functions"] = [f"{reward}:logged_length"]
    config.write_text(yaml.safe_dump(settings))
    result = _launch(config)
    assert result.returncode == 0, result.stderr[-3000:]
    # 16 episodes per update = 4 prompts x 4 samples, 2 prompts on each process
    assert [(r["update"], r["episode"]) for r in _records(tmp_path / "run-ddp")] == [(1, 16), (2, 32)]
    calls = [[json.loads(line) for line in (tmp_path / f"scored-{rank}").read_text().splitlines()] for rank in (0, 1)]
    assert [len(c) for c in calls] == [2, 2]  # one scoring call per update on each process
    for update in range(2):
        per_process = [calls[rank][update] for rank in (0, 1)]
        for rows in per_process:
            assert len(rows) == 8 and all(rows[i] == rows[i - i % 4] for i in range(8))  # runs of 4 samples of one row
        assert not set(per_process[0]) & set(per_process[1])  # no prompt's samples are split across processes
        assert len(set(per_process[0]) | set(per_process[1])) == 4
    assert not (tmp_path / "run-ddp" / "final" / "value_model").exists()


@needs_torchrun
def test_one_process_under_torchrun_trains_as_a_plain_run(model_dir, prompts_file, tmp_path):
    """torchrun with one process, under ddp (accelerate's DDP wrapper dropped) and under fsdp (a mesh of one),
    back-propagates policy and critic one after the other like a plain `ppokit ppo` run: the same numbers."""
    runs = {}
    for strategy in ("ddp", "fsdp"):
        config = _config(model_dir, prompts_file, tmp_path, strategy, total_episodes=16, num_sample_generations=0, save_steps=0)
        result = _launch(config, processes=1)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[strategy] = _comparable(tmp_path / f"run-{strategy}")
    (tmp_path / "plain").mkdir()
    plain = _config(model_dir, prompts_file, tmp_path / "plain", "ddp", total_episodes=16, num_sample_generations=0, save_steps=0)
    result = subprocess.run([sys.executable, "-m", "ppokit", "ppo", str(plain)], capture_output=True, text=True, timeout=900,
                            env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    want = _comparable(tmp_path / "plain" / "run-ddp")
    assert len(want) == 2 and "loss/value_avg" in want[0]
    for strategy, records in runs.items():
        assert len(records) == len(want)
        for got, expected in zip(records, want):
            for key, value in expected.items():
                assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (strategy, key)


@needs_torchrun
def test_two_processes_with_the_speed_switches(model_dir, prompts_file, tmp_path):
    """Token-budget micro-batches (one all-reduce of the minibatch's tokens per minibatch, on every process
    alike) and the light LM head under ddp: the run finishes without hanging and its numbers are sane."""
    config = _config(model_dir, prompts_file, tmp_path, max_tokens_per_micro_batch=28, total_episodes=32, save_steps=0)
    data = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**data, "lm_head_chunk_size": 3}))
    result = _launch(config)
    assert result.returncode == 0, result.stderr[-3000:]
    records = _records(tmp_path / "run-ddp")
    assert [r["update"] for r in records] == [1, 2]
    assert all(0 <= r["perf/padding_share"] < 0.5 for r in records)
    assert records[0]["val/ratio"] == pytest.approx(1.0, abs=0.05)  # two epochs: the second moves away from 1 a little


REWARD_THAT_FAILS_ON_RANK_1 = """
import os, time

calls = []

def judge(prompts, completions, **columns):
    calls.append(1)
    if os.environ["RANK"] == "1" and len(calls) == {fail_at}:
        {failure}
    return [len(c) / 40 for c in completions]
"""


def _failing_on_rank_1(model_dir, prompts_file, tmp_path, failure: str, **reward) -> Path:
    """4 updates of 16 episodes without sample generations: rank 1's third scoring call (update 3) fails."""
    judge = tmp_path / "judge.py"
    judge.write_text(REWARD_THAT_FAILS_ON_RANK_1.format(fail_at=3, failure=failure))
    config = _config(model_dir, prompts_file, tmp_path, save_steps=0, num_sample_generations=0)
    settings = yaml.safe_load(config.read_text())
    settings["reward"] = {"functions": [f"{judge}:judge"], **reward}
    config.write_text(yaml.safe_dump(settings))
    return config


def _error_lines(stderr: str) -> list[str]:
    return [line[line.index("ppokit: error:"):] for line in stderr.splitlines() if "ppokit: error:" in line]  # after any progress bar


def _worker_tracebacks(stderr: str) -> list[str]:
    """Tracebacks printed by the ppokit processes; torchrun prints its own (ChildFailedError) whenever one exits non-zero."""
    blocks = stderr.split("Traceback (most recent call last):")[1:]
    return [b for b in blocks if "torchrun" not in b.strip().splitlines()[0]]


@needs_torchrun
@pytest.mark.parametrize("failure, says, reward", [
    ("raise RuntimeError('the judge is down')", "raised RuntimeError: the judge is down", {}),
    ("time.sleep(30)", "did not return within reward.timeout_s=1s", {"timeout_s": 1}),
], ids=["raises", "times-out"])
def test_a_reward_failing_on_one_process_stops_every_process_with_one_error(model_dir, prompts_file, tmp_path, failure, says, reward):
    """on_error=raise, the reward failing on rank 1 alone: both processes stop together (no hang in the next
    collective), with the same one-line error naming the process and the source, exit 2, no traceback, and
    the last complete update saved as with one process (docs/checkpoints.md)."""
    config = _failing_on_rank_1(model_dir, prompts_file, tmp_path, failure, **reward)
    started = time.monotonic()
    result = subprocess.run([*_torchrun(), "-m", "ppokit", "ppo", str(config)],
                            capture_output=True, text=True, timeout=900, env=_env())
    print(f"stopped after {time.monotonic() - started:.0f} s")
    assert result.returncode != 0
    assert not _worker_tracebacks(result.stderr), result.stderr[-3000:]
    # torchrun's report: the first process to leave exited with 2; it left only once every process had stopped
    # (torchrun may still end the other while its interpreter shuts down, after it has said why)
    assert "exitcode  : 2" in result.stderr.split("Root Cause")[1].split("=====")[0], result.stderr[-3000:]
    lines = _error_lines(result.stderr)
    assert len(lines) == 2 and lines[0] == lines[1], result.stderr[-3000:]  # every process, the same line
    run = tmp_path / "run-ddp"
    assert "process 1" in lines[0] and "reward function judge" in lines[0] and says in lines[0], lines[0]
    assert lines[0].endswith(f"Updates 1-2 are saved in {run / 'checkpoints' / 'update-2'}; fix the cause and continue with --resume")
    assert [r["update"] for r in _records(run)] == [1, 2]
    assert not (run / "final").exists()
    if "raise" in failure:  # the checkpoint is one to continue from: rank 1's judge fails only at its third call
        resumed = _launch(config, "--resume")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert [r["update"] for r in _records(run)] == [1, 2, 3, 4] and (run / "final").is_dir()


REWARD_THAT_SKIPS = """
import os

batches = []

def judge(prompts, completions, **columns):
    if len(completions) > 1:  # a batch; rows scored alone come only after a batch failed (on_error: skip)
        batches.append(1)
    if (len(batches) == 2 and os.environ["RANK"] == "1") or len(batches) == 3:
        raise RuntimeError("the judge is down")
    return [len(c) / 40 for c in completions]
"""


@needs_torchrun
def test_rows_skipped_on_one_process_keep_the_processes_in_step(model_dir, prompts_file, tmp_path):
    """on_error=skip: in update 2 every row of rank 1 fails, in update 3 every row of both. The processes
    decide alike: update 2 trains on rank 0's rows (the verdict "no row scored" is over all processes) and
    counts rank 1's 8 dropped rows; update 3 is skipped by both; the run ends normally."""
    judge = tmp_path / "judge.py"
    judge.write_text(REWARD_THAT_SKIPS)
    config = _config(model_dir, prompts_file, tmp_path, save_steps=0, num_sample_generations=0)
    settings = yaml.safe_load(config.read_text())
    settings["reward"] = {"functions": [f"{judge}:judge"], "on_error": "skip"}
    config.write_text(yaml.safe_dump(settings))
    result = _launch(config)
    assert result.returncode == 0, result.stderr[-3000:]
    records = _records(tmp_path / "run-ddp")
    assert [r["update"] for r in records] == [1, 2, 3, 4]
    assert [r.get("reward/skipped") for r in records] == [0, 8, None, 0]  # over both processes' rows
    assert [r["skipped_updates"] for r in records] == [0, 0, 1, 1] and records[2]["nonfinite/score"] == 1
    assert all(r["loss/policy_avg"] == r["loss/policy_avg"] for r in records if "loss/policy_avg" in r)  # finite: rank 1's empty share adds nothing
    assert (tmp_path / "run-ddp" / "final").is_dir()


def _children(pid: int) -> set[int]:
    found = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found |= {int(c) for c in (task / "children").read_text().split()}
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except (OSError, IndexError):
        return False


@needs_torchrun
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_processes_whose_launcher_is_killed_while_starting_exit_and_release_the_run_lock(model_dir, prompts_file, tmp_path):
    """SIGKILL of torchrun's agent while its processes start: they waited 30 minutes in the rendezvous for the
    agent's store, holding the run lock. Now each ends with its launcher (launcher.follow_launcher)."""
    import fcntl

    config = _config(model_dir, prompts_file, tmp_path, total_episodes=16, save_steps=0, num_sample_generations=0)
    agent = subprocess.Popen([*_torchrun(), "-m", "ppokit", "ppo", str(config)], env=_env(),
                             stdout=subprocess.DEVNULL, stderr=(tmp_path / "stderr").open("w"), start_new_session=True)
    deadline = time.monotonic() + 240
    while len(ranks := _children(agent.pid)) < 2:
        assert agent.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()[-3000:]
        time.sleep(0.05)
    time.sleep(1.0)  # the processes are importing, or waiting in the rendezvous
    agent.kill()
    agent.wait()
    deadline = time.monotonic() + 240  # a loaded machine takes a while to import torch: the process may check only then
    while any(_alive(p) for p in ranks):
        if time.monotonic() > deadline:
            for p in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            raise AssertionError(f"processes {sorted(ranks)} outlived their launcher:\n{(tmp_path / 'stderr').read_text()[-3000:]}")
        time.sleep(0.1)
    lock = tmp_path / "run-ddp" / ".ppokit.lock"
    if lock.exists():  # the main process had taken it: released with the process
        with lock.open() as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert "Traceback" not in (tmp_path / "stderr").read_text()


DAMAGED_SHARDS = {
    "deleted": (lambda f: f.unlink(), "sharded/__1_0.distcp: missing"),
    "cut in half": (lambda f: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2]), "sharded/__1_0.distcp: cut short ("),
}


@pytest.mark.parametrize("damage", list(DAMAGED_SHARDS))
def test_a_damaged_shard_is_named_with_the_checkpoint_before_it(runs, tmp_path, damage, capsys):
    """A shard deleted or cut short used to end the resume in a traceback (DCP's CheckpointException is a
    BaseException): now the one-process message, found before any model loads, and nothing changes."""
    from ppokit.cli import main

    config, source = runs["fsdp"]
    run = tmp_path / "run"
    shutil.copytree(source, run)
    edit, detail = DAMAGED_SHARDS[damage]
    edit(run / "checkpoints" / "update-4" / "sharded" / "__1_0.distcp")
    before = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".ppokit.lock"}
    assert main(["ppo", str(config), f"output_dir={run}", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = [line for line in err.splitlines() if line.startswith("ppokit: error:")]
    assert len(line) == 1 and line[0].startswith(f"ppokit: error: checkpoint {run / 'checkpoints' / 'update-4'} is damaged: {detail}"), err
    assert line[0].endswith(f"; the previous complete one is {run / 'checkpoints' / 'update-2'}")
    assert {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".ppokit.lock"} == before


def test_a_shard_that_dcp_cannot_read_is_named_with_the_checkpoint_before_it(runs, tmp_path):
    """Whole in size but not readable (zeroed bytes): DCP's CheckpointException, a BaseException that
    `except Exception` let through, becomes the damaged-checkpoint message."""
    from ppokit.config.schema import PPOConfig
    from ppokit.errors import UserError
    from ppokit.trainer import PPOTrainer

    config, source = runs["fsdp"]
    run = tmp_path / "run"
    shutil.copytree(source, run)
    shard = run / "checkpoints" / "update-2" / "sharded" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[:-64] = bytes(len(data) - 64)
    shard.write_bytes(bytes(data))
    trainer = PPOTrainer(PPOConfig.load(config, [f"output_dir={run}"]), show_progress=False)
    with pytest.raises(UserError) as raised:
        trainer.resume_from(run / "checkpoints" / "update-2", force=True)  # one process: the count differs
    assert str(raised.value).startswith(f"checkpoint {run / 'checkpoints' / 'update-2'} is damaged: sharded/: cannot be read "
                                        "into this run's sharded model (process 0: ")
    assert str(raised.value).endswith("; there is no earlier complete checkpoint")


@needs_torchrun
def test_a_process_killed_mid_run_leaves_the_other_with_one_line(model_dir, prompts_file, tmp_path):
    """SIGKILL of process 1 while training: process 0 printed gloo's "Connection reset by peer" traceback. Now
    one line naming the process that ended and the last complete checkpoint."""
    config = _config(model_dir, prompts_file, tmp_path, save_steps=1, num_sample_generations=0)
    stderr = tmp_path / "stderr"
    agent = subprocess.Popen([*_torchrun(), "-m", "ppokit", "ppo", str(config)], env=_env(),
                             stdout=subprocess.DEVNULL, stderr=stderr.open("w"), start_new_session=True)
    run = tmp_path / "run-ddp"
    deadline = time.monotonic() + 240
    while not (run / "checkpoints" / "update-1").is_dir():
        assert agent.poll() is None and time.monotonic() < deadline, stderr.read_text()[-3000:]
        time.sleep(0.05)
    ranks = {int(p): Path(f"/proc/{p}/environ").read_bytes() for p in _children(agent.pid)}
    os.kill(next(p for p, env in ranks.items() if b"\0RANK=1\0" in b"\0" + env), signal.SIGKILL)
    try:
        agent.wait(timeout=240)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
    text = stderr.read_text()
    assert not _worker_tracebacks(text), text[-3000:]
    lines = _error_lines(text)
    assert len(lines) == 1, text[-3000:]
    assert lines[0].startswith("ppokit: error: process 1 of the run ended while process 0 waited for it ("), lines[0]
    named = lines[0].split("the last complete checkpoint is ")[1].split(": see that process's output")[0]
    assert named.startswith(str(run / "checkpoints" / "update-")) and (Path(named) / "trainer_state.json").is_file(), lines[0]
    assert lines[0].endswith("see that process's output for why, and continue with --resume"), lines[0]


def test_a_two_process_checkpoint_resumed_on_one_process_ends_at_total_episodes(runs, tmp_path):
    """--resume-force with half the processes halves the batch: the run used to take the one-process number of
    updates from the start, and ran past total_episodes (episodes 40, 48, ..., 80 after the checkpoint's 32, with
    total_episodes=64). It continues with the updates of the episodes left, at its own batch."""
    from ppokit.config.schema import PPOConfig
    from ppokit.trainer import PPOTrainer

    config, source = runs["ddp"]
    trainer = PPOTrainer(PPOConfig.load(config, [f"output_dir={tmp_path / 'run'}", "ppo.num_sample_generations=0"]),
                         show_progress=False)
    trainer.resume_from(source / "checkpoints" / "update-2", force=True)
    assert (trainer.state.update, trainer.state.episodes_sampled, trainer.sizes.batch, trainer.sizes.num_updates) == (2, 32, 8, 6)
    trainer.train()
    assert [(r["update"], r["episode"]) for r in _records(tmp_path / "run")] == [(1, 16), (2, 32), (3, 40), (4, 48), (5, 56), (6, 64)]
