"""The prompts of a PPO run: training and eval datasets from the config or the caller, and their token ids."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Optional

from ppokit.config import DataConfig
from ppokit.data import PromptDataset, as_prompt_dataset, encode_prompt_text, truncate_prompt
from ppokit.errors import UserError
from ppokit.models import PositionLimit, check_token_ids, position_limit, tightest


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
    """Token ids of every prompt under the length rule's first step (`data.truncate_prompt`: cut
    from the left to `max_prompt_length`, the end is what the response continues); how many were
    cut is said once."""
    encoded, truncated = [], 0
    for i, prompt in enumerate(dataset.prompts):
        ids = encode_prompt_text(tokenizer, prompt)
        if not ids:
            raise UserError(f"{dataset.where(i)}: the prompt encodes to no tokens")
        ids, cut = truncate_prompt(ids, max_prompt_length)
        truncated += cut
        encoded.append(ids)
    if truncated:
        say(f"{key}: {truncated} of {len(encoded)} prompts longer than data.max_prompt_length={max_prompt_length} were truncated from the left")
    return encoded


def check_prompts_fit(
    model_configs: dict[str, Any],
    prompts: list[tuple[str, Optional[PromptDataset], Optional[list[list[int]]]]],
    response_length: int,
    max_prompt_length: Optional[int],
    tokenizer,
    stop_token_id: Optional[int],
) -> None:
    """Before any weights load, for each model that reads the policy's token ids (`model_configs`,
    by role): every prompt id, the pad id and the stop id have an embedding row, and every prompt
    (after truncation) plus `response_length` fits its positions. One line naming the first row
    that does not, instead of an IndexError from inside the model after the first sampling.

    prompts: (config key, dataset, its encoded prompts) of each prompt set; a None dataset is skipped.
    """
    prompts = [(key, dataset, encoded) for key, dataset, encoded in prompts if dataset is not None]
    special = [("the tokenizer's pad token", [tokenizer.pad_token_id])]
    if stop_token_id is not None:
        special.append(("ppo.stop_token_id", [stop_token_id]))
    for role, config in model_configs.items():
        rows = ((f"{key} ({dataset.where(i)})", ids) for key, dataset, encoded in prompts for i, ids in enumerate(encoded))
        check_token_ids(config, role, itertools.chain(special, rows), tokenizer)
    limit = tightest(position_limit(config, role) for role, config in model_configs.items())
    if limit is None:
        return
    if response_length >= limit.tokens:
        raise UserError(f"ppo.response_length {response_length} leaves no room for a prompt in {limit.describe()}; "
                        f"{prompt_room(limit, response_length, max_prompt_length)}")
    limit.check(
        ((f"{key} ({dataset.where(i)})", len(ids) + response_length)
         for key, dataset, encoded in prompts for i, ids in enumerate(encoded)),
        lambda n: f"the prompt is {n - response_length} tokens; with ppo.response_length {response_length} that is {n}",
        prompt_room(limit, response_length, max_prompt_length),
    )


def prompt_room(limit: PositionLimit, response_length: int, max_prompt_length: Optional[int]) -> str:
    """How to make prompt + response fit `limit`: the key to set and the value that fits."""
    if response_length >= limit.tokens:
        return f"set ppo.response_length below {limit.tokens}"
    now = "null" if max_prompt_length is None else max_prompt_length
    return f"set data.max_prompt_length to at most {limit.tokens - response_length} (it is {now})"
