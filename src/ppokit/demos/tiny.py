"""Small real tokenizers and models built locally, for the demo, the tests and the benchmarks.

Nothing here downloads anything: the tokenizer is trained with `tokenizers` on given texts,
the models are built from configs with random weights.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional

from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

SPECIAL_TOKENS = {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>"}


def word_tokenizer(texts: Iterable[str], min_frequency: int = 1) -> PreTrainedTokenizerFast:
    """A word-level tokenizer (whitespace and punctuation split) with distinct pad/eos/bos/unk."""
    tok = Tokenizer(models.WordLevel(unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    trainer = trainers.WordLevelTrainer(special_tokens=list(SPECIAL_TOKENS.values()), min_frequency=min_frequency)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS, clean_up_tokenization_spaces=False)


def spaced_tokenizer(texts: Iterable[str]) -> PreTrainedTokenizerFast:
    """A tokenizer for text whose tokens are separated by spaces, such as JSON written `{ "a" : 74 }`: each
    space-separated word of `texts` is one token, but a number is one token per digit (`7`, then `##4`, a continuation
    written back without a space), so 20 tokens read and write every number. A word that starts with a number, such
    as `25);`, is that number's digits and what follows them as a continuation (`##);`): any other number reads
    before it too. Decoding joins the words with one space: such text decodes back to itself. pad/eos/bos/unk as
    `word_tokenizer`'s."""
    from tokenizers import decoders

    special = list(SPECIAL_TOKENS.values())
    digits = [str(d) for d in range(10)] + [f"##{d}" for d in range(10)]
    words = set()
    for word in (w for text in texts for w in text.split()):
        number = re.match(r"-?\d+", word)
        words.add(word if number is None else "##" + word[number.end():] if number.end() < len(word) else "")
        words.add("-" if number is not None and word.startswith("-") else "")  # a minus sign, then the digits
    words = sorted(words - {""} - set(special) - set(digits))
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(special + digits + words)}, unk_token=SPECIAL_TOKENS["unk_token"],
                                     max_input_chars_per_word=100))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS, clean_up_tokenization_spaces=False)


def bpe_tokenizer(texts: Iterable[str], vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer: a different vocabulary from `word_tokenizer` for the same texts."""
    from tokenizers import decoders

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[SPECIAL_TOKENS[k] for k in ("pad_token", "eos_token", "bos_token")],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", clean_up_tokenization_spaces=False
    )


def tiny_config(
    arch: str, tokenizer, hidden: int = 64, layers: int = 2, heads: int = 4, max_positions: int = 256,
    dropout: Optional[float] = None,
):
    """A model config of architecture `arch` (gpt2, llama, qwen2) sized for CPU tests; `dropout`
    (default: the architecture's own defaults) goes to every dropout probability its config has."""
    drop = {} if dropout is None else (
        dict(attn_pdrop=dropout, resid_pdrop=dropout, embd_pdrop=dropout, summary_first_dropout=dropout)
        if arch == "gpt2" else dict(attention_dropout=dropout)
    )
    ids = dict(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    if arch == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=max_positions, **drop, **ids)
    common = dict(
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        **drop,
        **ids,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    raise ValueError(f"unknown tiny architecture {arch!r}; use gpt2, llama or qwen2")


def tiny_causal_lm(arch: str, tokenizer, **sizes):
    return AutoModelForCausalLM.from_config(tiny_config(arch, tokenizer, **sizes))
