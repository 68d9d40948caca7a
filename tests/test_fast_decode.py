"""rollout.enforce_eager: false with the hf engine (`engines.fast_decode`): the lock-step decoder's steps through
ppokit's own compiled decoding step draw the eager path's tokens, with its logprobs within float rounding."""

import pytest
import torch
from conftest import assert_float32_close
from test_batching import _stop_ending_rows_apart

from ppokit.engines import fast_decode, hf
from ppokit.engines.base import Sampling
from ppokit.errors import UserError
from ppokit.models.forwards import left_pad

TEXTS = ["the movie was", "honestly the cast was really", "the", "overall the story felt", "this film is", "the acting"]


def _depth_terms(config) -> int:
    """The float32 terms behind one logit, for `assert_float32_close`: every layer's products (over the hidden and
    the MLP's widths) and attention's sums feed the next, so a kernel's rounding grows with all of them together."""
    return config.num_hidden_layers * (config.hidden_size + config.intermediate_size + 256) + config.vocab_size


def _load(model_dir, arch):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir(arch)).eval()


def test_the_engine_with_enforce_eager_false_samples_the_eager_engines_tokens(model_dir, tokenizer, monkeypatch):
    """Through the engine's own path (generate -> lock-step batch; finished rows leave the batch every 8 steps): the same
    tokens, the logprobs within float rounding, and every decoding step through the compiled step."""
    model = _load(model_dir, "llama")
    ids, mask = left_pad([tokenizer(t)["input_ids"] for t in TEXTS], tokenizer.pad_token_id)
    stop = _stop_ending_rows_apart(model, ids, mask, tokenizer.pad_token_id)
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    steps = []
    call = fast_decode.DecodeStep.__call__
    monkeypatch.setattr(fast_decode.DecodeStep, "__call__", lambda self, *a: steps.append(a[1].shape[0]) or call(self, *a))

    def sample(enforce_eager):
        engine = hf.HFEngine(model, tokenizer.pad_token_id, torch.device("cpu"), 64, enforce_eager=enforce_eager)
        torch.manual_seed(0)  # the stream `stop` was chosen from
        return engine.generate(prompts, Sampling(24, 2.0, stop))

    eager = sample(True)
    assert not steps
    fast = sample(False)
    assert len(steps) == fast.response_ids.shape[1] - 1 and min(steps) < len(TEXTS)  # every step; finished rows left
    lengths = eager.loss_mask.sum(1)
    assert eager.ended.any() and not eager.ended.all() and len(set(lengths.tolist())) > 2
    assert torch.equal(eager.response_ids, fast.response_ids) and torch.equal(eager.loss_mask, fast.loss_mask)
    assert_float32_close(fast.logprobs, eager.logprobs, terms=_depth_terms(model.config))


@pytest.mark.parametrize("compiled", [False, True])
def test_the_step_of_a_model_with_biased_projections_matches_its_own_forward(model_dir, tokenizer, compiled):
    """qwen2 (query/key/value biases), rows leaving the batch every 3 steps; the same functions uncompiled too. The
    logprobs of every step against the model's own forward, and the same tokens."""
    model = _load(model_dir, "qwen2")
    assert fast_decode.why_not(model) is None
    torch.manual_seed(0)
    with torch.no_grad():  # biases that count (a fresh model's are zero)
        for layer in model.model.layers:
            for name in ("q_proj", "k_proj", "v_proj"):
                torch.nn.init.normal_(getattr(layer.self_attn, name).bias, std=0.5)
    ids, mask = left_pad([tokenizer(t)["input_ids"] for t in TEXTS], tokenizer.pad_token_id)

    def sample(step):
        torch.manual_seed(3)
        return hf.HFSampler(model, 16, 1.5, None, tokenizer.pad_token_id, compact_every=3, decode_step=step).sample(ids, mask)

    own, fast = sample(None), sample(fast_decode.DecodeStep(compiled=compiled))
    assert torch.equal(own.response_ids, fast.response_ids)
    assert_float32_close(fast.logprobs, own.logprobs, terms=_depth_terms(model.config))


def test_the_step_refuses_models_it_does_not_compute_with_one_line(model_dir, tokenizer):
    """gpt2 (another decoder) and a LoRA policy (its adapters are not read): a UserError at the engine's start, naming the
    key, the reason and the way out."""
    import peft

    gpt2 = _load(model_dir, "gpt2")
    with pytest.raises(UserError, match=r"^rollout.enforce_eager: false: .*model type 'gpt2' .*set rollout.enforce_eager: true$"):
        hf.HFEngine(gpt2, tokenizer.pad_token_id, torch.device("cpu"), 8, enforce_eager=False)
    lora = peft.get_peft_model(_load(model_dir, "llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(UserError, match=r"layer 0's self_attn.q_proj is a Linear, not a plain nn.Linear"):
        hf.HFEngine(lora, tokenizer.pad_token_id, torch.device("cpu"), 8, enforce_eager=False)
    hf.HFEngine(gpt2, tokenizer.pad_token_id, torch.device("cpu"), 8)  # the default: any causal LM


def test_the_config_key_is_the_hf_engines_too(model_dir):
    """rollout.enforce_eager is accepted with the hf engine (not refused as vLLM's alone) and reaches the engine the trainer
    builds."""
    from ppokit.config.schema import PPOConfig
    from ppokit.engines import EngineSetup, build

    config = PPOConfig.load(None, ["model=m", "reward.functions=[length]", "rollout.enforce_eager=false"])
    config.validate()
    assert config.rollout.engine == "hf" and config.rollout.enforce_eager is False
    model = _load(model_dir, "llama")
    setup = lambda settings: EngineSetup(lambda: model, 0, torch.device("cpu"), 8, lambda policy: (), settings)  # noqa: E731
    assert isinstance(build("hf", setup(config.rollout))._decode_step, fast_decode.DecodeStep)
    assert build("hf", setup(PPOConfig(model="m").rollout))._decode_step is None



def test_the_lm_head_goes_through_the_layers_product(model_dir, tokenizer, monkeypatch):
    """The LM head (a vocabulary x hidden product, most of a small model's step) through the product `linear_for` picks
    for the layers (oneDNN's for float32 on a CPU), and the step's logits the model's own within float rounding."""
    model = _load(model_dir, "llama")
    products = []

    def counted(x, weight, bias=None):
        products.append(weight)
        return torch.nn.functional.linear(x, weight, bias)
    monkeypatch.setattr(fast_decode, "linear_for", lambda x, w: counted)
    ids, mask = left_pad([tokenizer(t)["input_ids"] for t in TEXTS], tokenizer.pad_token_id)

    def sample(step):
        torch.manual_seed(3)
        return hf.HFSampler(model, 4, 1.0, None, tokenizer.pad_token_id, decode_step=step).sample(ids, mask)

    own, fast = sample(None), sample(fast_decode.DecodeStep(compiled=False))
    assert sum(w is model.lm_head.weight for w in products) == fast.response_ids.shape[1] - 1  # once a decoding step
    assert torch.equal(own.response_ids, fast.response_ids)
    assert_float32_close(fast.logprobs, own.logprobs, terms=_depth_terms(model.config))
