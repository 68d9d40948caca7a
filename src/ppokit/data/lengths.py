"""The length rule, decided once: how sft and rm rows and PPO prompts are encoded and fitted to
`max_prompt_length` / `max_length` (`encode_row(s)`; PPO prompts `encode_prompts`, `truncate_prompt`), and what it
did (`LengthReport`); the longest row a PPO run can produce, checked against its micro-batch token budget before any
model loads (`check_budget`). docs/data.md states the rule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from ppokit.conversation.templates import Renderer, Text
from ppokit.errors import UserError


def tokenize_pair(tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """-> (prompt ids with the tokenizer's special tokens, completion ids ending with EOS).

    Prompt and completion are encoded separately, as PPO samples completions after the prompt's
    tokens. EOS is appended unless the completion already ends with it (some chat templates write it).
    """
    if tokenizer.eos_token_id is None:
        raise UserError(
            "the tokenizer has no EOS token; every completion ends with EOS so that the model learns to stop: "
            "set the tokenizer's eos_token and save it again (or give another `tokenizer`)"
        )
    prompt_ids = encode_prompt_text(tokenizer, prompt)
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    if not completion_ids or completion_ids[-1] != tokenizer.eos_token_id:
        completion_ids = completion_ids + [tokenizer.eos_token_id]
    return prompt_ids, completion_ids


def encode_prompt_text(tokenizer, prompt: str) -> list[int]:
    """A prompt's token ids, the tokenizer's special tokens included: what every stage and PPO encode."""
    return tokenizer(prompt)["input_ids"]


def truncate_prompt(prompt_ids: list[int], max_prompt_length: Optional[int]) -> tuple[list[int], bool]:
    """Rule 1 of the length rule: a prompt over max_prompt_length keeps its last tokens (the end is
    what the completion continues) -> (ids, truncated?). PPO prompts follow only this rule."""
    if max_prompt_length is not None and len(prompt_ids) > max_prompt_length:
        return prompt_ids[-max_prompt_length:], True
    return prompt_ids, False


def encode_prompts(tokenizer, datasets: Mapping[str, Any], max_prompt_length: Optional[int],
                   say: Callable[[str], None]) -> list[Optional[list[list[int]]]]:
    """The token ids of every PPO prompt of each of `datasets` (its config key, e.g. data.train -> a
    `prompts.PromptDataset`; None: none, and None back) under rule 1 (`truncate_prompt`), in their order; how many
    of a dataset's prompts were cut is said once, with its key. A prompt that encodes to no tokens is an error naming its row."""
    encoded_sets = []
    for key, dataset in datasets.items():
        if dataset is None:
            encoded_sets.append(None)
            continue
        encoded, truncated = [], 0
        for i, prompt in enumerate(dataset.prompts):
            ids = encode_prompt_text(tokenizer, prompt)
            if not ids:
                raise UserError(f"{dataset.where(i)}: the prompt encodes to no tokens")
            ids, cut = truncate_prompt(ids, max_prompt_length)
            truncated += cut
            encoded.append(ids)
        if truncated:
            say(f"{key}: {truncated} of {len(encoded)} prompts longer than data.max_prompt_length={max_prompt_length} were truncated "
                "from the left (their start is cut: a chat template's system prompt, with an environment's tools their schemas)")
        encoded_sets.append(encoded)
    return encoded_sets


class BudgetTooSmall(UserError):
    """A single row is wider than the token budget (a user's setting, so a UserError naming both numbers)."""


def longest_row(prompt_token_counts: list[int], response_length: int) -> int:
    """The widest row a run can produce: its longest prompt and a full-length response."""
    return (max(prompt_token_counts) if prompt_token_counts else 0) + response_length


def check_budget(max_tokens: Optional[int], prompt_token_counts: list[int], response_length: int) -> None:
    """Before any model loads: a micro-batch token budget (ppo.max_tokens_per_micro_batch, `batching`) below the longest
    row the run can produce is an error naming both numbers."""
    if max_tokens is None:
        return
    longest = longest_row(prompt_token_counts, response_length)
    if max_tokens < longest:
        raise BudgetTooSmall(
            f"ppo.max_tokens_per_micro_batch={max_tokens} is smaller than the longest row this run can produce "
            f"({longest} tokens: the longest prompt, {longest - response_length} tokens, + ppo.response_length "
            f"{response_length}); raise it to at least {longest} or shorten prompts with data.max_prompt_length"
        )


@dataclass
class LengthReport:
    """What the length rule did to a set of rows (reported by every stage and `data inspect`).

    prompts_truncated counts every row whose prompt was truncated (dropped ones too);
    completions_cut counts kept rows with a completion cut; dropped, rows left out, of which
    identical_pairs are preference pairs whose chosen and rejected were the same already in the data.
    """

    rows: int = 0
    prompts_truncated: int = 0
    completions_cut: int = 0
    dropped: int = 0
    identical_pairs: int = 0

    def add(self, prompt_truncated: bool, completion_cut: bool = False, dropped: bool = False, identical: bool = False) -> None:
        self.rows += 1
        self.prompts_truncated += prompt_truncated
        self.completions_cut += completion_cut
        self.dropped += dropped
        self.identical_pairs += identical

    def add_row(self, row: "EncodedRow") -> None:
        self.add(row.prompt_truncated, row.completion_cut, row.dropped, row.identical)

    def describe(self, max_prompt_length, max_length) -> str:
        identical = f" ({self.identical_pairs} of them pairs whose chosen and rejected are the same)" if self.identical_pairs else ""
        return (
            f"{self.prompts_truncated} of {self.rows} prompts over max_prompt_length={max_prompt_length} truncated "
            f"from the left, {self.completions_cut} completions cut at max_length={max_length}, {self.dropped} rows dropped"
            f"{identical}"
        )


def fit_lengths(
    prompt_ids: list[int], completion_ids: list[int], max_prompt_length: Optional[int], max_length: Optional[int]
) -> tuple[Optional[tuple[list[int], list[int]]], bool, bool]:
    """The length rule on one sequence -> ((prompt_ids, completion_ids) or None when dropped,
    prompt truncated?, completion cut?).

    1. A prompt over max_prompt_length keeps its last max_prompt_length tokens (truncated from
       the left: the end is what the completion continues).
    2. A prompt + completion over max_length has its completion cut on the right.
    3. A row whose prompt leaves no room for a completion token is dropped.
    """
    prompt_ids, prompt_cut = truncate_prompt(prompt_ids, max_prompt_length)
    completion_cut = False
    if max_length is not None and len(prompt_ids) + len(completion_ids) > max_length:
        room = max_length - len(prompt_ids)
        if room < 1:
            return None, prompt_cut, False
        completion_ids, completion_cut = completion_ids[:room], True
    return (prompt_ids, completion_ids), prompt_cut, completion_cut


@dataclass
class EncodedRow:
    """One sft or rm row under the length rule.

    raw: (prompt ids, completion ids) per completion as encoded, before the rule;
    fitted: the same after it, or None when the row is dropped.
    """

    where: str
    texts: list[tuple[str, str]]  # (prompt text, completion text) per completion, as rendered
    raw: list[tuple[list[int], list[int]]]
    fitted: Optional[list[tuple[list[int], list[int]]]]
    prompt_truncated: bool
    any_completion_cut: bool

    @property
    def dropped(self) -> bool:
        return self.fitted is None

    @property
    def identical(self) -> bool:
        """Several completions that were the same before any cut (a preference pair with nothing to prefer)."""
        return len(self.raw) > 1 and all(r == self.raw[0] for r in self.raw[1:])

    @property
    def completion_cut(self) -> bool:
        """A kept row with a completion cut (a dropped row counts as dropped only)."""
        return self.any_completion_cut and not self.dropped

    @property
    def sequences(self) -> list[list[int]]:
        """prompt + completion ids of each completion, after the rule (the row must be kept)."""
        return [p + c for p, c in self.fitted]


def encode_row(
    renderer: Renderer, tokenizer, prompt: Text, completions: list[Text], where: str,
    max_prompt_length: Optional[int], max_length: Optional[int],
) -> EncodedRow:
    """Render, encode and fit one row with one or more completions (sft: one; rm: chosen, rejected).

    Every (prompt, completion) follows `fit_lengths`; the row is dropped when any is dropped, or,
    with several completions, when cutting made them identical (no preference left to learn).
    Used by `ppokit sft`, `ppokit rm` and `ppokit data inspect`, so their counts agree.
    """
    texts = render_row(renderer, prompt, completions, where)
    raw = [tokenize_pair(tokenizer, prompt_text, completion_text) for prompt_text, completion_text in texts]
    fits = [fit_lengths(p, c, max_prompt_length, max_length) for p, c in raw]
    fitted: Optional[list] = [f for f, _, _ in fits]
    if any(f is None for f in fitted) or (len(fitted) > 1 and all(f == fitted[0] for f in fitted[1:])):
        fitted = None
    return EncodedRow(
        where, texts, raw, fitted, prompt_truncated=any(p for _, p, _ in fits), any_completion_cut=any(c for _, _, c in fits)
    )


def render_row(renderer: Renderer, prompt: Text, completions: list[Text], where: str) -> list[tuple[str, str]]:
    """(prompt text, completion text) per completion, as the model sees them."""
    return [renderer.pair(prompt, completion, where) for completion in completions]


def encode_rows(
    items: list[tuple[str, tuple]], renderer: Renderer, tokenizer, max_prompt_length: Optional[int],
    max_length: Optional[int],
) -> tuple[list[EncodedRow], LengthReport]:
    """(where, (prompt, *completions)) items -> (kept rows, what the rule did)."""
    kept, report = [], LengthReport()
    for where, (prompt, *completions) in items:
        row = encode_row(renderer, tokenizer, prompt, completions, where, max_prompt_length, max_length)
        report.add_row(row)
        if not row.dropped:
            kept.append(row)
    return kept, report
