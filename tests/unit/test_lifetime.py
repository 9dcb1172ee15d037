"""The reaper (cluster/launch/lifetime.py) with real processes: an owner that starts it and a
child of its own, then dies by SIGKILL."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

from cluster.launch.lifetime import POLL_S, STOP_GRACE_S

OWNER = textwrap.dedent("""
    import subprocess, sys, time
    from cluster.launch.lifetime import start_reaper
    reaper = start_reaper()
    child = subprocess.Popen(["sleep", "600"], start_new_session=True)  # outlives its parent by default
    print(reaper.pid, child.pid, flush=True)
    time.sleep(600)
""")


def start_owner():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    reaper_pid, child_pid = map(int, owner.stdout.readline().split())
    time.sleep(POLL_S + 1)  # the reaper has noted the child
    return owner, psutil.Process(reaper_pid), psutil.Process(child_pid)


def test_a_killed_owner_leaves_no_child_behind_and_the_reaper_ends():
    owner, reaper, child = start_owner()
    owner.kill()
    owner.wait()
    # More SIGTERMs after the parent-death signal, for a while: they must not cut the reaping
    # short (a reaper whose handler set a threading.Event once deadlocked on such a signal).
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            reaper.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.0005)
    _, alive = psutil.wait_procs([child, reaper], timeout=STOP_GRACE_S + 2 * POLL_S)
    assert not alive, alive

