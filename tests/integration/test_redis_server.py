"""The private redis-server never outlives its owner, even one killed with SIGKILL, and
wants a password that only its URL's file holds."""

import os
import signal
import socket
import subprocess
import sys

import psutil
import pytest
import redis

from cluster.kv import redis_client
from cluster.launch.redis_server import PrivateRedis
from tests.helpers import wait_until

OWNER = "from cluster.launch.redis_server import PrivateRedis; r = PrivateRedis(); print(r.port, flush=True); import time; time.sleep(120)"


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_killed_owner_takes_its_redis_server_with_it():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(owner.stdout.readline())
        assert port_open(port)
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
        assert wait_until(lambda: not port_open(port), timeout_s=10)
    finally:
        owner.kill()


def test_the_private_server_wants_the_password_its_url_names(tmp_path):
    """Loopback is open to every user of the host: the private server has a password, in a
    file only its user reads, which its URL names (never the password itself)."""
    with PrivateRedis() as server:
        password = open(server.password_file).read()
        assert password and password not in server.url
        assert os.stat(server.password_file).st_mode & 0o077 == 0
        assert redis_client.connect_sync(server.url).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port).ping()
        assert all(password not in " ".join(p.cmdline()) for p in psutil.process_iter() if p.pid == server.proc.pid)
    missing = f"redis://127.0.0.1:1/0?password_file={tmp_path / 'none'}"
    with pytest.raises(ValueError, match="the Redis password file .*none cannot be read"):
        redis_client.connect(missing)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        redis_client.connect(f"redis://127.0.0.1:1/0?password_file={tmp_path / 'empty'}&db=0")
    assert redis_client.split_password_file("redis://h:1/0?socket_timeout=1") == ("redis://h:1/0?socket_timeout=1", None)
