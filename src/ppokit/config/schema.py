"""The configuration schema of `ppokit ppo`: every section as a dataclass, each key with its help
text and range check, and the rules across keys (`validate`); sft's, rm's and the pipeline's are
`ppokit.config.stages`. Loading YAML and `a.b=value` overrides into it is `ppokit.config.fields`.

Every field carries its documentation in `metadata["help"]`; `docs/config.md` is generated
from it (`python -m ppokit.config.reference > docs/config.md`). Names in `PPOHyperparams` follow TRL's
PPOConfig, and so do the defaults unless the help text says why they differ.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import threading
from fractions import Fraction
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from ppokit.config.fields import OtherConfig, differs_from_default, doc, load_config, one_of, rule, validate
from ppokit.engines import ENGINES, check_engine_lora
from ppokit.errors import UserError
from ppokit.training.estimators import ESTIMATORS, GRPO_STD_SCALINGS, Estimator, description as describe_estimator
from ppokit.process.strategies import DEFAULT as DEFAULT_STRATEGY, STRATEGIES
from ppokit.metrics.trackers import TRACKERS
from ppokit.config.trl_names import GRPO_ADVICE, GRPO_ONLY_NAMES, TRL_GRPO_NAMES
from ppokit.environments.tool_parsers import PARSER_NAMES


positive = rule("> 0", lambda v: v > 0)
non_negative = rule(">= 0", lambda v: v >= 0)
unit_interval = rule("in [0, 1]", lambda v: 0 <= v <= 1)
fraction = rule("in [0, 1)", lambda v: 0 <= v < 1)
seed_range = rule("in 0..2**32-1 (what NumPy's RNG takes)", lambda v: 0 <= v < 2**32)
a_path = rule("a path", lambda v: bool(v.strip()))
above_one = rule("> 1", lambda v: v > 1)
open_unit = rule("in (0, 1)", lambda v: 0 < v < 1)
half_open_unit = rule("in (0, 1]", lambda v: 0 < v <= 1)
ROLLBACK_CHOICE = rule("one of memory, disk, off, true (memory), false (off)", lambda v: isinstance(v, bool) or v in ("memory", "disk", "off"))
# Every wait on a timeout goes through Python's threading (Event.wait, Timer) or a socket timeout: a longer one
# raises OverflowError at every call. One rule for config keys and command-line flags alike.
timeout_range = rule(f"in (0, {threading.TIMEOUT_MAX:.0f}] seconds (threading.TIMEOUT_MAX: the longest wait Python takes)",
                     lambda v: 0 < v <= threading.TIMEOUT_MAX)
# logits / temperature and the policy ratio are float32 (bfloat16 logits are cast up first): both must stay below its
# largest value, 3.4e38. A temperature of 1e-30 keeps logits up to 3.4e8 in magnitude finite (1e-40 made them inf,
# and sampling failed on NaN probabilities); a clip range up to 3.4e38 keeps 1 + it a float32 clamp bound.
MIN_TEMPERATURE = 1e-30
temperature_range = rule(f">= {MIN_TEMPERATURE:g}: logits / temperature is computed in float32, whose largest value is 3.4e38, "
                         "and this keeps it finite for logits up to 3.4e8", lambda v: v >= MIN_TEMPERATURE)
eval_temperature_range = rule(f"0 (greedy) or {temperature_range.requirement}", lambda v: v == 0 or v >= MIN_TEMPERATURE)
clip_range = rule("in (0, 3.4e38]: 1 + it bounds the float32 ratio exp(logp - old logp), whose largest value is 3.4e38",
                  lambda v: 0 < v <= 3.4e38)
# run_name names a folder under <output_dir>/tensorboard: a separator or ".." would put it elsewhere.
distinct_counts = rule("a list of distinct whole numbers >= 1",
                       lambda v: isinstance(v, list) and all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in v) and len(set(v)) == len(v))
TEMPLATE_CALL_ARGUMENTS = {"messages", "tools", "add_generation_prompt", "tokenize", "chat_template", "conversation"}  # apply_chat_template's own
template_variables = rule("a mapping of template variables other than messages, tools, add_generation_prompt, tokenize, chat_template",
                          lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v) and not set(v) & TEMPLATE_CALL_ARGUMENTS)
folder_name = rule("a name without / or \\, not . or ..", lambda v: bool(v.strip()) and not {"/", "\\"} & set(v) and v not in (".", ".."))
DATA_FORMATS = ("auto", "prompt", "prompt_completion", "messages", "alpaca", "preference")
# The same names as ppokit.training.algo's (tests/test_config.py checks); repeated here so that reading a
# config does not import torch.
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
LR_SCHEDULES = ("linear", "constant", "cosine", "cosine_with_min_lr")  # optimise.lr_factor computes each
ROLLOUT_IS = ("tis", "tis_sequence")  # ppo.rollout_is: engines.correction.IMPORTANCE_WEIGHTS holds their functions


# TRL's flat names (its PPOConfig, ModelConfig, ScriptArguments) that ppokit spells otherwise: an unknown
# key of one of these names is told where it goes (docs/trl.md). They are not aliases: TRL's PPO example
# loads the tokenizer from model_name_or_path and the policy from sft_model_path, and one ppokit key for
# both would have to drop one of two values the user set.
TRL_STAGE_NAMES = {
    "model_name_or_path": "TRL's name; ppokit's is model",
    "dataset_name": "TRL's name; ppokit's is data.train: a file, folder or hub dataset name, NAME:SPLIT picks a split",
    "dataset_train_split": "TRL's name; ppokit's is the split in data.train: NAME:SPLIT",
    "dataset_test_split": "TRL's name; ppokit's is the split in data.eval: NAME:SPLIT",
    "max_seq_length": "TRL's name; ppokit's is data.max_length",
}
TRL_PPO_NAMES = {
    **TRL_STAGE_NAMES,
    "model_name_or_path": "TRL's name; ppokit's is model, the policy, whose tokenizer is used unless tokenizer is set",
    "sft_model_path": "TRL's name; ppokit's is model, the policy to start from and the reference",
    "reward_model_path": "TRL's name; ppokit's is reward.model, where the value model also starts unless value_model is set",
    "value_model_path": "TRL's name; ppokit's is value_model",
    "max_seq_length": "TRL's name; ppokit's are data.max_prompt_length and ppo.response_length",
    "use_peft": "TRL's name; ppokit's is a lora section: lora: {} takes every default",
    "lora_r": "TRL's name; ppokit's is lora.r",
    "lora_alpha": "TRL's name; ppokit's is lora.alpha",
    "lora_dropout": "TRL's name; ppokit's is lora.dropout",
    "lora_target_modules": "TRL's name; ppokit's is lora.target_modules",
    "load_in_4bit": "TRL's name; ppokit's is quantization: 4bit",
    "load_in_8bit": "TRL's name; ppokit's is quantization: 8bit",
    "batch_size": "TRL derives it, and so does ppokit: set ppo.per_device_train_batch_size, ppo.gradient_accumulation_steps, ppo.num_mini_batches",
}


# How the PPO loss is normalised (`PPOHyperparams.loss_normalisation`, decided once from ppo.max_tokens_per_micro_batch):
# PER_MICRO_BATCH (TRL): each micro-batch's loss over its own tokens, the gradient the mean of the micro-batches'
# losses, the statistics per micro-batch; PER_MINIBATCH (a token budget): one normaliser over the whole minibatch, so
# the gradient does not depend on how it is split, the statistics per minibatch (ppokit.training.optimise).
PER_MICRO_BATCH, PER_MINIBATCH = "micro_batch", "minibatch"


def loss_normalisation(max_tokens_per_micro_batch: Optional[int]) -> str:
    return PER_MICRO_BATCH if max_tokens_per_micro_batch is None else PER_MINIBATCH


def same_loss_normalisation(before: Optional[int], now: Optional[int]) -> bool:
    """ppo.max_tokens_per_micro_batch on resume: a token budget may become another (the gradient does not depend
    on the split), but not null or from null (the other loss normalisation)."""
    return loss_normalisation(before) == loss_normalisation(now)


@dataclass
class PPOHyperparams:
    """The `ppo:` section. Names and defaults follow TRL's PPOConfig."""

    total_episodes: Optional[int] = doc(None, "Prompts to sample over the whole run (episodes). Default: `num_train_epochs` passes over the training prompts, "
                                              "rounded down to a whole number of batches. Must be a multiple of the batch size.", check=positive)
    num_train_epochs: int = doc(1, "Passes over the training prompts when `total_episodes` is not set.", check=positive)
    per_device_train_batch_size: int = doc(8, "Micro-batch size of one forward/backward pass on one device.", check=positive)
    gradient_accumulation_steps: int = doc(1, "Micro-batches accumulated per optimiser step.", check=positive)
    num_mini_batches: int = doc(1, "Minibatches (optimiser steps) per PPO epoch. Rollout batch per device = per_device_train_batch_size x "
                                   "gradient_accumulation_steps x num_mini_batches.", check=positive)
    num_ppo_epochs: int = doc(4, "Passes of PPO optimisation over each rollout batch.", check=positive)
    local_rollout_forward_batch_size: int = doc(64, "Rows per forward pass during sampling and the reference and value passes (no gradients); the reward model "
                                                    "uses `reward.batch_size`.", check=positive)
    response_length: int = doc(53, "Maximum new tokens sampled per prompt.", check=positive)
    temperature: float = doc(0.7, f"Sampling temperature; logits are divided by it in every logprob computation. At least {MIN_TEMPERATURE:g}, so that logits "
                                  "/ temperature stays a finite float32.", check=temperature_range)
    stop_token: Optional[str] = doc("eos", "Token that ends a response: `eos` (the tokenizer's EOS), any other string that is one token, or null for none. "
                                           "Tokens after it are padding. Differs from TRL (None) because scoring text after EOS is never wanted. With an "
                                           "`environment` whose chat template ends a turn that calls a tool with another special token (gpt-oss: `<|call|>` "
                                           "after a call, `<|return|>` after an answer), that token ends a turn too (said at the start; docs/environments.md).")
    stop_token_id: Optional[int] = doc(None, "Token id that ends a response; overrides `stop_token`.", check=non_negative)
    top_k: int = doc(0, "Sample only from the k most likely tokens; 0: off. With top_k, top_p or min_p the logprobs in the PPO ratio and the KL are still the "
                        "policy's full softmax at `temperature`, not the truncated distribution's.", check=non_negative)
    top_p: float = doc(1.0, "Nucleus sampling: only the smallest set of most likely tokens whose probability reaches top_p (after top_k, before min_p, as "
                            "transformers orders them); 1: off.", check=half_open_unit)
    min_p: float = doc(0.0, "Sample only tokens with at least min_p x the most likely token's probability; 0: off.", check=fraction)
    num_samples_per_prompt: int = doc(1, "Responses sampled per prompt, n (OpenRLHF `--rollout.n_samples_per_prompt`, veRL `rollout.n`). Every batch size "
                                         "counts episodes = prompts x n: an update uses batch / n prompts, and `total_episodes` counts responses. The n "
                                         "samples of a prompt stay on one process, so n must divide the rollout batch per device.", check=positive)
    eval_temperature: Optional[float] = doc(None, "Temperature of `evaluate()` and the sample generations; null: `temperature`; 0: greedy (the most likely "
                                                  "token "
                                                  f"at every step); otherwise at least {MIN_TEMPERATURE:g}, as `temperature`.", check=eval_temperature_range)
    missing_eos_penalty: Optional[float] = doc(None, "Subtracted from the score of responses that never produced the stop token.")
    mask_truncated_completions: bool = doc(False, "Responses that never produced the stop token (with an `environment`: episodes that did not end by "
                                                  "themselves, `rollout/truncated`) leave the loss: their tokens are not trained on, while their scores still "
                                                  "count in the advantages' baselines and statistics (TRL `mask_truncated_completions`; DAPO's overlong "
                                                  "filtering). Needs a stop token or an environment.")
    kl_coef: float = doc(0.05, "Coefficient of the per-token KL penalty (initial value when `kl_target` is set).", check=non_negative)
    kl_estimator: str = doc("k1", "KL estimator in the reward: k1, k2 or k3 (Schulman, 'Approximating KL Divergence').", check=one_of(KL_ESTIMATORS))
    kl_target: Optional[float] = doc(None, "Target "
                                           "KL per sequence for the adaptive controller (Ziegler et al. 2019); null keeps `kl_coef` fixed.", check=positive)
    kl_horizon: float = doc(10000.0, "Horizon (episodes) of the adaptive KL controller.", check=positive)
    cliprange: float = doc(0.2, "Clip range of the policy ratio: clipped to [1 - cliprange, 1 + cliprange], so below 1 unless `cliprange_low` is set (a lower "
                                "bound <= 0 would never clip).", check=clip_range)
    cliprange_value: float = doc(0.2, "Clip range of the value prediction around its rollout value.", check=positive)
    vf_coef: float = doc(0.1, "Weight of the value loss in the total loss.", check=non_negative)
    gamma: float = doc(1.0, f"Discount factor ({' and '.join(e.name for e in ESTIMATORS.values() if e.discounts)}).", check=unit_interval)
    lam: float = doc(0.95, "GAE lambda (gae only).", check=unit_interval)
    whiten_rewards: bool = doc(False, "Whiten per-token rewards (variance only, mean kept) before GAE. gae only: keeping the mean adds the same amount to "
                                      "every token, which a critic learns but a critic-free estimator would take as a reward for length (refused there).")
    whiten_advantages: bool = doc(True, "Whiten advantages over real tokens: with `gae` per process (as TRL always does), with `reinforce_pp` over the global "
                                        "batch (REINFORCE++). grpo, rloo and remax normalise by their own baseline and do not whiten (false is refused there).")
    advantage_estimator: str = doc("gae", "How advantages are estimated (OpenRLHF `--algo.advantage.estimator`, veRL `algorithm.adv_estimator`): "
                                   + "; ".join(f"`{e.name}` ({e.doc})" for e in ESTIMATORS.values())
                                   + ". docs/algorithms.md has the formulas.", check=one_of(ESTIMATORS))
    grpo_scale_std: Union[bool, str] = doc(True, "grpo: what r - mean (the group's mean) is divided by: `true` the group's standard deviation; `batch` the "
                                                 "standard deviation of the whole batch's rewards, over every process (Lite PPO; TRL `scale_rewards: batch`); "
                                                 "`false` nothing, Dr. GRPO's unscaled r - mean (veRL `norm_adv_by_std_in_grpo: false`, OpenRLHF's `dr_grpo` "
                                                 "estimator, TRL `scale_rewards: none`). TRL's spellings `group` and `none` "
                                                 "are taken too.", check=rule("true, false, batch, or TRL's group, none", lambda v: v in GRPO_STD_SCALINGS))
    kl_in_reward: bool = doc(True, "Subtract kl_coef x the per-token KL from the reward (TRL's PPO, veRL `use_kl_in_reward`). false: no KL in the reward (use "
                                   "`kl_loss_coef` for a KL term in the loss, as GRPO does).")
    kl_loss_coef: float = doc(0.0, "Weight of a KL(policy || reference) term in the policy loss (OpenRLHF `--algo.kl.use_loss` + `--algo.kl.init_coef`, veRL "
                                   "`actor.kl_loss_coef`); 0: off. Either or both of this and `kl_in_reward`.", check=non_negative)
    kl_loss_estimator: str = doc("k3", "KL estimator of the loss term: "
                                       "k1, k2 or k3 (k3 is the usual low-variance KL of GRPO; veRL `kl_loss_type` low_var_kl).", check=one_of(KL_ESTIMATORS))
    kl_clamp: Optional[float] = doc(None, "Clamp every per-token KL estimate to [-kl_clamp, kl_clamp], in the reward (`kl_estimator`; `objective/kl` reports "
                                          "the clamped values) and in the loss (`kl_loss_estimator`); where the clamp is active the KL term's gradient is 0 "
                                          "(k3's is 1 - e^r otherwise: -3.3e6 at r = 15). null: off. OpenRLHF clamps every estimator to 10 (always on); veRL "
                                          "clamps k3 `low_var_kl` to 10 (`kl_penalty`/`kl_loss_type` low_var_kl).", check=positive)
    cliprange_low: Optional[float] = doc(None, "Lower clip range: the ratio is clipped below at 1 - cliprange_low; null: `cliprange` (veRL `clip_ratio_low`, "
                                               "OpenRLHF `--actor.eps_clip_low_high`).", check=open_unit)
    cliprange_high: Optional[float] = doc(None, "Upper clip range: clipped above at 1 + cliprange_high; null: `cliprange`. DAPO's clip-higher uses 0.28 with a "
                                                "low of 0.2. At most 3.4e38 (1 + it is a float32 bound).", check=clip_range)
    dual_clip_c: Optional[float] = doc(None, "Dual-clip PPO (Ye et al. 2020): where the advantage is negative the loss is capped at c x |A|; null: off; c > 1 "
                                             "(veRL `clip_ratio_c`, always on there with default 3.0; OpenRLHF `--actor.dual_clip`).", check=above_one)
    entropy_coef: float = doc(0.0, "Weight of an entropy "
                                   "bonus subtracted from the policy loss (OpenRLHF `--actor.entropy_coef`, veRL `entropy_coeff`); 0: off.", check=non_negative)
    loss_aggregation: str = doc("token_mean", "How per-token policy losses become one number (veRL `loss_agg_mode`): `token_mean` (over every real token, "
                                              "TRL's), `seq_mean_token_sum` (sum per sequence, mean over sequences), `seq_mean_token_mean` (mean per sequence, "
                                              "then over sequences: the original GRPO), `seq_mean_token_sum_norm` (sum per sequence / response_length, mean "
                                              "over sequences: Dr. GRPO). The value loss is always a token mean.", check=one_of(LOSS_AGGREGATIONS))
    importance_sampling_level: str = doc("token", "The policy ratio of the clipped loss: `token`, each token's own pi / pi_old (PPO); `sequence`, GSPO's "
                                                  "(Zheng et al. 2025): exp of the mean log-ratio over the response's trained tokens, the same ratio (and "
                                                  "clip) on every token of it (TRL `importance_sampling_level: sequence`, veRL `policy_loss.loss_mode: gspo`, "
                                                  "OpenRLHF `--actor.policy_loss_type gspo`). GSPO's objective is a mean over sequences: pair it with "
                                                  "`loss_aggregation: seq_mean_token_mean` (TRL `loss_type: grpo`; OpenRLHF forces it), and its paper clips at "
                                                  "3e-4 / 4e-4 (`cliprange_low`, `cliprange_high`). The ratio statistics (`val/ratio`, `policy/clipfrac_avg`, "
                                                  "`policy/approxkl_avg`) are then of the sequence ratios.", check=one_of(("token", "sequence")))
    rollout_is: Optional[str] = doc(None, "Correction for a rollout engine whose probabilities are not the trainer's (the PPO ratio and the KL always use the "
                                          "trainer's own logprobs, recomputed with one no-gradient forward), truncated importance sampling (Yao et al. 2025): "
                                          "`tis`, each token's policy-gradient loss times its own ratio p_trainer / p_engine clipped to [`rollout_is_floor`, "
                                          "`rollout_is_cap`] (veRL `algorithm.rollout_correction.rollout_is: token` with `rollout_is_threshold`; OpenRLHF "
                                          "`--algo.advantage.is_correction_enable` with `--algo.advantage.is_correction_threshold LOW HIGH`, type `tis`); "
                                          "`tis_sequence`, every token of a response times the ratio of the whole response's probabilities, clipped likewise "
                                          "(veRL `rollout_is: sequence`). null: off. With `rollout.engine: hf` the engine's probabilities are the trainer's "
                                          "and every weight would be 1: nothing is computed.", check=one_of(ROLLOUT_IS))
    rollout_is_cap: float = doc(2.0, "The largest truncated importance weight of `rollout_is` (veRL `rollout_is_threshold`, default 2; OpenRLHF the HIGH of "
                                     "`--algo.advantage.is_correction_threshold`, default "
                                     "5).", check=rule(">= 1 (a cap below 1 would shrink every token's loss, the on-policy ones too)", lambda v: v >= 1))
    rollout_is_floor: float = doc(0.0, "The smallest truncated importance weight of `rollout_is`: weights below it are raised to it. 0: truncated above only, "
                                       "as veRL; OpenRLHF clips to [LOW, HIGH] of `--algo.advantage.is_correction_threshold`, default [0.5, 5]: "
                                       "`rollout_is_floor: 0.5` with `rollout_is_cap: 5` gives its "
                                       "weights.", check=rule("in [0, 1] (a "
                                                              "floor above 1 would raise every token's loss, the on-policy ones too)", lambda v: 0 <= v <= 1))
    vf_learning_rate: Optional[float] = doc(None, "Peak learning rate of the value model (its own AdamW parameter group, on the same schedule); null: "
                                                  "`learning_rate` (OpenRLHF `--critic.adam.lr`, veRL `critic.optim.lr`). gae only.", check=positive)
    critic_warmup_updates: int = doc(0, "The first this many updates train only the value model; the policy moves from the next (OpenRLHF "
                                        "`--critic.freezing_steps`, veRL `trainer.critic_warmup`). gae only.", check=non_negative)
    learning_rate: float = doc(3e-6, "Peak learning rate of AdamW (policy, and value unless `vf_learning_rate`).", check=positive)
    adam_epsilon: float = doc(1e-5, "AdamW epsilon. "
                                    "Differs from transformers' and TRL's 1e-8: 1e-5 as in 'The N+ Implementation Details of RLHF with PPO'.", check=positive)
    adam_beta1: float = doc(0.9, "AdamW's beta1, "
                                 "the decay of its gradient average (transformers' and TRL's name and default).", check=rule("in [0, 1)", lambda v: 0 <= v < 1))
    adam_beta2: float = doc(0.999, "AdamW's beta2, the decay "
                                   "of its squared-gradient average (transformers' and TRL's name and default).", check=rule("in [0, 1)", lambda v: 0 <= v < 1))
    weight_decay: float = doc(0.0, "AdamW weight decay.", check=non_negative)
    max_grad_norm: float = doc(1.0, "Gradient clipping norm (policy and value together); 0 disables.", check=non_negative)
    lr_scheduler_type: str = doc("linear", "Learning-rate schedule over all optimiser steps after the warm-up: linear (decay to 0), constant, cosine (a half "
                                           "cosine down to 0) or cosine_with_min_lr (down to `min_lr_rate` x the peak), as transformers' schedules of those "
                                           "names.", check=one_of(LR_SCHEDULES))
    min_lr_rate: Optional[float] = doc(None, "The floor of lr_scheduler_type cosine_with_min_lr, a share of the peak rate (transformers' and TRL's "
                                             "`lr_scheduler_kwargs: {min_lr_rate: ...}`; their `min_lr` is min_lr / learning_rate). Only with "
                                             "cosine_with_min_lr, which needs it.", check=rule("in [0, 1]", lambda v: 0 <= v <= 1))
    warmup_steps: int = doc(0, "Optimiser steps of linear warm-up.", check=non_negative,
                            if_wrong="a share of the run's steps (transformers' and TRL's warmup_steps: 0.1) is ppo.warmup_ratio")
    warmup_ratio: float = doc(0.0, "Linear warm-up as a share of the run's optimiser steps: ceil(warmup_ratio x steps), the ratio taken as written (0.07 of "
                                   "100 steps is 7, where the float product 7.000000000000001 would make 8) (TRL/transformers `warmup_ratio`, OpenRLHF "
                                   "`--actor.lr_warmup_ratio`, "
                                   "veRL `optim.lr_warmup_steps_ratio`, which rounds down). Set this or `warmup_steps`, not both.", check=fraction)
    # resume=True (here and below): keys that change no number the run computes, so a resumed run may set them
    # otherwise without --resume-force (ppokit.run.checkpoint.config_differences): how often it prints or saves, how many
    # checkpoints it keeps, when it gives up on non-finite updates and how it undoes them (the same numbers until one
    # appears). Every key without it must match the checkpoint's.
    logging_steps: int = doc(1, "Print a line every this many updates (metrics.jsonl gets every update).", check=positive, resume=True)
    save_steps: int = doc(0, "Write a checkpoint every this many updates; 0 saves only at the end.", check=non_negative, resume=True)
    num_sample_generations: int = doc(10, "How many times over the run to write sample completions to samples.jsonl (and eval scores); with eval data also "
                                          "once "
                                          "before training (update 0; its random draws leave training's stream as it was); 0 disables.", check=non_negative)
    num_eval_samples: int = doc(8, "Prompts (from data.eval, else the current batch) in each sample generation.", check=positive)
    eval_samples_per_prompt: int = doc(1, "Responses sampled per eval prompt, n, in `evaluate()` and each sample generation (every one a samples.jsonl row; "
                                          "TRL `num_generations_eval`): `eval/scores` is then the mean over every sample, and with `eval_pass_at_k` the "
                                          "estimates of pass@k. More than 1 needs sampling (an `eval_temperature` other than 0).", check=positive)
    eval_pass_at_k: list[int] = doc(factory=list, help="The ks of `eval/pass@k` (e.g. [1, 4]): the unbiased estimate (Chen et al. 2021) from the "
                                                       "`eval_samples_per_prompt` samples of each eval prompt, of which c are correct (score >= "
                                                       "`eval_correct_threshold`), averaged over the prompts: 1 - C(n - c, k) / C(n, k) (docs/algorithms.md). "
                                                       "Each k in 1..eval_samples_per_prompt. With it `eval/mean@n` is logged too (the mean score over the n "
                                                       "samples, averaged over the prompts). Empty: "
                                                       "off.", check=distinct_counts)
    eval_correct_threshold: float = doc(1.0, "A sample counts as correct for `eval_pass_at_k` when its score (the combined score, as `eval/scores`) is at "
                                             "least this; a reward function that returns a bool scores 1 (true) or 0 (false). An unscored sample is not "
                                             "correct.")
    save_total_limit: Optional[int] = doc(None, "Keep only the newest this many complete checkpoints in output_dir/checkpoints (older ones are deleted after "
                                                "each save; the newest complete one never is). null keeps all.", check=positive, resume=True)
    max_skipped_updates: int = doc(3, "An update with a non-finite score, or a non-finite loss or gradient as `nonfinite_rollback` says, is skipped (counted "
                                      "in `skipped_updates`); after this "
                                      "many in a row the run writes a checkpoint and stops with an error naming the quantity.", check=positive, resume=True)
    nonfinite_rollback: Union[str, bool] = doc("off", "What a non-finite loss or gradient at an optimiser step does. `off`: that step is skipped (no weight or "
                                                      "optimiser-state change; every process agrees) and the update goes on, counted in `skipped_steps`; an "
                                                      "update whose every step was skipped is a skipped update; nothing is copied. `memory`: the whole update "
                                                      "is undone and skipped, from a copy of the trainable weights and optimiser state made at the start of "
                                                      "every update in CPU memory (about 3x the trainable weights with AdamW, per process: ~84 GB for a 7B "
                                                      "full fine-tune). `disk`: the same copy, written to the run folder (`.rollback/`, one file per process) "
                                                      "instead. "
                                                      "true means memory, false off (YAML reads an unquoted off as false).", check=ROLLBACK_CHOICE, resume=True)
    # Speed (docs/speed.md).
    max_tokens_per_micro_batch: Optional[int] = doc(None, "Token budget of one training micro-batch (veRL's ppo_max_token_len_per_gpu). Within each minibatch "
                                                          "(per_device_train_batch_size x gradient_accumulation_steps rows, as without it) rows of similar "
                                                          "length are packed together, longest first, while rows x the micro-batch's longest row (prompt + "
                                                          "response) stays within the budget, and each micro-batch is packed: every row's tokens end at the "
                                                          "last column, so it is as wide as its longest row (no padding between a prompt and its response, "
                                                          "none beyond the longest row). The loss is normalised over the whole minibatch's real tokens, so the "
                                                          "gradient does not depend on the split: a memory knob, not a result knob. The reference, value and "
                                                          "reward-model passes are then chunked and packed the same way, each chunk within "
                                                          "local_rollout_forward_batch_size (reward.batch_size) rows of the batch's full width. Must be at "
                                                          "least the longest prompt + response_length (checked at start). null: fixed micro-batches of "
                                                          "per_device_train_batch_size "
                                                          "rows, each loss a mean over its own tokens (TRL).", check=positive, resume=same_loss_normalisation)

    padding_free: bool = doc(False, "Padding-free training and scoring forwards (veRL's use_remove_padding, OpenRLHF's --packing_samples, TRL's padding_free): "
                                    "the policy, reference, critic and reward model read several episodes per row, concatenated, positions restarting at each "
                                    "episode, so no padding token is computed. With max_tokens_per_micro_batch the budget fills these rows (rows x the "
                                    "micro-batch's longest episode) instead of rows of one episode each; without it the micro-batches keep their rows. "
                                    "Logprobs, values and losses equal the padded computation within float rounding; each model is checked once at start to "
                                    "keep packed episodes apart (transformers' packed-sequence masks from position ids). Under parallel.strategy fsdp a causal "
                                    "LM's packed forward runs inside its own forward (FSDP gathers the head there).", resume=True)
    shared_prompt: bool = doc(False, "The prompt of a group of num_samples_per_prompt samples computed once in the policy, reference and critic forwards "
                                     "(sampling aside), gradients included (Unsloth's PrefixGrouper, veRL's and NeMo Automodel's shared-prefix "
                                     "layout): each group is one row, the samples' common prefix once and then each sample's rest, with a 4-D "
                                     "attention mask (each sample attends to the prefix and its own tokens) and positions continuing from the "
                                     "prefix's; the logit that predicts a sample's first token is read from the prefix's last position. Logprobs, "
                                     "values and losses equal the separate computation within float rounding; the update's shuffle keeps a group's "
                                     "samples together (whole groups per minibatch). Needs num_samples_per_prompt >= 2, per_device_train_batch_size "
                                     "and local_rollout_forward_batch_size multiples of it, attn_implementation sdpa or eager (each model checked "
                                     "once at start); not with padding_free, max_tokens_per_micro_batch or compile. Under parallel.strategy fsdp a "
                                     "causal LM's shared-prompt forward runs inside its own forward, as padding_free's does. Faster where "
                                     "the prompt is long beside the responses (docs/speed.md has the rule).", resume=True)

    @property
    def kept_together(self) -> int:
        """Adjacent rows the update's shuffle keeps together: a group's samples with shared_prompt (its forwards lay each
        group out as one row), else 1 (rows shuffled one by one)."""
        return self.num_samples_per_prompt if self.shared_prompt else 1

    @property
    def loss_normalisation(self) -> str:
        """PER_MICRO_BATCH or PER_MINIBATCH: how the loss is normalised and the statistics gathered (ppokit.training.optimise)."""
        return loss_normalisation(self.max_tokens_per_micro_batch)

    def warmup_steps_over(self, num_steps: int) -> int:
        """The schedule's warm-up in optimiser steps, for a run of `num_steps`: `warmup_steps`, or
        ceil(warmup_ratio x num_steps) with the ratio as written (Fraction of its decimal form: 0.07 x 100 is 7, where
        the float product 7.000000000000001 would round up to 8). The one place both keys are read."""
        if self.warmup_steps:
            return self.warmup_steps
        return math.ceil(Fraction(repr(self.warmup_ratio)) * num_steps)

    def _check_eval_samples(self) -> None:
        """pass@k needs k <= n samples per eval prompt, n > 1 needs sampling, and the threshold is read only by pass@k."""
        n = self.eval_samples_per_prompt
        above = [k for k in self.eval_pass_at_k if k > n]
        if above:
            raise UserError(f"ppo.eval_pass_at_k ({self.eval_pass_at_k}): pass@{above[0]} needs at least {above[0]} samples per eval "
                            f"prompt, and ppo.eval_samples_per_prompt is {n}; raise it to {max(above)} or more, or drop k > {n}")
        if n > 1 and self.eval_temperature == 0:
            raise UserError(f"ppo.eval_samples_per_prompt ({n}) with ppo.eval_temperature 0 (greedy) would sample {n} identical "
                            "responses per prompt; set ppo.eval_temperature above 0 (or null: ppo.temperature)")
        if not self.eval_pass_at_k and differs_from_default(self, "eval_correct_threshold"):
            raise UserError(f"ppo.eval_correct_threshold ({self.eval_correct_threshold}) decides which samples pass for "
                            "ppo.eval_pass_at_k, which is not set; set ppo.eval_pass_at_k (e.g. [1, 4]) or remove the key")

    def _check_shared_prompt(self) -> None:
        """shared_prompt needs groups, micro-batches and no-gradient chunks of whole groups, and neither of the layouts it
        does not combine with."""
        if not self.shared_prompt:
            return
        n = self.num_samples_per_prompt
        if n < 2:
            raise UserError("ppo.shared_prompt computes the prompt of a group of samples once, and ppo.num_samples_per_prompt is 1 (no groups); "
                            "set it to 2 or more, or ppo.shared_prompt: false")
        uneven = [f"ppo.{key} ({getattr(self, key)})" for key in ("per_device_train_batch_size", "local_rollout_forward_batch_size")
                  if getattr(self, key) % n]
        if uneven:
            raise UserError(f"ppo.shared_prompt lays out whole groups of ppo.num_samples_per_prompt ({n}) samples: {' and '.join(uneven)} "
                            f"must be a multiple of {n}")
        for key in ("padding_free", "max_tokens_per_micro_batch"):
            if getattr(self, key) not in (None, False):
                raise UserError(f"ppo.shared_prompt with ppo.{key}: the two layouts do not combine yet; turn one of them off")

    @property
    def estimator(self) -> Estimator:
        """The declaration of `advantage_estimator` (ppokit.training.estimators): its function and traits."""
        return ESTIMATORS[self.advantage_estimator]

    @property
    def rollback(self) -> str:
        """`nonfinite_rollback` as one of memory, disk, off (true and false are its aliases)."""
        return {True: "memory", False: "off"}.get(self.nonfinite_rollback, self.nonfinite_rollback)

    def check_combination(self) -> None:
        """Rules across keys of this section (each key's own range is checked by `validate`):
        every bad combination is an error naming the key and the rule."""
        n, estimator = self.num_samples_per_prompt, self.estimator
        local_batch = self.per_device_train_batch_size * self.gradient_accumulation_steps * self.num_mini_batches
        if n < estimator.min_samples_per_prompt:
            raise UserError(
                f"ppo.num_samples_per_prompt: {estimator.name} needs at least {estimator.min_samples_per_prompt} samples per prompt "
                f"(its baseline is the other samples of the same prompt), got {n}"
            )
        if local_batch % n:
            raise UserError(
                f"ppo.num_samples_per_prompt ({n}) must divide the rollout batch per device ({local_batch} = "
                f"per_device_train_batch_size {self.per_device_train_batch_size} x gradient_accumulation_steps "
                f"{self.gradient_accumulation_steps} x num_mini_batches {self.num_mini_batches}): a prompt's samples stay on one process"
            )
        self._check_eval_samples()
        self._check_shared_prompt()
        if self.warmup_steps and self.warmup_ratio:
            raise UserError(f"ppo.warmup_steps ({self.warmup_steps}) and ppo.warmup_ratio ({self.warmup_ratio}) both set the warm-up; set one of them")
        if (self.lr_scheduler_type == "cosine_with_min_lr") != (self.min_lr_rate is not None):
            raise UserError("ppo.lr_scheduler_type cosine_with_min_lr needs ppo.min_lr_rate, its floor as a share of the peak rate"
                            if self.min_lr_rate is None else
                            f"ppo.min_lr_rate ({self.min_lr_rate}) is the floor of ppo.lr_scheduler_type cosine_with_min_lr, and "
                            f"this run's schedule is {self.lr_scheduler_type}; remove it, or set ppo.lr_scheduler_type: cosine_with_min_lr")
        for key in ("rollout_is_cap", "rollout_is_floor"):
            if self.rollout_is is None and differs_from_default(self, key):
                raise UserError(f"ppo.{key} ({getattr(self, key)}) bounds the weights of ppo.rollout_is, which is off; set ppo.rollout_is: "
                                f"{' or '.join(ROLLOUT_IS)} or remove the key")
        if self.cliprange_low is None and self.cliprange >= 1:  # cliprange_low's own range is (0, 1)
            raise UserError(
                f"ppo.cliprange ({self.cliprange}) is also the lower clip range (ppo.cliprange_low is unset): the ratio's lower "
                f"bound 1 - {self.cliprange} = {1 - self.cliprange:g} is not above 0, so it would never clip; it must be below 1 "
                "(set ppo.cliprange_high for a wider upper range)"
            )
        low = self.cliprange if self.cliprange_low is None else self.cliprange_low
        high = self.cliprange if self.cliprange_high is None else self.cliprange_high
        if low > high:
            raise UserError(
                f"ppo.cliprange_low ({low}) is larger than ppo.cliprange_high ({high}); the lower clip range must not exceed the "
                "upper (clip-higher widens the upper one); unset, each is ppo.cliprange"
            )
        if self.whiten_rewards and not estimator.critic:
            # Whitening keeps the mean: r' = r / std + mean (1 - 1 / std) on every real token, so a return gains
            # mean (1 - 1 / std) per remaining token. GAE's critic learns that; a baseline of sequence rewards cannot
            # remove a term that differs with each response's length (and a greedy baseline's score is not whitened at all).
            baseline = " and its greedy baseline is not whitened" if estimator.greedy_baseline else ""
            raise UserError(
                "ppo.whiten_rewards: true is for gae: it keeps the mean, which adds the same amount to every token, so a "
                f"whitened return grows with the response's length; a critic learns that, but ppo.advantage_estimator {estimator.name} "
                f"has none{baseline}; remove it"
            )
        if not estimator.whitens and not self.whiten_advantages:
            raise UserError(f"ppo.whiten_advantages: false has no effect with ppo.advantage_estimator {estimator.name}, which never whitens; remove it")
        # A key set away from its default that this configuration would never read is refused, not ignored.
        for key, why in self.unread_keys().items():
            if differs_from_default(self, key):
                raise UserError(f"ppo.{key} ({getattr(self, key)!r}) is for {why}; remove it")

    def unread_keys(self) -> dict[str, str]:
        """{key: what would read it} for every key of this section that these settings never read: the estimator's
        (`Estimator.unread_keys`), the KL's and the clip range's. Set away from its default one is refused
        (`check_combination`); at its default it is left out of the run's config.yaml and model card, which say so
        (`PPOConfig.save`, ppokit.run.model_card)."""
        estimator = self.estimator
        unused = dict(estimator.unread_keys())
        if not estimator.whitens:
            unused.setdefault("whiten_advantages", f"whitening, which ppo.advantage_estimator {estimator.name} never does")
        if not estimator.critic:
            unused.setdefault("whiten_rewards", f"gae's critic, which ppo.advantage_estimator {estimator.name} does not build")
        if not self.kl_in_reward:
            unused.update({k: "the KL penalty in the reward, and ppo.kl_in_reward is false" for k in ("kl_coef", "kl_target", "kl_horizon")})
        if self.kl_loss_coef == 0:
            unused["kl_loss_estimator"] = "the KL term in the loss, and ppo.kl_loss_coef is 0"
        if not self.kl_in_reward and self.kl_loss_coef == 0:
            unused["kl_clamp"] = "a KL in the reward or the loss, and this run has neither"
        if self.cliprange_low is not None and self.cliprange_high is not None:
            unused["cliprange"] = "a clip range that ppo.cliprange_low or ppo.cliprange_high leaves unset, and both are set"
        return unused

    @property
    def estimator_description(self) -> str:
        """What the advantage estimator computes with these settings, in one phrase (grpo's by `grpo_scale_std`)."""
        return describe_estimator(self.advantage_estimator, self.grpo_scale_std)


def http_url_problem(url: Any) -> Optional[str]:
    """What is wrong with `url` as a remote scorer's address, or None: it must be http:// or https://
    with a host, and carry no credentials (those go in headers, where a redirect cannot take them)."""
    from urllib.parse import urlsplit

    if not isinstance(url, str):
        return f"expected an http:// or https:// URL, got {url!r}"
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        return f"{url!r} contains spaces or control characters"
    if "://" not in url:
        return f"{url!r} has no scheme; write http://{url} (or https://)"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises on a port that is not a number in 0-65535)
    except ValueError as e:
        return f"{url!r} is not a valid URL ({e})"
    if parts.scheme.lower() not in ("http", "https"):
        return f"scheme {parts.scheme}:// is not supported; use http:// or https://"
    if parts.username is not None or parts.password is not None:
        return "user:password@ in the URL is not supported; put credentials in reward.remote.headers (e.g. Authorization: \"Bearer ${RM_TOKEN}\")"
    if not parts.hostname:
        return f"{url!r} has no host"
    return None


@dataclass
class RemoteRewardConfig:
    """The `reward.remote:` section: a scorer behind HTTP (for example `ppokit serve-rm`)."""

    url: Optional[str] = doc(None, "Endpoint (http:// or https://) that takes a POST of JSON {prompts, completions, columns} and answers {rewards: [...]}. A "
                                   "redirect is followed only to the same scheme, host and port; see docs/rewards.md.")
    timeout_s: float = doc(60.0, "Deadline in seconds for one whole request (connect, send, the answer read to its end); after it the request counts as failed "
                                 "and is retried. At most threading.TIMEOUT_MAX (about 292 years).", check=timeout_range)
    max_retries: int = doc(3, "Retries of a failed request (connection error, timeout, HTTP 429 or 5xx) before the run stops.", check=non_negative)
    backoff_s: float = doc(1.0, "Wait before the first retry; doubled for each further retry (capped at 30 s).", check=non_negative)
    batch_size: int = doc(64, "Rows per request.", check=positive)
    headers: dict = doc(factory=dict, help="Extra HTTP headers. `${VAR}` in a value is replaced by the environment variable VAR when the request is sent, so "
                                           "secrets stay out of config.yaml.")
    name: str = doc("remote", "Name of this source in the metrics (`reward/<name>`).")
    max_response_bytes: int = doc(16 << 20, "Largest "
                                            "answer read, in bytes (default 16 MiB); a larger one fails this batch without being read further.", check=positive)


@dataclass
class RewardConfig:
    """The `reward:` section: where scores come from. At least one source is required."""

    model: Optional[str] = doc(None, "Sequence-classification reward model (local path or hub id), one label; scored at the last real token.")
    functions: list[str | dict] = doc(factory=list, help="Reward functions: `path/to/file.py:fn`, `package.module:fn` or a built-in name (`sentiment`, "
                                                         "`exact_match`, `math_equivalence`, `regex`, `format`, `length`, `contains`), or a mapping "
                                                         "`{function: NAME, name: LABEL, PARAM: VALUE, ...}` that gives a built-in its parameters (extra keys "
                                                         "go to a user function as keyword arguments). Called as fn(prompts, completions, **columns) -> "
                                                         "list[float], or TRL's way, every argument by keyword (prompts=, completions=, completion_ids=, "
                                                         "**columns), when the function names a `completions` parameter elsewhere than second (`def "
                                                         "reward_len(completions, **kwargs)`); each signature is checked before any model loads. See "
                                                         "docs/rewards.md.")
    weights: Optional[list[float]] = doc(None, "One weight per source, in this order: reward model, functions, remote, environment; default all 1.")
    batch_size: int = doc(64, "Rows per reward-model forward pass.", check=positive)
    remote: Optional[RemoteRewardConfig] = doc(None, "A remote scorer over HTTP; it comes after the functions in `weights`.")
    normalize: bool | list[bool] = doc(False, "Standardise each source's raw score by its own running mean and std (over every batch so far) before weighting: "
                                              "true for all sources, or one true/false per source in `weights` order. The statistics are part of the training "
                                              "state.")
    length_penalty: float = doc(0.0, "Subtracted from the "
                                     "score per completion token beyond `length_penalty_start` (policy tokens, stop token not counted).", check=non_negative)
    length_penalty_start: int = doc(0, "Completion length (tokens) from which `length_penalty` applies.", check=non_negative)
    overlong_max_length: Optional[int] = doc(None, "DAPO's overlong reward shaping, L_max (veRL's data.max_response_length with reward_model.overlong_buffer): "
                                                   "with `overlong_cache_length` L_cache, a completion of L tokens in (L_max - L_cache, L_max] loses (L - "
                                                   "(L_max - L_cache)) / L_cache x `overlong_penalty_factor`, one beyond L_max the whole factor. The same as "
                                                   "length_penalty: factor / L_cache from length_penalty_start: L_max - L_cache, held at the factor beyond "
                                                   "L_max; docs/algorithms.md. null: off.", check=positive)
    overlong_cache_length: Optional[int] = doc(None, "DAPO's L_cache (veRL's reward_model.overlong_buffer.len): the last tokens before `overlong_max_length` "
                                                     "over which the penalty grows from 0 to the factor; at most overlong_max_length.", check=positive)
    overlong_penalty_factor: float = doc(1.0, "DAPO's "
                                              "overlong penalty at L_max and beyond (veRL's reward_model.overlong_buffer.penalty_factor).", check=non_negative)
    clip_range: Optional[list[float]] = doc(None, "[low, high]: the final score (after weights, normalisation and penalties) is clipped to this range.")
    timeout_s: Optional[float] = doc(600.0, "Deadline in seconds for one call of a reward function (built-ins too): the function runs in a worker thread, and "
                                            "a call that has not returned by then fails like a raised error (`on_error` applies). Python cannot stop a thread, "
                                            "so the stuck call is left running and the function fails at once until it returns. null: call it in the main "
                                            "thread without a limit (for libraries that need the main thread, e.g. signal-based timeouts). At most "
                                            "threading.TIMEOUT_MAX (about 292 years).", check=timeout_range)
    on_error: str = doc("raise", "A reward source that raises, returns the wrong count, NaN or inf: `raise` stops the run with an error naming the source and "
                                 "a "
                                 "row; `skip` drops the affected samples from the update and counts them in `reward/skipped`.", check=one_of(("raise", "skip")))

    def check_combination(self, n_sources: int) -> None:
        """Checks across keys of this section (each key's own range is checked by `validate`)."""
        if self.remote is not None and not self.remote.url:
            raise UserError("reward.remote.url: required (the endpoint to POST {prompts, completions, columns} to)")
        if self.remote is not None:
            problem = http_url_problem(self.remote.url)
            if problem:
                raise UserError(f"reward.remote.url: {problem}")
        if isinstance(self.normalize, list):
            if len(self.normalize) != n_sources or not all(isinstance(v, bool) for v in self.normalize):
                raise UserError(f"reward.normalize: expected true, false or a list of {n_sources} true/false (one per source), got {self.normalize!r}")
        elif not isinstance(self.normalize, bool):
            raise UserError(f"reward.normalize: expected true, false or a list of true/false, got {self.normalize!r}")
        if self.clip_range is not None and (len(self.clip_range) != 2 or not self.clip_range[0] < self.clip_range[1]):
            raise UserError(f"reward.clip_range: expected [low, high] with low < high, got {self.clip_range!r}")
        self._check_overlong()

    def _check_overlong(self) -> None:
        """DAPO's overlong keys come together, and are length_penalty in another form: not both."""
        longest, cache = self.overlong_max_length, self.overlong_cache_length
        if (longest is None) != (cache is None):
            given, missing = ("overlong_max_length", "overlong_cache_length") if cache is None else ("overlong_cache_length", "overlong_max_length")
            raise UserError(f"reward.{given} needs reward.{missing} (DAPO's L_max and L_cache come together); set it, or remove reward.{given}")
        if longest is None:
            if differs_from_default(self, "overlong_penalty_factor"):
                raise UserError("reward.overlong_penalty_factor is read only with reward.overlong_max_length and overlong_cache_length; set them, or remove it")
            return
        if cache > longest:
            raise UserError(f"reward.overlong_cache_length ({cache}) is longer than reward.overlong_max_length ({longest}); it is the last part of it")
        if self.length_penalty or self.length_penalty_start:
            raise UserError("reward.overlong_max_length is DAPO's form of reward.length_penalty (docs/algorithms.md); set one of them, not both")

    @property
    def length_shaping(self) -> tuple[float, int, Optional[float]]:
        """(penalty per token, from which length, the most it takes or None): length_penalty and length_penalty_start, or
        DAPO's overlong keys in that form, factor / L_cache from L_max - L_cache, at most the factor."""
        if self.overlong_max_length is None:
            return self.length_penalty, self.length_penalty_start, None
        factor, cache = self.overlong_penalty_factor, self.overlong_cache_length
        return factor / cache, self.overlong_max_length - cache, factor


@dataclass
class DataConfig:
    """The `data:` section."""

    train: Optional[str] = doc(None, "Training prompts: a .jsonl/.json/.csv/.parquet file, a datasets.save_to_disk folder, reasoning-gym's tasks "
                                     "(`reasoning_gym:TASK?size=N&seed=S`) or a hub dataset name (docs/data.md). Any format with a prompt works (chat prompts "
                                     "are rendered with the chat template); the other columns are passed to reward functions.")
    eval: Optional[str] = doc(None, "Evaluation prompts, same format; completions and scores go to samples.jsonl. A `reasoning_gym:` spec without a seed, "
                                    "beside a `reasoning_gym:` train, starts after the training entries.")
    prompt_field: str = doc("prompt", "Name of the prompt column.")
    max_prompt_length: Optional[int] = doc(None, "Prompts longer "
                                                 "than this (in tokens) are truncated from the left; the count is reported. null: no limit.", check=positive)
    format: str = doc("auto", "Row format: auto (detected "
                              "from the columns), prompt, prompt_completion, messages, alpaca or preference (docs/data.md).", check=one_of(DATA_FORMATS))
    chat_template: Optional[str] = doc(None, "Template for chat prompts: null/auto (the tokenizer's, else the plain fallback), plain, tokenizer, a .jinja file "
                                             "or Jinja text. The run's config.yaml records the template used. With an `environment` it renders the "
                                             "observations too (docs/environments.md).")
    chat_template_kwargs: dict = doc(factory=dict, help="Extra variables for the chat template, in every prompt and observation it renders (TRL's name), e.g. "
                                                        "`{enable_thinking: false}` for Qwen3's template without "
                                                        "reasoning.", check=template_variables)
    eval_fraction: float = doc(0.0, "When "
                                    "`eval` is not set: share of the training prompts held out as eval prompts (a seeded shuffle); 0: none.", check=fraction)


@dataclass
class LoraConfig:
    """The `lora:` section: train LoRA adapters (peft) instead of every weight. null in the config: off."""

    r: int = doc(16, "Rank of each adapter's update matrices.", check=positive)
    alpha: float = doc(32.0, "LoRA alpha; the update is scaled by alpha / r (alpha / sqrt(r) with use_rslora).", check=positive)
    dropout: float = doc(0.0, "Dropout on the adapter input. Default 0 (peft's is 0.05): dropout makes the PPO ratio differ from 1 before any update, as model "
                              "dropout does.", check=fraction)
    target_modules: list[str] = doc(factory=lambda: ["all-linear"], help="Module names (or suffixes) that get adapters; `all-linear` is every linear layer "
                                                                         "except the output head.")
    use_dora: bool = doc(False, "Weight-decomposed LoRA (DoRA): adds a trainable magnitude per output feature; slower per step.")
    use_rslora: bool = doc(False, "Rank-stabilised scaling alpha / sqrt(r) instead of alpha / r.")
    value_model_lora: bool = doc(True, "A separate value model (not `value_model: shared`) also trains through its own adapter on a frozen base, its head "
                                       "fully; false trains all its weights.")


@dataclass
class ParallelConfig:
    """The `parallel:` section: how several processes share the models (docs/parallel.md)."""

    strategy: str = doc(DEFAULT_STRATEGY, "`ddp`: every process holds every model whole and gradients are averaged (DistributedDataParallel). `fsdp`: PyTorch "
                                          "FSDP2 shards the trainable roles' weights, gradients and optimiser state over the processes (1/N each), the frozen "
                                          "roles' weights too unless `shard_frozen` is false; checkpoints are sharded (torch.distributed.checkpoint) and "
                                          "final/ is still one plain model. With one process fsdp splits nothing but runs the same code (cpu_offload, bf16 "
                                          "through MixedPrecisionPolicy).", check=one_of(tuple(STRATEGIES)))
    # resume=True: how the models are spread over the processes, not what they compute (all-gathers are exact).
    shard_frozen: bool = doc(True, "With fsdp: shard the reference and reward models too; false keeps a whole copy of each on every process (faster forwards, "
                                   "more memory).", resume=True)
    cpu_offload: bool = doc(False, "With fsdp: keep the sharded weights, gradients and optimiser state in CPU memory (FSDP2 CPUOffloadPolicy) and run the "
                                   "optimiser step on the CPU; each unit is copied to the device when it runs.")
    wrap_classes: list[str] = doc(factory=list, help="With fsdp: class names of the modules sharded one by one (each one all-gather); default the model's "
                                                     "`_no_split_modules` (its decoder layers). Set it for a model that declares none.", resume=True)
    unshard_for_generation: bool = doc(True, "With fsdp: gather the whole policy once per rollout for sampling (costs its full weights on every process while "
                                             "sampling); false gathers layer by layer at every decoded token (least memory, far slower).", resume=True)


def _either(items) -> str:
    """a, b or c."""
    items = list(items)
    return " or ".join([", ".join(items[:-1]), items[-1]] if len(items) > 1 else items)


@dataclass
class _RolloutKeys:
    """The `rollout:` keys of every engine (the engines' own are added from their entries: `RolloutConfig`)."""

    engine: str = doc("hf", f"What samples the responses: {_either(f'`{name}` ({e.about})' for name, e in ENGINES.items())}.", check=one_of(tuple(ENGINES)))
    max_turns: int = doc(1, "Model turns per episode at most: after each turn the `environment` answers (its `step`), until it says done, this many turns, or "
                            "`max_episode_tokens`. 1: one prompt, one response (no environment needed). More than 1 needs `environment`.", check=positive)
    max_episode_tokens: Optional[int] = doc(None, "Token budget of one episode after the prompt: every model turn and every observation (the environment's "
                                                  "answers, rendered) together. An episode that reaches it ends and counts in `rollout/truncated`; an "
                                                  "observation longer "
                                                  "than what is left is cut. null: max_turns x ppo.response_length. Needs `environment`.", check=positive)
    turn_rewards: bool = doc(False, "Place each `step` reward at the last token of the model turn that earned it; false: the episode's summed environment "
                                    "reward at its last model token. Needs `environment`.")
    max_concurrent_episodes: Optional[int] = doc(None, "Episodes in flight at once on each process: each holds its environment instance and, with "
                                                       "rollout.engine: hf, its keys and values between its turns; when one ends the next starts. null: every "
                                                       "episode of the rollout at once. Bounds memory; what veRL-based agent recipes call "
                                                       "`agent.max_concurrent_trajectories` (vLLM's own `max_num_seqs`, the sequences it decodes at once, is "
                                                       "set from the rollout batch). With an environment the episodes are the same under any bound (their "
                                                       "seeds are their own); without one, a bound below the rollout batch samples it in lock-step batches of "
                                                       "that many.", check=positive)
    max_staleness: int = doc(0, "Off-policy rollouts (AReaL's max_head_offpolicyness, veRL's one-step-off-policy at 1): the episodes of updates u+1 ... u+k "
                                "are sampled while update u trains, each trained at most k weight versions after the weights that sampled it, and the loss is "
                                "the decoupled PPO loss (the PPO ratio against the trainer's recomputed logprobs, the engine's corrected by ppo.rollout_is; "
                                "docs/algorithms.md). No episode is sampled ahead across a checkpoint (ppo.save_steps), so a resumed run is the straight run. "
                                "0: sample, train, push, in turn. 1 or more needs an engine beside the trainer (rollout.engine: vllm with rollout.placement: "
                                "separate or servers) and ppo.rollout_is; docs/rollout.md.", check=non_negative)

    dynamic_sampling: bool = doc(False, "DAPO's dynamic sampling (veRL's algorithm.filter_groups, OpenRLHF's --algo.dynamic_filtering): groups whose "
                                        "`dynamic_sampling_metric` has no spread (every sample of the prompt scored the same: zero advantage under a group "
                                        "estimator) are dropped, and further rounds of prompts are sampled until the batch is full, at most "
                                        "`dynamic_sampling_extra_rounds` of them. Needs ppo.num_samples_per_prompt of 2 or more. Logs rollout/groups_kept (the "
                                        "share of sampled groups kept), rollout/rounds and rollout/prompts_consumed; docs/algorithms.md.")
    dynamic_sampling_metric: str = doc("score", "With dynamic_sampling: what must vary within a group for it to be kept: `score` (the combined score the "
                                                "advantages "
                                                "see) or a reward source's name (its raw score, as in `reward/<name>`; veRL's filter_groups.metric).")
    dynamic_sampling_extra_rounds: int = doc(4, "With dynamic_sampling: rounds of prompts (each one update's worth) sampled beyond the first to fill the "
                                                "batch, at most (veRL's filter_groups.max_num_gen_batches is this plus 1).", check=non_negative)
    dynamic_sampling_when_short: str = doc("train", "With dynamic_sampling, when the extra rounds end with the batch still short of groups: `train` trains on "
                                                    "the groups found (the batch's missing groups are left out of the update) and says so; `stop` stops the "
                                                    "run with its last checkpoint (veRL's behaviour).", check=one_of(("train", "stop")))

    def check_combination(self) -> None:
        """Another engine's keys (never read by this one) are refused; the engine's own rules across its keys."""
        for key, owners in ENGINE_KEY_OWNERS.items():
            if self.engine not in owners and differs_from_default(self, key):
                owner = " or ".join(owners)
                raise UserError(f"rollout.{key} ({getattr(self, key)!r}) is for rollout.engine: {owner}, and this run's is "
                                f"{self.engine}, which never reads it; remove it, or set rollout.engine: {owner}")
        if ENGINES[self.engine].check is not None:
            ENGINES[self.engine].check(self)
        if self.max_staleness and not ENGINES[self.engine].beside_training(self):
            where = f"rollout.engine {self.engine}" + (f" with rollout.placement {self.placement}" if self.engine in ENGINE_KEY_OWNERS["placement"] else "")
            raise UserError(f"rollout.max_staleness: {self.max_staleness} samples while the trainer trains, which needs an engine outside the "
                            f"trainer's process (rollout.engine: vllm with rollout.placement: separate or servers), and this run's is {where}; "
                            "set rollout.max_staleness: 0, or rollout.placement")


def _engine_keys() -> tuple[list[tuple[str, Any, Any]], dict[str, tuple[str, ...]]]:
    """The engines' own `rollout:` keys as fields (each help text led by the engines that read it), and
    {key: the engines that read it}. Two engines may share a key only with the same type and default."""
    fields: dict[str, tuple[str, Any, Any]] = {}
    owners: dict[str, tuple[str, ...]] = {}
    for name, engine in ENGINES.items():
        for key, kind, spec in engine.keys:
            if key in fields and (fields[key][1], fields[key][2].default) != (kind, spec.default):
                raise TypeError(f"rollout.{key}: engines {', '.join(owners[key])} and {name} declare it with another type or default")
            fields.setdefault(key, (key, kind, spec))
            owners[key] = owners.get(key, ()) + (name,)
    return [(key, kind, dataclasses.field(default=spec.default, default_factory=spec.default_factory,
                                          metadata={**spec.metadata, "help": f"{', '.join(owners[key])}: {spec.metadata['help']}"}))
            for key, kind, spec in fields.values()], owners


_ENGINE_FIELDS, ENGINE_KEY_OWNERS = _engine_keys()
RolloutConfig = dataclasses.make_dataclass("RolloutConfig", _ENGINE_FIELDS, bases=(_RolloutKeys,), namespace={
    "__doc__": """The `rollout:` section: what samples the episodes (`ppokit.engines`), the turns and token budget of multi-turn
    episodes, and each engine's own keys (declared with it in `ppokit.engines.ENGINES`). The sampling itself (temperature,
    response_length, top_k, ...) stays in `ppo:`, under TRL's names, and means the same with every engine.""",
    "__module__": __name__,
})


AGENT_SPEC = rule("'path/to/agent.py:FUNCTION', 'package.module:FUNCTION' or a mapping {command: ...}",
                  lambda v: isinstance(v, dict) or (bool(v.strip()) and ":" in v and all(part.strip() for part in v.rpartition(":")[::2])))
AGENT_COMMAND_KEYS = ("command",)


def agent_command(agent: Union[str, dict, None]) -> Optional[list[str]]:
    """The program and arguments of `agent: {command: ...}`: a list of strings as written, or a string split into words as
    a POSIX shell splits them (quotes and backslashes; no variables, globs or pipes: nothing runs a shell); None for the
    function form. A UserError naming the key for a mapping with other keys, without `command`, or with an empty one."""
    import shlex

    if not isinstance(agent, dict):
        return None
    unknown = [key for key in agent if key not in AGENT_COMMAND_KEYS]
    if unknown:
        raise UserError(f"agent: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(repr(k) for k in unknown)}; an agent's mapping takes "
                        f"{', '.join(AGENT_COMMAND_KEYS)} (a program run per episode, docs/agents.md)")
    command = agent.get("command")
    if isinstance(command, str):
        try:
            words = shlex.split(command)
        except ValueError as e:
            raise UserError(f"agent.command: {command!r} cannot be split into words: {e}") from None
    elif isinstance(command, list) and all(isinstance(word, (str, int, float)) and not isinstance(word, bool) for word in command):
        words = [str(word) for word in command]
    else:
        raise UserError(f"agent.command: expected a list of strings (the program, then its arguments) or one string split into them as "
                        f"a shell splits words; got {command!r}")
    if not words or not words[0].strip():
        raise UserError(f"agent.command: names no program ({command!r})")
    return words
ENVIRONMENT_SPEC = rule("'path/to/env.py:ClassName' or 'package.module:ClassName' (e.g. ppokit.environments:Tools)",
                        lambda v: bool(v.strip()) and ":" in v and all(part.strip() for part in v.rpartition(":")[::2]))


@dataclass
class PPOConfig:
    """Everything a PPO run needs. Load with `PPOConfig.load(path, overrides)` or build directly."""

    OTHER_NAMES = {**TRL_PPO_NAMES, **TRL_GRPO_NAMES}  # not a field (no annotation): hints for unknown keys (dataclass_config.unknown_keys)
    OTHER_CONFIGS = (OtherConfig(GRPO_ONLY_NAMES, GRPO_ADVICE),)  # not a field: what a TRL GRPO config needs besides its keys

    model: Optional[str] = doc(None, "Policy to start from (local path or hub id), usually an SFT model.")
    ref_model: Optional[str] = doc(None, "Frozen reference policy; default a frozen copy of `model`.")
    value_model: Optional[str] = doc(None, "Value model (sequence-classification path or id); default the policy's backbone with a fresh scalar head, or the "
                                           "reward model's weights if `reward.model` is set. Two special values: `shared` (needs `lora`) is a second LoRA "
                                           "adapter plus a scalar head on the policy's own frozen base, so policy, reference and critic hold one copy of the "
                                           "base weights; `from_reward` starts the critic from the reward model loaded once (with `lora`, the critic is an "
                                           "adapter on the reward model's own weights, and scoring runs with that adapter disabled).")
    tokenizer: Optional[str] = doc(None, "Tokenizer path or id; default the one saved with `model`.")
    teacher: Optional[str] = doc(None, "On-policy distillation (docs/algorithms.md): a saved causal LM (a folder, or an id as `ref_model`) with the policy's "
                                       "tokenizer, frozen, that scores every sampled token as the reference does; each token's reward gets -`teacher_coef` x "
                                       "(log pi_student - log pi_teacher), the negative per-token reverse KL, placed as the KL penalty is (gae and the "
                                       "critic-free estimators alike), logged as `teacher/kl`. Alone (no reward source needed) or beside the reward sources. A "
                                       "teacher whose vocabulary differs is refused at start-up. null: off.")
    teacher_coef: float = doc(1.0, "With `teacher`: the weight of the per-token reverse KL to the teacher in the reward, against the reward sources' score "
                                   "(weighted by reward.weights).", check=positive)
    # resume=True: whether remote code may run and where the run is written change no number.
    trust_remote_code: bool = doc(False, "Allow model repositories to run their own Python code.", resume=True)
    output_dir: str = doc("runs/ppo", "Run directory: config.yaml, metrics.jsonl, samples.jsonl, final/.", check=a_path, resume=True)
    seed: int = doc(42, "Seed for sampling, data order and initialisation; same seed and config give the same metrics.", check=seed_range)
    reward: RewardConfig = doc(factory=RewardConfig, help="Reward sources.")
    data: DataConfig = doc(factory=DataConfig, help="Prompt data.")
    ppo: PPOHyperparams = doc(factory=PPOHyperparams, help="PPO hyperparameters.")
    rollout: RolloutConfig = doc(factory=RolloutConfig, help="How episodes are sampled: the rollout engine, and the turns and token budget of multi-turn "
                                                             "episodes.")
    lora: Optional[LoraConfig] = doc(None, "LoRA adapters for the policy (and the critic); null trains all weights. With it, the reference is the policy's "
                                           "base with the adapter disabled: no second copy of the weights. `lora: {}` takes every default.")
    quantization: Optional[str] = doc(None, "Load every frozen base (policy/reference, LoRA critic, reward model) quantised with bitsandbytes: `4bit` (NF4, "
                                            "double quantisation) "
                                            "or `8bit`; needs `lora` and a CUDA device. null: the checkpoint's dtype.", check=one_of(("4bit", "8bit")))
    gradient_checkpointing: bool = doc(False, "Recompute each layer's activations in the backward pass instead of storing them: about one extra forward per "
                                              "step, activation memory from per-layer to per-model-input.")
    bf16: bool = doc(False, "bfloat16 mixed precision (autocast through accelerate) for every forward: sampling, reference, value and training. Weights and "
                            "optimiser state keep the checkpoint's dtype.")
    fp16: bool = doc(False, "float16 mixed precision with loss scaling (accelerate); needs a CUDA device and float32 trainable weights. Prefer bf16 where the "
                            "hardware has it.")
    save_merged: bool = doc(False, "With `lora`: also write final/merged/, the policy with its adapter merged in, loadable by "
                                   "AutoModelForCausalLM.from_pretrained without peft.")
    # resume=True: the speed switches change numbers only within float rounding (docs/speed.md), as another machine's
    # kernels do: a resume may turn them on or off (an OOM, a machine without a compiler). A bit-for-bit equal
    # continuation needs the same values.
    lm_head_chunk_size: Optional[int] = doc(None, "Memory-light LM head: logprobs and entropy of the response tokens are computed this many tokens at a time, "
                                                  "only at real response tokens (padding skipped), and recomputed in the backward pass, so the full (rows, "
                                                  "response, vocabulary) float32 log-softmax is never held; every logprob pass (reference, training) uses it. "
                                                  "Equal to the direct computation within float rounding; checked once against the model's own forward. Memory "
                                                  "per chunk: about 4 x chunk x vocabulary x 4 bytes. null: the direct computation over the whole micro-batch "
                                                  "(TRL).", check=positive, resume=True)
    compile: bool = doc(False, "torch.compile (inductor) the policy and value backbones for the training forward and backward; sampling and the no-gradient "
                               "passes stay eager. Equal to eager within float rounding, under parallel.strategy fsdp too (there the compiled backbone "
                               "runs inside the causal LM's own forward, which gathers its tied embeddings and head). The first training pass pays the "
                               "compile time (about 20-60 s on a CPU, docs/speed.md); worth it for runs of more than a few minutes. An error at start where "
                               "torch.compile cannot run on this machine.", resume=True)
    matmul_backend: str = doc("aten", "The float32 matrix products of every nn.Linear of the run's models (policy, reference, critic, reward model; "
                                      "sampling, scoring and training): aten (torch's F.linear: MKL's sgemm on a CPU) or onednn (oneDNN's kernel, "
                                      "torch.ops.mkldnn._linear_pointwise, where gradients flow: training's forward and backward; the passes without "
                                      "gradients, sampling and scoring, stay on F.linear). Equal within float rounding; onednn is faster on "
                                      "some CPUs (1.2-1.6x per product on an AVX-512 EPYC, docs/speed.md); with compile: true the compiled training "
                                      "forward and backward call the same oneDNN products. onednn: CPU runs in float32 only (refused with a CUDA "
                                      "device, bf16, fp16, quantization or parallel.strategy fsdp).",
                              check=one_of(("aten", "onednn")), resume=True)
    cpu_allocator: Optional[str] = doc(None, "The malloc that serves the process's memory (its CPU tensors included): null, the C library's (glibc's on "
                                             "Linux), or tcmalloc (gperftools', preloaded: the ppokit program starts itself again with LD_PRELOAD; "
                                             "Debian/Ubuntu: apt-get install libtcmalloc-minimal4). Changes no number; glibc keeps freed memory that "
                                             "tcmalloc reuses: on the variable-shape benchmark ~175 MB less peak RSS at the same speed, under 1000 MiB "
                                             "with gradient_checkpointing (docs/speed.md). Linux only; an error at start where the library is not "
                                             "installed. From Python (or ppokit pipeline), start the interpreter with the library in LD_PRELOAD.",
                                       check=one_of(("tcmalloc",)), resume=True)
    parallel: ParallelConfig = doc(factory=ParallelConfig, help="Several processes: data parallel (ddp) or sharded (fsdp).")
    environment: Optional[str] = doc(None, "What answers the model in multi-turn episodes: a class `path/to/env.py:ClassName` or `package.module:ClassName` "
                                           "with reset(row) and step(completion) (docs/environments.md); built-ins `ppokit.environments:Tools` (tool calls) "
                                           "and `ppokit.environments:GuessNumber` (the demo game). One instance per episode. Its step rewards, summed, are a "
                                           "reward source (`reward/environment`), the last in `reward.weights` order. null: no environment, one response per "
                                           "prompt. Its code runs in the trainer's process.", check=ENVIRONMENT_SPEC)
    environment_args: dict = doc(factory=dict, help="Keyword arguments of the environment's constructor, e.g. `{tools: [\"tools.py:add\"]}` for "
                                                    "ppokit.environments:Tools.")
    environment_timeout_s: Optional[float] = doc(60.0, "Deadline in seconds for one call of the environment's code (constructing and reset, one step): it runs "
                                                       "in a worker thread, and a call that has not returned by then fails its episode (`reward.on_error` "
                                                       "applies: skip the episode or stop the run). null: call it in the main thread without a limit. At most "
                                                       "threading.TIMEOUT_MAX.", check=timeout_range)
    agent: Union[str, dict, None] = doc(None, "An agent program trained as it is: a function `path/to/agent.py:FUNCTION` (or `package.module:FUNCTION`), "
                                              "called as FUNCTION(row, base_url) for each episode (sync or `async def`) with an OpenAI-compatible endpoint "
                                              "serving that episode (`base_url` ends in /v1; any API key); it returns the episode's reward, a number or a "
                                              "dict with one under `reward` (its other numbers are logged as `agent/<key>`). Or a program in any language, "
                                              "`{command: [program, arg, ...]}` (or one string, split as a shell splits words, without a shell), run once per "
                                              "episode with OPENAI_BASE_URL and OPENAI_API_KEY in its environment and the row as one JSON line on stdin; the "
                                              "last line of its stdout is the reward, a number or a JSON object as above. Its calls are recorded token for "
                                              "token and trained (docs/agents.md). The reward is a reward source (`reward/agent`), the last in "
                                              "`reward.weights` order. Exclusive with `environment`. null: no agent.", check=AGENT_SPEC)
    agent_timeout_s: float = doc(600.0, "Deadline in seconds for one episode's agent run (FUNCTION(row, base_url) from its call to its return; a command from "
                                        "its start to its exit): an agent still running then fails its episode (`reward.on_error` applies), its URL is closed "
                                        "and a command's process group is killed. Needs `agent`.", check=timeout_range)
    agent_call_timeout_s: float = doc(600.0, "Deadline in seconds for the endpoint to answer one call of an agent (the engine's sampling of it): a call not "
                                             "answered by then fails its episode. Needs `agent`.", check=timeout_range)
    agent_tool_parser: str = doc("auto", "How an agent's tool calls are read from the model's text and returned as OpenAI `tool_calls`: a format by vLLM's "
                                         "--tool-call-parser name (hermes, qwen3_coder, llama3_json, pythonic, mistral, openai) or `auto` (the one the chat "
                                         "template writes; docs/environments.md). Needs `agent`.", check=one_of(PARSER_NAMES))
    # Where the numbers also go (docs/report.md). None of these changes a number of the run (resume=True).
    report_to: list[str] = doc(factory=list, help="Experiment trackers that also get every metric, the config and the sample tables: any of "
                                                  f"{', '.join(TRACKERS)} (each needs its extra, `pip install \"ppokit[NAME]\"`, or `[trackers]` for all). "
                                                  "Default none: a run needs no extra package and no network, and metrics.jsonl plus `ppokit report` always "
                                                  "work.", resume=True)
    run_name: Optional[str] = doc(None, "Run name in the trackers; default the output folder's name and the start time (e.g. ppo-20250101-120000), kept when "
                                        "the run resumes.", check=folder_name, resume=True)
    project: str = doc("ppokit", "W&B and trackio project, MLflow experiment.", resume=True)
    mlflow_tracking_uri: Optional[str] = doc(None, "MLflow tracking URI (a server, `sqlite:///mlflow.db`, a folder); default MLFLOW_TRACKING_URI when set, "
                                                   "else a local file store in <output_dir>/mlruns.", resume=True)

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | None = None) -> "PPOConfig":
        return load_config(cls, path, overrides)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        """config.yaml: every key, but the ppo keys this run never read (`PPOHyperparams.unread_keys`), which a run
        has at their defaults (set otherwise, it is refused): left out of the `ppo:` section, so that it says what
        trained, and named at the end in a comment with their values and what would read them. Loading the file
        gives them those defaults again, so it loads back as the same config (a resume compares them so)."""
        data = self.to_dict()
        unread = {key: why for key, why in self.ppo.unread_keys().items() if not differs_from_default(self.ppo, key)}
        for key in unread:
            del data["ppo"][key]
        lines = yaml.safe_dump(data, sort_keys=False).splitlines(keepends=True)
        if unread:
            end = next(i for i in range(lines.index("ppo:\n") + 1, len(lines) + 1) if i == len(lines) or not lines[i].startswith(" "))
            lines[end:end] = (["  # Not read by this run, so left out here; a config loaded from this file has them at these defaults:\n"]
                              + [f"  #   {key}: {json.dumps(getattr(self.ppo, key))}  (for {why})\n" for key, why in unread.items()])
        Path(path).write_text("".join(lines))

    def validate(self, *, model_given: bool = False, reward_model_given: bool = False) -> "PPOConfig":
        """Check every key and the rules across keys. model_given / reward_model_given: the trainer
        was passed the policy / the reward model as an object, in place of `model` / `reward.model`."""
        validate(self)
        if not self.model and not model_given:
            raise UserError("model: required (a path to a saved causal LM or a hub id)")
        has_reward_model = self._has_reward_model(reward_model_given)
        has_environment = self.episodes_answered  # an environment or an agent: each is a reward source
        if not has_reward_model and not self.reward.functions and self.reward.remote is None and not has_environment and self.teacher is None:
            raise UserError("reward: set at least one source, reward.model, reward.functions or reward.remote (or an environment, an agent, or a teacher)")
        if self.teacher is None and differs_from_default(self, "teacher_coef"):
            raise UserError(f"teacher_coef ({self.teacher_coef}) weighs the reverse KL to a teacher, and `teacher` is not set; set teacher "
                            "(a saved model with the policy's tokenizer) or remove teacher_coef")
        n_sources = int(has_reward_model) + len(self.reward.functions) + int(self.reward.remote is not None) + int(has_environment)
        if self.reward.weights is not None and len(self.reward.weights) != n_sources:
            raise UserError(f"reward.weights has {len(self.reward.weights)} entries for {n_sources} reward sources")
        self.reward.check_combination(n_sources)
        self.ppo.check_combination()
        self.rollout.check_combination()
        self._validate_off_policy()
        self._validate_dynamic_sampling()
        self._validate_estimator_roles()
        if self.ppo.mask_truncated_completions and self.ppo.stop_token is None and self.ppo.stop_token_id is None and not has_environment:
            # Without a stop token (or an environment to end episodes) no response ends by itself: every one would leave the loss.
            raise UserError("ppo.mask_truncated_completions needs a stop token: without one every response is truncated and none "
                            "would be trained on; set ppo.stop_token (e.g. eos) or ppo.stop_token_id, or drop the key")
        if self.ppo.missing_eos_penalty is not None and self.ppo.stop_token is None and self.ppo.stop_token_id is None:
            # Without a stop token no response "misses" it: the penalty would never apply.
            raise UserError("ppo.missing_eos_penalty needs a stop token; set ppo.stop_token (e.g. eos) or ppo.stop_token_id, or drop the penalty")
        if self.data.eval and self.data.eval_fraction:
            raise UserError("data.eval_fraction holds out training prompts for evaluation, but data.eval is set too; set one of them")
        self._validate_memory_switches(reward_model_given)
        check_engine_lora(self.rollout, self.lora, self.quantization)
        self._validate_environment()
        self._validate_parallel()
        self._validate_report_to()
        return self

    @property
    def response_room(self) -> int:
        """Tokens after the prompt an episode may take: ppo.response_length for one response; with an environment
        rollout.max_episode_tokens (default max_turns x response_length). What the budget and position checks read."""
        if not self.episodes_answered:
            return self.ppo.response_length
        rollout = self.rollout
        return rollout.max_episode_tokens if rollout.max_episode_tokens is not None else rollout.max_turns * self.ppo.response_length

    @property
    def episodes_answered(self) -> bool:
        """Whether the episodes are multi-turn: an `environment` answers the model's turns, or an `agent` program makes
        the calls (each is a reward source, the last in reward.weights order)."""
        return self.environment is not None or self.agent is not None

    @property
    def turn_weight(self) -> Optional[float]:
        """The environment's weight in reward.weights (the last) when its step rewards are placed per turn
        (rollout.turn_rewards: `experience.rewards`), else None."""
        if not self.rollout.turn_rewards:
            return None
        return float(self.reward.weights[-1]) if self.reward.weights is not None else 1.0

    def _validate_environment(self) -> None:
        """Keys of multi-turn episodes set without an environment would never be read: refused. Turn rewards move the
        environment's part of the score to its turns, which is exact only while the score is a plain weighted sum. An
        agent's keys likewise need `agent`, which excludes `environment`."""
        agent_command(self.agent)  # a command's mapping: its keys and its words
        if self.agent is not None and self.environment is not None:
            raise UserError(f"agent ({self.agent!r}) and environment ({self.environment!r}) are both set; an episode is answered by "
                            "an environment or made by an agent program: set one of them")
        if self.agent is None:
            for key in ("agent_timeout_s", "agent_call_timeout_s", "agent_tool_parser"):
                if differs_from_default(self, key):
                    raise UserError(f"{key} ({getattr(self, key)!r}) is for an agent program, and `agent` is not set; set agent, or remove {key}")
        else:
            for key in ("environment_args", "environment_timeout_s"):
                if differs_from_default(self, key):
                    raise UserError(f"{key} ({getattr(self, key)!r}) is for an environment, and an `agent` makes the episodes; remove {key}")
        if self.episodes_answered:
            reward = self.reward
            normalize = reward.normalize[-1] if isinstance(reward.normalize, list) else reward.normalize
            if self.rollout.turn_rewards and (normalize or reward.clip_range is not None):
                which = "reward.normalize on the environment" if normalize else "reward.clip_range"
                raise UserError(f"rollout.turn_rewards places each step reward at its turn, which needs the score to be a plain weighted "
                                f"sum; {which} changes it as a whole; turn one of them off")
            return
        needs = [("environment_args", self, "environment_args"), ("environment_timeout_s", self, "environment_timeout_s"),
                 ("rollout.max_episode_tokens", self.rollout, "max_episode_tokens"), ("rollout.turn_rewards", self.rollout, "turn_rewards")]
        for name, section, key in needs:
            if differs_from_default(section, key):
                raise UserError(f"{name} ({getattr(section, key)!r}) is for multi-turn episodes, and `environment` is not set; set environment, or remove "
                                f"{name}")
        if self.rollout.max_turns > 1:
            raise UserError(f"rollout.max_turns ({self.rollout.max_turns}): a second turn needs an environment to answer the first; set `environment` "
                            "(docs/environments.md), or rollout.max_turns: 1")

    def _validate_off_policy(self) -> None:
        """rollout.max_staleness >= 1: the behaviour policy corrected (ppo.rollout_is), no greedy baseline sampled mid-update."""
        k = self.rollout.max_staleness
        if k and self.ppo.rollout_is is None:
            raise UserError(f"rollout.max_staleness: {k} trains on episodes sampled by older weights, which the decoupled PPO loss corrects "
                            "with ppo.rollout_is; set ppo.rollout_is: tis (AReaL's behaviour weights, docs/algorithms.md) or tis_sequence")
        if k and self.ppo.estimator.greedy_baseline:
            raise UserError(f"ppo.advantage_estimator {self.ppo.advantage_estimator} samples a greedy baseline with the current weights "
                            f"during the update, which rollout.max_staleness: {k} does not; use another estimator or rollout.max_staleness: 0")

    def _validate_dynamic_sampling(self) -> None:
        """rollout.dynamic_sampling filters groups, which needs groups; its own keys are read only with it on."""
        rollout = self.rollout
        if not rollout.dynamic_sampling:
            for key in ("dynamic_sampling_metric", "dynamic_sampling_extra_rounds", "dynamic_sampling_when_short"):
                if differs_from_default(rollout, key):
                    raise UserError(f"rollout.{key} ({getattr(rollout, key)!r}) is read only with rollout.dynamic_sampling: true; set it, or remove the key")
        elif self.ppo.num_samples_per_prompt < 2:
            raise UserError(f"rollout.dynamic_sampling drops the groups of samples of one prompt whose score has no spread, and "
                            f"ppo.num_samples_per_prompt is {self.ppo.num_samples_per_prompt} (no groups); set it to 2 or more")

    def _validate_estimator_roles(self) -> None:
        """A critic-free estimator builds no value model: settings for one would be ignored, so they are refused."""
        estimator = self.ppo.advantage_estimator
        if self.ppo.estimator.critic:
            return
        if self.value_model is not None:
            raise UserError(f"value_model: ppo.advantage_estimator {estimator} builds no value model; remove value_model ({self.value_model!r})")
        if self.lora is not None and not self.lora.value_model_lora:
            raise UserError(f"lora.value_model_lora: ppo.advantage_estimator {estimator} builds no value model; remove the key")

    def _validate_parallel(self) -> None:
        """Switches the strategy cannot combine with (strategies.STRATEGIES), and another strategy's keys (never read by this one)."""
        name = self.parallel.strategy
        facts = STRATEGIES[name]
        for key in (k for other in STRATEGIES.values() for k in other.keys if k not in facts.keys):
            if differs_from_default(self.parallel, key):
                readers = " or ".join(s.name for s in STRATEGIES.values() if key in s.keys)
                raise UserError(
                    f"parallel.{key} ({getattr(self.parallel, key)!r}) is for parallel.strategy: {readers}, and this run's is "
                    f"{name}, which never reads it; remove it, or set parallel.strategy: {readers}"
                )
        if self.quantization is not None and not facts.holds_quantized:
            raise UserError(f"parallel.strategy: {name} cannot shard quantised ({self.quantization}) weights; use quantization: null, or parallel.strategy: "
                            f"{DEFAULT_STRATEGY}")
        if self.fp16 and facts.own_mixed_precision:
            raise UserError(f"parallel.strategy: {name} runs mixed precision as bf16 ({facts.own_mixed_precision}); set bf16: true instead of fp16")
        if self.ppo.shared_prompt and self.compile:
            raise UserError("ppo.shared_prompt with compile: the compiled backbone is not checked with a 4-D attention mask yet; turn one of them off")

    def _validate_report_to(self) -> None:
        for name in self.report_to:
            if name not in TRACKERS:
                close = difflib.get_close_matches(str(name), TRACKERS, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise UserError(f"report_to: unknown tracker {name!r}{hint}; known: {', '.join(TRACKERS)}")
        if len(set(self.report_to)) != len(self.report_to):
            raise UserError(f"report_to: a tracker is listed twice: {self.report_to}")

    def _has_reward_model(self, reward_model_given: bool) -> bool:
        return bool(self.reward.model) or reward_model_given

    def _validate_memory_switches(self, reward_model_given: bool) -> None:
        """Combinations of lora / value_model / quantization / precision that cannot work (reward_model_given: `validate`'s)."""
        has_reward_model = self._has_reward_model(reward_model_given)
        if self.bf16 and self.fp16:
            raise UserError("bf16 and fp16 are both true; choose one mixed precision")
        onednn_clash = "bf16" if self.bf16 else "fp16" if self.fp16 else "quantization" if self.quantization else None
        if self.matmul_backend == "onednn" and onednn_clash:
            raise UserError(f"matmul_backend: onednn runs float32 products; it does not go with {onednn_clash} (set one of them off)")
        if self.value_model == "shared" and self.lora is None:
            raise UserError("value_model: shared puts the critic's adapter on the policy's LoRA base; set `lora` (e.g. `lora: {}`)")
        if self.value_model == "from_reward" and not has_reward_model:
            raise UserError("value_model: from_reward needs reward.model")
        if self.quantization is not None and self.lora is None:
            raise UserError(f"quantization: {self.quantization} freezes the base weights, so only adapters can train; set `lora`")
        critic_from_frozen = self.value_model in (None, "from_reward") and self.lora is not None and not self.lora.value_model_lora
        if self.quantization is not None and critic_from_frozen and has_reward_model:
            raise UserError("quantization with lora.value_model_lora: false would train a full critic copied from the quantised reward model; set "
                            "lora.value_model_lora: true or value_model to a path")
        if self.save_merged and self.lora is None:
            raise UserError("save_merged: true merges a LoRA adapter into its base; without `lora` final/ already holds the full policy")
        if self.save_merged and self.quantization is not None:
            raise UserError("save_merged: true with quantization would merge into a quantised base (lossy); save the adapter and merge it into the "
                            "full-precision base with ppokit.models.roles.merge_adapter")
