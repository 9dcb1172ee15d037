"""Collectives between the tensor-parallel ranks of one replica on one host (CPU), through
one shared-memory file: a step's all-reduces cost microseconds, not gloo's round trips
through the kernel's sockets (measured ~2 ms per small all-reduce between two processes
on a 2-core AMD EPYC VM, which made every decode step pay ~4 ms per layer).

    file: [ header: one 64-byte line per rank: seq, pid ] [ 2 buffers x size ranks x capacity ]
    FIFOs: one per rank > 0, to wake it for a broadcast (an idle rank sleeps, not spins)

An all-reduce or all-gather: each rank bumps its seq, writes its part into its slot of
buffer seq % 2, publishes seq, spins until every rank has published it (they are all in
the same step: microseconds), then reads every rank's slot (all-reduce: sums them in
rank order, so every rank computes the identical result). A broadcast (rank 0's step
plan): rank 0 writes its slot, publishes, writes a byte to every other rank's FIFO and
goes on; the others sleep on their FIFO until it comes, read, then publish.

Invariants:
- A rank publishes seq n only after it finished reading collective n-1. Before writing
  buffer n % 2 (last used by n-2), a rank waits until every rank published n-1: so two
  buffers suffice, and the broadcasting rank never waits for the others in the common case.
- Ranks run the same collectives in the same order with the same sizes (the model is the
  same code on every rank), so all ranks agree whether a tensor fits `capacity`; the
  caller sends larger ones through the process group instead.
- x86 stores are seen in program order (TSO): the data is visible before the seq that
  follows it. A waiting rank checks its peers' pids, so a dead peer is noticed at once
  (RankLostError), a stalled one after `timeout_s`.
- The file is unlinked once every rank has mapped it: nothing is left in /dev/shm.
"""

from __future__ import annotations

import mmap
import os
import select
import time

import numpy as np
import torch

from cluster.errors import RankLostError

LINE = 64  # bytes per rank in the header: its seq and pid, alone on a cache line
SPIN_CHECKS = 200  # busy checks before yielding the core between checks
LIVENESS_EVERY_S = 0.1


class ShmCollectives:
    def __init__(self, path: str, rank: int, size: int, capacity: int, timeout_s: float, nonce: int):
        """Rank 0 creates the file and the FIFOs (`path`.r<rank>); the others open them
        (OSError if they cannot, e.g. another host's /dev/shm). `nonce`, rank 0's, tells a
        rank it mapped the right file. `remove_files` once every rank has opened them."""
        self.rank, self.size, self.capacity = rank, size, capacity
        self.timeout_s = timeout_s
        self.path = path
        header = LINE * size
        nbytes = header + 2 * size * capacity
        if rank == 0:
            for r in range(1, size):
                os.mkfifo(f"{path}.r{r}", 0o600)
        # O_RDWR: opening a FIFO does not wait for the other end. Rank 0 never blocks on a
        # write (a byte per broadcast, read promptly; O_NONBLOCK), the others block on reads.
        self._wake_fds = [os.open(f"{path}.r{r}", os.O_RDWR | os.O_NONBLOCK) for r in range(1, size)] if rank == 0 else []
        self._wait_fd = os.open(f"{path}.r{rank}", os.O_RDWR) if rank > 0 else None
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if rank == 0 else 0), 0o600)
        try:
            if rank == 0:
                os.ftruncate(fd, nbytes)
            self._mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        lines = np.frombuffer(self._mapping, dtype=np.int64, count=header // 8).reshape(size, LINE // 8)
        self._seqs, self._pids = lines[:, 0], lines[:, 1]  # views into the file
        if rank == 0:
            lines[0, 2] = nonce
        elif int(lines[0, 2]) != nonce:
            self.close()
            raise OSError(f"{path} is not this group's file")
        self._pids[rank] = os.getpid()
        data = torch.frombuffer(self._mapping, dtype=torch.uint8)[header:]  # [2 * size * capacity]
        self._slots = data.view(2, size, capacity)
        self._seq = 0

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.capacity

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(t)
        t.copy_(parts[0])
        for part in parts[1:]:
            t.add_(part)
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(t), dim=-1)

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0's payload (len <= capacity - 8) on every rank. The others may wait for
        it indefinitely (an idle replica): they sleep, and watch rank 0's pid."""
        self._seq += 1
        buffer = self._seq % 2
        slot = self._slots[buffer, 0]
        if self.rank == 0:
            self._wait_all(self._seq - 1)  # buffer free: everyone is done with seq - 2
            slot[:8].copy_(torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8))
            if payload:
                slot[8 : 8 + len(payload)].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            self._seqs[0] = self._seq  # after the data (TSO)
            for fd in self._wake_fds:
                os.write(fd, b"\x01")
            return payload
        self._sleep_until_woken()  # rank 0 published its seq before it woke us (TSO)
        length = int(slot[:8].view(torch.int64))
        data = slot[8 : 8 + length].numpy().tobytes()
        self._seqs[self.rank] = self._seq  # after reading
        return data

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t` (same shape and dtype on all), as views of the file."""
        raw = t.contiguous().view(-1).view(torch.uint8)
        self._seq += 1
        buffer = self._seq % 2
        self._wait_all(self._seq - 1)  # buffer free: everyone is done with seq - 2
        self._slots[buffer, self.rank, : raw.numel()].copy_(raw)
        self._seqs[self.rank] = self._seq  # after the data (TSO)
        self._wait_all(self._seq)
        return [self._slots[buffer, r, : raw.numel()].view(t.dtype).view(t.shape) for r in range(self.size)]

    def _sleep_until_woken(self) -> None:
        while not select.select([self._wait_fd], [], [], LIVENESS_EVERY_S)[0]:
            self._check_peers(self._seq, ranks=[0])
        os.read(self._wait_fd, 1)

    def _wait_all(self, seq: int) -> None:
        """Spin (then yield) until every rank published `seq`: they are in the same step."""
        checks = 0
        start = last_liveness = time.monotonic()
        while (self._seqs < seq).any():
            checks += 1
            if checks < SPIN_CHECKS:
                continue
            os.sched_yield()
            now = time.monotonic()
            if now - last_liveness > LIVENESS_EVERY_S:
                last_liveness = now
                self._check_peers(seq)
                if now - start > self.timeout_s:
                    raise RankLostError(f"rank {self.rank}: a peer rank did not reach collective {seq} in {self.timeout_s}s")

    def _check_peers(self, seq: int, ranks=None) -> None:
        """RankLostError if a rank that has not reached `seq` has died."""
        for rank in np.flatnonzero(self._seqs < seq) if ranks is None else ranks:
            pid = int(self._pids[rank])
            if pid > 0 and not _alive(pid):  # (0: not mapped yet, never after the set-up barrier)
                raise RankLostError(f"rank {rank} (pid {pid}) died before collective {seq}")

    @staticmethod
    def remove_files(path: str, size: int) -> None:
        """Rank 0, once every rank has opened the file and FIFOs (or failed to): nothing
        stays in /dev/shm."""
        for name in [path, *(f"{path}.r{r}" for r in range(1, size))]:
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        for fd in [*self._wake_fds, *([self._wait_fd] if self._wait_fd is not None else [])]:
            os.close(fd)
        self._wake_fds, self._wait_fd = [], None
        self._seqs = self._pids = self._slots = None
        try:
            self._mapping.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with it
            pass


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (exited, not yet reaped by its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:  # gone meanwhile, or no /proc
        return os.path.exists(f"/proc/{pid}")
