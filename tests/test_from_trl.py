"""`ppokit from-trl`: a TRL GRPO config becomes the ppokit config that trains GRPO (issue 47: the refusal's hints, followed
exactly, trained GAE with a critic, and the run never said which estimator it used)."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from ppokit.cli import main
from ppokit.config.schema import PPOConfig, PPOHyperparams
from ppokit.config.fields import key_paths
from ppokit.errors import UserError
from ppokit.config.from_trl import TRL_DEFAULTS, translate

TRL_GRPO = {  # as TRL's GRPO examples write one (flat: GRPOConfig, TrainingArguments, ModelConfig, ScriptArguments)
    "model_name_or_path": "Qwen/Qwen2.5-0.5B-Instruct", "dataset_name": "openai/gsm8k", "output_dir": "runs/grpo",
    "learning_rate": 1.0e-6, "num_generations": 4, "max_completion_length": 256, "beta": 0.04, "loss_type": "dr_grpo",
    "scale_rewards": False, "lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.1},
    "adam_beta2": 0.99, "per_device_train_batch_size": 8, "use_vllm": True, "vllm_mode": "server",
    "vllm_server_host": "10.0.0.9", "vllm_server_port": 8001, "vllm_server_timeout": 300,
    "chat_template_kwargs": {"enable_thinking": False}, "disable_dropout": True, "logging_steps": 5, "seed": 7,
}


def _convert(tmp_path, capsys, trl: dict, *extra: str) -> tuple[int, str, str]:
    source = tmp_path / "trl_grpo.yaml"
    source.write_text(yaml.safe_dump(trl, sort_keys=False))
    capsys.readouterr()
    code = main(["from-trl", str(source), *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_trl_grpo_config_becomes_a_ppokit_config_that_trains_grpo(tmp_path, capsys):
    out = tmp_path / "ppo.yaml"
    code, stdout, err = _convert(tmp_path, capsys, TRL_GRPO, "-o", str(out))
    assert (code, stdout) == (0, "")
    config = PPOConfig.load(out, ["reward.functions=[sentiment]"])
    ppo, rollout = config.ppo, config.rollout
    assert (ppo.advantage_estimator, config.value_model) == ("grpo", None)  # TRL's GRPOTrainer: no value model
    assert (ppo.num_samples_per_prompt, ppo.response_length, ppo.kl_in_reward, ppo.kl_loss_coef) == (4, 256, False, 0.04)
    assert (ppo.loss_aggregation, ppo.grpo_scale_std, ppo.learning_rate) == ("seq_mean_token_sum_norm", False, 1e-6)
    assert (ppo.lr_scheduler_type, ppo.min_lr_rate, ppo.adam_beta1, ppo.adam_beta2) == ("cosine_with_min_lr", 0.1, 0.9, 0.99)
    assert (rollout.engine, rollout.placement, rollout.servers, rollout.server_timeout_s) == ("vllm", "servers", ["10.0.0.9:8001"], 300)
    assert (config.model, config.data.train, config.data.chat_template_kwargs) == (
        "Qwen/Qwen2.5-0.5B-Instruct", "openai/gsm8k", {"enable_thinking": False})
    assert (config.output_dir, config.seed, ppo.logging_steps) == ("runs/grpo", 7, 5)
    # TRL's defaults where ppokit's differ and the file sets none: num_iterations 1, temperature 1.0, adam_epsilon 1e-8
    assert (ppo.num_ppo_epochs, ppo.temperature, ppo.adam_epsilon) == (1, 1.0, 1e-8)
    text = out.read_text()
    assert "advantage_estimator: grpo  # TRL's GRPOTrainer: group-relative advantages, no value model" in text
    assert "num_ppo_epochs: 1  # TRL's default num_iterations: 1" in text
    assert "  num_samples_per_prompt: 4  # num_generations: 4\n" in text and "  learning_rate: 1.0e-06\n" in text  # moved as named
    assert "\nseed: 7\n" in text
    # the translation, one TRL key a line on stderr
    lines = err.splitlines()
    assert lines[0] == f"from-trl: {tmp_path / 'trl_grpo.yaml'}, TRL's GRPO config, as ppokit's:"
    assert "  num_generations: 4  ->  ppo.num_samples_per_prompt: 4 (TRL's default is 8, ppokit's 1)" in lines
    assert "  (TRL's GRPOTrainer: group-relative advantages, no value model)  ->  ppo.advantage_estimator: grpo" in lines
    assert ("  vllm_server_host: 10.0.0.9, vllm_server_port: 8001  ->  rollout.engine: vllm, rollout.placement: servers, "
            "rollout.servers: [10.0.0.9:8001]") in lines
    assert f"from-trl: wrote {out}" in lines
    assert lines[-1].startswith(f"from-trl: before `ppokit ppo {out}`: reward: set at least one source")  # TRL's reward functions are code
    assert max(map(len, lines)) < 400


def test_without_o_the_config_goes_to_stdout(tmp_path, capsys):
    code, stdout, err = _convert(tmp_path, capsys, {"num_generations": 2})
    assert code == 0
    data = yaml.safe_load(stdout)
    assert data["ppo"]["advantage_estimator"] == "grpo" and data["ppo"]["num_samples_per_prompt"] == 2
    assert data["ppo"]["response_length"] == 512 and data["ppo"]["kl_in_reward"] is False  # TRL's defaults: 512, beta 0.0
    assert "from-trl:" not in stdout and "->" in err


def test_trls_defaults_are_the_installed_trls_and_differ_from_ppokits():
    trl = pytest.importorskip("trl")
    defaults = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
    assert {name: defaults[name] for name in TRL_DEFAULTS} == TRL_DEFAULTS
    translated = translate({}).settings
    ours = PPOHyperparams()
    for key, setting in translated.items():
        section, _, leaf = key.partition(".")
        if setting.origin.startswith("TRL's default"):
            assert getattr(ours, leaf) != setting.value, key  # written only where ppokit's default differs
    for name in ("temperature", "learning_rate", "adam_epsilon"):  # the defaults that go by ppokit's own name
        assert len(key_paths(PPOConfig)[name]) == 1


@pytest.mark.parametrize("trl, lines", [
    ({"num_generations": 4, "top_entropy_quantile": 0.2, "push_to_hub": True, "vllm_mode": "nonsense"}, [
        "  top_entropy_quantile: 0.2: TRL's GRPO name; ppokit has no equivalent",
        "  push_to_hub: true: ppokit has no such key",
        "  vllm_mode: nonsense: TRL's GRPO name; ppokit knows the values colocate, server of vllm_mode, not nonsense"]),
    ({"num_generations": 4, "ppo": {"num_samples_per_prompt": 8}}, [
        "  ppo.num_samples_per_prompt: 4 from `num_generations: 4`, 8 from `ppo.num_samples_per_prompt: 8`"]),
    ({"use_vllm": False, "vllm_importance_sampling_correction": False, "vllm_importance_sampling_mode": "sequence_truncate"}, [
        "  ppo.rollout_is: null from `vllm_importance_sampling_correction: false`, tis_sequence from "
        "`vllm_importance_sampling_mode: sequence_truncate`"]),
    ({"disable_dropout": False}, ["  disable_dropout: false: TRL's GRPO name; ppokit has no equivalent of false"]),
])
def test_what_cannot_be_translated_is_refused_a_key_a_line_and_nothing_is_written(tmp_path, capsys, trl, lines):
    out = tmp_path / "ppo.yaml"
    code, stdout, err = _convert(tmp_path, capsys, trl, "-o", str(out))
    assert (code, stdout, out.exists()) == (2, "", False)
    assert err.startswith("ppokit: error: ") and "Traceback" not in err
    for line in lines:
        assert any(got.startswith(line) for got in err.splitlines()), (line, err)


def test_an_implied_setting_gives_way_to_one_set_explicitly():
    """The importance-sampling cap implies rollout_is: tis; the mode sets tis_sequence: the mode decides, no conflict."""
    settings = translate({"vllm_importance_sampling_clip_max": 3.0, "vllm_importance_sampling_mode": "sequence_truncate",
                          "vllm_importance_sampling_correction": True}).settings
    assert (settings["ppo.rollout_is"].value, settings["ppo.rollout_is_cap"].value) == ("tis_sequence", 3.0)


def test_a_run_of_the_translated_config_trains_grpo_and_says_so_first(tmp_path, capsys, model_dir, prompts_file):
    """The run's first line names the estimator; a GRPO run builds no value model and writes no final/value_model."""
    from ppokit.trainer import PPOTrainer

    trl = {"model_name_or_path": str(model_dir()), "dataset_name": str(prompts_file), "output_dir": str(tmp_path / "run"),
           "num_generations": 4, "max_completion_length": 8, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1}
    out = tmp_path / "ppo.yaml"
    assert _convert(tmp_path, capsys, trl, "-o", str(out))[0] == 0
    config = PPOConfig.load(out, ["reward.functions=[sentiment]", "ppo.total_episodes=4"])
    trainer = PPOTrainer(config, show_progress=True)
    trainer.train()
    err = capsys.readouterr().err
    assert err.splitlines()[0] == ("ppokit: ppo.advantage_estimator: grpo (GRPO: rewards normalised within each prompt's group "
                                   "of samples, no value model)")
    assert "value model (the critic)" not in err
    assert (tmp_path / "run" / "final" / "config.json").exists() and not (tmp_path / "run" / "final" / "value_model").exists()


def test_a_gae_run_says_so_first_and_names_its_critic(tmp_path, capsys, model_dir, prompts_file):
    from conftest import tiny_ppo_config

    from ppokit.trainer import PPOTrainer

    capsys.readouterr()
    PPOTrainer(tiny_ppo_config(model_dir(), prompts_file, tmp_path / "run"), show_progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "ppokit: ppo.advantage_estimator: gae (PPO with a learned value model and GAE)"
    assert "ppokit: value model (the critic): policy backbone" in lines[:6], lines


def test_ppokit_ppo_refuses_a_trl_grpo_file_saying_grpo_and_from_trl(tmp_path, capsys):
    source = tmp_path / "trl_grpo.yaml"
    source.write_text(yaml.safe_dump(TRL_GRPO, sort_keys=False))
    assert main(["ppo", str(source)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ppokit: error: unknown config keys:\n  model_name_or_path (")
    assert "ppo.advantage_estimator: grpo" in err and "ppokit from-trl FILE -o ppo.yaml" in err
    assert len(err.splitlines()) > 10 and max(map(len, err.splitlines())) < 400


def test_translate_refuses_a_key_name_that_is_not_a_string():
    with pytest.raises(UserError, match="1: not a key name"):
        translate({1: 2})
