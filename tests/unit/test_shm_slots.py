"""Shared-memory payload slots: reused while the sender lives, removed when it closes or
dies, never reused after a failure."""

import os
import subprocess
import sys

import pytest
import torch

from cluster.kv.transport import shm_slots

pytestmark = pytest.mark.skipif(not shm_slots.available(), reason="no writable /dev/shm")


def test_a_slot_is_reused_after_an_ack_and_never_after_a_failure():
    pool, views = shm_slots.SlotPool(), shm_slots.SlotViews()
    try:
        a = pool.take(1000)
        assert a.capacity == shm_slots.CAPACITY_STEP and os.path.exists(a.path)
        shm_slots.view_as(a.data, (10, 25), torch.float32).fill_(3.0)
        seen = shm_slots.view_as(views.view(a.pid, a.index, a.capacity), (10, 25), torch.float32)
        assert torch.equal(seen, torch.full((10, 25), 3.0))  # the receiver's mapping sees the sender's bytes
        pool.give(a)
        assert pool.take(5000) is a  # reused: no new file, no new page faults
        pool.drop(a)  # failed transfer: gone for good
        assert not os.path.exists(a.path)
        b = pool.take(shm_slots.CAPACITY_STEP + 1)
        assert b is not a and b.capacity == 2 * shm_slots.CAPACITY_STEP
    finally:
        pool.close()
        views.close()
    assert not os.path.exists(b.path)


def test_a_taken_name_is_an_oserror_not_a_crash():
    pool = shm_slots.SlotPool()
    blocker = shm_slots.next_slot_path(shm_slots.CAPACITY_STEP)
    open(blocker, "w").close()
    try:
        with pytest.raises(OSError):
            pool.take(10)
    finally:
        os.unlink(blocker)
        pool.close()


def test_files_of_dead_senders_are_swept_and_live_ones_kept():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_file = shm_slots.slot_path(int(dead.stdout), 0, shm_slots.CAPACITY_STEP)
    live_file = shm_slots.slot_path(os.getpid(), 99, shm_slots.CAPACITY_STEP)
    for path in (dead_file, live_file):
        open(path, "w").close()
    try:
        shm_slots.sweep_dead_senders()
        assert not os.path.exists(dead_file) and os.path.exists(live_file)
    finally:
        for path in (dead_file, live_file):
            if os.path.exists(path):
                os.unlink(path)


def test_processes_share_a_memory_domain_exactly_when_they_see_the_same_shm(tmp_path, monkeypatch):
    """The domain names what /dev/shm a process sees, not its host or IP: another process
    on it reads the same one; a process whose /dev/shm is elsewhere (a container's own)
    gets a different one, though on the same host."""
    here = shm_slots.memory_domain()
    other = subprocess.run([sys.executable, "-c", "from cluster.kv.transport import shm_slots; print(shm_slots.memory_domain())"],
                           capture_output=True, text=True, check=True)
    assert other.stdout.strip() == here and len(here) == 32
    monkeypatch.setattr(shm_slots, "SHM_DIR", str(tmp_path))
    elsewhere = shm_slots.memory_domain()
    assert elsewhere != here and shm_slots.memory_domain() == elsewhere
    assert os.listdir(tmp_path) == [shm_slots.DOMAIN_FILE]  # the draft it linked from is gone
