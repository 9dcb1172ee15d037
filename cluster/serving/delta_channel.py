"""Token deltas from a worker to the gateway that asked for them: one message per event
loop turn for all of that gateway's requests, not one Ray streaming item per token per
request (each of those costs ~0.6 ms of CPU between two processes; a step of 16 decodes
would pay it 16 times).

    gateway: DeltaReceiver                            worker: DeltaSender
      address = (node ip, port, token)  --GenerateRequest.reply_to-->
      subscribe(request_id) -> queue                   connection(reply_to).send(delta)
                                <--- TCP, one connection per (worker, gateway) ---
      frame: [u32 length][pickle: list of deltas]      one frame per loop turn and gateway

The Ray call that starts a request still carries its control: placement, cancellation
(cancelling the call aborts the request on every tier), worker faults (a dead worker
fails the call) and its end (the call returns how many deltas it sent). Only the deltas
travel here.

Invariants:
- Per connection, frames arrive in the order they were sent, so a request's deltas do
  too: its first token (sent from the worker's event loop) before any step's delta.
- A connection opens with the receiver's token; the receiver unpickles nothing from a
  peer that did not present it.
- Deltas for a request nobody is subscribed to (cancelled, migrated away) are dropped.
- A request's deltas all travel on the connection it started on. If that connection
  fails or closes, the request's next send raises DeltaChannelError (the worker aborts
  it: its gateway is gone, or its stream has a gap); later requests connect anew.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import pickle
import secrets
import struct

log = logging.getLogger(__name__)

DeltaAddress = tuple[str, int, str]  # (host, port, token)
_LENGTH = struct.Struct("!I")
MAX_FRAME_BYTES = 64 << 20  # a frame longer than this is a broken or hostile peer
MAX_UNSENT_BYTES = 64 << 20  # a gateway this far behind is stuck: its requests are aborted


class DeltaChannelError(RuntimeError):
    """The connection to a gateway failed: its requests cannot be delivered."""


def _frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (n,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if n > MAX_FRAME_BYTES:
        raise DeltaChannelError(f"frame of {n} bytes is over the limit of {MAX_FRAME_BYTES}")
    return await reader.readexactly(n)


# ---- gateway side ----------------------------------------------------------------------


class DeltaReceiver:
    """Listens for workers' deltas and hands each to its request's queue. Runs on the
    event loop of the requests that subscribe (asyncio queues are not thread-safe)."""

    def __init__(self, host: str):
        self.host = host
        self.token = secrets.token_hex(16)
        self._queues: dict[str, asyncio.Queue] = {}
        self._server: asyncio.Server | None = None
        self._starting: asyncio.Task | None = None
        self._writers: set[asyncio.StreamWriter] = set()  # open connections from workers
        self.counts = {"connections": 0, "frames": 0, "deltas": 0, "dropped": 0, "refused": 0}

    async def start(self) -> DeltaAddress:
        """Start listening (once; later calls return at once) and return the address
        workers send to."""
        if self._server is None:
            if self._starting is None:
                self._starting = asyncio.ensure_future(asyncio.start_server(self._serve, self.host, 0))
            self._server = await asyncio.shield(self._starting)
        return self.address

    @property
    def address(self) -> DeltaAddress:
        if self._server is None:
            raise RuntimeError("DeltaReceiver.start() first")
        return self.host, self._server.sockets[0].getsockname()[1], self.token

    def subscribe(self, request_id: str) -> asyncio.Queue:
        """The queue `request_id`'s deltas arrive on, until `unsubscribe`."""
        if request_id in self._queues:
            raise ValueError(f"request {request_id!r} is already subscribed")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def unsubscribe(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            if not hmac.compare_digest(await _read_frame(reader), self.token.encode()):
                self.counts["refused"] += 1
                log.warning("delta channel: refused a connection from %s (wrong token)", writer.get_extra_info("peername"))
                return
            self.counts["connections"] += 1
            while True:
                self._dispatch(pickle.loads(await _read_frame(reader)))
        except (asyncio.IncompleteReadError, ConnectionError, DeltaChannelError):
            pass  # the worker closed or broke the connection: its requests' calls say what happened
        finally:
            self._writers.discard(writer)
            writer.close()

    def _dispatch(self, deltas: list) -> None:
        self.counts["frames"] += 1
        self.counts["deltas"] += len(deltas)
        for delta in deltas:
            queue = self._queues.get(delta.request_id)
            if queue is None:
                self.counts["dropped"] += 1
            else:
                queue.put_nowait(delta)

    async def close(self) -> None:
        """Stop listening and close every worker's connection (their senders fail)."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        if self._server is not None:
            await self._server.wait_closed()


# ---- worker side -----------------------------------------------------------------------


class DeltaConnection:
    """One connection to one gateway. A request sends all its deltas on the connection
    it started on: should that connection fail, the request fails (DeltaChannelError)
    rather than going on over a new one with a gap in its stream."""

    def __init__(self, sender: DeltaSender, address: DeltaAddress):
        self.address = address
        self._sender = sender
        self._pending: list = []  # deltas waiting for the next flush
        self._writer: asyncio.StreamWriter | None = None  # None while connecting
        self._flush_scheduled = False
        self.error: BaseException | None = None
        self._reading = asyncio.ensure_future(self._connect())

    def send(self, delta) -> None:
        """Queue `delta`; it goes out with the others of this loop turn."""
        if self.error is not None:
            raise DeltaChannelError(f"delta channel to {self.address[0]}:{self.address[1]} failed: {self.error}")
        self._pending.append(delta)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if self._writer is not None and not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self.error is not None or not self._pending:
            return
        deltas, self._pending = self._pending, []
        transport = self._writer.transport
        if transport.is_closing():
            self._fail(ConnectionResetError("the gateway closed the connection"))
        elif transport.get_write_buffer_size() > MAX_UNSENT_BYTES:
            self._fail(DeltaChannelError(f"the gateway left {MAX_UNSENT_BYTES} bytes unread"))
        else:
            self._writer.write(_frame(pickle.dumps(deltas, protocol=pickle.HIGHEST_PROTOCOL)))
            self._sender.counts["frames"] += 1
            self._sender.counts["deltas"] += len(deltas)

    async def _connect(self) -> None:
        host, port, token = self.address
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(_frame(token.encode()))
        except OSError as e:
            self._fail(e)
            return
        self._writer = writer
        self._sender.counts["connections"] += 1
        self._schedule_flush()
        try:  # the gateway never writes: EOF or an error means the connection is gone
            await reader.read()
            self._fail(ConnectionResetError("the gateway closed the connection"))
        except OSError as e:
            self._fail(e)

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
            self._sender.counts["failures"] += 1
            log.warning("delta channel to %s:%s failed: %s", self.address[0], self.address[1], error)
        self._pending.clear()
        self.close()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self.error is None:
            self.error = DeltaChannelError("closed")


class DeltaSender:
    """A worker's connections to gateways, one live one per gateway, each writing the
    deltas of a loop turn as one frame: all the deltas one engine step hands to the
    worker's event loop go out together. Use it from one event loop only."""

    def __init__(self):
        self._connections: dict[DeltaAddress, DeltaConnection] = {}
        self.counts = {"frames": 0, "deltas": 0, "connections": 0, "failures": 0}

    def connection(self, address: DeltaAddress) -> DeltaConnection:
        """The live connection to the gateway at `address` (a new one if it had none, or
        if the last one failed)."""
        address = tuple(address)
        conn = self._connections.get(address)
        if conn is None or conn.error is not None:
            conn = self._connections[address] = DeltaConnection(self, address)
        return conn

    def close(self) -> None:
        for conn in self._connections.values():
            conn.close()
        self._connections.clear()
