"""The private redis-server never outlives its owner, even one killed with SIGKILL."""

import signal
import socket
import subprocess
import sys

from tests.helpers import wait_until

OWNER = "from cluster.redis_server import PrivateRedis; r = PrivateRedis(); print(r.port, flush=True); import time; time.sleep(120)"


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
