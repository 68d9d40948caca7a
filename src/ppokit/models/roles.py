"""Policy, reference, critic and reward on as few copies of the weights as the config allows.

Without `lora` every role is a full model (loading.py loads them). With `lora`:

- the policy is its base with a LoRA adapter named `default` (peft's default name, so final/
  loads with a plain `PeftModel.from_pretrained`);
- the reference is that same base with the adapter disabled (`PeftModel.disable_adapter`), so
  no second copy of the weights exists;
- `value_model: shared` adds a second adapter, `value`, to the policy's base plus a scalar head
  (`SharedBaseCritic`): policy, reference and critic share one set of base weights;
- a separate critic trains through its own adapter with peft's SEQ_CLS task type, which makes
  the scalar head (`score`) a fully trained module. Any other task type leaves the head frozen
  or, as in veRL #4620 (CAUSAL_LM on a classifier), crashes;
- `value_model: from_reward` puts the critic's adapter on the reward model itself, and the
  reward is scored with that adapter disabled (its source's `scored_under`).

The adapters themselves (adding, switching, disabling, the shared critic) are `ppokit.models.adapters`.

Which of these layouts a run gets is decided once, by `decide_roles`, from the config alone (and
whether the reward model reads the policy's token ids); the trainer builds what it says
(`build_roles`) and `ppokit plan` estimates what it says, so the two cannot disagree.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from ppokit.models.adapters import (
    VALUE_ADAPTER,
    SharedBaseCritic,
    add_policy_adapter,
    add_value_adapter,
    adapters_disabled,
    is_peft,
    recompute_with_active_adapter,
)
from ppokit.config.schema import PPOConfig
from ppokit.errors import UserError
from ppokit.models.prefix import SharedPrefix
from ppokit.models.forwards import check_output_head, check_packed_forward, check_shared_forward
from ppokit.models.onednn import route_linears
from ppokit.models.loading import (
    POLICY_ADAPTER,
    disable_dropout,
    enable_gradient_checkpointing,
    frozen_copy,
    load_causal_lm,
    load_scalar_model,
    model_config,
    no_progress_bars,
    value_model_from_path,
    value_model_from_policy,
)
from ppokit.rewards import RewardModelReward, RewardScorer



def mixed_precision(config: PPOConfig) -> str:
    """accelerate's name for the configured mixed precision."""
    return "bf16" if config.bf16 else "fp16" if config.fp16 else "no"


def load_kwargs(config: PPOConfig) -> dict:
    """from_pretrained arguments for a frozen base: the bitsandbytes config when quantising."""
    if config.quantization is None:
        return {}
    from transformers import BitsAndBytesConfig

    compute_dtype = torch.bfloat16 if config.bf16 or not config.fp16 else torch.float16
    if config.quantization == "4bit":
        quant = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute_dtype
        )
    else:
        quant = BitsAndBytesConfig(load_in_8bit=True)
    return {"quantization_config": quant, "device_map": {"": torch.cuda.current_device()}}


# --------------------------------------------------------------------------- which model plays which role

# The reference policy.
REFERENCE_OWN = "own model"  # ref_model: a model of its own
REFERENCE_COPY = "frozen copy"  # a frozen copy of the policy
REFERENCE_BASE = "adapter-disabled base"  # with lora: the policy's base with its adapter disabled
# The critic.
CRITIC_OWN = "own model"  # value_model: a path (or an object passed in)
CRITIC_SHARED = "shared adapter"  # value_model: shared, an adapter + head on the policy's base
CRITIC_ON_REWARD = "adapter on the reward model"  # from_reward with lora: the reward model's own weights
CRITIC_REWARD_COPY = "copy of the reward model"  # the reward model reads the policy's ids: its weights start the critic
CRITIC_POLICY_PATH = "policy checkpoint"  # quantised policy: its checkpoint reloaded as a classifier
CRITIC_POLICY_COPY = "policy backbone"  # a copy of the policy's backbone with a fresh head
CRITIC_NONE = "none"  # a critic-free advantage estimator (ppokit.training.estimators: not `critic`): no value model


@dataclass(frozen=True)
class RoleLayout:
    """Which weights play the reference and the critic, and which roles train through adapters."""

    reference: str  # one of REFERENCE_*
    critic: str  # one of CRITIC_*
    policy_adapter: bool  # the policy trains a LoRA adapter on a frozen base
    critic_adapter: bool  # the critic (other than the shared one) trains its own adapter on a frozen base
    quantized: Optional[str]  # "4bit"/"8bit": every frozen base is loaded quantised

    @property
    def copies_reward_model(self) -> bool:
        return self.critic in (CRITIC_ON_REWARD, CRITIC_REWARD_COPY)

    @property
    def has_critic(self) -> bool:
        return self.critic != CRITIC_NONE


def decide_roles(
    config: PPOConfig, *, reward_vocabulary: Optional[bool], ref_model_given: bool = False, value_model_given: bool = False
) -> RoleLayout:
    """The one decision of which model plays which role.

    reward_vocabulary: None without a reward model, else whether it reads the policy's token ids
    (a critic reads the policy's ids, so a reward model with another vocabulary cannot start it).
    ref_model_given / value_model_given: objects passed to the trainer in place of config paths.
    """
    lora = config.lora
    critic_lora = lora is not None and lora.value_model_lora
    if ref_model_given or config.ref_model:
        reference = REFERENCE_OWN
    else:
        reference = REFERENCE_BASE if lora is not None else REFERENCE_COPY
    if config.value_model == "from_reward" and not reward_vocabulary:
        raise UserError("value_model: from_reward needs reward.model with the policy's vocabulary (the critic reads the policy's token ids)")
    if not config.ppo.estimator.critic:
        if value_model_given:
            raise UserError(f"value_model=: ppo.advantage_estimator {config.ppo.advantage_estimator} builds no value model; do not pass one")
        critic = CRITIC_NONE
    elif config.value_model == "shared":
        critic = CRITIC_SHARED
    elif value_model_given or (config.value_model and config.value_model != "from_reward"):
        critic = CRITIC_OWN
    elif config.value_model == "from_reward" and critic_lora:
        critic = CRITIC_ON_REWARD
    elif reward_vocabulary:
        critic = CRITIC_REWARD_COPY
    elif config.quantization is not None:
        critic = CRITIC_POLICY_PATH
    else:
        critic = CRITIC_POLICY_COPY
    return RoleLayout(
        reference=reference,
        critic=critic,
        policy_adapter=lora is not None,
        critic_adapter=critic_lora and critic not in (CRITIC_SHARED, CRITIC_NONE),
        quantized=config.quantization,
    )


def configs_reading_policy_ids(
    layout: RoleLayout, config: PPOConfig, scorer: RewardScorer, reward_vocabulary: Optional[bool], *,
    model=None, ref_model=None, value_model=None,
) -> dict:
    """{role: model config} of every distinct model that reads the policy's token ids, before any
    of their weights load: the policy (whose config its copies, adapters and backbone share), a
    reference or critic of its own, and a reward model that scores the policy's ids (it starts the
    critic too when the layout says so). For the checks of prompt lengths and token ids."""
    trc = config.trust_remote_code
    configs = {"model": model_config(model if model is not None else config.model, "model", trc)}
    if layout.reference == REFERENCE_OWN:
        configs["ref_model"] = model_config(ref_model if ref_model is not None else config.ref_model, "ref_model", trc)
    if config.teacher is not None:
        configs["teacher"] = model_config(config.teacher, "teacher", trc)
    if layout.critic == CRITIC_OWN:
        configs["value_model"] = model_config(value_model if value_model is not None else config.value_model, "value_model", trc)
    if reward_vocabulary and scorer.reward_model is not None:
        configs["reward.model"] = scorer.reward_model.config
    return configs


@dataclass
class Roles:
    """The trainable policy and critic (None without one), the frozen reference (None: the policy's base, adapters off)
    and the frozen teacher of on-policy distillation (None: no `teacher`)."""

    policy: nn.Module
    reference: Optional[nn.Module]
    value: Optional[nn.Module]
    teacher: Optional[nn.Module] = None


def build_roles(layout: RoleLayout, config: PPOConfig, scorer: RewardScorer, *, model=None, ref_model=None, value_model=None) -> Roles:
    """Load (or take) the models `layout` names. With the critic's adapter on the reward model,
    the scorer's reward source is replaced by one that scores with that adapter disabled."""
    trc = config.trust_remote_code
    base_kwargs = load_kwargs(config)
    critic_kwargs = base_kwargs if layout.critic_adapter else {}
    policy = load_causal_lm(model if model is not None else config.model, "model", trc, **base_kwargs)
    reference = None
    if layout.reference == REFERENCE_OWN:
        reference = load_causal_lm(ref_model if ref_model is not None else config.ref_model, "ref_model", trc)
        reference.requires_grad_(False)
    elif layout.reference == REFERENCE_COPY:
        reference = frozen_copy(policy)
    # The teacher (on-policy distillation) is a frozen model of its own, loaded and scored as an own reference is.
    teacher = load_causal_lm(config.teacher, "teacher", trc).requires_grad_(False) if config.teacher is not None else None
    reward_model = scorer.reward_model
    value = {
        CRITIC_SHARED: lambda: None,  # an adapter on the policy's base, added with the policy's below
        CRITIC_OWN: lambda: load_scalar_model(value_model if value_model is not None else config.value_model, "value_model",
                                              trc, **critic_kwargs),
        CRITIC_ON_REWARD: lambda: reward_model,  # one copy of the reward weights: the critic's adapter goes on it
        CRITIC_REWARD_COPY: lambda: frozen_copy(reward_model).train().requires_grad_(True),
        CRITIC_POLICY_PATH: lambda: value_model_from_path(config.model, trc, critic_kwargs),
        CRITIC_POLICY_COPY: lambda: value_model_from_policy(policy),
        CRITIC_NONE: lambda: None,
    }[layout.critic]()
    for m in (policy, reference, value, reward_model, teacher):
        if m is not None:
            disable_dropout(m)
    # Adapters after disable_dropout, so that lora.dropout is the one dropout left on purpose.
    if layout.critic_adapter:
        value = add_value_adapter(value, config.lora, config.quantization)
        if layout.critic == CRITIC_ON_REWARD:  # the reward model's weights carry the critic's adapter: scored with it off
            scorer.sources = [replace(s, scored_under=functools.partial(adapters_disabled, value)) if isinstance(s, RewardModelReward)
                              else s for s in scorer.sources]
    if layout.policy_adapter:
        policy = add_policy_adapter(policy, config.lora, config.quantization)
    if layout.critic == CRITIC_SHARED:
        value = SharedBaseCritic(policy, config.lora)
    if config.gradient_checkpointing:
        # The shared critic runs on the policy's base: one switch, whose recompute re-activates the adapter that ran.
        context_fn = recompute_with_active_adapter(policy) if layout.critic == CRITIC_SHARED else None
        enable_gradient_checkpointing(policy, context_fn)
        if context_fn is None and value is not None:
            enable_gradient_checkpointing(value)
    # The memory-light LM head and the compiled forward read the logits from the last hidden state: a model whose forward
    # computes them otherwise is refused now, before the optimiser, rather than trained on wrong logits.
    switch = ("lm_head_chunk_size" if config.lm_head_chunk_size else "compile" if config.compile
              else "ppo.padding_free" if config.ppo.padding_free else "ppo.shared_prompt" if config.ppo.shared_prompt else None)
    for m in (policy, reference, teacher) if switch else ():
        if m is not None:
            check_output_head(m, switch)
    # Padding-free forwards need each model to keep the episodes packed in a row apart (the reward model: where it loads).
    for m in (policy, reference, value, teacher) if config.ppo.padding_free else ():
        if m is not None:
            check_packed_forward(m, "ppo.padding_free")
    # Shared-prompt forwards need each model to follow a 4-D attention mask as given.
    for m in (policy, reference, value, teacher) if config.ppo.shared_prompt else ():
        if m is not None:
            check_shared_forward(m, "ppo.shared_prompt", SharedPrefix(2))
    if config.matmul_backend == "onednn":  # after the adapters: peft's LoRA layers wrap plain Linears, routed with the rest
        for m in (policy, reference, value, reward_model, teacher):
            if m is not None:
                route_linears(m)
    return Roles(policy, reference, value, teacher)


def trainable_by_role(policy: nn.Module, value: Optional[nn.Module]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(the policy's trainable parameters, the critic's), each once: the two optimiser parameter groups.

    The shared critic's adapter `value` lives inside the policy's PeftModel but trains the critic,
    so it goes with the critic's head, not with the policy.
    """
    critic = [p for p in value.parameters() if p.requires_grad] if value is not None else []
    if isinstance(value, SharedBaseCritic):
        critic += [p for n, p in policy.named_parameters() if p.requires_grad and f".{VALUE_ADAPTER}." in n]
    taken = {id(p) for p in critic}
    return [p for p in policy.parameters() if p.requires_grad and id(p) not in taken], critic


# --------------------------------------------------------------------------- saving


def save_policy(policy: nn.Module, directory: Path, merged_directory: Optional[Path] = None) -> None:
    """A full policy: save_pretrained. A LoRA policy: its `default` adapter only (the critic's
    adapter goes to value_model/), and with `merged_directory` the merged full model."""
    if not is_peft(policy):
        policy.save_pretrained(directory)
        return
    policy.save_pretrained(directory, selected_adapters=[POLICY_ADAPTER])
    if merged_directory is not None:
        save_merged_policy(policy, merged_directory)


def save_merged_policy(policy, directory: Path) -> None:
    """Merge the `default` adapter into the base weights, save a plain transformers model, unmerge.

    Merging in place needs no second copy of the weights; the state dict is cleaned of peft's
    names (`base_layer.`, `lora_*`) so AutoModelForCausalLM loads it without peft.
    """
    base = policy.get_base_model()
    with torch.no_grad():
        policy.base_model.merge_adapter(adapter_names=[POLICY_ADAPTER])
        try:
            state = {}
            for key, tensor in base.state_dict().items():
                if "lora_" in key:
                    continue
                state[key.replace(".base_layer.", ".")] = tensor.detach().cpu().clone()
            base.save_pretrained(directory, state_dict=state)
        finally:
            policy.base_model.unmerge_adapter()


def save_value_model(value_model: nn.Module, directory: Path) -> None:
    """Full critic: save_pretrained. LoRA critic: adapter + trained head (peft's SEQ_CLS layout).
    Shared critic: the `value` adapter, the head and a note naming the base."""
    value_model.save_pretrained(directory)


def write_models(folder: Path, whole, tokenizer, merged: bool = False, card=None) -> None:
    """What a saved run's model folder holds: the policy (`save_policy`) and its tokenizer in `folder`, with
    `merged` the merged LoRA policy in folder/merged/; `card` (a `model_card.ModelCard`, or None) as the README.md
    of each; the value model, if there is one (`whole.value_model`), with the tokenizer in folder/value_model/."""
    merged_dir = folder / "merged" if merged else None
    save_policy(whole.policy, folder, merged_dir)
    tokenizer.save_pretrained(folder)
    if merged_dir is not None:
        tokenizer.save_pretrained(merged_dir)
    if card is not None:
        card.write(folder)
        if merged_dir is not None:
            card.merged().write(merged_dir)
    if whole.value_model is None:  # a critic-free estimator
        return
    save_value_model(whole.value_model, folder / "value_model")
    tokenizer.save_pretrained(folder / "value_model")


def merge_adapter(base: str, adapter: str, output: str) -> None:
    """Merge a saved policy adapter (e.g. final/) into its full-precision base and save it plainly.

    For a run trained on a quantised base, where merging at the end of training would be lossy.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with no_progress_bars():
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
        model.merge_and_unload().save_pretrained(output)
