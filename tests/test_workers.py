"""Threads that run environment code (ppokit.process.workers, and EnvironmentCalls over them): a thread is kept for the next
call, a call never waits for a busy one, an idle thread ends, the caller's torch modes are the call's; EnvironmentCalls
keeps each call's deadline on the event loop (one thread per call), drops what a timed-out call returns later, and
waits for the calls started since its last settle when they usually return in time."""

from __future__ import annotations

import asyncio
import threading
import time
from functools import partial

import torch

from ppokit.environments import EnvironmentRunner, EnvironmentTimeout
from ppokit.environments.base import EnvironmentCalls
from ppokit.process.workers import WorkerThreads, run_coroutine

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


def test_each_call_is_one_worker_thread_under_the_event_loops_deadline():
    runner, calls = _calls(timeout_s=0.2)
    [episode] = runner.start_many([{}], ["p"])

    async def both():
        started = time.monotonic()
        quick, hung = await asyncio.gather(calls.run(partial(episode.step, "0"), "step", "p"),
                                           calls.run(partial(episode.step, "1.0"), "step", "p"))
        waited = time.monotonic() - started
        await asyncio.sleep(1.0)  # the hung call returns meanwhile, into the same loop
        return quick, hung, waited

    quick, timed_out, waited = run_coroutine(both)
    assert quick.observation == "ppokit-env"  # not a deadline thread of its own ("ppokit-env-step")
    assert isinstance(timed_out, EnvironmentTimeout) and waited < 1.0  # answered at its deadline, not when it returned
    assert str(timed_out).startswith("environment test:Sleeps: step did not return within environment_timeout_s=0.2s")
    assert str(timed_out).endswith("; prompt 'p'")
    assert len(runner.recent_call_s) == 1  # what it returned at last is dropped: its episode failed already


def test_settle_waits_for_the_calls_started_since_the_last_when_they_usually_return_in_time():
    """`settle` waits until the calls started since the last settle are back with their episodes (the coroutines that
    awaited them have gone on), at most twice the environment's usual call time, and only if that is within the limit."""
    runner, calls = _calls(timeout_s=60.0)
    [episode] = runner.start_many([{}], ["p"])
    back = []

    async def scenario():
        async def call(key, seconds):
            await calls.run(partial(episode.step, seconds), "step", "p")
            back.append(key)

        async def started(key, seconds):
            task = asyncio.ensure_future(call(key, seconds))
            await asyncio.sleep(0)  # the call starts
            return task

        first = await started("first", "0.2")
        await calls.settle(WAIT_BOUND_S)
        assert back == []  # how long its calls take is not known yet
        await first
        again = await started("again", "0.2")
        await calls.settle(0.3)
        assert back == ["first"]  # twice its usual time is more than it may wait
        await again
        await started("patient", "0.2")
        await calls.settle(WAIT_BOUND_S)  # waits up to twice 0.2 s
        assert back[-1] == "patient"

        second = await started("second", "3")
        await calls.settle(WAIT_BOUND_S)  # not patient: it runs for seconds
        await started("third", "0")
        await calls.settle(WAIT_BOUND_S)
        assert back[-1] == "third"  # "second" was started before the last settle: not waited for
        await second
        assert back[-1] == "second"

    run_coroutine(scenario)


def test_without_a_deadline_calls_run_in_the_event_loops_thread_as_in_a_plain_one():
    runner = EnvironmentRunner("test:Sleeps", Sleeps, {}, timeout_s=None)
    calls = runner.side_by_side()
    assert isinstance(calls, EnvironmentCalls) and not calls.threaded
    [episode] = runner.start_many([{}], ["p"])
    step = run_coroutine(lambda: calls.run(partial(episode.step, "0"), "step", "p"))
    assert step.observation == threading.current_thread().name
    # code that runs an event loop of its own works there, as in a thread without one
    step = run_coroutine(lambda: calls.run(lambda: asyncio.run(asyncio.sleep(0, result="own loop")), "step", "p"))
    assert step == "own loop"
