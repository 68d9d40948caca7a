"""Output folders: what ppokit writes, what it will replace or delete, and what it leaves alone.

ppokit knows its own folders by a marker file, `.ppokit`, that it writes into every folder it
creates — an sft or rm output, a ppo run folder, each `checkpoints/update-N/`, `final/` — before
anything else goes in. The rules built on it:

- A folder is replaced or deleted only when it carries the marker (or is empty). Replacing
  anything else needs `--overwrite` (`overwrite=True`); the current directory, an ancestor of
  it and the home directory are never accepted as an output folder.
- Folders are written under a temporary name (`.NAME.tmp-PID`, marked) and renamed into place
  when complete (`atomic_save_dir`); a write that fails removes its temporary folder, one cut
  short by SIGKILL is removed (or, if only the final rename was missing, finished) by
  `remove_leftovers` at the next start.
- A ppo run holds an exclusive lock (`fcntl.flock` on `output_dir/.ppokit.lock`) for its whole
  run (`RunLock`); the kernel drops it when the process ends, however it ends.
- `output_dir` is checked before any model loads (`check_output_dir`): not empty, not a file, not
  in /proc or /sys, writable.

Only the standard library is used here: every other module may import this one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import resource
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Optional

from ppokit.errors import UserError
from ppokit.version import __version__

MARKER = ".ppokit"
LOCK_FILE = ".ppokit.lock"
KERNEL_FILE_SYSTEMS = ("/proc", "/sys")
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)$")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


# --------------------------------------------------------------------------- markers


def write_marker(folder: Path, kind: str) -> None:
    """Mark `folder` as written by ppokit; `kind` says what it is (sft, rm, ppo-run, checkpoint, final)."""
    (Path(folder) / MARKER).write_text(json.dumps({"written_by": "ppokit", "kind": kind, "version": __version__}) + "\n")


def marker_kind(folder: Path) -> Optional[str]:
    """The kind recorded in `folder`'s marker, or None when the folder carries no readable marker."""
    try:
        marker = json.loads((Path(folder) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker.get("kind") if isinstance(marker, dict) and marker.get("written_by") == "ppokit" else None


def is_marked(folder: Path) -> bool:
    return marker_kind(folder) is not None


def is_empty_dir(path: Path) -> bool:
    """Nothing in it (but a run's lock file, `RunLock`: the lock of a stage that wrote nothing)."""
    return path.is_dir() and not any(p.name != LOCK_FILE for p in path.iterdir())


# --------------------------------------------------------------------------- checks before anything loads


def check_output_dir(value: str, key: str = "output_dir") -> Path:
    """A usable output folder or a UserError saying why not; called before any model loads."""
    if not str(value).strip():
        raise UserError(f"{key}: may not be empty")
    path = Path(value).expanduser()
    resolved = path.resolve()
    cwd = Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        where = "the current directory" if resolved == cwd else f"a folder above the current directory ({cwd})"
        raise UserError(f"{key}: {value} is {where}; ppokit writes each output into a folder of its own: give a new one, e.g. runs/NAME")
    if resolved == Path.home().resolve():
        raise UserError(f"{key}: {value} is your home directory; give a folder of its own, e.g. {path / 'runs' / 'NAME'}")
    for root in KERNEL_FILE_SYSTEMS:
        if resolved == Path(root) or Path(root) in resolved.parents:
            raise UserError(f"{key}: {value} is in {root}, a kernel file system, not a place for files; give a folder on disk")
    if path.exists() and not path.is_dir():
        raise UserError(f"{key}: {value} is a file, not a folder")
    existing = resolved
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{key}: {value} cannot be made: {existing} is a file")
    try:  # the one reliable test (permissions, read-only mounts, root's privileges): try it
        os.rmdir(tempfile.mkdtemp(prefix=".ppokit-write-test-", dir=existing))
    except OSError as e:
        raise UserError(f"{key}: {value} cannot be written: {existing} is not writable ({e.strerror})") from None
    return path


def check_replaceable(path: str | Path, overwrite: bool, key: str = "output_dir") -> None:
    """A stage output (sft, rm) may replace what is at `path` only if it is absent, empty or a ppokit
    output; anything else needs `overwrite`."""
    path = Path(path)
    if not path.exists() or overwrite or is_empty_dir(path) or is_marked(path):
        return
    raise UserError(
        f"{key}: {path} exists and was not written by ppokit (no {MARKER} marker in it); it would be replaced. "
        "Give another output_dir, or pass --overwrite to replace it"
    )


# --------------------------------------------------------------------------- writing folders atomically


class NoSpaceError(UserError):
    """The file system ran out of space (or a quota or the file size limit was hit) while ppokit wrote `target`."""

    def __init__(self, target: Path, code: int):
        self.target, self.errno = Path(target), code
        super().__init__(f"no space left on {mount_point(target)} ({os.strerror(code)}) while writing {target}")


def _space_problem(error: BaseException, tmp: Path) -> Optional[int]:
    """ENOSPC, EDQUOT or EFBIG when that is why writing into `tmp` failed, else None.

    Not every writer says so: safetensors puts the OS error in its message, and torch.save raises
    a RuntimeError without any ("file write failed"); so the file system is asked too.
    """
    if isinstance(error, NoSpaceError):  # from a folder written inside this one: named as this one
        return error.errno
    if isinstance(error, OSError) and error.errno in _NO_SPACE:
        return error.errno
    said = re.search(r"os error (\d+)", str(error))
    if said and int(said.group(1)) in _NO_SPACE:
        return int(said.group(1))
    if isinstance(error, (KeyboardInterrupt, SystemExit)):
        return None
    try:
        fs = os.statvfs(tmp)
        if fs.f_bavail * fs.f_frsize < 1 << 20:
            return errno.ENOSPC
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and any(f.stat().st_size >= limit for f in tmp.rglob("*") if f.is_file()):
            return errno.EFBIG
    except OSError:
        pass
    return None


def full_disk(error: BaseException, path: Path, last_checkpoint: Optional[Path]) -> Optional[UserError]:
    """One line for a full disk while a run writes `path`, naming the checkpoint to resume from; None
    when `error` is about something else."""
    if not isinstance(error, NoSpaceError):
        if not (isinstance(error, OSError) and error.errno in _NO_SPACE):
            return None
        error = NoSpaceError(path, error.errno)
    last = f"the last complete checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint of this run was written yet"
    return UserError(f"{error}; {last}")


def mount_point(path: Path) -> Path:
    path = Path(path).resolve()
    while not path.exists() or (not os.path.ismount(path) and path != path.parent):
        path = path.parent
    return path


def atomic_save_dir(target: Path, write: Callable[[Path], None], kind: str, replace_unmarked: bool = False) -> None:
    """Write the folder `target` under a temporary name (marked as `kind`) and rename it into place
    when `write(tmp)` is done; an existing `target` is replaced only when it is ppokit's (or
    `replace_unmarked`). A failed write removes the temporary folder: nothing half-written stays,
    and the previous `target` is as it was. Running out of space raises NoSpaceError."""
    tmp = temporary_dir(target, kind, replace_unmarked)
    try:
        write(tmp)
    except BaseException as e:
        full = discard_dir(tmp, target, e)
        if full is not None:
            raise full from None
        raise
    finish_dir(tmp, target)


def temporary_dir(target: Path, kind: str, replace_unmarked: bool = False) -> Path:
    """A fresh folder `.NAME.tmp-PID` beside `target`, marked as `kind`, to write `target` in. Refused
    up front when `target` exists and may not be replaced (not ppokit's, not empty, no `replace_unmarked`)."""
    target = Path(target)
    if target.exists() and not replace_unmarked and not is_marked(target) and not is_empty_dir(target):
        raise UserError(f"{target} exists and was not written by ppokit (no {MARKER} marker in it); ppokit will not replace it")
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    write_marker(tmp, kind)
    return tmp


def finish_dir(tmp: Path, target: Path) -> None:
    """Rename the complete folder `tmp` to `target`, the one it replaces moved aside first and deleted last."""
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old)
    else:
        tmp.rename(target)


def discard_dir(tmp: Path, target: Path, error: BaseException) -> Optional[NoSpaceError]:
    """After writing `tmp` failed with `error`: remove it; -> a NoSpaceError naming `target` when the disk was full."""
    code = _space_problem(error, tmp) if tmp.exists() else None
    shutil.rmtree(tmp, ignore_errors=True)
    return NoSpaceError(target, code) if code is not None else None


def remove_leftovers(folder: Path, name: Optional[str] = None) -> list[str]:
    """Finish or clear what an `atomic_save_dir` cut short (SIGKILL, power loss) left in `folder`
    (only entries for `name` when given); returns what was done, for a message.

    Only folders of processes no longer running are touched, and of those only the marked ones and the
    empty ones (nothing in them but at most a marker cut short: the process was killed between the
    folder's mkdir and its marker; nothing is lost with them). `.NAME.old-PID` beside `.NAME.tmp-PID`
    and no NAME means only the final rename was missing: it is done now.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    done = []
    for entry in sorted(folder.iterdir()):
        m = _LEFTOVER.match(entry.name)
        if not m or (name is not None and m["name"] != name) or not entry.is_dir() or not (is_marked(entry) or _unfilled(entry)):
            continue
        pid = int(m["pid"])
        if pid == os.getpid() or _running(pid) or not entry.exists():
            continue
        target = folder / m["name"]
        twin = folder / f".{m['name']}.{'old' if m['kind'] == 'tmp' else 'tmp'}-{pid}"
        if m["kind"] == "tmp" and twin.exists() and not target.exists():
            entry.rename(target)  # complete: the old one had been moved aside for it
            done.append(f"finished writing {target}")
            continue
        if m["kind"] == "old" and twin.exists() and not target.exists():
            twin.rename(target)
            done.append(f"finished writing {target}")
        shutil.rmtree(entry, ignore_errors=True)
        done.append(f"removed {entry.name}, left by process {pid}")
    return done


def _unfilled(folder: Path) -> bool:
    """Nothing in `folder` but at most its marker file (a marker being written when the process was killed)."""
    return all(p.name == MARKER for p in folder.iterdir())


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --------------------------------------------------------------------------- the run lock


class RunLock:
    """An exclusive lock on a run folder, held until `release()` or the end of the process.

    `fcntl.flock` on `folder/.ppokit.lock`, which holds the PID of the owner for the message a
    second run gets. flock locks belong to the open file, so the kernel releases them when the
    process dies, by SIGKILL too; no stale lock is ever left to clean up. Within one process the
    lock is shared: acquiring a folder this process already holds returns the same lock (counted).
    """

    _held: dict[Path, "RunLock"] = {}

    def __init__(self, folder: Path, fd: int):
        self.folder, self.fd, self.count = folder, fd, 1

    @classmethod
    def acquire(cls, folder: str | Path) -> "RunLock":
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        key = folder.resolve()
        held = cls._held.get(key)
        if held is not None:
            held.count += 1
            return held
        fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UserError(
                f"{folder} is in use by another ppokit run (PID {owner}); wait for it to end, or give another output_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        lock = cls._held[key] = cls(key, fd)
        return lock

    def remove_file(self) -> None:
        """Delete the lock file while holding it, if the folder still has this one (not a newer folder renamed over it)."""
        file = self.folder / LOCK_FILE
        try:
            on_disk, held = os.stat(file), os.fstat(self.fd)
        except FileNotFoundError:
            return
        if (on_disk.st_dev, on_disk.st_ino) == (held.st_dev, held.st_ino):
            file.unlink()

    def release(self) -> None:
        self.count -= 1
        if self.count == 0 and self._held.get(self.folder) is self:
            del self._held[self.folder]
            os.close(self.fd)  # closing the file drops the flock


@contextlib.contextmanager
def locked_output(output_dir: str | Path) -> Iterator[None]:
    """A stage's (sft, rm) output_dir locked for as long as the stage runs, by the lock of a ppo run's
    folder (`RunLock`): a second run into it is refused while the first one lives. The lock file is in
    the folder (made for it if absent); the finished output is renamed into place over the folder, the
    file with it. A folder made for the lock alone is removed again when the stage writes nothing."""
    path = Path(output_dir)
    made = not path.exists()
    lock = RunLock.acquire(path)
    try:
        yield
    finally:
        if lock.count == 1:  # a failed stage leaves the folder as it found it: no lock file, no folder it made
            lock.remove_file()
            if made and is_empty_dir(path):
                path.rmdir()
        lock.release()


# --------------------------------------------------------------------------- ppo run folders

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
RUN_FILES = ("config.yaml", "metrics.jsonl", "samples.jsonl", "final")  # what a ppo run writes at the top of its folder
NEW_RUN = ".ppokit-new-run"  # an --overwrite run's files until its first checkpoint
REPLACED_RUN = ".ppokit-replaced-run"  # the earlier run's files while they are being swapped out
CHECKPOINT_NAME = re.compile(r"^update-(\d+)$")


def read_state(path: Path) -> Optional[dict]:
    """trainer_state.json of a complete checkpoint, else None."""
    return _state_or_problem(path)[0]


def _state_or_problem(path: Path) -> tuple[Optional[dict], str]:
    """(trainer_state.json of a complete checkpoint, "") or (None, why it is not one)."""
    file = Path(path) / STATE_FILE
    try:
        state = json.loads(file.read_text())
    except FileNotFoundError:
        return None, f"no {STATE_FILE}"
    except OSError as e:
        return None, f"{STATE_FILE} cannot be read ({e.strerror or e})"
    except ValueError:
        return None, f"{STATE_FILE} is not valid JSON (cut short?)"
    if not isinstance(state, dict) or state.get("complete") is not True:
        return None, f"{STATE_FILE} is not marked complete"
    return state, ""


def list_checkpoints(folder: str | Path) -> list[Path]:
    """Complete checkpoints in `folder` (a checkpoints/ folder), oldest first."""
    return [p for p, problem in _checkpoint_folders(folder) if not problem]


def skipped_checkpoints(folder: str | Path) -> list[tuple[Path, str]]:
    """(folder, why) for each checkpoint folder in `folder` newer than its latest complete checkpoint:
    what a resume from the latest passes over. Checkpoints are written whole and then renamed, so
    one of these was damaged afterwards (a trainer_state.json cut short, say)."""
    found = _checkpoint_folders(folder)
    complete = [i for i, (_, problem) in enumerate(found) if not problem]
    return [(p, problem) for p, problem in found[complete[-1] + 1 if complete else 0:]]


def _checkpoint_folders(folder: str | Path) -> list[tuple[Path, str]]:
    """(checkpoint folder, "" if complete else why not) for every update-N folder in `folder`, oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := CHECKPOINT_NAME.match(p.name)) and p.is_dir())
    return [(p, _state_or_problem(p)[1]) for _, p in found]


def owned_checkpoint(path: Path) -> bool:
    """A checkpoint folder ppokit may move or delete: marked, or holding a complete trainer_state.json
    (checkpoints written before markers existed)."""
    return path.is_dir() and bool(CHECKPOINT_NAME.match(path.name)) and (is_marked(path) or read_state(path) is not None)


def _run_entries(folder: Path) -> list[str]:
    """What of a run `folder` is ppokit's to move: RUN_FILES at the top, owned checkpoints (superseded ones too)."""
    entries = [name for name in RUN_FILES if (folder / name).exists()]
    for sub in (CHECKPOINTS, f"{CHECKPOINTS}/superseded"):
        if (folder / sub).is_dir():
            entries += [f"{sub}/{p.name}" for p in sorted((folder / sub).iterdir()) if owned_checkpoint(p)]
    return entries


def holds_run(folder: Path) -> Optional[str]:
    """A description of the run in `folder` when it holds one to lose (a checkpoint or final/), else None."""
    found = list_checkpoints(Path(folder) / CHECKPOINTS)
    state = read_state(found[-1]) if found else None
    update, total = (state.get("update"), state.get("num_updates")) if state is not None else (None, None)
    if isinstance(update, int) and isinstance(total, int) and update < total:
        return f"an unfinished run (checkpoint {found[-1].name} of {total} updates)"
    if state is not None or (Path(folder) / "final").is_dir():
        updates = f"{update} updates, " if isinstance(update, int) else ""
        return f"a finished run ({updates}final/)"
    return None


def check_run_folder(output_dir: str, overwrite: bool) -> Path:
    """`output_dir` is usable (`check_output_dir`) and a place for a ppo run: absent, empty, a ppokit run
    folder, or anything with `overwrite`."""
    path = check_output_dir(output_dir)
    if overwrite or not path.exists() or not [p for p in path.iterdir() if p.name not in (MARKER, LOCK_FILE)]:
        return path
    kind = marker_kind(path)
    if kind != "ppo-run" and not list_checkpoints(path / CHECKPOINTS):
        what = f"a ppokit {kind} output" if kind else f"not a ppokit run folder (no {MARKER} marker in it)"
        raise UserError(
            f"output_dir: {path} exists and is {what}; give another output_dir, or pass --overwrite to write the run "
            f"there (ppokit then replaces {', '.join(RUN_FILES)} and checkpoints/update-N there and leaves every other file alone)"
        )
    return path


def check_run_start(output_dir: str, resume: bool, overwrite: bool) -> Path:
    """Before any model loads: may a ppo run start in `output_dir`? A UserError says what to do when it
    may not: a folder that is not a ppokit run (`check_run_folder`), or a run that a fresh start would replace."""
    if resume and overwrite:
        raise UserError("--resume continues the run in output_dir and --overwrite replaces it: give one of them")
    path = check_run_folder(output_dir, overwrite)
    held = None if resume or overwrite or not path.is_dir() else holds_run(path)
    if held is not None:
        resume_hint = ("continue it with --resume" if held.startswith("an unfinished") else
                       "continue it with --resume --resume-force after raising ppo.total_episodes (the learning-rate schedule then changes)")
        raise UserError(
            f"{path} holds {held}: give another output_dir, {resume_hint}, or pass --overwrite to replace it "
            "(the old run stays until the new one has written its first checkpoint)"
        )
    return path


def check_resume_into(output_dir: str | Path, checkpoint: Path) -> None:
    """Resuming rewrites output_dir's metrics.jsonl and samples.jsonl to the checkpoint's: a checkpoint
    of another folder may be resumed into output_dir only when no run of its own is there to lose."""
    root = Path(output_dir).resolve()
    if root in Path(checkpoint).resolve().parents or not root.is_dir():
        return
    held = holds_run(root)
    if held is not None:
        raise UserError(f"--resume {checkpoint}: {output_dir} holds {held} of its own, which resuming there would overwrite; "
                        "give another output_dir")


class RunFolder:
    """A ppo run's output_dir while the run uses it.

    `open` (every process; the main process does the work): the lock for the whole run, the marker,
    and the leftovers of a run that was killed. `start` says where the run writes (`files`): the
    folder itself, or — for a fresh run replacing an earlier one (`overwrite`) — `.ppokit-new-run/`
    inside it, so that the earlier run stays whole until the new one has a checkpoint; `commit`
    (after every checkpoint and final save) then swaps the new run in, once. `close` releases the lock
    and removes a new run's files that never reached a checkpoint; a run refused before it wrote
    anything (a config, data, plan or launch error found after `open`) leaves the folder as it found
    it: the marker, lock file and folder that `open` made are removed again.
    """

    def __init__(self, root: Path, main_process: bool, lock: Optional[RunLock]):
        self.root, self.main_process, self.lock = root, main_process, lock
        self.files = root
        self.notes: list[str] = []  # what was cleaned up at open, for the run's first lines
        self.made: list[Path] = []  # what open created (the folder, its lock file, its marker): removed if the run writes nothing

    @classmethod
    def open(cls, output_dir: str | Path, main_process: bool = True, overwrite: bool = False) -> "RunFolder":
        root = Path(output_dir).absolute()  # user code may change the working directory while the run holds the folder
        if not main_process:
            return cls(root, False, None)
        check_run_folder(str(output_dir), overwrite)  # before anything is written in it (as given: `.` is refused)
        made = [path for path in (root, root / LOCK_FILE, root / MARKER) if not path.exists()]
        lock = RunLock.acquire(root)
        run = cls(root, True, lock)
        if lock.count == 1:  # not a second open of a folder this process holds: that one's opener undoes
            run.made = made
        try:
            if marker_kind(root) != "ppo-run":
                write_marker(root, "ppo-run")
            run.notes += run._repair()
        except BaseException:
            run.close()
            raise
        return run

    @property
    def staged(self) -> bool:
        return self.files != self.root

    def start(self, fresh: bool, overwrite: bool, barrier: Callable[[], None] = lambda: None) -> Path:
        """-> where the run writes. A fresh run over a run that holds something (`holds_run`) needs
        `overwrite` and is staged; otherwise the run writes in the folder itself. The main process
        decides; `barrier` (every process calls start) lets the others see where."""
        if self.main_process and fresh and holds_run(self.root) is not None:
            if not overwrite:
                check_run_start(str(self.root), resume=False, overwrite=False)  # raises, naming the run
            staging = self.root / NEW_RUN
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir()
            write_marker(staging, "new-run")
            self.files = staging
        barrier()
        if not self.main_process:
            self.files = self.root / NEW_RUN if (self.root / NEW_RUN).is_dir() else self.root
        return self.files

    def commit(self, path: Optional[Path] = None) -> Path:
        """After a checkpoint or the final save: a staged run replaces the earlier one now.
        -> the folder the run writes in from now on, or where `path` (written in the old one) is now."""
        written_in = self.files
        if self.staged and self.main_process:
            self._swap()
        self.files = self.root
        return self.root if path is None else self.root / Path(path).relative_to(written_in)

    def close(self) -> None:
        if self.main_process and self.staged and (self.root / NEW_RUN).exists():
            shutil.rmtree(self.root / NEW_RUN, ignore_errors=True)  # no checkpoint: the earlier run stays as it was
            self.files = self.root
        if self.lock is not None:
            if self.lock.count == 1:
                self._remove_if_unused()
            self.lock.release()
            self.lock = None

    def _remove_if_unused(self) -> None:
        """Undo `open` when the run wrote nothing: the folder holds only what open made (marker, lock file)."""
        if not self.made or not self.root.is_dir() or any(p.name not in (MARKER, LOCK_FILE) for p in self.root.iterdir()):
            return
        for path in reversed(self.made):  # marker, lock file (removed while held), folder
            if path == self.root / LOCK_FILE:
                self.lock.remove_file()
            elif path == self.root:
                with contextlib.suppress(OSError):  # another run made something in it meanwhile: it stays
                    path.rmdir()
            else:
                path.unlink(missing_ok=True)

    # The swap, resumable: phase "aside" moves the earlier run's entries into REPLACED_RUN, phase "in"
    # moves the new run's entries up; a run killed half way is completed by the next open (`_repair`).
    def _swap(self, phase: str = "aside") -> None:
        staging, replaced = self.root / NEW_RUN, self.root / REPLACED_RUN
        if phase == "aside":
            replaced.mkdir(exist_ok=True)
            write_marker(replaced, "replaced-run:aside")
            for entry in _run_entries(self.root):
                move_into_place(self.root / entry, replaced / entry)
            write_marker(replaced, "replaced-run:in")
        for entry in _run_entries(staging):
            move_into_place(staging / entry, self.root / entry)
        shutil.rmtree(replaced, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)

    def _repair(self) -> list[str]:
        """Leftovers of a run in this folder that was killed (the lock says none is running now)."""
        done = []
        staging, replaced = self.root / NEW_RUN, self.root / REPLACED_RUN
        phase = marker_kind(replaced)
        if phase in ("replaced-run:aside", "replaced-run:in") and staging.is_dir():
            self._swap(phase.split(":")[1])
            done.append(f"finished replacing the earlier run in {self.root} (a run started with --overwrite was stopped while doing it)")
        elif is_marked(staging):
            if list_checkpoints(staging / CHECKPOINTS):
                self._swap()
                done.append(f"finished replacing the earlier run in {self.root} with the new run's first checkpoint")
            else:
                shutil.rmtree(staging)
                done.append(f"removed the files of an --overwrite run that stopped before its first checkpoint; the earlier run in {self.root} is as it was")
        elif is_marked(replaced):
            shutil.rmtree(replaced)
        done += remove_leftovers(self.root, "final")
        done += remove_leftovers(self.root / CHECKPOINTS)
        return done


def move_into_place(source: Path, target: Path) -> None:
    """Rename `source` to `target`. Something already at `target` is deleted when it is ppokit's (a
    marked folder or an owned checkpoint), and otherwise renamed aside to NAME.not-ppokit, never deleted."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_dir() and (is_marked(target) or owned_checkpoint(target)):
        shutil.rmtree(target)
    elif target.exists():
        aside, n = target.with_name(f"{target.name}.not-ppokit"), 1
        while aside.exists():
            aside, n = target.with_name(f"{target.name}.not-ppokit-{n}"), n + 1
        target.rename(aside)
    source.rename(target)
