"""The trainer's stages on tiny real models."""

import json
import math
import re

import pytest
import torch
from conftest import tiny_ppo_config

from ppokit.training import experience
from ppokit.trainer import PPOTrainer


def _trainer(model_dir, prompts_file, tmp_path, arch="llama", **ppo):
    return PPOTrainer(tiny_ppo_config(model_dir(arch), prompts_file, tmp_path / "run", **ppo), show_progress=False)


def _trainer_with_dropout(model_dir, prompts_file, tmp_path, arch, dropout, **ppo):
    """A trainer on a checkpoint whose config has `dropout` in every dropout probability (None: the arch's defaults)."""
    directory = model_dir(arch) if dropout is None else model_dir(arch, dropout=dropout)
    return PPOTrainer(tiny_ppo_config(directory, prompts_file, tmp_path / "run", **ppo), show_progress=False)


TRUNCATED = {"top_k": 5, "top_p": 0.9, "min_p": 0.05}


@pytest.mark.parametrize(
    "arch,dropout,sampling",
    [(arch, dropout, {}) for arch in ("gpt2", "llama", "qwen2") for dropout in (None, 0.5)] + [("llama", None, TRUNCATED)],
)
def test_ratio_is_one_on_first_minibatch(arch, dropout, sampling, model_dir, prompts_file, tmp_path):
    """Sampling logprobs (logits / T, KV cache, left padding) equal the training forward's, also
    for a checkpoint saved with dropout (Llama/Qwen2 attention copies `attention_dropout` at
    construction: zeroing the config alone left a first-minibatch ratio of 0.64..1.36), and with
    top-k / top-p / min-p sampling (the logprobs are the full softmax's, not the truncated distribution's)."""
    trainer = _trainer_with_dropout(model_dir, prompts_file, tmp_path, arch, dropout, temperature=0.7, response_length=12, **sampling)
    indices = trainer.batch_indices(0)
    rollout = trainer.rollout.sample([trainer.train_query_ids[i] for i in indices], *trainer.train_data.rows(indices))
    assert rollout.query_mask[:, 0].logical_not().any(), "prompts of different lengths must be left-padded"
    mb = rollout.select(torch.arange(4))
    assert trainer.model.training  # the training forward, in train mode as optimise() runs it
    new_logprobs, _, _ = trainer.model(mb.input_ids, mb.attention_mask, mb.response_ids, mb.loss_mask, 0.7)
    ratio = torch.exp(new_logprobs - mb.logprobs)[mb.loss_mask]
    assert (ratio - 1).abs().max().item() < 1e-5


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2"])
def test_first_update_ratio_is_one_with_dropout_in_the_checkpoint(arch, model_dir, prompts_file, tmp_path):
    """A real update (one minibatch, one epoch: every ratio is measured before the optimiser step)."""
    trainer = _trainer_with_dropout(
        model_dir, prompts_file, tmp_path, arch, 0.5, total_episodes=4, num_mini_batches=1, num_ppo_epochs=1,
        num_sample_generations=0,
    )
    record = trainer.step()
    assert record["val/ratio"] == pytest.approx(1.0, abs=1e-5)
    assert record["policy/approxkl_avg"] == pytest.approx(0.0, abs=1e-6)
    assert record["policy/clipfrac_avg"] == 0.0


def test_temperature_is_applied_in_reference_logprobs(model_dir, prompts_file, tmp_path):
    trainer = _trainer(model_dir, prompts_file, tmp_path, temperature=0.5)
    rollout = trainer.rollout.sample(trainer.train_query_ids[:4], *trainer.train_data.rows(range(4)))
    ref_logprobs, values, _, _ = experience.reference_and_values(
        rollout, trainer.accelerator.unwrap_model(trainer.model), trainer.ref_model, rows=trainer.config.ppo.local_rollout_forward_batch_size,
        packed=False, temperature=trainer.config.ppo.temperature, chunk_size=trainer.config.lm_head_chunk_size)
    # The reference starts equal to the policy, so with logits / T everywhere the KL is exactly 0.
    assert torch.allclose(ref_logprobs, rollout.logprobs, atol=1e-5)
    assert torch.all(values == 0)  # fresh value head starts at zero


def test_truncation_after_stop_and_early_stop(model_dir, prompts_file, tmp_path):
    trainer = _trainer(model_dir, prompts_file, tmp_path, response_length=40)
    eos = trainer.tokenizer.eos_token_id
    rollout = trainer.rollout.sample(trainer.train_query_ids[:8], *trainer.train_data.rows(range(8)))
    for ids, mask, ended in zip(rollout.response_ids, rollout.loss_mask, rollout.ended):
        real = ids[mask].tolist()
        if ended:
            assert real[-1] == eos and eos not in real[:-1]
            assert torch.all(ids[~mask] == trainer.tokenizer.pad_token_id)
        else:
            assert eos not in real
    if rollout.ended.all():
        # every row stopped: sampling stops too, before response_length
        assert rollout.response_ids.shape[1] == int(rollout.loss_mask.sum(1).max())


def dropout_left(model: torch.nn.Module) -> list[str]:
    """Every non-zero dropout probability a model holds: nn.Dropout modules and float attributes."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout) and module.p:
            found.append(f"{name}.p")
        found += [f"{name}.{k}" for k, v in vars(module).items()
                  if ("dropout" in k or k.endswith("pdrop")) and isinstance(v, float) and v]
    return found


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2"])
def test_dropout_is_off_in_every_model(arch, model_dir, prompts_file, tmp_path):
    from ppokit.models.loading import frozen_copy, load_scalar_model

    directory = model_dir(arch, dropout=0.5)
    reward_model = load_scalar_model(str(directory), "reward.model")
    assert dropout_left(reward_model) and dropout_left(frozen_copy(reward_model))  # the checkpoint does hold some
    trainer = PPOTrainer(
        tiny_ppo_config(directory, prompts_file, tmp_path / "run"), reward_model=reward_model, show_progress=False
    )
    for role, module in (("policy", trainer.policy), ("ref_model", trainer.ref_model),
                         ("value_model", trainer.value_model), ("reward", reward_model)):
        assert not dropout_left(module), role


def test_same_seed_same_metrics(model_dir, prompts_file, tmp_path):
    def run(name):
        config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / name)
        return PPOTrainer(config, show_progress=False).train()

    def strip(records):
        return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "eps"} for r in records]

    assert strip(run("a")) == strip(run("b"))


def test_metrics_and_samples_contents(model_dir, prompts_file, tmp_path):
    trainer = _trainer(model_dir, prompts_file, tmp_path, missing_eos_penalty=1.0)
    trainer.train()
    run = tmp_path / "run"
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("update", "episode", "objective/scores", "objective/kl", "objective/entropy", "objective/non_score_reward",
                "objective/rlhf_reward", "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg",
                "val/clipfrac_avg", "val/ratio", "val/num_eos_tokens", "lr", "eps", "time/generation", "time/scoring",
                "time/training", "reward/sentiment"):
        assert key in record and math.isfinite(record[key]), key
    assert record["episode"] == 16
    assert record["objective/rlhf_reward"] == pytest.approx(record["objective/scores"] + record["objective/non_score_reward"], abs=1e-5)
    samples = [json.loads(row) for row in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and {"prompt", "completion", "score", "update"} <= set(samples[0])


def words(prompts, completions, **columns):
    return [float(len(c.split())) for c in completions]


def answer_number(prompts, completions, answer, **columns):
    return [float(a[1:]) for a in answer]


@pytest.mark.parametrize("split", ["eval", "train"])
def test_each_sample_row_has_every_sources_score_and_the_data_columns(model_dir, demo_data, tmp_path, split):
    """samples.jsonl: beside the combined score, each reward source's own (`rewards`, by its reward/<name> name, before the
    weights) and the row's data columns that the functions were given (`columns`): a reader sees why a row scored what it
    did, for the eval prompts' rows and for the training batch's (no data.eval)."""
    rows = [{"prompt": r["prompt"], "answer": f"a{i}", "tags": ["t", i]} for i, r in enumerate(demo_data["prompts"][:16])]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    config = tiny_ppo_config(model_dir("llama"), tmp_path / "train.jsonl", tmp_path / "run", total_episodes=8, num_sample_generations=1)
    config.data.eval = str(tmp_path / "eval.jsonl") if split == "eval" else None
    config.reward.weights = [1.0, 2.0]
    PPOTrainer(config, reward_functions=[words, answer_number], show_progress=False).train()
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples and {s["split"] for s in samples} == {split}
    by_answer = {r["answer"]: r for r in rows}
    for sample in samples:
        assert list(sample) == ["update", "episode", "split", "prompt", "completion", "score", "rewards", "columns"]
        row = by_answer[sample["columns"]["answer"]]
        assert sample["columns"] == {"answer": row["answer"], "tags": row["tags"]} and sample["prompt"] == row["prompt"]
        expected = {"words": len(sample["completion"].split()), "answer_number": float(row["answer"][1:])}
        assert sample["rewards"] == expected
        assert sample["score"] == pytest.approx(expected["words"] + 2 * expected["answer_number"], abs=1e-5)  # float32 sum


def test_missing_eos_penalty_lowers_unfinished_scores(model_dir, prompts_file, tmp_path):
    trainer = _trainer(model_dir, prompts_file, tmp_path, response_length=2, missing_eos_penalty=3.0)
    prompts, columns = trainer.train_data.rows(range(8))
    rollout = trainer.rollout.sample(trainer.train_query_ids[:8], prompts, columns)
    scored = trainer.rollout.score(rollout, prompts, columns)
    from ppokit.rewards import sentiment

    raw = torch.tensor(sentiment(prompts, scored.completions))
    assert (~rollout.ended).any()  # two tokens are too few for every review to end
    expected = raw - 3.0 * (~rollout.ended).float()
    assert torch.allclose(scored.scores, expected)


def test_final_models_load_with_auto_classes(model_dir, prompts_file, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    trainer = _trainer(model_dir, prompts_file, tmp_path)
    trainer.train()
    final = tmp_path / "run" / "final"
    policy = AutoModelForCausalLM.from_pretrained(final)
    AutoTokenizer.from_pretrained(final)
    value = AutoModelForSequenceClassification.from_pretrained(final / "value_model")
    assert value.config.num_labels == 1
    trained = trainer.policy.state_dict()
    for name, tensor in policy.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    assert not (tmp_path / "run" / ".final.tmp").exists()


def test_reward_model_scores_at_last_real_token(model_dir, tokenizer):
    from ppokit.models.forwards import left_pad, score_at_last_token
    from ppokit.models.loading import load_scalar_model

    model = load_scalar_model(str(model_dir("llama")), "reward.model")
    seqs = [[5, 6, 7], [8, 9]]
    left_ids, left_mask = left_pad(seqs, tokenizer.pad_token_id)
    right_ids = torch.tensor([[5, 6, 7], [8, 9, tokenizer.pad_token_id]])
    right_mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    with torch.no_grad():
        alone = torch.stack([score_at_last_token(model, torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))[0] for s in seqs])
        left = score_at_last_token(model, left_ids, left_mask.long())
        right = score_at_last_token(model, right_ids, right_mask)
    assert torch.allclose(left, alone, atol=1e-5) and torch.allclose(right, alone, atol=1e-5)


def one_row_scores(prompts, completions, **columns):
    """Scores only the first row; every other row fails (NaN) and is dropped under on_error=skip."""
    return [1.0] + [float("nan")] * (len(completions) - 1)


def test_rows_dropped_by_on_error_skip_count_in_no_statistic(model_dir, prompts_file, tmp_path, monkeypatch):
    config = tiny_ppo_config(
        model_dir("llama"), prompts_file, tmp_path / "run", total_episodes=4, per_device_train_batch_size=1,
        gradient_accumulation_steps=4, num_mini_batches=1, num_ppo_epochs=1, num_sample_generations=0,
        kl_target=1.0, kl_coef=0.5,
    )
    config.ref_model = str(model_dir("gpt2"))  # another model, so that the KL is not 0
    config.reward.on_error = "skip"
    trainer = PPOTrainer(config, reward_functions=[one_row_scores], show_progress=False)
    seen = []
    optimise = trainer.optimise
    monkeypatch.setattr(trainer, "optimise", lambda rollout: seen.append(rollout) or optimise(rollout))
    with pytest.warns(UserWarning, match="one_row_scores returned nan"):
        record = trainer.step()
    (rollout,) = seen
    assert rollout.trained_mask.any(1).tolist() == [True, False, False, False]
    real = rollout.trained_mask[0]
    kl = (rollout.logprobs[0] - rollout.ref_logprobs[0])[real].sum().item()
    assert abs(kl) > 1e-3
    # Means over the one kept episode, not over all four rows.
    assert record["objective/kl"] == pytest.approx(kl, rel=1e-4)
    assert record["objective/scores"] == pytest.approx(1.0)
    assert record["objective/non_score_reward"] == pytest.approx(-0.5 * kl, rel=1e-4)
    assert record["objective/rlhf_reward"] == pytest.approx(1.0 - 0.5 * kl, rel=1e-4)
    assert record["objective/entropy"] == pytest.approx(-rollout.logprobs[0][real].sum().item(), rel=1e-4)
    assert record["objective/response_length"] == int(real.sum())
    assert record["val/num_eos_tokens"] == int(rollout.ended[0])
    # One optimiser step, micro-batches of one row: only the kept row's micro-batch is measured, and
    # before any step its ratio is exactly 1 (three empty micro-batches would have pulled it to 0.25).
    assert record["val/ratio"] == pytest.approx(1.0, abs=1e-5)
    assert record["val/ratio_var"] == 0.0
    assert record["policy/approxkl_avg"] == pytest.approx(0.0, abs=1e-8)
    # The adaptive controller moved by the kept episode's KL.
    error = min(max(kl / 1.0 - 1.0, -0.2), 0.2)
    assert trainer.kl_controller.value == pytest.approx(0.5 * (1 + error * 4 / 10000), rel=1e-6)


def test_stop_token_outside_the_vocabulary_is_an_error_not_unk(model_dir, prompts_file, tmp_path):
    from ppokit.errors import UserError

    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run")
    config.ppo.stop_token = "zzzz"  # a word-level tokenizer maps it to <unk>
    with pytest.raises(UserError, match="ppo.stop_token 'zzzz' is not in the tokenizer's vocabulary"):
        PPOTrainer(config, show_progress=False)
    config.ppo.stop_token = "."  # one real token
    trainer = PPOTrainer(config, show_progress=False)
    assert trainer.stop_token_ids == (trainer.tokenizer.convert_tokens_to_ids("."),) != (trainer.tokenizer.unk_token_id,)


def test_eval_scores_only_with_eval_data_and_no_step_past_the_end(model_dir, prompts_file, tmp_path):
    from ppokit.errors import UserError

    trainer = _trainer(model_dir, prompts_file, tmp_path)  # no data.eval: samples come from the batch
    records = trainer.train()
    assert not any("eval/scores" in r for r in records)
    samples = [json.loads(row) for row in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples and {s["split"] for s in samples} == {"train"}
    with pytest.raises(UserError, match="all 2 updates of ppo.total_episodes=16 are done"):
        trainer.step()

    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "with-eval")
    config.data.eval = str(prompts_file)
    records = PPOTrainer(config, show_progress=False).train()
    assert "eval/scores" in records[-1]


def test_evaluate_scores_every_eval_prompt_repeatably_without_touching_training_randomness(model_dir, prompts_file, tmp_path):
    from ppokit.errors import UserError

    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run", local_rollout_forward_batch_size=16)
    with pytest.raises(UserError, match="evaluate: no eval prompts"):
        PPOTrainer(config, show_progress=False).evaluate()
    config.data.eval = str(prompts_file)  # 64 prompts: 4 sampling chunks of 16
    trainer = PPOTrainer(config, show_progress=False)
    state = torch.get_rng_state()
    first = trainer.evaluate()
    assert torch.equal(torch.get_rng_state(), state)  # training's random stream is untouched
    assert first["eval/num_scored"] == 64
    assert trainer.evaluate() == first  # same seed, same policy: same completions and scores
    assert trainer.evaluate(max_prompts=8)["eval/num_scored"] == 8
    assert 0 < first["eval/response_length"] <= 8 and 0 <= first["eval/ended"] <= 1
    # after training the policy is different, and so are its completions' scores
    trainer.train()
    assert trainer.evaluate() != first


def test_tokenizer_folder_without_config_json(model_dir, prompts_file, tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path / "tok")
    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run", total_episodes=8, num_sample_generations=0)
    config.tokenizer = str(tmp_path / "tok")
    trainer = PPOTrainer(config, show_progress=False)
    assert trainer.tokenizer.get_vocab() == tokenizer.get_vocab()
    assert math.isfinite(trainer.step()["objective/scores"])


def test_notices_go_to_stderr_and_stdout_stays_for_results(model_dir, prompts_file, tmp_path, capsys):
    out = tmp_path / "run"
    config = tiny_ppo_config(model_dir("llama"), prompts_file, out, total_episodes=8, num_sample_generations=0)
    PPOTrainer(config, show_progress=False).train()  # an earlier run that the next one replaces
    config.data.max_prompt_length = 3
    capsys.readouterr()
    PPOTrainer(config, show_progress=True, overwrite=True).train()
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "prompts longer than data.max_prompt_length=3 were truncated" in captured.err
    assert f"{out}: the earlier run there is replaced by this one, whose first checkpoint is written" in captured.err


def test_the_callers_config_is_not_changed(model_dir, prompts_file, tmp_path, tokenizer):
    from ppokit.models.loading import load_causal_lm

    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run", total_episodes=8)
    config.model = None
    config.data.chat_template = None
    before = config.to_dict()
    trainer = PPOTrainer(config, model=load_causal_lm(str(model_dir("llama"))), tokenizer=tokenizer,
                         reward_functions=[lambda prompts, completions: [0.0] * len(completions)], show_progress=False)
    assert config.to_dict() == before
    assert trainer.config.model == str(model_dir("llama"))  # what is recorded of the object: its saved path
    assert trainer.config.reward.functions != before["reward"]["functions"]


def test_prompts_that_a_model_cannot_read_are_refused_before_its_weights_load(model_dir, prompts_file, tokenizer, demo_data, tmp_path):
    """Token ids past the embeddings of any model that reads them, or prompt + response past the
    smallest position limit among them: one line naming the row (both were IndexErrors in the model)."""
    from ppokit.errors import UserError
    from ppokit.demos.tiny import word_tokenizer

    bigger = word_tokenizer([r["prompt"] + " " + r["completion"] for r in demo_data["sft"]] + [f"new{i}" for i in range(50)])
    rows = tmp_path / "new.jsonl"
    rows.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["the movie was"] * 7 + ["the new7 was"]))
    config = tiny_ppo_config(model_dir("llama"), rows, tmp_path / "run", total_episodes=8)
    with pytest.raises(UserError) as error:
        PPOTrainer(config, tokenizer=bigger, show_progress=False)
    assert str(error.value) == (
        f"data.train ({rows}:8): token id {bigger.convert_tokens_to_ids('new7')} ('new7') is outside the model's vocabulary "
        f"of {len(tokenizer)} (vocab_size in its config): the tokenizer of {len(bigger)} tokens is not this model's; set "
        "`tokenizer` to the model's own, or resize the model's embeddings")
    # The reference has fewer positions than the policy: its limit is the one that counts.
    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run", response_length=6)
    config.ref_model = str(model_dir("gpt2", max_positions=8))
    with pytest.raises(UserError, match=r"data.train \(.*:\d+\): the prompt is \d+ tokens; with ppo.response_length 6 that is "
                                        r"\d+, over the ref_model's position limit of 8 tokens \(n_positions in its config\); "
                                        r"set data.max_prompt_length to at most 2 \(it is null\) \(\d+ rows are over it\)"):
        PPOTrainer(config, show_progress=False)
    config.data.max_prompt_length = 2
    assert max(len(ids) for ids in PPOTrainer(config, show_progress=False).train_query_ids) == 2
    config.ppo.response_length = 8
    with pytest.raises(UserError) as error:
        PPOTrainer(config, show_progress=False)
    assert str(error.value) == ("ppo.response_length 8 leaves no room for a prompt in the ref_model's position limit of 8 tokens "
                                "(n_positions in its config); set ppo.response_length below 8")


def test_a_pad_token_outside_the_models_vocabulary_pads_with_one_it_has(model_dir, prompts_file, tmp_path):
    """A pad token added to the tokenizer without resizing the embeddings (TRL's examples add `[PAD]`) was
    refused ("token id 33 ('[PAD]') is outside the model's vocabulary of 33"). Every mask is positional, so
    the inputs are padded with an id the model has (EOS here): the run is the one padded with the model's
    own pad token (another id), sample for sample; prompt and stop tokens outside the vocabulary are still refused."""
    from transformers import AutoTokenizer

    from ppokit.errors import UserError

    base = model_dir("llama")
    tokenizer = AutoTokenizer.from_pretrained(base)
    rows, own_pad = len(tokenizer), tokenizer.pad_token_id
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    assert tokenizer.pad_token_id == rows and own_pad != tokenizer.eos_token_id
    tokenizer.save_pretrained(tmp_path / "added-pad")
    runs = {}
    for name in ("added-pad", "own-pad"):
        config = tiny_ppo_config(base, prompts_file, tmp_path / f"run-{name}", total_episodes=8, num_sample_generations=1)
        config.tokenizer = str(tmp_path / name) if name == "added-pad" else None
        config.data.eval = str(prompts_file)
        trainer = PPOTrainer(config, show_progress=False)
        assert trainer.pad_id == (tokenizer.eos_token_id if name == "added-pad" else own_pad)
        records = [{k: v for k, v in r.items() if not k.startswith(("time/", "eps"))} for r in trainer.train()]
        samples = [json.loads(line) for line in (tmp_path / f"run-{name}" / "samples.jsonl").read_text().splitlines()]
        runs[name] = records, samples
    (added, added_samples), (own, own_samples) = runs["added-pad"], runs["own-pad"]
    assert added_samples == own_samples  # the same tokens sampled, decoded and scored
    assert added[0].keys() == own[0].keys()
    for key, value in own[0].items():  # masked positions add exact zeros; tolerance only for kernels that might block differently
        assert added[0][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key

    prompts = tmp_path / "with-pad.jsonl"
    prompts.write_text(json.dumps({"prompt": "the movie [PAD] was"}) + "\n")
    refused = {"data.train": (["data.train=" + str(prompts)], f"token id {rows} ('[PAD]') is outside the model's vocabulary of {rows}"),
               "ppo.stop_token_id": ([f"ppo.stop_token_id={rows}"], f"ppo.stop_token_id: token id {rows} ('[PAD]') is outside")}
    for key, (overrides, message) in refused.items():
        config = tiny_ppo_config(base, prompts_file, tmp_path / "refused")
        config.tokenizer = str(tmp_path / "added-pad")
        for text in overrides:
            name, value = text.split("=", 1)
            section, _, field = name.rpartition(".")
            setattr(getattr(config, section) if section else config, field, int(value) if value.isdigit() else value)
        with pytest.raises(UserError, match=re.escape(message)):
            PPOTrainer(config, show_progress=False)


def test_the_trainers_jobs_never_reach_back_into_it():
    """Set-up, the rollout, evaluation and saving take what they need (`ppokit.training.parts.Parts`, its pieces): none imports
    the trainer, so none can call back into it; the trainer stays the run's life, within 300 lines."""
    import ast
    from pathlib import Path

    import ppokit

    package = Path(ppokit.__file__).parent
    for name in ("training/parts", "training/sampler", "training/rollout", "training/evaluation", "training/saving", "training/experience",
                 "training/guards"):
        tree = ast.parse((package / f"{name}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
                   {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {f"ppokit.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "ppokit" for a in n.names}
        assert "ppokit.trainer" not in imported, name
    assert len((package / "trainer.py").read_text().splitlines()) <= 300


def test_no_module_imports_the_package_face():
    """`ppokit/__init__.py` hands out the trainer (lazily): a module of the package that imports a name from it
    (not a submodule) closes a loop back up through the trainer. The version is `ppokit.version`'s."""
    import ast
    from pathlib import Path

    import ppokit

    package = Path(ppokit.__file__).parent
    submodules = {p.stem for p in package.glob("*.py")} | {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "ppokit":
                names = {a.name for a in node.names} - submodules
                assert not names, f"{path.relative_to(package)} imports {sorted(names)} from the package face"

