"""Supervised fine-tuning on prompt/completion pairs: the loop itself, without file handling.

The loss is the mean cross-entropy over completion tokens only (prompt tokens are masked with
-100) unless `completion_only_loss` is off, with the EOS token appended so the model learns to
stop. `train_loop` is the optimisation loop shared with the reward-model stage.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch.nn.utils.rnn import pad_sequence

from ppokit.data.lengths import tokenize_pair

IGNORE_INDEX = -100


def build_example(prompt_ids: list[int], completion_ids: list[int], completion_only_loss: bool = True):
    """-> (input_ids, labels) lists; labels are IGNORE_INDEX on the prompt when completion_only_loss."""
    labels = ([IGNORE_INDEX] * len(prompt_ids) if completion_only_loss else list(prompt_ids)) + list(completion_ids)
    return list(prompt_ids) + list(completion_ids), labels


def encode_pair(tokenizer, prompt: str, completion: str, completion_only_loss: bool = True):
    """Text -> (input_ids, labels) with no length limit (`ppokit sft` applies the length rule
    through `data.encode_row` first); labels are IGNORE_INDEX on the prompt when completion_only_loss."""
    return build_example(*tokenize_pair(tokenizer, prompt, completion), completion_only_loss)


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
    """Mean cross-entropy per labelled token over `examples`."""
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        ids, mask, labels = (t.to(device) for t in collate(chunk, pad_token_id))
        n = int((labels[:, 1:] != IGNORE_INDEX).sum())
        total += completion_loss(model, ids, mask, labels).item() * n
        count += n
    model.train()
    return total / max(count, 1)


def train_loop(
    model,
    examples: list,
    loss_fn: Callable[[torch.nn.Module, list], torch.Tensor],
    *,
    epochs: float = 1.0,
    batch_size: int = 16,
    learning_rate: float = 1e-3,
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
    seed: int = 0,
    on_step: Optional[Callable[[int, int, float], None]] = None,
    evaluate: Optional[Callable[[], dict]] = None,
    eval_every: int = 0,
    on_eval: Optional[Callable[[int, dict], None]] = None,
) -> list[float]:
    """AdamW with linear decay over `epochs` passes of seeded shuffles; returns the loss per step.

    `loss_fn(model, batch_of_examples)` gives the loss of one batch. `evaluate()` runs every
    `eval_every` steps (0: never in between) and after the last step; its result goes to `on_eval`.
    """
    generator = torch.Generator().manual_seed(seed)
    steps_per_epoch = math.ceil(len(examples) / batch_size)
    total_steps = max(1, int(steps_per_epoch * epochs))
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / total_steps))
    model.train()
    losses, step = [], 0
    while step < total_steps:
        order = torch.randperm(len(examples), generator=generator).tolist()
        for i in range(0, len(order), batch_size):
            if step >= total_steps:
                break
            loss = loss_fn(model, [examples[j] for j in order[i : i + batch_size]])
            loss.backward()
            if max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            step += 1
            if on_step is not None:
                on_step(step, total_steps, losses[-1])
            if evaluate is not None and (step == total_steps or (eval_every and step % eval_every == 0)):
                metrics = evaluate()
                model.train()
                if on_eval is not None:
                    on_eval(step, metrics)
    model.eval()
    return losses


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
    eval_examples: Optional[list[tuple[list[int], list[int]]]] = None,
    eval_every: int = 0,
    eval_batch_size: int = 32,
    on_eval: Optional[Callable[[int, dict], None]] = None,
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
) -> list[float]:
    """SFT with `train_loop`; with `eval_examples`, `on_eval(step, {"eval_loss": ...})` gets the held-out loss."""
    device = next(model.parameters()).device

    def loss_fn(model, batch):
        ids, mask, labels = (t.to(device) for t in collate(batch, pad_token_id))
        return completion_loss(model, ids, mask, labels)

    evaluate = (lambda: {"eval_loss": evaluate_loss(model, eval_examples, pad_token_id, eval_batch_size)}) if eval_examples else None
    return train_loop(
        model, examples, loss_fn, epochs=epochs, batch_size=batch_size, learning_rate=learning_rate,
        weight_decay=weight_decay, max_grad_norm=max_grad_norm, seed=seed, on_step=on_step,
        evaluate=evaluate, eval_every=eval_every, on_eval=on_eval,
    )
