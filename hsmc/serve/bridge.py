"""One HTTP request's choices in the request driver. The driver hands out increments on its own thread; they cross
into the event loop through `call_soon_threadsafe` onto a queue the request's handler awaits."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from hsmc.engine.driver import RequestDriver
from hsmc.requests import Increment, SamplingParams


class Submission:
    """Submits the choices (increment index k = choice k) and tracks which have not ended yet."""

    def __init__(self, driver: RequestDriver, prompts: Sequence[list[int]], params: Sequence[SamplingParams]) -> None:
        """Raises the driver's RequestError, with nothing queued, when a choice cannot be served."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Increment] = asyncio.Queue()

        def sink(increment: Increment) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, increment)
            except RuntimeError:  # the event loop has closed: nobody waits for this request any more
                pass

        self._driver, self._queue = driver, queue
        self._ids = driver.submit(prompts, params, sink, indices=range(len(prompts)))
        self.open = set(range(len(prompts)))  # choices that have not ended

    async def next(self) -> Increment:
        increment = await self._queue.get()
        if increment.result is not None or increment.error is not None:
            self.open.discard(increment.index)
        return increment

    def cancel(self) -> None:
        """End the choices still running (their rows and KV slots go back to the pool)."""
        if self.open:
            self._driver.cancel([self._ids[k] for k in self.open])
            self.open.clear()
