"""A private redis-server for one `pdserve serve` (or a test): free loopback port,
no persistence, stopped with its owner (also when the owner is killed: Linux's parent-
death signal, so a SIGKILLed `pdserve serve` leaves no server behind)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

from cluster.lifetime import die_with_parent
from cluster.ports import free_port


class PrivateRedis:
    def __init__(self, port: int | None = None):
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server not found: install it (Debian/Ubuntu: apt-get install redis-server) or pass --redis-url")
        self.port = port or free_port()
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        self._wait_ready()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server did not answer on port {self.port} within {timeout_s}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def __enter__(self) -> PrivateRedis:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
