"""Admission control for one gateway replica: at most `max_running` requests stream at
once, at most `max_queued` more wait (each up to `queue_timeout_s`) for a slot, and the
rest are refused at once with 503 + Retry-After, so an overloaded cluster says so
quickly instead of hanging."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from router.errors import Overloaded


class Admission:
    def __init__(self, max_running: int, max_queued: int, queue_timeout_s: float, retry_after_s: int):
        self.max_running = max_running
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self._slots = asyncio.Semaphore(max_running)
        self.running = 0
        self.queued = 0

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a running slot for the body of the `async with`; raises Overloaded."""
        if self._slots.locked():
            if self.queued >= self.max_queued:
                raise self._refuse(f"{self.running} requests running and {self.queued} queued")
            self.queued += 1
            try:
                await asyncio.wait_for(self._slots.acquire(), self.queue_timeout_s)
            except TimeoutError:
                raise self._refuse(f"no slot freed within {self.queue_timeout_s:g} s") from None
            finally:
                self.queued -= 1
        else:
            await self._slots.acquire()  # free slot: returns at once
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._slots.release()

    def _refuse(self, why: str) -> Overloaded:
        return Overloaded(f"the server is overloaded ({why}); retry later", retry_after_s=self.retry_after_s)
