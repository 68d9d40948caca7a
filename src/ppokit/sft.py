"""Supervised fine-tuning on prompt/completion pairs: the loop itself, without file handling.

The loss is the mean cross-entropy over completion tokens only (prompt tokens are masked with
-100), with the EOS token appended so the model learns to stop.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch.nn.utils.rnn import pad_sequence

IGNORE_INDEX = -100


def encode_pair(tokenizer, prompt: str, completion: str, completion_only_loss: bool = True, max_length: Optional[int] = None):
    """-> (input_ids, labels) lists; labels are IGNORE_INDEX on the prompt when completion_only_loss."""
    prompt_ids = tokenizer(prompt)["input_ids"]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    input_ids = prompt_ids + completion_ids
    labels = ([IGNORE_INDEX] * len(prompt_ids) if completion_only_loss else list(prompt_ids)) + completion_ids
    if max_length is not None:
        input_ids, labels = input_ids[:max_length], labels[:max_length]
    return input_ids, labels


def collate(examples: list[tuple[list[int], list[int]]], pad_token_id: int):
    """Right-padded (input_ids, attention_mask, labels), each (B, L)."""
    ids = pad_sequence([torch.tensor(e[0]) for e in examples], batch_first=True, padding_value=pad_token_id)
    labels = pad_sequence([torch.tensor(e[1]) for e in examples], batch_first=True, padding_value=IGNORE_INDEX)
    mask = pad_sequence([torch.ones(len(e[0]), dtype=torch.long) for e in examples], batch_first=True, padding_value=0)
    return ids, mask, labels


def completion_loss(model, ids, mask, labels) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX)


@torch.no_grad()
def evaluate_loss(model, examples, pad_token_id: int, batch_size: int = 32) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        ids, mask, labels = collate(chunk, pad_token_id)
        n = int((labels[:, 1:] != IGNORE_INDEX).sum())
        total += completion_loss(model, ids, mask, labels).item() * n
        count += n
    model.train()
    return total / max(count, 1)


def train_sft(
    model,
    examples: list[tuple[list[int], list[int]]],
    pad_token_id: int,
    *,
    epochs: float = 1.0,
    batch_size: int = 16,
    learning_rate: float = 1e-3,
    seed: int = 0,
    on_step: Optional[Callable[[int, int, float], None]] = None,
) -> list[float]:
    """AdamW with linear decay over `epochs` passes of seeded shuffles; returns the loss per step."""
    generator = torch.Generator().manual_seed(seed)
    steps_per_epoch = math.ceil(len(examples) / batch_size)
    total_steps = max(1, int(steps_per_epoch * epochs))
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / total_steps))
    model.train()
    losses, step = [], 0
    while step < total_steps:
        order = torch.randperm(len(examples), generator=generator).tolist()
        for i in range(0, len(order), batch_size):
            if step >= total_steps:
                break
            ids, mask, labels = collate([examples[j] for j in order[i : i + batch_size]], pad_token_id)
            loss = completion_loss(model, ids, mask, labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            step += 1
            if on_step is not None:
                on_step(step, total_steps, losses[-1])
    model.eval()
    return losses
