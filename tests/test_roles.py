"""LoRA policy, adapter-disabled reference, shared-base and LoRA critics, saving, memory switches."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import tiny_ppo_config

from ppokit.training import algo, experience

from ppokit.config.schema import LoraConfig, PPOConfig
from ppokit.errors import UserError
from ppokit.models.forwards import left_pad, response_logits, score_at_last_token
from ppokit.models.loading import enable_gradient_checkpointing, load_causal_lm
from ppokit.models.adapters import VALUE_ADAPTER, recompute_with_active_adapter
from ppokit.models.loading import POLICY_ADAPTER
from ppokit.demos.tiny import tiny_config
from ppokit.trainer import PPOTrainer

pytest.importorskip("peft")


def lora_config(model_dir, prompts_file, output_dir, value_model=None, **ppo):
    """One update of two optimiser steps (the second is the first with a non-zero value head)."""
    ppo = {"total_episodes": 8, "num_ppo_epochs": 1, "num_sample_generations": 0, **ppo}
    config = tiny_ppo_config(model_dir, prompts_file, output_dir, **ppo)
    config.lora = LoraConfig(r=4, alpha=8)
    config.value_model = value_model
    return config


def storage_bytes(*modules) -> int:
    """Bytes of distinct tensor storages reachable from `modules` (shared weights count once)."""
    storages = {}
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def trainable_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def test_shared_mode_holds_one_copy_of_the_base_weights(model_dir, prompts_file, tmp_path):
    path = model_dir("llama")
    base = load_causal_lm(str(path))
    base_bytes = storage_bytes(base)

    trainer = PPOTrainer(lora_config(path, prompts_file, tmp_path / "run", value_model="shared"), show_progress=False)
    assert trainer.ref_model is None  # the reference is the policy's base with the adapter disabled
    assert trainer.value_model.policy is trainer.policy
    held = storage_bytes(trainer.model)  # policy (base + both adapters) and the critic's head
    assert held == base_bytes + trainable_bytes(trainer.model)

    full = PPOTrainer(tiny_ppo_config(path, prompts_file, tmp_path / "full"), show_progress=False)
    full_bytes = storage_bytes(full.model, full.ref_model)
    assert full_bytes > 2.9 * base_bytes  # policy, reference and value: three copies
    assert held < 1.5 * base_bytes


def test_lora_set_up_prints_no_deprecation_warning_from_the_libraries(model_dir, prompts_file, tmp_path):
    # peft reads transformers' deprecated is_gradient_checkpointing; a user cannot act on that warning.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        trainer = PPOTrainer(lora_config(model_dir("llama"), prompts_file, tmp_path / "run"), show_progress=False)
    assert trainer.ref_model is None


@pytest.mark.parametrize("arch,value_model", [("llama", None), ("gpt2", "shared"), ("qwen2", "shared")])
def test_lora_ppo_trains_adapters_and_head_not_the_base(arch, value_model, model_dir, prompts_file, tmp_path):
    config = lora_config(model_dir(arch), prompts_file, tmp_path / "run", value_model=value_model)
    trainer = PPOTrainer(config, show_progress=False)
    named = dict(trainer.model.named_parameters())
    before = {n: p.detach().clone() for n, p in named.items()}
    records = trainer.train()
    assert len(records) == 1 and all(torch.isfinite(torch.tensor(r["loss/value_avg"])) for r in records)

    changed = {n for n, p in named.items() if not torch.equal(before[n], p.detach())}
    frozen = {n for n, p in named.items() if not p.requires_grad}
    assert frozen and not (changed & frozen), "base weights must stay frozen"
    assert any(f"lora_B.{POLICY_ADAPTER}" in n for n in changed)
    if value_model == "shared":
        assert any(f"lora_B.{VALUE_ADAPTER}" in n for n in changed)
        assert "value_model.score.weight" in changed
    else:
        assert any(n.startswith("value_model.") and "lora_B" in n for n in changed)
        assert any(n.startswith("value_model.") and "modules_to_save" in n for n in changed)  # the head (SEQ_CLS)

    final = tmp_path / "run" / "final"
    assert (final / "adapter_config.json").exists() and not (final / "config.json").exists()
    assert (final / "value_model" / "adapter_model.safetensors").exists()
    assert not (final / VALUE_ADAPTER).exists()  # the critic's adapter lives in value_model/, not under final/


def test_reference_is_the_base_model_and_the_policy_is_not(model_dir, prompts_file, tmp_path):
    path = model_dir("llama")
    trainer = PPOTrainer(lora_config(path, prompts_file, tmp_path / "run", learning_rate=1e-2), show_progress=False)
    trainer.train()
    ids, mask = left_pad([[5, 6, 7, 8, 9], [10, 11, 12]], trainer.tokenizer.pad_token_id)
    base = load_causal_lm(str(path)).eval()
    response_ids, response_mask = ids[:, -2:], mask[:, -2:].bool()
    with torch.no_grad():
        expected = response_logits(base, ids, mask, 2)
        reference = experience.reference_logprobs(trainer.policy, trainer.ref_model, ids, mask, response_ids, response_mask,
                                                  temperature=trainer.config.ppo.temperature, chunk_size=trainer.config.lm_head_chunk_size)
        policy = response_logits(trainer.policy, ids, mask, 2)
    torch.testing.assert_close(reference, algo.logprobs_from_logits(expected, response_ids, trainer.config.ppo.temperature), rtol=0, atol=1e-5)
    assert (policy - expected).abs().max() > 1e-3  # the adapter did train, and is on outside the reference


@pytest.mark.parametrize("value_model", [None, "shared"])
def test_ratio_is_one_on_the_first_minibatch_with_lora(value_model, model_dir, prompts_file, tmp_path):
    # One epoch of one minibatch: every ratio is computed before the first optimiser step.
    config = lora_config(model_dir("qwen2"), prompts_file, tmp_path / "run", value_model=value_model,
                         total_episodes=8, num_mini_batches=1, num_ppo_epochs=1, gradient_accumulation_steps=2,
                         per_device_train_batch_size=4, num_sample_generations=0)
    record = PPOTrainer(config, show_progress=False).step()
    assert record["val/ratio"] == pytest.approx(1.0, abs=1e-5)
    assert record["policy/approxkl_avg"] == pytest.approx(0.0, abs=1e-6)
    assert record["objective/kl"] == pytest.approx(0.0, abs=1e-5)  # adapter B starts at 0: policy == reference


def test_gradient_checkpointing_recomputes_with_the_right_adapter(model_dir, prompts_file, tmp_path):
    config = lora_config(model_dir("llama"), prompts_file, tmp_path / "run", value_model="shared")
    trainer = PPOTrainer(config, show_progress=False)
    model = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad():  # a non-zero head and value adapter, so every gradient path is live
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.normal_(0, 0.05)
    ids, mask = left_pad([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]], trainer.tokenizer.pad_token_id)

    def grads():
        model.zero_grad(set_to_none=True)
        response_ids, response_mask = ids[:, -3:], mask[:, -3:].bool()
        logprobs, _, values = model(ids, mask.long(), response_ids, response_mask, 1.0)
        (logprobs.mean() + values.pow(2).mean()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    model.train()
    plain = grads()
    enable_gradient_checkpointing(trainer.policy, recompute_with_active_adapter(trainer.policy))
    assert trainer.policy.get_base_model().is_gradient_checkpointing
    checkpointed = grads()
    assert plain.keys() == checkpointed.keys() and any(f".{VALUE_ADAPTER}." in n for n in plain)
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-4, atol=1e-6, msg=name)


def test_gradient_checkpointing_switch_runs(model_dir, prompts_file, tmp_path):
    config = lora_config(model_dir("gpt2"), prompts_file, tmp_path / "run", value_model="shared")
    config.gradient_checkpointing = True
    trainer = PPOTrainer(config, show_progress=False)
    assert trainer.policy.get_base_model().is_gradient_checkpointing
    assert torch.isfinite(torch.tensor(trainer.step()["loss/policy_avg"]))


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, tokenizer):
    from transformers import AutoModelForSequenceClassification

    config = tiny_config("llama", tokenizer)
    config.num_labels = 1
    torch.manual_seed(3)
    path = tmp_path_factory.mktemp("tiny-rm")
    AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_from_reward_shares_the_reward_weights_and_scores_without_the_adapter(model_dir, reward_model_dir, prompts_file, tmp_path):
    from ppokit.models.loading import load_scalar_model

    config = lora_config(model_dir("llama"), prompts_file, tmp_path / "run", value_model="from_reward", learning_rate=1e-2)
    config.reward.model = str(reward_model_dir)
    config.reward.functions = []
    config.ppo.max_tokens_per_micro_batch = 1024
    trainer = PPOTrainer(config, show_progress=False)
    reward_source = trainer.scorer.sources[0]
    assert trainer.value_model.get_base_model() is reward_source.model  # one copy of the reward weights
    assert reward_source.by_tokens  # scored with the adapter off, it keeps its settings (a subclass once lost this one)
    trainer.train()

    ids, mask = left_pad([[5, 6, 7, 8], [9, 10, 11]], trainer.tokenizer.pad_token_id)
    original = load_scalar_model(str(reward_model_dir), "reward.model").eval()
    from ppokit.rewards import ScoringBatch

    batch = ScoringBatch(["a", "b"], ["c", "d"], {}, ids, mask.long(), trainer.tokenizer)
    with torch.no_grad():
        expected = score_at_last_token(original, ids, mask.long())
        critic = score_at_last_token(trainer.value_model, ids, mask.long())
    torch.testing.assert_close(reward_source.score(batch), expected, rtol=0, atol=1e-5)
    assert (critic - expected).abs().max() > 1e-3  # the critic's adapter and head did train


def test_save_merged_loads_without_peft(model_dir, prompts_file, tmp_path):
    config = lora_config(model_dir("llama"), prompts_file, tmp_path / "run", value_model="shared", learning_rate=1e-2)
    config.save_merged = True
    trainer = PPOTrainer(config, show_progress=False)
    trainer.train()
    ids, mask = left_pad([[5, 6, 7, 8, 9]], trainer.tokenizer.pad_token_id)
    with torch.no_grad():
        expected = response_logits(trainer.policy, ids, mask, 3)
    merged = tmp_path / "run" / "final" / "merged"
    torch.save({"ids": ids, "mask": mask, "expected": expected}, tmp_path / "expected.pt")
    script = f"""
import sys
sys.modules["peft"] = None  # importing peft now fails
import torch
from transformers import AutoModelForCausalLM
from ppokit.models.forwards import response_logits
data = torch.load({str(tmp_path / "expected.pt")!r})
model = AutoModelForCausalLM.from_pretrained({str(merged)!r}).eval()
with torch.no_grad():
    got = response_logits(model, data["ids"], data["mask"], 3)
torch.testing.assert_close(got, data["expected"], rtol=1e-4, atol=1e-4)
print("merged ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "merged ok" in result.stdout

    value_dir = tmp_path / "run" / "final" / "value_model"
    note = json.loads((value_dir / "shared_value_model.json").read_text())
    assert note["kind"] == "shared"
    from safetensors.torch import load_file

    head = load_file(value_dir / "value_head.safetensors")["score.weight"]
    torch.testing.assert_close(head, trainer.value_model.score.weight.detach())
    adapter = load_file(value_dir / "adapter_model.safetensors")
    assert adapter and all("lora_" in k and f".{POLICY_ADAPTER}." not in k for k in adapter)

    # Model cards: ours replaces peft's boilerplate beside the adapter; the merged model has its own.
    final = tmp_path / "run" / "final"
    card, merged_card = (final / "README.md").read_text(), (merged / "README.md").read_text()
    assert "library_name: peft" in card and "| trained weights | a LoRA adapter (r 4, alpha 8) on the frozen base |" in card
    assert f"AutoPeftModelForCausalLM.from_pretrained({str(final)!r})" in card
    assert "library_name: transformers" in merged_card and "| trained weights | the LoRA adapter merged into the base weights |" in merged_card
    from peft import AutoPeftModelForCausalLM

    assert AutoPeftModelForCausalLM.from_pretrained(final) is not None  # the card does not stand in peft's way


@pytest.mark.parametrize("overrides,message", [
    ({"bf16": True, "fp16": True}, "bf16 and fp16"),
    ({"value_model": "shared"}, "set `lora`"),
    ({"quantization": "4bit"}, "set `lora`"),
    ({"save_merged": True}, "without `lora`"),
    ({"value_model": "from_reward"}, "needs reward.model"),
    ({"lora": {"r": 0}}, "lora.r"),
    ({"quantization": "3bit", "lora": {}}, "quantization"),
])
def test_config_rejects_impossible_switches(overrides, message):
    data = {"model": "m", "reward": {"functions": ["sentiment"]}, **overrides}
    with pytest.raises(UserError, match=message):
        _load(data)


def _load(data):
    from ppokit.config.fields import load_config

    return load_config(PPOConfig, data=data)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("switch", [{"quantization": "4bit"}, {"quantization": "8bit"}, {"fp16": True}])
def test_cuda_only_switches_fail_before_loading_weights(switch, model_dir, prompts_file, tmp_path, monkeypatch):
    import ppokit.models.roles as roles_module

    def must_not_load(*args, **kwargs):
        raise AssertionError("weights were loaded before the CUDA check")

    monkeypatch.setattr(roles_module, "load_causal_lm", must_not_load)
    config = lora_config(model_dir("llama"), prompts_file, tmp_path / "run")
    for key, value in switch.items():
        setattr(config, key, value)
    with pytest.raises(UserError, match="CUDA"):
        PPOTrainer(config, show_progress=False)


# --------------------------------------------------------------------------- GPU machine only


@pytest.fixture
def fresh_accelerator_state():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_quantized_shared_base_runs_on_cuda(quantization, model_dir, prompts_file, tmp_path, fresh_accelerator_state):
    pytest.importorskip("bitsandbytes")
    config = lora_config(model_dir("llama", hidden=128), prompts_file, tmp_path / "run", value_model="shared",
                         total_episodes=8, num_mini_batches=1, num_ppo_epochs=1, num_sample_generations=0)
    config.quantization = quantization
    config.bf16 = True
    trainer = PPOTrainer(config, show_progress=False)
    assert getattr(trainer.policy.get_base_model(), "is_quantized", False)
    record = trainer.step()
    assert record["val/ratio"] == pytest.approx(1.0, abs=0.05)
    trainer.save_final()
    assert (tmp_path / "run" / "final" / "adapter_config.json").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_lora_on_cuda(precision, model_dir, prompts_file, tmp_path, fresh_accelerator_state):
    config = lora_config(model_dir("qwen2"), prompts_file, tmp_path / "run", value_model="shared",
                         total_episodes=8, num_mini_batches=1, num_ppo_epochs=1, num_sample_generations=0)
    setattr(config, precision, True)
    config.gradient_checkpointing = True
    trainer = PPOTrainer(config, show_progress=False)
    assert trainer.accelerator.mixed_precision == precision
    record = trainer.step()
    assert record["val/ratio"] == pytest.approx(1.0, abs=0.05)


@pytest.fixture(scope="module")
def other_vocab_reward_dir(tmp_path_factory, demo_data):
    """A reward model whose tokenizer (byte-level BPE) is not the policy's (word-level)."""
    from test_rewards_model import tiny_rm

    from ppokit.demos.tiny import bpe_tokenizer

    rm_tokenizer = bpe_tokenizer(r["prompt"] + " " + r["completion"] for r in demo_data["sft"])
    path = tmp_path_factory.mktemp("tiny-rm-bpe")
    tiny_rm(rm_tokenizer, seed=4).save_pretrained(path)
    rm_tokenizer.save_pretrained(path)
    return path


def trainer_role_table(trainer) -> dict:
    """What the trainer built, in the plan's terms: parameters per role, and what trains."""
    count = lambda module, trainable=None: sum(  # noqa: E731
        p.numel() for p in {id(p): p for p in module.parameters()}.values() if trainable is None or p.requires_grad == trainable
    )
    table = {
        "trainable": count(trainer.model, True),
        "reference": count(trainer.ref_model) if trainer.ref_model is not None else 0,
        "policy frozen": count(trainer.policy, False),
    }
    if trainer.layout.critic not in (roles_module.CRITIC_SHARED, roles_module.CRITIC_NONE):
        # The plan counts the weights a role holds itself: not the reward model's frozen ones, which a
        # critic's adapter may sit on.
        rm = trainer.scorer.reward_model
        reward = {id(p) for p in rm.parameters() if not p.requires_grad} if rm is not None else set()
        table["value"] = sum(p.numel() for p in {id(p): p for p in trainer.value_model.parameters()}.values() if id(p) not in reward)
    return table


def plan_role_table(plan) -> dict:
    by_role = {r.role: r for r in plan.roles}
    table = {
        "trainable": by_role["policy"].trainable + (by_role["value"].trainable if "value" in by_role else 0),
        "reference": by_role["reference"].params,
        "policy frozen": by_role["policy"].params - by_role["policy"].trainable,
    }
    if plan.layout.critic not in (roles_module.CRITIC_SHARED, roles_module.CRITIC_NONE):
        table["value"] = by_role["value"].params
    return table


import ppokit.models.roles as roles_module  # noqa: E402

LAYOUTS = {
    # name: (lora?, changes to the config) -> the reference and critic the decision must give
    "full": ({}, roles_module.REFERENCE_COPY, roles_module.CRITIC_POLICY_COPY),
    "full, reward model with the policy's vocabulary": ({"reward": "same"}, roles_module.REFERENCE_COPY, roles_module.CRITIC_REWARD_COPY),
    "full, reward model with another vocabulary": ({"reward": "other"}, roles_module.REFERENCE_COPY, roles_module.CRITIC_POLICY_COPY),
    "full, own reference and critic": ({"ref_model": "gpt2", "value_model": "qwen2"}, roles_module.REFERENCE_OWN, roles_module.CRITIC_OWN),
    "lora": ({"lora": True}, roles_module.REFERENCE_BASE, roles_module.CRITIC_POLICY_COPY),
    "lora, shared critic": ({"lora": True, "value_model": "shared"}, roles_module.REFERENCE_BASE, roles_module.CRITIC_SHARED),
    "lora, critic on the reward model": ({"lora": True, "reward": "same", "value_model": "from_reward"},
                                         roles_module.REFERENCE_BASE, roles_module.CRITIC_ON_REWARD),
    "lora, reward model with another vocabulary": ({"lora": True, "reward": "other"}, roles_module.REFERENCE_BASE,
                                                   roles_module.CRITIC_POLICY_COPY),
    "lora, full critic": ({"lora": True, "value_model_lora": False}, roles_module.REFERENCE_BASE, roles_module.CRITIC_POLICY_COPY),
    "lora, own critic with its adapter": ({"lora": True, "value_model": "qwen2"}, roles_module.REFERENCE_BASE, roles_module.CRITIC_OWN),
    "full, critic-free estimator": ({"estimator": "grpo"}, roles_module.REFERENCE_COPY, roles_module.CRITIC_NONE),
    "lora, critic-free estimator, reward model": ({"lora": True, "reward": "same", "estimator": "reinforce_pp"},
                                                  roles_module.REFERENCE_BASE, roles_module.CRITIC_NONE),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_plan_and_trainer_agree_on_every_layout(name, model_dir, reward_model_dir, other_vocab_reward_dir, prompts_file, tmp_path):
    from ppokit.plan import plan_for

    changes, reference, critic = LAYOUTS[name]
    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run", total_episodes=8)
    if changes.get("lora"):
        config.lora = LoraConfig(r=4, alpha=8, value_model_lora=changes.get("value_model_lora", True))
    if "reward" in changes:
        config.reward.model = str(reward_model_dir if changes["reward"] == "same" else other_vocab_reward_dir)
    if "ref_model" in changes:
        config.ref_model = str(model_dir(changes["ref_model"]))
    value = changes.get("value_model")
    config.value_model = str(model_dir(value)) if value in ("gpt2", "qwen2") else value
    if "estimator" in changes:
        config.ppo.advantage_estimator = changes["estimator"]
        config.ppo.num_samples_per_prompt = 2

    plan = plan_for(config)
    trainer = PPOTrainer(config, show_progress=False)
    assert (trainer.layout.reference, trainer.layout.critic) == (reference, critic)
    assert plan.layout == trainer.layout
    assert plan_role_table(plan) == trainer_role_table(trainer)
