"""An engine's requests as awaitables, for a loop that runs each episode as a coroutine.

    driver = AsyncRequests(engine)
    async def episode(row):
        completion = await driver.complete(Request(...))        # resumes as soon as this request is done
        answer = await environment.step(...)                      # or: await loop.run_in_executor(pool, env.step, ...)
        ...
    async def rollout():
        with engine.serving():
            async with driver.running():                          # steps the engine while requests are unfinished
                return await asyncio.gather(*(episode(row) for row in rows))

The engine is stepped in the event loop's thread (enter `serving()` there); between two steps the loop runs
whatever is ready (episodes whose request or environment call has returned). Results do not depend on that
order: seeded requests are the engine's own (`base.Request`).
"""

from __future__ import annotations

import asyncio
import contextlib

from ppokit.engines.base import Completion, Request, RolloutEngine


class AsyncRequests:
    """Awaitable completions over one engine (see the module docstring)."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine
        self._waiting: dict[str, asyncio.Future] = {}
        self._submitted = asyncio.Event()

    async def complete(self, request: Request) -> Completion:
        """Submit `request` -> its completion, once the engine hands it back."""
        future = asyncio.get_running_loop().create_future()
        self.engine.submit([request])
        self._waiting[request.request_id] = future
        self._submitted.set()
        try:
            return await future
        except asyncio.CancelledError:  # its episode was cancelled: the engine stops the request too
            self._waiting.pop(request.request_id, None)
            self.engine.abort([request.request_id])
            raise

    @contextlib.asynccontextmanager
    async def running(self):
        """Step the engine in a task while the block runs; an error of the engine fails every waiting request."""
        task = asyncio.create_task(self._run())
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            if not self.engine.unfinished():
                self._submitted.clear()
                await self._submitted.wait()
                continue
            try:
                completions = self.engine.step()
            except Exception as error:
                for future in self._waiting.values():
                    future.set_exception(error)
                self._waiting.clear()
                raise
            for completion in completions:
                future = self._waiting.pop(completion.request_id, None)
                if future is not None and not future.done():
                    future.set_result(completion)
            await asyncio.sleep(0)  # let the episodes that can go on run before the next step
