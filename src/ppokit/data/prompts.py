"""The prompts of a PPO run: `PromptDataset` (prompt texts or chats, and the other columns for reward
functions), the training and eval datasets from the config or the caller, and which prompts each update takes
(`batch_indices`); their token ids are the length rule's (`lengths.encode_prompts`).

torch and the model helpers are imported where used: `ppokit data inspect` reads prompts with neither (an answer in a
second, not after the 20-30 s a loaded machine takes to import them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ppokit.conversation.templates import Messages, Renderer, Text
from ppokit.config.schema import DataConfig
from ppokit.data.formats import FORMATS_ACCEPTED, Records, alpaca_prompt, load_records, split_eval
from ppokit.data.reasoning_gym import eval_source
from ppokit.errors import UserError


@dataclass
class PromptDataset:
    """Rows of PPO prompts: `prompts[i]` is the prompt text, `columns[name][i]` any other field.

    Chat prompts (message lists) are kept in `chat` until `render_chat` turns them into text
    with the policy's tokenizer; `prompts[i]` is None until then.
    """

    prompts: list[Optional[str]]
    columns: dict[str, list[Any]]
    source: str
    chat: Optional[list[Optional[Messages]]] = None
    format: str = "prompt"
    locations: Optional[list[str]] = None  # where each row is (`file:line`), for error messages

    def __len__(self) -> int:
        return len(self.prompts)

    def where(self, i: int) -> str:
        """`file:line` (or `source: row n`, from 1) of prompt i (0-based)."""
        return self.locations[i] if self.locations is not None else f"{self.source}: row {i + 1}"

    def rows(self, indices) -> tuple[list[str], dict[str, list[Any]]]:
        idx = [int(i) for i in indices]
        return [self.prompts[i] for i in idx], {k: [v[i] for i in idx] for k, v in self.columns.items()}

    def subset(self, indices: list[int]) -> "PromptDataset":
        chat = [self.chat[i] for i in indices] if self.chat is not None else None
        prompts, columns = self.rows(indices)
        locations = [self.where(i) for i in indices]
        return PromptDataset(prompts, columns, self.source, chat, self.format, locations)

    def split(self, fraction: float, seed: int) -> tuple["PromptDataset", "PromptDataset"]:
        """(train, eval) by a seeded shuffle, as `split_eval`."""
        train, held = split_eval(list(range(len(self))), fraction, seed)
        return self.subset(train), self.subset(held)

    def row(self, i: int) -> dict[str, Any]:
        """Row i's columns other than the prompt, by name."""
        return {name: values[i] for name, values in self.columns.items()}

    def render_chat(self, renderer: Renderer, tools: Optional[list[Optional[list[dict]]]] = None) -> None:
        """Render chat prompts with a generation prompt (tools: each row's own tools; None: the renderer's); no-op for
        text prompts."""
        if self.chat is None:
            return
        for i, messages in enumerate(self.chat):
            if messages is not None:
                self.prompts[i] = renderer.prompt(messages) if tools is None else renderer.prompt(messages, tools=tools[i] or [])
        self.chat = None


def render_chat_prompts(tokenizer, chat_template: Optional[str], *datasets_: Optional[PromptDataset]) -> Optional[str]:
    """Render every chat prompt of the given datasets; -> the template used, or None if none was needed."""
    renderer = Renderer(tokenizer, chat_template)
    for dataset in datasets_:
        if dataset is not None:
            dataset.render_chat(renderer)
    return renderer.template_used


def prompt_dataset_from_records(records: Records) -> PromptDataset:
    """Any format with a prompt -> PromptDataset. Every column except the prompt column goes to
    reward functions (a `messages` chat minus a final assistant turn is the prompt; the full
    conversation stays available as the `messages` column)."""
    prompts, chat = [], []
    for i, row in enumerate(records.rows):
        if records.format == "alpaca":
            value: Text = alpaca_prompt(row)
        elif records.format == "messages":
            value = row["messages"][:-1] if row["messages"][-1]["role"] == "assistant" else row["messages"]
            if not value:
                raise UserError(f"{records.where(i)}: the conversation is a single assistant message; there is no prompt")
        else:
            value = row.get("prompt")
            if value is None:
                raise UserError(f"{records.where(i)}: a PPO prompt needs a prompt column; formats accepted: {FORMATS_ACCEPTED}")
        if isinstance(value, str) and not value.strip():
            # Found here, before any model loads: the policy would have nothing to continue.
            raise UserError(f"{records.where(i)}: the prompt is empty")
        prompts.append(value if isinstance(value, str) else None)
        chat.append(None if isinstance(value, str) else value)
    other = [c for c in records.columns if c != "prompt"]
    columns = {k: [row.get(k) for row in records.rows] for k in other}
    has_chat = any(c is not None for c in chat)
    locations = [records.where(i) for i in range(len(records))]
    return PromptDataset(prompts, columns, records.source, chat if has_chat else None, records.format, locations)


def as_prompt_dataset(data, prompt_field: str = "prompt", format: str = "auto") -> PromptDataset:
    """Accepts a PromptDataset, a path or hub name, a list of strings or dicts, or a `datasets.Dataset`."""
    if isinstance(data, PromptDataset):
        return data
    return prompt_dataset_from_records(load_records(data, format, prompt_field))


def load_prompt_data(data: DataConfig, seed: int, train_dataset=None, eval_dataset=None) -> tuple[PromptDataset, Optional[PromptDataset]]:
    """(train, eval) prompts: the datasets passed in, else data.train / data.eval, each read the same way; without
    eval prompts, data.eval_fraction of the training prompts held out by a seeded shuffle (a reasoning_gym eval spec
    without a seed starts after the training entries: `reasoning_gym.eval_source`). A conflict between the
    arguments and the config is refused before anything is read."""
    if train_dataset is None and data.train is None:
        raise UserError("data.train: required")
    if eval_dataset is not None and data.eval_fraction:
        raise UserError("data.eval_fraction holds out training prompts for evaluation, but eval_dataset is given too; use one of them")
    train_source = train_dataset if train_dataset is not None else data.train
    sources = (train_source, eval_source(train_source, eval_dataset if eval_dataset is not None else data.eval))
    train, evaluation = (as_prompt_dataset(source, data.prompt_field, data.format) if source is not None else None for source in sources)
    if evaluation is None and data.eval_fraction:
        train, evaluation = train.split(data.eval_fraction, seed)
    return train, evaluation


def batch_indices(update: int, num_prompts: int, prompts_per_update: int, seed: int, rank: int = 0, world: int = 1) -> list[int]:
    """Prompt indices of update `update` (0-based) on process `rank` of `world`: a shuffle seeded with seed + pass
    per pass over the `num_prompts` prompts, `prompts_per_update` of them per update (a batch may span two passes).
    Each process takes whole prompts and samples all n responses of each (docs/algorithms.md). The order depends on
    (seed, update) alone, so the update counter is the data position on resume."""
    import torch

    start, indices = update * prompts_per_update, []
    while len(indices) < prompts_per_update:
        epoch, offset = divmod(start + len(indices), num_prompts)
        order = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        indices.extend(order[offset : offset + prompts_per_update - len(indices)])
    return indices[rank::world]
