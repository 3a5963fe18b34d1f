"""One HTTP request's choices in the request driver. The driver hands out increments on its own thread; they cross
into the event loop through a `Mailbox`: one wake-up of the loop per burst of increments (the driver sends one per
running request at every step), not one per increment, so the loop takes the GIL from the decode thread once."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

from hsmc.engine.driver import RequestDriver
from hsmc.requests import Increment, SamplingParams


class Mailbox:
    """Increments posted from the driver's thread for queues of one event loop, delivered in one callback."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._posted: list[tuple[asyncio.Queue[Increment], Increment]] = []

    def post(self, queue: asyncio.Queue[Increment], increment: Increment) -> None:
        with self._lock:
            first = not self._posted
            self._posted.append((queue, increment))
        if first:
            try:
                self.loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # the event loop has closed: nobody waits for these requests any more
                pass

    def _deliver(self) -> None:
        with self._lock:
            posted, self._posted = self._posted, []
        for queue, increment in posted:
            queue.put_nowait(increment)


class Submission:
    """Submits the choices (increment index k = choice k) and tracks which have not ended yet."""

    def __init__(
        self, driver: RequestDriver, mailbox: Mailbox, prompts: Sequence[list[int]], params: Sequence[SamplingParams]
    ) -> None:
        """Raises the driver's RequestError, with nothing queued, when a choice cannot be served."""
        queue: asyncio.Queue[Increment] = asyncio.Queue()
        self._driver, self._queue = driver, queue
        self._ids = driver.submit(prompts, params, lambda increment: mailbox.post(queue, increment),
                                  indices=range(len(prompts)))  # fmt: skip
        self.open = set(range(len(prompts)))  # choices that have not ended

    async def next(self) -> Increment:
        return self._track(await self._queue.get())

    def ready(self) -> list[Increment]:
        """The increments that have arrived already, without waiting."""
        arrived = []
        while not self._queue.empty():
            arrived.append(self._track(self._queue.get_nowait()))
        return arrived

    def _track(self, increment: Increment) -> Increment:
        if increment.result is not None or increment.error is not None:
            self.open.discard(increment.index)
        return increment

    def cancel(self) -> None:
        """End the choices still running (their rows and KV slots go back to the pool)."""
        if self.open:
            self._driver.cancel([self._ids[k] for k in self.open])
            self.open.clear()
