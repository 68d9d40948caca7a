"""Experiment trackers as metric sinks: TensorBoard, MLflow, Weights & Biases, trackio.

`report_to: [tensorboard, mlflow, wandb, trackio]` (any subset) adds one `Trackers` sink next to
metrics.jsonl and the console. Every tracker gets every numeric metric of each update's record
with the update number as its step, the resolved config as hyperparameters, and the sample rows
of each sample generation as a table (TensorBoard, which has no tables, as a text table).

Each tracker uses its own library directly (accelerate's tracker wrappers have neither resume by
run id nor tables for all four, and would tie the sinks to an Accelerator). Local by default:
TensorBoard event files in <output_dir>/tensorboard, an MLflow file store in <output_dir>/mlruns
(unless `mlflow_tracking_uri` or MLFLOW_TRACKING_URI says otherwise), W&B files in
<output_dir>/wandb (offline with WANDB_MODE=offline), trackio's local database.

Resume: `<output_dir>/trackers.json` keeps each tracker's run id and the last update it was sent.
A resumed run continues the same tracker runs, replays the updates of the checkpoint that a tracker
lacks (from metrics.jsonl and samples.jsonl) and never sends an update twice: updates a tracker
already has from before an interruption are kept, not repeated.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Iterable, Optional

from ppokit.console import stdout_to_stderr
from ppokit.errors import UserError

# tracker -> the module its library installs (what must be importable); the extra has the tracker's name
MODULES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb", "trackio": "trackio"}
TRACKERS = tuple(MODULES)
STATE_FILE = "trackers.json"
SAMPLE_COLUMNS = ("update", "episode", "split", "prompt", "completion", "score")


def check_installed(names: Iterable[str]) -> None:
    """A clear error naming the extra for each tracker whose package is missing; imports nothing, so it
    runs before any model loads."""
    missing = [name for name in names if importlib.util.find_spec(MODULES[name]) is None]
    if missing:
        extras = ",".join(missing)
        raise UserError(
            f"report_to: {', '.join(missing)} {'needs its package' if len(missing) == 1 else 'need their packages'}, "
            f"which {'is' if len(missing) == 1 else 'are'} not installed: pip install \"ppokit[{extras}]\" "
            f"(in a checkout: pip install -e \".[{extras}]\"; \".[trackers]\" brings all four)"
        )


def check_usable(names: Iterable[str]) -> None:
    """Before any model loads: each tracker's package is installed, and trackio's local store can be
    written (trackio writes it from a background thread that only warns when it fails)."""
    check_installed(names)
    if "trackio" in names:
        TrackioTracker.check_store()


class NotStored(Exception):
    """A tracker's store holds fewer updates than it was sent; trackers.json was set back to what it holds."""


def scalars(record: dict) -> dict[str, float]:
    """The numeric metrics of a record, without the step (`update`)."""
    return {k: float(v) for k, v in record.items() if k != "update" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def flat_config(config: dict, prefix: str = "") -> dict[str, Any]:
    """{"ppo": {"kl_coef": 0.05}} -> {"ppo.kl_coef": 0.05}; lists and None as text (what hparam stores take)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flat_config(value, f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = json.dumps(value, default=str)
    return flat


class TrackerState:
    """<output_dir>/trackers.json: per tracker its run identity and the last update sent to it."""

    def __init__(self, output_dir: Path, data: dict):
        self.path = Path(output_dir) / STATE_FILE
        self.data = data

    @classmethod
    def load(cls, output_dir: Path, resumed: bool) -> "TrackerState":
        """A resumed run's trackers.json, checked (a UserError naming the file and what is wrong in it:
        `checkpoint.load_checkpoint` reads it before the resume changes anything); a fresh state otherwise."""
        path = Path(output_dir) / STATE_FILE
        if not (resumed and path.is_file()):
            return cls(output_dir, {"trackers": {}})
        problem = "is not valid JSON"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            problem = _state_problem(data)
        except (OSError, UnicodeDecodeError) as e:
            problem = f"cannot be read ({getattr(e, 'strerror', None) or e})"
        except ValueError:
            pass
        if problem:
            raise UserError(f"{path}: {problem}; it records which updates each tracker of report_to was sent. Restore it, or "
                            "delete it to have the trackers start new runs and be sent every update of the run again")
        return cls(output_dir, data)

    def of(self, name: str) -> dict:
        return self.data["trackers"].setdefault(name, {})

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(self.data, indent=1))
        os.replace(partial, self.path)


# The keys TrackerState.save writes in a tracker's entry, and their types.
_ENTRY_TYPES = {"last_update": int, "hparams_written": bool, "log_dir": str, "tracking_uri": str, "run_id": str, "id": str, "name": str}


def _state_problem(data: Any) -> str:
    """What is wrong with the contents of trackers.json, or ""."""
    if not isinstance(data, dict) or not isinstance(data.get("trackers"), dict):
        return 'is not a mapping with a "trackers" mapping in it'
    if "run_name" in data and not isinstance(data["run_name"], str):
        return f"run_name is {data['run_name']!r}, not text"
    for name, entry in data["trackers"].items():
        if not isinstance(entry, dict):
            return f"trackers.{name} is {entry!r}, not a mapping"
        for key, kind in _ENTRY_TYPES.items():
            value = entry.get(key)
            if key in entry and (not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 0))):
                return f"trackers.{name}.{key} is {value!r}, not {'a whole number >= 0' if kind is int else kind.__name__}"
    return ""


class Tracker:
    """One tracker run. Subclasses start (or continue) it, log one update, and finish it."""

    name = ""

    def __init__(self, settings: "TrackerSettings", state: dict):
        self.settings = settings
        self.state = state  # this tracker's entry in trackers.json, updated in place

    def start(self) -> None:
        """Start the tracker run, or continue the one named in `self.state`."""
        raise NotImplementedError

    def log(self, update: int, metrics: dict[str, float], samples: list[dict]) -> None:
        raise NotImplementedError

    def finish(self, complete: bool) -> None:
        raise NotImplementedError


class TrackerSettings:
    """What the trackers read from the run's config."""

    def __init__(self, config, run_name: str, output_dir: Path):
        self.output_dir = output_dir
        self.config = config.to_dict()
        self.project = config.project
        self.run_name = run_name
        self.mlflow_tracking_uri = config.mlflow_tracking_uri


def _sample_table(rows: list[dict]) -> tuple[list[str], list[list]]:
    return list(SAMPLE_COLUMNS), [[row.get(c) for c in SAMPLE_COLUMNS] for row in rows]


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        # one folder per tracker run, so a fresh run over an old run directory does not mix with its events
        self.state.setdefault("log_dir", str(self.settings.output_dir / "tensorboard" / self.settings.run_name))
        self.writer = SummaryWriter(self.state["log_dir"])
        if not self.state.get("hparams_written"):
            values = {k: v for k, v in flat_config(self.settings.config).items()}
            for summary in hparams(values, {}):
                self.writer.file_writer.add_summary(summary)
            self.writer.add_text("config", "```\n" + json.dumps(self.settings.config, indent=1, default=str) + "\n```", 0)
            self.state["hparams_written"] = True

    def log(self, update: int, metrics: dict[str, float], samples: list[dict]) -> None:
        for key, value in metrics.items():
            # float32 tensor scalars: TensorBoard's default (fast) loader shows no float64 ones. The exact
            # values stay in metrics.jsonl.
            self.writer.add_scalar(key, value, update, new_style=True)
        if samples:
            columns, rows = _sample_table(samples)
            lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(str(v).replace("|", "\\|").replace("\n", " ") for v in row) + " |" for row in rows]
            self.writer.add_text("samples", "\n".join(lines), update)
        self.writer.flush()

    def finish(self, complete: bool) -> None:
        self.writer.close()


class MLflowTracker(Tracker):
    name = "mlflow"

    def start(self) -> None:
        from mlflow.tracking import MlflowClient

        uri = self.state.get("tracking_uri") or self.settings.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") \
            or (self.settings.output_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 keeps its file store in maintenance mode behind this switch; the default store is one.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        self.client = MlflowClient(tracking_uri=uri)
        self.state["tracking_uri"] = uri
        run_id = self.state.get("run_id")
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
            present = set(self.client.get_run(run_id).data.params)
        else:
            experiment = self.client.get_experiment_by_name(self.settings.project)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(self.settings.project)
            run = self.client.create_run(experiment_id, run_name=self.settings.run_name,
                                         tags={"ppokit.output_dir": str(self.settings.output_dir.resolve())})
            run_id = self.state["run_id"] = run.info.run_id
            present = set()
        self.run_id = run_id
        from mlflow.entities import Param

        # A resumed run keeps the params it has (MLflow refuses to change one; only resume-safe keys can differ).
        params = [Param(k, str(v)[:6000]) for k, v in flat_config(self.settings.config).items() if k not in present]
        for i in range(0, len(params), 100):
            self.client.log_batch(run_id, params=params[i: i + 100])

    def log(self, update: int, metrics: dict[str, float], samples: list[dict]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, update) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i: i + 1000])
        if samples:
            columns, rows = _sample_table(samples)
            table = {c: [row[j] for row in rows] for j, c in enumerate(columns)}
            with warnings.catch_warnings():  # a pandas deprecation inside mlflow, nothing the user can act on
                warnings.simplefilter("ignore")
                self.client.log_table(self.run_id, table, f"samples/update-{update:06d}.json")

    def finish(self, complete: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if complete else "KILLED")


class WandbTracker(Tracker):
    name = "wandb"

    def start(self) -> None:
        import wandb

        run_id = self.state.setdefault("id", uuid.uuid4().hex[:12])
        self.run = wandb.init(
            project=self.settings.project, name=self.settings.run_name, id=run_id, resume="allow",
            dir=str(self.settings.output_dir), config=self.settings.config,
            settings=wandb.Settings(console="off", silent=True),
        )
        self.wandb = wandb

    def log(self, update: int, metrics: dict[str, float], samples: list[dict]) -> None:
        values: dict[str, Any] = dict(metrics)
        if samples:
            columns, rows = _sample_table(samples)
            values["samples"] = self.wandb.Table(columns=columns, data=rows)
        self.run.log(values, step=update)

    def finish(self, complete: bool) -> None:
        self.run.finish(exit_code=0 if complete else 1)


class TrackioTracker(Tracker):
    """trackio logs from a background thread that only warns when its store cannot be written: the store
    is checked at start, and what it holds is read back when the run finishes or resumes, so
    trackers.json never records an update as logged that the store lacks."""

    name = "trackio"

    @staticmethod
    def local_store() -> Optional[Path]:
        """trackio's local store (TRACKIO_DIR, by default under HF_HOME), or None when it logs to a Space or server."""
        if os.environ.get("TRACKIO_SPACE_ID") or os.environ.get("TRACKIO_SERVER_URL"):
            return None
        with stdout_to_stderr():
            from trackio.utils import TRACKIO_DIR  # trackio's own answer, read when it is first imported
        return Path(TRACKIO_DIR)

    @classmethod
    def check_store(cls) -> None:
        store = cls.local_store()
        if store is None:
            return
        try:
            store.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=store):
                pass
        except OSError as e:
            raise UserError(f"report_to: trackio cannot write its store TRACKIO_DIR={store} ({e.strerror or e}): "
                            "set TRACKIO_DIR to a writable folder, or leave trackio out of report_to") from None

    def stored_last_update(self) -> Optional[int]:
        """The last update trackio's local store holds for this run (0: none), or None when it logs remotely."""
        if self.local_store() is None:
            return None
        from trackio.sqlite_storage import SQLiteStorage

        return SQLiteStorage.get_last_step(self.settings.project, self.state["name"]) or 0

    def start(self) -> None:
        self.check_store()
        if "name" in self.state:  # resuming: what an interrupted run sent may never have reached the store
            stored = self.stored_last_update()
            if stored is not None and stored < self.state.get("last_update", 0):
                self.state["last_update"] = stored
        with stdout_to_stderr():  # trackio prints its banner, coloured
            import trackio

            self.trackio = trackio
            resume = "must" if "name" in self.state else "never"  # trackio finds the run to continue by its name
            name = self.state.setdefault("name", self.settings.run_name)
            self.run = trackio.init(
                project=self.settings.project, name=name, config=flat_config(self.settings.config),
                resume=resume, embed=False, auto_log_cpu=False, auto_log_gpu=False,
            )

    def log(self, update: int, metrics: dict[str, float], samples: list[dict]) -> None:
        values: dict[str, Any] = {k: v for k, v in metrics.items() if math.isfinite(v)}  # its store takes no NaN
        if samples:
            columns, rows = _sample_table(samples)
            values["samples"] = self.trackio.Table(columns=columns, data=rows)
        self.run.log(values, step=update)

    def finish(self, complete: bool) -> None:
        with stdout_to_stderr():
            self.trackio.finish()  # finishes the current run (ours) and forgets it, so exit does not finish it again
        stored, sent = self.stored_last_update(), self.state.get("last_update", 0)
        if stored is not None and stored < sent:
            self.state["last_update"] = stored
            raise NotStored(f"its store TRACKIO_DIR={self.local_store()} holds updates up to {stored} of the {sent} sent "
                            "(it could not write them); trackers.json records only those, and --resume sends it the rest")


CLASSES = {cls.name: cls for cls in (TensorBoardTracker, MLflowTracker, WandbTracker, TrackioTracker)}


class Trackers:
    """The metrics sink that feeds every configured tracker (ppokit.metrics.sinks.Sink).

    Samples wait for their update's record, so a tracker logs an update's metrics and samples at one
    step. An update a tracker was already sent (trackers.json) is not sent again. A tracker that fails
    (a server gone, a disk full) is said once and sent nothing more in this run; training goes on, and
    a later --resume replays what it missed.
    """

    def __init__(self, trackers: list[Tracker], state: TrackerState, total_updates: int, say=lambda message: None):
        self.trackers = trackers
        self.state = state
        self.total_updates = total_updates
        self.say = say
        self.pending: list[dict] = []
        self.last_update = 0

    def record(self, record: dict) -> None:
        update = record["update"]
        samples = [row for row in self.pending if row.get("update") == update]
        self.pending = []
        metrics = scalars(record)
        for tracker in list(self.trackers):
            if update > tracker.state.get("last_update", 0):
                try:
                    tracker.log(update, metrics, samples)
                except Exception as error:  # a tracker must not end a training run; metrics.jsonl has every number
                    self._drop(tracker, f"logging update {update} failed", error)
                    continue
                tracker.state["last_update"] = update
        self.last_update = update
        self.state.save()

    def samples(self, rows: list[dict]) -> None:
        self.pending.extend(rows)

    def close(self) -> None:
        complete = self.last_update >= self.total_updates
        for tracker in self.trackers:
            try:
                tracker.finish(complete)
            except NotStored as error:
                self.say(f"warning: {tracker.name}: {error}")
            except Exception as error:  # the run's models are saved after the sinks close: never stop that
                self.say(f"warning: {tracker.name}: could not finish its run ({type(error).__name__}: {error})")
        self.state.save()

    def _drop(self, tracker: Tracker, what: str, error: Exception) -> None:
        self.trackers.remove(tracker)
        self.say(f"warning: {tracker.name}: {what} ({type(error).__name__}: {error}); it gets no more updates in this run "
                 "(every number is in metrics.jsonl; --resume sends it what it missed)")
        try:
            tracker.finish(False)
        except Exception:
            pass  # already failing; the warning above is what the user needs


def open_trackers(config, *, total_updates: int, done_updates: int, say=lambda message: None, output_dir=None) -> Optional[Trackers]:
    """Start (or, on resume, continue) every tracker of `config.report_to`; None when there are none. Their files go
    under `output_dir` (default config.output_dir), made absolute here: the trackers write there all run long.

    On resume (done_updates > 0) each tracker is sent the updates of the run so far that it lacks,
    read from metrics.jsonl and samples.jsonl (which resume rewrote to the checkpoint's)."""
    names = list(config.report_to)
    if not names:
        return None
    check_installed(names)
    output_dir = Path(output_dir if output_dir is not None else config.output_dir).absolute()
    state = TrackerState.load(output_dir, resumed=done_updates > 0)
    # one name for the whole run, kept across resumes
    state.data.setdefault("run_name", f"{output_dir.resolve().name}-{time.strftime('%Y%m%d-%H%M%S')}")
    state.data["run_name"] = config.run_name or state.data["run_name"]
    settings = TrackerSettings(config, state.data["run_name"], output_dir)
    trackers = []
    for name in names:
        entry = state.of(name)
        ahead = entry.get("last_update", 0)
        if ahead > done_updates:
            which = f"update {ahead} was" if ahead == done_updates + 1 else f"updates {done_updates + 1}-{ahead} were"
            say(f"{name}: {which} logged before the run stopped; kept, and not sent again (a resumed run repeats the same numbers)")
        tracker = CLASSES[name](settings, entry)
        try:
            tracker.start()
        except Exception as error:
            for started in trackers:
                started.finish(False)
            if isinstance(error, UserError):
                raise
            raise UserError(f"report_to: {name} could not start its run: {type(error).__name__}: {error}") from error
        trackers.append(tracker)
    sink = Trackers(trackers, state, total_updates, say)
    if done_updates > 0:
        _replay(sink, output_dir, done_updates)
    state.save()
    return sink


def _replay(sink: Trackers, output_dir: Path, done_updates: int) -> None:
    behind = min(t.state.get("last_update", 0) for t in sink.trackers)
    if behind >= done_updates:
        return
    samples = [r for r in read_jsonl_records(output_dir / "samples.jsonl") if behind < r.get("update", 0) <= done_updates]
    for record in read_jsonl_records(output_dir / "metrics.jsonl"):
        if behind < record["update"] <= done_updates:
            sink.samples([r for r in samples if r["update"] == record["update"]])
            sink.record(record)


def read_jsonl_records(path: str | Path) -> list[dict]:
    """The records of a run's metrics.jsonl / samples.jsonl ([] when there is none yet)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
