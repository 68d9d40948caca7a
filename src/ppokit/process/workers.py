"""Threads and deadlines for user code: a call under a deadline, threads kept between calls, an event loop per caller.

`ThreadCall` runs one call (a reward function, an environment's step, a tool) in a daemon thread that the caller
stops waiting for at its deadline (`DeadlineExceeded`); `code_raised` tells the code's own failure from a stop request
that reached it. Every thread carries the caller's torch modes over (`in_callers_modes`).

Starting a thread costs about as much as a small tool call (measured: a rollout of 64 episodes with instant tools
spent more time starting threads than decoding), so the episode loop's environment calls go to `WorkerThreads`,
which keeps idle threads for the next call. A call never queues behind another: with no idle thread a new one
starts, so N slow calls cost one deadline, not N. A call that outlives its deadline keeps its thread (Python cannot
stop one); the caller stops waiting for it and the pool starts others as needed.

`run_coroutine` runs a coroutine (the episode loop's rollout) to its end on an event loop of its own, so that a
synchronous caller never sees asyncio.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import signal
import threading
import time
from typing import Any, Awaitable, Callable, Optional, TypeVar

import torch

from ppokit.errors import TrainingInterrupted

T = TypeVar("T")


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


def run_coroutine(make: Callable[[], Awaitable[T]]) -> T:
    """make()'s coroutine run to its end on an event loop of its own in this thread -> its value (or its exception).
    Tasks that a stop (an error, Ctrl-C) leaves behind are cancelled and unwound before it returns. Called from a
    thread that runs an event loop already (an async caller), the loop runs in a thread of its own, in the caller's
    torch modes, and this call blocks as any synchronous call would."""
    if asyncio._get_running_loop() is None:
        return _run_here(make)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ppokit-loop") as pool:
        return pool.submit(in_callers_modes(lambda: _run_here(make))).result()


def _run_here(make: Callable[[], Awaitable[T]]) -> T:
    loop = asyncio.new_event_loop()
    main = asyncio.ensure_future(make(), loop=loop)  # a coroutine, or any awaitable (a reward function's)
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            _unwind(loop, main)
        finally:
            loop.close()


def _unwind(loop: asyncio.AbstractEventLoop, main: asyncio.Task) -> None:
    """Cancel the tasks a stop left and run them to their end. asyncio lets a KeyboardInterrupt or SystemExit out of
    the loop from the task it reaches, so one that a task raises again on its way out ends a round, not the unwinding;
    what the tasks ended with is read (asyncio would report each as never retrieved)."""
    seen = {main}
    while True:
        left = asyncio.all_tasks(loop)
        if not left:
            break
        seen |= left
        for task in left:
            task.cancel()
        with contextlib.suppress(KeyboardInterrupt, SystemExit):
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
    for task in seen:
        if task.done() and not task.cancelled():
            task.exception()


def outside_event_loop(fn: Callable[[], T]) -> T:
    """fn() called from a coroutine as if no event loop ran in this thread: user code that starts one of its own
    (`asyncio.run`) works there as it does in a plain thread. (The loop is paused meanwhile: fn blocks it.)"""
    loop = asyncio._get_running_loop()
    asyncio._set_running_loop(None)
    try:
        return fn()
    finally:
        asyncio._set_running_loop(loop)


class DeadlineExceeded(Exception):
    """A ThreadCall did not finish in time; its thread is left running."""


class ThreadCall:
    """fn() in a daemon thread, so the caller can stop waiting for it after a deadline.

    The thread inherits the caller's autograd and inference mode and its CUDA device (both are
    per-thread in PyTorch). Python cannot stop a thread: one that never returns is abandoned,
    and a daemon thread does not keep the process alive at exit (the program leaves before the
    interpreter's shutdown could wake it inside torch's C++ code: `cli._leave`). Waiting is
    interruptible by signal handlers, like any blocking call in the main thread.
    """

    def __init__(self, fn: Callable[[], Any], name: str = "ppokit-call"):
        self._done = threading.Event()
        self._value: Any = None
        self._error: Optional[BaseException] = None
        fn = in_callers_modes(fn)

        def run():
            try:
                self._value = fn()
            except BaseException as e:  # SystemExit too: it is the caller's to judge, not this thread's to swallow
                self._error = e
            finally:
                self._done.set()

        self.started = time.monotonic()
        self.thread = threading.Thread(target=run, name=name, daemon=True)
        self.thread.start()

    def running(self) -> bool:
        return not self._done.is_set()

    def result(self, timeout_s: Optional[float]) -> Any:
        """fn's return value, or its exception re-raised; DeadlineExceeded after `timeout_s` seconds."""
        if not self._done.wait(timeout_s):
            raise DeadlineExceeded()
        if self._error is not None:
            raise self._error
        return self._value

    def raised(self, error: BaseException) -> bool:
        """Whether `error` (caught around `result`) is what fn raised in its thread, rather than something that
        reached the caller while it waited (a signal handler's exception)."""
        return self._error is not None and error is self._error


def code_raised(error: BaseException, call: Optional[ThreadCall] = None) -> bool:
    """Whether `error`, caught around user code (an environment, a tool), is that code's own failure rather than a
    stop request that reached it. Code run by `call` (a ThreadCall) raised it itself: signals reach the main
    thread only, so even a KeyboardInterrupt from its thread is the code's. Code run in the caller's thread
    (call None): ppokit's own stop (a second SIGINT/SIGTERM, `errors.TrainingInterrupted`) is never the code's, and
    a KeyboardInterrupt is the code's own only where SIGINT cannot raise one (its handler is not Python's default)."""
    if call is not None:
        return call.raised(error)
    if isinstance(error, TrainingInterrupted):
        return False
    if isinstance(error, KeyboardInterrupt):
        return threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    return True


def raised_text(error: BaseException) -> str:
    """'TypeName: message', or 'TypeName' for an exception without a message (KeyboardInterrupt())."""
    message = str(error)
    return f"{type(error).__name__}: {message}" if message else type(error).__name__
