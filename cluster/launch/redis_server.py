"""A private redis-server for one `pdserve serve` (or a test): free loopback port,
no persistence, a random password (in a file only this user can read, which the URL names:
cluster/kv/redis_client.py; loopback is open to every user of the host), stopped with its
owner (also when the owner is killed: Linux's parent-death signal, so a SIGKILLed
`pdserve serve` leaves no server behind)."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
import weakref

from cluster.kv.redis_client import PASSWORD_FILE
from cluster.launch.lifetime import die_with_parent
from cluster.launch.ports import free_port


class PrivateRedis:
    def __init__(self, port: int | None = None, password_file: str | None = None):
        """`port`, `password_file`: another server's, to stand in for it (its clients reconnect)."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server not found: install it (Debian/Ubuntu: apt-get install redis-server) or pass --redis-url")
        self.port = port or free_port()
        if password_file is None:
            secrets_dir = tempfile.mkdtemp(prefix="pdserve-redis-")  # mode 0700
            # Kept after a stop (clients read it when they connect, a restarted server reuses
            # it); removed with this object or at exit.
            weakref.finalize(self, shutil.rmtree, secrets_dir, ignore_errors=True)
            password_file = os.path.join(secrets_dir, "password")
            with open(os.open(password_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                f.write(secrets.token_hex(24))
        self.password_file = password_file
        with open(password_file) as f:
            password = f.read().strip()
        # The password comes on stdin (`-`: a config read from it), so that no process list shows it.
        self.proc = subprocess.Popen(
            [binary, "-", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        self.proc.stdin.write(f"requirepass {password}\n".encode())
        self.proc.stdin.close()  # the config ends here; the server starts
        self._wait_ready(password)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0?{PASSWORD_FILE}={self.password_file}"

    def _wait_ready(self, password: str, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(f"AUTH {password}\r\nPING\r\n".encode())
                    replies = b""
                    while replies.count(b"\r\n") < 2:
                        replies += s.recv(64) or b"\r\n\r\n"
                    if replies.endswith(b"+PONG\r\n"):
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
