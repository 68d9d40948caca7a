import re
import threading

import pytest
import yaml

from ppokit.training.batch_sizes import derive
from ppokit.config.schema import PER_MICRO_BATCH, PER_MINIBATCH, PPOConfig, PPOHyperparams
from ppokit.errors import UserError

BASE = ["model=some/model", "reward.functions=[sentiment]", "data.train=p.jsonl"]


def test_defaults_follow_trl():
    hp = PPOHyperparams()
    assert (hp.learning_rate, hp.num_mini_batches, hp.num_ppo_epochs, hp.response_length) == (3e-6, 1, 4, 53)
    assert (hp.temperature, hp.kl_coef, hp.kl_estimator, hp.cliprange, hp.vf_coef) == (0.7, 0.05, "k1", 0.2, 0.1)
    assert (hp.cliprange_value, hp.gamma, hp.lam, hp.whiten_rewards) == (0.2, 1.0, 0.95, False)
    assert (hp.missing_eos_penalty, hp.num_sample_generations, hp.local_rollout_forward_batch_size) == (None, 10, 64)


def test_the_loss_normalisation_is_decided_once_from_the_token_budget():
    assert PPOHyperparams().loss_normalisation == PER_MICRO_BATCH  # TRL's
    assert PPOHyperparams(max_tokens_per_micro_batch=512).loss_normalisation == PER_MINIBATCH


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": "m", "reward": {"functions": ["sentiment"]}, "ppo": {"kl_coef": 0.1}}))
    config = PPOConfig.load(path, ["ppo.kl_coef=0.2", "ppo.learning_rate=1e-5", "ppo.whiten_rewards=true", "data.train=x.jsonl", "ppo.stop_token=null"])
    assert config.ppo.kl_coef == 0.2
    assert config.ppo.learning_rate == 1e-5  # YAML reads 1e-5 as a string; it is coerced
    assert config.ppo.whiten_rewards is True
    assert config.ppo.stop_token is None
    assert config.reward.functions == ["sentiment"]
    # the saved config round-trips with every default filled in
    config.save(tmp_path / "resolved.yaml")
    saved = yaml.safe_load((tmp_path / "resolved.yaml").read_text())
    assert saved["ppo"]["num_ppo_epochs"] == 4 and saved["ppo"]["kl_coef"] == 0.2
    assert PPOConfig.load(tmp_path / "resolved.yaml").to_dict() == config.to_dict()


@pytest.mark.parametrize(
    "override, message",
    [
        ("ppo.kl_coeff=0.1", "unknown config key ppo.kl_coeff (did you mean ppo.kl_coef?)"),
        ("learning_rate=1e-5", "unknown config key learning_rate"),
        ("ppo.cliprange=-1", "ppo.cliprange: value -1.0 is out of range, it must be in (0, 3.4e38]"),
        ("ppo.kl_estimator=k4", "ppo.kl_estimator: value 'k4' is out of range, it must be one of k1, k2, k3"),
        ("reward.on_error=ignore", "reward.on_error: value 'ignore' is out of range, it must be one of raise, skip"),
        ("ppo.lr_scheduler_type=polynomial", "ppo.lr_scheduler_type: value 'polynomial' is out of range, it must be one of linear, constant, cosine, "
                                             "cosine_with_min_lr"),
        ("ppo.num_ppo_epochs=two", "ppo.num_ppo_epochs: expected an integer"),
        ("ppo.gamma=1.5", "ppo.gamma: value 1.5 is out of range, it must be in [0, 1]"),
        ("data.eval_fraction=1", "data.eval_fraction: value 1.0 is out of range, it must be in [0, 1)"),
        ("ppo.whiten_rewards=maybe", "ppo.whiten_rewards: expected true or false"),
        ("ppo=3", "ppo: expected a mapping"),
        # a value of none of a union's kinds: refused at load, not by the code that first uses it
        ("reward.functions=7", "reward.functions: expected a string or a mapping, got 7"),
        ("reward.functions=[sentiment, 1.5]", "reward.functions[1]: expected a string or a mapping, got 1.5"),
        ("reward.normalize=maybe", "reward.normalize: expected true/false or a list, got 'maybe'"),
        # run_name is a folder under <output_dir>/tensorboard: "../../x" wrote the events two levels up
        ("run_name=../../x", "run_name: value '../../x' is out of range, it must be a name without / or \\, not . or .."),
        ("run_name=a/b", "run_name: value 'a/b' is out of range"),
        ("run_name=..", "run_name: value '..' is out of range"),
        ("nonsense", "expected key.sub=value"),
        # empty keys and an empty output_dir
        (".ppo=1", "override '.ppo=1': '.ppo' has an empty part; write section.key=value"),
        ("ppo..kl_coef=1", "'ppo..kl_coef' has an empty part"),
        ("ppo.=1", "'ppo.' has an empty part"),
        ("output_dir=", "output_dir: may not be empty"),
        ("output_dir=' '", "output_dir: may not be empty"),
    ],
)
def test_bad_keys_and_values_name_the_key(override, message):
    with pytest.raises(UserError, match=re.escape(message)):
        PPOConfig.load(None, BASE + [override])


def test_a_flat_trl_config_names_every_unknown_key_and_where_it_goes(tmp_path):
    """TRL's configs are flat (one namespace of TrainingArguments, ModelConfig and ScriptArguments): such a
    file once failed one key at a time, with no hint. Now one message names every key and where it belongs, one key a
    line (18 keys once made one line of 2,000 characters)."""
    path = tmp_path / "trl.yaml"
    path.write_text(yaml.safe_dump({
        "model_name_or_path": "EleutherAI/pythia-1b-deduped", "sft_model_path": "sft", "reward_model_path": "rm",
        "dataset_name": "trl-internal-testing/descriptiveness-sentiment-trl-style", "output_dir": "runs/x",
        "learning_rate": 3e-6, "total_episodes": 10000, "gradient_checkpointing": True, "push_to_hub": True,
        "ppo": {"kl_coeff": 0.1, "model": "m"},
    }, sort_keys=False))
    with pytest.raises(UserError) as error:
        PPOConfig.load(path)
    message = str(error.value)
    assert message.startswith(
        "unknown config keys:\n"
        "  model_name_or_path (TRL's name; ppokit's is model, the policy, whose tokenizer is used unless tokenizer is set)\n"
        "  sft_model_path (TRL's name; ppokit's is model, the policy to start from and the reference)\n"
        "  reward_model_path (TRL's name; ppokit's is reward.model, where the value model also starts unless value_model is set)\n"
        "  dataset_name (TRL's name; ppokit's is data.train: a file, folder or hub dataset name, NAME:SPLIT picks a split)\n"
        "  learning_rate (did you mean ppo.learning_rate?)\n  total_episodes (did you mean ppo.total_episodes?)\n  push_to_hub\n"
        "  ppo.kl_coeff (did you mean ppo.kl_coef?)\n  ppo.model (did you mean model or reward.model?)\n"
        "known keys at the top level: model, ref_model, "
    )
    assert message.count("\n") == 10  # a line each, and the top level's keys (for push_to_hub, which has no hint)
    assert "known keys in ppo" not in message  # each unknown key in ppo has its hint
    assert "GRPO" not in message  # a TRL PPO config: nothing about GRPO


@pytest.mark.parametrize("overrides, message", [
    (["batch_size=8"], "unknown config key batch_size (TRL derives it, and so does ppokit: set ppo.per_device_train_batch_size, "),
    (["ppo.batch_size=8"], "unknown config key ppo.batch_size (TRL derives it"),
    (["ppo.eval=x"], "unknown config key ppo.eval (did you mean data.eval?)"),  # a key in another section
    (["lora_r=8"], "unknown config key lora_r (TRL's name; ppokit's is lora.r)"),
    (["ppo.kl_coeff=1", "ppo.bogus=1"], "unknown config keys:\n  ppo.kl_coeff (did you mean ppo.kl_coef?)\n  ppo.bogus\nknown keys here: total_episodes, "),
])
def test_an_unknown_key_is_told_where_it_goes(overrides, message):
    with pytest.raises(UserError, match=re.escape(message)):
        PPOConfig.load(None, BASE + overrides)


def test_the_stage_configs_point_trl_names_too():
    from ppokit.config.stages import SFTConfig

    with pytest.raises(UserError, match=re.escape("unknown config keys:\n  model_name_or_path (TRL's name; ppokit's is model)\n"
                                                  "  learning_rate (did you mean train.learning_rate?)")):
        SFTConfig.load(None, ["model_name_or_path=m", "learning_rate=1e-5", "data.train=x.jsonl"])


def test_every_trl_name_is_in_the_side_by_side_table_of_docs_trl():
    from pathlib import Path

    from ppokit.config.schema import TRL_PPO_NAMES

    table = Path(__file__).resolve().parents[1].joinpath("docs", "trl.md").read_text()
    assert [name for name in TRL_PPO_NAMES if f"| `{name}` |" not in table] == []


def test_required_keys():
    with pytest.raises(UserError, match="model: required"):
        PPOConfig.load(None, ["reward.functions=[sentiment]"])
    with pytest.raises(UserError, match="at least one source"):
        PPOConfig.load(None, ["model=m"])
    with pytest.raises(UserError, match="reward.weights has 2 entries for 1"):
        PPOConfig.load(None, BASE + ["reward.weights=[1, 2]"])


def test_values_that_could_never_apply_are_refused():
    with pytest.raises(UserError, match="ppo.missing_eos_penalty needs a stop token"):
        PPOConfig.load(None, BASE + ["ppo.missing_eos_penalty=1.0", "ppo.stop_token=null"])
    PPOConfig.load(None, BASE + ["ppo.missing_eos_penalty=1.0", "ppo.stop_token=null", "ppo.stop_token_id=3"])
    with pytest.raises(UserError, match="data.eval_fraction .* data.eval is set too"):
        PPOConfig.load(None, BASE + ["data.eval=e.jsonl", "data.eval_fraction=0.1"])


def test_batch_arithmetic_and_inexact_division():
    hp = PPOHyperparams(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_mini_batches=2, total_episodes=64)
    sizes = derive(hp, world_size=2, num_prompts=100)
    assert sizes.local_batch == 16 and sizes.batch == 32 and sizes.local_mini_batch == 8
    assert sizes.num_updates == 2 and sizes.micro_batch == 4
    with pytest.raises(UserError, match=r"total_episodes \(60\) is not a multiple of the batch size \(32"):
        derive(PPOHyperparams(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_mini_batches=2, total_episodes=60), 2, 100)
    # default: one pass over the prompts, whole batches only
    assert derive(PPOHyperparams(per_device_train_batch_size=8), 1, 100).total_episodes == 96
    with pytest.raises(UserError, match="less than one batch"):
        derive(PPOHyperparams(per_device_train_batch_size=8), 1, 5)


def test_a_warmup_as_long_as_the_run_is_refused():
    """Counted in optimiser steps (2 updates x 4 epochs x 2 minibatches = 16): 16 would never reach the peak rate."""
    hp = dict(per_device_train_batch_size=4, num_mini_batches=2, num_ppo_epochs=4, total_episodes=16)
    assert derive(PPOHyperparams(**hp, warmup_steps=15), 1, 100).num_updates == 2
    with pytest.raises(UserError) as error:
        derive(PPOHyperparams(**hp, warmup_steps=16), 1, 100)
    assert str(error.value) == (
        "ppo.warmup_steps (16) is not shorter than the run's 16 optimiser steps (2 updates x num_ppo_epochs 4 x "
        "num_mini_batches 2): the learning rate would never reach ppo.learning_rate; set ppo.warmup_steps below 16")


def test_missing_config_file_and_bad_yaml(tmp_path):
    with pytest.raises(UserError, match="config file not found"):
        PPOConfig.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(UserError, match="not valid YAML"):
        PPOConfig.load(bad)


# --------------------------------------------------------------------------- config files a user can get wrong


def test_config_files_in_other_encodings_or_binary(tmp_path):
    good = "model: m\nreward: {functions: [sentiment]}\ndata: {train: p.jsonl}\nppo: {kl_coef: 0.1}\n"
    for encoding in ("utf-16", "utf-8-sig"):  # what Windows editors and PowerShell's `>` write: with a byte-order mark
        path = tmp_path / f"{encoding}.yaml"
        path.write_bytes(good.encode(encoding))
        assert PPOConfig.load(path).ppo.kl_coef == 0.1
    binary = tmp_path / "model.yaml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00")
    with pytest.raises(UserError, match=r"model\.yaml:3: holds NUL bytes: a binary file .*save it as UTF-8"):
        PPOConfig.load(binary)
    headless = tmp_path / "utf16-no-bom.yaml"
    headless.write_bytes(good.encode("utf-16-le"))
    with pytest.raises(UserError, match=r"utf16-no-bom\.yaml:1: holds NUL bytes"):
        PPOConfig.load(headless)
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("model: m\n# café\n".encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1\.yaml:2: not UTF-8 text \(byte 0xe9\)"):
        PPOConfig.load(latin1)
    with pytest.raises(UserError, match="is a directory, not a YAML config file"):
        PPOConfig.load(tmp_path)


@pytest.mark.parametrize(
    "text, message",
    [  # a key or a section written twice: the key and both lines (PyYAML would keep the second silently)
        ("model: m\nppo:\n  kl_coef: 0.1\nreward:\n  functions: [sentiment]\nppo:\n  learning_rate: 1.0e-5\n",
         "c.yaml:6: section ppo is written twice (lines 2 and 6)"),
        ("model: m\nppo:\n  kl_coef: 0.1\n  cliprange: 0.3\n  kl_coef: 0.2\n", "c.yaml:5: key ppo.kl_coef is written twice (lines 3 and 5)"),
        ("reward:\n  functions:\n    - {function: contains, required: [a], required: [b]}\n",
         "key reward.functions[0].required is written twice"),
        ("model: &m [*m]\n", "model: expected a string"),  # a recursive anchor is not followed for ever
        ("'': 1\n", "unknown config key ''; known keys here: model"),  # odd keys are named visibly
        ("ppo:\n  1: 2\n", "unknown config key ppo.1; known keys"),
    ],
)
def test_yaml_mistakes_name_the_key_and_the_lines(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=re.escape(message)):
        PPOConfig.load(path)


@pytest.mark.parametrize("seed, ok", [(0, True), (2**32 - 1, True), (-1, False), (2**32, False)])
def test_seed_range_is_checked_at_config_time(seed, ok):
    from ppokit.config.stages import RMConfig, SFTConfig

    for cls, args in ((PPOConfig, BASE), (SFTConfig, ["model=m", "data.train=t.jsonl"]), (RMConfig, ["model=m", "data.train=t.jsonl"])):
        if ok:
            assert cls.load(None, [*args, f"seed={seed}"]).seed == seed
        else:
            with pytest.raises(UserError, match=re.escape(f"seed: value {seed} is out of range, it must be in 0..2**32-1")):
                cls.load(None, [*args, f"seed={seed}"])


# --------------------------------------------------------------------------- the PPO toolbox (issue 9)


def test_toolbox_defaults_reproduce_todays_ppo():
    hp = PPOHyperparams()
    assert (hp.advantage_estimator, hp.num_samples_per_prompt, hp.kl_in_reward, hp.kl_loss_coef) == ("gae", 1, True, 0.0)
    assert (hp.top_k, hp.top_p, hp.min_p, hp.eval_temperature) == (0, 1.0, 0.0, None)
    assert (hp.cliprange_low, hp.cliprange_high, hp.dual_clip_c, hp.entropy_coef) == (None, None, None, 0.0)
    assert (hp.loss_aggregation, hp.vf_learning_rate, hp.critic_warmup_updates) == ("token_mean", None, 0)


def test_toolbox_choices_are_algos():
    from ppokit.config import schema as config
    from ppokit.training import algo

    assert config.LOSS_AGGREGATIONS == algo.LOSS_AGGREGATIONS and config.KL_ESTIMATORS == algo.KL_ESTIMATORS


GRPO = ["ppo.advantage_estimator=grpo", "ppo.num_samples_per_prompt=4"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        # ranges
        (["ppo.advantage_estimator=ppo2"], "ppo.advantage_estimator: value 'ppo2' is out of range, it must be one of gae, grpo, rloo, reinforce_pp, remax"),
        (["ppo.loss_aggregation=sum"], "ppo.loss_aggregation: value 'sum' is out of range, it must be one of token_mean"),
        (["ppo.kl_loss_estimator=k4", "ppo.kl_loss_coef=0.1"], "ppo.kl_loss_estimator: value 'k4' is out of range"),
        (["ppo.dual_clip_c=1"], "ppo.dual_clip_c: value 1.0 is out of range, it must be > 1"),
        (["ppo.dual_clip_c=0.5"], "ppo.dual_clip_c: value 0.5 is out of range, it must be > 1"),
        (["ppo.cliprange_low=1"], "ppo.cliprange_low: value 1.0 is out of range, it must be in (0, 1)"),
        (["ppo.top_p=0"], "ppo.top_p: value 0.0 is out of range, it must be in (0, 1]"),
        (["ppo.min_p=1"], "ppo.min_p: value 1.0 is out of range, it must be in [0, 1)"),
        (["ppo.top_k=-1"], "ppo.top_k: value -1 is out of range, it must be >= 0"),
        (["ppo.num_samples_per_prompt=0"], "ppo.num_samples_per_prompt: value 0 is out of range, it must be > 0"),
        (["ppo.eval_temperature=-0.5"], "ppo.eval_temperature: value -0.5 is out of range, it must be 0 (greedy) or >= 1e-30"),
        # logits / temperature overflowed float32 (sampling then failed on NaN probabilities), 1 + 1e300 the ratio's clamp
        (["ppo.temperature=1e-46"], "ppo.temperature: value 1e-46 is out of range, it must be >= 1e-30: logits / temperature is computed in float32, whose "
                                    "largest value is 3.4e38, and this keeps it finite for logits up to 3.4e8"),
        (["ppo.temperature=1e-40"], "ppo.temperature: value 1e-40 is out of range, it must be >= 1e-30: "),
        (["ppo.temperature=0"], "ppo.temperature: value 0.0 is out of range, it must be >= 1e-30: "),
        (["ppo.eval_temperature=1e-40"], "ppo.eval_temperature: value 1e-40 is out of range, it must be 0 (greedy) or >= 1e-30: logits / temperature"),
        (["ppo.cliprange_high=1e300"], "ppo.cliprange_high: value 1e+300 is out of range, it must be in (0, 3.4e38]: 1 + it bounds the float32 ratio exp(logp "
                                       "- old logp), whose largest value is 3.4e38"),
        (["ppo.cliprange_low=0.2", "ppo.cliprange=1e39"], "ppo.cliprange: value 1e+39 is out of range, it must be in (0, 3.4e38]"),
        (["ppo.vf_learning_rate=0"], "ppo.vf_learning_rate: value 0.0 is out of range, it must be > 0"),
        (["ppo.critic_warmup_updates=-1"], "ppo.critic_warmup_updates: value -1 is out of range, it must be >= 0"),
        (["ppo.kl_loss_coef=-0.1"], "ppo.kl_loss_coef: value -0.1 is out of range, it must be >= 0"),
        (["ppo.entropy_coef=-0.1"], "ppo.entropy_coef: value -0.1 is out of range, it must be >= 0"),
        (["ppo.kl_clamp=0"], "ppo.kl_clamp: value 0.0 is out of range, it must be > 0"),
        (["ppo.kl_clamp=-10"], "ppo.kl_clamp: value -10.0 is out of range, it must be > 0"),
        # n samples per prompt
        (["ppo.advantage_estimator=grpo"], "ppo.num_samples_per_prompt: grpo needs at least 2 samples per prompt"),
        (["ppo.advantage_estimator=rloo", "ppo.num_samples_per_prompt=1"], "ppo.num_samples_per_prompt: rloo needs at least 2 samples per prompt"),
        (["ppo.num_samples_per_prompt=3"], "ppo.num_samples_per_prompt (3) must divide the rollout batch per device (8 = per_device_train_batch_size 8"),
        # clip ranges
        (["ppo.cliprange_low=0.3", "ppo.cliprange_high=0.2"], "ppo.cliprange_low (0.3) is larger than ppo.cliprange_high (0.2)"),
        (["ppo.cliprange_low=0.3"], "ppo.cliprange_low (0.3) is larger than ppo.cliprange_high (0.2)"),  # high defaults to cliprange
        # critic settings with a critic-free estimator
        (GRPO + ["ppo.vf_learning_rate=1e-5"], "ppo.vf_learning_rate (1e-05) is for the value model, which ppo.advantage_estimator grpo does not build"),
        (GRPO + ["ppo.critic_warmup_updates=2"], "ppo.critic_warmup_updates (2) is for the value model"),
        (["ppo.advantage_estimator=reinforce_pp", "ppo.vf_coef=0.5"], "ppo.vf_coef (0.5) is for the value model, which ppo.advantage_estimator reinforce_pp"),
        (["ppo.advantage_estimator=remax", "ppo.lam=0.9"], "ppo.lam (0.9) is for the value model"),
        (GRPO + ["value_model=some/critic"], "value_model: ppo.advantage_estimator grpo builds no value model"),
        (GRPO + ["lora={value_model_lora: false}"], "lora.value_model_lora: ppo.advantage_estimator grpo builds no value model"),
        # keys the configuration would never read
        (GRPO + ["ppo.gamma=0.9"], "ppo.gamma (0.9) is for discounting, which ppo.advantage_estimator grpo does not do"),
        (GRPO + ["ppo.whiten_advantages=false"], "ppo.whiten_advantages: false has no effect with ppo.advantage_estimator grpo"),
        (["ppo.grpo_scale_std=false"], "ppo.grpo_scale_std (False) is for ppo.advantage_estimator grpo (this run's is gae)"),
        (["ppo.kl_in_reward=false", "ppo.kl_coef=0.1"], "ppo.kl_coef (0.1) is for the KL penalty in the reward, and ppo.kl_in_reward is false"),
        (["ppo.kl_in_reward=false", "ppo.kl_target=6"], "ppo.kl_target (6.0) is for the KL penalty in the reward"),
        (["ppo.kl_loss_estimator=k2"], "ppo.kl_loss_estimator ('k2') is for the KL term in the loss, and ppo.kl_loss_coef is 0"),
        (["ppo.kl_in_reward=false", "ppo.kl_clamp=10"], "ppo.kl_clamp (10.0) is for a KL in the reward or the loss, and this run has neither"),
        (["ppo.cliprange_low=0.1", "ppo.cliprange_high=0.3", "ppo.cliprange=0.25"], "ppo.cliprange (0.25) is for a clip range that ppo.cliprange_low or "
                                                                                    "ppo.cliprange_high leaves unset, and both are set; remove it"),
        # a lower clip bound 1 - eps <= 0 never clips: refused from either key
        (["ppo.cliprange=1.0"], "ppo.cliprange (1.0) is also the lower clip range (ppo.cliprange_low is unset): the ratio's lower bound 1 - 1.0 = 0 is not "
                                "above 0, so it would never clip; it must be below 1"),
        (["ppo.cliprange=1.5"], "ppo.cliprange (1.5) is also the lower clip range (ppo.cliprange_low is unset): the ratio's lower bound 1 - 1.5 = -0.5"),
        (["ppo.cliprange_low=1.5", "ppo.cliprange=2"], "ppo.cliprange_low: value 1.5 is out of range, it must be in (0, 1)"),
        # fsdp's own keys under ddp: never read there
        (["parallel.cpu_offload=true"], "parallel.cpu_offload (True) is for parallel.strategy: fsdp, and this run's is ddp, which never reads it; remove it, "
                                        "or set parallel.strategy: fsdp"),
        (["parallel.shard_frozen=false"], "parallel.shard_frozen (False) is for parallel.strategy: fsdp, and this run's is ddp"),
        (["parallel.unshard_for_generation=false"], "parallel.unshard_for_generation (False) is for parallel.strategy: fsdp"),
        (["parallel.wrap_classes=[Block]"], "parallel.wrap_classes (['Block']) is for parallel.strategy: fsdp"),
        # timeouts past threading.TIMEOUT_MAX raised OverflowError at every call
        (["reward.timeout_s=1e12"], f"reward.timeout_s: value 1000000000000.0 is out of range, it must be in (0, {threading.TIMEOUT_MAX:.0f}] seconds "
                                    "(threading.TIMEOUT_MAX: the longest wait Python takes)"),
        (["reward.timeout_s=0"], "reward.timeout_s: value 0.0 is out of range, it must be in (0, "),
        (["reward.remote={url: "
          "'http://localhost:1'}", "reward.remote.timeout_s=1e300"], "reward.remote.timeout_s: value 1e+300 is out of range, it must be in (0, "),
        # reward whitening keeps the mean: a per-token shift that only gae's critic absorbs (test_algo shows it)
        (["ppo.advantage_estimator=remax", "ppo.whiten_rewards=true"], "ppo.whiten_rewards: true is for gae: it keeps the mean, which adds the same amount to "
                                                                       "every token, so a whitened return grows with the response's length; a critic learns "
                                                                       "that, but ppo.advantage_estimator remax has none and its greedy baseline is not "
                                                                       "whitened; remove it"),
        (GRPO + ["ppo.whiten_rewards=true"], "but ppo.advantage_estimator grpo has none; remove it"),
        (["ppo.advantage_estimator=rloo", "ppo.num_samples_per_prompt=2", "ppo.whiten_rewards=true"], "ppo.advantage_estimator rloo has none;"),
        (["ppo.advantage_estimator=reinforce_pp", "ppo.whiten_rewards=true"], "ppo.advantage_estimator reinforce_pp has none;"),
    ],
)
def test_toolbox_bad_inputs_name_the_key_and_the_rule(overrides, message):
    with pytest.raises(UserError, match=re.escape(message)):
        PPOConfig.load(None, BASE + overrides)


def test_toolbox_good_combinations_load():
    for overrides in (
        GRPO + ["ppo.grpo_scale_std=false", "ppo.kl_in_reward=false", "ppo.kl_loss_coef=0.001", "ppo.loss_aggregation=seq_mean_token_sum_norm"],
        ["ppo.advantage_estimator=rloo", "ppo.num_samples_per_prompt=2", "ppo.cliprange_high=0.28", "ppo.dual_clip_c=3"],
        ["ppo.advantage_estimator=reinforce_pp", "ppo.gamma=0.99", "ppo.whiten_advantages=false"],
        ["ppo.advantage_estimator=remax", "ppo.eval_temperature=0", "ppo.top_p=0.9", "ppo.top_k=20", "ppo.min_p=0.05"],
        ["ppo.vf_learning_rate=1e-5", "ppo.critic_warmup_updates=1", "ppo.entropy_coef=0.01", "ppo.kl_loss_coef=0.1", "ppo.kl_loss_estimator=k2"],
        ["ppo.cliprange_low=0.1"],  # below the default high: fine
        ["ppo.kl_clamp=10"], GRPO + ["ppo.kl_in_reward=false", "ppo.kl_loss_coef=0.001", "ppo.kl_clamp=10"],
        ["ppo.cliprange_low=0.2", "ppo.cliprange=1.5"],  # cliprange is only the upper range here: 1 + 1.5
        ["ppo.temperature=1e-30", "ppo.eval_temperature=1e-30", "ppo.cliprange_high=3.4e38"],  # the bounds themselves
        ["ppo.cliprange=0.999", "ppo.cliprange_value=1e300", f"reward.timeout_s={threading.TIMEOUT_MAX}"],
        ["reward.timeout_s=null"],  # no deadline at all: the main thread, no wait
        ["parallel.strategy=fsdp", "parallel.cpu_offload=true", "parallel.shard_frozen=false", "parallel.unshard_for_generation=false"],
        ["parallel.cpu_offload=false"],  # ddp with fsdp's default: what ddp does anyway
    ):
        PPOConfig.load(None, BASE + overrides)


def test_batch_arithmetic_with_several_samples_per_prompt():
    hp = PPOHyperparams(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_mini_batches=2, num_samples_per_prompt=4)
    sizes = derive(hp, world_size=2, num_prompts=100)
    # 32 episodes per update = 8 prompts x 4 samples, 4 prompts per process; one pass = 100 x 4 episodes -> 12 whole batches
    assert (sizes.batch, sizes.prompts_per_update, sizes.local_prompts, sizes.samples_per_prompt) == (32, 8, 4, 4)
    assert sizes.total_episodes == 384 and sizes.num_updates == 12
    with pytest.raises(UserError, match=r"3 training prompts x 4 samples per prompt x 1 epoch\(s\) is less than one batch of 32"):
        derive(hp, 2, 3)
    with pytest.raises(UserError, match=r"ppo.critic_warmup_updates \(2\) leaves no update that trains the policy: the run has 2 updates"):
        derive(PPOHyperparams(per_device_train_batch_size=8, total_episodes=16, critic_warmup_updates=2), 1, 100)
    assert derive(PPOHyperparams(per_device_train_batch_size=8, total_episodes=16, critic_warmup_updates=1), 1, 100).num_updates == 2


def test_a_learning_rate_warm_up_must_fit_after_the_critic_warm_up():
    hp = PPOHyperparams(per_device_train_batch_size=8, total_episodes=32, num_ppo_epochs=2, critic_warmup_updates=2, warmup_steps=4)
    # 4 updates x 2 optimiser steps; the policy's schedule has the last 2 updates: 4 steps
    with pytest.raises(UserError, match=r"ppo.warmup_steps \(4\) is not shorter than the policy's 4 optimiser steps after ppo.critic_warmup_updates \(2\)"):
        derive(hp, 1, 100)
    hp.warmup_steps = 3
    assert derive(hp, 1, 100).num_updates == 4


def machine_check(config: PPOConfig) -> None:
    """`machine.check_machine` with a validated config's switches, as the run's set-up passes them (`parts.assemble`)."""
    from ppokit.process.machine import check_machine

    check_machine(lora=config.lora is not None, quantization=config.quantization, fp16=config.fp16, compile=config.compile,
                  strategy=config.parallel.strategy, report_to=config.report_to)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a machine without CUDA")
def test_what_the_config_needs_of_this_machine_is_checked_apart_from_validate(tmp_path):
    """fp16 needs a CUDA device: `machine.check_machine` refuses it in one line, `validate` (which `ppokit plan` runs for other
    machines) does not; report_to a tracker whose package is missing names the extra."""
    from ppokit.config.schema import DataConfig, RewardConfig

    config = PPOConfig(model="m", fp16=True, reward=RewardConfig(functions=["sentiment"]), data=DataConfig(train="p.jsonl")).validate()
    with pytest.raises(UserError, match=r"^fp16: float16 mixed precision needs a CUDA device; use bf16: true on this machine$"):
        machine_check(config)
    machine_check(PPOConfig(model="m", reward=RewardConfig(functions=["sentiment"]), data=DataConfig(train="p.jsonl")).validate())


def test_lora_refuses_the_peft_releases_it_does_not_work_with(monkeypatch):
    """peft 0.16 and 0.17 fail on import under transformers 5 (they import its removed HybridCache), 0.13-0.14 cannot
    put an adapter on a critic sharing the policy's base, and before 0.21 LoRA under fsdp fails in its first forward:
    measured in a venv with each release (docs/memory.md). With lora on, `check_machine` names the installed release
    and the requirement in one line; pyproject.toml's extras carry the same requirements."""
    import tomllib
    from importlib import metadata
    from pathlib import Path

    from ppokit.config.schema import DataConfig, LoraConfig, ParallelConfig, RewardConfig
    from ppokit.process.machine import PEFT_REQUIREMENT
    from ppokit.process.strategies import STRATEGIES

    def lora_config(strategy):
        return PPOConfig(model="m", lora=LoraConfig(), parallel=ParallelConfig(strategy=strategy), reward=RewardConfig(functions=["sentiment"]),
                         data=DataConfig(train="p.jsonl")).validate()

    ddp, fsdp = lora_config("ddp"), lora_config("fsdp")
    machine_check(ddp)  # the peft of this environment (the dev extra's)
    machine_check(fsdp)
    real = metadata.version
    for release, works_under_ddp, works_under_fsdp in [
            ("0.13.0", False, False), ("0.14.0", False, False), ("0.15.0", True, False), ("0.15.2", True, False), ("0.16.0", False, False),
            ("0.17.1", False, False), ("0.18.0", True, False), ("0.20.0", True, False), ("0.21.0", True, True), ("1.0.0", True, True)]:
        monkeypatch.setattr(metadata, "version", lambda name, release=release: release if name == "peft" else real(name))
        for config, works, what, requirement in [(ddp, works_under_ddp, "lora", PEFT_REQUIREMENT),
                                                 (fsdp, works_under_fsdp, "lora under parallel.strategy: fsdp", "peft>=0.21")]:
            if works:
                machine_check(config)
                continue
            if what != "lora" and not works_under_ddp:
                what, requirement = "lora", PEFT_REQUIREMENT  # lora's own requirement is checked first
            with pytest.raises(UserError, match=rf"^{re.escape(what)}: peft {re.escape(release)} is installed and does not work with it "
                                                rf"\(it needs {re.escape(requirement)}; docs/memory.md says why\): pip install '{re.escape(requirement)}'$"):
                machine_check(config)

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    with pytest.raises(UserError, match=r"^lora: needs the peft package: pip install 'ppokit\[lora\]'$"):
        machine_check(ddp)

    extras = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    peft = {extra: [r for r in extras[extra] if r.startswith("peft")] for extra in ("lora", "quantization", "dev")}
    assert peft == {"lora": [PEFT_REQUIREMENT], "quantization": [PEFT_REQUIREMENT], "dev": [STRATEGIES["fsdp"].lora_peft]}
