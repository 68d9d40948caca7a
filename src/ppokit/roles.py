"""Policy, reference, critic and reward on as few copies of the weights as the config allows.

Without `lora` every role is a full model (models.py loads them). With `lora`:

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
  reward is scored with that adapter disabled (`AdapterDisabledReward`).

Switching adapters inside one training forward needs care: peft's `set_adapter` sets
`requires_grad=False` on the adapter it deactivates, and autograd does not accumulate into a
leaf that no longer requires grad at backward time. `active_adapter` restores it. Gradient
checkpointing recomputes a layer during backward, when another adapter may be active; the
checkpoint's `context_fn` re-activates the adapter the layer ran with.

Which of these layouts a run gets is decided once, by `decide_roles`, from the config alone (and
whether the reward model reads the policy's token ids); the trainer builds what it says
(`build_roles`) and `ppokit plan` estimates what it says, so the two cannot disagree.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from ppokit.config import LoraConfig, PPOConfig
from ppokit.errors import UserError
from ppokit.models import (
    POLICY_ADAPTER,
    backbone,
    check_output_head,
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

VALUE_ADAPTER = "value"
VALUE_HEAD_FILE = "value_head.safetensors"
SHARED_CRITIC_FILE = "shared_value_model.json"


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
CRITIC_NONE = "none"  # a critic-free advantage estimator (ppokit.estimators: not `critic`): no value model


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
    if layout.critic == CRITIC_OWN:
        configs["value_model"] = model_config(value_model if value_model is not None else config.value_model, "value_model", trc)
    if reward_vocabulary and scorer.reward_model is not None:
        configs["reward.model"] = scorer.reward_model.config
    return configs


@dataclass
class Roles:
    """The trainable policy and critic (None without one), and the frozen reference (None: the policy's base, adapters off)."""

    policy: nn.Module
    reference: Optional[nn.Module]
    value: Optional[nn.Module]


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
    for m in (policy, reference, value, reward_model):
        if m is not None:
            disable_dropout(m)
    # Adapters after disable_dropout, so that lora.dropout is the one dropout left on purpose.
    if layout.critic_adapter:
        value = add_value_adapter(value, config)
        if layout.critic == CRITIC_ON_REWARD:
            scorer.sources = [AdapterDisabledReward(s, value) if isinstance(s, RewardModelReward) else s for s in scorer.sources]
    if layout.policy_adapter:
        policy = add_policy_adapter(policy, config)
    if layout.critic == CRITIC_SHARED:
        value = SharedBaseCritic(policy, config)
    if config.gradient_checkpointing:
        # The shared critic runs on the policy's base: one switch, whose recompute re-activates the adapter that ran.
        context_fn = recompute_with_active_adapter(policy) if layout.critic == CRITIC_SHARED else None
        enable_gradient_checkpointing(policy, context_fn)
        if context_fn is None and value is not None:
            enable_gradient_checkpointing(value)
    # The memory-light LM head and the compiled forward read the logits from the last hidden state: a model whose forward
    # computes them otherwise is refused now, before the optimiser, rather than trained on wrong logits.
    switch = "lm_head_chunk_size" if config.lm_head_chunk_size else "compile" if config.compile else None
    for m in (policy, reference) if switch else ():
        if m is not None:
            check_output_head(m, switch)
    return Roles(policy, reference, value)


# --------------------------------------------------------------------------- adapters


def peft_lora_config(lora: LoraConfig, task_type: Optional[str]):
    import peft

    targets = lora.target_modules
    return peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets[0] if targets == ["all-linear"] else list(targets),
        use_dora=lora.use_dora,
        use_rslora=lora.use_rslora,
        bias="none",
        task_type=task_type,
    )


def _prepare_quantized(model: nn.Module, config: PPOConfig) -> None:
    if config.quantization is not None and getattr(model, "is_quantized", False):
        from peft import prepare_model_for_kbit_training

        # Gradient checkpointing is switched on by `build_roles`, with our context (`recompute_with_active_adapter`).
        prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def add_policy_adapter(policy: nn.Module, config: PPOConfig):
    """The policy as a PeftModel with adapter `default`; the base is frozen."""
    return _add_adapter(policy, config, "CAUSAL_LM", "lora.target_modules")


def add_value_adapter(value_model: nn.Module, config: PPOConfig):
    """A separate critic (one-label sequence classifier) with its own adapter; the head trains fully."""
    return _add_adapter(value_model, config, "SEQ_CLS", "lora.target_modules (value model)")


def _add_adapter(model: nn.Module, config: PPOConfig, task_type: str, where: str):
    from peft import get_peft_model

    _prepare_quantized(model, config)
    try:
        return _wrap(get_peft_model, model, peft_lora_config(config.lora, task_type))
    except ValueError as e:
        raise UserError(f"{where}: {str(e).splitlines()[0]}") from None


def _wrap(get_peft_model, model: nn.Module, lora_config):
    # peft reads transformers' deprecated `is_gradient_checkpointing`; its FutureWarning is not the user's to act on.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, lora_config)


def adapter_parameters(peft_model) -> list[nn.Parameter]:
    """Every adapter's trainable tensors (LoRA A/B, DoRA magnitudes, trained copies of heads)."""
    return [p for n, p in peft_model.named_parameters() if "lora_" in n or "modules_to_save" in n]


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


@contextlib.contextmanager
def active_adapter(peft_model, name: str):
    """Run with adapter `name` active, then switch back; every adapter keeps requires_grad."""
    previous = peft_model.active_adapter
    if previous == name:
        yield
        return
    trainable = [p for p in adapter_parameters(peft_model) if p.requires_grad]
    peft_model.set_adapter(name)
    for p in trainable:
        p.requires_grad_(True)
    try:
        yield
    finally:
        peft_model.set_adapter(previous)
        for p in trainable:
            p.requires_grad_(True)


class ScalarHead(nn.Linear):
    """hidden -> one scalar, in the head's own dtype (float32 on a bf16 base)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden.to(self.weight.dtype))


class SharedBaseCritic(nn.Module):
    """The critic on the policy's own frozen base: LoRA adapter `value` plus a scalar head.

    Shaped like a one-label sequence classifier (`base_model_prefix` names a backbone callable,
    `score` is the head), so `models.scalar_outputs` runs it like any value model. The policy's
    PeftModel is kept as a plain attribute, not a submodule: its weights belong to the policy,
    and registering it twice would duplicate them in every state_dict.
    """

    base_model_prefix = "backbone"

    def __init__(self, policy, config: PPOConfig):
        super().__init__()
        policy.add_adapter(VALUE_ADAPTER, peft_lora_config(config.lora, None))
        for p in adapter_parameters(policy):
            p.requires_grad_(True)  # add_adapter leaves the inactive adapter frozen
        base = policy.get_base_model()
        hidden = base.config.get_text_config().hidden_size
        self.score = ScalarHead(hidden, 1, bias=False, device=base.device)
        nn.init.zeros_(self.score.weight)  # values start at 0, as with value_model_from_policy
        self.__dict__["policy"] = policy
        self.config = base.config

    def backbone(self, **inputs):
        """The base's hidden states with the `value` adapter active. They are read from a forward of
        the whole causal LM (its head on the last position only, a negligible cost), not of the backbone
        alone: under FSDP the embeddings tied to the LM head are gathered by that model's forward."""
        base = self.policy.get_base_model()
        captured = {}
        handle = backbone(base).register_forward_hook(lambda module, args, output: captured.setdefault("output", output))
        try:
            with active_adapter(self.policy, VALUE_ADAPTER):
                base(**inputs, logits_to_keep=1)
        finally:
            handle.remove()
        return captured["output"]

    def save_pretrained(self, directory) -> None:
        """adapter_config.json + adapter_model.safetensors (the `value` adapter) and the head."""
        from peft.utils import get_peft_model_state_dict
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        adapter = get_peft_model_state_dict(self.policy, adapter_name=VALUE_ADAPTER)
        save_file({k: v.detach().contiguous().cpu() for k, v in adapter.items()}, directory / "adapter_model.safetensors")
        peft_config = self.policy.peft_config[VALUE_ADAPTER]
        peft_config.base_model_name_or_path = self.config._name_or_path
        peft_config.save_pretrained(directory)
        save_file({"score.weight": self.score.weight.detach().contiguous().cpu()}, directory / VALUE_HEAD_FILE)
        (directory / SHARED_CRITIC_FILE).write_text(json.dumps({
            "kind": "shared", "adapter": "adapter_model.safetensors", "head": VALUE_HEAD_FILE,
            "base": self.config._name_or_path,
            "note": "critic = the policy's base + this LoRA adapter + the head (hidden -> 1, no bias), read at every position",
        }, indent=2))


def recompute_with_active_adapter(peft_model):
    """Gradient checkpointing's `context_fn` under a multi-adapter PeftModel: a layer is recomputed with the adapter
    that was active in its forward (see the module docstring)."""

    def context_fn():
        name = peft_model.active_adapter
        return contextlib.nullcontext(), active_adapter(peft_model, name)

    return context_fn


@contextlib.contextmanager
def adapters_disabled(peft_model):
    """The base model alone (the reference, or the reward under a critic's adapter).

    peft's `disable_adapter` re-enables by `set_adapter(active)`, which leaves every inactive
    adapter (the shared critic's) with requires_grad=False; restore it.
    """
    trainable = [p for p in adapter_parameters(peft_model) if p.requires_grad]
    try:
        with peft_model.disable_adapter():
            yield
    finally:
        for p in trainable:
            p.requires_grad_(True)


def is_peft(model: nn.Module) -> bool:
    return hasattr(type(model), "disable_adapter") and hasattr(type(model), "get_base_model")


# --------------------------------------------------------------------------- reward on a shared base


class AdapterDisabledReward(RewardModelReward):
    """The reward model whose weights also carry the critic's adapter: scored with it disabled."""

    def __init__(self, source: RewardModelReward, peft_model):
        super().__init__(source.model, source.tokenizer, name=source.name, batch_size=source.batch_size)
        self.peft_model = peft_model

    def score(self, batch):
        with adapters_disabled(self.peft_model):
            return super().score(batch)


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
