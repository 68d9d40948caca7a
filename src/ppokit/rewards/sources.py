"""What every reward source shares: the batch it scores, the Protocol, and Python functions as sources.

A source takes a ScoringBatch (texts, extra dataset columns, and the policy's token ids) and
returns one score per row. Scores are checked in one place (`check_scores`) so every kind of
source fails the same way: an error naming the source and an example row, never a silent 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, runtime_checkable

import torch

from ppokit.errors import UserError


@dataclass
class ScoringBatch:
    """What a reward source sees for B episodes. Only the texts are always there."""

    prompts: list[str]  # B prompt texts, as given in the data
    completions: list[str]  # B completion texts, decoded without special tokens, cut at the stop token
    columns: dict[str, list[Any]] = field(default_factory=dict)  # other dataset columns, B values each
    input_ids: Optional[torch.Tensor] = None  # (B, L) prompt + response in the policy's tokenizer
    attention_mask: Optional[torch.Tensor] = None  # (B, L) long, 1 on real tokens (any padding side)
    tokenizer: Any = None  # the policy's tokenizer
    completion_ids: Optional[list[list[int]]] = None  # B completions in policy tokens, stop token not included
    ended: Optional[torch.Tensor] = None  # (B,) bool: the response produced the stop token; None: no stop token

    def __len__(self) -> int:
        return len(self.completions)

    def select(self, rows: list[int]) -> "ScoringBatch":
        """The sub-batch of `rows`, every field that is set."""
        pick = lambda seq: None if seq is None else [seq[i] for i in rows]  # noqa: E731
        index = torch.tensor(rows, dtype=torch.long)
        take = lambda t: None if t is None else t[index.to(t.device)]  # noqa: E731
        return ScoringBatch(
            prompts=pick(self.prompts),
            completions=pick(self.completions),
            columns={k: pick(v) for k, v in self.columns.items()},
            input_ids=take(self.input_ids),
            attention_mask=take(self.attention_mask),
            tokenizer=self.tokenizer,
            completion_ids=pick(self.completion_ids),
            ended=take(self.ended),
        )

    def describe_row(self, row: int) -> str:
        return f"row {row}: prompt {_short(self.prompts[row])}, completion {_short(self.completions[row])}"


def completion_token_ids(response_ids: torch.Tensor, response_mask: torch.Tensor, stop_token_id: Optional[int]) -> list[list[int]]:
    """(B, R) sampled responses -> B lists of completion token ids, without padding or the stop token."""
    rows = []
    for ids, mask in zip(response_ids.cpu(), response_mask.cpu()):
        row = ids[mask.bool()].tolist()
        if row and stop_token_id is not None and row[-1] == stop_token_id:
            row.pop()
        rows.append(row)
    return rows


def _short(text: str, limit: int = 160) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


@runtime_checkable
class RewardSource(Protocol):
    """Anything with a `name` and `score(batch) -> (B,) float32`. Any non-finite score is a failure."""

    name: str

    def score(self, batch: ScoringBatch) -> torch.Tensor: ...


class RewardError(UserError):
    """A reward source failed on the data it was given (raised, wrong count, NaN/inf).

    `reward.on_error: skip` drops the rows concerned instead of stopping; a plain UserError
    (a missing column, an unreachable server) always stops the run.
    """


def check_scores(values, batch: ScoringBatch, name: str, what: str = "reward source") -> torch.Tensor:
    """A list of B numbers -> (B,) float32; raises RewardError on the wrong type or count.

    Non-finite values pass through (as NaN/inf): the caller decides whether they stop the run
    or drop the row. None becomes NaN (JSON has no NaN, so remote scorers send null).
    """
    try:
        scores = torch.as_tensor([float("nan") if v is None else float(v) for v in values], dtype=torch.float32)
    except (TypeError, ValueError) as e:
        raise RewardError(f"{what} {name} returned something that is not a list of numbers ({e}); first {batch.describe_row(0)}") from None
    if scores.ndim != 1 or scores.shape[0] != len(batch):
        raise RewardError(
            f"{what} {name} returned {scores.numel()} scores for {len(batch)} completions; first {batch.describe_row(0)}"
        )
    return scores


def first_non_finite(scores: torch.Tensor) -> Optional[int]:
    bad = (~torch.isfinite(scores)).nonzero().flatten()
    return int(bad[0]) if bad.numel() else None


# --------------------------------------------------------------------------- Python functions


@dataclass
class FunctionReward:
    """fn(prompts, completions, **columns) -> list[float], sync or async.

    A function that declares a `completion_ids` parameter also gets the completions as policy
    token ids (stop token not included), e.g. to count tokens. `kwargs` are fixed keyword
    arguments from the config entry; they may not share a name with a data column.
    """

    fn: Callable
    name: str
    kwargs: dict = field(default_factory=dict)

    def __post_init__(self):
        try:
            params = inspect.signature(self.fn).parameters
        except (TypeError, ValueError):
            params = {}
        self._wants_ids = "completion_ids" in params
        self._params = params

    def required_columns(self) -> set[str]:
        """Data columns the function cannot run without: named parameters after (prompts, completions)
        with no default that the config does not fill (or what a built-in declares)."""
        declared = getattr(self.fn, "required_columns", None)
        if callable(declared):
            return set(declared())
        named = list(self._params.values())[2:]
        return {
            p.name for p in named
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty
            and p.name not in self.kwargs and p.name != "completion_ids"
        }

    def score(self, batch: ScoringBatch) -> torch.Tensor:
        clash = sorted(set(self.kwargs) & set(batch.columns))
        if clash:
            raise UserError(f"reward function {self.name}: parameter(s) {', '.join(clash)} have the name of a data column; rename one")
        extra = dict(self.kwargs)
        if self._wants_ids:
            extra["completion_ids"] = batch.completion_ids
        try:
            result = self.fn(batch.prompts, batch.completions, **batch.columns, **extra)
            if inspect.isawaitable(result):
                result = run_coroutine(result)
        except UserError:
            raise
        except Exception as e:
            raise RewardError(f"reward function {self.name} raised {type(e).__name__}: {e}") from e
        return check_scores(result, batch, self.name, what="reward function")


def run_coroutine(awaitable):
    """Run an awaitable to completion, also when the caller is already inside an event loop (Jupyter)."""

    async def wait():
        return await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, wait()).result()


def load_function(spec: str, base_dir: Path | None = None) -> tuple[str, Callable]:
    """`path/to/file.py:fn` or `package.module:fn` -> (display name, callable)."""
    if ":" not in spec:
        from ppokit.rewards.builtins import BUILTINS

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
    if fn is None:
        raise UserError(f"reward function {spec!r}: {target} has no function {fn_name}")
    if not callable(fn):
        raise UserError(f"reward function {spec!r}: {fn_name} in {target} is not a function (its type is {type(fn).__name__})")
    return fn_name, fn
