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

import errno
import fcntl
import json
import os
import re
import resource
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

from ppokit.errors import UserError

MARKER = ".ppokit"
LOCK_FILE = ".ppokit.lock"
KERNEL_FILE_SYSTEMS = ("/proc", "/sys")
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)$")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


# --------------------------------------------------------------------------- markers


def write_marker(folder: Path, kind: str) -> None:
    """Mark `folder` as written by ppokit; `kind` says what it is (sft, rm, ppo-run, checkpoint, final)."""
    from ppokit import __version__

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
    return path.is_dir() and not any(path.iterdir())


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
    target = Path(target)
    if target.exists() and not replace_unmarked and not is_marked(target) and not is_empty_dir(target):
        raise UserError(f"{target} exists and was not written by ppokit (no {MARKER} marker in it); ppokit will not replace it")
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir(parents=True)
        write_marker(tmp, kind)
        write(tmp)
    except BaseException as e:
        code = _space_problem(e, tmp) if tmp.exists() else None
        shutil.rmtree(tmp, ignore_errors=True)
        if code is not None:
            raise NoSpaceError(target, code) from None
        raise
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old)
    else:
        tmp.rename(target)


def remove_leftovers(folder: Path, name: Optional[str] = None) -> list[str]:
    """Finish or clear what an `atomic_save_dir` cut short (SIGKILL, power loss) left in `folder`
    (only entries for `name` when given); returns what was done, for a message.

    Only marked folders of processes no longer running are touched. `.NAME.old-PID` beside
    `.NAME.tmp-PID` and no NAME means only the final rename was missing: it is done now.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    done = []
    for entry in sorted(folder.iterdir()):
        m = _LEFTOVER.match(entry.name)
        if not m or (name is not None and m["name"] != name) or not entry.is_dir() or not is_marked(entry):
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

    def release(self) -> None:
        self.count -= 1
        if self.count == 0 and self._held.get(self.folder) is self:
            del self._held[self.folder]
            os.close(self.fd)  # closing the file drops the flock
