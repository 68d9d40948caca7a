"""benchmarks/profile_update.py's arithmetic floor: the FLOPs it counts for a forward, by hand for a tiny Llama."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import profile_update  # noqa: E402

from ppokit.demos.tiny import tiny_causal_lm, word_tokenizer  # noqa: E402


def test_forward_flops_count_the_linear_weights_the_head_at_scored_positions_and_attention():
    tokenizer = word_tokenizer(["a b c d e f g h"])
    torch.manual_seed(0)
    model = tiny_causal_lm("llama", tokenizer, hidden=16, layers=2, heads=4)
    # tiny_config: intermediate 2 x hidden, key/value heads half the heads (head_dim 4: k and v project 16 -> 8), tied head
    h, layers, inner, kv, vocab = 16, 2, 32, 8, model.config.vocab_size
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * inner  # q, k, v, o; gate, up, down
    assert profile_update.linear_weights(model) == (layers * per_layer, vocab * h)  # the embedding lookup is free
    lengths, scored = [3, 5], 4
    expected = 2 * layers * per_layer * 8 + 2 * vocab * h * scored + 2 * layers * h * (3 * 3 + 5 * 5)
    assert profile_update.forward_flops(model, lengths, scored) == expected


def test_a_value_model_counts_its_one_output_head_in_the_body():
    from transformers import AutoModelForSequenceClassification

    from ppokit.demos.tiny import tiny_config

    tokenizer = word_tokenizer(["a b c"])
    config = tiny_config("llama", tokenizer, hidden=16, layers=1, heads=4)
    config.num_labels = 1
    model = AutoModelForSequenceClassification.from_config(config)
    body, head = profile_update.linear_weights(model)
    assert head == 0 and body == 16 * 16 + 2 * 16 * 8 + 16 * 16 + 3 * 16 * 32 + 16  # the score head: 16 -> 1
