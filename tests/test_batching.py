"""Token-budget micro-batches: the plan, packing rows without padding between them, restoring order."""

from dataclasses import replace

import pytest
import torch
from conftest import assert_float32_close

from ppokit.training import algo, batching
from ppokit.training.episodes import Episodes
from ppokit.models.forwards import left_pad, position_ids_from_mask, response_logprobs


def _rollout(prompts: list[list[int]], responses: list[list[int]], width: int, pad: int = 0) -> Episodes:
    """Left-padded prompts, right-padded responses of `width` columns, as sampling leaves them."""
    query_ids, query_mask = left_pad(prompts, pad)
    response_ids = torch.full((len(responses), width), pad, dtype=torch.long)
    response_mask = torch.zeros((len(responses), width), dtype=torch.bool)
    for i, r in enumerate(responses):
        response_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        response_mask[i, : len(r)] = True
    logprobs = -torch.rand(len(responses), width) * response_mask
    return Episodes(query_ids, response_ids, torch.cat([query_mask, response_mask], 1), response_mask, logprobs,
                    response_mask.any(1), algo.last_token_index(response_mask))


def _lengths(prompt: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    return prompt + response


def test_plan_packs_similar_lengths_within_the_budget_and_keeps_every_row_once():
    prompt = torch.tensor([3, 10, 2, 9, 4, 1, 8, 5])
    response = torch.tensor([2, 6, 1, 7, 3, 1, 5, 2])
    rows = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])  # a minibatch's shuffled order
    plan = batching.plan_micro_batches(rows, _lengths(prompt, response), max_tokens=40)
    assert sorted(torch.cat(plan).tolist()) == sorted(rows.tolist())
    totals = [(prompt[mb] + response[mb]).tolist() for mb in plan]
    # Longest first, by hand: 16 (row 3), 16 (row 1), 13, ... each micro-batch's packed tensor fits 40.
    assert totals == [[16, 16], [13, 7, 7], [5, 3, 2]]
    for mb in plan:
        width = int((prompt[mb] + response[mb]).max())
        assert len(mb) * width <= 40
    flat = [t for group in totals for t in group]
    assert flat == sorted(flat, reverse=True), "rows of similar length are packed together"


def test_plan_is_a_function_of_lengths_and_the_seeded_order():
    prompt, response = torch.tensor([4, 4, 4, 4, 2, 2]), torch.tensor([1, 1, 1, 1, 3, 3])
    order = torch.randperm(6, generator=torch.Generator().manual_seed(7))
    a = batching.plan_micro_batches(order, _lengths(prompt, response), max_tokens=12)
    b = batching.plan_micro_batches(order.clone(), _lengths(prompt, response), max_tokens=12)
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    # Equal lengths keep the minibatch's own (seeded) order: a stable sort.
    assert [i for mb in a for i in mb.tolist()] == sorted(order.tolist(), key=lambda i: -(prompt[i] + response[i]).item())


@pytest.mark.parametrize("budget, groups", [(10**6, 1), (1, None)])
def test_budget_bounds(budget, groups):
    prompt, response = torch.tensor([3, 2, 1]), torch.tensor([1, 2, 2])
    if groups is None:
        with pytest.raises(batching.BudgetTooSmall, match=r"a row of 4 tokens is longer than ppo.max_tokens_per_micro_batch=1"):
            batching.plan_micro_batches(torch.arange(3), _lengths(prompt, response), budget)
    else:
        assert len(batching.plan_micro_batches(torch.arange(3), _lengths(prompt, response), budget)) == groups


def test_check_budget_names_both_numbers():
    from ppokit.data import lengths

    lengths.check_budget(None, [5, 9], 16)
    lengths.check_budget(25, [5, 9], 16)
    with pytest.raises(lengths.BudgetTooSmall, match=r"max_tokens_per_micro_batch=24 is smaller than .*25 tokens.*9 tokens.*response_length 16"):
        lengths.check_budget(24, [5, 9], 16)


def test_pack_ends_every_row_at_the_last_column_and_moves_its_token_fields_along():
    rollout = _rollout([[5, 6], [7, 8, 9]], [[1], [2, 3]], width=5)
    rollout = replace(rollout, values=torch.arange(10.0).reshape(2, 5))
    rollout = replace(rollout, query_ids=torch.cat([torch.zeros(2, 2, dtype=torch.long), rollout.query_ids], 1),
                      attention_mask=torch.cat([torch.zeros(2, 2, dtype=torch.bool), rollout.attention_mask], 1))
    packed = batching.pack(rollout)
    # Rows of 3 and 5 tokens: 5 columns, the last 2 the response columns; the short row's prompt reaches into them.
    assert packed.input_ids.tolist() == [[0, 0, 5, 6, 1], [7, 8, 9, 2, 3]]
    assert packed.attention_mask.long().tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert packed.response_ids.tolist() == [[6, 1], [2, 3]] and packed.loss_mask.tolist() == [[False, True], [True, True]]
    assert packed.score_index.tolist() == [1, 1]  # each row's last response token, where it now sits
    assert packed.values.tolist() == [[0.0, 0.0], [5.0, 6.0]]  # token 0 of each response keeps its value
    assert packed.ended.tolist() == rollout.ended.tolist()
    # Positions of the real tokens are the same before and after.
    before = position_ids_from_mask(rollout.attention_mask)[rollout.attention_mask.bool()]
    after = position_ids_from_mask(packed.attention_mask)[packed.attention_mask.bool()]
    assert before.tolist() == after.tolist()
    assert batching.pack(packed).input_ids.tolist() == packed.input_ids.tolist()


def test_pack_against_a_plain_loop():
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 40, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (9,), generator=g)]
    responses = [torch.randint(5, 40, (int(n),), generator=g).tolist() for n in torch.randint(0, 7, (9,), generator=g)]
    rollout = _rollout(prompts, responses, width=6)
    packed = batching.pack(rollout)
    width, width_r = max(len(p) + len(r) for p, r in zip(prompts, responses)), max(len(r) for r in responses)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        assert packed.input_ids[i].tolist() == [0] * (width - len(p) - len(r)) + p + r
        assert packed.loss_mask[i].tolist() == [False] * (width_r - len(r)) + [True] * len(r)
        assert packed.logprobs[i][packed.loss_mask[i]].tolist() == rollout.logprobs[i, : len(r)].tolist()


def test_trimmed_micro_batches_restore_the_padded_results(model_dir):
    """Reference-style pass: per packed micro-batch logprobs, scattered back, equal the padded batch's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir("llama")).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 40, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (7,), generator=g)]
    responses = [torch.randint(5, 40, (int(n),), generator=g).tolist() for n in torch.randint(0, 7, (7,), generator=g)]
    rollout = _rollout(prompts, responses, width=6)
    with torch.no_grad():
        full, _ = response_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.response_ids,
                                    rollout.trained_mask, 0.7)
        plan = batching.plan_episodes(torch.arange(7), rollout, max_tokens=30)
        assert len(plan) > 1
        pieces, micro = [], []
        for index in plan:
            mb = batching.pack(rollout.select(index))
            micro.append(mb)
            lp, _ = response_logprobs(model, mb.input_ids, mb.attention_mask, mb.response_ids, mb.trained_mask, 0.7)
            pieces.append((index, lp, mb.trained_mask))
    restored = batching.restore_tokens(pieces, rollout.trained_mask)
    # other batch shapes, other kernels: a logprob near 0 (p ~ 1) still carries rounding of its logits' size
    assert_float32_close(restored, full, terms=model.config.vocab_size)
    processed, real = batching.padded_tokens(micro)
    assert int(real) == int(rollout.attention_mask.sum())
    assert real <= processed < rollout.query_ids.numel() + rollout.response_ids.numel()


def test_pack_of_a_dropped_row_and_right_align_of_any_padded_layout():
    rollout = _rollout([[5, 6, 7], [8]], [[], [9, 9]], width=3)
    packed = batching.pack(rollout.select(torch.tensor([0])))  # a dropped row: its prompt only
    assert packed.query_ids.tolist() == [[5, 6, 7]] and packed.response_ids.shape == (1, 0)
    ids = torch.tensor([[0, 0, 4, 5, 0, 0], [0, 0, 0, 6, 7, 0]])
    aligned, mask, _ = batching.right_align(ids, ids > 0)
    assert aligned.tolist() == [[4, 5], [6, 7]] and mask.all()


def test_a_row_outside_the_update_is_forwarded_as_its_prompt():
    # valid False (reward.on_error=skip): no forward needs its response, in either kind of micro-batch
    rollout = replace(_rollout([[5, 6, 7], [8]], [[4, 4], [9, 9]], width=3), valid=torch.tensor([False, True]))
    for budget in (None, 100):
        ((_, mb),) = batching.split(rollout, torch.arange(2), 2, budget)
        real = [row[m].tolist() for row, m in zip(mb.input_ids, mb.attention_mask)]
        assert real == [[5, 6, 7], [8, 9, 9]]
        assert mb.trained_mask.sum(1).tolist() == [0, 2]


def test_pack_moves_a_loss_mask_with_a_gap_and_restore_tokens_puts_it_back():
    # response [a o o b]: o an observation, read (attention) but not trained on (loss_mask)
    rollout = _rollout([[5, 6], [7]], [[1, 2, 3, 4], [8]], width=4)
    loss_mask = torch.tensor([[True, False, False, True], [True, False, False, False]])
    rollout = replace(rollout, loss_mask=loss_mask, values=torch.arange(8.0).reshape(2, 4), score_index=torch.tensor([3, 0]))
    ((index, mb),) = batching.split(rollout, torch.arange(2), 2, 100)
    assert mb.input_ids.tolist() == [[5, 6, 1, 2, 3, 4], [0, 0, 0, 0, 7, 8]]
    assert mb.loss_mask.tolist() == [[True, False, False, True], [False, False, False, True]]
    assert mb.values.tolist() == [[0.0, 1.0, 2.0, 3.0], [0.0, 0.0, 0.0, 4.0]]
    assert mb.score_index.tolist() == [3, 3]
    restored = batching.restore_tokens([(index, mb.values + 10, mb.trained_mask)], rollout.trained_mask)
    assert restored.tolist() == [[10.0, 0.0, 0.0, 13.0], [14.0, 0.0, 0.0, 0.0]]


def _stop_ending_rows_apart(model, ids, mask, pad_token_id) -> int:
    """A stop token that ends the rows of a sampling (24 tokens, temperature 2) at the most different lengths, and not
    all of them, preferably one row well before a row after it."""
    from ppokit.engines.hf import HFSampler

    torch.manual_seed(0)
    free = HFSampler(model, 24, 2.0, None, pad_token_id).sample(ids, mask)

    def spread(token):
        hits = free.response_ids == token
        if hits.any(1).all():
            return (False, 0)
        ends = [int(h.nonzero()[0]) if h.any() else len(h) for h in hits]
        # preferred: a row ends 4+ steps before a row after it in the batch (which then moves up when it leaves)
        apart = any(ends[i] + 4 < ends[j] for i in range(len(ends)) for j in range(i + 1, len(ends)))
        return (apart, len(set(ends)))

    return max(set(free.response_ids.flatten().tolist()), key=spread)


@pytest.mark.parametrize("compact_every", [1, 3])
def test_sampling_without_finished_rows_draws_the_same_tokens(model_dir, tokenizer, compact_every):
    """Finished rows leave the forward batch and the KV cache; the random stream, and so every token, stays."""
    from transformers import AutoModelForCausalLM

    from ppokit.engines.hf import HFSampler

    model = AutoModelForCausalLM.from_pretrained(model_dir("llama")).eval()
    texts = ["the movie was", "honestly the cast was", "the", "overall the story felt", "this film is", "the acting"]
    ids, mask = left_pad([tokenizer(t)["input_ids"] for t in texts], tokenizer.pad_token_id)
    stop = _stop_ending_rows_apart(model, ids, mask, tokenizer.pad_token_id)

    def sample(every):
        torch.manual_seed(1)
        return HFSampler(model, 24, 2.0, stop, tokenizer.pad_token_id, compact_every=every).sample(ids, mask)

    plain, compact = sample(0), sample(compact_every)
    lengths = plain.loss_mask.sum(1)
    assert len(set(lengths.tolist())) > 2 and plain.ended.any() and not plain.ended.all()
    assert torch.equal(plain.response_ids, compact.response_ids)
    assert torch.equal(plain.loss_mask, compact.loss_mask)
    assert_float32_close(compact.logprobs, plain.logprobs, terms=model.config.vocab_size)  # other batch shapes


@pytest.mark.parametrize("compact_every", [0, 3])
def test_sampling_into_preallocated_keys_and_values_draws_the_same_tokens(model_dir, tokenizer, monkeypatch, compact_every):
    """The lock-step decoder writes each step's keys and values in place into buffers sized once (prompt + response);
    against transformers' own growing cache: the same tokens and logprobs, prompts of different lengths (left padding),
    with and without finished rows leaving the batch."""
    from transformers import AutoModelForCausalLM

    from ppokit.engines import hf

    model = AutoModelForCausalLM.from_pretrained(model_dir("llama")).eval()
    texts = ["the movie was", "honestly the cast was really", "the", "overall the story felt", "this film is", "the acting"]
    ids, mask = left_pad([tokenizer(t)["input_ids"] for t in texts], tokenizer.pad_token_id)
    assert len(set(mask.sum(1).tolist())) > 3
    stop = _stop_ending_rows_apart(model, ids, mask, tokenizer.pad_token_id)
    writes = []
    update = hf._PreallocatedLayer.update
    monkeypatch.setattr(hf._PreallocatedLayer, "update", lambda layer, *a, **k: writes.append(a[0].shape[0]) or update(layer, *a, **k))

    def sample(preallocate):
        torch.manual_seed(0)  # the stream `stop` was chosen from
        with monkeypatch.context() as patch:
            if not preallocate:
                patch.setattr(hf, "_preallocate", lambda cache, width: None)
            return hf.HFSampler(model, 24, 2.0, stop, tokenizer.pad_token_id, compact_every=compact_every).sample(ids, mask)

    growing = sample(False)
    assert not writes
    fixed = sample(True)
    steps = fixed.response_ids.shape[1] - 1  # the last token is not fed back
    assert len(writes) == model.config.num_hidden_layers * steps > 0
    lengths = growing.loss_mask.sum(1)
    assert growing.ended.any() and not growing.ended.all() and len(set(lengths.tolist())) > 2
    # a row left early, before a row after it in the batch stopped sampling (rows behind it move up in the buffers)
    assert any(growing.ended[i] and lengths[i] + 3 < lengths[j] for i in range(len(texts)) for j in range(i + 1, len(texts)))
    if compact_every:
        assert min(writes) < len(texts)  # finished rows left the buffers
    assert torch.equal(growing.response_ids, fixed.response_ids) and torch.equal(growing.loss_mask, fixed.loss_mask)
    assert_float32_close(fixed.logprobs, growing.logprobs, terms=model.config.vocab_size)  # other attention kernels may sum otherwise


def test_reward_model_chunks_by_tokens_give_the_scores_of_row_chunks(model_dir, tokenizer):
    from ppokit.models.loading import load_scalar_model
    from ppokit.rewards.model import RewardModelReward
    from ppokit.rewards.sources import ScoringBatch

    model = load_scalar_model(str(model_dir("llama")), "reward.model").eval()
    torch.nn.init.normal_(model.score.weight, std=1.0)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(5, 40, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (9,), generator=g)]
    responses = [torch.randint(5, 40, (int(n),), generator=g).tolist() for n in torch.randint(0, 7, (9,), generator=g)]
    rollout = _rollout(prompts, responses, width=6)
    batch = ScoringBatch(["p"] * 9, ["c"] * 9, {}, rollout.input_ids, rollout.attention_mask.long(), tokenizer)
    by_rows = RewardModelReward(model, tokenizer, batch_size=4).score(batch)
    by_tokens = RewardModelReward(model, tokenizer, batch_size=4, by_tokens=True).score(batch)
    assert torch.allclose(by_rows, by_tokens, atol=1e-5)


@pytest.mark.parametrize("cut", [{}, {"top_k": 40}])
def test_the_draw_over_the_rows_in_the_batch_keeps_torch_multinomials_tokens(model_dir, tokenizer, monkeypatch, cut):
    """The lock-step decoder draws with `sampling.multinomial_rows` over the rows still in the batch; against
    torch.multinomial over every row (the finished ones as placeholders), from the same seed: the same tokens, the same
    logprobs (the same log-softmax gathered), the generator left in the same state; finished rows leaving the batch."""
    from transformers import AutoModelForCausalLM

    from ppokit.engines import hf

    model = AutoModelForCausalLM.from_pretrained(model_dir("llama")).eval()
    texts = ["the movie was", "honestly the cast was", "the", "overall the story felt", "this film is", "the acting"]
    ids, mask = left_pad([tokenizer(t)["input_ids"] for t in texts], tokenizer.pad_token_id)
    stop = _stop_ending_rows_apart(model, ids, mask, tokenizer.pad_token_id)
    draws = []
    rows_drawn = hf.multinomial_rows
    monkeypatch.setattr(hf, "multinomial_rows", lambda probs, *a, **k: draws.append(probs.shape[0]) or rows_drawn(probs, *a, **k))

    def sample(ours, temperature):
        torch.manual_seed(0)
        with monkeypatch.context() as patch:
            patch.setattr(hf, "reproduces_multinomial", lambda: ours)
            episodes = hf.HFSampler(model, 24, temperature, stop, tokenizer.pad_token_id, compact_every=3, **cut).sample(ids, mask)
        return episodes, torch.get_rng_state()

    for temperature in (1.0, 2.0):
        (torch_draw, torch_state), (rows_draw, rows_state) = sample(False, temperature), sample(True, temperature)
        assert draws and min(draws) < len(texts)  # drawn over fewer rows once finished rows left
        lengths = torch_draw.loss_mask.sum(1)
        assert torch_draw.ended.any() and len(set(lengths.tolist())) > 2
        assert torch.equal(torch_draw.response_ids, rows_draw.response_ids) and torch.equal(torch_draw.loss_mask, rows_draw.loss_mask)
        assert torch.equal(torch_draw.logprobs, rows_draw.logprobs)
        assert torch.equal(torch_state, rows_state)
        draws.clear()
