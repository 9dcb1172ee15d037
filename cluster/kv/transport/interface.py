"""What every KV transport does, and the fault contract the workers rely on.

A transport moves a request's KV blocks from a prefill worker's cache into blocks a
decode worker reserved for them. Control (which request, which blocks, in which order)
travels over Ray calls; a transport carries the bulk data only.

    prefill side                                   decode side
    send(decode, its endpoint, caches, blocks,     receive(prefill, its endpoint, caches,
         transfer, first, total)  part by part         blocks, transfer)   every part, in order
    abandon(decode, its endpoint, ..., first)      -> that receive fails at once

Each side publishes its `endpoint`, which the other passes to every call with it: the
tiers carry endpoints in their messages without reading them (cluster/serving/messages.py).

The contract:
- Transfers are matched by id: the transfers of one pair may run concurrently and be
  posted in any order. Ids are unique per sender.
- A transfer goes in one part or in several, in order, as the prompt's KV is computed;
  the receiver writes each part into its blocks as it arrives, and only after that part
  arrived. A transfer that fails after some parts leaves those blocks written: they are
  the request's own reserved blocks, published to the prefix cache only when the whole
  transfer arrived (Scheduler.commit_remote), recomputed or freed otherwise.
- Every wait is bounded by the transport's timeout; a failure or timeout raises
  KVTransferError naming the peer and the transfer, and is counted in `stats()`.
- A sender that cannot go on (an injected fault, its prompt aborted or preempted midway)
  abandons the transfer: the receiver fails it at once instead of waiting out its timeout.
- A transport recovers from a broken link by itself: the next transfer with that peer
  reconnects. A peer's new endpoint (a restarted replica) replaces its old connection;
  connections idle for long (peers that went away) are closed.

Adding a transport (RDMA, a KV store): a class with these methods and an endpoint type
of its own, chosen in `open_transport` (cluster/kv/transport/builder.py) from the
TransportConfig; tests/integration/test_transport.py holds the contract's checks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # (torch's, which the gateway never loads: it only carries endpoints)
    from cluster.kv.transport.packing import KVCaches

Role = Literal["prefill", "decode"]


class KVTransferError(RuntimeError):
    """A transfer, or the connection it needs, failed or timed out."""


@dataclass(frozen=True)
class KVEndpoint:
    """Where a transport's peers reach it: what one side of a pair must tell the other.
    Opaque to the tiers, which only carry it (picklable); each transport subclasses it."""


class KVTransport(ABC):
    """One per worker rank. Thread-safe: transfers with different peers may run at once."""

    role: Role
    worker_id: str

    @property
    @abstractmethod
    def endpoint(self) -> KVEndpoint:
        """What a peer passes to its calls with this transport."""

    @abstractmethod
    def send(self, peer_id: str, peer: KVEndpoint, kv_caches: KVCaches, block_ids: Sequence[int], transfer_id: int,
             first: int = 0, total: int | None = None) -> None:
        """Send blocks `block_ids` of `kv_caches` to decode worker `peer_id`: blocks [first,
        first + len) of transfer `transfer_id`, which has `total` blocks in all (default:
        these are all of them); returns once the peer has them."""

    @abstractmethod
    def abandon(self, peer_id: str, peer: KVEndpoint, kv_caches: KVCaches, transfer_id: int, first: int, total: int) -> None:
        """End transfer `transfer_id` before its blocks from `first` on: the receiver's wait
        for them fails at once. Best effort: a broken link fails the receiver anyway."""

    @abstractmethod
    def receive(self, peer_id: str, peer: KVEndpoint, kv_caches: KVCaches, block_ids: Sequence[int], transfer_id: int) -> None:
        """Receive transfer `transfer_id` from prefill worker `peer_id` into blocks
        `block_ids` of `kv_caches`, in as many parts as the sender makes of it."""

    @abstractmethod
    def connect(self, peer_id: str, peer: KVEndpoint) -> None:
        """Connect with a peer ahead of the first transfer (send and receive connect as they
        need to): returns once the peer has connected too, KVTransferError within the
        timeout if it does not."""

    @abstractmethod
    def close(self) -> None:
        """Release everything; the transport is unusable afterwards."""

    @abstractmethod
    def path_to(self, peer: KVEndpoint) -> str:
        """How a transfer with `peer` moves its payload (a trace's attribute), e.g.
        "shared_memory" or "sockets"."""

    @abstractmethod
    def stats(self) -> dict[str, float | int]:
        """Counters since construction: transfers_ok, transfers_failed, bytes_sent,
        bytes_received, seconds_sending, seconds_receiving, and the transport's own."""

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
