"""Loading the four roles (policy, reference, value, reward) and running them over token batches.

Value and reward models are `AutoModelForSequenceClassification` with one label: the backbone
(`model.<base_model_prefix>`) gives hidden states, `model.score` maps each to a scalar. Reading
that scalar at every response position gives values; at the last real token, a reward.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
import pickle
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ppokit.errors import UserError


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep in name and name.count(os.sep) > 1


def resolve_model_path(name: str, role: str) -> str:
    """A local path that exists, or a hub id; a missing local path is a UserError naming the role."""
    expanded = os.path.expanduser(str(name))
    if os.path.exists(expanded):
        if not Path(expanded, "config.json").is_file():
            raise UserError(f"{role}: {name} exists but holds no config.json (is it a saved model directory?)")
        return expanded
    if _looks_like_path(str(name)):
        raise UserError(f"{role}: model path {name} does not exist")
    return str(name)


def _from_pretrained(loader, name: str, role: str, **kwargs):
    path = resolve_model_path(name, role)
    try:
        return loader.from_pretrained(path, **kwargs)
    except (OSError, ValueError, pickle.UnpicklingError) as e:
        # UnpicklingError: a pickled .bin refused by torch.load(weights_only=True); never executed.
        raise UserError(f"{role}: could not load {name!r}: {str(e).splitlines()[0]}") from None


def load_tokenizer(name: str, trust_remote_code: bool = False, role: str = "tokenizer") -> PreTrainedTokenizerBase:
    """Load a tokenizer; without a pad token, the EOS token is used as padding (documented fallback)."""
    tokenizer = _from_pretrained(AutoTokenizer, name, role, trust_remote_code=trust_remote_code)
    return ensure_pad_token(tokenizer)


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise UserError("tokenizer has neither a pad token nor an EOS token; set one and save it again")
        # Safe here because every mask is built from positions, never from `ids == pad_token_id`.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def resolve_stop_token(tokenizer: PreTrainedTokenizerBase, stop_token: str | None, stop_token_id: int | None) -> int | None:
    """The token id that ends a response (ppo.stop_token / ppo.stop_token_id), or None for none."""
    if stop_token_id is not None:
        if stop_token_id >= len(tokenizer):
            raise UserError(f"ppo.stop_token_id {stop_token_id} is outside the vocabulary ({len(tokenizer)} tokens)")
        return stop_token_id
    if stop_token is None:
        return None
    if stop_token == "eos":
        if tokenizer.eos_token_id is None:
            raise UserError("ppo.stop_token is 'eos' but the tokenizer has no EOS token; set ppo.stop_token_id")
        return tokenizer.eos_token_id
    ids = tokenizer.convert_tokens_to_ids([stop_token])
    if ids[0] is None or ids[0] == tokenizer.unk_token_id:
        encoded = tokenizer(stop_token, add_special_tokens=False)["input_ids"]
        if len(encoded) != 1:
            raise UserError(f"ppo.stop_token {stop_token!r} is {len(encoded)} tokens; it must be exactly one")
        if encoded[0] == tokenizer.unk_token_id and stop_token != tokenizer.unk_token:
            raise UserError(f"ppo.stop_token {stop_token!r} is not in the tokenizer's vocabulary (it encodes as {tokenizer.unk_token!r})")
        ids = encoded
    return ids[0]


def load_causal_lm(name_or_model, role: str = "model", trust_remote_code: bool = False, **load_kwargs) -> PreTrainedModel:
    """`load_kwargs` go to from_pretrained (e.g. quantization_config, device_map)."""
    if isinstance(name_or_model, nn.Module):
        return name_or_model
    return _from_pretrained(AutoModelForCausalLM, name_or_model, role, trust_remote_code=trust_remote_code, **load_kwargs)


def load_scalar_model(
    name_or_model, role: str, trust_remote_code: bool = False, require_trained_head: bool = False, **load_kwargs
) -> PreTrainedModel:
    """A sequence-classification model with exactly one label (reward or value).

    require_trained_head: refuse a checkpoint saved without a classification head (e.g. a causal
    LM), whose scalar head would be freshly random: right for a critic, silent garbage for a reward.
    load_kwargs go to from_pretrained (e.g. a quantisation config).
    """
    if isinstance(name_or_model, nn.Module):
        model = name_or_model
    else:
        path = resolve_model_path(name_or_model, role)
        try:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            raise UserError(f"{role}: could not load {name_or_model!r}: {str(e).splitlines()[0]}") from None
        if getattr(config, "num_labels", 1) != 1 and config.architectures and any(
            a.endswith("ForSequenceClassification") for a in config.architectures
        ):
            raise UserError(f"{role}: {name_or_model} has {config.num_labels} labels; a reward/value model needs exactly 1")
        if require_trained_head and config.architectures and not any(
            a.endswith("ForSequenceClassification") for a in config.architectures
        ):
            raise UserError(
                f"{role}: {name_or_model} is a {', '.join(config.architectures)}, not a sequence-classification model; "
                "its score head would be random. Use a trained reward model (e.g. from `ppokit rm`)"
            )
        config.num_labels = 1
        model = _from_pretrained(
            AutoModelForSequenceClassification, name_or_model, role, config=config, trust_remote_code=trust_remote_code,
            **load_kwargs,
        )
    if model.config.num_labels != 1:
        raise UserError(f"{role}: model has {model.config.num_labels} labels; a reward/value model needs exactly 1")
    return model


def value_model_from_policy(policy: PreTrainedModel) -> PreTrainedModel:
    """The policy's backbone (copied) with a fresh scalar head, initialised to 0 so values start at 0."""
    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    config.architectures = None
    value_model = AutoModelForSequenceClassification.from_config(config)
    backbone(value_model).load_state_dict(backbone(policy).state_dict())
    nn.init.zeros_(value_model.score.weight)
    if getattr(value_model.score, "bias", None) is not None:
        nn.init.zeros_(value_model.score.bias)
    return value_model.to(next(policy.parameters()).dtype)


def frozen_copy(model: nn.Module) -> nn.Module:
    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    return ref.eval()


def disable_dropout(model: nn.Module) -> None:
    """Dropout makes the PPO ratio differ from 1 even before any update [N+, "disable dropout"]."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    for attr in ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout", "dropout"):
        if hasattr(getattr(model, "config", None), attr):
            setattr(model.config, attr, 0.0)


def backbone(model: PreTrainedModel) -> nn.Module:
    model = unwrap_peft(model)
    return getattr(model, model.base_model_prefix)


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (its LoRA layers stay in place and active), else `model`.

    A PeftModel forwards unknown attributes to the wrapped model, but not `base_model_prefix`
    lookups or the forward signature, which the helpers here rely on.
    """
    get_base_model = getattr(type(model), "get_base_model", None)
    return model.get_base_model() if get_base_model is not None and not isinstance(model, PreTrainedModel) else model


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only, so left padding does not shift them. (B, L) -> (B, L)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@functools.lru_cache(maxsize=None)
def _cache_kwarg(cls) -> str:
    # transformers renamed `past_key_values` to `cache` in 5.x.
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def causal_lm_step(model, input_ids, attention_mask, position_ids, cache=None, logits_to_keep: int = 0):
    """One forward of a causal LM with an optional KV cache -> (logits, cache)."""
    kwargs = {_cache_kwarg(type(unwrap_peft(model))): cache} if cache is not None else {}
    if logits_to_keep:
        kwargs["logits_to_keep"] = logits_to_keep
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True, **kwargs)
    new_cache = out.get("cache", None) if "cache" in out else out.get("past_key_values", None)
    return out.logits, new_cache


def response_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int) -> torch.Tensor:
    """Logits that predict the last `response_length` tokens of each row.

    input_ids, attention_mask: (B, P + R) -> (B, R, V). Only R + 1 positions go through the LM head.
    """
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        logits_to_keep=response_length + 1,
    )
    return out.logits[:, :-1]


def scalar_outputs(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The scalar head at every position of a one-label sequence classifier. (B, L) -> (B, L) float32."""
    hidden = backbone(model)(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    ).last_hidden_state
    return unwrap_peft(model).score(hidden).squeeze(-1).float()


def score_at_last_token(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Reward-model score at each row's last real token, whatever side the padding is on. (B, L) -> (B,)."""
    outputs = scalar_outputs(model, input_ids, attention_mask)
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = torch.where(attention_mask.bool(), positions, torch.full_like(positions, -1)).max(-1).values
    return outputs[torch.arange(outputs.shape[0], device=outputs.device), last.clamp(min=0)]


def same_vocabulary(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    """True when token ids mean the same strings in both tokenizers (no re-encoding needed)."""
    return a is b or (type(a) is type(b) and a.get_vocab() == b.get_vocab())


def left_pad(sequences: list[list[int]], pad_token_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists -> (ids (B, P) long, mask (B, P) bool), padded on the left."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            mask[row, width - len(seq) :] = True
    return ids.to(device), mask.to(device)


