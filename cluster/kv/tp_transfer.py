"""A KV hand-off between a prefill replica of p tensor-parallel ranks and a decode replica
of d ranks, for any p and d the model's KV heads allow (cluster/model/sharding.py).

    kv_routes(Hk, p, d) -> pieces (src rank, dst rank, KV heads [start, stop))

Each piece is one ordinary transfer (cluster/kv/transport/) between the two ranks'
own transports, of a head slice of the same blocks (in one part or several, as the
prompt computes: every rank sends each part of its pieces in turn): the source packs the piece's heads
out of its cache shard, the destination writes them into its shard. Every rank moves
its own pieces, all at once, so nothing is gathered through one rank. Block ids are the
same on every rank of a replica (rank 0's block table), and the transfer id is the
same for every piece: at most one piece joins a pair of ranks, so tags stay unique.

With p = d = 1 this is one piece of all heads between the two workers' rank 0: the
transfer of a single-device replica, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from cluster.kv.transport.interface import KVEndpoint, KVTransport
from cluster.kv.transport.packing import KVCaches
from cluster.model.sharding import HeadRoute


def rank_peer_id(worker_id: str, rank: int) -> str:
    """The transport identity of a worker's rank (rank 0 is the worker itself)."""
    return worker_id if rank == 0 else f"{worker_id}/rank{rank}"


def head_view(kv_caches: KVCaches, kv_head_start: int, route: HeadRoute) -> KVCaches:
    """Views of this rank's caches holding only the piece's heads (no copy)."""
    lo, hi = route.start - kv_head_start, route.stop - kv_head_start
    return [(k[:, :, lo:hi], v[:, :, lo:hi]) for k, v in kv_caches]


@dataclass(frozen=True)
class Part:
    """Which blocks of a transfer a send carries: `block_ids` (the sender's) are blocks
    [first, first + len) of the `total` the decode side receives. A transfer goes in one
    part or in several, in order (transport.py)."""

    block_ids: Sequence[int]
    first: int
    total: int

    @property
    def end(self) -> int:
        return self.first + len(self.block_ids)


def send_pieces(
    transport: KVTransport,
    kv_caches: KVCaches,
    kv_head_start: int,
    pieces: Sequence[HeadRoute],
    decode_id: str,
    decode_endpoints: Sequence[KVEndpoint],
    part: Part,
    transfer_id: int,
    abandon: bool = False,
) -> None:
    """Send this rank's pieces of a part to their decode ranks (`abandon`: tell them instead
    that the transfer ends before it); KVTransferError if any failed."""

    def send(route: HeadRoute) -> None:
        peer, endpoint = rank_peer_id(decode_id, route.dst), decode_endpoints[route.dst]
        caches = head_view(kv_caches, kv_head_start, route)
        if abandon:
            transport.abandon(peer, endpoint, caches, transfer_id, part.first, part.total)
        else:
            transport.send(peer, endpoint, caches, part.block_ids, transfer_id, part.first, part.total)

    _each(send, pieces)


def recv_pieces(
    transport: KVTransport,
    kv_caches: KVCaches,
    kv_head_start: int,
    pieces: Sequence[HeadRoute],
    prefill_id: str,
    prefill_endpoints: Sequence[KVEndpoint],
    block_ids: Sequence[int],
    transfer_id: int,
) -> None:
    """Receive this rank's pieces from their prefill ranks; KVTransferError if any failed
    (the blocks of the pieces that did arrive are then recomputed or dropped anyway)."""

    def recv(route: HeadRoute) -> None:
        peer, endpoint = rank_peer_id(prefill_id, route.src), prefill_endpoints[route.src]
        transport.receive(peer, endpoint, head_view(kv_caches, kv_head_start, route), block_ids, transfer_id)

    _each(recv, pieces)


def _each(fn: Callable[[HeadRoute], None], pieces: Sequence[HeadRoute]) -> None:
    """fn on every piece, concurrently; the first error is raised after all have ended."""
    if len(pieces) <= 1:
        for piece in pieces:
            fn(piece)
        return
    with ThreadPoolExecutor(max_workers=len(pieces), thread_name_prefix="kv-piece") as pool:
        futures = [pool.submit(fn, piece) for piece in pieces]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]
