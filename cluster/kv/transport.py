r"""KV transport: moves KV-cache blocks from a prefill worker to a decode worker.

Bulk data only. Control (which request, which blocks, in which order) travels over Ray
calls. Each (prefill, decode) pair gets its own torch.distributed process group, made
lazily from a TCPStore rendezvous that the decode worker hosts, outside the default
world (`init_process_group` is never called): workers come and go as tiers scale.
ProcessGroupGloo when the KV cache is on CPU, ProcessGroupNCCL when it is on CUDA;
the rest of the code is the same.

    prefill P (rank 0)                          decode D (rank 1, hosts the TCPStore)
    ------------------                          -------------------------------------
                    <--- D.address, session s (control plane) ---
    ensure_group(D, D.address, s)               ensure_group(P, D.address, s)
          \_____ rendezvous under "pdserve/kv/P/D/s"; both block until both joined ___/
    send_blocks(D, caches, src_ids, t)          recv_blocks(P, caches, dst_ids, t)
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
(cluster/kv/shm_slots.py: files kept mapped on both sides and reused), sends a header
with the shared-memory magic that names the slot, and waits for the receiver's
one-word ack, which comes after the receiver has unpacked the slot into its cache: one
copy on each side, no socket copies, no page faults. After a failure the slot is
dropped, never reused.

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
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from cluster.host.openmp import serial_torch
from cluster.host.rendezvous import StoreAddress, listening_store
from cluster.kv import shm_slots

log = logging.getLogger(__name__)

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k, v), each [num_blocks, bs, Hk, D]
Role = Literal["prefill", "decode"]

PREFILL_RANK, DECODE_RANK = 0, 1
_MAGIC = 0x4B565846  # "KVXF"
_FAILED_MAGIC = 0x4B564641  # "KVFA": the sender could not send this transfer
_SHM_MAGIC = 0x4B56534D  # "KVSM": the payload waits in a shared-memory slot


def _tags(transfer_id: int) -> tuple[int, int]:
    """(header tag, payload tag): unique per transfer, so concurrent transfers of one pair
    match by id, not by the order the two sides post them in."""
    return 2 * transfer_id, 2 * transfer_id + 1
_HEADER_FIELDS = ("magic", "transfer_id", "first", "num_blocks", "total", "num_layers", "block_size", "num_kv_heads", "head_dim",
                  "dtype")
_NUM_BLOCKS = _HEADER_FIELDS.index("num_blocks")  # the part's own count: the receiver reads it
_CHECKED = len(_HEADER_FIELDS)  # then the slot's (pid, index, capacity): shared memory only


class KVTransferError(RuntimeError):
    """A transfer, or the process group it needs, failed or timed out."""


class _SenderFailed(Exception):
    """The sender's failure notice arrived in place of the data (the group is healthy)."""


@dataclass(frozen=True)
class FaultInjection:
    """Transfers the SENDER fails on purpose (a broken link): before sending anything, or,
    with `midway`, at their second part (after the first one went through)."""

    fail_transfer_ids: frozenset[int] = frozenset()
    fail_every_nth: int = 0  # 0: off; n: every n-th send_blocks call of this transport
    midway: bool = False

    @classmethod
    def of(cls, transport) -> FaultInjection:
        """The faults a TransportConfig (cluster/config.py) asks for."""
        return cls(frozenset(transport.fail_transfer_ids), transport.fail_every_nth, transport.fail_midway)

    def selects(self, transfer_id: int, attempt: int, first: int = 0) -> bool:
        """attempt: 1-based count of send_blocks calls on this transport; first: the part's
        first block within its transfer."""
        if self.midway and first == 0:
            return False
        every = self.fail_every_nth
        return transfer_id in self.fail_transfer_ids or (every > 0 and attempt % every == 0)


# ---- packing ------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheGeometry:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def packed_shape(self, n: int) -> tuple[int, ...]:
        return (self.num_layers, 2, n, self.block_size, self.num_kv_heads, self.head_dim)

    def packed_nbytes(self, n: int) -> int:
        return torch.Size(self.packed_shape(n)).numel() * self.dtype.itemsize


def cache_geometry(kv_caches: KVCaches) -> CacheGeometry:
    """The shared shape of all layers' K and V caches; ValueError if they differ."""
    if not kv_caches:
        raise ValueError("kv_caches is empty")
    k0 = kv_caches[0][0]
    if k0.dim() != 4:
        raise ValueError(f"cache tensors must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k0.shape)}")
    for layer, (k, v) in enumerate(kv_caches):
        for t in (k, v):
            if t.shape != k0.shape or t.dtype != k0.dtype or t.device != k0.device:
                raise ValueError(
                    f"layer {layer}: cache {tuple(t.shape)} {t.dtype} on {t.device} differs from layer 0's "
                    f"{tuple(k0.shape)} {k0.dtype} on {k0.device}"
                )
    num_blocks, block_size, num_kv_heads, head_dim = k0.shape
    return CacheGeometry(len(kv_caches), num_blocks, block_size, num_kv_heads, head_dim, k0.dtype, k0.device)


def _block_index(block_ids: Sequence[int], num_blocks: int, device: torch.device, unique: bool) -> torch.Tensor:
    ids = [int(b) for b in block_ids]
    bad = [b for b in ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"block ids {bad} out of range [0, {num_blocks})")
    if unique and len(set(ids)) != len(ids):
        raise ValueError(f"duplicate destination block ids in {ids}")
    return torch.tensor(ids, dtype=torch.long, device=device)  # [n]


def pack_blocks(kv_caches: KVCaches, block_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy the given blocks of every layer into one contiguous [L, 2, n, bs, Hk, D] tensor
    (`out`, when given: e.g. a shared-memory file's)."""
    geometry = cache_geometry(kv_caches)
    idx = _block_index(block_ids, geometry.num_blocks, geometry.device, unique=False)  # [n]
    packed = out if out is not None else torch.empty(geometry.packed_shape(len(idx)), dtype=geometry.dtype, device=geometry.device)
    with serial_torch():  # a transfer's thread, not the engine's: no OpenMP team of its own
        for layer, (k, v) in enumerate(kv_caches):  # k, v: [num_blocks, bs, Hk, D]
            torch.index_select(k, 0, idx, out=packed[layer, 0])  # packed[layer, 0]: [n, bs, Hk, D]
            torch.index_select(v, 0, idx, out=packed[layer, 1])
    return packed


def unpack_blocks(kv_caches: KVCaches, block_ids: Sequence[int], packed: torch.Tensor) -> None:
    """Write packed [L, 2, n, bs, Hk, D] into the given blocks of every layer, in place."""
    geometry = cache_geometry(kv_caches)
    idx = _block_index(block_ids, geometry.num_blocks, geometry.device, unique=True)  # [n]
    expected = geometry.packed_shape(len(idx))
    if tuple(packed.shape) != expected or packed.dtype != geometry.dtype or packed.device != geometry.device:
        raise ValueError(
            f"packed {tuple(packed.shape)} {packed.dtype} on {packed.device} does not fit {len(idx)} blocks "
            f"of this cache: expected {expected} {geometry.dtype} on {geometry.device}"
        )
    with serial_torch():
        for layer, (k, v) in enumerate(kv_caches):
            k.index_copy_(0, idx, packed[layer, 0])
            v.index_copy_(0, idx, packed[layer, 1])


# ---- wire header --------------------------------------------------------------------


def _dtype_code(dtype: torch.dtype) -> int:
    return zlib.crc32(str(dtype).encode())  # the same in every process


def _header(
    transfer_id: int, first: int, n: int, total: int, geometry: CacheGeometry, magic: int = _MAGIC,
    slot: tuple[int, int, int] = (0, 0, 0),
) -> torch.Tensor:
    g = geometry
    values = [magic, transfer_id, first, n, total, g.num_layers, g.block_size, g.num_kv_heads, g.head_dim, _dtype_code(g.dtype),
              *slot]
    return torch.tensor(values, dtype=torch.int64, device=g.device)  # header: [13]


def _header_mismatch(expected: torch.Tensor, got: torch.Tensor) -> str:
    pairs = zip(_HEADER_FIELDS, expected.tolist(), got.tolist())
    return ", ".join(f"{name} {g} (expected {e})" for name, e, g in pairs if e != g)


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


class KVTransport:
    """One per worker. Thread-safe; transfers with different peers may run concurrently.

    host: this worker's reachable address; the decode side's store and every gloo
    connection listen on it.
    shared_memory: a CPU payload to a decode worker on this host goes through a
    shared-memory file rather than the group's sockets.
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
        self._slots = shm_slots.SlotPool() if self.shared_memory and role == "prefill" else None
        self._views = shm_slots.SlotViews() if role == "decode" else None
        if self._slots is not None:
            shm_slots.sweep_dead_senders()
        self._timeout = timedelta(seconds=timeout_s)
        self._faults = fault_injection or FaultInjection()
        self._rank = PREFILL_RANK if role == "prefill" else DECODE_RANK
        self._lock = threading.Lock()  # guards _pairs, _counters, _closed
        self._pairs: dict[str, _Pair] = {}
        self._counters = _Counters()
        self._closed = False
        self._store: dist.TCPStore | None = None
        if role == "decode":
            self._store = listening_store(host, self._timeout)

    @property
    def address(self) -> StoreAddress | None:
        """The rendezvous store's (host, port) on the decode side; None on the prefill side."""
        return (self.host, self._store.port) if self._store is not None else None

    # ---- groups ---------------------------------------------------------------------

    def ensure_group(self, peer_id: str, store_address: StoreAddress, session: str) -> None:
        """Make the group with `peer_id` for `session` unless it exists; blocks until the
        peer joins too (<= timeout_s) and raises KVTransferError if it does not. A new
        session replaces the peer's old group. Later calls with the same session return
        once the first one is done, without raising: should the group be down, the next
        transfer remakes it. The decode side passes its own address (ignored there)."""
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

    def close_peer(self, peer_id: str) -> None:
        """Forget a peer and tear its group down (idempotent). A transfer in flight with it
        fails within its timeout."""
        with self._lock:
            pair = self._pairs.pop(peer_id, None)
        if pair is not None:
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

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- transfers ------------------------------------------------------------------

    def send_blocks(
        self, peer_id: str, kv_caches: KVCaches, block_ids: Sequence[int], transfer_id: int, first: int = 0,
        total: int | None = None,
    ) -> None:
        """Send blocks `block_ids` of `kv_caches` to decode worker `peer_id`: blocks [first,
        first + len) of transfer `transfer_id`, which has `total` blocks in all (default:
        these are all of them); returns once the peer has them. The parts of one transfer go
        in order. KVTransferError on failure or timeout."""
        self._require_role("prefill", "send_blocks")
        start = time.perf_counter()
        geometry = cache_geometry(kv_caches)
        _block_index(block_ids, geometry.num_blocks, geometry.device, unique=False)  # ValueError before any I/O
        total = first + len(block_ids) if total is None else total
        if not 0 <= first <= first + len(block_ids) <= total:
            raise ValueError(f"part [{first}, {first + len(block_ids)}) is not within a transfer of {total} blocks")
        pair = self._pair_for_transfer(peer_id, transfer_id)
        pg, failure, shared = None, None, False
        try:
            pg = self._live_group(pair)
            if self._fault_selected(transfer_id, first):
                # Tell the receiver at once instead of letting it wait out its timeout.
                self._send_notice(pg, transfer_id, first, total, geometry)
                self._count(transfers_failed=1)
                failure = KVTransferError(f"{self.worker_id}: injected fault: transfer {transfer_id} with {peer_id!r} not sent")
            else:
                shared = self._on_this_host(pair) and len(block_ids) > 0
                shared = shared and self._send_shared(pg, kv_caches, block_ids, geometry, transfer_id, first, total)
                if not shared:
                    header = _header(transfer_id, first, len(block_ids), total, geometry)  # [13]
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

    def abandon(self, peer_id: str, kv_caches: KVCaches, transfer_id: int, first: int, total: int) -> None:
        """End transfer `transfer_id` before its blocks from `first` on (its prompt was
        aborted or preempted): the receiver's wait for them fails at once. Best effort: a
        group that is down already fails the receiver anyway."""
        self._require_role("prefill", "abandon")
        pair = self._pair_for_transfer(peer_id, transfer_id)
        pg, failure = None, None
        try:
            pg = self._live_group(pair)
            self._send_notice(pg, transfer_id, first, total, cache_geometry(kv_caches))
        except Exception as e:
            failure = self._failed(pair, pg, transfer_id, "abandon", e)
        pg = None
        self._count(transfers_failed=int(failure is None))  # (_failed counted the other case)

    def _send_notice(self, pg, transfer_id: int, first: int, total: int, geometry: CacheGeometry) -> None:
        notice = _header(transfer_id, first, 0, total, geometry, _FAILED_MAGIC)
        self._wait(pg.send([notice], DECODE_RANK, _tags(transfer_id)[0]), "failure notice send")

    def recv_blocks(self, peer_id: str, kv_caches: KVCaches, block_ids: Sequence[int], transfer_id: int) -> None:
        """Receive transfer `transfer_id` from prefill worker `peer_id` into blocks
        `block_ids` of `kv_caches`, in as many parts as the sender makes of it. KVTransferError
        on failure, timeout, or if the peer sent a different transfer; the blocks of the parts
        that arrived before it hold their KV, the others are untouched."""
        self._require_role("decode", "recv_blocks")
        start = time.perf_counter()
        geometry = cache_geometry(kv_caches)
        _block_index(block_ids, geometry.num_blocks, geometry.device, unique=True)  # ValueError before any I/O
        pair = self._pair_for_transfer(peer_id, transfer_id)
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
            raise KVTransferError(f"{self.worker_id}: transfer {transfer_id}: no group with {peer_id!r}; call ensure_group first")
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
        if pair.closed:  # close_peer ran while we waited for the peer
            _shut_down(pg)
            raise KVTransferError(f"{self.worker_id}: peer {pair.peer_id!r} was closed during the rendezvous")
        pair.pg = pg
        self._count(groups_created=1)

    def _pair_store(self, pair: _Pair) -> dist.Store:
        """A store client of the pair's own, kept across rebuilds: a TCPStore object runs one
        request at a time, so rendezvous sharing one would wait for each other."""
        if pair.store is None:
            host, port = self.address if self.role == "decode" else pair.store_address
            pair.store = dist.TCPStore(host, port, is_master=False, timeout=self._timeout)
        return pair.store

    def _send_once(self, pg, header: torch.Tensor, packed: torch.Tensor, transfer_id: int) -> None:
        header_tag, payload_tag = _tags(transfer_id)
        self._wait(pg.send([header], DECODE_RANK, header_tag), "header send")
        if packed.numel():
            self._wait(pg.send([packed], DECODE_RANK, payload_tag), "payload send")

    def _recv_part(
        self, pg, transfer_id: int, first: int, kv_caches: KVCaches, block_ids: Sequence[int], geometry: CacheGeometry
    ) -> tuple[int, bool]:
        """Receive the part that starts at block `first` and write its blocks; returns (its
        blocks, whether it came through shared memory). Its header must be the expected one
        (but for the path's magic, the slot and the part's size, which must fit)."""
        header_tag, payload_tag = _tags(transfer_id)
        total = len(block_ids)
        header = torch.empty(len(_HEADER_FIELDS) + 3, dtype=torch.int64)  # [13]
        self._wait(pg.recv([header], PREFILL_RANK, header_tag), "header recv")
        magic, n, slot = int(header[0]), int(header[_NUM_BLOCKS]), tuple(header[_CHECKED:].tolist())
        if magic == _FAILED_MAGIC:
            raise _SenderFailed(f"the sender reported it could not send (at block {first} of {total})")
        expected = _header(transfer_id, first, n, total, geometry)
        header[0] = _MAGIC if magic == _SHM_MAGIC else magic
        if not torch.equal(header[:_CHECKED], expected[:_CHECKED]) or not (0 < n <= total - first or n == total == 0):
            raise KVTransferError(f"unexpected transfer header: {_header_mismatch(expected, header)} (part of {n} blocks)")
        part, shape = block_ids[first : first + n], geometry.packed_shape(n)
        if magic == _SHM_MAGIC:
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

    def _on_this_host(self, pair: _Pair) -> bool:
        return self._slots is not None and self.shared_memory and pair.store_address[0] == self.host

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
            header_tag, payload_tag = _tags(transfer_id)
            header = _header(transfer_id, first, n, total, geometry, _SHM_MAGIC, (slot.pid, slot.index, slot.capacity))
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

    def _require_role(self, role: Role, method: str) -> None:
        if self.role != role:
            raise RuntimeError(f"{method} is for the {role} side; this transport is {self.role}")
