"""Output folders: ppokit replaces or deletes only what it wrote (the .ppokit marker), refuses folders
it must not write in before any model loads, cleans up after itself, and one run holds a run folder."""

import json
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import ppokit
from ppokit.run import run_dir
from ppokit.cli import main
from ppokit.config.stages import SFTConfig
from ppokit.errors import UserError
from ppokit.stages.sft import run_sft

SRC = str(Path(ppokit.__file__).resolve().parents[1])


def ppokit_process(*args, cwd=None, limit_file_size=None, **popen):
    """`python -m ppokit ARGS` in a subprocess running this checkout's code."""
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()), PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))

    def limits():
        if limit_file_size is not None:  # as `ulimit -f`: writing past it fails with EFBIG (Python ignores SIGXFSZ)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_size, limit_file_size))

    return subprocess.Popen([sys.executable, "-m", "ppokit", *map(str, args)], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=limits, **popen)


def run_ppokit(*args, timeout=900, **kwargs):
    proc = ppokit_process(*args, **kwargs)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def one_error_line(err: str) -> str:
    """The single `ppokit: error:` line of a run that failed on a user error, without a traceback."""
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("ppokit: error: ")]
    assert len(errors) == 1 and err.rstrip().splitlines()[-1] == errors[0], err
    return errors[0]


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def a_project(folder: Path) -> Path:
    """A folder of the user's that ppokit did not write."""
    (folder / "src").mkdir(parents=True)
    (folder / "src" / "main.py").write_text("print('my project')\n")
    (folder / "notes.txt").write_text("do not lose me\n")
    return folder


@pytest.fixture(scope="module")
def sft_files(tmp_path_factory, demo_data, model_dir):
    d = tmp_path_factory.mktemp("sft-data")
    train = d / "sft.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in demo_data["sft"][:64]))
    config = d / "sft.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(model_dir("llama")), "output_dir": "out",
        "data": {"train": str(train), "eval_fraction": 0.0},
        "train": {"per_device_train_batch_size": 16, "learning_rate": 1e-3},
    }))
    return {"train": str(train), "config": config, "model": model_dir("llama")}


def sft_config(sft_files, out, *extra) -> SFTConfig:
    return SFTConfig.load(sft_files["config"], [f"output_dir={out}", *extra])


# --------------------------------------------------------------------------- sft / rm outputs (item 1)


def test_sft_refuses_to_replace_a_folder_it_did_not_write(sft_files, tmp_path):
    project = a_project(tmp_path / "project")
    before = tree(project)
    with pytest.raises(UserError, match=r"output_dir: .*project exists and was not written by ppokit \(no \.ppokit marker in it\).*--overwrite"):
        run_sft(sft_config(sft_files, project), show_progress=False)
    assert tree(project) == before

    run_sft(sft_config(sft_files, project), show_progress=False, overwrite=True)  # the user said so
    assert (project / "model.safetensors").exists() and not (project / "src").exists()
    assert run_dir.marker_kind(project) == "sft"
    run_sft(sft_config(sft_files, project), show_progress=False)  # ppokit's own output: replaced without asking
    assert run_dir.marker_kind(project) == "sft"
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".project")]  # no temporary or old folder left


def test_sft_and_rm_refuse_the_current_directory_in_one_line(sft_files, tmp_path):
    a_project(tmp_path)
    before = tree(tmp_path)
    for stage, value in (("sft", "."), ("rm", str(tmp_path)), ("sft", "..")):
        code, _, err = run_ppokit(stage, sft_files["config"], f"output_dir={value}", "--overwrite", cwd=tmp_path)
        assert code == 2, err
        line = one_error_line(err)
        assert f"output_dir: {value} is " in line and "the current directory" in line, line
    assert tree(tmp_path) == before


def test_output_dir_that_cannot_be_used_is_refused_before_any_model_loads(sft_files, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("mine\n")
    missing_model = f"model={tmp_path / 'no-such-model'}"  # would fail if loading came first
    cases = [
        (str(a_file), "is a file, not a folder"),
        (str(a_file / "sub"), f"cannot be made: {a_file} is a file"),
        ("/proc/ppokit-run", "is in /proc, a kernel file system"),
        ("/sys/ppokit-run", "is in /sys, a kernel file system"),
    ]
    for value, expected in cases:
        with pytest.raises(UserError, match=f"output_dir: {value} {expected}" if "cannot be made" not in expected else expected):
            run_sft(sft_config(sft_files, value, missing_model), show_progress=False)
    assert a_file.read_text() == "mine\n"


def private_mount_namespace() -> bool:
    """Whether `unshare -rm` works here: a mount made inside it is seen by its processes only."""
    return bool(shutil.which("unshare")) and subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


def ppokit_on_a_mount(mount_options: str, folder: Path, *args) -> tuple[int, str]:
    """`ppokit ARGS` with a tmpfs (`mount_options`) mounted at `folder` for it alone -> (exit status, stderr + `ls -A folder`)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    command = " ".join(map(shlex.quote, [sys.executable, "-m", "ppokit", *map(str, args)]))
    where = shlex.quote(str(folder))
    script = f"mount -t tmpfs -o {mount_options} tmpfs {where} && {{ {command}; code=$?; echo left: $(ls -A {where}) >&2; exit $code; }}"
    result = subprocess.run(["unshare", "-rm", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=300)
    return result.returncode, result.stderr


def test_a_read_only_output_dir_is_refused_before_any_model_loads(sft_files, tmp_path):
    folder = tmp_path / "read-only"
    folder.mkdir()
    expected = r"output_dir: .*read-only/run cannot be written: .*read-only is not writable \((Permission denied|Read-only file system)\)"
    missing_model = f"model={tmp_path / 'no-such-model'}"  # would fail if loading came first
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            with pytest.raises(UserError, match=expected):
                run_sft(sft_config(sft_files, folder / "run", missing_model), show_progress=False)
        finally:
            folder.chmod(0o755)
        return
    if not private_mount_namespace():
        pytest.skip("root ignores permission bits, and no private mount namespace to mount a read-only folder")
    code, err = ppokit_on_a_mount("ro,size=64k", folder, "sft", sft_files["config"], f"output_dir={folder / 'run'}", missing_model)
    assert code == 2, err
    assert re.search(expected, err.splitlines()[-2]), err


def test_leftovers_of_a_killed_stage_are_cleared_at_its_next_start(sft_files, tmp_path):
    out = tmp_path / "out"
    dead = 2**22 + 12345  # above the default pid_max: no process has it
    ours = tmp_path / f".out.tmp-{dead}"
    ours.mkdir()
    run_dir.write_marker(ours, "sft")
    (ours / "model.safetensors").write_bytes(b"half")
    foreign = tmp_path / f".out.tmp-{dead + 1}"  # the same name pattern, not marked: not ppokit's
    foreign.mkdir()
    (foreign / "notes.txt").write_text("someone else's")
    running = tmp_path / f".out.tmp-{os.getppid()}"  # a live process: may be writing it now
    running.mkdir()
    run_dir.write_marker(running, "sft")
    run_sft(sft_config(sft_files, out), show_progress=False)
    assert not ours.exists() and foreign.exists() and running.exists()
    assert run_dir.marker_kind(out) == "sft"


def test_an_empty_leftover_of_a_process_killed_before_its_marker_is_removed(tmp_path):
    """SIGKILL between a temporary folder's mkdir and its marker leaves `.update-N.tmp-PID` empty (or with the marker
    file cut short): the next start removes it, as it removes marked ones; a live process's empty one stays."""
    dead = 2**22 + 4321  # above the default pid_max: no process has it
    empty, cut_short = tmp_path / f".update-3.tmp-{dead}", tmp_path / f".final.tmp-{dead + 1}"
    running = tmp_path / f".update-4.tmp-{os.getppid()}"
    for folder in (empty, cut_short, running):
        folder.mkdir()
    (cut_short / run_dir.MARKER).write_text('{"written_by": "ppo')
    done = run_dir.remove_leftovers(tmp_path)
    assert not empty.exists() and not cut_short.exists() and running.exists()
    assert f"removed .update-3.tmp-{dead}, left by process {dead}" in done
    # at the start of the run whose checkpoint it was
    run = tmp_path / "run"
    leftover = run / "checkpoints" / f".update-2.tmp-{dead}"
    leftover.mkdir(parents=True)
    run_dir.write_marker(run, "ppo-run")
    opened = run_dir.RunFolder.open(run)
    try:
        assert not leftover.exists() and f"removed .update-2.tmp-{dead}, left by process {dead}" in opened.notes
    finally:
        opened.close()


def test_remove_leftovers_finishes_a_rename_cut_short(tmp_path):
    dead = 2**22 + 777
    new, old = tmp_path / f".final.tmp-{dead}", tmp_path / f".final.old-{dead}"
    for folder, content in ((new, "new"), (old, "old")):
        folder.mkdir()
        run_dir.write_marker(folder, "final")
        (folder / "weights").write_text(content)
    done = run_dir.remove_leftovers(tmp_path)
    assert (tmp_path / "final" / "weights").read_text() == "new" and not new.exists() and not old.exists()
    assert done == [f"finished writing {tmp_path / 'final'}", f"removed .final.old-{dead}, left by process {dead}"]


def test_a_full_disk_while_saving_says_so_and_leaves_nothing_half_written(sft_files, tmp_path):
    out = tmp_path / "out"
    run_sft(sft_config(sft_files, out), show_progress=False)  # an earlier complete output
    before = tree(out)
    code, _, err = run_ppokit("sft", sft_files["config"], f"output_dir={out}", limit_file_size=64 * 1024)
    assert code == 2, err
    line = one_error_line(err)
    assert line.startswith("ppokit: error: no space left on /") and f"(File too large) while writing {out}" in line, line
    assert line.endswith(f"the partial output was removed and {out} is as it was before this run")
    assert tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_full_file_system_while_saving(sft_files, tmp_path):
    """A real ENOSPC: a 256 KiB tmpfs, mounted for the run alone."""
    if not private_mount_namespace():
        pytest.skip("no private mount namespace here")
    small = tmp_path / "small"
    small.mkdir()
    code, err = ppokit_on_a_mount("size=256k", small, "sft", sft_files["config"], f"output_dir={small / 'out'}")
    assert code == 2, err
    *log, last = err.rstrip().splitlines()
    assert last == "left:", "nothing is left on the full file system: no temporary folder"
    line = one_error_line("\n".join(log))
    assert line.startswith(f"ppokit: error: no space left on {small} (No space left on device) while writing {small / 'out'}"), line


# --------------------------------------------------------------------------- the lock


LOCK_HOLDER = """
import sys, time
sys.path.insert(0, {src!r})
from ppokit.run.run_dir import RunLock
RunLock.acquire({folder!r})
print("locked", flush=True)
time.sleep(120)
"""


def test_the_run_lock_names_the_holder_and_dies_with_it(tmp_path):
    folder = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER.format(src=SRC, folder=str(folder))], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError, match=f"{folder} is in use by another ppokit run \\(PID {holder.pid}\\); wait for it to end"):
            run_dir.RunLock.acquire(folder)
    finally:
        holder.kill()  # SIGKILL: no handler runs, the kernel drops the lock
        holder.wait()
    lock = run_dir.RunLock.acquire(folder)
    again = run_dir.RunLock.acquire(folder)  # the same process may take it again (trainer and CLI both do)
    assert again is lock and (folder / ".ppokit.lock").read_text() == f"{os.getpid()}\n"
    again.release()
    lock.release()
    assert not run_dir.RunLock._held


SFT_THAT_WAITS = """
import sys, time
from pathlib import Path
sys.path.insert(0, {src!r})
import ppokit.stages.sft as stage
from ppokit.cli import main
train_sft = stage.train_sft

def waiting(*args, **kwargs):  # holds the run at its first step until the test says go
    print("training", file=sys.stderr, flush=True)  # a command's stdout holds its results alone (cli.result)
    while not Path({go!r}).exists():
        time.sleep(0.05)
    return train_sft(*args, **kwargs)

stage.train_sft = waiting
sys.exit(main(["sft", {config!r}, "output_dir={out}"]))
"""


def test_a_second_sft_run_into_the_folder_of_one_in_progress_is_refused(sft_files, tmp_path, capsys):
    """sft (and rm: the same `stages.common.claimed_output`) hold the run lock of a ppo run on their output_dir."""
    out, go = tmp_path / "out", tmp_path / "go"
    script = SFT_THAT_WAITS.format(src=SRC, go=str(go), config=str(sft_files["config"]), out=out)
    first = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    try:
        said = ""
        while said not in ("training", None):
            said = first.stderr.readline().strip() or (None if first.poll() is not None else "")
        assert said == "training", first.stderr.read()
        assert main(["sft", str(sft_files["config"]), f"output_dir={out}"]) == 2
        assert one_error_line(capsys.readouterr().err) == (
            f"ppokit: error: {out} is in use by another ppokit run (PID {first.pid}); wait for it to end, or give another output_dir")
        assert not run_dir.RunLock._held
        assert (tmp_path / f".out.tmp-{first.pid}").is_dir()  # the first run's output in the making is untouched
    finally:
        go.touch()
        _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert json.loads((out / "summary.json").read_text())["stage"] == "sft"
    assert not (out / ".ppokit.lock").exists()  # the lock file went with the folder the output replaced


# --------------------------------------------------------------------------- ppo run folders, on their own


def fake_checkpoint(folder: Path, update: int, num_updates: int) -> Path:
    """A checkpoint folder as ppokit leaves it: marked, trainer_state.json written last."""
    folder.mkdir(parents=True)
    run_dir.write_marker(folder, "checkpoint")
    (folder / "optimizer.pt").write_bytes(b"weights of update %d" % update)
    (folder / "trainer_state.json").write_text(json.dumps({"update": update, "num_updates": num_updates, "complete": True}))
    return folder


def fake_run(folder: Path, label: str, updates: int = 2, num_updates: int = 2, final: bool = True) -> Path:
    """A ppo run folder holding `updates` checkpoints (and final/), plus a file of another tool's in checkpoints/."""
    folder.mkdir(parents=True, exist_ok=True)
    run_dir.write_marker(folder, "ppo-run")
    (folder / "config.yaml").write_text(f"run: {label}\n")
    (folder / "metrics.jsonl").write_text(f'{{"run": "{label}"}}\n')
    for u in range(1, updates + 1):
        fake_checkpoint(folder / "checkpoints" / f"update-{u}", u, num_updates)
    if final:
        (folder / "final").mkdir()
        run_dir.write_marker(folder / "final", "final")
        (folder / "final" / "model.safetensors").write_text(label)
    other = folder / "checkpoints" / "other-tool"
    other.mkdir(parents=True, exist_ok=True)
    (other / "model.bin").write_text("another tool's weights\n")
    return folder


def test_a_ppo_run_starts_only_where_it_loses_nothing(tmp_path):
    check = run_dir.check_run_start
    assert check(str(tmp_path / "new"), resume=False, overwrite=False) == tmp_path / "new"
    project = a_project(tmp_path / "project")
    with pytest.raises(UserError, match=r"project exists and is not a ppokit run folder \(no \.ppokit marker in it\); give another output_dir, or pass "
                                        r"--overwrite"):
        check(str(project), resume=False, overwrite=False)
    sft = tmp_path / "sft"
    sft.mkdir()
    run_dir.write_marker(sft, "sft")
    (sft / "model.safetensors").write_text("x")
    with pytest.raises(UserError, match="sft exists and is a ppokit sft output; give another output_dir"):
        check(str(sft), resume=False, overwrite=False)

    finished = fake_run(tmp_path / "finished", "old")
    with pytest.raises(UserError, match=re.escape(
        f"{finished} holds a finished run (2 updates, final/): give another output_dir, continue it with --resume "
        "--resume-force after raising ppo.total_episodes (the learning-rate schedule then changes), or pass --overwrite to replace it (the old run stays until "
        "the new one has written its first checkpoint)"
    )):
        check(str(finished), resume=False, overwrite=False)
    unfinished = fake_run(tmp_path / "unfinished", "old", updates=1, num_updates=4, final=False)
    with pytest.raises(UserError, match=re.escape(f"{unfinished} holds an unfinished run (checkpoint update-1 of 4 updates): give another output_dir, continue "
                                                  "it with --resume, or pass --overwrite")):
        check(str(unfinished), resume=False, overwrite=False)
    assert check(str(unfinished), resume=True, overwrite=False) == unfinished
    assert check(str(finished), resume=False, overwrite=True) == finished
    with pytest.raises(UserError, match="--resume continues the run in output_dir and --overwrite replaces it: give one of them"):
        check(str(finished), resume=True, overwrite=True)
    crashed = fake_run(tmp_path / "crashed", "old", updates=0, final=False)  # stopped before any checkpoint: nothing to lose
    assert check(str(crashed), resume=False, overwrite=False) == crashed


def test_overwrite_keeps_the_earlier_run_until_the_new_one_has_a_checkpoint(tmp_path):
    root = fake_run(tmp_path / "run", "old")
    before = tree(root)
    run = run_dir.RunFolder.open(root, overwrite=True)
    files = run.start(fresh=True, overwrite=True)
    assert files == root / ".ppokit-new-run"
    (files / "config.yaml").write_text("run: new\n")
    (files / "metrics.jsonl").write_text('{"run": "new"}\n')
    assert {k: v for k, v in tree(root).items() if not k.startswith((".ppokit-new-run", ".ppokit"))} == {
        k: v for k, v in before.items() if not k.startswith(".ppokit")}
    run.close()  # the new run failed before its first checkpoint: the earlier one is untouched
    assert tree(root) == {**before, ".ppokit.lock": f"{os.getpid()}\n".encode()}

    run = run_dir.RunFolder.open(root, overwrite=True)
    files = run.start(fresh=True, overwrite=True)
    (files / "config.yaml").write_text("run: new\n")
    fake_checkpoint(files / "checkpoints" / "update-1", 1, 3)
    assert run.commit() == root and run.files == root
    run.close()
    assert (root / "config.yaml").read_text() == "run: new\n" and not (root / "metrics.jsonl").exists()
    assert not (root / "final").exists(), "the earlier run's final/ must not sit beside the new run"
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["other-tool", "update-1"]
    assert (root / "checkpoints" / "other-tool" / "model.bin").read_text() == "another tool's weights\n"
    assert sorted(p.name for p in root.iterdir()) == [".ppokit", ".ppokit.lock", "checkpoints", "config.yaml"]


KILLED_SWAP = """
import os, signal, sys
sys.path.insert(0, {src!r})
from pathlib import Path
from ppokit.run import run_dir
root = Path({root!r})
run = run_dir.RunFolder.open(root, overwrite=True)
files = run.start(fresh=True, overwrite=True)
(files / "config.yaml").write_text("run: new\\n")
(files / "checkpoints" / "update-1").mkdir(parents=True)
run_dir.write_marker(files / "checkpoints" / "update-1", "checkpoint")
(files / "checkpoints" / "update-1" / "trainer_state.json").write_text('{{"update": 1, "num_updates": 3, "complete": true}}')
moves, real_move = [], run_dir.move_into_place
def move(source, target):
    moves.append(source)
    if len(moves) == {kill_at}:
        os.kill(os.getpid(), signal.SIGKILL)
    real_move(source, target)
run_dir.move_into_place = move
run.commit()
"""


@pytest.mark.parametrize("kill_at", [1, 3, 6, 7])  # 5 entries of the earlier run go aside, then 2 of the new run come in
def test_a_swap_cut_short_by_sigkill_is_finished_at_the_next_start(tmp_path, kill_at):
    root = fake_run(tmp_path / "run", "old")
    killed = subprocess.run([sys.executable, "-c", KILLED_SWAP.format(src=SRC, root=str(root), kill_at=kill_at)])
    assert killed.returncode == -9
    run = run_dir.RunFolder.open(root)
    run.close()
    assert run.notes[0].startswith(f"finished replacing the earlier run in {root}")
    assert (root / "config.yaml").read_text() == "run: new\n" and not (root / "final").exists()
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["other-tool", "update-1"]
    assert sorted(p.name for p in root.iterdir()) == [".ppokit", ".ppokit.lock", "checkpoints", "config.yaml"]


def test_an_overwrite_run_killed_before_its_first_checkpoint_leaves_the_earlier_run(tmp_path):
    root = fake_run(tmp_path / "run", "old")
    before = tree(root)
    script = KILLED_SWAP.split("moves, real_move")[0].replace('(files / "checkpoints" '
                                                              '/ "update-1" / "trainer_state.json")', '(files / "checkpoints" / "update-1" / "half")')
    killed = subprocess.run([sys.executable, "-c", script.format(src=SRC, root=str(root)) + "os.kill(os.getpid(), 9)\n"])
    assert killed.returncode == -9
    run = run_dir.RunFolder.open(root)
    run.close()
    assert run.notes == [f"removed the files of an --overwrite run that stopped before its first checkpoint; the earlier run in {root} is as it was"]
    assert {k: v for k, v in tree(root).items() if k != ".ppokit.lock"} == before


# --------------------------------------------------------------------------- ppo runs


def ppo_yaml(model_dir, prompts_file, path: Path, output_dir: Path, **ppo) -> Path:
    from conftest import tiny_ppo_config

    tiny_ppo_config(model_dir("llama"), prompts_file, output_dir, **ppo).save(path)
    return path


@pytest.mark.slow
def test_two_runs_on_one_folder_started_half_a_second_apart(model_dir, prompts_file, tmp_path):
    out = tmp_path / "run"
    # 8 updates: long enough that the second run starts its checks while the first is training.
    config = ppo_yaml(model_dir, prompts_file, tmp_path / "ppo.yaml", out, total_episodes=64, save_steps=1, save_total_limit=2)
    first = ppokit_process("ppo", config)
    time.sleep(0.5)
    second = ppokit_process("ppo", config)
    runs = {first.pid: first, second.pid: second}
    err_second = second.communicate(timeout=300)[1]
    still_running = first.poll() is None
    out_first, err_first = first.communicate(timeout=600)
    results = {first.pid: (first.returncode, err_first), second.pid: (second.returncode, err_second)}
    failed = [pid for pid, (code, _) in results.items() if code != 0]
    assert len(failed) == 1, results  # whichever took the lock first runs; the other stops at once
    loser, winner = failed[0], next(pid for pid in runs if pid not in failed)
    code, err = results[loser]
    assert code == 2 and one_error_line(err) == (
        f"ppokit: error: {out} is in use by another ppokit run (PID {winner}); wait for it to end, or give another output_dir"
    )
    assert loser != second.pid or still_running, "the second run stopped while the first was still training"
    assert "Loading weights" not in err, "it stopped before loading any model"
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["update"] for line in lines] == list(range(1, 9))  # one run's records, whole
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["update-7", "update-8"]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "final")


def run_tree(folder: Path) -> dict[str, bytes]:
    """A run folder's files, less the lock file (which holds the PID of whoever locked it last)."""
    return {k: v for k, v in tree(folder).items() if k != ".ppokit.lock"}


def finished_run(model_dir, prompts_file, tmp_path, **ppo) -> tuple[Path, Path]:
    """A finished ppo run (4 updates, checkpoints 2 and 4, final/) -> (its folder, its config file)."""
    from conftest import tiny_ppo_config

    from ppokit.trainer import PPOTrainer

    out = tmp_path / "run"
    config = tiny_ppo_config(model_dir("llama"), prompts_file, out, total_episodes=32, save_steps=2, **ppo)
    PPOTrainer(config, show_progress=False).train()
    path = tmp_path / "ppo.yaml"
    config.save(path)
    return out, path


def test_a_fresh_run_over_a_run_is_refused_and_overwrite_keeps_the_old_run_until_its_first_checkpoint(
    model_dir, prompts_file, tmp_path, capsys, monkeypatch
):
    from ppokit.config.schema import PPOConfig
    from ppokit.trainer import PPOTrainer

    out, config_path = finished_run(model_dir, prompts_file, tmp_path)
    (out / "checkpoints" / "other-tool").mkdir()
    (out / "checkpoints" / "other-tool" / "model.bin").write_text("another tool's weights\n")
    before = run_tree(out)
    assert main(["ppo", str(config_path)]) == 2
    assert one_error_line(capsys.readouterr().err) == (
        f"ppokit: error: {out} holds a finished run (4 updates, final/): give another output_dir, continue it with --resume "
        "--resume-force after raising ppo.total_episodes (the learning-rate schedule then changes), or pass --overwrite to replace it (the old run stays until "
        "the new one has written its first checkpoint)"
    )
    with pytest.raises(UserError, match="holds a finished run"):
        PPOTrainer(PPOConfig.load(config_path), show_progress=False).train()  # the Python API too
    assert run_tree(out) == before

    # --overwrite, and the new run fails in update 3, before its first checkpoint (save_steps 0): the old run is whole.
    real_step, calls = torch.optim.AdamW.step, []

    def failing_step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("simulated crash")
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", failing_step)
    with pytest.raises(RuntimeError, match="simulated crash"):
        main(["ppo", str(config_path), "ppo.save_steps=0", "ppo.learning_rate=0.002", "--overwrite"])
    monkeypatch.undo()
    assert run_tree(out) == before

    assert main(["ppo", str(config_path), "ppo.save_steps=0", "ppo.learning_rate=0.002", "--overwrite"]) == 0
    assert yaml.safe_load((out / "config.yaml").read_text())["ppo"]["learning_rate"] == 0.002
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["other-tool", "update-4"]
    assert (out / "checkpoints" / "other-tool" / "model.bin").read_text() == "another tool's weights\n"
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4 and (out / "final" / "model.safetensors").exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".ppokit-")], "no staging or replaced folder left"


def test_a_run_into_another_tools_folder_is_refused_and_deletes_only_ppokits_checkpoints(model_dir, prompts_file, tmp_path, capsys):
    out = a_project(tmp_path / "run")
    (out / "checkpoints" / "update-9").mkdir(parents=True)  # named like ppokit's, but not ppokit's
    (out / "checkpoints" / "update-9" / "weights.bin").write_text("theirs\n")
    config_path = ppo_yaml(model_dir, prompts_file, tmp_path / "ppo.yaml", out, total_episodes=32, save_steps=1, save_total_limit=1)
    before = tree(out)
    assert main(["ppo", str(config_path)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"ppokit: error: output_dir: {out} exists and is not a ppokit run folder (no .ppokit marker in it); give another output_dir, or "
                           "pass --overwrite")
    assert tree(out) == before
    assert main(["ppo", str(config_path), "--overwrite"]) == 0
    after = tree(out)
    assert all(after[k] == v for k, v in before.items()), "every file of theirs is still there, unchanged"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["update-4", "update-9"]  # save_total_limit=1 pruned 1-3


KILL_WHILE_SAVING = """
import os, signal, sys
sys.path[:0] = [{src!r}]
import torch
from ppokit.models import roles
real_save, real_policy = torch.save, roles.save_policy
def save(obj, path, *args, **kwargs):
    if ".update-2.tmp-" in str(path) and str(path).endswith("scheduler.pt") and {where!r} == "checkpoint":
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save(obj, path, *args, **kwargs)
def save_policy(policy, folder, *args, **kwargs):
    if ".final.tmp-" in str(folder) and {where!r} == "final":
        os.kill(os.getpid(), signal.SIGKILL)
    return real_policy(policy, folder, *args, **kwargs)
torch.save, roles.save_policy = save, save_policy
from ppokit.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_leftovers_of_a_run_killed_while_saving_are_removed_at_its_next_start(model_dir, prompts_file, tmp_path, capsys):
    out = tmp_path / "run"
    config_path = ppo_yaml(model_dir, prompts_file, tmp_path / "ppo.yaml", out, total_episodes=32, save_steps=1)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    for where, leftover_dir, pattern in (("checkpoint", out / "checkpoints", ".update-2.tmp-"), ("final", out, ".final.tmp-")):
        killed = subprocess.run([sys.executable, "-c", KILL_WHILE_SAVING.format(src=SRC, where=where), "ppo", str(config_path),
                                 *(["--resume"] if where == "final" else [])], env=env, capture_output=True, text=True, timeout=600)
        assert killed.returncode == -9, killed.stderr
        leftovers = [p for p in leftover_dir.iterdir() if p.name.startswith(pattern)]
        assert len(leftovers) == 1 and run_dir.marker_kind(leftovers[0]) in ("checkpoint", "final")
        assert main(["ppo", str(config_path), "--resume"]) == 0
        err = capsys.readouterr().err
        assert f"ppokit: removed {leftovers[0].name}, left by process {leftovers[0].name.rsplit('-', 1)[1]}" in err, err
        assert not leftovers[0].exists()
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".ppokit", ".ppokit.lock"]
    assert (out / "final" / "model.safetensors").exists()


@pytest.mark.slow
def test_an_overwrite_run_killed_before_its_first_checkpoint_leaves_the_earlier_run_whole(model_dir, prompts_file, tmp_path, capsys):
    out, config_path = finished_run(model_dir, prompts_file, tmp_path)
    before = run_tree(out)
    proc = ppokit_process("ppo", config_path, "ppo.save_steps=0", "--overwrite")
    staged = out / ".ppokit-new-run" / "metrics.jsonl"
    deadline = time.monotonic() + 900
    while not (staged.exists() and staged.read_text().count("\n") >= 1):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    assert {k: v for k, v in run_tree(out).items() if not k.startswith(".ppokit-new-run/")} == before  # the old run is untouched
    assert main(["ppo", str(config_path), "--resume"]) == 0  # the next start: the old run, finished, nothing to train
    err = capsys.readouterr().err
    assert f"removed the files of an --overwrite run that stopped before its first checkpoint; the earlier run in {out} is as it was" in err
    assert run_tree(out) == before


def test_a_full_disk_while_writing_a_checkpoint(model_dir, prompts_file, tmp_path):
    out = tmp_path / "run"
    config_path = ppo_yaml(model_dir, prompts_file, tmp_path / "ppo.yaml", out, total_episodes=16, save_steps=1)
    code, _, err = run_ppokit("ppo", config_path, limit_file_size=100 * 1024)  # a checkpoint's weights are bigger
    assert code == 2, err
    line = one_error_line(err)
    assert line.startswith("ppokit: error: no space left on /") and line.endswith(
        f"(File too large) while writing {out / 'checkpoints' / 'update-1'}; no checkpoint of this run was written yet"), line
    assert list((out / "checkpoints").iterdir()) == [], "the half-written checkpoint is removed"


def test_a_run_whose_every_update_was_skipped_fails_and_writes_no_final(model_dir, prompts_file, tmp_path, capsys):
    judge = tmp_path / "judge.py"
    judge.write_text("def unreachable(prompts, completions, **columns):\n    return [float('nan')] * len(completions)\n")
    config_path = ppo_yaml(model_dir, prompts_file, tmp_path / "ppo.yaml", tmp_path / "run", total_episodes=16)
    assert main(["ppo", str(config_path), f"reward.functions=[{judge}:unreachable]", "reward.on_error=skip"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("ppokit: error: every update of the run (2) was skipped, the last for a non-finite score: ")
    assert line.endswith(f"nothing was trained, so final/ is not written. The checkpoint {tmp_path / 'run' / 'checkpoints' / 'update-2'} "
                         "holds the starting weights and the counters; fix the cause (reward, learning rate, data)")
    assert not (tmp_path / "run" / "final").exists()


FLAKY_JUDGE = """import os

calls = []


def judge(prompts, completions, **columns):
    calls.append(1)
    fail_at = os.path.join(os.path.dirname(__file__), "fail-at")
    if os.path.exists(fail_at) and len(calls) == int(open(fail_at).read()):
        raise RuntimeError("the judge is down")
    return [len(c.split()) / 10 for c in completions]
"""


def test_a_reward_error_under_on_error_raise_saves_the_last_complete_update(model_dir, prompts_file, tmp_path, capsys):
    import importlib

    from conftest import tiny_ppo_config

    from ppokit.config.schema import PPOConfig
    from ppokit.trainer import PPOTrainer

    judge = tmp_path / "judge.py"
    judge.write_text(FLAKY_JUDGE)

    def config(out):
        c = tiny_ppo_config(model_dir("llama"), prompts_file, out, total_episodes=32, kl_target=0.5, kl_horizon=100)
        c.reward.functions = [f"{judge}:judge"]
        return c

    PPOTrainer(config(tmp_path / "straight"), show_progress=False).train()
    out = tmp_path / "run"
    config_path = tmp_path / "ppo.yaml"
    config(out).save(config_path)
    (tmp_path / "fail-at").write_text("3")  # the third scoring call of the process: update 3 (save_steps 0: no checkpoint before)
    importlib.invalidate_caches()
    for module in [m for m in sys.modules if m.endswith("judge")]:
        del sys.modules[module]
    assert main(["ppo", str(config_path)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "raised RuntimeError: the judge is down" in line
    assert line.endswith(f". Updates 1-2 are saved in {out / 'checkpoints' / 'update-2'}; fix the cause and continue with --resume")
    (tmp_path / "fail-at").unlink()
    trainer = PPOTrainer(PPOConfig.load(config_path), show_progress=False)
    trainer.resume_from()
    trainer.train()
    wall_clock = ("eps", "time/")

    def numbers(path):
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(wall_clock)} for line in path.read_text().splitlines()]

    assert numbers(out / "metrics.jsonl") == numbers(tmp_path / "straight" / "metrics.jsonl")  # as if it had never stopped


def test_ppo_checks_its_output_dir_before_any_model_loads(model_dir, prompts_file, tmp_path, capsys, monkeypatch):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine\n")
    config_path = ppo_yaml(model_dir, prompts_file, tmp_path / "ppo.yaml", tmp_path / "run", total_episodes=8)
    monkeypatch.chdir(tmp_path)
    import ppokit.trainer

    monkeypatch.setattr(ppokit.trainer.PPOTrainer, "__init__", lambda *a, **k: pytest.fail("a model was loaded"))
    cases = [
        ("output_dir=.", "ppokit: error: output_dir: . is the current directory; ppokit writes each output into a folder of its own: give a new one, e.g. "
                         "runs/NAME"),
        ("output_dir=", "ppokit: error: output_dir: may not be empty (Run directory: config.yaml, metrics.jsonl, samples.jsonl, final/.)"),
        (f"output_dir={a_file}", f"ppokit: error: output_dir: {a_file} is a file, not a folder"),
        ("output_dir=/proc/self/run", "ppokit: error: output_dir: /proc/self/run is in /proc, a kernel file system, not a place for files; give a folder on "
                                      "disk"),
    ]
    for override, expected in cases:
        assert main(["ppo", str(config_path), override, "--overwrite"]) == 2, override
        assert one_error_line(capsys.readouterr().err) == expected
    assert a_file.read_text() == "mine\n" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "ppo.yaml"]


def test_resuming_another_folders_checkpoint_over_a_run_is_refused(tmp_path, capsys):
    ours = fake_run(tmp_path / "ours", "ours")
    theirs = fake_run(tmp_path / "theirs", "theirs", updates=1, num_updates=4, final=False)
    with pytest.raises(UserError, match=re.escape(
        f"--resume {theirs / 'checkpoints' / 'update-1'}: {ours} holds a finished run (2 updates, final/) of its own, "
        "which resuming there would overwrite; give another output_dir"
    )):
        run_dir.check_resume_into(ours, theirs / "checkpoints" / "update-1")
    run_dir.check_resume_into(tmp_path / "new", theirs / "checkpoints" / "update-1")  # a new folder: fine
    run_dir.check_resume_into(theirs, theirs / "checkpoints" / "update-1")  # its own checkpoint: fine
