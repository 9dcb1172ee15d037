"""What every worker replica shares, whatever its tier: its identity, its engine (one
thread, `torch_threads` intra-op threads per tensor-parallel rank), its entry in the
prefix index, its KV transport (one per rank: each rank moves its own KV heads,
cluster/kv/tp_transfer.py), its stats, its health, and an orderly stop.
prefill_worker/ and decode_worker/ add only what their tier does.

A worker's constructor arguments are only what the replica runs on: scaling a tier
(num_replicas, autoscaling) must not change them, or Serve would restart the replicas.
"""

from __future__ import annotations

import os

import ray.util

from cluster.config import EngineConfig, TransportConfig
from cluster.engine.async_engine import AsyncEngine
from cluster.engine.engine import Engine
from cluster.engine.step_timeline import StepRecord
from cluster.engine.step_times import Histograms
from cluster.kv.prefix_index import IndexPublisher
from cluster.kv.tp_transfer import Part, recv_pieces, send_pieces
from cluster.kv.transport.builder import open_transport
from cluster.kv.transport.interface import KVEndpoint, KVTransferError
from cluster.model.sharding import kv_routes
from cluster.planner.costs import StepCostModel
from cluster.planner.load import LoadMeter
from cluster.serving import tracing
from cluster.serving.routing import RouteHint, replica_unique_id, worker_id


class EngineWorker:
    tier: str  # "prefill" or "decode": set by each tier's class
    # Until the constructor completes. A replica whose constructor failed has nothing to
    # stop: Serve ends its process, and the actors it owns (TP ranks) with it.
    _closed = True

    def __init__(self, engine_config: EngineConfig, transport: TransportConfig | None, redis_url: str | None):
        """`transport`: this worker moves KV blocks (None: colocated, it does not).
        `redis_url`: it publishes its prefix cache to the index there."""
        self.replica = replica_unique_id()
        self.worker_id = worker_id(self.tier, self.replica)
        tracing.configure(f"pdserve-{self.tier}")
        self.phases = Histograms(tracing.PHASES[self.tier])  # its requests' phase durations (stats: phase_seconds)
        self.engine = AsyncEngine(lambda: Engine(engine_config))
        layout = self.engine.kv_layout
        self.kv_caches = layout.caches
        self.shard = layout.shard  # rank 0's; ranks 1..N-1 (their actors) hold the others
        self.num_kv_heads = layout.num_kv_heads
        self._rank_actors = layout.rank_actors
        self.block_size = engine_config.cache.block_size
        # What the SLO planner reads (record_autoscaling_stats): this engine's step costs, the load seen.
        scheduler = engine_config.scheduler
        chunk = min(scheduler.max_num_batched_tokens, scheduler.long_prefill_token_threshold or scheduler.max_num_batched_tokens)
        self.costs = StepCostModel(chunk_tokens=chunk)
        self.load = LoadMeter()
        self._costs_seen_until = 0.0  # wall-clock start of the last step fitted
        self._lookups_seen = (0, 0)  # the scheduler's prefix-cache counters (looked up, found) at the last report
        self._block_bytes = sum(k[0].nbytes + v[0].nbytes for k, v in self.kv_caches)  # rank 0's heads
        self.index = None
        if redis_url:
            self.index = IndexPublisher.for_engine(self.engine, redis_url, self.worker_id, self.tier, self.replica, engine_config)
            self.index.start()
        self.transport = None
        if transport is not None:
            self.transport = open_transport(self.tier, self.worker_id, engine_config.device, transport,
                                            host=ray.util.get_node_ip_address(), node_id=ray.get_runtime_context().get_node_id())
            others = [a.open_transport.remote(self.tier, self.worker_id, transport) for a in self._rank_actors]
            self.rank_endpoints: tuple[KVEndpoint, ...] = (self.transport.endpoint, *ray.get(others))  # each rank's
            self._transfer_wait_s = 4 * transport.timeout_s  # a rank's pieces: rendezvous + send, each bounded
        self._closed = False

    # ---- KV hand-off, every rank at once (cluster/kv/tp_transfer.py) -------------------

    def transfer_attributes(self, num_blocks: int, peer: KVEndpoint) -> dict:
        """A KV transfer's trace attributes: its blocks, the bytes rank 0 moves, the path
        (none with tracing off: nothing to compute per request)."""
        if not tracing.enabled():
            return {}
        return {"blocks": num_blocks, "bytes_rank0": num_blocks * self._block_bytes, "path": self.transport.path_to(peer)}

    def send_kv(self, decode_id: str, decode_endpoints: tuple[KVEndpoint, ...], part: Part, transfer_id: int,
                abandon: bool = False) -> None:
        """Send a part of a transfer to decode worker `decode_id` (of as many ranks as
        endpoints; `abandon`: end the transfer before it): each rank of this replica sends
        its pieces. KVTransferError if any piece failed."""
        routes = kv_routes(self.num_kv_heads, self.shard.size, len(decode_endpoints))
        self._on_every_rank(
            [r for r in routes if r.src == 0],
            lambda mine: send_pieces(
                self.transport, self.kv_caches, self.shard.kv_head_start, mine, decode_id, decode_endpoints, part, transfer_id,
                abandon,
            ),
            [[r for r in routes if r.src == rank] for rank in range(1, self.shard.size)],
            lambda actor, pieces: actor.send_pieces.remote(pieces, decode_id, decode_endpoints, part, transfer_id, abandon),
        )

    def recv_kv(self, prefill_id: str, prefill_endpoints: tuple[KVEndpoint, ...], block_ids: list[int], transfer_id: int) -> None:
        """Receive blocks from prefill worker `prefill_id` (of as many ranks as endpoints) on
        every rank of this replica. KVTransferError if any piece failed."""
        routes = kv_routes(self.num_kv_heads, len(prefill_endpoints), self.shard.size)
        self._on_every_rank(
            [r for r in routes if r.dst == 0],
            lambda mine: recv_pieces(
                self.transport, self.kv_caches, self.shard.kv_head_start, mine, prefill_id, prefill_endpoints, block_ids,
                transfer_id,
            ),
            [[r for r in routes if r.dst == rank] for rank in range(1, self.shard.size)],
            lambda actor, pieces: actor.recv_pieces.remote(pieces, prefill_id, prefill_endpoints, block_ids, transfer_id),
        )

    def _on_every_rank(self, mine, run_mine, theirs, start_theirs) -> None:
        """Start the other ranks' pieces, run rank 0's here, then wait for all of them
        (whatever happened here: their blocks stay in use until every rank is done)."""
        refs = [start_theirs(actor, pieces) for actor, pieces in zip(self._rank_actors, theirs) if pieces]
        error = None
        try:
            run_mine(mine)
        except KVTransferError as e:
            error = e
        finally:
            for ref in refs:
                try:
                    ray.get(ref, timeout=self._transfer_wait_s)
                except Exception as e:  # noqa: BLE001 - the rank's KVTransferError (wrapped), or the rank is gone
                    error = error or KVTransferError(f"{self.worker_id}: a tensor-parallel rank's KV pieces failed: {e}")
        if error is not None:
            raise error

    def publish_soon(self) -> None:
        """The prefix cache just changed (blocks cached or freed): tell the index now
        rather than at the next heartbeat."""
        if self.index is not None:
            self.index.nudge()

    async def stats(self, route: RouteHint | None = None) -> dict:
        """Queue depths, KV usage, prefix-cache and transfer counters; asserts the block
        invariant. `route` only steers Serve's request router to this replica."""
        return {
            "worker_id": self.worker_id,
            "tier": self.tier,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "ranks": self.engine.rank_info(),
            **await self.engine.call(Engine.checked_stats),
            **self.tier_stats(),
            "transport": self.transport.stats() if self.transport else {},
            # Ranks 1..N-1 move their own KV heads, on transports of their own.
            "rank_transports": [await self._rank_call(a.transport_stats) for a in self._rank_actors],
            "index": self.index.counts if self.index else {},
            "phase_seconds": self.phases.snapshot(),
        }

    async def step_timeline(self, route: RouteHint | None = None, since: float = 0.0) -> dict:
        """The engine's steps that began at or after wall-clock time `since`, as rows of
        cluster/engine/step_timeline.py's fields. `route` only steers Serve's request router."""
        steps = await self.engine.call(lambda e: e.timeline.since(since))
        return {"worker_id": self.worker_id, "fields": StepRecord._fields, "steps": [tuple(s) for s in steps]}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics (called every metrics_interval_s where the
        tier autoscales; the SLO planner reads them, cluster/planner/policy.py): the
        engine's step costs, fitted from the steps since the last call, and the load of
        the last cluster/planner/load.py WINDOW_S."""
        seen = self._costs_seen_until

        def read(engine) -> tuple[list, int, int]:
            return engine.timeline.since(seen), engine.scheduler.prefix_query_tokens, engine.scheduler.prefix_hit_tokens

        timeline, looked_up, found = await self.engine.call(read)
        steps = [s for s in timeline if s.t > seen]  # each step once
        if steps:
            self._costs_seen_until = steps[-1].t
        self.costs.observe(steps)
        self.load.prefix_lookups(looked_up - self._lookups_seen[0], found - self._lookups_seen[1])
        self._lookups_seen = (looked_up, found)
        return {**self.costs.report(), **self.load.report()}

    @staticmethod
    async def _rank_call(method) -> dict:
        try:
            return await method.remote()
        except Exception as e:  # noqa: BLE001 - a lost rank: its stats say so, the others' still count
            return {"error": f"{type(e).__name__}: {e}"}

    def check_health(self) -> None:
        """Serve's periodic health check: a replica whose engine is dead (a tensor-parallel
        rank lost) fails it, and Serve replaces the whole replica."""
        self.engine.check_health()

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
        if self._closed:
            return
        if self.index is not None:
            await self.index.close()  # out of the index at once
        self.shutdown()
