"""Shared-memory collectives between real processes: the sums, gathers and broadcasts of
gloo, and a peer that dies is noticed at once (not after the timeout)."""

import multiprocessing as mp
import os
import secrets
import time

import pytest
import torch

from cluster.errors import RankLostError
from cluster.model.shm_collectives import ShmCollectives

CAPACITY = 1 << 16


def _peer(path, nonce, rounds, die_after):
    group = ShmCollectives(path, 1, 2, CAPACITY, 30.0, nonce)
    for i in range(rounds):
        if i == die_after:
            os._exit(0)  # gone without a word, as a killed process
        group.all_reduce_(torch.full((3, 5), float(i + 1)))
        group.all_gather_last(torch.full((2, 4), 10.0 * i))
        group.broadcast_bytes(None)


def _start(tmp_path, rounds, die_after=-1):
    path, nonce = str(tmp_path / f"tp-{secrets.token_hex(4)}"), secrets.randbits(62)
    root = ShmCollectives(path, 0, 2, CAPACITY, 30.0, nonce)
    peer = mp.get_context("spawn").Process(target=_peer, args=(path, nonce, rounds, die_after))
    peer.start()
    return root, peer


def test_an_idle_follower_sleeps_until_the_broadcast(tmp_path):
    """A rank waiting for the next step plan uses no CPU (an idle replica burns none)."""
    path, nonce = str(tmp_path / "tp-idle"), secrets.randbits(62)
    root = ShmCollectives(path, 0, 2, CAPACITY, 30.0, nonce)
    ctx = mp.get_context("spawn")
    waiting = ctx.Event()
    peer = ctx.Process(target=_cpu_of_waiting_for_a_broadcast, args=(path, nonce, waiting))
    peer.start()
    try:
        assert waiting.wait(timeout=60)
        time.sleep(1.5)
        root.broadcast_bytes(b"go")
        peer.join(timeout=30)
        assert peer.exitcode == 0  # it got b"go" after waiting >= 1 s on under 0.2 s of CPU
    finally:
        root.close()
        ShmCollectives.remove_files(path, 2)


def _cpu_of_waiting_for_a_broadcast(path, nonce, waiting):
    group = ShmCollectives(path, 1, 2, CAPACITY, 30.0, nonce)
    wall, cpu = time.monotonic(), time.process_time()
    waiting.set()
    got = group.broadcast_bytes(None)
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    os._exit(0 if got == b"go" and wall >= 1.0 and cpu < 0.2 else 1)


def test_all_reduce_all_gather_and_broadcast_match_their_definitions(tmp_path):
    root, peer = _start(tmp_path, rounds=50)
    try:
        for i in range(50):  # many rounds: both buffers are reused many times
            summed = root.all_reduce_(torch.full((3, 5), 100.0 * i))
            assert torch.equal(summed, torch.full((3, 5), 100.0 * i + i + 1))
            gathered = root.all_gather_last(torch.full((2, 4), -1.0))
            assert torch.equal(gathered, torch.cat([torch.full((2, 4), -1.0), torch.full((2, 4), 10.0 * i)], dim=-1))
            payload = secrets.token_bytes(i * 37)
            assert root.broadcast_bytes(payload) == payload
    finally:
        peer.join(timeout=30)
        root.close()
        ShmCollectives.remove_files(root.path, 2)
    assert peer.exitcode == 0


def test_a_peer_that_dies_is_noticed_at_once(tmp_path):
    root, peer = _start(tmp_path, rounds=10, die_after=3)
    try:
        for _ in range(3):
            root.all_reduce_(torch.zeros(3, 5))
            root.all_gather_last(torch.zeros(2, 4))
            root.broadcast_bytes(b"plan")
        with pytest.raises(RankLostError, match="died"):  # the liveness check, not the 30 s timeout (that says so)
            root.all_reduce_(torch.zeros(3, 5))
    finally:
        peer.join(timeout=30)
        root.close()
        ShmCollectives.remove_files(root.path, 2)


def test_a_rank_that_maps_another_groups_file_is_refused(tmp_path):
    path = str(tmp_path / "tp-other")
    root = ShmCollectives(path, 0, 2, CAPACITY, 30.0, nonce=1)
    try:
        with pytest.raises(OSError, match="not this group's file"):
            ShmCollectives(path, 1, 2, CAPACITY, 30.0, nonce=2)
    finally:
        root.close()
        ShmCollectives.remove_files(path, 2)
