"""From reward sources to one score per episode: weights, normalisation, shaping, failures.

    raw_i      = source_i(batch)                                   logged as reward/<name_i>
    z_i        = (raw_i - running mean_i) / running std_i          only where normalisation is on
    score      = sum_i weight_i * z_i
                 - missing_eos_penalty      (responses without the stop token)
                 - length_penalty * max(0, completion tokens - length_penalty_start)   (DAPO's overlong shaping: at most its factor)
    score      = clip(score, *clip_range)

A Python function that returns None for a row does not score it (TRL's reward-function protocol): the row's score is
the weighted sum of the other sources' (z_i is 0 there, as TRL's nansum), and a row that no source scores leaves the
update (as TRL gives it no advantage and leaves it out of its group's baseline), counted in `reward/skipped` with a
warning. A source that raises, returns the wrong count, something that is not numbers or a non-finite
score, or (a Python function) does not return within `reward.timeout_s`, stops the run with an
error naming the source and a row; with `on_error: skip` those rows are marked invalid instead
(the trainer masks them out of the update) and counted in `reward/skipped`. Every source scores
its own copy of the batch: what one does to its arguments reaches neither the others nor the
trainer (samples.jsonl, the dataset).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from ppokit.config.schema import RewardConfig
from ppokit.config.fields import build, validate
from ppokit.errors import UserError
from ppokit.rewards.builtins import BUILTINS
from ppokit.rewards.environment import EnvironmentReward
from ppokit.rewards.model import RewardModelReward, reward_model_source
from ppokit.rewards.remote import RemoteReward
from ppokit.rewards.sources import (
    FunctionReward, RewardError, RewardSource, RewardTimeout, Scores, ScoringBatch, first_non_finite, load_function,
)


@dataclass
class RunningMoments:
    """Mean and variance of every value seen so far (Chan et al.'s parallel update of Welford's)."""

    count: float = 0.0
    mean: float = 0.0
    var: float = 0.0  # population variance

    def update(self, values: torch.Tensor, all_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        """Add `values`; `all_reduce` (a sum over processes) makes every process add every process's values."""
        values = values.double()
        sums = torch.stack([torch.tensor(float(values.numel()), dtype=torch.float64), values.sum(), (values**2).sum()])
        if all_reduce is not None:
            sums = all_reduce(sums)
        n, total_sum, total_sq = sums.tolist()
        if n == 0:
            return
        batch_mean = total_sum / n
        batch_var = max(total_sq / n - batch_mean**2, 0.0)
        total = self.count + n
        delta = batch_mean - self.mean
        self.var = (self.count * self.var + n * batch_var + delta**2 * self.count * n / total) / total
        self.mean += delta * n / total
        self.count = total

    def normalise(self, values: torch.Tensor) -> torch.Tensor:
        return (values - self.mean) / (math.sqrt(self.var) + 1e-8)


UNSCORED = object()  # RewardScorer._warned's entry once rows that no source scored were reported


@dataclass
class ScoreResult:
    scores: torch.Tensor  # (B,) float32, 0 where invalid
    valid: torch.Tensor  # (B,) bool: False for rows dropped by on_error: skip
    raw: dict[str, torch.Tensor]  # name -> (B,) raw scores, NaN where the source gave none (failed, or None: no score)
    errors: list[str] = field(default_factory=list)  # one message per failed source


def unique_names(names: list[str]) -> list[str]:
    """The sources' names as the metrics show them (`reward/<name>`): a name given again numbered from its second (`_2`)."""
    seen: dict[str, int] = {}
    unique = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        unique.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return unique


@dataclass
class RewardScorer:
    """Every reward source of a run and how their scores become one. `state_dict` holds the
    normalisation statistics, the only state that changes during training."""

    sources: list[RewardSource]
    weights: list[float]
    normalize: list[bool]
    on_error: str = "raise"
    missing_eos_penalty: Optional[float] = None
    length_penalty: float = 0.0
    length_penalty_start: int = 0
    length_penalty_cap: Optional[float] = None  # the most the length penalty takes (DAPO's overlong shaping: its factor)
    clip_range: Optional[tuple[float, float]] = None
    reward_model: Optional[torch.nn.Module] = None  # the reward model's weights, when one is loaded
    all_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # sum over processes, for the statistics
    # With several processes: called by each after every source with its error or None; raises on all of
    # them when any failed (`parallel.stop_together`), so none waits for one that has stopped.
    verdict: Optional[Callable[[Optional[UserError]], None]] = None
    moments: dict[str, RunningMoments] = field(default_factory=dict)
    _warned: set = field(default_factory=set, repr=False)  # sources whose skipped failure was reported (and UNSCORED)

    def __post_init__(self):
        self.names = unique_names([source.name for source in self.sources])
        if len(self.weights) != len(self.sources) or len(self.normalize) != len(self.sources):
            raise UserError(f"reward: {len(self.sources)} sources but {len(self.weights)} weights and {len(self.normalize)} normalize flags")
        for name, on in zip(self.names, self.normalize):
            if on:
                self.moments.setdefault(name, RunningMoments())

    def score(self, batch: ScoringBatch, update_statistics: bool = True) -> ScoreResult:
        n = len(batch)
        valid = torch.ones(n, dtype=torch.bool)
        raw, unscored, errors = {}, {}, []
        for name, source in zip(self.names, self.sources):
            try:
                (raw[name], unscored[name]), error = self._score_source(name, source, batch)
            except UserError as failure:
                if self.verdict is None:
                    raise
                self.verdict(failure)  # raises, on every process
            if self.verdict is not None:
                self.verdict(None)
            if error:
                errors.append(error)
            valid &= torch.isfinite(raw[name]) | unscored[name]
        valid &= ~self._scored_by_none(unscored, batch)
        total = torch.zeros(n)
        for name, weight in zip(self.names, self.weights):
            scored = valid & ~unscored[name]
            values = torch.where(scored, raw[name], torch.zeros(()))
            if name in self.moments:
                if update_statistics:
                    self.moments[name].update(values[scored], self.all_reduce)
                values = torch.where(scored, self.moments[name].normalise(values), torch.zeros(()))
            total = total + weight * values
        if self.missing_eos_penalty is not None and batch.ended is not None:
            total = total - self.missing_eos_penalty * (~batch.ended.cpu()).float()
        if self.length_penalty and batch.completion_ids is not None:
            lengths = torch.tensor([len(ids) for ids in batch.completion_ids], dtype=torch.float32)
            penalty = self.length_penalty * (lengths - self.length_penalty_start).clamp(min=0)
            total = total - (penalty if self.length_penalty_cap is None else penalty.clamp(max=self.length_penalty_cap))
        if self.clip_range is not None:
            total = total.clamp(*self.clip_range)
        return ScoreResult(total.masked_fill(~valid, 0.0), valid, raw, errors)

    def _scored_by_none(self, unscored: dict[str, torch.Tensor], batch: ScoringBatch) -> torch.Tensor:
        """(B,) bool: the rows that every source left unscored (each returned None), which the update leaves out."""
        none = torch.stack(list(unscored.values())).all(0) if unscored else torch.zeros(len(batch), dtype=torch.bool)
        if none.any() and UNSCORED not in self._warned:
            self._warned.add(UNSCORED)
            row = int(none.nonzero()[0])
            warnings.warn(f"every reward source returned None (no score) for {batch.describe_row(row)}: such rows leave the "
                          "update, counted in reward/skipped (TRL gives them no advantage)", stacklevel=3)
        return none

    def _score_source(self, name: str, source: RewardSource, batch: ScoringBatch) -> tuple[Scores, Optional[str]]:
        """-> (B,) scores (NaN where failed when skipping, or unscored) and the rows the source did not score (None), the
        first error message or None."""
        try:
            scores = _score_copy(source, batch)
        except RewardTimeout as e:  # trying each row alone would wait as long again, row after row
            if self.on_error == "raise":
                raise
            self._warn_once(name, str(e))
            return Scores(torch.full((len(batch),), float("nan")), torch.zeros(len(batch), dtype=torch.bool)), str(e)
        except RewardError as e:
            rows = self._isolate(source, batch)
            bad = [i for i, (s, none) in enumerate(zip(rows.values.tolist(), rows.unscored.tolist())) if not math.isfinite(s) and not none]
            failing = batch.describe_row(bad[0]) if bad else None
            message = f"{e} (failing {failing})" if failing and failing not in str(e) else str(e)
            if self.on_error == "raise":
                raise RewardError(message) from e.__cause__
            self._warn_once(name, message)
            return rows, message
        bad = first_non_finite(scores.values.masked_fill(scores.unscored, 0.0))
        if bad is None:
            return scores, None
        what = "reward function" if isinstance(source, FunctionReward) else "reward source"
        message = f"{what} {source.name} returned {scores.values[bad].item()} for {batch.describe_row(bad)}"
        if self.on_error == "raise":
            raise RewardError(message)
        self._warn_once(name, message)
        return scores, message

    def _isolate(self, source: RewardSource, batch: ScoringBatch) -> Scores:
        """Score row by row after a batch failed: NaN for the rows that fail alone."""
        scores = torch.full((len(batch),), float("nan"))
        unscored = torch.zeros(len(batch), dtype=torch.bool)
        for i in range(len(batch)):
            try:
                row = _score_copy(source, batch.select([i]))
                scores[i], unscored[i] = row.values[0], row.unscored[0]
            except RewardTimeout:
                break  # the function is stuck: the rows left fail too, without waiting for each
            except RewardError:
                pass
        return Scores(scores, unscored)

    def _warn_once(self, name: str, message: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            warnings.warn(f"reward.on_error=skip: dropping samples; first failure: {message}", stacklevel=3)

    def reward_model_shares_vocabulary(self, tokenizer) -> bool:
        """Whether the reward model reads the policy's token ids; only then can it initialise the critic."""
        return any(isinstance(s, RewardModelReward) and s.shares_vocabulary(tokenizer) for s in self.sources)

    def metrics(self, result: ScoreResult) -> dict[str, float]:
        """reward/<name>: mean raw score over the rows the source scored; reward/skipped: rows dropped;
        over every process's rows (one all_reduce of the sums and counts)."""
        sums = []
        for values in result.raw.values():
            finite = values[torch.isfinite(values)].double()
            sums += [finite.sum().item(), float(finite.numel())]
        sums = torch.tensor([*sums, float((~result.valid).sum())], dtype=torch.float64)
        if self.all_reduce is not None:
            sums = self.all_reduce(sums)
        *totals, skipped = sums.tolist()
        out = {f"reward/{name}": total / count if count else float("nan")
               for name, total, count in zip(result.raw, totals[::2], totals[1::2])}
        out["reward/skipped"] = skipped
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"moments": {name: vars(m).copy() for name, m in self.moments.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("moments", {})
        if set(saved) != set(self.moments):
            raise UserError(
                f"reward normalisation state is for sources {sorted(saved)}, this run normalises {sorted(self.moments)}"
            )
        for name, values in saved.items():
            self.moments[name] = RunningMoments(**values)


def _score_copy(source: RewardSource, batch: ScoringBatch) -> Scores:
    """source(its own copy of batch) -> (B,) float32 on the CPU, and the rows it did not score (a reward function's None).
    sys.exit() inside a source is that source failing, not the run ending (with exit status 0 and no final/)."""
    try:
        if isinstance(source, FunctionReward):
            return source.score_rows(batch.copy())
        scores = source.score(batch.copy()).float().cpu()
        return Scores(scores, torch.zeros(len(scores), dtype=torch.bool))
    except SystemExit as e:
        raise RewardError(f"reward source {source.name} called sys.exit({'' if e.code is None else repr(e.code)})") from None


# --------------------------------------------------------------------------- building sources


def function_source(entry: str | dict, key: str, base_dir: Optional[Path] = None, timeout_s: Optional[float] = None) -> FunctionReward:
    """A `reward.functions` entry -> a source: a built-in name, `file.py:fn`, `module:fn`, or a mapping
    `{function: ..., name: ..., PARAM: value}` (parameters of a built-in, or keyword arguments of a user function).
    `timeout_s`: each call's deadline (reward.timeout_s); None calls the function without one."""
    if isinstance(entry, str):
        spec, label, params = entry, None, {}
    elif isinstance(entry, dict):
        params = dict(entry)
        spec, label = params.pop("function", None), params.pop("name", None)
        if not isinstance(spec, str) or not spec:
            raise UserError(f"{key}.function: required, a built-in ({', '.join(BUILTINS)}), 'file.py:function' or 'module:function'")
    else:
        raise UserError(f"{key}: expected a name or a mapping {{function: ..., ...}}, got {entry!r}")
    if spec in BUILTINS:
        builtin = BUILTINS[spec]
        if isinstance(builtin, type):
            fn = build(builtin, params, prefix=f"{key}.")
            validate(fn, prefix=f"{key}.")
            if hasattr(fn, "check"):
                fn.check(key)
        elif params:
            raise UserError(f"{key}: the built-in {spec} takes no parameters (got {', '.join(map(str, params))})")
        else:
            fn = builtin
        return FunctionReward(fn, str(label or spec), timeout_s=timeout_s)
    name, fn = load_function(spec, base_dir)
    return FunctionReward(fn, str(label or name), kwargs=params, timeout_s=timeout_s)


def as_source(item: Any, key: str, base_dir: Optional[Path] = None, timeout_s: Optional[float] = None) -> RewardSource:
    """A config entry (str or mapping), a RewardSource object, or any callable fn(prompts, completions, **columns).
    `timeout_s` applies to functions (a RewardSource object keeps its own)."""
    if isinstance(item, (str, dict)):
        return function_source(item, key, base_dir, timeout_s)
    if isinstance(item, RewardSource):
        return item
    if callable(item):
        fn = getattr(item, "func", item)  # functools.partial
        return FunctionReward(item, getattr(item, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__, timeout_s=timeout_s)
    raise UserError(f"{key}: expected a reward function, a reward source or a spec string, got {type(item).__name__}")


def source_label(item: Any) -> str | dict:
    """What to record in the config for a reward function passed as an object."""
    if isinstance(item, (str, dict)):
        return item
    return getattr(item, "name", None) or getattr(getattr(item, "func", item), "__name__", None) or type(item).__name__


@dataclass
class CheckedSources:
    """The `reward:` section's sources that load no weights, built and checked (`check_sources`): the functions, each
    signature checked against the data's columns, and the remote scorer (its URL and headers checked)."""

    functions: list[RewardSource]
    remote: Optional[RemoteReward]
    reward_model: bool = False  # a reward model is a source too (loaded later)
    environment: bool = False  # the environment is a source too (the last)

    @property
    def names(self) -> list[str]:
        """Every source's name, as the scorer will name them (`RewardScorer.names`), in weights order."""
        return unique_names([RewardModelReward.name] * self.reward_model + [f.name for f in self.functions]
                            + ([self.remote.name] if self.remote is not None else []) + [EnvironmentReward.name] * self.environment)


def check_sources(
    reward: RewardConfig,
    *,
    reward_functions: Optional[Sequence[Callable | str | dict | RewardSource]] = None,
    base_dir: Optional[Path] = None,
    data_columns: Optional[dict[str, set[str]]] = None,
    reward_model: bool = False,
    environment: bool = False,
    teacher: bool = False,
    names_a_source: Optional[tuple[str, str]] = None,
) -> CheckedSources:
    """Every check of the `reward:` section that needs no weights, before any model loads (the run's set-up and
    `ppokit plan` both run it, `ppokit.training.startup`): each function resolved (objects passed in replace the config's entries)
    and its signature checked against `data_columns` (split -> its column names), the remote scorer built, and the
    number of sources against reward.weights. reward_model / environment: whether those sources are there too; teacher:
    a run with a teacher needs no source (the reverse KL to it is a reward of its own). names_a_source: (key, name) of a
    setting that names one of the sources (`rollout.dynamic_sampling_metric`)."""
    items = reward_functions if reward_functions is not None else reward.functions
    functions = [as_source(item, f"reward.functions[{i}]", base_dir, reward.timeout_s) for i, item in enumerate(items)]
    # A column a function needs but the data lacks, or a signature that cannot take the call, fails now, not after
    # every model has loaded and the first rollout ran.
    for source in functions:
        for split, columns in (data_columns or {}).items():
            missing = sorted(getattr(source, "required_columns", lambda: set())() - columns)
            if missing:
                raise UserError(
                    f"reward function {source.name} needs the data column(s) {', '.join(missing)}, which {split} "
                    f"does not have (columns: {', '.join(sorted(columns)) or 'none besides the prompt'})"
                )
            problem = source.call_problem(columns, split) if isinstance(source, FunctionReward) else None
            if problem:
                raise UserError(problem)
    remote = None
    if reward.remote is not None:  # its URL and headers are checked here, before any model loads
        r = reward.remote
        remote = RemoteReward(
            r.url, r.timeout_s, r.max_retries, r.backoff_s, r.batch_size, dict(r.headers), r.name,
            max_response_bytes=r.max_response_bytes, key="reward.remote",
        )
    count = reward_model + len(functions) + (remote is not None) + environment
    if not count and not teacher:
        raise UserError("reward: set at least one source, reward.model, reward.functions or reward.remote")
    if reward.weights is not None and len(reward.weights) != count:
        raise UserError(f"reward.weights has {len(reward.weights)} entries for {count} reward sources")
    checked = CheckedSources(functions, remote, bool(reward_model), bool(environment))
    if names_a_source is not None and names_a_source[1] not in checked.names:
        key, name = names_a_source
        raise UserError(f"{key}: {name!r} is neither `score` nor a reward source of this run ({', '.join(checked.names)})")
    return checked


def build_scorer(
    reward: RewardConfig,
    *,
    missing_eos_penalty: Optional[float] = None,
    reward_model=None,
    reward_tokenizer=None,
    reward_functions: Optional[Sequence[Callable | str | dict | RewardSource]] = None,
    trust_remote_code: bool = False,
    base_dir: Optional[Path] = None,
    all_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    verdict: Optional[Callable[[Optional[UserError]], None]] = None,
    load_kwargs: Optional[dict] = None,
    data_columns: Optional[dict[str, set[str]]] = None,
    reward_model_by_tokens: bool = False,
    reward_model_padding_free: bool = False,
    environment: Optional[RewardSource] = None,
    checked: Optional[CheckedSources] = None,
) -> RewardScorer:
    """Every source of the `reward:` section (objects passed in replace the config's entries), in
    `weights` order: reward model, functions, remote, environment. Loads the reward model: a model that cannot be
    loaded or has more than one label is a UserError here, before any training. With several
    processes, `all_reduce` (a sum across them) keeps the normalisation statistics identical on all, and
    `verdict` (`parallel.stop_together`) makes a source failing on one of them stop every one.
    reward_model_by_tokens: the reward model scores in token-budget chunks (ppo.max_tokens_per_micro_batch);
    reward_model_padding_free: over packed rows (ppo.padding_free).
    environment: the episodes' environment as a source (`rewards.environment.EnvironmentReward`), the last in weights order.
    checked: what `check_sources` returned for these arguments (the run's start-up checked them already); else
    they are checked here."""
    has_model = reward_model is not None or bool(reward.model)
    if checked is None:
        checked = check_sources(reward, reward_functions=reward_functions, base_dir=base_dir, data_columns=data_columns,
                                reward_model=has_model, environment=environment is not None)
    sources: list[RewardSource] = []
    rm_module = None
    if has_model:
        rm = reward_model_source(
            reward_model if reward_model is not None else reward.model, reward_tokenizer, reward.batch_size, trust_remote_code,
            by_tokens=reward_model_by_tokens, padding_free=reward_model_padding_free, **(load_kwargs or {}),
        )
        sources.append(rm)
        rm_module = rm.model
    sources += checked.functions
    if checked.remote is not None:
        sources.append(checked.remote)
    if environment is not None:
        sources.append(environment)
    weights = list(reward.weights) if reward.weights is not None else [1.0] * len(sources)
    normalize = list(reward.normalize) if isinstance(reward.normalize, list) else [bool(reward.normalize)] * len(sources)
    length_penalty, length_penalty_start, length_penalty_cap = reward.length_shaping
    return RewardScorer(
        sources=sources,
        weights=weights,
        normalize=normalize,
        on_error=reward.on_error,
        missing_eos_penalty=missing_eos_penalty,
        length_penalty=length_penalty,
        length_penalty_start=length_penalty_start,
        length_penalty_cap=length_penalty_cap,
        clip_range=tuple(reward.clip_range) if reward.clip_range is not None else None,
        reward_model=rm_module,
        all_reduce=all_reduce,
        verdict=verdict,
    )


def source_from_argument(text: str, trust_remote_code: bool = False, timeout_s: Optional[float] = RewardConfig.timeout_s) -> RewardSource:
    """`ppokit serve-rm MODEL`: a saved reward model directory, a function spec, or a YAML mapping entry.
    `timeout_s` is a function's deadline per call, as reward.timeout_s."""
    if Path(text).expanduser().is_dir():
        return reward_model_source(str(Path(text).expanduser()), trust_remote_code=trust_remote_code)
    if text.lstrip().startswith("{"):
        import yaml

        try:
            entry = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise UserError(f"serve-rm: {text!r} is not a valid YAML mapping: {e}") from None
        return function_source(entry, "serve-rm MODEL", Path.cwd(), timeout_s)
    if ":" not in text and ("/" in text or text.startswith((".", "~"))):
        # Only a directory can be a model here; a path that is none is a missing model, not a misspelt function.
        raise UserError(f"serve-rm MODEL: reward model directory {text} does not exist")
    return function_source(text, "serve-rm MODEL", Path.cwd(), timeout_s)
