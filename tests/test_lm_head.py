"""The memory-light LM head: the same logprobs, entropy and gradients as the direct computation."""

import math

import pytest
import torch
from conftest import assert_float32_close

from ppokit.training import algo
from ppokit.errors import UserError
from ppokit.models.loading import check_output_head, output_head, response_logprobs


def _batch(vocab: int, seed: int = 0):
    """Left-padded prompts and right-padded responses of varied lengths (one row with no response token)."""
    g = torch.Generator().manual_seed(seed)
    B, P, R = 5, 6, 7
    ids = torch.randint(4, vocab, (B, P + R), generator=g)
    prompt_len, response_len = torch.tensor([6, 3, 1, 4, 2]), torch.tensor([7, 2, 5, 0, 1])
    mask = torch.zeros(B, P + R, dtype=torch.long)
    for b in range(B):
        mask[b, P - prompt_len[b] : P + response_len[b]] = 1
    response_mask = mask[:, P:].bool()
    return ids, mask, ids[:, P:], response_mask


def _grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params, allow_unused=True)


@pytest.mark.parametrize("chunk_size", [1, 4, 1000])
def test_light_head_equals_direct_values_and_gradients(model_dir, chunk_size):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir("llama"))
    ids, mask, response_ids, response_mask = _batch(model.config.vocab_size)
    weights = torch.randn(response_mask.shape, generator=torch.Generator().manual_seed(1))

    def run(**kw):
        logprobs, entropy = response_logprobs(model, ids, mask, response_ids, response_mask, 0.7, with_entropy=True, entropy_grad=True, **kw)
        loss = (logprobs * weights).sum() + (entropy * weights.flip(0)).sum()
        return logprobs.detach(), entropy.detach(), _grads(model, loss)

    direct = run()
    light = run(chunk_size=chunk_size)
    # The chunks change the summation order over the vocabulary (log-sum-exp) and, in the backward, over the
    # hidden and intermediate features: equal to a few float32 ulps of each tensor's magnitude.
    terms = max(model.config.vocab_size, model.config.intermediate_size)
    for a, b in zip(direct[:2], light[:2]):
        assert_float32_close(b, a, terms)
        assert (b[~response_mask] == 0).all()
    for ga, gb in zip(direct[2], light[2]):
        assert_float32_close(gb, ga, terms)


def test_light_head_in_float64_is_exact_to_1e_6(model_dir):
    """The same comparison without float32 rounding in the way: 1e-6 relative on every gradient."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir("llama")).double()
    ids, mask, response_ids, response_mask = _batch(model.config.vocab_size, seed=3)

    def run(**kw):
        logprobs, entropy = response_logprobs(model, ids, mask, response_ids, response_mask, 1.3, with_entropy=True, entropy_grad=True, **kw)
        return logprobs.detach(), _grads(model, logprobs.sum() - 0.01 * entropy.sum())

    (lp_a, g_a), (lp_b, g_b) = run(), run(chunk_size=3)
    assert torch.allclose(lp_a.float(), lp_b.float(), atol=1e-6)
    for a, b in zip(g_a, g_b):
        assert (a - b).abs().max().item() <= 1e-6 * max(a.abs().max().item(), 1.0)


def test_entropy_gradient_only_when_asked():
    torch.manual_seed(0)
    hidden = torch.randn(6, 8, requires_grad=True)
    head = torch.nn.Linear(8, 11)
    tokens = torch.randint(0, 11, (6,))
    _, stat = algo.chunked_head_logprobs(hidden, head, tokens, 0.7, 4, with_entropy=True)
    assert not stat.requires_grad
    _, ent = algo.chunked_head_logprobs(hidden, head, tokens, 0.7, 4, with_entropy=True, entropy_grad=True)
    (g,) = torch.autograd.grad(ent.sum(), hidden)
    # dH/ds_k = -p_k (log p_k + H) by autograd through the direct formula: the same gradient.
    _, direct = algo.logprobs_and_entropy(head(hidden), tokens, 0.7, entropy_grad=True)
    (expected,) = torch.autograd.grad(direct.sum(), hidden)
    # the terms p_k (log p_k + H) / T are at most about log(V) / T
    assert_float32_close(g, expected, terms=11, scale=math.log(11) / 0.7)
    logp = torch.log_softmax(head(hidden).detach() / 0.7, -1)
    manual = -(logp.exp() * (logp + (-(logp.exp() * logp).sum(-1, keepdim=True)))) / 0.7  # dH/dlogits
    assert_float32_close(manual @ head.weight, expected, terms=11, scale=math.log(11) / 0.7)


def test_light_head_materialises_no_full_vocabulary_tensor(model_dir):
    """Peak of the tensors autograd keeps: the direct path holds (B, R, V) float32 copies, the light head none."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir("llama"))
    ids, mask, response_ids, response_mask = _batch(model.config.vocab_size)
    V = model.config.vocab_size

    def widest_saved(**kw):
        sizes = []

        def pack(t):
            sizes.append(t.numel() if t.shape and t.shape[-1] == V and t.dim() > 1 else 0)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logprobs, _ = response_logprobs(model, ids, mask, response_ids, response_mask, 0.7, with_entropy=True, **kw)
        return max(sizes)

    assert widest_saved() >= ids.shape[0] * response_ids.shape[1] * V
    assert widest_saved(chunk_size=2) == 0  # checkpointed chunks keep only their hidden states


def test_sampling_logprobs_equal_the_light_head(model_dir, tokenizer):
    """Sampling keeps its own per-step logprobs (KV cache); they equal both heads' on the sampled rows."""
    from transformers import AutoModelForCausalLM

    from ppokit.models.loading import left_pad
    from ppokit.engines.hf import HFSampler

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir("llama")).eval()
    ids, mask = left_pad([tokenizer("the movie was")["input_ids"], tokenizer("the acting")["input_ids"]], tokenizer.pad_token_id)
    rollout = HFSampler(model, 9, 0.8, tokenizer.eos_token_id, tokenizer.pad_token_id).sample(ids, mask)
    with torch.no_grad():
        for kw in ({}, {"chunk_size": 3}):
            lp, _ = response_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.response_ids, rollout.loss_mask, 0.8, **kw)
            # the KV cache's incremental attention against one full forward: float32 rounding through the model
            assert_float32_close(lp, rollout.logprobs, terms=model.config.intermediate_size)


def double_the_logits(model):
    """Makes `model`'s forward compute its logits otherwise than its head does (twice them)."""
    original = model.forward

    def doubled(*a, **kw):
        out = original(*a, **kw)
        out.logits = out.logits * 2
        return out

    model.forward = doubled


def test_a_model_whose_logits_the_head_cannot_reproduce_is_refused(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir("llama"))
    check_output_head(model, "lm_head_chunk_size")
    double_the_logits(model)
    with pytest.raises(UserError, match="lm_head_chunk_size: LlamaForCausalLM's forward computes its logits"):
        check_output_head(model, "lm_head_chunk_size")


def test_output_head_applies_the_families_logit_transforms(tokenizer):
    from transformers import AutoModelForCausalLM, Gemma2Config

    config = Gemma2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=3.0,
                          pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    torch.nn.init.normal_(model.get_output_embeddings().weight, std=2.0)  # logits large enough for the cap to matter
    check_output_head(model, "lm_head_chunk_size")
    assert output_head(model)(torch.randn(3, 32)).abs().max() <= 3.0


@pytest.mark.parametrize("temperature, entropy_grad, dtype", [(1.0, False, torch.float32), (0.7, True, torch.float32),
                                                              (1.3, True, torch.float64), (0.7, True, torch.bfloat16)])
def test_the_head_function_equals_the_autograd_chain(temperature, entropy_grad, dtype):
    """`head_logprobs_and_entropy` (blocks of rows, one gradient buffer) against `logprobs_and_entropy`
    (scale, log-softmax, exp, product by autograd): values and the logits' gradient, for blocks of 1 row,
    of 3 rows and of every row."""
    g = torch.Generator().manual_seed(0)
    N, V = 7, 50
    logits = (3 * torch.randn(N, V, generator=g)).to(dtype)
    tokens = torch.randint(0, V, (N,), generator=g)
    w_lp, w_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)

    def run(fn):
        x = logits.clone().requires_grad_()
        lp, ent = fn(x)
        loss = (lp * w_lp).sum() + ((ent * w_ent).sum() if entropy_grad else 0)
        loss.backward()
        return lp.detach(), ent.detach(), x.grad

    want = run(lambda x: algo.logprobs_and_entropy(x, tokens, temperature, entropy_grad))
    for rows in (1, 3, N):
        got = run(lambda x: algo.head_logprobs_and_entropy(x, tokens, temperature, entropy_grad, block_elements=rows * V))
        for a, b in zip(want, got):
            assert a.dtype == b.dtype
            if dtype == torch.bfloat16:  # both compute in float32: one bfloat16 rounding (2^-8 relative) apart at most
                assert torch.allclose(a.double(), b.double(), atol=1e-2, rtol=1e-2), (rows, (a.double() - b.double()).abs().max())
            else:  # reductions over the vocabulary in float32
                assert_float32_close(b, a, terms=V)


def test_the_head_function_makes_one_vocabulary_wide_tensor():
    """The autograd chain makes 3 (N, V) tensors (5 with the entropy's gradient) besides the logits; the head
    function makes one, the logits' gradient, and the rest a block of rows at a time."""
    from conftest import LiveTensors

    N, V = 64, 5000
    tokens = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(0))

    def wide(fn, entropy_grad):
        logits = torch.randn(N, V).requires_grad_()
        with LiveTensors(wide_elements=N * V) as mode:
            lp, ent = fn(logits, tokens, 0.7, entropy_grad)
            (lp.sum() + (ent.sum() if entropy_grad else 0)).backward()
        return mode.peak_wide

    light = lambda *a: algo.head_logprobs_and_entropy(*a, block_elements=8 * V)  # noqa: E731
    assert (wide(algo.logprobs_and_entropy, False), wide(algo.logprobs_and_entropy, True)) == (3, 5)
    assert (wide(light, False), wide(light, True)) == (1, 1)


def test_the_trainer_refuses_such_a_model_before_its_optimiser(model_dir, prompts_file, tokenizer, tmp_path, monkeypatch):
    """Through the run's set-up (`roles.build_roles` checks the loaded models' heads): lm_head_chunk_size on a policy whose
    forward computes its logits otherwise is one line, and no optimiser is built for it."""
    from conftest import tiny_ppo_config
    from transformers import AutoModelForCausalLM

    from ppokit.training import optimise
    from ppokit.trainer import PPOTrainer

    model = AutoModelForCausalLM.from_pretrained(model_dir("llama"))
    double_the_logits(model)
    built = []
    monkeypatch.setattr(optimise, "build_optimiser", lambda *a, **kw: built.append(1))
    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run", total_episodes=8)
    config.lm_head_chunk_size = 4
    with pytest.raises(UserError, match="lm_head_chunk_size: LlamaForCausalLM's forward computes its logits"):
        PPOTrainer(config, model=model, tokenizer=tokenizer, show_progress=False)
    assert not built
