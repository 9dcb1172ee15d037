"""One OpenMP master per worker process: the engine thread.

libgomp (torch's OpenMP runtime) spins at a barrier only while the threads it manages are
no more than the CPUs. Any other thread that once ran a torch op in parallel keeps a team
of its own, idle but counted; from then on every barrier of every step sleeps in the kernel
and waits to be woken (a batch-8 step of 2 threads, AMD EPYC: 13.1-13.7 ms alone, 14.9-15.5
ms beside one idle team, ~250 futex sleeps a step; served, the engine's threads were asleep
half the time). So the engine thread builds the engine and runs every parallel op
(cluster/engine/async_engine.py), and other threads that touch tensors (a KV transfer's
copies) run their ops on themselves alone, in `serial_torch()`.

Spinning at barriers is right while every compute thread has a core. When replicas on one
machine have more torch threads than it has cores, a thread spinning for its team holds a
core that another replica's thread needs: there they wait passively (`waiting_env`).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import cache

import torch


@cache
def _libgomp() -> ctypes.CDLL | None:
    """torch's libgomp, if torch loaded one (RTLD_NOLOAD: never a second runtime)."""
    try:
        return ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except (OSError, AttributeError):  # another OpenMP runtime, or none: nothing to do
        return None


@contextmanager
def serial_torch() -> Iterator[None]:
    """torch's CPU ops in this block run on the calling thread only: no OpenMP team is made
    for it. The thread's own OpenMP thread count (an OpenMP ICV, per thread) is set to 1
    and restored after; other threads and torch's global setting are untouched."""
    lib = _libgomp()
    if lib is None:
        yield
        return
    torch.get_num_threads()  # torch sets a thread's count at its first op: let it, then override
    before = lib.omp_get_max_threads()
    lib.omp_set_num_threads(1)
    try:
        yield
    finally:
        lib.omp_set_num_threads(before)


WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # the user's choice, if set, stands


def wait_settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """How OpenMP threads wait under `environ` (default: this process's environment)."""
    environ = os.environ if environ is None else environ
    return {name: environ[name] for name in WAIT_SETTINGS if name in environ}


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, as libgomp counts them)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def waiting_env(compute_threads: int, cpus: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The OpenMP environment for worker processes whose torch threads, all replicas' on one
    machine, number `compute_threads` on its `cpus` cores: passive waiting past the cores
    (nothing while they suffice, or when `environ`, default os.environ, sets it already)."""
    if compute_threads <= cpus or wait_settings(environ):
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}
