"""A built-in tool that runs the model's Python code in a separate process: `ppokit.environments:run_python`.

    environment: ppokit.environments:Tools
    environment_args: {tools: ["ppokit.environments:run_python"]}

Each call runs the code as a new `python -I -B` process (no user site, no PYTHON* variables, no bytecode
written) in a fresh temporary folder that is removed afterwards, with no inherited environment variables
(PATH, HOME and TMPDIR set to fixed values), and these limits:

  OS-level (hold for any code, native code too):
    wall clock    the process group is killed after `wall_s` seconds
    memory        RLIMIT_AS: `memory_mb` of address space (a larger allocation raises MemoryError)
    CPU time      RLIMIT_CPU: `wall_s` seconds (SIGXCPU, then SIGKILL)
    output        stdout/stderr go to files limited by RLIMIT_FSIZE (`max_output_bytes`); the answer is cut
    files open    RLIMIT_NOFILE 64
    processes     RLIMIT_NPROC 0: no new process or thread (not for a process running as root, which the
                  kernel exempts: there only the Python-level block below holds)
    network       a new network namespace with only a loopback device, where the OS lets an unprivileged
                  user make one (`unshare --user --map-root-user --net`); checked once, `network_isolated()`
  Python-level (an audit hook, sys.addaudithook: it sees what Python code does, not what native code
  does; ctypes may be imported but not used, so that code cannot reach native functions by that road):
    no process creation (fork, exec, spawn, subprocess, os.system), no signals to other processes,
    no sockets, no ctypes calls, no chdir, and no writing, creating, removing or renaming files outside
    its folder (reading is allowed).

What is not isolated: reading files the trainer's user can read; CPU and memory bandwidth shared with
the trainer; native code in an importable extension module (it is past the audit hook), and, as root,
its processes. It is a guard against a model's accidents and ordinary misbehaviour, not a security
boundary against deliberately hostile code: run untrusted work in a container or VM of its own.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WALL_S = 5.0  # below the Tools environment's default per-call deadline (10 s), startup included
MEMORY_MB = 1024
MAX_OUTPUT_BYTES = 1 << 16
ANSWER_CHARS = 4000  # the most text one call sends back to the model

# Runs inside the child, before the model's code: limits first, then the audit hook (which cannot be removed).
BOOTSTRAP = r'''
import json, os, resource, sys
limits = json.loads(sys.argv[1])
for name, value in limits.items():
    resource.setrlimit(getattr(resource, name), (value, value))
root = os.path.realpath(os.getcwd())
code = open("main.py").read()
REFUSED = ("os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn", "os.system", "os.startfile", "subprocess.Popen",
           "os.kill", "os.killpg", "signal.pthread_kill", "os.chdir", "os.fchdir", "os.chroot",
           "ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.cdata", "ctypes.call_function",
           "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo", "socket.gethostbyname",
           "socket.__new__", "webbrowser.open")
PATH_EVENTS = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1), "os.symlink": (1,), "os.link": (1,),
               "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,), "shutil.rmtree": (0,),
               "shutil.copyfile": (1,), "shutil.move": (0, 1), "os.listxattr": (), "os.setxattr": (0,), "os.removexattr": (0,)}
WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
inside_hook = []

def outside(path):
    if isinstance(path, int):
        return False  # an open file descriptor: it was checked when it was opened
    full = os.path.realpath(os.path.join(root, os.fsdecode(path)))
    return full != root and not full.startswith(root + os.sep)

def hook(event, args):
    if inside_hook:
        return
    inside_hook.append(1)
    try:
        if event in REFUSED:
            raise PermissionError(f"{event} is not allowed here")
        if event == "import" and args[0] == "_posixsubprocess":
            raise PermissionError(f"importing {args[0]} is not allowed here")
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(flags, int) and flags & WRITES) or (isinstance(mode, str) and any(c in mode for c in "wax+"))
            if writes and path is not None and outside(path):
                raise PermissionError(f"writing {os.fsdecode(path)} is not allowed here: only files in the working folder")
        elif event in PATH_EVENTS:
            for i in PATH_EVENTS[event]:
                if i < len(args) and args[i] is not None and outside(args[i]):
                    raise PermissionError(f"{event} on {os.fsdecode(args[i])} is not allowed here: only files in the working folder")
    finally:
        inside_hook.pop()

try:
    import ctypes  # noqa: F401  (its import opens the interpreter's own library, which the hook would refuse)
except ImportError:
    pass
sys.addaudithook(hook)
sys.argv = ["main.py"]
del json, resource, limits
try:
    exec(compile(code, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as e:  # the traceback from the model's code on, without this bootstrap's frame
    import traceback
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    sys.exit(1)
'''


@functools.lru_cache(maxsize=1)
def network_isolated() -> bool:
    """Whether this machine lets a process put itself in a new network namespace (unshare, user namespaces)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    try:
        return subprocess.run([unshare, "--user", "--map-root-user", "--net", "true"], stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def execute_python(code: str, wall_s: float = WALL_S, memory_mb: int = MEMORY_MB, max_output_bytes: int = MAX_OUTPUT_BYTES) -> str:
    """Run `code` under the limits above and return what the model gets back: its stdout (and stderr), or
    'error: ...' when it failed, was stopped or ran out of time. Never raises for anything the code does."""
    folder = Path(tempfile.mkdtemp(prefix="ppokit-python-"))
    try:
        (folder / "main.py").write_text(code)
        limits = {"RLIMIT_AS": memory_mb << 20, "RLIMIT_CPU": max(1, int(wall_s + 0.999)), "RLIMIT_FSIZE": max_output_bytes,
                  "RLIMIT_NOFILE": 64, "RLIMIT_CORE": 0, "RLIMIT_NPROC": 0}
        command = [sys.executable, "-I", "-B", "-c", BOOTSTRAP, json.dumps(limits)]
        if network_isolated():
            command = [shutil.which("unshare"), "--user", "--map-root-user", "--net", "--", *command]
        # Set, not inherited. One thread for numerical libraries: a thread pool would fail under RLIMIT_NPROC.
        environment = {"PATH": "/usr/bin:/bin", "HOME": str(folder), "TMPDIR": str(folder), "LANG": "C.UTF-8",
                       "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with open(folder / "stdout", "wb") as out, open(folder / "stderr", "wb") as err:
            started = time.monotonic()
            process = subprocess.Popen(command, cwd=folder, env=environment, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                       start_new_session=True, close_fds=True)
            try:
                status = process.wait(timeout=wall_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(process)
            status = process.wait()
            elapsed = time.monotonic() - started
        stdout, stderr = (_read(folder / name, max_output_bytes) for name in ("stdout", "stderr"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if timed_out:
        return _cut(f"error: the code did not finish within {wall_s:g}s" + _tail(stdout, "output so far"))
    if status < 0:
        name = signal.Signals(-status).name if -status in signal.Signals._value2member_map_ else str(-status)
        why = {"SIGXCPU": "the CPU time limit", "SIGXFSZ": "the output limit", "SIGKILL": "a limit (memory or CPU time)"}.get(name, "a signal")
        return _cut(f"error: the code was stopped by {name} ({why}) after {elapsed:.1f}s" + _tail(stderr, "stderr"))
    if status != 0:
        return _cut(f"error: exit status {status}" + _tail(stderr, "stderr"))
    text = stdout + (f"\n[stderr]\n{stderr}" if stderr.strip() else "")
    return _cut(text if text.strip() else "(no output)")


def run_python(code: str) -> str:
    """Run Python code in a fresh process and return what it printed.

    Args:
        code: a complete Python program; print what you want to see
    """
    return execute_python(code)


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)  # its own session: everything it started, too
    except (ProcessLookupError, PermissionError):
        pass


def _read(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _tail(text: str, what: str) -> str:
    text = text.strip()
    return f"\n[{what}]\n{text[-ANSWER_CHARS // 2:]}" if text else ""


def _cut(text: str) -> str:
    return text if len(text) <= ANSWER_CHARS else text[:ANSWER_CHARS] + "\n[cut]"
