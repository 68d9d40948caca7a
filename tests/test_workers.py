"""Threads that run environment code (ppokit.process.workers, and SideBySide over them): a thread is kept for the next call, a
call never waits for a busy one, an idle thread ends, the caller's torch modes are the call's; SideBySide keeps each
call's deadline itself (one thread per call), drops what a timed-out call returns later, and waits for the calls
started since its last look when asked to be patient and its calls usually return in time."""

from __future__ import annotations

import threading
import time

import torch

from ppokit.environments import EnvironmentRunner, EnvironmentTimeout
from ppokit.environments.base import SideBySide
from ppokit.process.workers import WorkerThreads

# What a test waits for at most before it calls the behaviour broken: far above what a loaded machine takes.
WAIT_BOUND_S = 20.0


def _until(condition, bound_s: float = WAIT_BOUND_S) -> bool:
    end = time.monotonic() + bound_s
    while not condition() and time.monotonic() < end:
        time.sleep(0.005)
    return condition()


def _idle(pool: WorkerThreads) -> int:
    with pool._lock:
        return pool._idle


def test_a_thread_is_kept_for_the_next_call_and_a_busy_one_is_never_waited_for():
    pool = WorkerThreads("test-workers")
    seen, release, first_running = [], threading.Event(), threading.Event()

    def blocked():
        seen.append(threading.get_ident())
        first_running.set()
        release.wait(WAIT_BOUND_S)

    pool.run(blocked)
    assert first_running.wait(WAIT_BOUND_S)
    second = threading.Event()
    pool.run(lambda: (seen.append(threading.get_ident()), second.set()))
    assert second.wait(WAIT_BOUND_S), "a call waited for a busy thread"
    assert seen[1] != seen[0]
    release.set()
    assert _until(lambda: _idle(pool) == 2)
    third = threading.Event()
    pool.run(lambda: (seen.append(threading.get_ident()), third.set()))
    assert third.wait(WAIT_BOUND_S)
    assert seen[2] in seen[:2], "an idle thread was not reused"
    assert _until(lambda: _idle(pool) == 2)
    assert sum(t.name == "test-workers" for t in threading.enumerate()) == 2


def test_an_idle_thread_ends_and_a_call_after_it_starts_another():
    pool = WorkerThreads("test-workers-idle", idle_s=0.05)
    ran = threading.Event()
    pool.run(ran.set)
    assert ran.wait(WAIT_BOUND_S)
    assert _until(lambda: not any(t.name == "test-workers-idle" for t in threading.enumerate()))
    assert _idle(pool) == 0
    again = threading.Event()
    pool.run(again.set)
    assert again.wait(WAIT_BOUND_S)


def test_a_call_runs_in_the_callers_torch_modes():
    pool = WorkerThreads("test-workers-modes")
    modes, done = [], threading.Event()

    def look():
        modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        done.set()

    with torch.inference_mode():
        pool.run(look)
    assert done.wait(WAIT_BOUND_S) and modes == [(True, False)]
    done.clear()
    with torch.no_grad():
        pool.run(look)
    assert done.wait(WAIT_BOUND_S) and modes[1] == (False, False)


class Sleeps:
    """reset: nothing; step(seconds as text): sleeps that long, and says which thread ran it."""

    def reset(self, row):
        return None

    def step(self, completion):
        time.sleep(float(completion))
        return threading.current_thread().name, 0.0, False


def _calls(timeout_s: float):
    runner = EnvironmentRunner("test:Sleeps", Sleeps, {}, timeout_s=timeout_s)
    return runner, runner.side_by_side()


def test_each_call_is_one_worker_thread_under_the_side_by_sides_own_deadline():
    runner, calls = _calls(timeout_s=0.2)
    [episode] = runner.start_many([{}], ["p"])
    calls.start("quick", lambda **kw: episode.step("0", **kw), "step", "p")
    calls.start("hung", lambda **kw: episode.step("1.0", **kw), "step", "p")
    returned = {}
    assert _until(lambda: returned.update(calls.finished(wait=True, timeout_s=0.05)) or len(returned) == 2)
    assert returned["quick"].observation == "ppokit-env"  # not a deadline thread of its own ("ppokit-env-step")
    timed_out = returned["hung"]
    assert isinstance(timed_out, EnvironmentTimeout)
    assert str(timed_out).startswith("environment test:Sleeps: step did not return within environment_timeout_s=0.2s")
    assert str(timed_out).endswith("; prompt 'p'")
    assert calls.running == 0  # handed back, its thread still sleeping
    time.sleep(1.0)
    assert calls.finished(wait=False) == []  # what it returned at last is dropped: its episode failed already


def test_patience_waits_for_the_calls_started_since_the_last_look_when_they_usually_return_in_time():
    runner, calls = _calls(timeout_s=60.0)
    [episode] = runner.start_many([{}], ["p"])
    calls.start("first", lambda **kw: episode.step("0.2", **kw), "step", "p")
    assert calls.finished(wait=False, patience_s=WAIT_BOUND_S) == []  # how long its calls take is not known yet
    assert [key for key, _ in calls.finished(wait=True)] == ["first"]
    calls.start("again", lambda **kw: episode.step("0.2", **kw), "step", "p")
    assert calls.finished(wait=False, patience_s=0.3) == []  # twice its usual time is more than it may wait
    assert [key for key, _ in calls.finished(wait=True)] == ["again"]
    calls.start("patient", lambda **kw: episode.step("0.2", **kw), "step", "p")
    [(key, step)] = calls.finished(wait=False, patience_s=WAIT_BOUND_S)  # waits up to twice 0.2 s
    assert key == "patient" and step.observation == "ppokit-env"

    calls.start("second", lambda **kw: episode.step("3", **kw), "step", "p")
    assert calls.finished(wait=False) == []  # not patient: it runs for seconds
    calls.start("third", lambda **kw: episode.step("0", **kw), "step", "p")
    returned = calls.finished(wait=False, patience_s=WAIT_BOUND_S)
    assert [key for key, _ in returned] == ["third"]  # "second" was started before the last look: not waited for
    [(key, _)] = calls.finished(wait=True)
    assert key == "second" and calls.running == 0


def test_without_a_deadline_calls_run_in_the_callers_thread():
    runner = EnvironmentRunner("test:Sleeps", Sleeps, {}, timeout_s=None)
    calls = runner.side_by_side()
    assert isinstance(calls, SideBySide) and not calls.threaded
    [episode] = runner.start_many([{}], ["p"])
    calls.start("x", lambda **kw: episode.step("0", **kw), "step", "p")
    [(key, step)] = calls.finished(wait=False)
    assert key == "x" and step.observation == threading.current_thread().name
