"""/ready's answer: the last real check, made by the gateway itself at most every
`interval_s`, so that no number of calls costs more than one generation per interval (a
real check is two tokens through prefill, the KV transfer and decode, outside admission
and rate limits: one per call would let anyone load every tier).

The first call waits for the first check; after it, a call answers at once with the last
result and, if that is older than the interval, starts the next check, which later calls
see. One check runs at a time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


class Readiness:
    def __init__(self, check: Callable[[], Awaitable[None]], timeout_s: float, interval_s: float):
        """`check()` raises if the cluster is not ready; it gets `timeout_s`."""
        self._check = check
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self._result: str | None = None  # None: ready; else why not
        self._checked_at: float | None = None  # monotonic time of the last check's end
        self._running: asyncio.Task | None = None
        self.checks = 0  # real checks made (for tests and metrics)

    async def status(self) -> str | None:
        """None if the cluster was ready at the last check, else why it was not."""
        stale = self._checked_at is None or time.monotonic() - self._checked_at >= self.interval_s
        if stale and self._running is None:
            self._running = asyncio.create_task(self._run())
        if self._checked_at is None:
            await asyncio.shield(self._running)
        return self._result

    async def _run(self) -> None:
        self.checks += 1
        try:
            await asyncio.wait_for(self._check(), self.timeout_s)
            self._result = None
        except Exception as e:  # noqa: BLE001 - any failure means not ready
            self._result = "timed out" if isinstance(e, TimeoutError) else type(e).__name__
        finally:
            self._checked_at = time.monotonic()
            self._running = None
