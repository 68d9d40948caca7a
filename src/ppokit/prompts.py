"""The prompts of a PPO run: training and eval datasets from the config or the caller, and their token ids."""

from __future__ import annotations

from typing import Callable, Optional

from ppokit.config import DataConfig
from ppokit.data import PromptDataset, as_prompt_dataset
from ppokit.errors import UserError


def load_prompt_data(data: DataConfig, seed: int, train_dataset=None, eval_dataset=None) -> tuple[PromptDataset, Optional[PromptDataset]]:
    """(train, eval) prompts: the datasets passed in, else data.train / data.eval; without eval
    prompts, data.eval_fraction of the training prompts held out by a seeded shuffle."""
    if train_dataset is None and data.train is None:
        raise UserError("data.train: required")
    train = as_prompt_dataset(train_dataset if train_dataset is not None else data.train, data.prompt_field, data.format)
    if eval_dataset is not None and data.eval_fraction:
        raise UserError("data.eval_fraction holds out training prompts for evaluation, but eval_dataset is given too; use one of them")
    eval_source = eval_dataset if eval_dataset is not None else data.eval
    evaluation = as_prompt_dataset(eval_source, data.prompt_field, data.format) if eval_source is not None else None
    if evaluation is None and data.eval_fraction:
        train, evaluation = train.split(data.eval_fraction, seed)
    return train, evaluation


def encode_prompts(tokenizer, dataset: PromptDataset, max_prompt_length: Optional[int], key: str, say: Callable[[str], None]) -> list[list[int]]:
    """Token ids of every prompt, cut from the left to `max_prompt_length` (the end is what the
    response continues); how many were cut is said once."""
    encoded, truncated = [], 0
    for i, prompt in enumerate(dataset.prompts):
        ids = tokenizer(prompt)["input_ids"]
        if not ids:
            raise UserError(f"{dataset.where(i)}: the prompt encodes to no tokens")
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            ids = ids[-max_prompt_length:]
            truncated += 1
        encoded.append(ids)
    if truncated:
        say(f"{key}: {truncated} of {len(encoded)} prompts longer than data.max_prompt_length={max_prompt_length} were truncated from the left")
    return encoded
