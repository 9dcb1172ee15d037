"""Admission control for one gateway replica, counted in choices: a request of p prompts with
n choices each is p x n generations and holds p x n slots.

At most `max_running` slots are held at once and `max_queued` more wait (each request up to
`queue_timeout_s`); beyond that a request is refused at once with 503 + Retry-After, so an
overloaded cluster says so quickly instead of hanging.

Between API keys the slots are shared max-min fairly, so that one key at its limit cannot
starve another:
- a freed slot goes to the waiting key that holds the fewest (its oldest request first; a
  request waits until all its slots are free, so small ones cannot starve a large one);
- each key with work (running or waiting) may keep at most an equal share of the queue.
  A key over its share is refused there (429); a key under its share that finds the queue
  full displaces the newest request of the key furthest over its share (503 to that one).
With a single key (or none: no auth) it is one FIFO queue, as before. `max_running_per_key`
(0: none) caps what one key may hold even when no other waits.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from cluster.config import GatewayConfig
from router.errors import BadRequest, Overloaded, RateLimited


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for (GatewayConfig), each refused with a 400 that names it:
    checked before it is admitted (its size) and once its prompts are tokenized."""

    max_prompts: int
    max_choices: int
    max_input_tokens: int

    @classmethod
    def of(cls, config: GatewayConfig) -> RequestLimits:
        return cls(config.max_prompts_per_request, config.max_choices_per_request, config.max_request_input_tokens)

    def check_size(self, prompts: int, n: int) -> int:
        """The request's choices (prompts x n)."""
        if prompts > self.max_prompts:
            raise BadRequest(f"{prompts} prompts in one request; the limit is {self.max_prompts} (max_prompts_per_request)",
                             param="prompt")
        if prompts * n > self.max_choices:
            raise BadRequest(f"{prompts} prompt(s) x n={n} is {prompts * n} choices; the limit is {self.max_choices} "
                             "(max_choices_per_request)", param="n")
        return prompts * n

    def check_input_tokens(self, tokens: int) -> None:
        if tokens > self.max_input_tokens:
            raise BadRequest(f"the request's prompts have {tokens} tokens; the limit is {self.max_input_tokens} "
                             "(max_request_input_tokens)", param="prompt")


@dataclass
class _Waiter:
    key: str
    cost: int
    order: int
    granted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Admission:
    def __init__(self, max_running: int, max_queued: int, queue_timeout_s: float, retry_after_s: int,
                 max_running_per_key: int = 0):
        self.max_running = max_running
        self.max_running_per_key = max_running_per_key
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self.running = 0  # slots held
        self.queued = 0  # slots waited for
        self._running_by_key: Counter[str] = Counter()
        self._queued_by_key: Counter[str] = Counter()
        self._waiting: dict[str, deque[_Waiter]] = {}  # per key, oldest first; no empty deques
        self._order = itertools.count()

    @asynccontextmanager
    async def slot(self, key: str = "", cost: int = 1) -> AsyncIterator[None]:
        """Hold `cost` slots for `key` for the body of the `async with`; raises Overloaded
        (503), RateLimited (429: over the key's share of the queue) or BadRequest (400: more
        than can ever run at once)."""
        if not 1 <= cost <= self.max_running:
            raise BadRequest(f"a request of {cost} choices can never run here: at most {self.max_running} run at once "
                             "(max_running_requests)")
        if self.max_running_per_key and cost > self.max_running_per_key:
            raise BadRequest(f"a request of {cost} choices can never run here: an API key runs at most "
                             f"{self.max_running_per_key} at once (max_running_per_key)")
        await self._acquire(key, cost)
        try:
            yield
        finally:
            self._release(key, cost)

    async def _acquire(self, key: str, cost: int) -> None:
        if not self._waiting and self._fits(key, cost):
            self._start(key, cost)
            return
        self._make_room(key, cost)
        waiter = _Waiter(key, cost, next(self._order))
        self._waiting.setdefault(key, deque()).append(waiter)
        self.queued += cost
        self._queued_by_key[key] += cost
        self._grant()
        try:
            done, _ = await asyncio.wait({waiter.granted}, timeout=self.queue_timeout_s)
        except asyncio.CancelledError:  # the client went away while it waited
            self._withdraw(waiter)
            raise
        if not done:
            self._withdraw(waiter)
            if self.max_running_per_key and self._running_by_key[key] + cost > self.max_running_per_key:
                raise RateLimited(f"this API key runs {self._running_by_key[key]} choices, its cap is {self.max_running_per_key} "
                                  f"(max_running_per_key), and none ended within {self.queue_timeout_s:g} s",
                                  retry_after_s=self.retry_after_s)
            raise self._refuse(f"no slot freed within {self.queue_timeout_s:g} s")
        waiter.granted.result()  # raises if it was displaced

    def _make_room(self, key: str, cost: int) -> None:
        """Queue room for `key`'s request of `cost`, or raise: its share, then the whole queue."""
        keys_with_work = {k for k, n in self._running_by_key.items() if n} | set(self._waiting) | {key}
        share = max(cost, self.max_queued // len(keys_with_work))
        if len(keys_with_work) > 1 and self._queued_by_key[key] + cost > share:  # alone, the whole queue is its own
            raise RateLimited(f"this API key has {self._queued_by_key[key]} choices waiting, its share of the queue is "
                              f"{share} (max_queued_requests {self.max_queued} over {len(keys_with_work)} keys with work)",
                              retry_after_s=self.retry_after_s)
        while self.queued + cost > self.max_queued:
            over = [k for k in self._waiting if k != key and self._queued_by_key[k] > share]
            if not over:
                raise self._refuse(f"{self.running} choices running and {self.queued} queued")
            greediest = max(over, key=lambda k: self._queued_by_key[k])
            displaced = self._waiting[greediest][-1]
            self._remove(displaced)
            displaced.granted.set_exception(self._refuse("queued past its API key's share when another key came"))

    def _fits(self, key: str, cost: int) -> bool:
        within_key = not self.max_running_per_key or self._running_by_key[key] + cost <= self.max_running_per_key
        return within_key and self.running + cost <= self.max_running

    def _grant(self) -> None:
        """Free slots to waiters, the key that holds the fewest first (keys at their own cap wait
        for their own requests to end)."""
        while True:
            keys = [k for k in self._waiting
                    if not self.max_running_per_key or self._running_by_key[k] + self._waiting[k][0].cost <= self.max_running_per_key]
            if not keys:
                return
            key = min(keys, key=lambda k: (self._running_by_key[k], self._waiting[k][0].order))
            head = self._waiting[key][0]
            if self.running + head.cost > self.max_running:
                return  # it waits for room; no one overtakes it
            self._remove(head)
            self._start(key, head.cost)
            head.granted.set_result(None)

    def _start(self, key: str, cost: int) -> None:
        self.running += cost
        self._running_by_key[key] += cost

    def _release(self, key: str, cost: int) -> None:
        self.running -= cost
        self._running_by_key[key] -= cost
        if not self._running_by_key[key]:
            del self._running_by_key[key]
        self._grant()

    def _remove(self, waiter: _Waiter) -> None:
        queue = self._waiting[waiter.key]
        queue.remove(waiter)
        if not queue:
            del self._waiting[waiter.key]
        self.queued -= waiter.cost
        self._queued_by_key[waiter.key] -= waiter.cost
        if not self._queued_by_key[waiter.key]:
            del self._queued_by_key[waiter.key]

    def _withdraw(self, waiter: _Waiter) -> None:
        """A waiter that stops waiting: out of the queue, or, granted meanwhile, its slots back."""
        if not waiter.granted.done():
            self._remove(waiter)
            waiter.granted.cancel()
            self._grant()  # a large request that left may let smaller ones behind it run
        elif not waiter.granted.cancelled() and waiter.granted.exception() is None:
            self._release(waiter.key, waiter.cost)

    def _refuse(self, why: str) -> Overloaded:
        return Overloaded(f"the server is overloaded ({why}); retry later", retry_after_s=self.retry_after_s)
