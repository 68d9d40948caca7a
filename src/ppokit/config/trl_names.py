"""TRL's GRPOConfig names, and what each is in ppokit: the hints of an unknown key (`PPOConfig.OTHER_NAMES`).

A TRL GRPO user writes `num_generations: 8`, `beta: 0.04`, `loss_type: dr_grpo`; ppokit answers with the exact key
and value that does the same (`ppo.num_samples_per_prompt: 8`), or says that it has none, instead of the closest
spelling among its own keys (which pointed `epsilon` at `ppo.adam_epsilon`). Names are not accepted as aliases (one
spelling per key keeps config.yaml, overrides and the resume check on one name); names that ppokit spells the same
in one of its sections (`temperature`, `learning_rate`, `mask_truncated_completions`) are found there by the generic
hint ("did you mean ppo.temperature?"). docs/trl.md has the table; tests/test_config.py applies every suggestion.

Facts from TRL 1.16 (`trl/trainer/grpo_config.py`, `grpo_trainer.py`): the loss types' normalisations
(grpo: a mean per sequence, then over the micro-batch's sequences; bnpo: the micro-batch's tokens; dr_grpo: the
micro-batch's sequences x max_completion_length; dapo (its default): the tokens of the whole optimiser step's batch
over every process), the per-token KL beta * k3 in the loss, scale_rewards (group, batch, none).
This module imports nothing from ppokit (schema.py imports it).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Union


class Equivalent(NamedTuple):
    """The ppokit settings that do what a TRL setting does: (dotted key, value) pairs, and a remark. No settings: what
    the TRL setting asks is what ppokit always does. `implied`: the keys among the settings that the TRL setting only
    needs (rollout.engine: vllm for a vLLM option): another TRL key that sets one of them explicitly decides it
    (`ppokit.config.from_trl`)."""

    settings: tuple[tuple[str, Any], ...]
    note: str = ""
    implied: tuple[str, ...] = ()


Said = Union[Equivalent, str]  # a str: ppokit has no equivalent, and why or what instead


def yaml_value(value: Any) -> str:
    """A value as the user would write it in YAML (true, null, 0.04, [1.0, 0.5])."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def describe(said: Said) -> str:
    """The hint's text: `TRL's GRPO name; ppokit's is KEY: VALUE[ with KEY: VALUE][; note]`."""
    if isinstance(said, str):
        return f"TRL's GRPO name; {said}"
    if not said.settings:
        return f"TRL's GRPO name; {said.note}; remove the key"
    settings = " with ".join(f"{key}: {yaml_value(value)}" for key, value in said.settings)
    return f"TRL's GRPO name; ppokit's is {settings}" + (f"; {said.note}" if said.note else "")


def same(key: str, note: str = "") -> Callable[[Any], Said]:
    """A TRL key whose value carries over unchanged to ppokit's `key`."""
    return lambda value: Equivalent(((key, value),), note)


def with_engine(key: str, engine_note: str = "") -> Callable[[Any], Said]:
    """A vLLM key of TRL: ppokit's rollout key, which needs rollout.engine: vllm."""
    return lambda value: Equivalent((("rollout.engine", "vllm"), (key, value)), engine_note, implied=("rollout.engine",))


def always(note: str, when: Any) -> Callable[[Any], Said]:
    """A TRL key whose value `when` asks what ppokit always does (`note`: what); another value has no equivalent."""
    return lambda value: (Equivalent((), note) if value == when
                          else f"{NO_EQUIVALENT} of {yaml_value(value)}: {note}")


SERVERS = "rollout.servers: [HOST:PORT] with rollout.engine: vllm and rollout.placement: servers (servers you start: docs/rollout.md)"


def server_address(host: Any = "0.0.0.0", port: Any = 8000) -> str:
    """rollout.servers' entry for TRL's vllm_server_host and vllm_server_port (TRL's defaults 0.0.0.0 and 8000): the
    address the trainer connects to, so TRL's listening-on-every-interface host is read as this machine."""
    return f"{'127.0.0.1' if str(host) == '0.0.0.0' else host}:{port}"


def server_url_address(url: Any) -> Said:
    """TRL's vllm_server_base_url (http://HOST:PORT) as rollout.servers' entry."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(str(url))
        port = parts.port
    except ValueError:
        parts, port = None, None
    if parts is None or not parts.hostname or port is None or parts.path.strip("/"):
        return f"ppokit's is {SERVERS}; {yaml_value(url)} is no http://HOST:PORT"
    return Equivalent((("rollout.engine", "vllm"), ("rollout.placement", "servers"), ("rollout.servers", [f"{parts.hostname}:{port}"])),
                      implied=("rollout.engine",))


def _beta(value: Any) -> Said:
    if value == 0:
        return Equivalent((("ppo.kl_in_reward", False),), "no KL term anywhere, as TRL's beta: 0; ppo.kl_loss_coef stays 0")
    return Equivalent((("ppo.kl_in_reward", False), ("ppo.kl_loss_coef", value)),
                      "the k3 KL in the loss (ppo.kl_loss_estimator's default), as TRL's, which by default also multiplies "
                      "it by the policy ratio (use_bias_correction_kl)")


def _by_value(table: dict, name: str) -> Callable[[Any], Said]:
    """A TRL key whose values each map to their own ppokit settings (`table`: value -> Said)."""

    def said(value: Any) -> Said:
        try:
            found = table.get(value)
        except TypeError:  # an unhashable value (a list)
            found = None
        if found is None:
            return f"ppokit knows the values {', '.join(yaml_value(v) for v in table)} of {name}, not {yaml_value(value)}"
        return found

    return said


LOSS_TYPES: dict[str, Said] = {
    "grpo": Equivalent((("ppo.loss_aggregation", "seq_mean_token_mean"),),
                       "each sequence's mean, then the mean over each micro-batch's sequences, as TRL's"),
    "bnpo": Equivalent((("ppo.loss_aggregation", "token_mean"),),
                       "ppokit's default: a mean over each micro-batch's tokens, as TRL's"),
    "dr_grpo": Equivalent((("ppo.loss_aggregation", "seq_mean_token_sum_norm"),),
                          "a sum over each micro-batch's tokens / (its sequences x ppo.response_length), TRL's "
                          "max_completion_length"),
    "dapo": Equivalent((("ppo.loss_aggregation", "token_mean"),),
                       "normalised over the tokens of a whole optimiser step on every process, as dapo, once "
                       "ppo.max_tokens_per_micro_batch sets a token budget (docs/speed.md), else over each micro-batch's "
                       "own (TRL's bnpo)"),
    "cispo": "ppokit has no equivalent of loss_type: cispo (it clips the ratio in a REINFORCE loss)",
    "sapo": "ppokit has no equivalent of loss_type: sapo (a soft gate in place of the clip)",
    "luspo": "ppokit has no equivalent of loss_type: luspo (each sequence's loss times its length)",
    "vespo": "ppokit has no equivalent of loss_type: vespo (a Gamma weighting of sequence ratios)",
}

SCALE_REWARDS: dict[Any, Said] = {
    "group": Equivalent((("ppo.grpo_scale_std", True),), "ppokit's default"),
    True: Equivalent((("ppo.grpo_scale_std", True),), "ppokit's default"),
    "batch": Equivalent((("ppo.grpo_scale_std", "batch"),), "the group's mean over the whole batch's standard deviation"),
    "none": Equivalent((("ppo.grpo_scale_std", False),), "Dr. GRPO's r - mean"),
    False: Equivalent((("ppo.grpo_scale_std", False),), "Dr. GRPO's r - mean"),
}

NO_EQUIVALENT = "ppokit has no equivalent"

TRL_GRPO_EQUIVALENTS: dict[str, Callable[[Any], Said]] = {
    # the algorithm
    "num_generations": same("ppo.num_samples_per_prompt", "TRL's default is 8, ppokit's 1"),
    "num_generations_eval": same("ppo.eval_samples_per_prompt", "TRL's unset default is num_generations, ppokit's 1; "
                                 "ppo.eval_pass_at_k adds pass@k"),
    "max_completion_length": same("ppo.response_length"),
    "num_iterations": same("ppo.num_ppo_epochs", "TRL's default is 1, ppokit's 4"),
    "beta": _beta,
    "epsilon": same("ppo.cliprange", "both bounds unless ppo.cliprange_high is set"),
    "epsilon_high": same("ppo.cliprange_high"),
    "delta": same("ppo.dual_clip_c", "the same loss where delta > 1 + epsilon_high, as TRL advises"),
    "loss_type": _by_value(LOSS_TYPES, "loss_type"),
    "scale_rewards": _by_value(SCALE_REWARDS, "scale_rewards"),
    "reward_weights": same("reward.weights"),
    "multi_objective_aggregation": _by_value({
        "sum_then_normalize": "ppokit's way: the estimator normalises the sum of the sources' weighted scores; remove the key",
        "normalize_then_sum": f"{NO_EQUIVALENT} of normalize_then_sum (reward.normalize standardises each source by its "
                              "running statistics, not within each group)",
    }, "multi_objective_aggregation"),
    "max_tool_calling_iterations": lambda value: (
        Equivalent((("rollout.max_turns", value + 1),), "model turns: the first and one after each tool call; "
                   "with environment: ppokit.environments:Tools")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0
        else "ppokit's is rollout.max_turns, model turns: the first and one after each tool call"),
    # batches
    "steps_per_generation": lambda value: "ppokit's rollout batch per process is per_device_train_batch_size x "
                                          "gradient_accumulation_steps x num_mini_batches: steps_per_generation / "
                                          "gradient_accumulation_steps is ppo.num_mini_batches",
    "generation_batch_size": lambda value: "ppokit derives it: per_device_train_batch_size x gradient_accumulation_steps x "
                                           "num_mini_batches x processes (set ppo.num_mini_batches)",
    "max_steps": lambda value: "ppokit counts episodes: ppo.total_episodes = max_steps x per_device_train_batch_size x "
                               "gradient_accumulation_steps x processes (one optimiser step per rollout)",
    # vLLM
    "use_vllm": lambda value: Equivalent((("rollout.engine", "vllm" if value else "hf"),)),
    "vllm_mode": _by_value({
        "colocate": Equivalent((("rollout.engine", "vllm"),), "an engine in the trainer's process, as TRL's colocate"),
        "server": Equivalent((("rollout.engine", "vllm"), ("rollout.placement", "servers")),
                             "with rollout.servers: [HOST:PORT], TRL's vllm_server_host and vllm_server_port (docs/rollout.md)",
                             implied=("rollout.engine",)),
    }, "vllm_mode"),
    "vllm_server_host": lambda value: f"ppokit's is {SERVERS}: HOST is vllm_server_host, PORT vllm_server_port",
    "vllm_server_port": lambda value: f"ppokit's is {SERVERS}: HOST is vllm_server_host, PORT vllm_server_port",
    "vllm_server_base_url": server_url_address,
    "vllm_server_timeout": lambda value: Equivalent(
        (("rollout.engine", "vllm"), ("rollout.placement", "servers"), ("rollout.server_timeout_s", value)),
        "the longest wait for a server: its start, one request, one weight push", implied=("rollout.engine", "rollout.placement")),
    "vllm_group_port": lambda value: f"{NO_EQUIVALENT}: ppokit's weight-transfer group takes a free port",
    "vllm_gpu_memory_utilization": with_engine("rollout.gpu_memory_utilization"),
    "vllm_tensor_parallel_size": with_engine("rollout.tensor_parallel_size"),
    "vllm_max_model_length": with_engine("rollout.max_model_len"),
    "vllm_enable_sleep_mode": with_engine("rollout.sleep"),
    "vllm_importance_sampling_correction": lambda value: (
        Equivalent((("ppo.rollout_is", "tis"),), "per-token truncated weights, TRL's token_truncate; TRL 1.16's default "
                   "mode, sequence_mask, ppokit lacks", implied=("ppo.rollout_is",)) if value else Equivalent((("ppo.rollout_is", None),), "ppokit's default")),
    "vllm_importance_sampling_mode": _by_value({
        "token_truncate": Equivalent((("ppo.rollout_is", "tis"),)),
        "token_mask": f"{NO_EQUIVALENT} of token_mask (ppo.rollout_is: tis truncates the weights, token_truncate)",
        "sequence_truncate": Equivalent((("ppo.rollout_is", "tis_sequence"),), "the whole response's probability ratio, truncated"),
        "sequence_mask": f"{NO_EQUIVALENT} of sequence_mask (ppo.rollout_is: tis_sequence truncates the response's weight, "
                         "sequence_truncate)",
    }, "vllm_importance_sampling_mode"),
    "vllm_importance_sampling_clip_max": lambda value: Equivalent((("ppo.rollout_is", "tis"), ("ppo.rollout_is_cap", value)),
                                                                  implied=("ppo.rollout_is",)),
    "vllm_importance_sampling_cap": lambda value: Equivalent((("ppo.rollout_is", "tis"), ("ppo.rollout_is_cap", value)),
                                                             implied=("ppo.rollout_is",)),
    "vllm_importance_sampling_clip_min": lambda value: Equivalent((("ppo.rollout_is", "tis"), ("ppo.rollout_is_floor", value)),
                                                                  implied=("ppo.rollout_is",)),
    "ds3_gather_for_generation": lambda value: Equivalent(
        (("parallel.strategy", "fsdp"), ("parallel.unshard_for_generation", value)), "ppokit shards with FSDP2, not DeepSpeed"),
    # what ppokit always does
    "disable_dropout": always("ppokit always zeroes every dropout probability, in every role", True),
    "remove_unused_columns": always("ppokit passes every data column to the reward functions (TRL's false)", False),
    "shuffle_dataset": always("ppokit's prompt order is always a shuffle by `seed`", True),
    "log_completions": lambda value: Equivalent((), "ppokit writes sample completions to samples.jsonl "
                                                    "ppo.num_sample_generations times over the run"),
    "model_init_kwargs": lambda value: "ppokit loads the checkpoint's dtype; set bf16, quantization and trust_remote_code "
                                       "at the top level",
    # transformers' TrainingArguments that ppokit spells otherwise
    "lr_scheduler_kwargs": lambda value: (
        Equivalent((("ppo.min_lr_rate", value["min_lr_rate"]),), "with ppo.lr_scheduler_type: cosine_with_min_lr")
        if isinstance(value, dict) and set(value) == {"min_lr_rate"}
        else "ppokit's is ppo.min_lr_rate (the floor as a share of the peak rate, transformers' min_lr_rate; min_lr / "
             "learning_rate) with ppo.lr_scheduler_type: cosine_with_min_lr; no other scheduler argument"),
}

# GRPOConfig names with no counterpart: named as such, so that no close spelling of another key is offered instead.
WITHOUT_EQUIVALENT = (
    "router_aux_loss_coef", "cast_lm_head_to_fp32", "pad_to_multiple_of", "generation_kwargs",
    "repetition_penalty", "cache_implementation", "vllm_model_impl", "vllm_structured_outputs_regex",
    "sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
    "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps", "top_entropy_quantile", "use_adaptive_entropy",
    "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target", "off_policy_mask_threshold", "use_bias_correction_kl", "log_multimodal",
    "num_completions_to_print",
    "log_unique_prompts", "log_completions_hub_repo", "use_transformers_continuous_batching",
    "transformers_continuous_batching_config", "use_transformers_paged",
)

TRL_GRPO_NAMES: dict[str, Callable[[Any], str]] = {
    **{name: (lambda said: lambda value: describe(said(value)))(said) for name, said in TRL_GRPO_EQUIVALENTS.items()},
    **{name: (lambda value: describe(NO_EQUIVALENT)) for name in WITHOUT_EQUIVALENT},
}

# The table's names that are transformers' TrainingArguments (a TRL PPO config has them too): the others are a GRPO
# config's own, and one of them among a config's unknown keys makes the refusal say what GRPO needs besides them.
TRAINING_ARGUMENTS_NAMES = frozenset({"max_steps", "lr_scheduler_kwargs", "remove_unused_columns"})
GRPO_ONLY_NAMES = frozenset(TRL_GRPO_NAMES) - TRAINING_ARGUMENTS_NAMES

GRPO_TRAINER: tuple[tuple[str, Any], ...] = (("ppo.advantage_estimator", "grpo"),)
"""What TRL's GRPOTrainer is in ppokit besides its config's keys: group-relative advantages, which build no value model."""

GRPO_ADVICE = ("a TRL GRPO config: TRL's GRPOTrainer is also ppo.advantage_estimator: grpo (group-relative advantages, "
               "no value model); `ppokit from-trl FILE -o ppo.yaml` writes the whole ppokit config (docs/trl.md)")
