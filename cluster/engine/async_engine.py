"""Streaming front of the Engine for async callers (the workers' interface).

One background thread builds the Engine, owns it and steps it; nothing else touches it.
It builds it too: the thread that steps must be the process's only OpenMP master, and
loading the model runs parallel ops (cluster/host/openmp.py).
Callers hand work in through a thread-safe inbox (add, abort) and get deltas on a
per-request asyncio queue. A caller that stops iterating (cancelled, disconnected)
aborts its request, which frees its blocks on the engine thread.

A step that fails fails the requests it ran (their blocks freed) and the engine goes
on; a step that cannot run again (EngineDeadError: a tensor-parallel rank is lost) also
refuses every later request with that error (calls still run: stats, aborts), and `dead`
tells the worker's health check.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from cluster.engine.engine import Engine
from cluster.engine.input_processor import TokenizedRequest
from cluster.engine.outputs import RequestOutput
from cluster.errors import EngineDeadError

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Add:
    request_id: str
    request: TokenizedRequest
    hold_kv: bool
    generated: tuple[int, ...]
    stream_kv: bool
    sink: _Sink


@dataclass(frozen=True)
class _Call:
    """Run fn(engine) on the engine thread; its result or exception resolves `future`."""

    fn: Callable[[Engine], object]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


@dataclass(frozen=True)
class _Run:
    """Run fn() on the engine thread; nobody awaits it (what it does goes to a sink)."""

    fn: Callable[[], None]


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Sink:
    """Where a request's deltas go: an asyncio queue on the caller's loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening
            pass


class AsyncEngine:
    def __init__(self, build: Callable[[], Engine]):
        """Build the engine with `build()` on the engine thread, then serve it; the build's
        exception, if any, is raised here."""
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Call | _Run | None] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._sinks: dict[str, _Sink] = {}
        # Requests whose first token is accepted and whose KV is still coming: their sinks
        # until kv_in joins them (engine thread only).
        self._awaiting_kv: dict[str, _Sink] = {}
        self._ids = itertools.count()
        self._closed = False
        self.dead: EngineDeadError | None = None
        built: Future[Engine] = Future()
        self._thread = threading.Thread(target=self._run, args=(build, built), name="pdserve-engine", daemon=True)
        self._thread.start()
        self.engine = built.result()
        self.kv_layout = self.engine.kv_layout()  # fixed once built: read from any thread

    def rank_info(self) -> list[dict]:
        """The replica's ranks (fixed at start: no engine-thread call)."""
        return self.engine.rank_info()

    def check_health(self) -> None:
        """EngineDeadError or RankLostError if the engine cannot serve (not on the engine
        thread: it only asks Ray about the rank actors)."""
        if self.dead is not None:
            raise self.dead
        self.engine.check_health()

    async def stream(
        self,
        request: TokenizedRequest,
        request_id: str | None = None,
        hold_kv: bool = False,
        generated: Sequence[int] = (),
        stream_kv: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Run a request made at the edge (InputProcessor.process) and stream its deltas
        until it finishes (and, with stream_kv, its KV progress: Engine.add)."""
        self._check_alive()
        await self.prepare(request)
        request_id = request_id or f"async-{next(self._ids)}"
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        self._post(_Add(request_id, request, hold_kv, tuple(generated), stream_kv, sink))
        async for item in self._drain(request_id, sink):
            yield item

    async def prepare(self, request: TokenizedRequest) -> None:
        """Compile the request's grammar, if it has one the engine has not compiled yet, on a
        thread of its own: the engine thread only copies it (other requests keep stepping)."""
        if request.params.structured is not None:
            await asyncio.to_thread(self.engine.grammars.compile, request.params.structured)

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` on the engine thread, between steps, and return its result."""
        self._check_open()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._post(_Call(fn, loop, future))
        return await future

    async def accept_first_token(
        self, request_id: str, token_id: int, logprob, kv_arrived: Callable[[], bool]
    ) -> tuple[RequestOutput | None, AsyncIterator[RequestOutput] | None, bool]:
        """Accept the prefill worker's first token of a request reserved with
        Engine.add_remote_request: (its delta, or None if the request stopped waiting; the
        stream of its decode steps, None if the first token ended it; whether it joined the
        batch in this call). It joins in the same call, between two steps, when
        `kv_arrived()` (asked on the engine thread) says the whole KV is in, so that the
        next step computes the second token; else at the first step boundary after
        `kv_in`, which the receiving thread calls itself (no hop through the caller's event
        loop, which 16 streams keep busy: that hop alone was up to 40 ms)."""
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())

        def accept(engine: Engine) -> tuple[RequestOutput | None, bool, bool]:
            first = engine.accept_first_token(request_id, token_id, logprob)
            if first is None or first.finished or self.dead is not None:
                return first, False, False
            if kv_arrived():
                self._start(request_id, sink, lambda e: e.commit_remote(request_id, True))
                return first, True, True
            self._awaiting_kv[request_id] = sink
            return first, True, False

        first, streams, joined = await self.call(accept)
        return first, self._drain(request_id, sink) if streams else None, joined

    def kv_in(self, request_id: str, received: bool) -> None:
        """From any thread: the KV of a request whose first token was accepted without it
        is in (received) or will not come (the prompt is recomputed here: policy
        `recompute`); it joins the batch at the next step boundary. A no-op for a request
        not waiting (it joined with its first token, or ended)."""
        def join() -> None:
            sink = self._awaiting_kv.pop(request_id, None)
            if sink is not None:
                self._start(request_id, sink, lambda e: e.commit_remote(request_id, received))

        self._post(_Run(join))

    async def compute_here(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """A reserved request whose prefill worker is lost computes its prompt here: stream it."""
        async for item in self._join(request_id, lambda e: e.compute_here(request_id)):
            yield item

    async def _join(self, request_id: str, join: Callable[[Engine], bool]) -> AsyncIterator[RequestOutput]:
        self._check_open()
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        self._post(_Run(lambda: self._start(request_id, sink, join)))
        async for item in self._drain(request_id, sink):
            yield item

    def _start(self, request_id: str, sink: _Sink, join: Callable[[Engine], bool]) -> None:
        """(engine thread) Join a request to the batch with `join`; its deltas go to `sink`."""
        if self.dead is not None:  # it would never step
            self.engine.abort(request_id)
            sink.put(EngineDeadError(f"engine is dead: {self.dead}"))
            return
        try:
            joined = join(self.engine)
        except Exception as e:  # the caller's, not the engine loop's
            sink.put(e)
            return
        if not joined:
            sink.put(EngineDeadError(f"request {request_id} was not waiting for KV"))
            return
        self._sinks[request_id] = sink

    async def _drain(self, request_id: str, sink: _Sink) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._post(_Abort(request_id))

    def _check_open(self) -> None:
        if self._closed:
            raise EngineDeadError("engine is shut down")

    def _check_alive(self) -> None:
        """New requests need an engine that can still step."""
        self._check_open()
        if self.dead is not None:
            raise EngineDeadError(f"engine is dead: {self.dead}")

    def abort(self, request_id: str) -> None:
        self._post(_Abort(request_id))

    def shutdown(self) -> None:
        self._closed = True
        self._post(None)
        self._thread.join(timeout=30)

    def _post(self, msg: _Add | _Abort | _Call | _Run | None) -> None:
        self._inbox.put(msg)
        self._wakeup.set()

    # ---- engine thread ---------------------------------------------------------------
    def _run(self, build: Callable[[], Engine], built: Future[Engine]) -> None:
        try:
            self.engine = build()
        except BaseException as e:
            built.set_exception(e)
            return
        built.set_result(self.engine)
        try:
            self._loop()
        finally:
            self.engine.close()

    def _loop(self) -> None:
        while True:
            self._wakeup.clear()
            if not self._drain_inbox():
                return
            if self.dead is not None or not self.engine.has_schedulable:  # idle, waiting for KV, or dead
                if not self._wakeup.wait(self.engine.idle_tick_s) and self.dead is None:
                    self._idle_tick()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a broken step must not strand callers or blocks
                log.exception("engine step failed; failing every running request")
                if isinstance(e, EngineDeadError):
                    self.dead = e
                self._fail_all(e)
                continue
            self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their callers: one wake-up per caller's event loop
        for the whole step, not one per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            sink = self._sinks.pop(out.request_id) if out.finished else self._sinks.get(out.request_id)
            if sink is not None:
                by_loop.setdefault(sink.loop, []).append((sink.queue, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that caller's loop is closed: nobody is listening
                pass

    def _idle_tick(self) -> None:
        try:
            self.engine.idle_tick()
        except EngineDeadError as e:  # a tensor-parallel rank is gone
            log.error("engine is dead: %s", e)
            self.dead = e
            self._fail_all(e)

    def _drain_inbox(self) -> bool:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return True
            if msg is None:
                self._fail_all(EngineDeadError("engine shut down"))
                return False
            if isinstance(msg, _Abort):
                self._sinks.pop(msg.request_id, None)
                self._awaiting_kv.pop(msg.request_id, None)
                self.engine.abort(msg.request_id)
            elif isinstance(msg, _Call):
                self._run_call(msg)
            elif isinstance(msg, _Run):
                msg.fn()
            elif self.dead is not None:
                msg.sink.put(EngineDeadError(f"engine is dead: {self.dead}"))
            else:
                try:
                    self.engine.add(msg.request, msg.request_id, msg.hold_kv, msg.generated, msg.stream_kv)
                    self._sinks[msg.request_id] = msg.sink
                except Exception as e:
                    msg.sink.put(e)

    def _run_call(self, msg: _Call) -> None:
        def resolve(future: asyncio.Future, result, error) -> None:
            if future.done():  # the caller was cancelled meanwhile
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        result, error = None, None
        try:
            result = msg.fn(self.engine)
        except Exception as e:
            error = e
        try:
            msg.loop.call_soon_threadsafe(resolve, msg.future, result, error)
        except RuntimeError:  # the caller's loop is closed
            pass

    def _fail_all(self, error: BaseException) -> None:
        for request_id, sink in [*self._sinks.items(), *self._awaiting_kv.items()]:
            self.engine.abort(request_id)
            sink.put(error)
        self._awaiting_kv.clear()
        self._sinks.clear()


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for deltas, out in items:
        deltas.put_nowait(out)
