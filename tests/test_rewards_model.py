import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from ppokit.config.schema import RewardConfig
from ppokit.errors import UserError
from ppokit.models.forwards import left_pad, score_at_last_token
from ppokit.rewards import RewardModelReward, ScoringBatch, build_scorer, reward_model_source
from ppokit.demos.tiny import bpe_tokenizer, tiny_config


def tiny_rm(tokenizer, seed=0, **config):
    torch.manual_seed(seed)
    cfg = tiny_config("llama", tokenizer)
    cfg.num_labels = 1
    for k, v in config.items():
        setattr(cfg, k, v)
    return AutoModelForSequenceClassification.from_config(cfg).eval()


@pytest.fixture(scope="module")
def other_tokenizer(demo_data):
    return bpe_tokenizer(r["prompt"] + " " + r["completion"] for r in demo_data["sft"])


def policy_batch(tokenizer, pairs, pad_side="mixed"):
    """Prompts and completions as the trainer hands them over: left-padded prompt + right-padded response."""
    q = [tokenizer(p)["input_ids"] for p, _ in pairs]
    r = [tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for _, c in pairs]
    q_ids, q_mask = left_pad(q, tokenizer.pad_token_id)
    width = max(map(len, r))
    r_ids = torch.tensor([x + [tokenizer.pad_token_id] * (width - len(x)) for x in r])
    r_mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in r], dtype=torch.bool)
    ids, mask = torch.cat([q_ids, r_ids], 1), torch.cat([q_mask, r_mask], 1).long()
    if pad_side in ("left", "right"):
        rows = [i[m.bool()].tolist() for i, m in zip(ids, mask)]
        ids, mask = left_pad(rows, tokenizer.pad_token_id)
        mask = mask.long()
        if pad_side == "right":
            ids = torch.stack([torch.cat([i[m.bool()], i[~m.bool()]]) for i, m in zip(ids, mask)])
            mask = mask.sort(dim=1, descending=True).values
    return ScoringBatch(
        [p for p, _ in pairs], [c for _, c in pairs], {}, ids, mask, tokenizer, ended=torch.ones(len(pairs), dtype=torch.bool)
    )


PAIRS = [("the movie was", "great ."), ("honestly the cast was", "really awful and dull , truly bad ."), ("the plot", "fun")]


def unpadded_scores(model, rows):
    return torch.stack([score_at_last_token(model, torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long))[0] for r in rows])


@pytest.mark.parametrize("pad_side", ["mixed", "left", "right"])
def test_same_vocabulary_scores_policy_ids_at_last_real_token(tokenizer, pad_side):
    rm = tiny_rm(tokenizer)
    batch = policy_batch(tokenizer, PAIRS, pad_side)
    rows = [i[m.bool()].tolist() for i, m in zip(batch.input_ids, batch.attention_mask)]
    expected = unpadded_scores(rm, rows)
    got = RewardModelReward(rm, tokenizer).score(batch)
    assert torch.allclose(got, expected, atol=1e-5)
    # no decode/re-encode round trip: texts that disagree with the ids do not change the scores
    batch.prompts, batch.completions = ["x"] * 3, ["y"] * 3
    assert torch.allclose(RewardModelReward(rm, tokenizer).score(batch), expected, atol=1e-5)


def test_other_vocabulary_gives_the_scores_of_the_decoded_text(tokenizer, other_tokenizer):
    assert tokenizer.get_vocab() != other_tokenizer.get_vocab()
    rm = tiny_rm(other_tokenizer, seed=1)
    batch = policy_batch(tokenizer, PAIRS)
    got = RewardModelReward(rm, other_tokenizer, batch_size=2).score(batch)
    # directly: the decoded text, encoded by the RM's tokenizer, then its EOS (the responses stopped)
    texts = ["the movie was great .", "honestly the cast was really awful and dull , truly bad .", "the plot fun"]
    rows = [other_tokenizer(t)["input_ids"] + [other_tokenizer.eos_token_id] for t in texts]
    expected = unpadded_scores(rm, rows)
    assert torch.allclose(got, expected, atol=1e-5), (got, expected)
    assert len(set(torch.round(expected, decimals=4).tolist())) == 3  # the rows really differ
    # texts only (e.g. Python use or a server): prompt + completion, no EOS since nothing says it stopped
    plain = RewardModelReward(rm, other_tokenizer).score(ScoringBatch(["the movie was "], ["great ."]))
    assert torch.allclose(plain, unpadded_scores(rm, [other_tokenizer("the movie was great .")["input_ids"]]), atol=1e-5)


def test_chat_rows_go_through_the_reward_models_chat_template(tokenizer, other_tokenizer):
    rm_tok = bpe_tokenizer(["<|user|> hi <|assistant|> the movie was great ."])
    rm_tok.chat_template = "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    rm = tiny_rm(rm_tok, seed=2)
    messages = [[{"role": "user", "content": "the movie was"}], [{"role": "user", "content": "the plot"}]]
    batch = policy_batch(tokenizer, [("the movie was", "great ."), ("the plot", "fun")])
    batch.columns = {"messages": messages}
    got = RewardModelReward(rm, rm_tok).score(batch)
    texts = ["<|user|> the movie was <|assistant|> great . ", "<|user|> the plot <|assistant|> fun "]
    expected = unpadded_scores(rm, [rm_tok(t, add_special_tokens=False)["input_ids"] for t in texts])
    assert torch.allclose(got, expected, atol=1e-5)
    # a conversation that ends with the data's reference answer: the policy was prompted without
    # it, so the reward model must score the completion in its place, not after it
    batch.columns = {"messages": [m + [{"role": "assistant", "content": "reference answer"}] for m in messages]}
    assert torch.allclose(RewardModelReward(rm, rm_tok).score(batch), expected, atol=1e-5)


def test_reward_model_from_a_path_uses_its_saved_tokenizer(tmp_path, tokenizer, other_tokenizer):
    rm = tiny_rm(other_tokenizer, seed=1)
    rm.save_pretrained(tmp_path / "rm")
    other_tokenizer.save_pretrained(tmp_path / "rm")
    scorer = build_scorer(RewardConfig(model=str(tmp_path / "rm"), batch_size=2))
    assert scorer.names == ["reward_model"] and scorer.reward_model is not None
    batch = policy_batch(tokenizer, PAIRS)
    assert torch.allclose(scorer.score(batch).scores, RewardModelReward(rm, other_tokenizer).score(batch), atol=1e-5)


def test_reward_models_that_cannot_serve_are_refused_before_training(tmp_path, tokenizer):
    two = tiny_rm(tokenizer, num_labels=2)
    two.save_pretrained(tmp_path / "two")
    tokenizer.save_pretrained(tmp_path / "two")
    with pytest.raises(UserError, match="reward.model: .* has 2 labels"):
        reward_model_source(str(tmp_path / "two"))
    AutoModelForCausalLM.from_config(tiny_config("llama", tokenizer)).save_pretrained(tmp_path / "lm")
    with pytest.raises(UserError, match="LlamaForCausalLM, not a sequence-classification model"):
        reward_model_source(str(tmp_path / "lm"))
    with pytest.raises(UserError, match="reward.model: model path ./missing/rm does not exist"):
        reward_model_source("./missing/rm")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="reward.model: could not load"):
        reward_model_source(str(tmp_path / "broken"))
    with pytest.raises(UserError, match="has 2 labels"):
        reward_model_source(two, tokenizer)


def test_trainer_refuses_a_multi_label_reward_model_at_construction(tmp_path, tokenizer, model_dir, prompts_file):
    from conftest import tiny_ppo_config

    from ppokit.trainer import PPOTrainer

    tiny_rm(tokenizer, num_labels=3).save_pretrained(tmp_path / "three")
    tokenizer.save_pretrained(tmp_path / "three")
    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run")
    config.reward.model = str(tmp_path / "three")
    config.reward.functions = []
    with pytest.raises(UserError, match="has 3 labels"):
        PPOTrainer(config, show_progress=False)
    assert not (tmp_path / "run").exists()
