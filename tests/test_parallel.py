"""ppokit.process.parallel in one process, without a process group: choosing the strategy, finding the layers to
shard, the meta skeleton that consolidated saves are built on, and the config checks. The multi-process
behaviour is in tests/test_multiprocess.py."""

import dataclasses
import re

import pytest
import torch
from torch import nn

from ppokit.process import parallel
from ppokit.config.schema import PPOConfig
from ppokit.errors import UserError
from ppokit.models.loading import value_model_from_policy
from ppokit.demos.tiny import tiny_causal_lm

BASE = ["model=some/model", "reward.functions=[sentiment]"]


def test_parallel_keys_and_their_defaults():
    config = PPOConfig.load(None, BASE)
    assert (config.parallel.strategy, config.parallel.shard_frozen, config.parallel.cpu_offload) == ("ddp", True, False)
    assert (config.parallel.wrap_classes, config.parallel.unshard_for_generation) == ([], True)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.strategy=zero3"], "parallel.strategy: value 'zero3' is out of range, it must be one of ddp, fsdp"),
        (["parallel.stratgy=fsdp"], "unknown config key parallel.stratgy (did you mean parallel.strategy?)"),
        (["parallel.strategy=fsdp", "lora={}", "quantization=4bit"], "parallel.strategy: fsdp cannot shard quantised (4bit) weights"),
        (["parallel.strategy=fsdp", "fp16=true"], "set bf16: true instead of fp16"),
    ],
)
def test_bad_parallel_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(UserError, match=re.escape(message)):
        PPOConfig.load(None, BASE + overrides)


def test_an_unknown_strategy_object_is_refused_by_the_strategy_too():
    settings = PPOConfig().parallel
    settings.strategy = "zero3"  # set in Python, past the config check
    with pytest.raises(UserError, match="parallel.strategy: unknown strategy 'zero3'; use one of ddp, fsdp"):
        parallel.strategy(settings, accelerator=None)


def test_each_declared_strategy_has_its_class_and_checkpoint_layout():
    from ppokit.run.checkpoint import PlainWeights
    from ppokit.process.strategies import STRATEGIES

    layouts = {PlainWeights.kind, parallel.ShardedWeights.kind}
    for name, facts in STRATEGIES.items():
        cls = getattr(parallel, facts.implementation)
        assert cls.strategy == name and facts.checkpoint_weights in layouts
        assert set(facts.keys) <= {f.name for f in dataclasses.fields(PPOConfig().parallel)} - {"strategy"}
    assert parallel.Replicated(type("Accelerator", (), {"num_processes": 1})()).checkpoint_weights() is None  # PlainWeights


def test_decoder_layers_come_from_no_split_modules(tokenizer):
    for arch, layer in (("llama", "LlamaDecoderLayer"), ("gpt2", "GPT2Block"), ("qwen2", "Qwen2DecoderLayer")):
        model = tiny_causal_lm(arch, tokenizer, layers=3)
        found = parallel.decoder_layers(model)
        assert [type(m).__name__ for m in found] == [layer] * 3
        assert parallel.decoder_layers(model, ["LlamaMLP"] if arch == "llama" else [layer])  # the key overrides


class NoLayersDeclared(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))


def test_a_model_whose_layers_cannot_be_found_names_its_class_and_the_key():
    with pytest.raises(UserError) as e:
        parallel.decoder_layers(NoLayersDeclared())
    assert str(e.value) == (
        "parallel.strategy: fsdp cannot find the decoder layers of NoLayersDeclared to shard: it declares no "
        "_no_split_modules; set parallel.wrap_classes to the layer class name(s) (its repeated blocks: Linear)"
    )
    assert parallel.decoder_layers(NoLayersDeclared(), ["Linear"])
    with pytest.raises(UserError, match=r"none of parallel.wrap_classes \['Block'\] is in the model"):
        parallel.decoder_layers(NoLayersDeclared(), ["Block"])


def test_units_keep_tied_weights_together_and_give_a_critic_its_own_backbone_and_head(tokenizer):
    policy = tiny_causal_lm("llama", tokenizer)
    units, root = parallel._units(policy, [])
    assert root is policy and all(type(u).__name__ == "LlamaDecoderLayer" for u in units)  # embeddings tied to the head: root
    critic = value_model_from_policy(policy)
    units, root = parallel._units(critic, [])
    assert [type(u).__name__ for u in units[-2:]] == ["LlamaModel", "Linear"]  # backbone, then the score head


def test_meta_skeleton_costs_no_weights_and_materializes_a_plain_copy(tokenizer):
    policy = tiny_causal_lm("llama", tokenizer)
    skeleton = parallel.meta_skeleton(policy)
    assert all(p.is_meta for p in skeleton.parameters())
    assert skeleton.lm_head.weight is skeleton.model.embed_tokens.weight  # ties kept
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)  # the skeleton shares nothing with the model it was taken from
    plain = parallel.materialize(skeleton, {k: v.clone() for k, v in policy.state_dict().items()})
    assert plain.lm_head.weight is plain.model.embed_tokens.weight
    ids = torch.tensor([[5, 6, 7]])
    assert torch.equal(plain(ids).logits, policy(ids).logits)
    with pytest.raises(RuntimeError, match="no full weight for"):
        parallel.materialize(skeleton, {})
