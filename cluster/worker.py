"""What every worker replica shares, whatever its tier: its identity, its engine (one
thread, `torch_threads` intra-op threads), its entry in the prefix index, its KV
transport, its stats, and an orderly stop. prefill_worker/ and decode_worker/ add only
what their tier does.

A worker's constructor arguments are only what the replica runs on: scaling a tier
(num_replicas, autoscaling) must not change them, or Serve would restart the replicas.
"""

from __future__ import annotations

import os

import ray.util

from cluster.config import EngineConfig, TransportConfig
from cluster.engine.async_engine import AsyncEngine
from cluster.engine.engine import Engine
from cluster.kv.prefix_index import IndexPublisher
from cluster.kv.transport import FaultInjection, KVTransport
from cluster.routing import replica_unique_id, worker_id


class EngineWorker:
    tier: str  # "prefill" or "decode": set by each tier's class

    def __init__(self, engine_config: EngineConfig, transport: TransportConfig | None, redis_url: str | None):
        """`transport`: this worker moves KV blocks (None: colocated, it does not).
        `redis_url`: it publishes its prefix cache to the index there."""
        self.replica = replica_unique_id()
        self.worker_id = worker_id(self.tier, self.replica)
        self.engine = AsyncEngine(Engine(engine_config))
        self.kv_caches = self.engine.engine.runner.kv_caches
        self.block_size = engine_config.cache.block_size
        self.index = None
        if redis_url:
            self.index = IndexPublisher.for_engine(self.engine, redis_url, self.tier, self.replica, engine_config)
            self.index.start()
        self.transport = None
        if transport is not None:
            self.transport = KVTransport(
                self.tier,
                self.worker_id,
                engine_config.device,
                timeout_s=transport.timeout_s,
                # The node's address, which peers on other nodes reach (and which tells a
                # peer on this node that shared memory will do).
                host=ray.util.get_node_ip_address(),
                shared_memory=transport.shared_memory,
                fault_injection=FaultInjection(frozenset(transport.fail_transfer_ids), transport.fail_every_nth),
            )
        self._closed = False

    def publish_soon(self) -> None:
        """The prefix cache just changed (blocks cached or freed): tell the index now
        rather than at the next heartbeat."""
        if self.index is not None:
            self.index.nudge()

    async def stats(self) -> dict:
        """Queue depths, KV usage, prefix-cache and transfer counters; asserts the block invariant."""
        return {
            "worker_id": self.worker_id,
            "tier": self.tier,
            "pid": os.getpid(),
            **await self.engine.call(Engine.checked_stats),
            **self.tier_stats(),
            "transport": self.transport.stats() if self.transport else {},
            "index": self.index.counts if self.index else {},
        }

    def tier_stats(self) -> dict:
        return {}

    def stop_tier(self) -> None:
        """Stop what the tier added (its thread pools), before the engine stops."""

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop_tier()
        if self.transport is not None:
            self.transport.close()
        self.engine.shutdown()

    async def __del__(self):  # Serve awaits this when the replica stops
        if self.index is not None:
            await self.index.close()  # out of the index at once
        self.shutdown()
