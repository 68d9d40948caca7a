"""The process between the trainer and a server it starts (`launched_server.LaunchedServer`): the server ends with the
trainer, however the trainer ends.

    python -I server_guard.py TRAINER_PID FOLDER -- COMMAND...

Started in a session of its own (so a Ctrl-C or a signal to the trainer's group does not reach the server first), it
runs COMMAND in its own process group (the server, and what the server starts: vLLM's engine core and its workers) and
watches two things until one happens:

- the server exits: the rest of the group is stopped (a server that died leaves no engine behind), and this process
  exits with the server's code (the trainer reads it; FOLDER stays for the server's output);
- the trainer is gone (this process was handed to init or a subreaper: SIGKILL, a crash, an exit without `stop`): the
  whole group is stopped and FOLDER removed.

The trainer is watched by its process id rather than by a parent-death signal (PR_SET_PDEATHSIG), which fires when the
*thread* that started the child ends: servers are started from worker threads too. This file imports only the
standard library and runs as a script (`-I`: nothing from the trainer's environment or its folder is imported).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

POLL_S = 0.2
GRACE_S = 10.0  # after SIGTERM, before SIGKILL: vLLM frees its shared-memory queues when it is let to end


def process_start(pid: int) -> Optional[tuple[str, int]]:
    """(name, start time in clock ticks) of a live process, None for one that is gone or a zombie (Linux: /proc)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 1:].split()
    # after the command's closing parenthesis: state, ppid, pgrp, ... (the start time is the 20th)
    return None if rest[0] in ("Z", "X") else (name, int(rest[19]))


def group_processes(pgid: int) -> dict[int, tuple[str, int]]:
    """The live processes of group `pgid`: pid -> (name, start time). Zombies are not counted (an exited worker whose
    new parent has not reaped it yet holds nothing). Linux only (/proc); elsewhere empty."""
    found = {}
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        return found
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
                started = process_start(int(entry.name))
                if started is not None:
                    found[int(entry.name)] = started
    return found


def live_in_group(pgid: int, but: int = -1) -> bool:
    """Whether a process of group `pgid` other than `but` still runs (Linux: /proc; elsewhere: whether the group can be
    signalled)."""
    if not Path("/proc/self/stat").exists():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    return any(pid != but for pid in group_processes(pgid))


def stop_group(pgid: int, grace_s: float, but: int = -1) -> None:
    """SIGTERM to group `pgid`, SIGKILL to each of its processes (but `but`, the caller when it is in the group) left
    after `grace_s`; returns once none is left (a process that cannot be killed is not waited for beyond 10 s more)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while live_in_group(pgid, but) and time.monotonic() < deadline:
        time.sleep(0.1)
    deadline = time.monotonic() + 10.0
    while live_in_group(pgid, but) and time.monotonic() < deadline:
        for pid in group_processes(pgid):
            if pid != but:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def guard(trainer: int, folder: Path, command: list[str]) -> int:
    """The module's docstring: -> the server's exit code, or 0 once the trainer is gone and the server stopped."""
    me = os.getpid()
    server = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    # The trainer's `stop` signals the whole group: this process waits for the server to end instead of ending first.
    signal.signal(signal.SIGTERM, lambda *_: None)
    while True:
        code = server.poll()
        if code is not None:
            stop_group(me, GRACE_S, but=me)
            if code < 0:  # ended by a signal: this process ends by it too, so that the trainer reads the same
                with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP have no handler to reset
                    signal.signal(-code, signal.SIG_DFL)
                os.kill(me, -code)
            return code
        if os.getppid() != trainer:
            stop_group(me, GRACE_S, but=me)
            server.wait()
            shutil.rmtree(folder, ignore_errors=True)
            return 0
        time.sleep(POLL_S)


if __name__ == "__main__":
    separator = sys.argv.index("--")
    sys.exit(guard(int(sys.argv[1]), Path(sys.argv[2]), sys.argv[separator + 1:]))
