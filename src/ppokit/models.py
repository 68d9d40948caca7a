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
from typing import Optional

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ppokit import algo
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


def hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, backbone_fn=None) -> torch.Tensor:
    """The backbone's last hidden state at every position. (B, L) -> (B, L, H).

    backbone_fn: a stand-in for the backbone with the same call (a `torch.compile`d one, `ppokit.compile`)."""
    run = backbone_fn if backbone_fn is not None else backbone(model)
    return run(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    ).last_hidden_state


def output_head(model):
    """hidden (..., H) -> logits (..., V) as the model's own forward computes them from its last hidden
    state: the output embedding, then the transforms transformers applies after it for some families
    (Cohere's logit_scale, Granite's logits_scaling, Gemma's final_logit_softcapping). Whether that is the
    whole story for a model is checked once against its forward (`check_output_head`)."""
    base = unwrap_peft(model)
    lm_head = base.get_output_embeddings()
    if lm_head is None:
        raise UserError(f"{type(base).__name__} has no output embedding (get_output_embeddings() is None); lm_head_chunk_size and compile need one")
    config = base.config.get_text_config()
    scale = getattr(base, "logit_scale", None) if isinstance(getattr(base, "logit_scale", None), (int, float)) else None
    divide = getattr(config, "logits_scaling", None)
    softcap = getattr(config, "final_logit_softcapping", None)

    def head(hidden: torch.Tensor) -> torch.Tensor:
        logits = lm_head(hidden)
        if scale is not None:
            logits = logits * scale
        if divide is not None:
            logits = logits / divide
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    return head


@torch.no_grad()
def check_output_head(model, what: str) -> None:
    """Refuse `what` (the switch that needs backbone + `output_head`) for a model whose forward computes its
    logits some other way: a few tokens through both must give the same logits."""
    base = unwrap_peft(model)
    device = next(base.parameters()).device
    vocab = base.get_output_embeddings().weight.shape[0] if base.get_output_embeddings() is not None else 2
    ids = (torch.arange(8, device=device).reshape(2, 4) * 7919) % max(vocab, 1)
    mask = torch.ones_like(ids)
    mask[1, 0] = 0  # one left-padded row, as prompts are
    was_training = base.training
    base.eval()
    try:
        direct = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=False).logits.float()
        light = output_head(model)(hidden_states(model, ids, mask)).float()
    finally:
        base.train(was_training)
    gap = (direct - light).abs().max().item()
    if not gap <= 1e-4 * max(1.0, direct.abs().max().item()):
        raise UserError(
            f"{what}: {type(base).__name__}'s forward computes its logits in a way ppokit does not reproduce from the "
            f"last hidden state (largest difference {gap:.3g}); turn {what} off for this model"
        )


def response_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float,
    *,
    chunk_size: Optional[int] = None,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    backbone_fn=None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Logprobs (and entropy) of each response token under `model`: THE function every logprob site uses
    (reference pass, training; sampling keeps its own per-step logprobs from the same formula).

    input_ids, attention_mask: (B, P + R); response_ids, response_mask: (B, R)
    -> (logprobs (B, R) float32, entropy (B, R) float32 or None), 0 at padding.

    chunk_size None and no backbone_fn: the direct computation, logits at the R + 1 last positions from
    the model's forward (`logits_to_keep`: never at prompt positions) and one log-softmax over them.
    chunk_size N: the memory-light head. The backbone's hidden states at the positions that predict a
    real response token (padding is skipped) go through the output layer N at a time, checkpointed
    (`algo.chunked_head_logprobs`), so the full (B, R, V) float32 log-softmax never exists.
    backbone_fn (a compiled backbone) also takes the backbone + head route, in one chunk if chunk_size is None.
    Entropy: a detached statistic unless entropy_grad (an entropy bonus in the loss).
    """
    R = response_ids.shape[1]
    if chunk_size is None and backbone_fn is None:
        logits = response_logits(model, input_ids, attention_mask, R)
        if with_entropy:
            logprobs, entropy = algo.logprobs_and_entropy(logits, response_ids, temperature, entropy_grad)
        else:
            logprobs, entropy = algo.logprobs_from_logits(logits, response_ids, temperature), None
        keep = response_mask.bool()
        return logprobs.masked_fill(~keep, 0.0), (entropy.masked_fill(~keep, 0.0) if entropy is not None else None)
    hidden = hidden_states(model, input_ids, attention_mask, backbone_fn)
    L = hidden.shape[1]
    keep = response_mask.bool()
    predicting = hidden[:, L - R - 1 : L - 1][keep]  # (N, H): the state before each real response token
    n = predicting.shape[0]
    logprobs, entropy = algo.chunked_head_logprobs(
        predicting, output_head(model), response_ids[keep], temperature, chunk_size or max(n, 1), with_entropy, entropy_grad
    )
    return _scatter(logprobs, keep), (_scatter(entropy, keep) if entropy is not None else None)


def _scatter(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N,) values at the True positions of mask (B, R) -> (B, R), 0 elsewhere; differentiable."""
    out = values.new_zeros(mask.shape)
    return out.masked_scatter(mask, values)


def scalar_outputs(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, backbone_fn=None) -> torch.Tensor:
    """The scalar head at every position of a one-label sequence classifier. (B, L) -> (B, L) float32."""
    hidden = hidden_states(model, input_ids, attention_mask, backbone_fn)
    return unwrap_peft(model).score(hidden).squeeze(-1).float()


def response_values(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int, backbone_fn=None) -> torch.Tensor:
    """Value of the state before each response token. (B, P + R) -> (B, R) float32."""
    return scalar_outputs(model, input_ids, attention_mask, backbone_fn)[:, -response_length - 1 : -1]


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


