"""What every reward source shares: the batch it scores, the Protocol, and Python functions as sources.

A source takes a ScoringBatch (texts, extra dataset columns, and the policy's token ids) and
returns one score per row. Scores are checked in one place (`check_scores`) so every kind of
source fails the same way: an error naming the source and an example row, never a silent 0.
Each source is handed its own copy of the batch (`ScoringBatch.copy`), so one that edits what it
was given changes nothing outside itself. A Python function runs in a worker thread under a
deadline (`ThreadCall`); one that does not return in time counts as failed (`RewardTimeout`).
"""

from __future__ import annotations

import copy
import inspect
import time
from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Protocol, Sequence, runtime_checkable

import torch

from ppokit.errors import UserError
from ppokit.user_code import load_attribute
from ppokit.process.workers import DeadlineExceeded, ThreadCall, run_coroutine


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
    # Multi-turn episodes (an `environment`): each episode's summed step rewards (NaN: it failed) and its failure or None.
    environment_rewards: Optional[list[float]] = None
    environment_errors: Optional[list[Optional[str]]] = None

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
            environment_rewards=pick(self.environment_rewards),
            environment_errors=pick(self.environment_errors),
        )

    def copy(self) -> "ScoringBatch":
        """A copy that a source may change at will: new lists, column values copied (deep), tensors
        cloned. Only the tokenizer is shared."""
        clone = lambda t: None if t is None else t.clone()  # noqa: E731
        try:
            columns = copy.deepcopy(self.columns)
        except RecursionError:
            raise UserError("a data column holds a value nested too deeply to copy for the reward sources") from None
        return ScoringBatch(
            prompts=list(self.prompts),
            completions=list(self.completions),
            columns=columns,
            input_ids=clone(self.input_ids),
            attention_mask=clone(self.attention_mask),
            tokenizer=self.tokenizer,
            completion_ids=None if self.completion_ids is None else [list(ids) for ids in self.completion_ids],
            ended=clone(self.ended),
            environment_rewards=None if self.environment_rewards is None else list(self.environment_rewards),
            environment_errors=None if self.environment_errors is None else list(self.environment_errors),
        )

    def describe_row(self, row: int) -> str:
        return f"row {row}: prompt {_short(self.prompts[row])}, completion {_short(self.completions[row])}"

    def first_row(self) -> str:
        """'; first row 0: ...' for an error message, or nothing for an empty batch."""
        return f"; first {self.describe_row(0)}" if len(self) else ""


def completion_token_ids(response_ids: torch.Tensor, loss_mask: torch.Tensor, stop_token_ids: Sequence[int]) -> list[list[int]]:
    """(B, R) sampled responses and their loss masks (the sampled tokens) -> B lists of completion token
    ids, without padding or the stop token that ended them (any of `stop_token_ids`)."""
    rows = []
    for ids, mask in zip(response_ids.cpu(), loss_mask.cpu()):
        row = ids[mask.bool()].tolist()
        if row and row[-1] in stop_token_ids:
            row.pop()
        rows.append(row)
    return rows


def _short(text: str, limit: int = 160) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _brief(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@runtime_checkable
class RewardSource(Protocol):
    """Anything with a `name` and `score(batch) -> (B,) float32`. Any non-finite score is a failure."""

    name: str

    def score(self, batch: ScoringBatch) -> torch.Tensor: ...


class RewardError(UserError):
    """A reward source failed on the data it was given (raised, wrong count, NaN/inf, not numbers).

    `reward.on_error: skip` drops the rows concerned instead of stopping; a plain UserError
    (a missing column, an unreachable server) always stops the run.
    """


class RewardTimeout(RewardError):
    """A reward function did not return within `reward.timeout_s`. Every row of the batch failed:
    the scorer does not retry the rows one at a time (each would wait as long again)."""


def check_scores(values, batch: ScoringBatch, name: str, what: str = "reward source") -> torch.Tensor:
    """A list (or 1-D tensor/array) of B numbers -> (B,) float32; RewardError on anything else.

    A string is not a list of numbers ('11111111' is not eight 1.0s), and an element must be a
    number (bool, int, float, a NumPy or 0-d tensor scalar), never a string such as '0.5'.
    Non-finite values pass through (as NaN/inf): the caller decides whether they stop the run
    or drop the row. None becomes NaN (JSON has no NaN, so remote scorers send null).
    """
    return scores_and_abstentions(values, batch, name, what).values


class Scores(NamedTuple):
    values: torch.Tensor  # (B,) float32, NaN where None
    unscored: torch.Tensor  # (B,) bool: the source returned None for the row


def scores_and_abstentions(values, batch: ScoringBatch, name: str, what: str = "reward source") -> Scores:
    """`check_scores`, and which rows were None (for a reward function, TRL's meaning: it does not score that row)."""
    unscored = []
    if isinstance(values, torch.Tensor) and values.ndim == 1 and not values.is_complex():
        scores = values.detach().to("cpu", torch.float32)
    else:
        if isinstance(values, (str, bytes, bytearray, Mapping, Set)) or not hasattr(values, "__iter__"):
            raise RewardError(
                f"{what} {name} returned {_brief(values)} (a {type(values).__name__}), not a list of numbers{batch.first_row()}"
            )
        numbers = []
        for row, value in enumerate(values):
            number = as_number(value)
            if number is None:
                where = batch.describe_row(row) if row < len(batch) else f"row {row}"
                raise RewardError(
                    f"{what} {name} returned {_brief(value)} (a {type(value).__name__}) for {where}; expected a number"
                )
            numbers.append(number)
            unscored.append(value is None)
        scores = torch.tensor(numbers, dtype=torch.float32)
    if scores.shape[0] != len(batch):
        raise RewardError(f"{what} {name} returned {scores.shape[0]} scores for {len(batch)} completions{batch.first_row()}")
    return Scores(scores, torch.tensor(unscored, dtype=torch.bool) if unscored else torch.zeros(len(scores), dtype=torch.bool))


def as_number(value) -> Optional[float]:
    """A score as a float (None -> NaN); None when `value` is not a number (a str has no __float__)."""
    if value is None:
        return float("nan")
    if isinstance(value, (str, bytes, bytearray)) or not hasattr(value, "__float__"):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):  # e.g. a tensor of several elements
        return None


def first_non_finite(scores: torch.Tensor) -> Optional[int]:
    bad = (~torch.isfinite(scores)).nonzero().flatten()
    return int(bad[0]) if bad.numel() else None


# --------------------------------------------------------------------------- Python functions


# How a reward function is called (`calling_convention`): ppokit's fn(prompts, completions, **columns), or TRL's,
# every argument by keyword: fn(prompts=, completions=, completion_ids=, **columns).
POSITIONAL, KEYWORDS = "positional", "keywords"
# What TRL's GRPOTrainer also passes its reward functions, and ppokit does not (it has no such objects).
TRL_ONLY_ARGUMENTS = ("trainer_state", "log_extra", "log_metric", "environments")
_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def calling_convention(params: Mapping[str, inspect.Parameter]) -> str:
    """POSITIONAL or KEYWORDS, from a reward function's parameters.

    POSITIONAL (ppokit's): fn(prompts, completions, **columns), for a function whose first two positional parameters
    are named prompts and completions (both conventions then give the same call), or that names no `completions`
    parameter at all (any names: fn(p, c, **kw)). KEYWORDS (TRL's GRPOTrainer): fn(prompts=..., completions=...,
    completion_ids=..., **columns), for a function that names `completions` elsewhere (`def reward_len(completions,
    **kwargs)`, called positionally, would take the prompts for completions, or fail with "takes 1 positional argument
    but 2 were given") or that takes keywords only (`def f(**kwargs)`).
    """
    kinds = [p.kind for p in params.values()]
    positional = [p.name for p in params.values() if p.kind in _POSITIONAL]
    completions = params.get("completions")
    if completions is not None and completions.kind in _NAMED:
        return POSITIONAL if positional[:2] == ["prompts", "completions"] else KEYWORDS
    takes_only_keywords = not positional and inspect.Parameter.VAR_POSITIONAL not in kinds
    return KEYWORDS if takes_only_keywords and inspect.Parameter.VAR_KEYWORD in kinds else POSITIONAL


def _where(fn: Callable) -> str:
    """` (file.py:line)` where fn is defined, or nothing (a built-in, a C function)."""
    code = getattr(inspect.unwrap(getattr(fn, "__func__", fn)), "__code__", None)
    if code is None:
        code = getattr(getattr(type(fn), "__call__", None), "__code__", None)
    if code is None or "ppokit/rewards/" in code.co_filename.replace("\\", "/"):
        return ""
    return f" ({Path(code.co_filename).name}:{code.co_firstlineno})"


@dataclass
class FunctionReward:
    """fn(prompts, completions, **columns) -> list[float], sync or async; or, TRL's way, every argument by keyword
    (`calling_convention`): fn(prompts=, completions=, completion_ids=, **columns).

    A function that declares a `completion_ids` parameter also gets the completions as policy
    token ids (stop token not included), e.g. to count tokens; called by keyword, so does one with **kwargs (TRL
    passes them). `kwargs` are fixed keyword arguments from the config entry; they may not share a name with a data
    column. `call_problem` checks the signature against the data's columns before any model loads.

    The function gets its own copies of the lists and column values. With `timeout_s`, it runs
    in a worker thread and a call that has not returned after `timeout_s` seconds fails
    (RewardTimeout); while that call is still running, later calls fail at once rather than
    pile up threads. `timeout_s=None` calls it in the caller's thread, without a limit.
    """

    fn: Callable
    name: str
    kwargs: dict = field(default_factory=dict)
    timeout_s: Optional[float] = None
    _abandoned: Optional[ThreadCall] = field(default=None, init=False, repr=False)

    def __post_init__(self):
        try:
            self._signature: Optional[inspect.Signature] = inspect.signature(self.fn)
        except (TypeError, ValueError):  # a callable without a signature Python can read: called ppokit's way, unchecked
            self._signature = None
        params = self._signature.parameters if self._signature is not None else {}
        self._params = params
        self.convention = calling_convention(params)
        takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
        self._takes = lambda name: name in params and params[name].kind in _NAMED or takes_any  # noqa: E731
        self._wants_ids = "completion_ids" in params or (self.convention == KEYWORDS and takes_any)

    def required_columns(self) -> set[str]:
        """Data columns the function cannot run without: named parameters with no default besides the
        arguments ppokit passes (prompts, completions, completion_ids) and those the config fills (or what a
        built-in declares)."""
        declared = getattr(self.fn, "required_columns", None)
        if callable(declared):
            return set(declared())
        named = list(self._params.values())[2:] if self.convention == POSITIONAL else list(self._params.values())
        return {
            p.name for p in named
            if p.kind in _NAMED and p.default is p.empty
            and p.name not in self.kwargs and p.name not in ("prompts", "completions", "completion_ids", *TRL_ONLY_ARGUMENTS)
        }

    def arguments(self, prompts, completions, completion_ids, columns: dict) -> tuple[tuple, dict]:
        """(args, kwargs) of one call, by the function's `convention`: the one place the call is shaped."""
        extra = {**columns, **self.kwargs}
        if self._wants_ids:
            extra["completion_ids"] = completion_ids
        if self.convention == POSITIONAL:
            return (prompts, completions), extra
        given = {"prompts": prompts} if self._takes("prompts") else {}
        return (), {**given, "completions": completions, **extra}

    def call_problem(self, columns: Set, source: str = "") -> Optional[str]:
        """One line naming the function and what its signature lacks to be called with data of these `columns`
        (set of names; `source` says whose, e.g. "data.train (p.jsonl)"), or None. Checked at start-up, before any model loads: a function that cannot take the
        call
        would otherwise fail at the first scoring, after the models loaded and the first rollout ran."""
        if self._signature is None:
            return None
        args, kwargs = self.arguments([], [], [], {name: [] for name in columns})
        try:
            self._signature.bind(*args, **kwargs)
            return None
        except TypeError as e:
            return f"reward function {self.name}{_where(self.fn)}{self._lacks(args, kwargs, columns, source, e)}"

    def _lacks(self, args: tuple, kwargs: dict, columns: Set, source: str, error: TypeError) -> str:
        params = self._params.values()
        slots = [p for p in params if p.kind in _POSITIONAL]
        if self.convention == POSITIONAL and len(slots) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in params):
            return (f" takes {len(slots)} positional parameter(s), and ppokit calls it as fn(prompts, completions, **columns); "
                    "name them (prompts, completions), or name a parameter `completions` to be called TRL's way, every "
                    "argument by keyword")
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            extra = sorted(k for k in kwargs if not (k in self._params and self._params[k].kind in _NAMED))
            if extra:
                data = [k for k in extra if k in columns]
                what = [f"the column(s) {', '.join(data)} of {source or 'the data'}"] if data else []
                what += [f"the keyword argument(s) {', '.join(k for k in extra if k not in columns)}"] if len(data) < len(extra) else []
                return f" has no parameter for {' and '.join(what)}, which ppokit passes to it; add **kwargs"
        filled = set(kwargs) | {p.name for p in slots[:len(args)]}
        missing = [p.name for p in params if p.kind in (*_POSITIONAL, p.KEYWORD_ONLY) and p.default is p.empty and p.name not in filled]
        trl_only = [name for name in missing if name in TRL_ONLY_ARGUMENTS]
        if trl_only:
            return (f" needs {', '.join(trl_only)}, which TRL's GRPOTrainer passes and ppokit does not; give the "
                    "parameter a default or read it from **kwargs")
        if missing:
            return f" needs {', '.join(missing)}, which ppokit's call {self._call_shape(args, kwargs)} does not pass"
        return f" cannot take ppokit's call {self._call_shape(args, kwargs)}: {error}"

    def _call_shape(self, args: tuple, kwargs: dict) -> str:
        passed = (["prompts", "completions"] if args else []) + [f"{k}=" for k in kwargs]
        return f"fn({', '.join(passed)})"

    def score(self, batch: ScoringBatch) -> torch.Tensor:
        return self.score_rows(batch).values

    def score_rows(self, batch: ScoringBatch) -> Scores:
        """The scores, and the rows the function returned None for: TRL's reward-function protocol, where None means
        that this function does not score that row (`RewardScorer` combines the other sources' scores there)."""
        clash = sorted(set(self.kwargs) & set(batch.columns))
        if clash:
            raise UserError(f"reward function {self.name}: parameter(s) {', '.join(clash)} have the name of a data column; rename one")
        own = batch.copy()  # what the function does to its arguments stays with it
        args, kwargs = self.arguments(own.prompts, own.completions, own.completion_ids, own.columns)

        def call():
            result = self.fn(*args, **kwargs)
            return run_coroutine(lambda: result) if inspect.isawaitable(result) else result

        try:
            result = call() if self.timeout_s is None else self._call_with_deadline(call)
        except UserError:
            raise
        except SystemExit as e:  # sys.exit() in a reward function is that function failing, not the run ending
            raise RewardError(f"reward function {self.name} called sys.exit({'' if e.code is None else repr(e.code)})") from None
        except Exception as e:
            raise RewardError(f"reward function {self.name} raised {type(e).__name__}: {e}") from e
        return scores_and_abstentions(result, batch, self.name, what="reward function")

    def _call_with_deadline(self, call: Callable[[], Any]) -> Any:
        if self._abandoned is not None and self._abandoned.running():
            raise RewardTimeout(
                f"reward function {self.name}: its call that passed reward.timeout_s={self.timeout_s:g}s "
                f"{time.monotonic() - self._abandoned.started:.0f}s ago has still not returned; the function fails until it does"
            )
        running = ThreadCall(call, name=f"reward-{self.name}")
        try:
            return running.result(self.timeout_s)
        except DeadlineExceeded:
            self._abandoned = running
            raise RewardTimeout(
                f"reward function {self.name} did not return within reward.timeout_s={self.timeout_s:g}s "
                "(its thread is left running: Python cannot stop it)"
            ) from None

    def stuck_s(self) -> Optional[float]:
        """Seconds since the call that passed its deadline started, while it still runs; else None."""
        if self._abandoned is not None and self._abandoned.running():
            return time.monotonic() - self._abandoned.started
        return None


def load_function(spec: str, base_dir: Path | None = None) -> tuple[str, Callable]:
    """`path/to/file.py:fn` or `package.module:fn` -> (display name, callable)."""
    from ppokit.rewards.builtins import BUILTINS

    expected = f"a built-in ({', '.join(BUILTINS)}), 'file.py:function' or 'module:function'"
    fn_name, fn = load_attribute(spec, base_dir, "reward function", "function", expected)
    if not callable(fn):
        target = spec.rpartition(":")[0]
        raise UserError(f"reward function {spec!r}: {fn_name} in {target} is not a function (its type is {type(fn).__name__})")
    return fn_name, fn
