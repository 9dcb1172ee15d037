"""Shared-memory payload files for KV transfers between workers on one node, reused.

A fresh mapping costs more than the copy it carries (first-touch faults of new tmpfs
pages: ~25 ms for a 35 MB payload that packs in ~3 ms), so a sender keeps its files and
their mappings for the next transfer, and a receiver keeps the mappings it has opened.

    SlotPool   (sender)    take(nbytes) -> a mapped file of >= nbytes; give(slot) after
                           the receiver's ack; drop(slot) after a failure (the receiver
                           may still read it: never reused); close()
    SlotViews  (receiver)  view(pid, index, capacity) -> the sender's file, mapped once
    memory_domain()        the same string in every process that sees this /dev/shm


Files are /dev/shm/pdserve-kv-<pid>-<index>-<capacity>: the pid lets a starting sender
remove the files of senders on this node that died (sweep_dead_senders). An index is
never reused within a process, even by another pool: a receiver's mapping cached under a
name is always that file's.
"""

from __future__ import annotations

import mmap
import os
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import torch

SHM_DIR = "/dev/shm"
PREFIX = "pdserve-kv-"
DOMAIN_FILE = "pdserve-memory-domain"
CAPACITY_STEP = 8 << 20  # capacities round up to this, so a file serves payloads of similar size
MAX_IDLE_BYTES = 1 << 30  # a sender keeps at most this much in idle files
MAX_VIEWS = 64  # mappings a receiver keeps
_index_lock = threading.Lock()
_next_index = 0  # of this process's next slot file, whichever pool makes it


def _new_index() -> int:
    global _next_index
    with _index_lock:
        index, _next_index = _next_index, _next_index + 1
    return index


def next_slot_path(capacity: int) -> str:
    """The file this process's next new slot of `capacity` takes (tests make it fail by
    taking the name first)."""
    with _index_lock:
        return slot_path(os.getpid(), _next_index, capacity)


def available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def memory_domain() -> str:
    """A random id that the first caller writes to /dev/shm and every later one reads:
    two processes get the same one exactly when they share /dev/shm, whatever their IPs
    (containers on one host with their own /dev/shm, or hosts behind one NAT address, do
    not). Published by an atomic link, so no reader sees a half-written file."""
    path = os.path.join(SHM_DIR, DOMAIN_FILE)
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        pass
    draft = f"{path}.{os.getpid()}.{uuid.uuid4().hex}"
    with open(draft, "w") as f:
        f.write(uuid.uuid4().hex)
    try:
        os.link(draft, path)  # fails if another process published first: read theirs
    except FileExistsError:
        pass
    finally:
        os.unlink(draft)
    with open(path) as f:
        return f.read()


def slot_path(pid: int, index: int, capacity: int) -> str:
    return os.path.join(SHM_DIR, f"{PREFIX}{pid}-{index}-{capacity}")


def _map(path: str, capacity: int) -> tuple[mmap.mmap, torch.Tensor]:
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != capacity:
            raise OSError(f"{path} is not {capacity} bytes")
        mapping = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    return mapping, torch.frombuffer(mapping, dtype=torch.uint8)  # [capacity]


def _unmap(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:  # a tensor view is still alive somewhere: the mapping goes with it
        pass


@dataclass(eq=False)
class Slot:
    pid: int
    index: int
    capacity: int
    mapping: mmap.mmap
    data: torch.Tensor  # uint8 [capacity] over the mapping

    @property
    def path(self) -> str:
        return slot_path(self.pid, self.index, self.capacity)


def view_as(data: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The first bytes of a slot as a contiguous tensor of `shape` and `dtype`."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    return data[:nbytes].view(dtype).view(shape)


class SlotPool:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[Slot] = []
        self._live: set[Slot] = set()

    def take(self, nbytes: int) -> Slot:
        """A slot of at least nbytes: an idle one if any fits, else a new file. OSError if
        none can be made (e.g. /dev/shm full: its pages are reserved up front, so a full
        /dev/shm fails here, never as a SIGBUS on a later write)."""
        with self._lock:
            fitting = [s for s in self._free if s.capacity >= nbytes]
            if fitting:
                slot = min(fitting, key=lambda s: s.capacity)
                self._free.remove(slot)
                return slot
            index = _new_index()
        capacity = -(-max(nbytes, 1) // CAPACITY_STEP) * CAPACITY_STEP
        path = slot_path(os.getpid(), index, capacity)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, capacity)
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        mapping, data = _map(path, capacity)
        slot = Slot(os.getpid(), index, capacity, mapping, data)
        with self._lock:
            self._live.add(slot)
        return slot

    def give(self, slot: Slot) -> None:
        """Back to the pool after a transfer the receiver acknowledged."""
        with self._lock:
            idle = sum(s.capacity for s in self._free)
            if idle + slot.capacity <= MAX_IDLE_BYTES:
                self._free.append(slot)
                return
        self.drop(slot)

    def drop(self, slot: Slot) -> None:
        with self._lock:
            self._live.discard(slot)
            if slot in self._free:
                self._free.remove(slot)
        try:
            os.unlink(slot.path)
        except FileNotFoundError:
            pass
        slot.data = None
        _unmap(slot.mapping)

    def close(self) -> None:
        with self._lock:
            slots = list(self._live)
        for slot in slots:
            self.drop(slot)


class SlotViews:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._views: OrderedDict[str, tuple[mmap.mmap, torch.Tensor]] = OrderedDict()

    def view(self, pid: int, index: int, capacity: int) -> torch.Tensor:
        """uint8 [capacity] over the sender's slot file (mapped on first use)."""
        path = slot_path(pid, index, capacity)
        with self._lock:
            if path in self._views:
                self._views.move_to_end(path)
                return self._views[path][1]
        mapping, data = _map(path, capacity)
        with self._lock:
            self._views[path] = (mapping, data)
            while len(self._views) > MAX_VIEWS:
                _, (old, _data) = self._views.popitem(last=False)
                del _data
                _unmap(old)
        return data

    def forget(self, pid: int, index: int, capacity: int) -> None:
        """Unmap a slot (its transfer failed: the sender will not reuse it)."""
        with self._lock:
            entry = self._views.pop(slot_path(pid, index, capacity), None)
        if entry is not None:
            mapping, data = entry
            del data
            _unmap(mapping)

    def close(self) -> None:
        with self._lock:
            entries, self._views = list(self._views.values()), OrderedDict()
        for mapping, data in entries:
            del data
            _unmap(mapping)


def sweep_dead_senders() -> None:
    """Remove slot files whose sender process is gone (it died without closing)."""
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)]
    except OSError:
        return
    for name in names:
        try:
            pid = int(name[len(PREFIX):].split("-", 1)[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass
        except (ValueError, PermissionError):  # not ours, or another user's live process
            pass
