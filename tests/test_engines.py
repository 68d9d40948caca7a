"""The rollout-engine seam: the engine table, Sampling per purpose, HFEngine against the sampler it wraps,
the trainer's own logprobs where an engine's are not its own, and truncated importance sampling."""

import math
import subprocess
import sys
import types
from dataclasses import replace

import pytest
import torch
from conftest import tiny_ppo_config

from ppokit import engines

from ppokit.training import algo
from ppokit.config.schema import PPOConfig, PPOHyperparams
from ppokit.engines.base import Sampling
from ppokit.engines.hf import HFEngine, HFSampler
from ppokit.errors import UserError
from ppokit.models.forwards import left_pad
from ppokit.models.loading import load_causal_lm
from ppokit.trainer import PPOTrainer

pytestmark = pytest.mark.transformers_pins  # CI runs this file under vLLM's transformers pin too (.ci/vllm-env)


def test_engine_table_imports_no_torch():
    code = "import sys, ppokit.engines, ppokit.config.schema; assert 'torch' not in sys.modules; print(sorted(ppokit.engines.ENGINES))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['hf', 'vllm']"


def test_unknown_engine_is_one_line_naming_the_key():
    with pytest.raises(UserError, match=r"^rollout\.engine: .*one of hf, vllm"):
        PPOConfig.load(None, ["model=m", "reward.functions=[sentiment]", "rollout.engine=vllm2"]).validate()


def test_rollout_is_cap_without_rollout_is_is_refused():
    with pytest.raises(UserError, match=r"ppo\.rollout_is_cap .* ppo\.rollout_is: tis"):
        PPOHyperparams(rollout_is_cap=3.0).check_combination()
    PPOHyperparams(rollout_is="tis", rollout_is_cap=3.0).check_combination()


def test_sampling_for_purpose():
    hp = types.SimpleNamespace(temperature=0.7, eval_temperature=None, response_length=9, top_k=3, top_p=0.9, min_p=0.0)
    train = Sampling.for_purpose(hp, 2, "train")
    assert (train.temperature, train.greedy, train.max_new_tokens, train.top_k, train.stop_token_ids) == (0.7, False, 9, 3, (2,))
    assert Sampling.for_purpose(hp, 2, "eval") == train  # eval_temperature null: the training temperature
    greedy = Sampling.for_purpose(hp, 2, "greedy")
    assert greedy.greedy and greedy.temperature == 0.7  # logprobs stay at the training temperature
    hp.eval_temperature = 0
    assert Sampling.for_purpose(hp, 2, "eval") == greedy
    hp.eval_temperature = 1.3
    assert Sampling.for_purpose(hp, 2, "eval").temperature == 1.3
    with pytest.raises(ValueError):
        Sampling.for_purpose(hp, 2, "sample")


def test_hf_engine_is_the_sampler_it_wraps(model_dir, tokenizer, demo_data):
    """Same tokens, same logprobs, bit for bit; the policy back in train mode after; sampling runs in eval mode."""
    policy = load_causal_lm(str(model_dir("llama"))).train()
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in demo_data["prompts"][:6]]
    sampling = Sampling(max_new_tokens=8, temperature=0.9, stop_token_ids=tokenizer.eos_token_id, top_k=5)
    modes = []
    engine = HFEngine(lambda: policy, tokenizer.pad_token_id, torch.device("cpu"), rows_per_forward=4,
                      sampling_contexts=lambda p: (_recording(modes, p),))
    torch.manual_seed(3)
    got = engine.generate(prompts, sampling)
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    torch.manual_seed(3)
    want = HFSampler(policy.eval(), 8, 0.9, tokenizer.eos_token_id, tokenizer.pad_token_id, 4, top_k=5, compact_every=8).sample(ids, mask)
    assert torch.equal(got.response_ids, want.response_ids) and torch.equal(got.logprobs, want.logprobs)
    assert modes == [False] and engine.logprobs_are_trainers
    engine.sync_weights(policy), engine.release(), engine.resume(), engine.close()  # no-ops


class _recording:
    def __init__(self, modes, policy):
        self.modes, self.policy = modes, policy

    def __enter__(self):
        self.modes.append(self.policy.training)

    def __exit__(self, *exc):
        return False


def _sizing(settings, on_gpu=False):
    from transformers import LlamaConfig

    # 2 layers, 2 key/value heads of 32: kv = 64
    model_config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               vocab_size=10)
    return engines.EngineSizing(model_config, dict(layers=2, kv=64, vocab=10), weight_bytes=1000, dtype=torch.float32, act_bytes=2,
                                rows_per_forward=3, rows_per_rollout=6, longest_sequence=5, settings=settings,
                                device_memory=8 * 2**30, on_gpu=on_gpu)


def test_plan_reads_the_engines_memory():
    from ppokit.config.schema import RolloutConfig

    # hf: nothing of its own; keys and values 2 x layers x kv x rows x seq x bytes, logits and their log-softmax 2 x rows x vocab x 4
    assert engines.engine_class("hf").memory(_sizing(RolloutConfig())) == engines.EngineMemory(sampling=2 * 2 * 64 * 3 * 5 * 2 + 2 * 3 * 10 * 4)
    vllm = engines.engine_class("vllm")
    # CPU: the weight copy + the KV cache for the rollout's 6 rows (+ 1) of 16384 tokens (128 blocks of 128), float32 like the weights
    on_cpu = vllm.memory(_sizing(RolloutConfig(engine="vllm", max_model_len=16384)))
    assert (on_cpu.held, on_cpu.sampling, on_cpu.released_for_training) == (1000 + 2 * 2 * 64 * 4 * 16384 * 7, 2 * 6 * 10 * 4, False)
    assert vllm.memory(_sizing(RolloutConfig(engine="vllm"))).held == 1000 + 64 * 2**20  # 5 tokens: under the cache's floor
    # GPU: its share of the device, freed while training with sleep
    on_gpu = vllm.memory(_sizing(RolloutConfig(engine="vllm", gpu_memory_utilization=0.25, sleep=True), on_gpu=True))
    assert (on_gpu.held, on_gpu.sampling, on_gpu.released_for_training, on_gpu.lighter) == (2 * 2**30, 0, True, ())
    assert [on_gpu.during(phase) for phase in ("sampling", "forward", "training")] == [2 * 2**30, 2 * 2**30, 0]
    assert vllm.memory(_sizing(RolloutConfig(engine="vllm"), on_gpu=True)).lighter == (("sleep", True),)


# --------------------------------------------------------------------------- truncated importance sampling


def test_truncated_is_weights_by_hand():
    trainer = torch.tensor([[-1.0, -2.0, -0.5, -2.0, 0.0]])
    engine = torch.tensor([[-1.0, -3.0, -1.0, -1.0, 0.0]])
    # exp(trainer - engine) = 1, e (capped to 2), e^0.5, e^-1; padding (both 0): 1
    want = [1.0, 2.0, math.exp(0.5), math.exp(-1.0), 1.0]
    assert algo.truncated_is_weights(trainer, engine, cap=2.0)[0].tolist() == pytest.approx(want, rel=1e-6)
    assert algo.truncated_is_weights(trainer, engine, cap=3.0)[0, 1].item() == pytest.approx(math.e, rel=1e-6)
    grad = trainer.clone().requires_grad_(True)
    assert not algo.truncated_is_weights(grad, engine, 2.0).requires_grad  # a weight, not a path for gradients
    huge = algo.truncated_is_weights(torch.tensor([[0.0]]), torch.tensor([[-200.0]]), 2.0)
    assert huge.item() == 2.0  # exp overflows to inf; the cap still holds


def test_ppo_loss_multiplies_each_tokens_policy_loss_by_its_weight():
    """A plain loop: token_mean of w_t x max(-A r, -A clip(r)) over the real tokens."""
    torch.manual_seed(0)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    logprobs, old = torch.randn(2, 3) * 0.3 - 1, torch.randn(2, 3) * 0.3 - 1
    advantages, weights = torch.randn(2, 3), torch.tensor([[1.0, 2.0, 0.5], [1.5, 0.25, 1.0]])
    settings = algo.LossSettings()
    normalisers = algo.loss_normalisers(mask, settings.aggregation, 3)
    got = algo.ppo_loss(settings, normalisers, mask, logprobs, old, advantages, torch.zeros(2, 3), is_weights=weights).policy
    total, count = 0.0, 0
    for i in range(2):
        for t in range(3):
            if mask[i, t]:
                r = math.exp(logprobs[i, t].item() - old[i, t].item())
                a = advantages[i, t].item()
                total += weights[i, t].item() * max(-a * r, -a * min(max(r, 0.8), 1.2))
                count += 1
    assert got.item() == pytest.approx(total / count, rel=1e-5)


# --------------------------------------------------------------------------- an engine whose logprobs are not the trainer's


class _OffsetEngine(HFEngine):
    """The hf engine, reporting every sampled logprob `offset` too low, as an engine with other kernels might."""

    def __init__(self, *args, offset: float, **kwargs):
        super().__init__(*args, logprobs_are_trainers=False, **kwargs)
        self.offset = offset

    def step(self):
        return [replace(c, logprobs=[lp - self.offset for lp in c.logprobs]) for c in super().step()]


def _with_engine(trainer, offset):
    trainer.rollout.source.engine = _OffsetEngine(  # the one place the engine is held (the episode loop's)
        lambda: trainer.policy, trainer.pad_id, trainer.accelerator.device, trainer.config.ppo.local_rollout_forward_batch_size,
        lambda p: (trainer.strategy.generation(p), trainer.accelerator.autocast()), offset=offset,
    )
    return trainer


ONE_STEP = dict(total_episodes=8, per_device_train_batch_size=8, num_mini_batches=1, num_ppo_epochs=1, num_sample_generations=0)


@pytest.mark.parametrize("offset", [0.0, 0.25])
def test_trainer_recomputes_old_logprobs_where_the_engines_are_not_its_own(offset, model_dir, prompts_file, tmp_path):
    """The first minibatch's ratio is 1 (every ratio of a one-step update is measured before the optimiser step),
    the KL starts at 0 (reference = policy), and the mismatch metrics measure the engine's offset."""
    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run", **ONE_STEP)
    record = _with_engine(PPOTrainer(config, show_progress=False), offset).step()
    assert record["val/ratio"] == pytest.approx(1.0, abs=1e-5)
    assert record["policy/approxkl_avg"] == pytest.approx(0.0, abs=1e-6)
    assert record["objective/kl"] == pytest.approx(0.0, abs=1e-4)
    assert record["rollout/logprob_diff_mean"] == pytest.approx(offset, abs=1e-5)
    assert record["rollout/logprob_diff_max"] == pytest.approx(offset, abs=1e-5)


def test_hf_engine_logs_no_mismatch(model_dir, prompts_file, tmp_path):
    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run", **ONE_STEP)
    record = PPOTrainer(config, show_progress=False).step()
    assert not any(key.startswith("rollout/") for key in record)


def test_tis_weights_scale_the_policy_loss(model_dir, prompts_file, tmp_path):
    """An engine whose every logprob is 0.25 too low: each weight is p_trainer / p_engine = exp(0.25) (under the
    cap 2), so the first step's policy loss (ratio 1: the mean of -A, not whitened to 0) is exp(0.25) times the
    uncorrected one; with cap 1.1 it is 1.1 times."""
    def first_step(**ppo):
        config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / f"run{len(ppo)}-{ppo.get('rollout_is_cap')}", whiten_advantages=False, **ONE_STEP,
                                 **ppo)
        return _with_engine(PPOTrainer(config, show_progress=False), 0.25).step()

    plain, corrected, capped = first_step(), first_step(rollout_is="tis"), first_step(rollout_is="tis", rollout_is_cap=1.1)
    assert abs(plain["loss/policy_avg"]) > 1e-3
    assert corrected["loss/policy_avg"] == pytest.approx(math.exp(0.25) * plain["loss/policy_avg"], rel=1e-4)
    assert capped["loss/policy_avg"] == pytest.approx(1.1 * plain["loss/policy_avg"], rel=1e-4)
    assert corrected["objective/scores"] == plain["objective/scores"]  # the same episodes


def test_resume_refuses_another_engine_and_reads_an_older_checkpoint_as_hf():
    """Another engine samples with other kernels (other logprobs, other tokens): a changed rollout.engine is a
    difference --resume-force must allow; a checkpoint written before the key existed counts as its default."""
    from ppokit.run import checkpoint

    base = PPOConfig(model="m").to_dict()
    older = {k: v for k, v in base.items() if k != "rollout"}
    assert checkpoint.config_differences(older, base, base) == []
    other = {**base, "rollout": {**base["rollout"], "engine": "vllm"}}
    assert checkpoint.config_differences(base, other, base) == ["rollout.engine (checkpoint 'hf', now 'vllm')"]
    tis = {**base, "ppo": {**base["ppo"], "rollout_is": "tis"}}
    assert checkpoint.config_differences(base, tis, base) == ["ppo.rollout_is (checkpoint None, now 'tis')"]


def test_another_engines_keys_are_refused():
    """rollout.gpu_memory_utilization and the other vllm keys are never read by hf: setting them is an error naming them."""
    with pytest.raises(UserError, match=r"^rollout\.sleep \(True\) is for rollout\.engine: vllm, and this run's is hf"):
        PPOConfig.load(None, ["model=m", "reward.functions=[sentiment]", "rollout.sleep=true"]).validate()
    with pytest.raises(UserError, match=r"^rollout\.tensor_parallel_size: value 2 is out of range, it must be 1"):
        PPOConfig.load(None, ["model=m", "reward.functions=[sentiment]", "rollout.engine=vllm", "rollout.tensor_parallel_size=2"]).validate()
    PPOConfig.load(None, ["model=m", "reward.functions=[sentiment]", "rollout.engine=vllm", "rollout.gpu_memory_utilization=0.5",
                          "rollout.max_model_len=512"]).validate()


def test_an_engine_class_lacking_a_protocol_method_is_named(monkeypatch):
    """`create`, `memory` and `check_installed` are part of the Protocol: a class without one is refused by name."""
    module = types.ModuleType("half_an_engine")
    module.HalfAnEngine = type("HalfAnEngine", (), {k: v for k, v in vars(HFEngine).items() if k != "memory"})
    monkeypatch.setitem(sys.modules, "half_an_engine", module)
    monkeypatch.setitem(engines.ENGINES, "half", engines.Engine("half_an_engine:HalfAnEngine", "an engine without memory()"))
    with pytest.raises(TypeError, match=r"^rollout engine half \(half_an_engine:HalfAnEngine\) lacks memory of ppokit.engines.base.RolloutEngine"):
        engines.engine_class("half")
    assert engines.engine_class("hf") is HFEngine


TOY_RUN = """
import json, sys
from ppokit import engines
from ppokit.config import reference as configdoc
from ppokit.config.schema import PPOConfig
from ppokit.errors import UserError
from ppokit.plan import plan_for
from ppokit.trainer import PPOTrainer

def refusal(*overrides):
    try:
        PPOConfig.load(None, ["model=m", "reward.functions=[sentiment]", *overrides])
    except UserError as e:
        return str(e)

config = PPOConfig.load(sys.argv[1], ["rollout.engine=toy", "rollout.toy_logprob_shift=0.25", "rollout.toy_held_bytes=12345"])
trainer = PPOTrainer(config, show_progress=False)
record = trainer.step()
print(json.dumps({
    "under_hf": refusal("rollout.toy_logprob_shift=0.25"), "out_of_range": refusal("rollout.engine=toy", "rollout.toy_logprob_shift=-1"),
    "misspelt": refusal("rollout.engine=toy", "rollout.toy_logprob_shfit=0.25"),
    "documented": [line for line in configdoc.reference_document().splitlines() if "toy" in line],
    "engine": type(trainer.rollout_engine).__module__, "calls": trainer.rollout_engine.calls,
    "diff": record["rollout/logprob_diff_mean"], "held": plan_for(config, memory_gib=80).engine.held,
}))
"""


def test_a_third_engine_is_one_module_and_one_entry(model_dir, prompts_file, tmp_path):
    """Adding an engine is one module in ppokit/engines/ and one entry in ENGINES: in a copy of the package with exactly
    that added (tests/toy_engine.py; config.py, plan.py and the trainer as they are), the engine's own keys are `rollout:`
    keys (range-checked, documented, refused under another engine, a misspelling told its name), the trainer builds the
    engine from the table and samples with it (its shifted logprobs measured as the mismatch), and `ppokit plan` counts
    what it says it holds."""
    import json
    import os
    import shutil
    from pathlib import Path

    import ppokit
    import toy_engine

    copy = tmp_path / "src" / "ppokit"
    shutil.copytree(Path(ppokit.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(Path(toy_engine.__file__), copy / "engines" / "toy.py")
    table = copy / "engines" / "__init__.py"
    anchor = "ENGINES = {\n"
    assert table.read_text().count(anchor) == 1
    table.write_text(table.read_text().replace(anchor, anchor + toy_engine.ENTRY))
    tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run", **ONE_STEP).save(tmp_path / "ppo.yaml")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "src"))
    run = subprocess.run([sys.executable, "-c", TOY_RUN, str(tmp_path / "ppo.yaml")], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    said = json.loads(run.stdout)
    assert said["under_hf"].startswith("rollout.toy_logprob_shift (0.25) is for rollout.engine: toy, and this run's is hf")
    assert said["out_of_range"].startswith("rollout.toy_logprob_shift: value -1.0 is out of range, it must be >= 0 (toy: ")
    assert "did you mean rollout.toy_logprob_shift?" in said["misspelt"]
    assert any(line.startswith("| `rollout.toy_logprob_shift` | `0.0` | toy: subtracted") for line in said["documented"])
    assert any("`toy` (the hf sampler reporting its logprobs shifted" in line for line in said["documented"])  # rollout.engine's help
    assert said["engine"] == "ppokit.engines.toy" and said["calls"] == 1
    assert said["diff"] == pytest.approx(0.25, abs=1e-5)  # the trainer recomputed the logprobs the engine shifted
    assert said["held"] == 12345


def test_the_prepared_gpu_benchmark_builds_its_model_and_configs_without_a_gpu():
    """benchmarks/gpu_engines.py waits for a GPU (docs/rollout.md); what it can do without one (`--dry-run`: the
    tokenizer, the ~0.5B model's config counted on the meta device, both validated PPO configs) keeps working."""
    import json
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    result = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_engines.py"), "--dry-run"], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["engine"] for line in lines] == ["vllm", "hf"]
    for line in lines:
        config = line["config"]
        assert 0.45e9 < line["parameters"] < 0.55e9 and line["model"]["hidden_size"] // line["model"]["num_attention_heads"] == 64
        assert config["rollout"]["engine"] == line["engine"] and config["rollout"]["sleep"] == (line["engine"] == "vllm")
        assert config["bf16"] and config["ppo"]["total_episodes"] == 5 * 64  # 4 timed updates after a warm-up
    # the off-policy check (issue 30): the server on GPUs of its own, k = 0 then 1, the same loss
    result = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_engines.py"), "--dry-run", "--engines", "vllm-k0,vllm-k1"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    configs = [json.loads(line)["config"] for line in result.stdout.splitlines()]
    assert [(c["rollout"]["placement"], c["rollout"]["max_staleness"], c["ppo"]["rollout_is"]) for c in configs] == [
        ("separate", 0, "tis"), ("separate", 1, "tis")]
