"""The KV transport's contract (cluster/kv/transport/interface.py), checked on its
torch.distributed transport over real gloo groups, between real (spawned) processes; no
mocks.

A two-process test runs one scenario in a decode child, which hosts the rendezvous
store, and in a prefill child; they swap endpoints through a pair of queues. Each child
reports a result dict (tensors serialised with torch.save) or its traceback. Every wait
has a deadline and children are stopped or killed on failure, so no test can hang. No
assertion is on elapsed time: "at once" is shown by what a failure says (the sender's
notice, not a timeout), so a loaded machine cannot fail a test by being slow.
"""

import glob
import io
import multiprocessing
import os
import queue
import threading
import time
import traceback

import pytest
import torch

from cluster.kv.transport import shm_slots
from cluster.kv.transport.faults import FaultInjection
from cluster.kv.transport.interface import KVTransferError
from cluster.kv.transport.packing import pack_blocks, unpack_blocks
from cluster.kv.transport.torch_dist import TorchDistTransport as Transport

pytestmark = pytest.mark.timeout(90)

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 2, 10, 4, 2, 8
PREFILL_SEED, DECODE_SEED = 1, 2
CHILD_DEADLINE_S = 45  # for both children to report; each blocking step has its own timeout


def random_caches(seed: int, dtype: torch.dtype = torch.bfloat16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return [tuple(torch.randn(shape, generator=g).to(dtype) for _ in range(2)) for _ in range(NUM_LAYERS)]


def payload_nbytes(n: int, dtype: torch.dtype = torch.bfloat16) -> int:
    return NUM_LAYERS * 2 * n * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize


def to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(data: bytes):
    return torch.load(io.BytesIO(data))


# ---- child processes ----------------------------------------------------------------


def _child_loop(role, commands, endpoints, results):
    """Run (target, args) commands until None, or until idle for long (orphaned)."""
    torch.set_num_threads(1)
    while True:
        try:
            command = commands.get(timeout=300)
        except queue.Empty:
            return
        if command is None:
            return
        target, args = command
        try:
            results.put((role, "ok", target(endpoints, *args)))
        except BaseException:
            results.put((role, "error", traceback.format_exc()))


class ChildPair:
    """A decode child and a prefill child, reused across tests (importing torch costs ~2 s
    of CPU per process) and restarted after any failure. Each scenario makes its own
    transports, hence its own store and groups."""

    ROLES = ("decode", "prefill")

    def __init__(self):
        self._ctx = multiprocessing.get_context("spawn")
        self._procs = {}

    def run(self, decode_target, prefill_target, decode_args=(), prefill_args=()):
        """Run one scenario in both children; returns (decode result, prefill result)."""
        if not self._procs:
            self._start()
        finished = False
        try:
            self._commands["decode"].put((decode_target, decode_args))
            self._commands["prefill"].put((prefill_target, prefill_args))
            out = self._collect()
            finished = True
            return out["decode"], out["prefill"]
        finally:
            if not finished:
                self.stop(graceful=False)

    def stop(self, graceful=True):
        for role, p in self._procs.items():
            if graceful:
                self._commands[role].put(None)
                p.join(10)
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        self._procs = {}

    def _start(self):
        self._endpoints, self._results = (self._ctx.Queue(), self._ctx.Queue()), self._ctx.Queue()
        self._commands = {role: self._ctx.Queue() for role in self.ROLES}
        self._procs = {
            role: self._ctx.Process(
                target=_child_loop, args=(role, self._commands[role], self._endpoints, self._results), name=f"kv-{role}", daemon=True
            )
            for role in self.ROLES
        }
        for p in self._procs.values():
            p.start()

    def _collect(self):
        out = {}
        deadline = time.monotonic() + CHILD_DEADLINE_S
        while len(out) < 2:
            try:
                role, status, payload = self._results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                dead = {r: p.exitcode for r, p in self._procs.items() if not p.is_alive()}
                pytest.fail(f"no result from {sorted(set(self.ROLES) - set(out))} within {CHILD_DEADLINE_S}s (exited: {dead})")
            if status != "ok":
                pytest.fail(f"{role} child failed:\n{payload}")
            out[role] = payload
        return out


@pytest.fixture(scope="module")
def children():
    pair = ChildPair()
    yield pair
    pair.stop()


def _swap_as_decode(endpoints, kv):
    """The prefill child's endpoint, for ours (queues: to the prefill child, to the decode child)."""
    endpoints[0].put(kv.endpoint)
    return endpoints[1].get(timeout=30)


def _swap_as_prefill(endpoints, kv):
    peer = endpoints[0].get(timeout=30)
    endpoints[1].put(kv.endpoint)
    return peer


def _attempt(fn, *args) -> tuple:
    """("ok", seconds) or ("error", message, seconds); only KVTransferError is expected."""
    start = time.monotonic()
    try:
        fn(*args)
    except KVTransferError as e:
        return ("error", str(e), time.monotonic() - start)
    return ("ok", time.monotonic() - start)


def _decode_transfers(endpoints, transfers, timeout_s, shared_memory=True):
    caches = random_caches(DECODE_SEED)
    with Transport("decode", "d0", "cpu", timeout_s=timeout_s, shared_memory=shared_memory) as kv:
        peer = _swap_as_decode(endpoints, kv)
        kv.connect("p0", peer)
        outcomes = {tid: _attempt(kv.receive, "p0", peer, caches, dst, tid) for tid, _src, dst in transfers}
        return {"outcomes": outcomes, "stats": kv.stats(), "caches": to_bytes(caches)}


def _decode_transfers_concurrently(endpoints, transfers, timeout_s):
    """One thread per receive, started in the order given (receives overlap)."""
    caches = random_caches(DECODE_SEED)
    with Transport("decode", "d0", "cpu", timeout_s=timeout_s) as kv:
        peer = _swap_as_decode(endpoints, kv)
        kv.connect("p0", peer)
        outcomes = {}

        def receive(tid, dst):
            outcomes[tid] = _attempt(kv.receive, "p0", peer, caches, dst, tid)

        threads = [threading.Thread(target=receive, args=(tid, dst)) for tid, _src, dst in transfers]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join()
        return {"outcomes": outcomes, "stats": kv.stats(), "caches": to_bytes(caches)}


def _prefill_transfers(endpoints, transfers, timeout_s, faults=None, delays=None, shared_memory=True, block_shm=False,
                       node_id=""):
    """block_shm: the name of the first shared-memory slot is taken, so none can be made;
    node_id: the Ray node the sender says it runs on (the receiver's is "")."""
    caches = random_caches(PREFILL_SEED)
    blocker = shm_slots.next_slot_path(shm_slots.CAPACITY_STEP)
    if block_shm:
        open(blocker, "w").close()
    try:
        with Transport("prefill", "p0", "cpu", timeout_s=timeout_s, fault_injection=faults, shared_memory=shared_memory,
                       node_id=node_id) as kv:
            peer = _swap_as_prefill(endpoints, kv)
            kv.connect("d0", peer)
            path = kv.path_to(peer)
            outcomes = {}
            for tid, src, _dst in transfers:
                time.sleep((delays or {}).get(tid, 0.0))
                outcomes[tid] = _attempt(kv.send, "d0", peer, caches, src, tid)
            sent = {tid: to_bytes(pack_blocks(caches, src)) for tid, src, _dst in transfers}
            stats = kv.stats()
    finally:
        if block_shm:
            os.unlink(blocker)
    left = glob.glob(os.path.join(shm_slots.SHM_DIR, f"{shm_slots.PREFIX}{os.getpid()}-*"))  # this sender's files, after close
    return {"outcomes": outcomes, "stats": stats, "sent": sent, "files_left": left, "path": path}


def _prefill_parts(endpoints, transfers, timeout_s, parts, abandon_at=None, faults=None, shared_memory=True):
    """Each transfer sent in parts of `parts` blocks at most, in order, as a prefill sends
    a prompt's KV while it computes; `abandon_at` {transfer id: first block}: the sender
    gives that transfer up there (its prompt aborted), after the parts before it."""
    caches = random_caches(PREFILL_SEED)
    with Transport("prefill", "p0", "cpu", timeout_s=timeout_s, fault_injection=faults, shared_memory=shared_memory) as kv:
        peer = _swap_as_prefill(endpoints, kv)
        kv.connect("d0", peer)
        outcomes = {}
        for tid, src, _dst in transfers:
            stop = (abandon_at or {}).get(tid)
            outcome = ("ok", 0.0)
            for first in range(0, len(src), parts):
                if first == stop:
                    kv.abandon("d0", peer, caches, tid, first, len(src))
                    outcome = ("abandoned", first)
                    break
                outcome = _attempt(kv.send, "d0", peer, caches, src[first : first + parts], tid, first, len(src))
                if outcome[0] != "ok":
                    break
            outcomes[tid] = outcome
        return {"outcomes": outcomes, "stats": kv.stats()}


def _decode_late(endpoints, transfers, timeout_s, late_s):
    """Receives in order, the first of them `late_s` after the group is up (a decode worker
    that reads the prefill's first message late, or never: `transfers` may omit one)."""
    caches = random_caches(DECODE_SEED)
    with Transport("decode", "d0", "cpu", timeout_s=timeout_s) as kv:
        peer = _swap_as_decode(endpoints, kv)
        kv.connect("p0", peer)
        time.sleep(late_s)
        outcomes = {tid: _attempt(kv.receive, "p0", peer, caches, dst, tid) for tid, _src, dst in transfers}
        return {"outcomes": outcomes, "stats": kv.stats(), "caches": to_bytes(caches)}


def _decode_sessions(endpoints):
    """Transfer 1 from a prefill replica; transfer 2 from its replacement (a new transport:
    a new session), whose group replaces the first's."""
    caches = random_caches(DECODE_SEED)
    with Transport("decode", "d0", "cpu", timeout_s=5) as kv:
        first = _swap_as_decode(endpoints, kv)
        kv.receive("p0", first, caches, [0, 5, 2], 1)
        second = endpoints[1].get(timeout=30)
        kv.receive("p0", second, caches, [7, 8], 2)
        return {"stats": kv.stats(), "caches": to_bytes(caches)}


def _prefill_sessions(endpoints):
    caches = random_caches(PREFILL_SEED)
    with Transport("prefill", "p0", "cpu", timeout_s=5) as first:
        peer = _swap_as_prefill(endpoints, first)
        first.send("d0", peer, caches, [3, 7, 1], 1)
        first_stats = first.stats()
    with Transport("prefill", "p0", "cpu", timeout_s=5) as second:
        endpoints[1].put(second.endpoint)
        second.send("d0", peer, caches, [4, 6], 2)
        return {"sessions": [first_stats, second.stats()]}


# ---- tests --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pack_unpack_round_trip_is_exact(dtype):
    src, dst = random_caches(PREFILL_SEED, dtype), random_caches(DECODE_SEED, dtype)
    before = [(k.clone(), v.clone()) for k, v in dst]
    src_ids, dst_ids = [5, 0, 3, 9], [2, 7, 1, 4]

    packed = pack_blocks(src, src_ids)
    assert packed.shape == (NUM_LAYERS, 2, 4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    assert packed.dtype == dtype and packed.is_contiguous()
    unpack_blocks(dst, dst_ids, packed)

    untouched = [b for b in range(NUM_BLOCKS) if b not in dst_ids]
    for layer in range(NUM_LAYERS):
        for kv in range(2):
            for i, (s, d) in enumerate(zip(src_ids, dst_ids)):
                assert torch.equal(packed[layer, kv, i], src[layer][kv][s])
                assert torch.equal(dst[layer][kv][d], src[layer][kv][s])
            assert torch.equal(dst[layer][kv][untouched], before[layer][kv][untouched])


def test_pack_unpack_reject_bad_block_ids():
    caches = random_caches(PREFILL_SEED)
    with pytest.raises(ValueError, match="out of range"):
        pack_blocks(caches, [0, NUM_BLOCKS])
    packed = pack_blocks(caches, [1, 2])
    with pytest.raises(ValueError, match="duplicate"):
        unpack_blocks(caches, [3, 3], packed)
    with pytest.raises(ValueError, match="does not fit"):
        unpack_blocks(caches, [3, 4, 5], packed)


def test_fault_injection_selection():
    by_id = FaultInjection(fail_transfer_ids=frozenset({2, 5}))
    assert [t for t in range(1, 7) if by_id.selects(t, attempt=t)] == [2, 5]
    midway = FaultInjection(fail_transfer_ids=frozenset({2}), midway=True)
    assert not midway.selects(2, attempt=1, first=0) and midway.selects(2, attempt=2, first=4)
    every_third = FaultInjection(fail_every_nth=3)
    assert [a for a in range(1, 10) if every_third.selects(100 + a, attempt=a)] == [3, 6, 9]
    assert not any(FaultInjection().selects(t, t) for t in range(1, 10))


TRANSFERS = [(10, [3, 7, 1], [0, 5, 2]), (11, [0], [7]), (12, [2, 4, 5, 6], [1, 3, 4, 6])]


@pytest.mark.parametrize("path", ["shared_memory", "sockets", "shared_memory_unavailable", "another_ray_node"])
def test_transfers_between_processes_are_exact_and_counted(children, path):
    """On one Ray node the payload goes through shared memory; over the group's sockets when
    that is off, when no shared-memory slot can be made (here: its name is taken), or when
    the peers are on different Ray nodes, though on one host with one IP."""
    decode, prefill = children.run(
        _decode_transfers, _prefill_transfers, (TRANSFERS, 10.0),
        (TRANSFERS, 10.0, None, None, path != "sockets", path == "shared_memory_unavailable",
         "node-b" if path == "another_ray_node" else ""),
    )
    assert prefill["files_left"] == []  # the sender's slot files go with its transport
    assert prefill["path"] == ("shared_memory" if path in ("shared_memory", "shared_memory_unavailable") else "sockets")

    assert all(o[0] == "ok" for o in decode["outcomes"].values()), decode["outcomes"]
    assert all(o[0] == "ok" for o in prefill["outcomes"].values()), prefill["outcomes"]
    final, before, source = from_bytes(decode["caches"]), random_caches(DECODE_SEED), random_caches(PREFILL_SEED)
    for tid, src_ids, dst_ids in TRANSFERS:
        sent = from_bytes(prefill["sent"][tid])
        assert torch.equal(sent, pack_blocks(source, src_ids))
        assert torch.equal(pack_blocks(final, dst_ids), sent)
    assert torch.equal(pack_blocks(final, [8, 9]), pack_blocks(before, [8, 9]))

    payload = sum(payload_nbytes(len(src)) for _tid, src, _dst in TRANSFERS)
    p, d = prefill["stats"], decode["stats"]
    assert (p["transfers_ok"], p["transfers_failed"], p["bytes_sent"], p["bytes_received"]) == (3, 0, payload, 0)
    assert (d["transfers_ok"], d["transfers_failed"], d["bytes_sent"], d["bytes_received"]) == (3, 0, 0, payload)
    assert p["seconds_sending"] > 0 and d["seconds_receiving"] > 0
    assert p["groups"] == d["groups"] == 1 and p["groups_created"] == d["groups_created"] == 1
    assert p["transfers_shared_memory"] == d["transfers_shared_memory"] == (3 if path == "shared_memory" else 0)


FAULT_TRANSFERS = [(1, [3, 7, 1], [0, 5, 2]), (2, [0, 4], [7, 8]), (3, [2, 6], [1, 9])]


@pytest.mark.parametrize("shared_memory", [True, False])
def test_injected_faults_fail_both_sides_then_the_pair_recovers(children, shared_memory):
    timeout_s = 2.0
    transfers = [(1, [3, 7, 1], [0, 5, 2]), (2, [0], [7]), (3, [2], [1]), (4, [4], [8]), (5, [6, 5], [9, 3])]
    faults = FaultInjection(fail_transfer_ids=frozenset({2, 4}))
    decode, prefill = children.run(
        _decode_transfers, _prefill_transfers, (transfers, timeout_s, shared_memory),
        (transfers, timeout_s, faults, None, shared_memory),
    )

    po, do = prefill["outcomes"], decode["outcomes"]
    assert [po[t][0] for t in range(1, 6)] == [do[t][0] for t in range(1, 6)] == ["ok", "error"] * 2 + ["ok"], (po, do)
    for tid in (2, 4):
        assert "injected" in po[tid][1] and f"transfer {tid} with 'd0'" in po[tid][1]
        # The sender's failure notice ended the receive: it did not wait out its timeout.
        assert f"transfer {tid} from 'p0'" in do[tid][1] and "failed at the sender" in do[tid][1]

    final, before, source = from_bytes(decode["caches"]), random_caches(DECODE_SEED), random_caches(PREFILL_SEED)
    assert torch.equal(pack_blocks(final, [0, 5, 2, 1, 9, 3]), pack_blocks(source, [3, 7, 1, 2, 6, 5]))
    assert torch.equal(pack_blocks(final, [4, 6, 7, 8]), pack_blocks(before, [4, 6, 7, 8]))  # failed ones wrote nothing

    payload = payload_nbytes(3) + payload_nbytes(1) + payload_nbytes(2)
    p, d = prefill["stats"], decode["stats"]
    assert (p["transfers_ok"], p["transfers_failed"], p["bytes_sent"]) == (3, 2, payload)
    assert (d["transfers_ok"], d["transfers_failed"], d["bytes_received"]) == (3, 2, payload)
    # A sender-side failure leaves the group up: one group served all five transfers.
    assert p["groups_created"] == d["groups_created"] == 1 and p["groups"] == d["groups"] == 1


PART_TRANSFERS = [(1, [3, 7, 1, 0, 4], [0, 5, 2, 8, 9]), (2, [2], [7]), (3, [6, 5, 9], [1, 3, 4])]


@pytest.mark.parametrize("shared_memory", [True, False])
def test_a_transfer_in_parts_lands_as_one_send_would(children, shared_memory):
    """Parts of at most 2 blocks (the first transfer in 3, the last in 2), received by
    the same receive call as a one-part transfer: the same blocks, the same counts."""
    decode, prefill = children.run(
        _decode_transfers, _prefill_parts, (PART_TRANSFERS, 10.0, shared_memory), (PART_TRANSFERS, 10.0, 2, None, None, shared_memory)
    )
    assert all(o[0] == "ok" for o in {**prefill["outcomes"], **decode["outcomes"]}.values()), (prefill, decode)
    final, before, source = from_bytes(decode["caches"]), random_caches(DECODE_SEED), random_caches(PREFILL_SEED)
    for _tid, src, dst in PART_TRANSFERS:
        assert torch.equal(pack_blocks(final, dst), pack_blocks(source, src))
    assert torch.equal(pack_blocks(final, [6]), pack_blocks(before, [6]))
    payload = sum(payload_nbytes(len(src)) for _tid, src, _dst in PART_TRANSFERS)
    p, d = prefill["stats"], decode["stats"]
    assert (p["transfers_ok"], p["transfers_failed"], p["bytes_sent"]) == (3, 0, payload)  # a transfer counts once
    assert (d["transfers_ok"], d["transfers_failed"], d["bytes_received"]) == (3, 0, payload)
    assert p["transfers_shared_memory"] == d["transfers_shared_memory"] == (3 if shared_memory else 0)


@pytest.mark.parametrize("how", ["abandoned", "injected_midway"])
def test_a_transfer_that_fails_midway_fails_the_receive_at_once_and_the_pair_goes_on(children, how):
    """After its first part, transfer 1 ends: its prompt was aborted (the sender abandons
    it), or the link broke (a fault injected at its second part). The receiver fails it at
    once, with the first part's blocks written (the request's own, never published: the
    scheduler frees or recomputes them), and transfer 2 goes through the same group."""
    timeout_s = 5.0
    transfers = PART_TRANSFERS[:2]
    abandon_at, faults = ({1: 2}, None) if how == "abandoned" else (None, FaultInjection(frozenset({1}), midway=True))
    decode, prefill = children.run(
        _decode_transfers, _prefill_parts, (transfers, timeout_s), (transfers, timeout_s, 2, abandon_at, faults)
    )
    po, do = prefill["outcomes"], decode["outcomes"]
    assert po[1][0] == ("abandoned" if how == "abandoned" else "error") and po[2][0] == "ok", po
    assert do[1][0] == "error" and "failed at the sender" in do[1][1] and "at block 2 of 5" in do[1][1], do  # not a timeout
    assert do[2][0] == "ok", do
    final, before, source = from_bytes(decode["caches"]), random_caches(DECODE_SEED), random_caches(PREFILL_SEED)
    assert torch.equal(pack_blocks(final, [0, 5]), pack_blocks(source, [3, 7]))  # the part that came
    assert torch.equal(pack_blocks(final, [2, 8, 9]), pack_blocks(before, [2, 8, 9]))  # the rest untouched
    assert torch.equal(pack_blocks(final, [7]), pack_blocks(source, [2]))
    for stats in (prefill["stats"], decode["stats"]):
        assert (stats["transfers_ok"], stats["transfers_failed"], stats["groups_created"]) == (1, 1, 1)


def test_receiver_timeout_then_the_pair_recovers_on_the_next_transfer(children):
    """The sender is late for transfer 2: the receiver times out (and gloo closes the group's
    connections), the late send fails on the closed group, both remake it for transfer 3."""
    timeout_s = 2.0
    delays = {2: timeout_s + 0.5}
    decode, prefill = children.run(
        _decode_transfers, _prefill_transfers, (FAULT_TRANSFERS, timeout_s), (FAULT_TRANSFERS, timeout_s, None, delays)
    )

    po, do = prefill["outcomes"], decode["outcomes"]
    assert [po[t][0] for t in (1, 2, 3)] == [do[t][0] for t in (1, 2, 3)] == ["ok", "error", "ok"], (po, do)
    assert "timed out" in do[2][1].lower() and do[2][2] >= timeout_s - 0.1  # it waited its timeout, no less
    assert "timed out" not in po[2][1].lower(), po  # the late sender learns that the group is gone, at once
    final, before, source = from_bytes(decode["caches"]), random_caches(DECODE_SEED), random_caches(PREFILL_SEED)
    assert torch.equal(pack_blocks(final, [1, 9]), pack_blocks(source, [2, 6]))
    assert torch.equal(pack_blocks(final, [7, 8]), pack_blocks(before, [7, 8]))
    for stats in (prefill["stats"], decode["stats"]):
        assert (stats["transfers_ok"], stats["transfers_failed"], stats["groups_created"]) == (2, 1, 2)


@pytest.mark.parametrize("receiver", ["never_begins", "begins_too_late"])
def test_a_transfer_whose_receive_does_not_begin_sends_nothing_and_the_group_stays_up(children, receiver):
    """The handshake: transfer 1's receive never begins (its request was cancelled before
    the decode worker read the prefill's first message) or begins after the sender gave
    up: nothing is posted on the group for it (an unmatched gloo send would time out and
    close the group under every transfer of the pair), both sides fail it at once, and
    transfer 2 goes through the same group."""
    send_timeout_s = 1.0
    sent = FAULT_TRANSFERS[:2]
    received = sent[1:] if receiver == "never_begins" else sent
    decode, prefill = children.run(_decode_late, _prefill_transfers, (received, 10.0, send_timeout_s + 1.0),
                                   (sent, send_timeout_s))
    po, do = prefill["outcomes"], decode["outcomes"]
    assert po[1][0] == "error" and "no receive began" in po[1][1] and po[2][0] == "ok", po
    if receiver == "begins_too_late":
        assert do[1][0] == "error" and "gave up before this receive began" in do[1][1], do
    assert do[2][0] == "ok", do
    final, source = from_bytes(decode["caches"]), random_caches(PREFILL_SEED)
    assert torch.equal(pack_blocks(final, [7, 8]), pack_blocks(source, [0, 4]))
    for stats in (prefill["stats"], decode["stats"]):
        assert stats["groups_created"] == 1 and stats["transfers_ok"] == 1, stats


def test_header_mismatch_fails_the_transfer_then_the_pair_recovers(children):
    expected = [(1, None, [0, 5, 2]), (2, None, [7, 8]), (3, None, [1, 9])]
    sent = [(1, [3, 7, 1], None), (2, [0], None), (3, [2, 6], None)]  # 1 block where decode expects 2
    decode, prefill = children.run(_decode_transfers, _prefill_transfers, (expected, 5.0), (sent, 5.0))

    po, do = prefill["outcomes"], decode["outcomes"]
    assert do[2][0] == "error" and "total 1 (expected 2)" in do[2][1], do
    assert po[2][0] == "error" and "timed out" not in po[2][1].lower(), po  # the receiver dropped the group: no waiting out
    assert po[1][0] == do[1][0] == po[3][0] == do[3][0] == "ok", (po, do)
    final, before, source = from_bytes(decode["caches"]), random_caches(DECODE_SEED), random_caches(PREFILL_SEED)
    assert torch.equal(pack_blocks(final, [7, 8]), pack_blocks(before, [7, 8]))
    assert torch.equal(pack_blocks(final, [1, 9]), pack_blocks(source, [2, 6]))


def test_transfers_of_one_pair_match_by_id_in_any_order(children):
    """The decode side posts its receives in the reverse order of the sends."""
    expected = [(3, None, [1, 9]), (2, None, [7, 8]), (1, None, [0, 5, 2])]
    sent = [(1, [3, 7, 1], None), (2, [0, 4], None), (3, [2, 6], None)]
    decode, prefill = children.run(_decode_transfers_concurrently, _prefill_transfers, (expected, 5.0), (sent, 5.0))
    assert all(o[0] == "ok" for o in {**prefill["outcomes"], **decode["outcomes"]}.values()), (prefill, decode)
    final, source = from_bytes(decode["caches"]), random_caches(PREFILL_SEED)
    assert torch.equal(pack_blocks(final, [0, 5, 2, 7, 8, 1, 9]), pack_blocks(source, [3, 7, 1, 0, 4, 2, 6]))


def test_a_replaced_peer_gets_a_new_group(children):
    """A restarted prefill replica (a new transport, so a new session in its endpoint):
    the decode side makes a new group with it, which replaces the old one."""
    decode, prefill = children.run(_decode_sessions, _prefill_sessions)
    first, second = prefill["sessions"]
    assert first["transfers_ok"] == second["transfers_ok"] == 1 and first["groups_created"] == second["groups_created"] == 1
    stats = decode["stats"]
    assert stats["groups"] == 1 and stats["groups_created"] == 2 and stats["transfers_ok"] == 2
    final, source = from_bytes(decode["caches"]), random_caches(PREFILL_SEED)
    assert torch.equal(pack_blocks(final, [0, 5, 2, 7, 8]), pack_blocks(source, [3, 7, 1, 4, 6]))


def test_receiver_times_out_when_the_peer_never_connects():
    caches = random_caches(DECODE_SEED, torch.float32)
    before = pack_blocks(caches, list(range(NUM_BLOCKS)))
    with Transport("decode", "d0", "cpu", timeout_s=1.0) as kv, Transport("prefill", "ghost", "cpu", timeout_s=1.0) as ghost:
        with pytest.raises(KVTransferError, match="'ghost'"):
            kv.connect("ghost", ghost.endpoint)  # the ghost's transport exists, but it never connects
        with pytest.raises(KVTransferError, match="transfer 7 with 'ghost'"):
            kv.receive("ghost", ghost.endpoint, caches, [0, 1], 7)  # remakes the group: the peer is still absent
        with pytest.raises(KVTransferError, match="is not a prefill's"):
            kv.receive("nobody", kv.endpoint, caches, [0], 8)  # a decode endpoint where a prefill's belongs
        stats = kv.stats()
    assert torch.equal(pack_blocks(caches, list(range(NUM_BLOCKS))), before)
    assert (stats["transfers_ok"], stats["transfers_failed"], stats["groups"]) == (0, 1, 0)


def test_concurrent_rendezvous_one_group_per_peer_and_no_head_of_line_blocking():
    """Threads in one process. The decode side waits for a peer that never comes while two
    threads race to make the group with p0: p0's group is made once, without waiting."""
    src, dst = random_caches(PREFILL_SEED), random_caches(DECODE_SEED)
    errors = {}

    def run(name, fn, *args):
        try:
            fn(*args)
        except Exception as e:  # checked below
            errors[name] = e

    with Transport("decode", "d0", "cpu", timeout_s=5) as decode, Transport("prefill", "p0", "cpu", timeout_s=5) as prefill, \
            Transport("prefill", "ghost", "cpu", timeout_s=5) as absent:
        ghost = threading.Thread(target=run, args=("ghost", decode.connect, "ghost", absent.endpoint))
        ghost.start()
        time.sleep(0.2)  # the ghost's rendezvous is waiting on the store now
        calls = [("d0", decode.connect, "p0", prefill.endpoint), ("d1", decode.connect, "p0", prefill.endpoint)]
        calls.append(("p0", prefill.connect, "d0", decode.endpoint))
        threads = [threading.Thread(target=run, args=call) for call in calls]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert not errors and not any(t.is_alive() for t in threads), errors
        assert ghost.is_alive()  # p0's group was made while the ghost's rendezvous still waited
        assert decode.stats()["groups_created"] == prefill.stats()["groups_created"] == 1

        sender = threading.Thread(target=run, args=("send", prefill.send, "d0", decode.endpoint, src, [3, 7, 1], 1))
        sender.start()
        decode.receive("p0", prefill.endpoint, dst, [0, 5, 2], 1)
        sender.join(10)
        ghost.join(10)
    assert set(errors) == {"ghost"} and isinstance(errors["ghost"], KVTransferError), errors
    assert torch.equal(pack_blocks(dst, [0, 5, 2]), pack_blocks(src, [3, 7, 1]))


def test_groups_with_idle_peers_are_torn_down():
    """A replica that went away stops using its group: the next rendezvous with anyone
    closes groups idle for longer than idle_timeout_s."""
    dst = random_caches(DECODE_SEED)
    with Transport("decode", "d0", "cpu", timeout_s=0.5, idle_timeout_s=1.0) as decode, Transport(
        "prefill", "p0", "cpu", timeout_s=0.5, idle_timeout_s=1.0
    ) as prefill, Transport("prefill", "p1", "cpu", timeout_s=0.5) as absent:
        sender = threading.Thread(target=prefill.connect, args=("d0", decode.endpoint))
        sender.start()
        decode.connect("p0", prefill.endpoint)
        sender.join(10)
        assert decode.stats()["groups"] == prefill.stats()["groups"] == 1
        time.sleep(1.2)  # p0 goes quiet
        with pytest.raises(KVTransferError):
            decode.connect("p1", absent.endpoint)  # p1 never comes; p0's group is reaped meanwhile
        assert decode.stats()["groups"] == 0
    assert torch.equal(pack_blocks(dst, [0]), pack_blocks(random_caches(DECODE_SEED), [0]))
