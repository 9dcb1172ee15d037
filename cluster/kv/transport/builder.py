"""The one place a worker rank's KV transport is chosen and built, from its TransportConfig."""

from __future__ import annotations

import torch

from cluster.config import TransportConfig
from cluster.kv.transport.faults import FaultInjection
from cluster.kv.transport.interface import KVTransport, Role
from cluster.kv.transport.torch_dist import TorchDistTransport


def open_transport(role: Role, worker_id: str, device: torch.device | str, config: TransportConfig, host: str) -> KVTransport:
    """The transport of a worker rank: `host` is its node's address, which peers on other
    nodes reach (and which tells a peer on this node that shared memory will do)."""
    return TorchDistTransport(
        role, worker_id, device, timeout_s=config.timeout_s, host=host, shared_memory=config.shared_memory,
        fault_injection=FaultInjection.of(config),
    )
