"""Loading the four roles (policy, reference, value, reward) and their tokenizers; what their configs state (position
limits, vocabularies) checked against the prompts. `models.forwards` runs them over token batches.

Value and reward models are `AutoModelForSequenceClassification` with one label: the backbone
(`model.<base_model_prefix>`) gives hidden states, `model.score` maps each to a scalar.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch
from safetensors import SafetensorError
from torch import nn
from torch.nn.modules.dropout import _DropoutNd
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


# Files of which a saved tokenizer holds at least one (fast, slow BPE/WordPiece, SentencePiece, tiktoken).
# The policy's LoRA adapter: peft's default name (a critic on the same base has its own, adapters.VALUE_ADAPTER).
POLICY_ADAPTER = "default"

TOKENIZER_FILES = (
    "tokenizer_config.json", "tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model",
    "sentencepiece.bpe.model", "tiktoken.model",
)


def resolve_model_path(name: str, role: str, tokenizer: bool = False) -> str:
    """A local path that exists, or a hub id; a missing local path is a UserError naming the role.

    A local folder must hold a saved model (config.json), or with `tokenizer` a saved model or a
    saved tokenizer (as `tokenizer.save_pretrained` writes it: no config.json).
    """
    expanded = os.path.expanduser(str(name))
    if os.path.exists(expanded):
        if not os.path.isdir(expanded):
            what = "a saved tokenizer or model folder" if tokenizer else "a saved model folder"
            raise UserError(f"{role}: {name} is a file; give {what}")
        if Path(expanded, "config.json").is_file():
            return expanded
        if tokenizer and any(Path(expanded, f).is_file() for f in TOKENIZER_FILES):
            return expanded
        adapter = Path(expanded, "adapter_config.json")
        if adapter.is_file():
            raise UserError(f"{role}: {name} holds a LoRA adapter{_adapter_base(adapter)}, not a whole model; give the "
                            "merged model (a LoRA PPO run writes final/merged/ with save_merged: true) or the base model")
        if tokenizer:
            raise UserError(
                f"{role}: {name} exists but holds neither a saved tokenizer (tokenizer_config.json, tokenizer.json, "
                "vocab files) nor a saved model (config.json)"
            )
        raise UserError(f"{role}: {name} exists but holds no config.json (is it a saved model directory?)")
    if _looks_like_path(str(name)):
        raise UserError(f"{role}: {'path' if role == 'tokenizer' else 'model path'} {name} does not exist")
    return str(name)


def _adapter_base(adapter_config: Path) -> str:
    try:
        base = json.loads(adapter_config.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return ""
    return f" for {base}" if isinstance(base, str) and base else ""


@contextlib.contextmanager
def no_progress_bars():
    """Without transformers' progress bars ("Loading weights", "Writing model shards"): ppokit's loads and
    saves are steps of its own, and a bar for each would interleave with the run's progress (and fill
    a log file with carriage returns). The caller's setting is restored afterwards."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _from_pretrained(loader, name: str, role: str, **kwargs):
    path = resolve_model_path(name, role, tokenizer=loader is AutoTokenizer)
    try:
        with no_progress_bars():
            return loader.from_pretrained(path, **kwargs)
    except (OSError, ValueError, pickle.UnpicklingError, SafetensorError) as e:
        # UnpicklingError: a pickled .bin refused by torch.load(weights_only=True); never executed.
        # SafetensorError: a truncated or damaged .safetensors file.
        damaged = " (a weights file is damaged or incomplete)" if isinstance(e, SafetensorError) else ""
        raise UserError(f"{role}: could not load {name!r}: {str(e).splitlines()[0]}{damaged}") from None


def load_tokenizer(name: str, trust_remote_code: bool = False, role: str = "tokenizer") -> PreTrainedTokenizerBase:
    """Load a tokenizer; without a pad token, the EOS token is used as padding (documented fallback)."""
    folder = Path(resolve_model_path(name, role, tokenizer=True))
    if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):  # so it holds config.json
        raise UserError(f"{role}: {name} holds a model but no tokenizer (no tokenizer_config.json, tokenizer.json or "
                        "vocab files); set `tokenizer` to the folder or id of its tokenizer")
    tokenizer = _from_pretrained(AutoTokenizer, name, role, trust_remote_code=trust_remote_code)
    return ensure_pad_token(tokenizer)


def policy_tokenizer(tokenizer, model, *, tokenizer_name: Optional[str], model_name: Optional[str],
                     trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The policy's tokenizer: `tokenizer` when one is passed (its pad token ensured); else loaded from `tokenizer_name`
    (the config's `tokenizer`), or from where the policy is: the saved path of a `model` object, a `model` path, or
    `model_name` (the config's `model`)."""
    if tokenizer is not None:
        return ensure_pad_token(tokenizer)
    if tokenizer_name:
        return load_tokenizer(tokenizer_name, trust_remote_code, "tokenizer")
    if model is not None and not isinstance(model, str):
        path = getattr(getattr(model, "config", None), "_name_or_path", None)
        if not path or not os.path.exists(path):
            raise UserError("pass `tokenizer=` (or `reward_tokenizer=`) when giving a model object without a saved path")
        return load_tokenizer(path, trust_remote_code, "model")
    return load_tokenizer(model if model is not None else model_name, trust_remote_code, "model")


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise UserError("tokenizer has neither a pad token nor an EOS token; set one and save it again")
        # Safe here because every mask is built from positions, never from `ids == pad_token_id`.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def resolve_stop_token(tokenizer: PreTrainedTokenizerBase, stop_token: str | None, stop_token_id: int | None) -> tuple[int, ...]:
    """The token ids that end a response (ppo.stop_token / ppo.stop_token_id) as every engine reads them
    (`engines.base.stop_ids`): that one, or () for none."""
    if stop_token_id is not None:
        if stop_token_id >= len(tokenizer):
            raise UserError(f"ppo.stop_token_id {stop_token_id} is outside the vocabulary ({len(tokenizer)} tokens)")
        return (stop_token_id,)
    if stop_token is None:
        return ()
    if stop_token == "eos":
        if tokenizer.eos_token_id is None:
            raise UserError("ppo.stop_token is 'eos' but the tokenizer has no EOS token; set ppo.stop_token_id")
        return (tokenizer.eos_token_id,)
    ids = tokenizer.convert_tokens_to_ids([stop_token])
    if ids[0] is None or ids[0] == tokenizer.unk_token_id:
        encoded = tokenizer(stop_token, add_special_tokens=False)["input_ids"]
        if len(encoded) != 1:
            raise UserError(f"ppo.stop_token {stop_token!r} is {len(encoded)} tokens; it must be exactly one")
        if encoded[0] == tokenizer.unk_token_id and stop_token != tokenizer.unk_token:
            raise UserError(f"ppo.stop_token {stop_token!r} is not in the tokenizer's vocabulary (it encodes as {tokenizer.unk_token!r})")
        ids = encoded
    return (ids[0],)


def load_causal_lm(name_or_model, role: str = "model", trust_remote_code: bool = False, **load_kwargs) -> PreTrainedModel:
    """`load_kwargs` go to from_pretrained (e.g. quantization_config, device_map)."""
    if isinstance(name_or_model, nn.Module):
        return name_or_model
    architectures = getattr(model_config(name_or_model, role, trust_remote_code), "architectures", None) or []
    if architectures and all(a.endswith(("ForSequenceClassification", "ForTokenClassification")) for a in architectures):
        # from_pretrained would load the backbone and a random LM head, with a warning nobody reads.
        raise UserError(
            f"{role}: {name_or_model} is a {', '.join(architectures)} (a reward or value model), not a causal LM; "
            "its language-model head would be random. Give the SFT (or base) model here; a reward model goes in reward.model"
        )
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


def value_model_from_path(path: str, trust_remote_code: bool, load_kwargs: dict) -> nn.Module:
    """The policy's checkpoint as a one-label classifier with a zero head.

    The critic's start when the policy is quantised: `value_model_from_policy` copies tensors
    from the loaded policy, which a quantised model does not allow.
    """
    model = load_scalar_model(path, "value_model", trust_remote_code, **load_kwargs)
    with torch.no_grad():
        unwrap_peft(model).score.weight.zero_()
    return model


def frozen_copy(model: nn.Module) -> nn.Module:
    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    return ref.eval()


def disable_dropout(model: nn.Module) -> None:
    """Zero every dropout probability the model uses, so that training forwards equal sampling ones.

    Dropout makes the PPO ratio differ from 1 even before any update [N+, "disable dropout"].
    Three places hold a probability: `nn.Dropout` modules; float attributes that modules copied
    from the config at construction (Llama/Qwen2 attention keeps `self.attention_dropout` and
    passes it to the attention kernel in train mode); and the config itself, read at forward time
    by some models and copied by any model built from it later (a value model from the policy's).
    """
    for module in model.modules():
        if isinstance(module, _DropoutNd):
            module.p = 0.0
        _zero_dropout_attributes(module)
    config = getattr(model, "config", None)
    if config is not None:
        _zero_dropout_attributes(config)


def _is_dropout_name(name: str) -> bool:
    # `*pdrop`: GPT-2's attn/resid/embd; `layerdrop`: OPT/BART skip whole layers at random in training.
    return "dropout" in name or name.endswith(("pdrop", "layerdrop"))


def _zero_dropout_attributes(obj, seen: Optional[set] = None) -> None:
    """Set float attributes named like a dropout probability to 0.0, in nested configs too."""
    from transformers import PretrainedConfig

    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    for name, value in list(vars(obj).items()):
        if isinstance(value, PretrainedConfig):
            _zero_dropout_attributes(value, seen)  # e.g. text_config of a multimodal config
        elif _is_dropout_name(name) and isinstance(value, (int, float)) and not isinstance(value, bool) and value:
            setattr(obj, name, 0.0)


# Config keys that hold the number of positions a model has embeddings (or was built) for, in
# the order they are looked up; GPT-2's n_positions also answers to max_position_embeddings.
POSITION_LIMIT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx", "max_seq_len")


@dataclass(frozen=True)
class PositionLimit:
    """The longest sequence (prompt + response, in tokens) a model takes, as its config states it.

    Past it, learned position embeddings index out of range (GPT-2: `IndexError` deep inside the
    model) and rotary ones run on positions the model never saw.
    """

    tokens: int
    key: str  # the config key it was read from, for messages
    role: str

    def describe(self) -> str:
        return f"the {self.role}'s position limit of {self.tokens} tokens ({self.key} in its config)"

    def rows_over(self, lengths: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
        """(where, length) of every sequence longer than the limit."""
        return [(where, n) for where, n in lengths if n > self.tokens]

    def check(self, lengths: Iterable[tuple[str, int]], what: Callable[[int], str], fix: str) -> None:
        """Refuse the first (where, length) over the limit in one line: `where: what(length), over
        <the limit>; fix (k rows are over)`."""
        over = self.rows_over(lengths)
        if over:
            where, n = over[0]
            more = f" ({len(over)} rows are over it)" if len(over) > 1 else ""
            raise UserError(f"{where}: {what(n)}, over {self.describe()}; {fix}{more}")


def position_limit(model_or_config, role: str = "model") -> Optional[PositionLimit]:
    """The model's position limit, from its (text) config; None when the config states none."""
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for key in POSITION_LIMIT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            # The key as config.json spells it (GPT-2 maps max_position_embeddings to n_positions).
            return PositionLimit(value, getattr(config, "attribute_map", {}).get(key, key), role)
    return None


def model_config(name_or_model, role: str = "model", trust_remote_code: bool = False):
    """A model object's config, or a saved model's config.json (no weights are read)."""
    if isinstance(name_or_model, nn.Module):
        return name_or_model.config
    from transformers import AutoConfig

    path = resolve_model_path(name_or_model, role)
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"{role}: could not load {name_or_model!r}: {str(e).splitlines()[0]}") from None


def position_limit_of(name_or_model, role: str = "model", trust_remote_code: bool = False) -> Optional[PositionLimit]:
    """`position_limit` of a model object or a saved model."""
    return position_limit(model_config(name_or_model, role, trust_remote_code), role)


def embedding_rows(config) -> Optional[int]:
    """The rows of a model's token embedding (vocab_size in its config), or None where the config does not say."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rows = getattr(text, "vocab_size", None)
    return rows if isinstance(rows, int) and rows > 0 else None


def input_pad_id(tokenizer, model_configs: Iterable) -> int:
    """The id at the padding positions of every model input: the tokenizer's pad token where every model
    in `model_configs` has an embedding row for it, else its EOS token, else 0. A pad token added to a
    tokenizer without resizing the embeddings is common (TRL's examples add `[PAD]`, and TRL masks pads
    to 0 before each forward). Every mask here is built from positions, never from ids, so the id at a
    masked position changes no result: it only has to be one the models can embed. Decoding still sees
    the tokenizer's own pad token."""
    rows = min((r for r in map(embedding_rows, model_configs) if r is not None), default=None)
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None and (rows is None or candidate < rows):
            return candidate
    return 0


def check_token_ids(config, role: str, sequences: Iterable[tuple[str, list[int]]], tokenizer=None) -> None:
    """Refuse a token id the model has no embedding row for (a tokenizer that is not the model's,
    or one with tokens added after the model was saved) in one line, instead of an IndexError
    (a device-side assert on CUDA) inside the model."""
    rows = embedding_rows(config)
    if rows is None:
        return
    for where, ids in sequences:
        bad = max(ids, default=-1)
        if bad >= rows:
            token = f" ({tokenizer.convert_ids_to_tokens(bad)!r})" if tokenizer is not None else ""
            size = f" of {len(tokenizer)} tokens" if tokenizer is not None else ""
            raise UserError(
                f"{where}: token id {bad}{token} is outside the {role}'s vocabulary of {rows} (vocab_size in its config): "
                f"the tokenizer{size} is not this model's; set `tokenizer` to the model's own, or resize the model's embeddings"
            )


def tightest(limits: Iterable[Optional[PositionLimit]]) -> Optional[PositionLimit]:
    """The smallest of several models' limits (the sequence goes through all of them)."""
    known = [limit for limit in limits if limit is not None]
    return min(known, key=lambda limit: limit.tokens) if known else None


def check_prompts_fit(
    model_configs: dict[str, Any],
    limit: Optional[PositionLimit],
    prompts: list[tuple[str, Any, Optional[list[list[int]]]]],
    response_length: int,
    max_prompt_length: Optional[int],
    tokenizer,
    stop_token_ids: tuple[int, ...],
) -> None:
    """Before the policy's weights load, for each model that reads the policy's token ids (`model_configs`, by role):
    every prompt id and the stop ids have an embedding row (the pad id is one they have: `input_pad_id`), and
    every prompt (after truncation) plus `response_length` fits `limit`, the tightest of their position limits
    (`tightest`; None: no config states one). One line naming the first row that does not, instead of an
    IndexError from inside the model after the first sampling.

    prompts: (config key, dataset, its encoded prompts) of each prompt set (a `prompts.PromptDataset`, which names its
    rows' places); a None dataset is skipped.
    """
    fix = prompt_room(limit, response_length, max_prompt_length) if limit is not None else ""
    prompts = [(key, dataset, encoded) for key, dataset, encoded in prompts if dataset is not None]
    special = [("ppo.stop_token_id", list(stop_token_ids))] if stop_token_ids else []
    for role, config in model_configs.items():
        rows = ((f"{key} ({dataset.where(i)})", ids) for key, dataset, encoded in prompts for i, ids in enumerate(encoded))
        check_token_ids(config, role, itertools.chain(special, rows), tokenizer)
    if limit is None:
        return
    if response_length >= limit.tokens:
        raise UserError(f"ppo.response_length {response_length} leaves no room for a prompt in {limit.describe()}; {fix}")
    limit.check(
        ((f"{key} ({dataset.where(i)})", len(ids) + response_length)
         for key, dataset, encoded in prompts for i, ids in enumerate(encoded)),
        lambda n: f"the prompt is {n - response_length} tokens; with ppo.response_length {response_length} that is {n}",
        fix,
    )


def prompt_room(limit: PositionLimit, response_length: int, max_prompt_length: Optional[int]) -> str:
    """How to make prompt + response fit `limit`: the key to set and the value that fits."""
    if response_length >= limit.tokens:
        return f"set ppo.response_length below {limit.tokens}"
    now = "null" if max_prompt_length is None else max_prompt_length
    return f"set data.max_prompt_length to at most {limit.tokens - response_length} (it is {now})"


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


def enable_gradient_checkpointing(model: nn.Module, context_fn: Optional[Callable] = None) -> None:
    """Non-reentrant gradient checkpointing of the transformers model (inside a peft wrapper, its LoRA layers included).
    context_fn: what a layer's recompute runs under, as torch.utils.checkpoint takes it (a multi-adapter PeftModel's:
    `adapters.recompute_with_active_adapter`)."""
    kwargs: dict = {"use_reentrant": False}
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    base = unwrap_peft(model)
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.x renamed it
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def same_vocabulary(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    """True when token ids mean the same strings in both tokenizers (no re-encoding needed)."""
    return a is b or (type(a) is type(b) and a.get_vocab() == b.get_vocab())


def check_teacher(path: str, tokenizer: PreTrainedTokenizerBase, trust_remote_code: bool = False) -> None:
    """`teacher`: a saved model whose tokenizer gives every token id the string the policy's gives it, and whose
    embeddings cover the policy's ids (the teacher scores the policy's sampled ids as they are); a UserError otherwise."""
    teacher = load_tokenizer(path, trust_remote_code, "teacher")
    if teacher.get_vocab() != tokenizer.get_vocab():
        theirs, ours = teacher.get_vocab(), tokenizer.get_vocab()
        differ = next((t for t in sorted(ours, key=ours.get) if theirs.get(t) != ours[t]), None)
        differ = differ if differ is not None else next(t for t in theirs if t not in ours)
        raise UserError(f"teacher: {path} has another vocabulary than the policy's tokenizer ({len(theirs)} tokens against {len(ours)}; "
                        f"{differ!r} is id {theirs.get(differ)} there, {ours.get(differ)} here): on-policy distillation scores the policy's "
                        "token ids with the teacher, so both need one tokenizer; use a teacher of the policy's family")
    size = getattr(model_config(path, "teacher", trust_remote_code), "vocab_size", None)
    if size is not None and size < len(tokenizer):
        raise UserError(f"teacher: {path} has {size} embeddings, fewer than the policy tokenizer's {len(tokenizer)} tokens")
