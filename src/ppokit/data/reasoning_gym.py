"""reasoning-gym's procedural tasks as a data source, and the datasets rebuilt to score them.

A spec `reasoning_gym:TASK?size=N&seed=S` (or several tasks with weights, `reasoning_gym:TASK*W,TASK*W?...`, made
as reasoning-gym's own `composite` dataset) -> one row per entry: the question as the prompt, and the entry's
`answer` and `metadata`, its `task` and the `dataset` spec that made it (seed and size filled in), so that a reward
function rebuilds the same dataset (`dataset_for`) and scores with the task's own `score_answer`.

Facts of reasoning-gym 0.1.25 this rests on: entry i of a task made with seed S is drawn from `Random(S + i)`, so
seeds S and S+1 share all but one entry (a default eval seed starts after the training entries: `eval_source`);
a composite's k-th task (from 0) gets seed S + k + 1 and the composite's size unless its own config says
otherwise, and picks entry i's task from `Random(S + i)` with the weights; its `score_answer` hands the entry to
the task named by the entry's `metadata.source_dataset`.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Optional
from urllib.parse import quote, unquote

import yaml

from ppokit.errors import UserError

PREFIX = "reasoning_gym:"
DEFAULT_SIZE = 500  # reasoning-gym's own default
DEFAULT_SEED = 0  # reasoning-gym draws a random seed when none is given; a run must be repeatable
INSTALL = "pip install 'ppokit[reasoning-gym]'"
RESERVED = ("size", "seed", "system_prompt")  # query keys of the source itself, not of a task's config


@dataclass
class TaskSpec:
    name: str
    weight: float = 1.0
    config: dict = field(default_factory=dict)


@dataclass
class GymSpec:
    """A parsed `reasoning_gym:` spec. `seed` None: not given (DEFAULT_SEED, or after the training entries for eval)."""

    tasks: list[TaskSpec]
    size: int = DEFAULT_SIZE
    seed: Optional[int] = None
    system_prompt: Optional[str] = None  # a key of reasoning_gym.utils.SYSTEM_PROMPTS: chat prompts with it as the system turn

    @property
    def composite(self) -> bool:
        return len(self.tasks) > 1

    def text(self) -> str:
        """The spec written out, defaults filled in: what the `dataset` column keeps and `dataset_for` reads back."""
        tasks = ",".join(t.name if t.weight == 1 and not self.composite else f"{t.name}*{t.weight:g}" for t in self.tasks)
        query = [f"size={self.size}", f"seed={DEFAULT_SEED if self.seed is None else self.seed}"]
        if self.system_prompt is not None:
            query.append(f"system_prompt={self.system_prompt}")
        for task in self.tasks:
            prefix = f"{task.name}." if self.composite else ""
            query += [f"{prefix}{key}={_written(value)}" for key, value in task.config.items()]
        return f"{PREFIX}{tasks}?{'&'.join(query)}"


def _written(value: Any) -> str:
    """A setting's value as the query holds it: YAML that reads back as the value, `&`, `=`, `%`, `?` and `#` escaped."""
    text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    return quote(text, safe=" []{},:._-+*/'\"!@()<>$^|~;")


def is_gym_spec(spec: Any) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def library():
    """The reasoning_gym package, or a UserError naming the extra that installs it."""
    try:
        import reasoning_gym
        import reasoning_gym.composite  # noqa: F401  (registers `composite`)
    except ImportError:
        raise UserError(f"reasoning_gym data needs the reasoning-gym package, which is not installed: {INSTALL}") from None
    return reasoning_gym


def _value(text: str) -> Any:
    """A query value as YAML reads it: `3` an int, `0.5` a float, `true` a bool, `[a, b]` a list, else the text."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse(spec: str) -> GymSpec:
    """`reasoning_gym:TASK[*W][,TASK[*W]...][?key=value&...]` -> GymSpec; a UserError naming the part that is wrong."""
    body, _, query = spec[len(PREFIX):].partition("?")
    if not body.strip():
        raise UserError(f"{spec}: name a reasoning-gym task after `{PREFIX}` (e.g. {PREFIX}chain_sum?size=1000&seed=1)")
    tasks = []
    for part in body.split(","):
        name, star, weight = (text.strip() for text in part.partition("*"))
        try:
            w = float(weight) if star else 1.0
        except ValueError:
            w = float("nan")
        if not w > 0 or w == float("inf"):
            raise UserError(f"{spec}: the weight of {name or part!r} must be a number > 0, got {weight!r}")
        if any(t.name == name for t in tasks):
            raise UserError(f"{spec}: task {name} is named twice")
        tasks.append(TaskSpec(name, w))
    parsed = GymSpec(tasks)
    by_name = {t.name: t for t in tasks}
    given = set()
    for item in filter(None, query.split("&")):
        key, equals, text = (unquote(part) for part in item.partition("="))
        if not equals or not key:
            raise UserError(f"{spec}: expected KEY=VALUE after `?` (joined by `&`), got {item!r}")
        if key in given:
            raise UserError(f"{spec}: {key} is given twice")
        given.add(key)
        value = _value(text)
        if key == "size" or key == "seed":
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key == "size" else 0):
                raise UserError(f"{spec}: {key} must be a whole number {'> 0' if key == 'size' else '>= 0'}, got {text!r}")
            setattr(parsed, key, value)
        elif key == "system_prompt":
            parsed.system_prompt = text
        elif parsed.composite:
            task, dot, setting = key.partition(".")
            if not dot or task not in by_name:
                raise UserError(f"{spec}: with several tasks a task's setting is written TASK.KEY=VALUE "
                                f"(one of {', '.join(by_name)}), got {key!r}")
            by_name[task].config[setting] = value
        else:
            tasks[0].config[key] = value
    return parsed


def _check(parsed: GymSpec, spec: str) -> None:
    """Each task known (else the close names), each setting one its config has, the system prompt one reasoning-gym has."""
    from reasoning_gym.factory import DATASETS
    from reasoning_gym.utils import SYSTEM_PROMPTS

    for task in parsed.tasks:
        if task.name not in DATASETS or task.name == "composite":
            close = difflib.get_close_matches(task.name, [n for n in DATASETS if n != "composite"], n=4, cutoff=0.6)
            hint = f"; close names: {', '.join(close)}" if close else f"; {len(DATASETS) - 1} tasks: reasoning_gym.factory.DATASETS"
            raise UserError(f"{spec}: reasoning-gym has no task {task.name!r}{hint}")
        config_cls = DATASETS[task.name][1]
        known = [f.name for f in fields(config_cls)] if is_dataclass(config_cls) else []
        for key in task.config:
            if key not in known or key in RESERVED:
                settings = ", ".join(k for k in known if k not in RESERVED)
                raise UserError(f"{spec}: task {task.name} has no setting {key!r} (its settings: {settings})")
    if parsed.system_prompt is not None and parsed.system_prompt not in SYSTEM_PROMPTS:
        raise UserError(f"{spec}: system_prompt must be one of reasoning-gym's {', '.join(SYSTEM_PROMPTS)}, got {parsed.system_prompt!r}")


def _create(parsed: GymSpec):
    """The dataset of `parsed`: the one task, or reasoning-gym's composite of several with their weights."""
    rg = library()
    seed = DEFAULT_SEED if parsed.seed is None else parsed.seed
    if not parsed.composite:
        task = parsed.tasks[0]
        return rg.create_dataset(task.name, **task.config, size=parsed.size, seed=seed)
    from reasoning_gym.composite import DatasetSpec

    specs = [DatasetSpec(name=t.name, weight=t.weight, config=dict(t.config)) for t in parsed.tasks]
    return rg.create_dataset("composite", size=parsed.size, seed=seed, datasets=specs)


@functools.lru_cache(maxsize=32)
def dataset_for(spec: str):
    """The reasoning-gym dataset a spec names (checked; one UserError line otherwise), built once per spec."""
    library()
    parsed = parse(spec)
    _check(parsed, spec)
    try:
        return _create(parsed)
    except (AssertionError, ValueError, TypeError) as e:  # a config's own validation
        raise UserError(f"{spec}: reasoning-gym refused the settings ({type(e).__name__}: {e})") from None


def read_rows(spec: str) -> list[dict]:
    """The rows of a spec: prompt (the question, or with `system_prompt` a system and a user message), answer, metadata,
    task (the entry's own task, in a composite the one it was drawn from) and dataset (the spec, defaults filled in)."""
    parsed = parse(spec)
    dataset = dataset_for(spec)
    written = parsed.text()
    prompt = _prompt_maker(parsed.system_prompt)
    rows = []
    for i in range(len(dataset)):
        entry = dataset[i]
        metadata = entry.get("metadata") or {}
        rows.append({"prompt": prompt(entry["question"]), "answer": entry["answer"], "metadata": metadata,
                     "task": metadata.get("source_dataset", parsed.tasks[0].name), "dataset": written})
    return rows


def _prompt_maker(system_prompt: Optional[str]):
    if system_prompt is None:
        return lambda question: question
    from reasoning_gym.utils import SYSTEM_PROMPTS

    text = SYSTEM_PROMPTS[system_prompt]
    return lambda question: [{"role": "system", "content": text}, {"role": "user", "content": question}]


def eval_source(train: Any, evaluation: Any) -> Any:
    """data.eval as read: a reasoning_gym spec without a seed, beside a reasoning_gym training spec, gets the first seed
    after the training entries' (train seed + train size), so that no eval entry is a training entry (seeds S and S+1
    share all but one entry). Anything else is returned as given."""
    if not (is_gym_spec(train) and is_gym_spec(evaluation)):
        return evaluation
    held = parse(evaluation)
    if held.seed is not None:
        return evaluation
    trained = parse(train)
    held.seed = (DEFAULT_SEED if trained.seed is None else trained.seed) + trained.size
    return held.text()
