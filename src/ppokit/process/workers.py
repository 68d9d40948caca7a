"""Threads that run user code beside the caller: the caller's torch modes carried over, and threads kept between calls.

Starting a thread costs about as much as a small tool call (measured: a rollout of 64 episodes with instant tools
spent more time starting threads than decoding), so the episode loop's environment calls go to `WorkerThreads`,
which keeps idle threads for the next call. A call never queues behind another: with no idle thread a new one
starts, so N slow calls cost one deadline, not N. A call that outlives its deadline keeps its thread (Python cannot
stop one); the caller stops waiting for it and the pool starts others as needed.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

import torch


def in_callers_modes(fn: Callable[[], Any]) -> Callable[[], Any]:
    """fn, to be run in another thread under the calling thread's autograd and inference mode and CUDA device (all
    three are per-thread in PyTorch, and a new thread would start with grad on and device 0)."""
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def run():
        if device is not None:
            torch.cuda.set_device(device)
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return fn()

    return run


class WorkerThreads:
    """Daemon threads that run jobs, each job at once: an idle thread takes it, or a new thread starts when none is
    idle. A thread idle for `idle_s` seconds ends. A job must not raise (wrap what it runs); it runs in the modes of
    the thread that handed it over (`in_callers_modes`)."""

    def __init__(self, name: str, idle_s: float = 30.0):
        self.name, self.idle_s = name, idle_s
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0  # threads waiting for a job that no `run` has counted on yet
        self._lock = threading.Lock()

    def run(self, job: Callable[[], None]) -> None:
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1  # that thread is this job's
        self._jobs.put(in_callers_modes(job))
        if start:
            threading.Thread(target=self._work, name=self.name, daemon=True).start()

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:  # no job counts on this thread: it ends
                        self._idle -= 1
                        return
                continue  # a `run` counted on it just now: its job is on the way
            job()
            with self._lock:
                self._idle += 1
