"""The one place a worker rank's KV transport is chosen and built, from its TransportConfig."""

from __future__ import annotations

import torch

from cluster.config import TransportConfig
from cluster.kv.transport.faults import FaultInjection
from cluster.kv.transport.interface import KVTransport, Role
from cluster.kv.transport.torch_dist import TorchDistTransport


def open_transport(
    role: Role, worker_id: str, device: torch.device | str, config: TransportConfig, host: str, node_id: str = "",
) -> KVTransport:
    """The transport of a worker rank: `host` is its node's address, which peers reach;
    `node_id` its Ray node (peers on another Ray node never share its memory)."""
    return TorchDistTransport(
        role, worker_id, device, timeout_s=config.timeout_s, host=host, shared_memory=config.shared_memory,
        fault_injection=FaultInjection.of(config), node_id=node_id,
    )
