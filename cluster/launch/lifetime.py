"""Processes that must not outlive the `pdserve serve` that started them, even when it is
killed outright (kill -9, the OOM killer).

- A child we spawn ourselves (the private redis-server) gets Linux's parent-death signal:
  `die_with_parent`.
- What a local Ray spawns, we do not spawn: GCS, raylet, workers, their agents, and the
  HAProxy that Serve starts per node. Most of it stops when the driver dies, not all:
  after a `kill -9` of `pdserve serve`, HAProxy (still holding the HTTP and gRPC ports,
  so the next `serve` on them fails) and Ray's dashboard and runtime-env agents (taking
  ~2% of a core between them) stayed for good. So `serve` starts a reaper, a small process
  that notes the driver's descendants every POLL_S and, once the driver is gone, stops
  those still running. A descendant that starts and is orphaned within one poll escapes it.
  A SIGTERM while the driver lives (a signal to the whole process group) does not start
  the reaping: the driver is stopping and will say when it is gone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

import psutil

PR_SET_PDEATHSIG = 1
POLL_S = 2.0
STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL for what still runs after this


def die_with_parent() -> None:
    """In a child before exec: SIGTERM when the thread that started it exits. (So an
    owner must start it from a thread that lives as long as it does, e.g. the main one.)"""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the owner's own stop remains the only way out
        pass


def start_reaper() -> subprocess.Popen:
    """A reaper of this process's descendants (from the main thread: see die_with_parent)."""
    return subprocess.Popen(
        [sys.executable, "-m", "cluster.launch.lifetime", str(os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=die_with_parent,  # told at once when the owner dies, not at the next poll
    )


def running(process: psutil.Process) -> bool:
    """Still the same process (psutil compares start times: a reused pid is not it), and not a zombie."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _owner_signalled(timeout_s: float) -> bool:
    """Waits up to `timeout_s` for the parent-death signal (blocked, so taken here: no
    handler runs at an arbitrary point, and a second signal cannot cut the reaping short)."""
    if not hasattr(signal, "sigtimedwait"):  # not Linux: the owner is polled only
        time.sleep(timeout_s)
        return False
    return signal.sigtimedwait([signal.SIGTERM], timeout_s) is not None


def reap_after(owner_pid: int) -> None:
    """Note `owner_pid`'s descendants until it is gone; then stop those still running."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the owner, which stops cleanly
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    owner, me = psutil.Process(owner_pid), os.getpid()
    started: dict[int, psutil.Process] = {}
    while running(owner):
        try:
            for child in owner.children(recursive=True):
                if child.pid != me:
                    started[child.pid] = child  # the latest holder of a pid: an earlier one has ended
        except psutil.Error:  # the owner went while we looked
            break
        _owner_signalled(POLL_S)  # the parent-death signal, or a group's SIGTERM: the loop checks which
    stop_processes(started.values(), STOP_GRACE_S)


def stop_processes(processes, grace_s: float) -> None:
    """SIGTERM to those of `processes` still running, then SIGKILL to any left after `grace_s`."""
    leftovers = [p for p in processes if running(p)]
    for process in leftovers:
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, still_running = psutil.wait_procs(leftovers, timeout=grace_s)
    for process in still_running:
        try:
            process.kill()
        except psutil.Error:
            pass


if __name__ == "__main__":
    reap_after(int(sys.argv[1]))
