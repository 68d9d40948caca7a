"""Experiment trackers as sinks, each read back with its own library's reader: TensorBoard's
EventAccumulator, MlflowClient on the file store, W&B's offline run files (`wandb leet inspect`),
trackio's local SQLite store. The scalars must equal the records, update by update, each once."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy
import pytest

# trackio reads its store's location once, when first imported: point it at a folder of the tests.
os.environ.setdefault("TRACKIO_DIR", tempfile.mkdtemp(prefix="ppokit-test-trackio-"))

from ppokit.metrics import trackers  # noqa: E402
from ppokit.config.schema import PPOConfig  # noqa: E402
from ppokit.errors import UserError  # noqa: E402
from test_report import healthy_records, sample_rows  # noqa: E402

ALL = list(trackers.TRACKERS)


@pytest.fixture(autouse=True)
def offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def config_for(output_dir: Path, report_to=ALL, **keys) -> PPOConfig:
    overrides = ["model=x", "reward.functions=[sentiment]", f"output_dir={output_dir}", f"report_to={json.dumps(report_to)}"]
    return PPOConfig.load(None, overrides + [f"{k}={v}" for k, v in keys.items()])


# --------------------------------------------------------------------------- each tracker's own reader


def tracker_state(output_dir: Path) -> dict:
    return json.loads((output_dir / trackers.STATE_FILE).read_text())


def read_tensorboard(output_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    events = EventAccumulator(tracker_state(output_dir)["trackers"]["tensorboard"]["log_dir"], size_guidance={"tensors": 0})
    events.Reload()
    return {
        tag: [(e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in events.Tensors(tag)]
        for tag in events.Tags()["tensors"] if not tag.endswith("/text_summary")
    }


def tensorboard_hparams_and_texts(output_dir: Path) -> tuple[dict, list[tuple[int, str]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2
    from tensorboard.util import tensor_util

    events = EventAccumulator(tracker_state(output_dir)["trackers"]["tensorboard"]["log_dir"], size_guidance={"tensors": 0})
    events.Reload()
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    values = {k: (v.number_value if v.HasField("number_value") else v.string_value if v.HasField("string_value") else v.bool_value)
              for k, v in hparams.items()}
    texts = [(e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode()) for e in events.Tensors("samples/text_summary")]
    return values, texts


def mlflow_client(output_dir: Path):
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    entry = tracker_state(output_dir)["trackers"]["mlflow"]
    return MlflowClient(tracking_uri=entry["tracking_uri"]), entry["run_id"]


def read_mlflow(output_dir: Path, keys) -> dict[str, list[tuple[int, float]]]:
    client, run_id = mlflow_client(output_dir)
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key)) for key in keys}


def wandb_records(output_dir: Path) -> list[dict]:
    """Every record of every offline run file (a resumed run adds one file per start), via W&B's own inspector."""
    records = []
    for path in sorted(glob.glob(str(output_dir / "wandb" / "offline-run-*" / "run-*.wandb"))):
        wandb_cli = Path(sys.executable).with_name("wandb")
        out = subprocess.run([str(wandb_cli), "leet", "inspect", "--json", path], capture_output=True, text=True, timeout=120, check=True)
        records += [dict(json.loads(line), file=path) for line in out.stdout.splitlines() if line.strip()]
    return records


def read_wandb(output_dir: Path) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for record in wandb_records(output_dir):
        if record["type"] == "history":
            step = record["history"]["step"]["num"]
            for key, value in record["history"]["item"].items():
                if not key.startswith("_") and isinstance(value, (int, float)):
                    series.setdefault(key, []).append((step, value))
    return series


def read_trackio(output_dir: Path, project: str = "ppokit") -> list[dict]:
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_logs(project, tracker_state(output_dir)["run_name"])


def trackio_series(logs: list[dict]) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for log in logs:
        for key, value in log.items():
            if key not in ("step", "timestamp") and isinstance(value, (int, float)):
                series.setdefault(key, []).append((log["step"], value))
    return series


def expected(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for key, value in trackers.scalars(record).items():
            series.setdefault(key, []).append((record["update"], value))
    return series


def float32(value: float) -> float:
    return float(numpy.float32(value))


# TensorBoard holds float32 scalars (its default loader shows no float64 ones): each value is the record's rounded once.
STORED_AS = {"tensorboard": float32}


def assert_same_series(got: dict, records: list[dict], name: str) -> None:
    stored = STORED_AS.get(name, lambda value: value)
    want = {key: [(step, stored(value)) for step, value in points] for key, points in expected(records).items()}
    missing = sorted(set(want) - set(got))
    assert not missing, f"{name}: metrics not logged: {missing}"
    for key, points in want.items():
        assert sorted(got[key]) == points, f"{name}: {key}"


# --------------------------------------------------------------------------- tests


def feed(sink, records, sample_updates=(3, 6)):
    for record in records:
        if record["update"] in sample_updates:
            sink.samples(sample_rows((record["update"],)))
        sink.record(record)


def test_every_tracker_round_trips_metrics_config_and_samples(tmp_path):
    records = healthy_records(6)
    config = config_for(tmp_path / "run", run_name="rt")
    sink = trackers.open_trackers(config, total_updates=6, done_updates=0)
    feed(sink, records)
    sink.close()
    out = tmp_path / "run"

    assert_same_series(read_tensorboard(out), records, "tensorboard")
    assert tracker_state(out)["trackers"]["tensorboard"]["log_dir"] == str(out / "tensorboard" / "rt")
    hparams, texts = tensorboard_hparams_and_texts(out)
    assert hparams["ppo.kl_coef"] == 0.05 and hparams["report_to"] == json.dumps(ALL) and hparams["run_name"] == "rt"
    assert [step for step, _ in texts] == [3, 6] and "pretty good and fun number 2 ." in texts[0][1]

    assert_same_series(read_mlflow(out, expected(records)), records, "mlflow")
    client, run_id = mlflow_client(out)
    run = client.get_run(run_id)
    assert run.data.params["ppo.kl_coef"] == "0.05" and run.info.run_name == "rt" and run.info.status == "FINISHED"
    assert [a.path for a in client.list_artifacts(run_id, "samples")] == ["samples/update-000003.json", "samples/update-000006.json"]
    table = json.loads(Path(client.download_artifacts(run_id, "samples/update-000006.json", str(tmp_path / "dl"))).read_text())
    assert table["columns"] == list(trackers.SAMPLE_COLUMNS) and table["data"][1][4] == "pretty good and fun number 1 ."

    assert_same_series(read_wandb(out), records, "wandb")
    wandb_run = next(r["run"] for r in wandb_records(out) if r["type"] == "run")
    assert wandb_run["display_name"] == "rt" and wandb_run["project"] == "ppokit"
    assert wandb_run["config"]["update"]["ppo"]["kl_coef"] == 0.05
    tables = [r["history"]["item"] for r in wandb_records(out) if r["type"] == "history" and "samples.path" in r["history"]["item"]]
    assert [t["_step"] for t in tables] == [3, 6]
    media = json.loads(next(Path(p).read_text() for p in glob.glob(str(out / "wandb" / "offline-run-*" / "files" / tables[1]["samples.path"]))))
    assert media["columns"] == list(trackers.SAMPLE_COLUMNS) and media["data"][0][0] == 6

    logs = read_trackio(out)
    assert_same_series(trackio_series(logs), records, "trackio")
    assert [log["samples"]["_value"][0]["update"] for log in logs if "samples" in log] == [3, 6]


def test_tensorboard_started_as_documented_shows_every_scalar(tmp_path):
    """`tensorboard --logdir <output_dir>/tensorboard` with its default (fast) loader said "No scalar data was
    found": the scalars were float64 tensors, which only `--load_fast=false` reads. The real server, on a
    loopback port, read back through the HTTP endpoint its scalar dashboard reads."""
    import re
    import urllib.parse
    import urllib.request

    records = healthy_records(4)
    sink = trackers.open_trackers(config_for(tmp_path / "run", ["tensorboard"], run_name="tb"), total_updates=4, done_updates=0)
    feed(sink, records, ())
    sink.close()
    want = {key: [[step, value] for step, value in points] for key, points in expected(records).items()}

    log = tmp_path / "tensorboard.log"
    with log.open("w") as out:
        server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(tmp_path / "run" / "tensorboard"),
                                   "--host", "127.0.0.1", "--port", "0"], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.PIPE)
    try:
        def get(path: str, **query):
            port = re.search(r"at http://127\.0\.0\.1:(\d+)/", log.read_text()).group(1)
            url = f"http://127.0.0.1:{port}/data/plugin/scalars/{path}?{urllib.parse.urlencode(query)}"
            with urllib.request.urlopen(url, timeout=30) as response:
                return json.loads(response.read())

        deadline = time.monotonic() + 240  # starts in seconds; its loader reads the logdir in the background
        tags = {}
        while set(tags.get("tb", ())) != set(want):
            assert server.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"no scalars after 240 s: {tags}\n{log.read_text()}"
            time.sleep(1)
            try:
                tags = get("tags")
            except (AttributeError, OSError):  # not listening yet (no port printed, or refused)
                pass
        for key, points in want.items():
            shown = [[step, value] for _, step, value in get("scalars", run="tb", tag=key)]
            assert shown == [[step, float32(value)] for step, value in points], key
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_trackio_says_where_its_run_is_on_stderr_without_colour_codes(tmp_path, capsys):
    """trackio prints its banner to stdout, which carries only results, with terminal colour codes that
    a log file would keep as noise."""
    # a project of its own: trackio prints the banner once per project and process
    config = config_for(tmp_path / "run", ["trackio"], run_name="plain", project="banner")
    sink = trackers.open_trackers(config, total_updates=2, done_updates=0)
    feed(sink, healthy_records(2), ())
    sink.close()
    out, err = capsys.readouterr()
    assert out == "" and 'trackio show --project "banner"' in err and "\x1b" not in err, (out, err)


def test_resume_continues_the_same_tracker_runs_and_sends_each_update_once(tmp_path):
    """Updates 1-4, a stop, then a resume from the checkpoint at update 3: the trackers hold 1-4 already
    (kept), a tracker added on resume gets 1-3 replayed from the run files, and 5-6 follow; every step once."""
    out = tmp_path / "run"
    records = healthy_records(6)
    first = trackers.open_trackers(config_for(out, ["tensorboard", "mlflow", "wandb"]), total_updates=6, done_updates=0)
    feed(first, records[:4])
    first.close()
    ids = tracker_state(out)
    # resume from the checkpoint of update 3: the run's files hold updates 1-3 again
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:3]))
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sample_rows((3,))))
    said = []
    second = trackers.open_trackers(config_for(out), total_updates=6, done_updates=3, say=said.append)
    feed(second, records[3:])
    second.close()

    assert said == [f"{name}: update 4 was logged before the run stopped; kept, and not sent again "
                    "(a resumed run repeats the same numbers)" for name in ("tensorboard", "mlflow", "wandb")]
    state = tracker_state(out)
    assert state["run_name"] == ids["run_name"]
    assert state["trackers"]["mlflow"]["run_id"] == ids["trackers"]["mlflow"]["run_id"]
    assert state["trackers"]["wandb"]["id"] == ids["trackers"]["wandb"]["id"]
    assert_same_series(read_tensorboard(out), records, "tensorboard")
    assert_same_series(read_mlflow(out, expected(records)), records, "mlflow")
    assert_same_series(read_wandb(out), records, "wandb")
    assert {r["run"]["run_id"] for r in wandb_records(out) if r["type"] == "run"} == {ids["trackers"]["wandb"]["id"]}
    logs = read_trackio(out)  # added on resume: 1-3 replayed, then 4-6
    assert_same_series(trackio_series(logs), records, "trackio")
    assert [log["samples"]["_value"][0]["update"] for log in logs if "samples" in log] == [3, 6]


def test_a_missing_tracker_package_is_an_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(trackers.MODULES, "wandb", "ppokit_no_such_module")
    with pytest.raises(UserError) as error:
        trackers.check_installed(["tensorboard", "wandb"])
    assert str(error.value) == (
        'report_to: wandb needs its package, which is not installed: pip install "ppokit[wandb]" '
        '(in a checkout: pip install -e ".[wandb]"; ".[trackers]" brings all four)'
    )


def test_report_to_names_are_checked():
    with pytest.raises(UserError, match=r"report_to: unknown tracker 'tensorbord' \(did you mean tensorboard\?\)"):
        config_for(Path("x"), ["tensorbord"])
    with pytest.raises(UserError, match="listed twice"):
        config_for(Path("x"), ["wandb", "wandb"])
    assert config_for(Path("x"), "wandb").report_to == ["wandb"]
    assert PPOConfig().report_to == []


# --------------------------------------------------------------------------- a real run through the trainer

WALL_CLOCK = ("eps", "time/")


def test_a_real_run_and_its_resume_reach_every_tracker_once(model_dir, prompts_file, tmp_path):
    """4 updates, checkpoint at update 2, a crash in update 4 (the trackers hold 1-3), resume from
    update 2: every tracker has updates 1-4 once, equal to metrics.jsonl (the wall-clock keys of the
    update done twice aside), and the same tracker runs continued."""
    from conftest import tiny_ppo_config
    from test_checkpoint import train_until_crash_at_optimizer_step

    from ppokit.trainer import PPOTrainer

    out = tmp_path / "run"

    def config():
        c = tiny_ppo_config(model_dir(), prompts_file, out, total_episodes=32, save_steps=2)
        c.report_to, c.run_name = list(ALL), "tiny-resume"
        return c

    train_until_crash_at_optimizer_step(PPOTrainer(config(), show_progress=False), 14)  # 4 steps per update: in update 4
    before = tracker_state(out)
    assert {name: entry["last_update"] for name, entry in before["trackers"].items()} == dict.fromkeys(ALL, 3)
    client, run_id = mlflow_client(out)
    assert client.get_run(run_id).info.status == "KILLED"

    trainer = PPOTrainer(config(), show_progress=False)
    trainer.resume_from()
    assert trainer.state.update == 2
    trainer.train()

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in records] == [1, 2, 3, 4] and "objective/scores_std" in records[0]
    steady = [{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)} for r in records]
    got = {
        "tensorboard": read_tensorboard(out),
        "mlflow": read_mlflow(out, expected(records)),
        "wandb": read_wandb(out),
        "trackio": trackio_series(read_trackio(out)),
    }
    for name, series in got.items():
        assert_same_series({k: v for k, v in series.items() if not k.startswith(WALL_CLOCK)}, steady, name)
        for key in ("eps", "time/update"):
            assert [step for step, _ in sorted(series[key])] == [1, 2, 3, 4], (name, key)  # each step once
    after = tracker_state(out)
    assert after["trackers"]["mlflow"]["run_id"] == before["trackers"]["mlflow"]["run_id"]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert {r["run"]["run_id"] for r in wandb_records(out) if r["type"] == "run"} == {before["trackers"]["wandb"]["id"]}
    # samples of the generations at updates 2 and 4 (training batches: the run has no eval data)
    assert [step for step, _ in tensorboard_hparams_and_texts(out)[1]] == [2, 4]


def test_a_missing_tracker_package_stops_the_run_before_any_model_loads(model_dir, prompts_file, tmp_path, monkeypatch):
    from conftest import tiny_ppo_config

    from ppokit.models import roles
    from ppokit.trainer import PPOTrainer

    def no_models(*args, **kwargs):
        raise AssertionError("models were loaded")

    monkeypatch.setitem(trackers.MODULES, "trackio", "ppokit_no_such_module")
    monkeypatch.setattr(roles, "build_roles", no_models)
    config = tiny_ppo_config(model_dir(), prompts_file, tmp_path / "run")
    config.report_to = ["trackio"]
    with pytest.raises(UserError, match=r'report_to: trackio needs its package.*pip install "ppokit\[trackio\]"'):
        PPOTrainer(config, show_progress=False)
    assert not (tmp_path / "run").exists()


def test_a_failing_tracker_is_said_once_and_training_goes_on(tmp_path, monkeypatch):
    records = healthy_records(5)
    out = tmp_path / "run"

    def server_gone(self, update, metrics, samples):
        if update == 3:
            raise ConnectionError("mlflow server went away")
        return log(self, update, metrics, samples)

    log = trackers.MLflowTracker.log
    monkeypatch.setattr(trackers.MLflowTracker, "log", server_gone)
    said = []
    sink = trackers.open_trackers(config_for(out, ["tensorboard", "mlflow"]), total_updates=5, done_updates=0, say=said.append)
    feed(sink, records)
    sink.close()
    assert said == ["warning: mlflow: logging update 3 failed (ConnectionError: mlflow server went away); it gets no more "
                    "updates in this run (every number is in metrics.jsonl; --resume sends it what it missed)"]
    assert {n: e["last_update"] for n, e in tracker_state(out)["trackers"].items()} == {"tensorboard": 5, "mlflow": 2}
    assert_same_series(read_tensorboard(out), records, "tensorboard")
    assert_same_series(read_mlflow(out, expected(records)), records[:2], "mlflow")


def test_an_unwritable_trackio_store_stops_the_run_before_any_model_loads(model_dir, prompts_file, tmp_path, monkeypatch):
    """A read-only TRACKIO_DIR exited 0 with trackio's raw warning while trackers.json recorded every update
    as logged (trackio writes from a background thread that only warns). A store under a file cannot be
    made, even by root; a read-only folder is tried too where permission bits hold (not for root)."""
    import trackio.utils
    from conftest import tiny_ppo_config

    from ppokit.models import roles
    from ppokit.trainer import PPOTrainer

    def no_models(*args, **kwargs):
        raise AssertionError("models were loaded")

    monkeypatch.setattr(roles, "build_roles", no_models)
    config = tiny_ppo_config(model_dir(), prompts_file, tmp_path / "run")
    config.report_to = ["trackio"]
    (tmp_path / "a-file").write_text("")
    stores = [(tmp_path / "a-file" / "trackio", "Not a directory")]
    if os.geteuid() != 0:
        (tmp_path / "read-only").mkdir(mode=0o555)
        stores.append((tmp_path / "read-only", "Permission denied"))
    for store, why in stores:
        monkeypatch.setattr(trackio.utils, "TRACKIO_DIR", store)  # where trackio keeps it (read from TRACKIO_DIR once)
        with pytest.raises(UserError) as error:
            PPOTrainer(config, show_progress=False)
        assert str(error.value) == (f"report_to: trackio cannot write its store TRACKIO_DIR={store} ({why}): "
                                    "set TRACKIO_DIR to a writable folder, or leave trackio out of report_to")
    assert not (tmp_path / "run").exists()


def test_updates_trackio_could_not_store_are_not_recorded_as_logged_and_a_resume_sends_them(tmp_path):
    """The store breaks after update 2 (its lock file replaced by a folder: trackio's writes fail, as on a
    disk gone read-only): the run goes on, says so in one line, and trackers.json keeps what the store
    holds; the resume sends the rest, each update once."""
    import trackio.utils
    from trackio.sqlite_storage import SQLiteStorage

    out = tmp_path / "run"
    records = healthy_records(4)
    project = f"ppokit-lost-{os.getpid()}"  # its own database and lock in the tests' trackio store
    said = []
    sink = trackers.open_trackers(config_for(out, ["trackio"], project=project, run_name="lost"), total_updates=4, done_updates=0,
                                  say=said.append)
    feed(sink, records[:2])
    for _ in range(600):  # trackio writes from its thread every fraction of a second; 60 s at most
        if SQLiteStorage.get_last_step(project, "lost") == 2:
            break
        time.sleep(0.1)
    assert SQLiteStorage.get_last_step(project, "lost") == 2
    lock = Path(trackio.utils.TRACKIO_DIR) / f"{project}.lock"
    lock.unlink()
    lock.mkdir()
    try:
        with warnings.catch_warnings():  # trackio's own warning, from its thread
            warnings.simplefilter("ignore")
            feed(sink, records[2:])
            sink.close()
    finally:
        lock.rmdir()
    assert said == [f"warning: trackio: its store TRACKIO_DIR={trackio.utils.TRACKIO_DIR} holds updates up to 2 of the 4 sent "
                    "(it could not write them); trackers.json records only those, and --resume sends it the rest"]
    assert tracker_state(out)["trackers"]["trackio"]["last_update"] == 2

    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    resumed = trackers.open_trackers(config_for(out, ["trackio"], project=project, run_name="lost"), total_updates=4, done_updates=4)
    resumed.close()
    assert tracker_state(out)["trackers"]["trackio"]["last_update"] == 4
    assert_same_series(trackio_series(read_trackio(out, project)), records, "trackio")


def test_a_tracker_that_cannot_start_is_one_error_naming_it(tmp_path):
    config = config_for(tmp_path / "run", ["mlflow"], mlflow_tracking_uri="nosuchscheme://x")
    with pytest.raises(UserError, match=r"^report_to: mlflow could not start its run: "):
        trackers.open_trackers(config, total_updates=5, done_updates=0)


def test_a_fresh_run_over_an_old_run_directory_starts_new_tracker_runs(tmp_path):
    out = tmp_path / "run"
    old = trackers.open_trackers(config_for(out, ["tensorboard", "mlflow", "wandb"]), total_updates=4, done_updates=0)
    feed(old, healthy_records(4, seed=1))
    old.close()
    first = tracker_state(out)
    time.sleep(1.1)  # the default run name carries the start time, to the second
    records = healthy_records(3, seed=2)
    new = trackers.open_trackers(config_for(out, ["tensorboard", "mlflow", "wandb"]), total_updates=3, done_updates=0)
    feed(new, records)
    new.close()
    second = tracker_state(out)
    assert second["run_name"] != first["run_name"] and second["run_name"].startswith("run-")
    for name, key in (("mlflow", "run_id"), ("wandb", "id"), ("tensorboard", "log_dir")):
        assert second["trackers"][name][key] != first["trackers"][name][key], name
    assert_same_series(read_tensorboard(out), records, "tensorboard")  # the new run's folder only
    assert_same_series(read_mlflow(out, expected(records)), records, "mlflow")
