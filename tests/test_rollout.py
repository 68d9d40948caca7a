"""The sampler's knobs: top-k / top-p / min-p truncation, greedy decoding, and the logprobs kept."""

import math

import pytest
import torch

from ppokit.training import algo
from ppokit.models.forwards import left_pad, response_logits
from ppokit.models.loading import load_causal_lm
from ppokit.engines.hf import HFSampler, truncate_distribution

PROBS = torch.tensor([[0.5, 0.3, 0.15, 0.05]])


def _kept(logprobs):
    return truncate_distribution(PROBS.log(), **logprobs).exp()[0].tolist()


def test_truncation_by_hand():
    assert _kept({}) == pytest.approx([0.5, 0.3, 0.15, 0.05])
    assert _kept({"top_k": 2}) == pytest.approx([0.625, 0.375, 0, 0])
    # top-p 0.7: 0.5 < 0.7 so 0.3 stays; 0.5 + 0.3 already covers 0.7, so 0.15 goes
    assert _kept({"top_p": 0.7}) == pytest.approx([0.625, 0.375, 0, 0])
    assert _kept({"top_p": 0.81}) == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    assert _kept({"top_p": 0.01}) == pytest.approx([1, 0, 0, 0])  # the most likely token always stays
    # min-p 0.5: keep p >= 0.25; min-p 0.2: keep p >= 0.1
    assert _kept({"min_p": 0.5}) == pytest.approx([0.625, 0.375, 0, 0])
    assert _kept({"min_p": 0.2}) == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    # in order: top-k 3 renormalises to (0.526, 0.316, 0.158); top-p 0.9 then keeps all three
    assert _kept({"top_k": 3, "top_p": 0.9}) == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    assert _kept({"top_k": 10}) == pytest.approx([0.5, 0.3, 0.15, 0.05])  # k above the vocabulary: no cut


@pytest.fixture
def policy_and_prompts(model_dir, tokenizer, demo_data):
    torch.manual_seed(0)
    policy = load_causal_lm(str(model_dir("llama"))).eval()
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in demo_data["prompts"][:8]]
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    return policy, tokenizer, ids, mask


def _sampler(policy, tokenizer, **knobs):
    return HFSampler(policy, response_length=10, temperature=0.7, stop_token_ids=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id, **knobs)


@pytest.mark.parametrize("knobs", [{"top_k": 3}, {"top_p": 0.8}, {"min_p": 0.1}, {"top_k": 5, "top_p": 0.9, "min_p": 0.05}])
def test_truncated_sampling_keeps_full_softmax_logprobs(policy_and_prompts, knobs):
    """With the sampling distribution truncated, the logprobs kept are the policy's full softmax at
    the temperature: a fresh forward gives the same, so the first PPO ratio is 1."""
    policy, tokenizer, ids, mask = policy_and_prompts
    rollout = _sampler(policy, tokenizer, **knobs).sample(ids, mask)
    with torch.no_grad():
        logits = response_logits(policy, rollout.input_ids, rollout.attention_mask, rollout.response_ids.shape[1])
    fresh = algo.logprobs_from_logits(logits, rollout.response_ids, 0.7)
    ratio = torch.exp(fresh - rollout.logprobs)[rollout.loss_mask]
    assert (ratio - 1).abs().max().item() < 1e-5
    # and every sampled token was inside the truncated distribution
    allowed = truncate_distribution(torch.log_softmax(logits.float() / 0.7, -1).flatten(0, 1), **knobs).isfinite()
    chosen = allowed.gather(1, rollout.response_ids.flatten().unsqueeze(1)).squeeze(1)
    assert chosen[rollout.loss_mask.flatten()].all()


def test_greedy_is_the_argmax_and_top_k_one_is_greedy(policy_and_prompts):
    policy, tokenizer, ids, mask = policy_and_prompts
    greedy = _sampler(policy, tokenizer, greedy=True).sample(ids, mask)
    again = _sampler(policy, tokenizer, greedy=True).sample(ids, mask)
    assert torch.equal(greedy.response_ids, again.response_ids)  # no randomness
    torch.manual_seed(1)
    top1 = _sampler(policy, tokenizer, top_k=1).sample(ids, mask)
    assert torch.equal(top1.response_ids, greedy.response_ids)
    with torch.no_grad():
        logits = response_logits(policy, greedy.input_ids, greedy.attention_mask, greedy.response_ids.shape[1])
    argmax = logits.argmax(-1)
    assert torch.equal(argmax[greedy.loss_mask], greedy.response_ids[greedy.loss_mask])
    assert greedy.logprobs[greedy.loss_mask].max().item() <= 0 and not math.isnan(greedy.logprobs.sum().item())
