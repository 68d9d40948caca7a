"""On-policy distillation (`teacher`): the per-token reverse KL by hand, the teacher scored as the reference is, the
student's KL to the teacher falling on held-out prompts, a teacher of another vocabulary refused, the plan's teacher."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import tiny_ppo_config

from ppokit.demos.tiny import tiny_causal_lm, word_tokenizer
from ppokit.errors import UserError
from ppokit.training import algo, experience
from ppokit.training.episodes import Episodes
from ppokit.trainer import PPOTrainer


def test_the_reward_is_the_negative_reverse_kl_by_hand_on_two_tokens():
    # student log p = [-1.0, -2.0], teacher log q = [-0.5, -2.5]: reverse KL per token log p - log q = [-0.5, 0.5];
    # with coef 2 the rewards are -2 x [-0.5, 0.5] = [1.0, -1.0]; the padding column (mask False) gets 0
    logprobs = torch.tensor([[-1.0, -2.0, -7.0]], requires_grad=True)
    teacher = torch.tensor([[-0.5, -2.5, -1.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    rewards, reverse_kl = algo.distillation_rewards(logprobs, teacher, mask, 2.0)
    assert rewards.tolist() == [[1.0, -1.0, 0.0]] and reverse_kl.tolist() == [[-0.5, 0.5, 0.0]]
    # a reward: no gradient flows through it to the student's logprobs or the teacher's
    assert not rewards.requires_grad and not reverse_kl.requires_grad


def _two_token_episodes(**fields) -> Episodes:
    return Episodes(query_ids=torch.tensor([[5]]), response_ids=torch.tensor([[7, 8]]), attention_mask=torch.ones(1, 3, dtype=torch.bool),
                    loss_mask=torch.tensor([[True, True]]), logprobs=torch.tensor([[-1.0, -2.0]]), ended=torch.tensor([True]),
                    score_index=torch.tensor([1]), scores=torch.tensor([0.25]), ref_logprobs=torch.tensor([[-1.5, -1.0]]), **fields)


def test_stage_4_places_the_teachers_reward_on_each_token_beside_the_kl_penalty_and_the_score():
    # KL penalty k1 = log p - log ref = [0.5, -1.0] x kl_coef 0.1 -> [-0.05, 0.1]; teacher: -0.5 x ([-1, -2] - [-3, -1]) = [-1.0, 0.5];
    # the score 0.25 at the last token: rewards [-1.05, 0.85]
    episodes = _two_token_episodes(teacher_logprobs=torch.tensor([[-3.0, -1.0]]))
    rewards, kl, non_score = experience.rewards(episodes, kl_estimator="k1", kl_clamp=None, kl_coef=0.1, whiten=False, teacher_coef=0.5)
    assert rewards[0].tolist() == pytest.approx([-1.05, 0.85], abs=1e-6)
    assert non_score[0].tolist() == pytest.approx([-0.05, 0.1], abs=1e-7)  # the KL penalty's share alone, as without a teacher
    without = experience.rewards(_two_token_episodes(), kl_estimator="k1", kl_clamp=None, kl_coef=0.1, whiten=False)[0]
    assert without[0].tolist() == pytest.approx([-0.05, 0.35], abs=1e-7)


def _forward_kl_check(trainer, teacher_dir, rows):
    """(the trainer's stage-3 teacher logprobs, a separately loaded teacher's, the student's) on episodes sampled now."""
    from transformers import AutoModelForCausalLM

    hp = trainer.config.ppo
    episodes = trainer.rollout.sample([trainer.train_query_ids[i] for i in rows], *trainer.train_data.rows(rows))
    *_, teacher_logprobs = experience.reference_and_values(
        episodes, trainer.accelerator.unwrap_model(trainer.model), trainer.ref_model, teacher=trainer.teacher, rows=3,
        packed=False, temperature=hp.temperature, chunk_size=None)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    with torch.no_grad():
        want = experience.forward_logprobs(teacher, episodes.input_ids, episodes.attention_mask, episodes.response_ids,
                                           episodes.trained_mask, temperature=hp.temperature)
    return teacher_logprobs, want * episodes.trained_mask, episodes


def test_the_teacher_scores_the_sampled_tokens_as_its_own_model_does(model_dir, sft_model_dir, prompts_file, tmp_path):
    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run")
    config.teacher = str(sft_model_dir)
    trainer = PPOTrainer(config, show_progress=False)
    got, want, episodes = _forward_kl_check(trainer, sft_model_dir, list(range(8)))
    assert got is not None and not got.requires_grad
    # the same model, inputs and kernels, chunked otherwise (3 rows a chunk against 8): float32 rounding of a log-softmax
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    assert not torch.allclose(got, episodes.logprobs * episodes.trained_mask, atol=1e-2)  # not the student's (nor its reference copy)


def _held_out_kl(trainer, query_ids, data, seed=0) -> float:
    """The student's reverse KL to the teacher on held-out prompts: the mean over responses the student samples now (8 a
    prompt) of their summed log pi_student - log pi_teacher, the sequence-level estimate of KL(student || teacher) that
    the summed per-token rewards are the negative of."""
    hp = trainer.config.ppo
    rows = [i for i in range(len(query_ids)) for _ in range(8)]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        episodes = trainer.rollout.sample([query_ids[i] for i in rows], *data.rows(rows))
    *_, teacher_logprobs = experience.reference_and_values(
        episodes, trainer.accelerator.unwrap_model(trainer.model), trainer.ref_model, teacher=trainer.teacher, rows=32,
        packed=False, temperature=hp.temperature, chunk_size=None)
    return float(((episodes.logprobs - teacher_logprobs) * episodes.trained_mask).sum() / len(rows))


@pytest.mark.parametrize("estimator,n", [("grpo", 4), ("gae", 1)])
def test_the_students_kl_to_the_teacher_falls_on_held_out_prompts(estimator, n, model_dir, sft_model_dir, demo_data, tmp_path):
    """A fresh tiny student distilled from the SFT'd tiny teacher with the teacher's reward alone (no reward source):
    its reverse KL to the teacher on 16 prompts it never trained on falls, as the summed `teacher/kl` of its batches."""
    train, held_out = tmp_path / "train.jsonl", tmp_path / "held_out.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in demo_data["prompts"][:48]))
    held_out.write_text("".join(json.dumps(r) + "\n" for r in demo_data["prompts"][48:]))
    config = tiny_ppo_config(model_dir("llama"), train, tmp_path / "run", total_episodes=256, per_device_train_batch_size=8,
                             num_mini_batches=2, advantage_estimator=estimator, num_samples_per_prompt=n, kl_coef=0.0,
                             learning_rate=3e-3, response_length=8, num_sample_generations=0)
    config.reward.functions, config.teacher, config.data.eval = [], str(sft_model_dir), str(held_out)
    trainer = PPOTrainer(config, show_progress=False)
    before = _held_out_kl(trainer, trainer.eval_query_ids, trainer.eval_data)
    records = trainer.train()
    after = _held_out_kl(trainer, trainer.eval_query_ids, trainer.eval_data)
    assert all(r["objective/scores"] == 0 for r in records)  # no reward source: the teacher's reward alone
    # per response: teacher/kl is per token; times the mean response length it is the batch's summed reverse KL
    summed = [r["teacher/kl"] * r["objective/response_length"] for r in records]
    assert after < 0.7 * before, (before, after)
    assert sum(summed[-3:]) / 3 < 0.8 * sum(summed[:3]) / 3, summed


def _other_vocabulary_teacher(tmp_path):
    tokenizer = word_tokenizer(["completely different words make another vocabulary here"])
    torch.manual_seed(0)
    path = tmp_path / "other-teacher"
    tiny_causal_lm("llama", tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_a_teacher_with_another_vocabulary_is_one_line_at_start_up_and_leaves_no_run_folder(model_dir, prompts_file, tmp_path):
    other = _other_vocabulary_teacher(tmp_path)
    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run")
    config.teacher = str(other)
    with pytest.raises(UserError, match=f"teacher: {other} has another vocabulary than the policy's tokenizer"):
        PPOTrainer(config, show_progress=False)
    out = tmp_path / "cli-run"
    path = tmp_path / "ppo.yaml"
    path.write_text(json.dumps({"model": str(model_dir("llama")), "teacher": str(other), "data": {"train": str(prompts_file)},
                                "output_dir": str(out)}))  # the teacher alone: no reward source
    result = subprocess.run([sys.executable, "-m", "ppokit", "ppo", str(path)], capture_output=True, text=True)
    assert result.returncode == 2 and not out.exists()
    errors = [line for line in result.stderr.splitlines() if not line.startswith("plan: ")]  # the preflight's estimate line, then the refusal
    assert len(errors) == 1 and errors[0].startswith("ppokit: error: teacher: ") and "another vocabulary" in errors[0], result.stderr


def test_teacher_coef_without_a_teacher_and_no_source_without_a_teacher_are_refused(model_dir):
    from ppokit.config.schema import PPOConfig

    with pytest.raises(UserError, match=r"teacher_coef \(0.5\) weighs the reverse KL to a teacher, and `teacher` is not set"):
        PPOConfig.load(None, [f"model={model_dir('llama')}", "reward.functions=[sentiment]", "teacher_coef=0.5"]).validate()
    with pytest.raises(UserError, match="reward: set at least one source"):
        PPOConfig.load(None, [f"model={model_dir('llama')}"]).validate()
    assert PPOConfig.load(None, [f"model={model_dir('llama')}", "teacher=t"]).validate().teacher == "t"


def test_the_plan_counts_the_teachers_weights_and_its_forward(model_dir, sft_model_dir, prompts_file, tmp_path):
    from ppokit.plan import plan_for

    config = tiny_ppo_config(model_dir("llama"), prompts_file, tmp_path / "run")
    without = plan_for(config, memory_gib=80)
    config.teacher = str(sft_model_dir)
    plan = plan_for(config, memory_gib=80)
    teacher = next(r for r in plan.roles if r.role == "teacher")
    from transformers import AutoModelForCausalLM

    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(sft_model_dir).parameters())
    assert teacher.params == params and teacher.trainable == 0 and teacher.weights == 4 * params  # float32, frozen
    assert plan.total >= without.total + teacher.weights
    assert "teacher" in plan.render()


def test_a_distillation_run_resumed_after_a_crash_is_the_straight_run(model_dir, sft_model_dir, prompts_file, tmp_path):
    """The teacher is frozen and read again at resume: teacher/kl and every other metric of a run crashed in its second
    update and resumed from its first checkpoint equal the straight run's."""
    from test_checkpoint import comparable, resume_and_finish, train_until_crash_at_optimizer_step

    def config(out, **extra):
        c = tiny_ppo_config(model_dir("llama"), prompts_file, out, total_episodes=24, num_sample_generations=0, learning_rate=1e-2, **extra)
        c.teacher, c.teacher_coef = str(sft_model_dir), 0.5
        return c

    PPOTrainer(config(tmp_path / "straight"), show_progress=False).train()
    out = tmp_path / "run"
    train_until_crash_at_optimizer_step(PPOTrainer(config(out, save_steps=1), show_progress=False), 6)  # in update 2
    resume_and_finish(config(out, save_steps=1))
    got, want = comparable(out / "metrics.jsonl"), comparable(tmp_path / "straight" / "metrics.jsonl")
    assert [r["update"] for r in got] == [1, 2, 3] and all("teacher/kl" in r for r in got)
    assert got == want
