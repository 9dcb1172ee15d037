r"""The torch.distributed KV transport (interface.py says what every transport does).

Each (prefill, decode) pair gets its own torch.distributed process group, made
lazily from a TCPStore rendezvous that the decode worker hosts, outside the default
world (`init_process_group` is never called): workers come and go as tiers scale.
ProcessGroupGloo when the KV cache is on CPU, ProcessGroupNCCL when it is on CUDA;
the rest of the code is the same.

    prefill P (rank 0)                          decode D (rank 1, hosts the TCPStore)
    ------------------                          -------------------------------------
          endpoints: D's (host, store port), P's session s, exchanged by the tiers
    send(D, D's endpoint, caches, src_ids, t)   receive(P, P's endpoint, caches, dst_ids, t)
          \_____ the pair's group, made at its first transfer: rendezvous under
                 "pdserve/kv/P/D/s" at D's store; both block until both joined ___/
      packed = pack_blocks(caches, src_ids)       (N = len(dst_ids) blocks in all)
      header [magic, t, first, n, N, L, bs, Hk, D, dtype] --tag 2t-->  must equal the
                                                             expected header, else
                                                             KVTransferError
      packed [L, 2, n, bs, Hk, D] ---------------tag 2t+1-->  into a fresh buffer, then
                                                             unpack_blocks(caches,
                                                             dst_ids[first:first + n])

A transfer goes in one part (first 0, n = N) or in several, in order, as the prompt's
KV is computed (a prefill chunk's blocks while the next chunk computes): each part is a
header and its payload on the transfer's two tags, which deliver in order, and the
receiver takes parts until it has all N blocks, each written into its blocks as it
arrives.

On one host (the decode's store host is the sender's own) with the cache on CPU, the
payload skips the sockets: the sender packs straight into a shared-memory slot
(shm_slots.py: files kept mapped on both sides and reused), sends a header
with the shared-memory magic that names the slot, and waits for the receiver's
one-word ack, which comes after the receiver has unpacked the slot into its cache: one
copy on each side, no socket copies, no page faults. After a failure the slot is
dropped, never reused.

A transfer begins with a handshake through the decode side's store (`_TransferKeys`),
before either side posts anything on the group: the receiver marks the transfer's key
"receiving" when it starts; the sender posts its first part (or failure notice) only
once it sees that mark, and gives up if none comes within `timeout_s`, marking the key
"gone" (compare-and-set: exactly one of the two marks wins). On gloo, an operation that
no one matches times out and closes every connection of the group, failing every
transfer on the pair: before the handshake, a prompt cancelled by its client while it
computed sent its failure notice to a decode worker that had never heard of it, and 30 s
later the pair's group died with 6-15 transfers in flight (`pdserve bench protect`, 16
decodes: each recomputed on the decode worker, 10-40 s late).

Invariants and failure handling:
- Tags come from the transfer id, so the transfers of one pair may be posted in any
  order and run concurrently: a send meets the receive of the same id. Transfer ids
  are unique within a session (the prefill side numbers them).
- Every blocking step (store connect, rendezvous, header, payload) waits at most
  `timeout_s`. A failure raises KVTransferError naming the peer and the transfer, and is
  counted. The receiver writes a part into its cache only once that part's payload has
  arrived; a transfer that fails after some parts leaves those blocks written, which is
  safe because they are the request's own reserved blocks, published to the prefix cache
  only when the whole transfer arrived (Scheduler.commit_remote), recomputed or freed
  otherwise.
- A sender that cannot send (injected fault, or its prompt was aborted or preempted
  midway) sends a failure notice in place of the next part's header (`abandon`): the
  receiver fails that transfer at once and the group stays up.
- A group is never reused after an I/O failure (on a timeout gloo closes every
  connection of the group). The failing side drops it (its peer's pending or next
  operation then fails with "connection closed") and the next transfer on the pair
  makes a new group named `{session}/g{generation}`; each side advances the generation
  once per dead group, so both derive the same name.
"""


from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from cluster.host.rendezvous import StoreAddress, listening_store
from cluster.kv.transport import shm_slots, wire
from cluster.kv.transport.faults import FaultInjection
from cluster.kv.transport.interface import KVEndpoint, KVTransferError, KVTransport, Role
from cluster.kv.transport.packing import CacheGeometry, KVCaches, block_index, cache_geometry, pack_blocks, unpack_blocks

log = logging.getLogger(__name__)

PREFILL_RANK, DECODE_RANK = 0, 1
RECEIVING, GONE = b"r", b"g"  # a transfer key's marks
HANDSHAKE_POLL_S = 0.002  # the sender's look at the key while it waits for the receiver


class _TransferKeys:
    """The transfer handshake's keys in the decode side's store (module docstring). The
    sender deletes a key once it has read the receiver's mark (nobody reads it again); a key
    it marked gone stays 2 x timeout_s (a receiver arriving later still finds it), then the
    sender deletes it."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._gone: list[tuple[float, dist.Store, str]] = []  # (delete after, store, key)
        self._lock = threading.Lock()

    @staticmethod
    def key(session: str, transfer_id: int) -> str:
        return f"pdserve/kv/transfer/{session}/{transfer_id}"

    def await_receiver(self, store: dist.Store, key: str) -> bool:
        """Sender: True once the receiver marked the key; False (marked gone) if it did not
        within timeout_s."""
        self._forget_old()
        deadline = time.monotonic() + self.timeout_s
        while not store.check([key]):
            if time.monotonic() >= deadline:
                if store.compare_set(key, "", GONE) == RECEIVING:  # it came at the last moment
                    break
                with self._lock:
                    self._gone.append((time.monotonic() + 2 * self.timeout_s, store, key))
                return False
            time.sleep(HANDSHAKE_POLL_S)
        store.delete_key(key)  # (only the receiver marks a key this sender has not marked gone)
        return True

    @staticmethod
    def start_receiving(store: dist.Store, key: str) -> bool:
        """Receiver: mark the key; False if the sender gave up first."""
        return store.compare_set(key, "", RECEIVING) == RECEIVING

    def _forget_old(self) -> None:
        now = time.monotonic()
        with self._lock:
            old = [g for g in self._gone if g[0] <= now]
            self._gone = [g for g in self._gone if g[0] > now]
        for _, store, key in old:
            try:
                store.delete_key(key)
            except Exception as e:  # noqa: BLE001 - the decode side is gone: so is its store
                log.debug("could not delete transfer key %s: %s", key, e)


@dataclass(frozen=True)
class StoreEndpoint(KVEndpoint):
    """A TorchDistTransport's endpoint: its host, and the decode side's rendezvous store
    port or the prefill side's session (new per transport: a restarted worker gets fresh
    groups); `memory`: the shared memory it reads and writes payloads through (None: none)."""

    host: str
    store_port: int | None = None  # decode side
    session: str | None = None  # prefill side
    memory: str | None = None  # "<Ray node>/<shm_slots.memory_domain()>"


class _SenderFailed(Exception):
    """The sender's failure notice arrived in place of the data (the group is healthy)."""


# ---- process groups -----------------------------------------------------------------


def _new_process_group(store: dist.Store, rank: int, device: torch.device, timeout: timedelta, host: str):
    """A 2-rank group outside the default world; blocks until the peer joins (<= timeout)."""
    if device.type == "cuda":
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise KVTransferError("the KV cache is on CUDA but this torch build has no NCCL")
        nccl_options = dist.ProcessGroupNCCL.Options()
        nccl_options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, nccl_options)
    gloo_options = dist.ProcessGroupGloo._Options()
    gloo_options._timeout = timeout
    gloo_options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, 2, gloo_options)


def _shut_down(pg) -> None:
    """Abort a group (NCCL: frees the communicator; gloo: a no-op there, and its sockets
    close once the last reference is gone, which the caller drops)."""
    try:
        pg.abort()
    except Exception as e:  # best effort: the group is being discarded anyway
        log.debug("abort of a KV transport group failed: %s", e)


@dataclass(eq=False)
class _Pair:
    """Everything one side holds for one peer. `lock` serialises transfers and rebuilds."""

    peer_id: str
    session: str
    store_address: StoreAddress
    lock: threading.Lock = field(default_factory=threading.Lock)
    ready: threading.Event = field(default_factory=threading.Event)  # first build done (either way)
    store: dist.Store | None = None  # this pair's client of the decode side's TCPStore
    pg: object | None = None  # the live group, or None when (yet to be) (re)made
    generation: int = 0  # groups of this session that died; names the next one
    closed: bool = False
    last_used: float = field(default_factory=time.monotonic)  # start of the latest transfer


@dataclass
class _Counters:
    transfers_ok: int = 0
    transfers_failed: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds_sending: float = 0.0
    seconds_receiving: float = 0.0
    groups_created: int = 0
    send_attempts: int = 0
    transfers_shared_memory: int = 0  # of transfers_ok, those whose payload went through shared memory


class TorchDistTransport(KVTransport):
    """host: this worker's reachable address; the decode side's store and every gloo
    connection listen on it.
    shared_memory: a CPU payload to a decode worker that shares this worker's memory goes
    through a shared-memory file rather than the group's sockets.
    node_id: the Ray node this worker runs on. Workers share memory when they are on the
    same Ray node and see the same /dev/shm (shm_slots.memory_domain), never by IP alone:
    two Ray nodes on one machine move KV over the sockets, as Ray's own object stores do.
    """

    def __init__(
        self,
        role: Role,
        worker_id: str,
        device: torch.device | str,
        timeout_s: float = 30.0,
        host: str = "127.0.0.1",
        fault_injection: FaultInjection | None = None,
        idle_timeout_s: float = 600.0,
        shared_memory: bool = True,
        node_id: str = "",
    ):
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.role = role
        self.worker_id = worker_id
        self.device = torch.device(device)
        self.timeout_s = float(timeout_s)
        if idle_timeout_s <= timeout_s:
            raise ValueError("idle_timeout_s must exceed timeout_s (a transfer in flight is never idle)")
        self.idle_timeout_s = float(idle_timeout_s)
        self.host = host
        self.shared_memory = shared_memory and self.device.type == "cpu" and shm_slots.available()
        self._memory = self._memory_domain(node_id) if self.shared_memory else None
        self.shared_memory = self._memory is not None
        self._slots = shm_slots.SlotPool() if self.shared_memory and role == "prefill" else None
        self._views = shm_slots.SlotViews() if role == "decode" else None
        if self._slots is not None:
            shm_slots.sweep_dead_senders()
        self._timeout = timedelta(seconds=timeout_s)
        self._keys = _TransferKeys(self.timeout_s)
        self._faults = fault_injection or FaultInjection()
        self._rank = PREFILL_RANK if role == "prefill" else DECODE_RANK
        self._lock = threading.Lock()  # guards _pairs, _counters, _closed
        self._pairs: dict[str, _Pair] = {}
        self._counters = _Counters()
        self._closed = False
        self._store: dist.TCPStore | None = None
        self._session = None
        if role == "decode":
            self._store = listening_store(host, self._timeout)
        else:
            self._session = uuid.uuid4().hex[:8]

    def _memory_domain(self, node_id: str) -> str | None:
        try:
            return f"{node_id}/{shm_slots.memory_domain()}"
        except OSError as e:
            log.warning("%s: no shared memory for KV transfers (%s); sending over sockets", self.worker_id, e)
            return None

    @property
    def endpoint(self) -> StoreEndpoint:
        if self._store is not None:
            return StoreEndpoint(self.host, store_port=self._store.port, memory=self._memory)
        return StoreEndpoint(self.host, session=self._session, memory=self._memory)

    # ---- groups ---------------------------------------------------------------------

    def connect(self, peer_id: str, peer: KVEndpoint) -> None:
        self._ensure_group(peer_id, peer)

    def _ensure_group(self, peer_id: str, peer: KVEndpoint) -> None:
        """Make the group with `peer_id` unless it exists for the pair's session (the prefill
        side's); blocks until the peer joins too (<= timeout_s) and raises KVTransferError if
        it does not. A new session replaces the peer's old group. Later calls with the same
        session return once the first one is done, without raising: should the group be
        down, the next transfer remakes it."""
        if not isinstance(peer, StoreEndpoint):
            raise KVTransferError(f"{self.worker_id}: {peer_id!r}'s endpoint {peer!r} is not a torch.distributed one")
        if self.role == "prefill":
            store_address, session = (peer.host, peer.store_port), self._session
        else:
            store_address, session = (self.host, self._store.port), peer.session
        if store_address[1] is None or session is None:
            raise KVTransferError(f"{self.worker_id}: {peer_id!r}'s endpoint {peer!r} is not a {self._peer_role()}'s")
        self._reap_idle()
        pair, created, replaced = self._register(peer_id, tuple(store_address), session)
        if replaced is not None:
            self._discard(replaced)
        if created:
            try:
                with pair.lock:
                    self._connect(pair, session)
            finally:
                pair.ready.set()
            return
        if not pair.ready.wait(self.timeout_s):
            raise KVTransferError(f"{self.worker_id}: timed out waiting for another thread's group with {peer_id!r}")

    def _reap_idle(self) -> None:
        """Tear down groups with peers that sent nothing for idle_timeout_s: replicas that
        went away (scaled down, restarted) leave no sockets or threads behind."""
        now = time.monotonic()
        with self._lock:
            idle = [p for p in self._pairs.values() if now - p.last_used > self.idle_timeout_s]
            for pair in idle:
                del self._pairs[pair.peer_id]
        for pair in idle:
            log.info("%s: closing the KV group with idle peer %s", self.worker_id, pair.peer_id)
            self._discard(pair)

    def close(self) -> None:
        """Tear down every group and stop the store. The transport is unusable afterwards."""
        with self._lock:
            self._closed = True
            pairs, self._pairs = list(self._pairs.values()), {}
            store, self._store = self._store, None
        for pair in pairs:
            self._discard(pair)
        del store  # the TCPStore server stops when its last reference goes
        for shared in (self._slots, self._views):
            if shared is not None:
                shared.close()

    # ---- transfers ------------------------------------------------------------------

    def send(
        self, peer_id: str, peer: KVEndpoint, kv_caches: KVCaches, block_ids: Sequence[int], transfer_id: int, first: int = 0,
        total: int | None = None,
    ) -> None:
        self._require_role("prefill", "send")
        start = time.perf_counter()
        geometry = cache_geometry(kv_caches)
        block_index(block_ids, geometry.num_blocks, geometry.device, unique=False)  # ValueError before any I/O
        total = first + len(block_ids) if total is None else total
        if not 0 <= first <= first + len(block_ids) <= total:
            raise ValueError(f"part [{first}, {first + len(block_ids)}) is not within a transfer of {total} blocks")
        self._ensure_group(peer_id, peer)
        pair = self._pair_for_transfer(peer_id, transfer_id)
        if first == 0:
            self._await_receiver(pair, transfer_id)
        pg, failure, shared = None, None, False
        try:
            pg = self._live_group(pair)
            if self._fault_selected(transfer_id, first):
                # Tell the receiver at once instead of letting it wait out its timeout.
                self._send_notice(pg, transfer_id, first, total, geometry)
                self._count(transfers_failed=1)
                failure = KVTransferError(f"{self.worker_id}: injected fault: transfer {transfer_id} with {peer_id!r} not sent")
            else:
                shared = self._slots is not None and self._shares_memory_with(peer) and len(block_ids) > 0
                shared = shared and self._send_shared(pg, kv_caches, block_ids, geometry, transfer_id, first, total)
                if not shared:
                    header = wire.header(transfer_id, first, len(block_ids), total, geometry)  # [13]
                    self._send_once(pg, header, pack_blocks(kv_caches, block_ids), transfer_id)
        except Exception as e:
            failure = self._failed(pair, pg, transfer_id, "send", e)
        pg = None  # the last reference to a dropped group goes: gloo closes its sockets now
        if failure is not None:
            raise failure  # outside `except`: see _failed
        last = first + len(block_ids) == total
        self._count(
            transfers_ok=int(last), transfers_shared_memory=int(shared and last),
            bytes_sent=geometry.packed_nbytes(len(block_ids)), seconds_sending=time.perf_counter() - start,
        )

    def abandon(self, peer_id: str, peer: KVEndpoint, kv_caches: KVCaches, transfer_id: int, first: int, total: int) -> None:
        self._require_role("prefill", "abandon")
        self._ensure_group(peer_id, peer)
        pair = self._pair_for_transfer(peer_id, transfer_id)
        if first == 0:
            self._await_receiver(pair, transfer_id)
        pg, failure = None, None
        try:
            pg = self._live_group(pair)
            self._send_notice(pg, transfer_id, first, total, cache_geometry(kv_caches))
        except Exception as e:
            failure = self._failed(pair, pg, transfer_id, "abandon", e)
        pg = None
        self._count(transfers_failed=int(failure is None))  # (_failed counted the other case)

    def _await_receiver(self, pair: _Pair, transfer_id: int) -> None:
        """Before a transfer's first operation on the group: its receiver has begun (the
        handshake), else KVTransferError, the group untouched."""
        try:
            began = self._keys.await_receiver(self._pair_store(pair), self._keys.key(self._session, transfer_id))
            problem = None if began else f"no receive began within {self.timeout_s}s"
        except Exception as e:  # noqa: BLE001 - the store is the peer's: it died, or is closing
            problem = f"the handshake failed: {e}"
        if problem is not None:
            self._count(transfers_failed=1)
            raise KVTransferError(f"{self.worker_id}: transfer {transfer_id} to {pair.peer_id!r}: {problem}; nothing was sent")

    def _send_notice(self, pg, transfer_id: int, first: int, total: int, geometry: CacheGeometry) -> None:
        notice = wire.header(transfer_id, first, 0, total, geometry, wire.FAILED_MAGIC)
        self._wait(pg.send([notice], DECODE_RANK, wire.tags(transfer_id)[0]), "failure notice send")

    def receive(self, peer_id: str, peer: KVEndpoint, kv_caches: KVCaches, block_ids: Sequence[int], transfer_id: int) -> None:
        """(Also KVTransferError if the peer sent a different transfer than this one.)"""
        self._require_role("decode", "receive")
        start = time.perf_counter()
        geometry = cache_geometry(kv_caches)
        block_index(block_ids, geometry.num_blocks, geometry.device, unique=True)  # ValueError before any I/O
        self._ensure_group(peer_id, peer)
        pair = self._pair_for_transfer(peer_id, transfer_id)
        key = self._keys.key(pair.session, transfer_id)
        if not self._keys.start_receiving(self._store, key):
            self._count(transfers_failed=1)
            raise KVTransferError(f"{self.worker_id}: transfer {transfer_id} from {peer_id!r}: the sender gave up before "
                                  f"this receive began")
        pg, failure, shared = None, None, True
        try:
            pg = self._live_group(pair)
            received = 0
            while True:  # parts until every block is in (a transfer of no blocks is one empty part)
                n, part_shared = self._recv_part(pg, transfer_id, received, kv_caches, block_ids, geometry)
                received, shared = received + n, shared and part_shared
                if received == len(block_ids):
                    break
        except _SenderFailed as e:  # the group is fine; only this transfer failed
            self._count(transfers_failed=1)
            failure = KVTransferError(f"{self.worker_id}: transfer {transfer_id} from {peer_id!r} failed at the sender: {e}")
        except Exception as e:
            failure = self._failed(pair, pg, transfer_id, "receive", e)
        pg = None  # the last reference to a dropped group goes: gloo closes its sockets now
        if failure is not None:
            raise failure  # outside `except`: see _failed
        self._count(
            transfers_ok=1, transfers_shared_memory=int(shared), bytes_received=geometry.packed_nbytes(len(block_ids)),
            seconds_receiving=time.perf_counter() - start,
        )

    # ---- stats ----------------------------------------------------------------------

    def stats(self) -> dict[str, float | int]:
        """Counters since construction. seconds_*: wall time inside successful calls
        (packing and waiting for the peer included); groups: groups open now."""
        with self._lock:
            c = self._counters
            return {
                "transfers_ok": c.transfers_ok,
                "transfers_failed": c.transfers_failed,
                "bytes_sent": c.bytes_sent,
                "bytes_received": c.bytes_received,
                "seconds_sending": c.seconds_sending,
                "seconds_receiving": c.seconds_receiving,
                "groups": sum(p.pg is not None for p in self._pairs.values()),
                "groups_created": c.groups_created,
                "transfers_shared_memory": c.transfers_shared_memory,
            }

    # ---- internals ------------------------------------------------------------------

    def _register(self, peer_id: str, store_address: StoreAddress, session: str) -> tuple[_Pair, bool, _Pair | None]:
        """(pair for peer/session, whether this call made it, the pair it replaced)."""
        with self._lock:
            self._check_open()
            old = self._pairs.get(peer_id)
            if old is not None and old.session == session:
                return old, False, None
            pair = _Pair(peer_id, session, store_address)
            self._pairs[peer_id] = pair
            return pair, True, old

    def _pair_for_transfer(self, peer_id: str, transfer_id: int) -> _Pair:
        with self._lock:
            self._check_open()
            pair = self._pairs.get(peer_id)
            if pair is None:
                self._counters.transfers_failed += 1
            else:
                pair.last_used = time.monotonic()
        if pair is None:
            raise KVTransferError(f"{self.worker_id}: transfer {transfer_id}: no group with {peer_id!r} (it was closed)")
        return pair

    def _live_group(self, pair: _Pair):
        """The pair's group, remade under the next generation's name if the last one died.
        Both sides drop a dead group exactly once (see _failed), so they agree on the name."""
        with pair.lock:
            if pair.closed:
                raise KVTransferError(f"peer {pair.peer_id!r} was closed")
            if pair.pg is None:
                name = f"{pair.session}/g{pair.generation}"
                log.warning("%s: remaking KV group with %s as %r", self.worker_id, pair.peer_id, name)
                self._connect(pair, name)
            return pair.pg

    def _connect(self, pair: _Pair, group_name: str) -> None:
        """Rendezvous a new group for `pair` under `group_name`. Caller holds pair.lock."""
        prefill_id, decode_id = (self.worker_id, pair.peer_id) if self.role == "prefill" else (pair.peer_id, self.worker_id)
        prefix = f"pdserve/kv/{prefill_id}/{decode_id}/{group_name}"
        try:
            store = dist.PrefixStore(prefix, self._pair_store(pair))
            pg = _new_process_group(store, self._rank, self.device, self._timeout, self.host)
        except Exception as e:
            raise KVTransferError(f"{self.worker_id}: no group with {pair.peer_id!r} (rendezvous {prefix!r}): {e}") from e
        if pair.closed:  # the pair was discarded (replaced, reaped, closed) while we waited for the peer
            _shut_down(pg)
            raise KVTransferError(f"{self.worker_id}: peer {pair.peer_id!r} was closed during the rendezvous")
        pair.pg = pg
        self._count(groups_created=1)

    def _pair_store(self, pair: _Pair) -> dist.Store:
        """A store client of the pair's own, kept across rebuilds: a TCPStore object runs one
        request at a time, so rendezvous sharing one would wait for each other."""
        if pair.store is None:
            host, port = pair.store_address
            pair.store = dist.TCPStore(host, port, is_master=False, timeout=self._timeout)
        return pair.store

    def _send_once(self, pg, header: torch.Tensor, packed: torch.Tensor, transfer_id: int) -> None:
        header_tag, payload_tag = wire.tags(transfer_id)
        self._wait(pg.send([header], DECODE_RANK, header_tag), "header send")
        if packed.numel():
            self._wait(pg.send([packed], DECODE_RANK, payload_tag), "payload send")

    def _recv_part(
        self, pg, transfer_id: int, first: int, kv_caches: KVCaches, block_ids: Sequence[int], geometry: CacheGeometry
    ) -> tuple[int, bool]:
        """Receive the part that starts at block `first` and write its blocks; returns (its
        blocks, whether it came through shared memory). Its header must be the expected one
        (but for the path's magic, the slot and the part's size, which must fit)."""
        header_tag, payload_tag = wire.tags(transfer_id)
        total = len(block_ids)
        header = torch.empty(wire.HEADER_WORDS, dtype=torch.int64)  # [13]
        self._wait(pg.recv([header], PREFILL_RANK, header_tag), "header recv")
        magic, n, slot = int(header[0]), int(header[wire.NUM_BLOCKS]), tuple(header[wire.CHECKED:].tolist())
        if magic == wire.FAILED_MAGIC:
            raise _SenderFailed(f"the sender reported it could not send (at block {first} of {total})")
        expected = wire.header(transfer_id, first, n, total, geometry)
        header[0] = wire.MAGIC if magic == wire.SHM_MAGIC else magic
        if not torch.equal(header[:wire.CHECKED], expected[:wire.CHECKED]) or not (0 < n <= total - first or n == total == 0):
            raise KVTransferError(f"unexpected transfer header: {wire.header_mismatch(expected, header)} (part of {n} blocks)")
        part, shape = block_ids[first : first + n], geometry.packed_shape(n)
        if magic == wire.SHM_MAGIC:
            done = torch.zeros(1, dtype=torch.int64)
            try:
                unpack_blocks(kv_caches, part, shm_slots.view_as(self._views.view(*slot), shape, geometry.dtype))
                done[0] = 1
            except Exception:
                self._views.forget(*slot)
                raise
            finally:  # the sender waits for this word before it reuses (or drops) the slot
                self._wait(pg.send([done], PREFILL_RANK, payload_tag), "shared-memory ack send")
            return n, True
        packed = torch.empty(shape, dtype=geometry.dtype, device=geometry.device)
        if packed.numel():
            self._wait(pg.recv([packed], PREFILL_RANK, payload_tag), "payload recv")
        unpack_blocks(kv_caches, part, packed)
        return n, False

    def _shares_memory_with(self, peer: StoreEndpoint) -> bool:
        return self.shared_memory and peer.memory is not None and peer.memory == self._memory

    def path_to(self, peer: KVEndpoint) -> str:
        if self.device.type != "cpu":
            return "nccl"
        return "shared_memory" if self._shares_memory_with(peer) else "sockets"

    def _send_shared(
        self, pg, kv_caches: KVCaches, block_ids: Sequence[int], geometry: CacheGeometry, transfer_id: int, first: int, total: int
    ) -> bool:
        """Pack into a shared-memory slot, announce it, wait for the receiver's ack. False
        (nothing sent) when no slot can be had: the caller sends over the sockets."""
        n = len(block_ids)
        try:
            slot = self._slots.take(geometry.packed_nbytes(n))
        except OSError as e:
            log.warning("%s: no shared memory for KV transfers (%s); sending over sockets", self.worker_id, e)
            self.shared_memory = False
            return False
        try:
            pack_blocks(kv_caches, block_ids, out=shm_slots.view_as(slot.data, geometry.packed_shape(n), geometry.dtype))
            header_tag, payload_tag = wire.tags(transfer_id)
            header = wire.header(transfer_id, first, n, total, geometry, wire.SHM_MAGIC, (slot.pid, slot.index, slot.capacity))
            self._wait(pg.send([header], DECODE_RANK, header_tag), "header send")
            done = torch.zeros(1, dtype=torch.int64)
            self._wait(pg.recv([done], DECODE_RANK, payload_tag), "shared-memory ack recv")
            if int(done[0]) != 1:
                raise KVTransferError("the receiver could not read the shared-memory payload")
        except BaseException:
            self._slots.drop(slot)  # the receiver may still be reading it: never reuse it
            raise
        self._slots.give(slot)
        return True

    def _wait(self, work, what: str) -> None:
        if not work.wait(self._timeout):
            raise KVTransferError(f"{what} timed out after {self.timeout_s}s")

    def _failed(self, pair: _Pair, pg, transfer_id: int, action: str, error: Exception) -> KVTransferError:
        """Count a failed transfer and drop the group it ran on; returns the error to raise.

        The caller raises it after leaving its `except` block, unchained: a traceback would
        keep the failed group's frames, hence the group, alive, and gloo closes a group's
        sockets (which tells the peer at once) only when its last reference goes."""
        self._drop_group(pair, pg)
        self._count(transfers_failed=1)
        message = f"{self.worker_id}: {action} of transfer {transfer_id} with {pair.peer_id!r} failed: {error}"
        log.warning("%s", message)
        return KVTransferError(message)

    def _drop_group(self, pair: _Pair, pg=None) -> None:
        """Drop the pair's group if `pg` is still it (or unconditionally when pg is None).
        Several transfers may fail on one dead group: only the first drop counts, so the
        generation advances once per dead group on each side."""
        with pair.lock:
            if pair.pg is None or (pg is not None and pair.pg is not pg):
                return
            dead, pair.pg = pair.pg, None
            pair.generation += 1
        _shut_down(dead)

    def _discard(self, pair: _Pair) -> None:
        pair.closed = True
        self._drop_group(pair)
        pair.store = None
        pair.ready.set()

    def _fault_selected(self, transfer_id: int, first: int) -> bool:
        with self._lock:
            self._counters.send_attempts += 1
            return self._faults.selects(transfer_id, self._counters.send_attempts, first)

    def _count(self, **increments: float) -> None:
        with self._lock:
            for name, value in increments.items():
                setattr(self._counters, name, getattr(self._counters, name) + value)

    def _check_open(self) -> None:
        if self._closed:
            raise KVTransferError(f"{self.worker_id}: transport is closed")

    def _peer_role(self) -> Role:
        return "decode" if self.role == "prefill" else "prefill"

    def _require_role(self, role: Role, method: str) -> None:
        if self.role != role:
            raise RuntimeError(f"{method} is for the {role} side; this transport is {self.role}")
