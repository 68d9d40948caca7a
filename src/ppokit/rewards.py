"""Reward sources: Python functions and reward models behind one small Protocol.

A source takes a ScoringBatch (texts, extra dataset columns, and the policy's token ids) and
returns one float per row. The trainer combines sources with weights and logs each raw score
as `reward/<name>`.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

import torch

from ppokit.errors import UserError
from ppokit.models import left_pad, same_vocabulary, score_at_last_token


@dataclass
class ScoringBatch:
    """What a reward source sees for B episodes."""

    prompts: list[str]  # B prompt texts, as given in the data
    completions: list[str]  # B completion texts, decoded without special tokens, cut at the stop token
    columns: dict[str, list[Any]] = field(default_factory=dict)  # other dataset columns, B values each
    input_ids: Optional[torch.Tensor] = None  # (B, L) prompt + response in the policy's tokenizer
    attention_mask: Optional[torch.Tensor] = None  # (B, L) long
    tokenizer: Any = None  # the policy's tokenizer


class RewardSource(Protocol):
    name: str

    def __call__(self, batch: ScoringBatch) -> torch.Tensor:
        """-> (B,) float32 scores."""
        ...


def _check_scores(values, batch: ScoringBatch, name: str) -> torch.Tensor:
    try:
        scores = torch.as_tensor([float(v) for v in values], dtype=torch.float32)
    except (TypeError, ValueError) as e:
        raise UserError(f"reward function {name} returned something that is not a list of numbers: {e}") from None
    if scores.shape[0] != len(batch.completions):
        raise UserError(
            f"reward function {name} returned {scores.shape[0]} scores for {len(batch.completions)} completions"
        )
    bad = (~torch.isfinite(scores)).nonzero().flatten()
    if bad.numel():
        row = int(bad[0])
        raise UserError(
            f"reward function {name} returned {scores[row].item()} for row {row} "
            f"(prompt {batch.prompts[row]!r}, completion {batch.completions[row]!r})"
        )
    return scores


@dataclass
class FunctionReward:
    """A Python function fn(prompts, completions, **columns) -> list[float] (sync or async)."""

    fn: Callable
    name: str

    def __call__(self, batch: ScoringBatch) -> torch.Tensor:
        try:
            result = self.fn(batch.prompts, batch.completions, **batch.columns)
            if inspect.isawaitable(result):
                result = asyncio.run(_await(result))
        except UserError:
            raise
        except Exception as e:
            raise UserError(
                f"reward function {self.name} raised {type(e).__name__}: {e} "
                f"(first row: prompt {batch.prompts[0]!r}, completion {batch.completions[0]!r})"
            ) from e
        return _check_scores(result, batch, self.name)


async def _await(awaitable):
    return await awaitable


@dataclass
class RewardModelReward:
    """A one-label sequence classifier, scored at the last real token of prompt + completion.

    When its tokenizer has the policy's vocabulary the policy's token ids are scored as they are;
    otherwise the texts are re-encoded with the reward model's own tokenizer.
    """

    model: torch.nn.Module
    tokenizer: Any
    name: str = "reward_model"
    batch_size: int = 64

    @torch.inference_mode()
    def __call__(self, batch: ScoringBatch) -> torch.Tensor:
        device = next(self.model.parameters()).device
        if batch.input_ids is not None and same_vocabulary(self.tokenizer, batch.tokenizer):
            ids, mask = batch.input_ids, batch.attention_mask
        else:
            texts = [p + c for p, c in zip(batch.prompts, batch.completions)]
            encoded = [self.tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]
            ids, mask = left_pad(encoded, self.tokenizer.pad_token_id)
        scores = [
            score_at_last_token(self.model, ids[i : i + self.batch_size].to(device), mask[i : i + self.batch_size].to(device))
            for i in range(0, ids.shape[0], self.batch_size)
        ]
        return torch.cat(scores).float().cpu()


# --------------------------------------------------------------------------- built-ins


def sentiment(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """VADER compound sentiment of each completion, in [-1, 1] (vaderSentiment ships its lexicon)."""
    return [_vader().polarity_scores(text)["compound"] for text in completions]


_VADER = None


def _vader():
    global _VADER
    if _VADER is None:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        _VADER = SentimentIntensityAnalyzer()
    return _VADER


BUILTINS: dict[str, Callable] = {"sentiment": sentiment}


def load_function(spec: str, base_dir: Path | None = None) -> tuple[str, Callable]:
    """`name` (built-in), `path/to/file.py:fn` or `package.module:fn` -> (display name, callable)."""
    if spec in BUILTINS:
        return spec, BUILTINS[spec]
    if ":" not in spec:
        raise UserError(
            f"reward function {spec!r}: expected a built-in ({', '.join(BUILTINS)}), 'file.py:function' or 'module:function'"
        )
    target, fn_name = spec.rsplit(":", 1)
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_absolute() and base_dir is not None and not path.exists():
            path = base_dir / path
        if not path.is_file():
            raise UserError(f"reward function {spec!r}: file {target} not found")
        module_name = f"ppokit_user_reward_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            raise UserError(f"reward function {spec!r}: importing {path} raised {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise UserError(f"reward function {spec!r}: cannot import module {target}: {e}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise UserError(f"reward function {spec!r}: {target} has no function {fn_name}")
    return fn_name, fn


def combine(sources: list[RewardSource], weights: list[float], batch: ScoringBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted sum of every source's score -> (scores (B,), {name: raw scores (B,)})."""
    raw = {}
    total = torch.zeros(len(batch.completions))
    for source, weight in zip(sources, weights):
        scores = source(batch)
        raw[_unique(source.name, raw)] = scores
        total = total + weight * scores
    return total, raw


def _unique(name: str, taken: dict) -> str:
    if name not in taken:
        return name
    i = 2
    while f"{name}_{i}" in taken:
        i += 1
    return f"{name}_{i}"


def is_finite_list(values) -> bool:
    return all(math.isfinite(v) for v in values)
