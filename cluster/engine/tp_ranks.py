"""A tensor-parallel replica's ranks 1..N-1: Ray actors that hold their model and KV-cache
shards and run every step rank 0 plans. Rank 0 is the engine's own process (it
schedules, samples and streams); `TensorParallelRanks` is its handle on the others.

    rank 0 (Engine)                                   rank r (RankWorker actor)
    host the rendezvous store; start the actors --->  join the group; load shard r
    join the group; load shard 0                      follow(): loop
    step: broadcast plan, forward, gather logits <--> receive plan, forward, all-gather
    close: broadcast None, kill the actors            loop ends

Placement: inside a Serve replica whose deployment has a placement group (one bundle
per rank, STRICT_PACK by default), rank r takes bundle r; elsewhere (`pdserve generate`,
`pdserve bench engine`) a placement group of the other ranks is made here. Every rank
sets its own torch thread count; on GPU each rank gets one device.

A rank that dies (or stalls past the group timeout) fails rank 0's next collective:
RankLostError, the engine stops, and `check` tells the worker's health check so that
Serve replaces the whole replica.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor

import ray
import ray.util
import torch
from ray.util.placement_group import PlacementGroup, get_current_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import EngineConfig, TransportConfig
from cluster.engine.runner import ModelRunner, kv_cache_dtype
from cluster.errors import RankLostError
from cluster.host import local_ray
from cluster.host.engine_cores import place_engine_thread
from cluster.host.memory import keep_freed_memory
from cluster.host.openmp import wait_settings
from cluster.kv.tp_transfer import rank_peer_id, recv_pieces, send_pieces
from cluster.kv.transport.builder import open_transport
from cluster.kv.transport.interface import KVEndpoint
from cluster.model.loader import load_model
from cluster.model.tp_group import TensorParallelGroup

# A rank runs its step loop and, in other threads, its KV transfers and stats calls.
RANK_ACTOR_CONCURRENCY = 16


@ray.remote(max_concurrency=RANK_ACTOR_CONCURRENCY)
class RankWorker:
    def __init__(self, config: EngineConfig, rank: int, address: tuple[str, int]):
        # One thread loads the model and runs the steps: the process's only OpenMP master
        # (cluster/host/openmp.py); the actor's other threads serve transfers and stats.
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdserve-rank")
        self.rank = rank
        self.config = config
        self.transport = None
        self._compute.submit(self._load, address).result()

    def _load(self, address: tuple[str, int]) -> None:
        config = self.config
        self.placement = place_engine_thread(config.num_threads or torch.get_num_threads(), config.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.device == "cpu":
            keep_freed_memory()
        self.group = TensorParallelGroup.join(
            address, self.rank, config.tensor_parallel_size, config.device, config.tp_timeout_s,
            shared_memory=config.tp_shared_memory,
        )
        loaded = load_model(config.model, config.dtype, config.device, config.max_model_len, self.group, config.quantization)
        self.shard = loaded.model.shard
        self.runner = ModelRunner(loaded, config.cache.num_blocks, config.cache.block_size, config.device,
                                  kv_dtype=kv_cache_dtype(config.cache, loaded.dtype))

    # ---- KV transfers: this rank's pieces of a hand-off (cluster/kv/tp_transfer.py) ----

    def open_transport(self, role: str, worker_id: str, transport: TransportConfig) -> KVEndpoint:
        """This rank's KV transport; returns its endpoint, which the peers' ranks pass."""
        self.transport = open_transport(role, rank_peer_id(worker_id, self.rank), self.config.device, transport,
                                        host=ray.util.get_node_ip_address(), node_id=ray.get_runtime_context().get_node_id())
        return self.transport.endpoint

    def send_pieces(self, pieces, decode_id, decode_endpoints, part, transfer_id, abandon=False) -> None:
        send_pieces(
            self.transport, self.runner.kv_caches, self.shard.kv_head_start, pieces, decode_id, decode_endpoints, part,
            transfer_id, abandon,
        )

    def recv_pieces(self, pieces, prefill_id, prefill_endpoints, block_ids, transfer_id) -> None:
        recv_pieces(self.transport, self.runner.kv_caches, self.shard.kv_head_start, pieces, prefill_id, prefill_endpoints,
                    block_ids, transfer_id)

    def transport_stats(self) -> dict:
        return self.transport.stats() if self.transport is not None else {}

    def follow(self) -> None:
        """Run rank 0's steps until it stops; raises RankLostError if rank 0 is lost."""
        self._compute.submit(self._follow).result()

    def _follow(self) -> None:
        while self.runner.follow():
            pass
        self.group.close()
        if self.transport is not None:
            self.transport.close()
        self.placement.release()

    def info(self) -> dict:
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "node": ray.util.get_node_ip_address(),
            "torch_threads": torch.get_num_threads(),
            "openmp_wait": wait_settings(),
            **self.placement.info(),
            "kv_heads": list(self.shard.kv_heads),
            "collectives": self.group.transport,
        }


class TensorParallelRanks:
    """Rank 0's handle on ranks 1..N-1 of its replica."""

    def __init__(self, config: EngineConfig):
        """Start the other ranks and join the group with them (blocks until they joined).
        `config` is resolved: the same dtype and block count on every rank."""
        size = config.tensor_parallel_size
        if not ray.is_initialized():  # offline use: a local Ray for the rank processes
            local_ray.init(max(os.cpu_count() or 1, size), log_to_driver=False)
        host = ray.util.get_node_ip_address()
        store, address = TensorParallelGroup.host(host, config.tp_timeout_s)
        self._own_pg: PlacementGroup | None = None
        self.actors = [
            RankWorker.options(**self._placement(config, rank)).remote(config, rank, address) for rank in range(1, size)
        ]
        self.group = TensorParallelGroup.join(
            address, 0, size, config.device, config.tp_timeout_s, store=store, shared_memory=config.tp_shared_memory
        )
        self._loops: list[ray.ObjectRef] = []
        self._timeout_s = config.tp_timeout_s
        self.info: list[dict] = []  # ranks 1..N-1: pid, node, threads, KV heads

    def _placement(self, config: EngineConfig, rank: int) -> dict:
        size = config.tensor_parallel_size
        pg = get_current_placement_group()
        if pg is not None and len(pg.bundle_specs) >= size:  # a Serve replica's: bundle r is rank r's
            bundle, index = pg.bundle_specs[rank], rank
        else:
            if self._own_pg is None:
                gpu = {"GPU": 1} if config.device.startswith("cuda") else {}
                self._own_pg = placement_group([{"CPU": 1, **gpu}] * (size - 1), strategy=config.tp_placement)
                ray.get(self._own_pg.ready(), timeout=config.tp_timeout_s)
            pg, bundle, index = self._own_pg, self._own_pg.bundle_specs[rank - 1], rank - 1
        return {
            "num_cpus": bundle.get("CPU", 0),
            "num_gpus": bundle.get("GPU", 0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index),
        }

    def start(self) -> None:
        """Once the other ranks loaded their shards: note who they are, start their step loops."""
        self.info = ray.get([a.info.remote() for a in self.actors], timeout=self._timeout_s)
        self._loops = [a.follow.remote() for a in self.actors]

    def check(self) -> None:
        """RankLostError if a rank's loop has ended (its process died, or it lost rank 0)."""
        done, _ = ray.wait(self._loops, num_returns=len(self._loops), timeout=0)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001 - ActorDiedError, RankLostError, ...
                raise RankLostError(f"a tensor-parallel rank is lost: {e}") from None
            raise RankLostError("a tensor-parallel rank stopped following rank 0")

    def close(self, stop_followers) -> None:
        """Stop the ranks (`stop_followers` releases their loops), then their processes."""
        try:
            stop_followers()
        except RankLostError:
            pass  # a rank is gone: nothing to tell the others, they are killed below
        for actor in self.actors:
            ray.kill(actor)
        self.group.close()
        if self._own_pg is not None:
            remove_placement_group(self._own_pg)


def resolved(config: EngineConfig, dtype: torch.dtype, kv_dtype: torch.dtype, num_blocks: int) -> EngineConfig:
    """`config` with what rank 0 decided for every rank: the dtypes and the KV block count."""
    def name(d: torch.dtype) -> str:
        return str(d).removeprefix("torch.")
    cache = dataclasses.replace(config.cache, dtype=name(kv_dtype), num_blocks=num_blocks)
    return dataclasses.replace(config, dtype=name(dtype), cache=cache)
