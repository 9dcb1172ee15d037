"""A replica's tensor-parallel process group and the collectives its ranks run.

One group per replica, outside torch.distributed's default world (as the KV transport's
pair groups are): rank 0 hosts the rendezvous TCPStore, every rank joins it. gloo when
the model is on CPU, NCCL on CUDA; the code above is the same. CPU ranks that share a
host (the default placement) run the collectives through shared memory
(cluster/model/shm_collectives.py) and use gloo only for what does not fit there.

    broadcast_object   rank 0 -> all: each step's plan (a pickled SchedulerOutput)
    all_reduce_        sums of row-parallel outputs (o_proj, down_proj, embeddings)
    all_gather_last    vocab-parallel logits, concatenated on every rank

Every collective waits at most `timeout_s`. A rank that dies makes its peers' next
collective fail (gloo sees the closed connection at once; a stalled rank is caught by
the timeout): that is a RankLostError, and the replica is dead from then on.
"""

from __future__ import annotations

import logging
import os
import pickle
import secrets
from datetime import timedelta

import torch
import torch.distributed as dist

from cluster.errors import RankLostError
from cluster.host.rendezvous import StoreAddress, listening_store
from cluster.model.shm_collectives import ShmCollectives

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SHM_CAPACITY = 16 << 20  # bytes per rank and buffer: a 2k-token step's activations of a ~1k-wide model in fp32


class TensorParallelGroup:
    def __init__(
        self, rank: int = 0, size: int = 1, pg=None, timeout_s: float = 60.0, store: dist.Store | None = None, device: str = "cpu"
    ):
        self.rank, self.size = rank, size
        self.device = torch.device(device)  # where the plan travels (NCCL moves only device tensors)
        self.timeout = timedelta(seconds=timeout_s)
        self._pg = pg
        self._store = store  # rank 0's store server lives as long as the group
        self._broken: str | None = None
        self._shm: ShmCollectives | None = None

    @classmethod
    def host(cls, host: str, timeout_s: float) -> tuple[dist.Store, StoreAddress]:
        """Rank 0's rendezvous store and its address (which the other ranks `join`)."""
        store = listening_store(host, timedelta(seconds=timeout_s))
        return store, (host, store.port)

    @classmethod
    def join(
        cls,
        address: StoreAddress,
        rank: int,
        size: int,
        device: str,
        timeout_s: float,
        store: dist.Store | None = None,
        shared_memory: bool = True,
    ) -> TensorParallelGroup:
        """Join the replica's group as `rank`; blocks until all `size` ranks have (<= timeout_s).
        shared_memory: CPU ranks that share a host run the collectives through /dev/shm."""
        timeout = timedelta(seconds=timeout_s)
        client = store if store is not None else dist.TCPStore(address[0], address[1], is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore("pdserve/tp", client)
        if torch.device(device).type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=address[0])]
            pg = dist.ProcessGroupGloo(prefixed, rank, size, options)
        group = cls(rank, size, pg, timeout_s, client, device)
        if group.device.type == "cpu" and shared_memory:
            group._shm = _shared_memory(prefixed, pg, rank, size, timeout_s)
        return group

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    def _wait(self, work, what: str) -> None:
        if self._broken is not None:
            raise RankLostError(f"tensor-parallel group is down since: {self._broken}")
        try:
            ok = work.wait(self.timeout)
        except Exception as e:  # gloo: a peer closed its connection (it died)
            self._broken = f"{what} failed on rank {self.rank}: {e}"
            raise RankLostError(self._broken) from None
        if not ok:
            self._broken = f"{what} timed out on rank {self.rank} after {self.timeout}"
            raise RankLostError(self._broken)

    def _start(self, op):
        if self._broken is not None:
            raise RankLostError(f"tensor-parallel group is down since: {self._broken}")
        try:
            return op()
        except Exception as e:
            self._broken = f"collective failed on rank {self.rank}: {e}"
            raise RankLostError(self._broken) from None

    @property
    def transport(self) -> str:
        """What the collectives go through (for stats)."""
        if self.size == 1:
            return "none"
        return "shared memory" if self._shm is not None else ("nccl" if self.device.type == "cuda" else "gloo")

    def _via_shm(self, fn, *args):
        if self._broken is not None:
            raise RankLostError(f"tensor-parallel group is down since: {self._broken}")
        try:
            return fn(*args)
        except RankLostError as e:
            self._broken = str(e)
            raise

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place."""
        if self.size == 1:
            return t
        if self._shm is not None and self._shm.fits(t.numel() * t.element_size()):
            return self._via_shm(self._shm.all_reduce_, t)
        self._wait(self._start(lambda: self._pg.allreduce([t])), "all-reduce")
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """[..., n] from every rank -> [..., size * n], in rank order."""
        if self.size == 1:
            return t
        if self._shm is not None and self._shm.fits(t.numel() * t.element_size()):
            return self._via_shm(self._shm.all_gather_last, t)
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._wait(self._start(lambda: self._pg.allgather([parts], [t])), "all-gather")
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's `obj`, on every rank (the others pass nothing)."""
        if self.size == 1:
            return obj
        if self._shm is not None:
            # A one-byte flag first: 1, the pickle follows here; 0, it goes through gloo
            # (too big for the slot), which every rank learns from this same broadcast.
            data = pickle.dumps(obj) if self.rank == 0 else None
            fits = data is not None and self._shm.fits(len(data) + 9)
            got = self._via_shm(self._shm.broadcast_bytes, (b"\x01" + data if fits else b"\x00") if self.rank == 0 else None)
            if got[:1] == b"\x01":
                return obj if self.rank == 0 else pickle.loads(got[1:])
        options = dist.BroadcastOptions()
        options.rootRank = 0
        payload = None
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        length = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64, device=self.device)
        self._wait(self._start(lambda: self._pg.broadcast([length], options)), "plan length broadcast")
        if payload is None:
            payload = torch.empty(int(length), dtype=torch.uint8, device=self.device)
        self._wait(self._start(lambda: self._pg.broadcast([payload], options)), "plan broadcast")
        return obj if self.rank == 0 else pickle.loads(payload.cpu().numpy().tobytes())

    def close(self) -> None:
        shm, self._shm = self._shm, None
        if shm is not None:
            shm.close()
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - best effort: gloo closes its sockets when the object goes
                pass
        self._store = None


SINGLE = TensorParallelGroup()  # one rank: every collective is the identity


def _shared_memory(store: dist.Store, pg, rank: int, size: int, timeout_s: float) -> ShmCollectives | None:
    """The shared-memory collectives, if every rank could map rank 0's file (they share a
    host); None otherwise (gloo for everything). Every rank reaches the same answer."""
    shm, path = None, None
    try:
        if rank == 0:  # its file and FIFOs exist before anyone is told where
            if os.path.isdir(SHM_DIR):
                nonce = secrets.randbits(62)
                path = os.path.join(SHM_DIR, f"pdserve-tp-{os.getpid()}-{nonce:x}")
                shm = ShmCollectives(path, rank, size, SHM_CAPACITY, timeout_s, nonce)
        else:
            where, nonce = store.get("shm").decode().split()
            if where != "-":
                shm = ShmCollectives(where, rank, size, SHM_CAPACITY, timeout_s, int(nonce))
    except OSError as e:
        log.warning("rank %d: no shared memory for tensor-parallel collectives (%s): gloo for all", rank, e)
    finally:
        if rank == 0:  # always answer: the others wait for it
            store.set("shm", f"{path} {nonce}" if shm is not None else "- 0")
    ok = torch.tensor([1 if shm is not None else 0], dtype=torch.int64)
    work = pg.allreduce([ok])  # also the barrier after which the file may be unlinked
    work.wait()
    if rank == 0 and path is not None:
        ShmCollectives.remove_files(path, size)
    if int(ok) == size:
        return shm
    if shm is not None:
        shm.close()
    return None
