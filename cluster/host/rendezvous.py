"""A torch.distributed TCPStore that listens on one address only.

torch's TCPStore server binds every interface (`::`) whatever host it is given; handed a
socket already bound and listening (`master_listen_fd`), it serves on that one instead.
The KV pairs' and the tensor-parallel groups' stores listen on the worker's node IP: the
loopback address on a local cluster, so nothing of theirs is reachable from the network.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

LISTEN_BACKLOG = 128

StoreAddress = tuple[str, int]  # a TCPStore's (host, port): where peers rendezvous


def listening_store(host: str, timeout: timedelta) -> dist.TCPStore:
    """A store server on `host` at a free port (`store.port`); it owns its socket, which
    closes with it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(LISTEN_BACKLOG)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout, master_listen_fd=sock.detach())
