"""`pdserve serve` as an operator runs it: a local Ray, a private redis-server, both
tiers up; `pdserve status` reports them; Ctrl-C stops everything."""

import json
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

PDSERVE = [sys.executable, "-m", "cluster.cli"]


def read_until(proc, pattern, timeout_s):
    """Lines of the process's stderr up to the first matching `pattern`."""
    deadline = time.monotonic() + timeout_s
    lines = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        lines.append(line)
        if re.search(pattern, line):
            return lines
    raise AssertionError(f"no {pattern!r} within {timeout_s}s:\n{''.join(lines[-40:])}")


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_serve_status_and_clean_stop(tiny_llama):
    proc = subprocess.Popen(
        [*PDSERVE, "serve", "--model", str(tiny_llama), "--dtype", "float32", "--http-port", "0"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        lines = read_until(proc, r"pdserve is up", timeout_s=240)
        redis_port = int(re.search(r"redis://127\.0\.0\.1:(\d+)", "".join(lines)).group(1))
        assert port_open(redis_port)
        status = subprocess.run([*PDSERVE, "status"], capture_output=True, text=True, timeout=120)
        assert status.returncode == 0, status.stderr
        stats = json.loads(status.stdout)
        assert len(stats["prefill"]) == 1 and len(stats["decode"]) == 1
        (decode,) = stats["decode"].values()
        assert decode["used_blocks"] == 0 and decode["num_blocks"] > 0
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
        assert not port_open(redis_port)  # the private redis-server went with it
    finally:
        if proc.poll() is None:
            proc.kill()
            pytest.fail("pdserve serve did not stop on Ctrl-C")
