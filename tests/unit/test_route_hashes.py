"""The gateway and the workers agree on every block hash: the gateway's placement hashes
a prompt exactly as a worker's KVCacheManager does (the same blocks, the same function),
in any process and under any PYTHONHASHSEED."""

import json
import os
import subprocess
import sys

import pytest

from cluster.config import CacheConfig, EngineConfig, RoutingConfig
from cluster.engine.kv_cache_manager import KVCacheManager
from cluster.engine.request import Request
from cluster.engine.sampling_params import SamplingParams
from cluster.kv.block_pool import BlockPool
from router.metrics import GatewayMetrics
from router.placement import Placer
from router.replica_router import rendezvous_order

CONFIG = EngineConfig(model="/models/some-model", cache=CacheConfig(block_size=8))
PROMPT = [(i * 7919) % 50_000 for i in range(61)]  # 7 full blocks and 5 tokens

PLACER_HASHES = """
import json, sys
from cluster.config import CacheConfig, EngineConfig, RoutingConfig
from router.metrics import GatewayMetrics
from router.placement import Placer
config = EngineConfig(model="/models/some-model", cache=CacheConfig(block_size=8))
placer = Placer(config, RoutingConfig(policy="prefix_hash"), None, False, GatewayMetrics("x"))
print(json.dumps([h.hex() for h in placer.block_hashes(json.loads(sys.argv[1]))]))
"""


def worker_hashes(prompt):
    kv = KVCacheManager(BlockPool(64, 8), CONFIG.model_id)
    request = Request("r", list(prompt), SamplingParams())
    kv.update_block_hashes(request)
    reusable = (len(prompt) - 1) // 8  # KVCacheManager.cached_prefix never reuses the last token's block
    return request.block_hashes[:reusable]


@pytest.mark.parametrize("length", [1, 8, 9, 16, 61])
def test_gateway_hashes_equal_the_workers(length):
    placer = Placer(CONFIG, RoutingConfig(policy="prefix_hash"), None, False, GatewayMetrics("t"))
    assert placer.block_hashes(PROMPT[:length]) == worker_hashes(PROMPT[:length])


def test_same_hashes_in_other_processes_and_hash_seeds():
    expected = [h.hex() for h in worker_hashes(PROMPT)]
    assert len(expected) == 7
    for seed in ("0", "1", "random"):
        out = subprocess.run(
            [sys.executable, "-c", PLACER_HASHES, json.dumps(PROMPT)],
            env={**os.environ, "PYTHONHASHSEED": seed}, capture_output=True, text=True, check=True,
        )
        assert json.loads(out.stdout) == expected


def test_rendezvous_moves_only_the_keys_of_a_replica_that_goes():
    replicas = ["r1", "r2", "r3", "r4"]
    keys = [i.to_bytes(4, "little") for i in range(400)]
    home = {k: rendezvous_order(k, replicas)[0] for k in keys}
    assert set(home.values()) == set(replicas)  # every replica gets some keys
    assert all(rendezvous_order(k, list(reversed(replicas)))[0] == home[k] for k in keys)  # order-free
    after = {k: rendezvous_order(k, ["r1", "r2", "r4"])[0] for k in keys}
    moved = [k for k in keys if after[k] != home[k]]
    assert moved and all(home[k] == "r3" for k in moved)
