"""LoRA adapters on the policy and the critic (peft): adding them, switching between them inside one forward, disabling
them, and the critic that lives on the policy's own base (`SharedBaseCritic`). `roles` decides which role trains
through an adapter and builds the roles with these.

Switching adapters inside one training forward needs care: peft's `set_adapter` sets
`requires_grad=False` on the adapter it deactivates, and autograd does not accumulate into a
leaf that no longer requires grad at backward time. `active_adapter` restores it. Gradient
checkpointing recomputes a layer during backward, when another adapter may be active; the
checkpoint's `context_fn` re-activates the adapter the layer ran with (`recompute_with_active_adapter`).
Under FSDP a switch must not reshard anything (`switch_adapter`).
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from ppokit.errors import UserError

# `lora` below is the config's `lora:` section (`config.LoraConfig`), read by its fields: nothing of ppokit above
# `errors` is imported here, peft and the loaded models are all this module works on.
VALUE_ADAPTER = "value"  # the critic's adapter (the policy's is peft's default name: models.POLICY_ADAPTER)
VALUE_HEAD_FILE = "value_head.safetensors"
SHARED_CRITIC_FILE = "shared_value_model.json"


def peft_lora_config(lora, task_type: Optional[str]):
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


def _prepare_quantized(model: nn.Module, quantization: Optional[str]) -> None:
    if quantization is not None and getattr(model, "is_quantized", False):
        from peft import prepare_model_for_kbit_training

        # Gradient checkpointing is switched on by `build_roles`, with our context (`recompute_with_active_adapter`).
        prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def add_policy_adapter(policy: nn.Module, lora, quantization: Optional[str] = None):
    """The policy as a PeftModel with adapter `default` (lora: the `lora:` section; quantization: that key); the base is frozen."""
    return _add_adapter(policy, lora, quantization, "CAUSAL_LM", "lora.target_modules")


def add_value_adapter(value_model: nn.Module, lora, quantization: Optional[str] = None):
    """A separate critic (one-label sequence classifier) with its own adapter; the head trains fully."""
    return _add_adapter(value_model, lora, quantization, "SEQ_CLS", "lora.target_modules (value model)")


def _add_adapter(model: nn.Module, lora, quantization: Optional[str], task_type: str, where: str):
    from peft import get_peft_model

    _prepare_quantized(model, quantization)
    try:
        return _wrap(get_peft_model, model, peft_lora_config(lora, task_type))
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


@contextlib.contextmanager
def active_adapter(peft_model, name: str):
    """Run with adapter `name` active, then switch back; every adapter keeps requires_grad."""
    previous = peft_model.active_adapter
    if previous == name:
        yield
        return
    trainable = [p for p in adapter_parameters(peft_model) if p.requires_grad]
    switch_adapter(peft_model, name)
    for p in trainable:
        p.requires_grad_(True)
    try:
        yield
    finally:
        switch_adapter(peft_model, previous)
        for p in trainable:
            p.requires_grad_(True)


def switch_adapter(peft_model, name: str) -> None:
    """Make adapter `name` the active one: the tuner's own switch and the PeftModel's record of it, which is what
    `PeftModel.set_adapter` does, less the resharding peft 0.22 added in front of it (`_reshard_fsdp_modules`).

    Under FSDP that resharding frees every unit's gathered weights, the root unit's (embeddings, final norm, a tied
    head) too, which FSDP keeps gathered from a forward to its backward. The shared critic switches to its adapter
    and back inside the training forward: the weights the forward had saved for the backward were freed under it,
    and the backward read freed memory (a segmentation fault on CPU). Nothing here needs the reshard: every
    adapter keeps requires_grad=True (`active_adapter`), so no change of it has to reach the shards.
    """
    peft_model.base_model.set_adapter(name)
    peft_model.active_adapter = name


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

    def __init__(self, policy, lora):
        super().__init__()
        policy.add_adapter(VALUE_ADAPTER, peft_lora_config(lora, None))
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
        handle = base.base_model.register_forward_hook(lambda module, args, output: captured.setdefault("output", output))
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
