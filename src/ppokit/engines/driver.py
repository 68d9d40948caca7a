"""An engine's requests as awaitables, for a loop that runs each episode as a coroutine (the episode loop does).

    requests = AsyncRequests(engine)
    async def episode(row):
        completion = await requests.complete(Request(...))      # resumes as soon as this request is done
        answer = await environment.step(...)                      # or: await loop.run_in_executor(pool, env.step, ...)
        ...
    async def rollout():
        with engine.serving():
            async with requests.running():                        # steps the engine while requests are unfinished
                return await asyncio.gather(*(episode(row) for row in rows))

The engine is stepped by a task in the event loop's thread (enter `serving()` there). Between two steps the episodes
that can go on run; the requests they ask for meanwhile go to the engine together, in one `submit`, in the order they
were asked for (so requests without a seed, asked for at one moment, are one lock-step batch, as `base.generate`'s).
Results do not depend on that order otherwise: seeded requests are the engine's own (`base.Request`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Awaitable, Callable, Optional

from ppokit.engines.base import Sampled, Request, RolloutEngine


class AsyncRequests:
    """Awaitable completions over one engine (see the module docstring). step_s: how long the engine's last step took
    (given: a step before these requests')."""

    def __init__(self, engine: RolloutEngine, step_s: float = 0.0):
        self.engine = engine
        self.step_s = step_s
        self._queued: list[Request] = []  # asked for since the last submit
        self._waiting: dict[str, asyncio.Future] = {}  # asked for and not completed, queued ones too
        self._asked: Optional[asyncio.Future] = None  # the stepping task's wake-up while the engine has nothing to do

    async def complete(self, request: Request) -> Sampled:
        """`request` -> its completion, once the engine hands it back."""
        future = asyncio.get_running_loop().create_future()
        self._queued.append(request)
        self._waiting[request.request_id] = future
        if self._asked is not None and not self._asked.done():
            self._asked.set_result(None)
        try:
            return await future
        except asyncio.CancelledError:  # its episode was cancelled: the engine stops the request too
            self._waiting.pop(request.request_id, None)
            if any(r is request for r in self._queued):
                self._queued = [r for r in self._queued if r is not request]
            else:
                self.engine.abort([request.request_id])
            raise

    def unanswered(self) -> list[str]:
        """The ids of the requests asked for and not completed (what a stop must abort)."""
        return list(self._waiting)

    @contextlib.asynccontextmanager
    async def running(self, before_step: Optional[Callable[[float], Awaitable]] = None):
        """Step the engine in a task while the block runs; an error of the engine fails every waiting request.
        before_step(last step's seconds): awaited before each step (the episode loop waits there, briefly, for the
        environment calls whose episodes would join the step)."""
        task = asyncio.ensure_future(self._run(before_step))
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self, before_step) -> None:
        while True:
            if before_step is not None:
                await before_step(self.step_s)
            try:
                if self._queued:
                    queued, self._queued = self._queued, []
                    self.engine.submit(queued)
                if not self.engine.unfinished():
                    if self._waiting:
                        raise RuntimeError(f"stuck: the engine holds none of the {len(self._waiting)} requests still waited for "
                                           f"({', '.join(list(self._waiting)[:3])}, ...)")
                    self._asked = asyncio.get_running_loop().create_future()
                    await self._asked  # until a request is asked for
                    continue
                began = time.perf_counter()
                completions = self.engine.step()
                self.step_s = time.perf_counter() - began
            except Exception as error:
                for future in self._waiting.values():
                    if not future.done():
                        future.set_exception(error)
                self._waiting.clear()
                raise
            for completion in completions:
                future = self._waiting.pop(completion.request_id, None)
                if future is not None and not future.done():
                    future.set_result(completion)
            await asyncio.sleep(0)  # let the episodes that can go on run before the next step
