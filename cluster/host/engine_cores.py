"""Decode engines on cores of their own; prefill engines yield to everything else.

A decode step is short and every ITL is one. On a host where a prefill engine computes
long prompts beside it, the scheduler put the gateway, HAProxy, Ray's processes and the
load client wherever a core was free, often on the decode engine's core, and the decode
step waited: served 1P1D on 2 cores (1 thread each, AMD EPYC), the decode engine's steps
lost up to 11 ms to other processes (step wall time minus its thread's CPU time: p99 11.4
ms, 3.2 ms without the long prompts), and 1536-token prompts raised the decodes' p99 ITL
1.31x.

So a local cluster's driver

- keeps everything else off those cores (`keep_off`): before it starts anything (redis,
  Ray, the replicas; a benchmark's load client runs in it) it narrows its own affinity to
  the other cores, which every process it starts inherits, and so every thread they start:
  the gateway, HAProxy, Ray's processes, the load client, and the workers' event loops.
  Served 1P1D on 2 cores with long prompts arriving, 50-59 of ~60 slow decode steps (over
  1.2x their alone median) had been off their core, not computing (`pdserve bench
  protect`'s step timelines). Only the decode worker's KV receives widen back to every
  core (`share_decode_cores`): the decode engine waits on them;
- tells the decode tier which cores are theirs ($PDSERVE_ENGINE_CORES): the last cores of
  the host. Each engine thread claims as many as it has torch threads (`claim_cores`: an
  exclusive lock file per core, which the kernel releases when the process dies, so a
  restarted replica finds its core free) and binds itself to them; its OpenMP team
  inherits the binding. An engine thread that claims nothing (a prefill engine, a decode
  engine that found its cores held) widens back to every core of the host
  ($PDSERVE_HOST_CORES);
- the prefill tier to yield ($PDSERVE_ENGINE_YIELDS): its engine threads run at
  SCHED_IDLE, on every core, so the control path always goes first, and a core that
  looks busy only with a prompt is where the scheduler puts what wakes up, not the decode
  engine's. Prompts take every cycle nothing else wants, the decode engine's core
  included while it idles, and only those: beside processes that keep the other cores
  busy (a heavy load client on the same host) they wait.

When (`plan`, by `--engine-cores`):
  auto    (the default) when the decode threads leave a core to spare and every engine
          thread of the cluster, prefill's included, has a core: 1P1D with one thread
          each on 2 cores. With more engine threads than cores the split is too hard:
          under skew to one hot prefix, 2 prefill + 1 decode replicas on 2 cores, kv_aware's
          p99 TTFT was 2.5x the unplaced figure (one core for 1 decode thread, 2 yielding
          prefill threads on the leftovers).
  own     whenever the decode threads leave a core to spare.
  shared  never.
Nothing is bound otherwise, nor on GPU: a yielding prefill engine beside decode engines
that fill every core would starve.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import BinaryIO

log = logging.getLogger(__name__)

CORES_ENV = "PDSERVE_ENGINE_CORES"  # "2,3": the cores this host's decode engines claim from
YIELDS_ENV = "PDSERVE_ENGINE_YIELDS"  # "1": this engine's threads run at SCHED_IDLE
HOST_CORES_ENV = "PDSERVE_HOST_CORES"  # "0,1,2,3": every core an engine thread may run on (its process starts narrower)
LOCK_DIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
HOST_CORES = tuple(sorted(os.sched_getaffinity(0)))


@dataclass(frozen=True)
class CorePlan:
    decode: tuple[int, ...]  # the decode engines' cores, one per thread
    host: tuple[int, ...] = HOST_CORES  # every core of the host

    @property
    def rest(self) -> tuple[int, ...]:
        """The cores for everything but the decode engines."""
        return tuple(c for c in self.host if c not in self.decode)

    @property
    def decode_env(self) -> dict[str, str]:
        return {CORES_ENV: _cores_text(self.decode), HOST_CORES_ENV: _cores_text(self.host)}

    @property
    def prefill_env(self) -> dict[str, str]:
        return {YIELDS_ENV: "1", HOST_CORES_ENV: _cores_text(self.host)}


def _cores_text(cores: Iterable[int]) -> str:
    return ",".join(map(str, cores))


def _cores_of(text: str) -> list[int]:
    """The cores a variable names ("0,1,2")."""
    return [int(c) for c in text.split(",")]


def keep_off(plan: CorePlan | None) -> set[int]:
    """In the driver, before it starts anything: the processes it starts from here on (and
    the threads it starts) run off the decode engines' cores. Threads already running keep
    theirs. Without a plan nothing changes. Returns the calling thread's cores before (to
    restore with os.sched_setaffinity(0, ...) once the cluster is gone)."""
    before = os.sched_getaffinity(0)
    if plan is not None:
        os.sched_setaffinity(0, plan.rest)  # 0: the calling thread, whose mask children inherit
    return before


def plan(decode_threads: int, engine_threads: int, mode: str = "auto",
         cores: Sequence[int] = HOST_CORES) -> CorePlan | None:
    """The last `decode_threads` of `cores` for the decode engines, when `mode` (see the
    module docstring) places them: None for shared, when no core would be left to the rest,
    and, for auto, when the cluster's `engine_threads` outnumber the cores."""
    cores = sorted(cores)
    if mode == "shared" or not 0 < decode_threads < len(cores):
        return None
    if mode == "auto" and engine_threads > len(cores):
        return None
    return CorePlan(tuple(cores[-decode_threads:]), tuple(cores))


@dataclass
class CoreClaim:
    """Cores held exclusively (among pdserve engines of this host) while the lock files are
    open: until release(), the claim's garbage collection, or the process's end."""

    cores: tuple[int, ...]
    _locks: list[BinaryIO]

    def release(self) -> None:
        for lock in self._locks:
            lock.close()  # closing the file drops its flock
        self._locks.clear()


def claim_cores(count: int, candidates: Iterable[int], lock_dir: str = LOCK_DIR) -> CoreClaim | None:
    """`count` of `candidates` that no other live process holds, locked; None if fewer are free."""
    claim = CoreClaim((), [])
    for core in candidates:
        if len(claim.cores) == count:
            break
        lock = open(os.path.join(lock_dir, f"pdserve-core-{core}.lock"), "ab")  # noqa: SIM115 - held by the claim
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another engine's
            lock.close()
            continue
        claim._locks.append(lock)
        claim.cores += (core,)
    if len(claim.cores) < count:
        claim.release()
        return None
    return claim


@dataclass
class EngineThreadPlacement:
    """Where an engine thread runs, as `place_engine_thread` left it."""

    claim: CoreClaim | None = None
    yields: bool = False

    @property
    def cores(self) -> list[int] | None:
        return list(self.claim.cores) if self.claim else None

    def info(self) -> dict:
        """What a rank reports of it in `pdserve status`."""
        return {"cores": self.cores, "yields": self.yields}

    def release(self) -> None:
        if self.claim is not None:
            self.claim.release()


def place_engine_thread(threads: int, device: str = "cpu", environ: Mapping[str, str] | None = None,
                        lock_dir: str = LOCK_DIR) -> EngineThreadPlacement:
    """On an engine thread, before its first parallel op (threads it starts inherit both):
    with $PDSERVE_ENGINE_CORES, claim `threads` of those cores and run on them (if too few
    are free, on every core of $PDSERVE_HOST_CORES); with $PDSERVE_ENGINE_YIELDS, run at
    SCHED_IDLE on every core of $PDSERVE_HOST_CORES. Without them, or off CPU, nothing
    changes."""
    environ = os.environ if environ is None else environ
    placement = EngineThreadPlacement()
    if device != "cpu":
        return placement
    if spec := environ.get(CORES_ENV, ""):
        placement.claim = claim_cores(threads, _cores_of(spec), lock_dir)
        if placement.claim is None:
            log.warning("no %d free core(s) among %s for this engine: it runs on any core", threads, spec)
        else:
            os.sched_setaffinity(0, placement.claim.cores)  # 0: the calling thread
    if environ.get(YIELDS_ENV) == "1":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread
        placement.yields = True
    if placement.claim is None and (host := environ.get(HOST_CORES_ENV, "")):
        os.sched_setaffinity(0, _cores_of(host))  # the process started off the decode cores
    return placement


_PR_SET_NAME = 15  # prctl(2)


def share_decode_cores(name: str, environ: Mapping[str, str] | None = None) -> None:
    """On a thread doing what the decode engine waits for (a decode worker's KV receives:
    its requests join the batch once their KV is in): run on every core of
    $PDSERVE_HOST_CORES, the decode engine's included, and name the thread `name` for
    ps/top (and the test that checks who else runs there); gloo's I/O threads, which a
    pair's first receive starts, inherit its cores. Kept off the decode core, a
    receive queued behind the host's other work: served 1P1D on 2 cores beside 16 decodes
    (AMD EPYC Zen 4), the KV of 190 of 211 hand-offs was still coming when their first
    token was accepted, 41 ms more on average; with this 118 of 208, 12 ms more, and the
    second token came 103 -> 63 ms after the first (mean of all). A receive's copy takes
    ~5 ms of the decode core. Without the variable (no core plan), only the name is set."""
    environ = os.environ if environ is None else environ
    if host := environ.get(HOST_CORES_ENV, ""):
        os.sched_setaffinity(0, _cores_of(host))  # 0: the calling thread
    prctl = getattr(ctypes.CDLL(None), "prctl", None)  # the process's own libc (dlopen(NULL): no search)
    if prctl is not None:  # the name is for people only: without prctl nothing else changes
        prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
