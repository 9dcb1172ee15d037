"""The Redis prefix index against a real redis-server: lookups give each live worker's
longest cached prefix; gaps (a flushed or restarted Redis, failed publishes) are
repaired by snapshots; a restarted worker's old generation stops counting at once; a
dead worker's entries stop counting when its heartbeat lapses, and at once when it
stops cleanly. The publisher's source is a real BlockPool."""

import asyncio

import pytest
import redis

from cluster.kv import prefix_index, redis_client
from cluster.kv.hashing import hash_prefix_blocks
from cluster.kv.prefix_index import PrefixIndex
from cluster.launch.redis_server import PrivateRedis
from tests.helpers import IndexedWorker

BS = 4
MODEL = "model-a"
TOKENS = list(range(100, 132))  # 8 full blocks
HASHES = hash_prefix_blocks(TOKENS, BS, MODEL)


def Worker(url, worker_id, **kw):  # noqa: N802 - reads like the class it builds
    return IndexedWorker(url, worker_id, model_id=kw.pop("model_id", MODEL), block_size=kw.pop("block_size", BS), **kw)


@pytest.fixture
def server():
    with PrivateRedis() as r:
        yield r


def hits(views):
    return {v.worker_id: v.hit_blocks for v in views}


def test_lookup_gives_each_workers_longest_prefix(server):
    async def scenario():
        a, b = Worker(server.url, "prefill-a"), Worker(server.url, "decode-b", tier="decode")
        other_model = Worker(server.url, "prefill-c", model_id="model-b")
        other_block = Worker(server.url, "prefill-d", block_size=8)
        a.cache(HASHES[:5])
        b.cache(HASHES[:2] + HASHES[3:6])  # a hole at block 2: its prefix is 2 blocks
        other_model.cache(HASHES)
        other_block.cache(HASHES)
        for w in (a, b, other_model, other_block):
            assert await w.publisher.sync()
        index = PrefixIndex(server.url, MODEL, BS)
        views = await index.lookup(HASHES)
        assert hits(views) == {"prefill-a": 5, "decode-b": 2}  # other model / block size never count
        view_a = next(v for v in views if v.worker_id == "prefill-a")
        assert (view_a.tier, view_a.replica, view_a.queued_tokens, view_a.running) == ("prefill", "a", 7, 2)
        # Changes are published as they happen.
        a.evict_all()
        a.cache(HASHES[:1])
        b.cache(HASHES[2:3])
        assert await a.publisher.sync() and await b.publisher.sync()
        assert hits(await index.lookup(HASHES)) == {"prefill-a": 1, "decode-b": 6}
        assert hits(await index.lookup([])) == {"prefill-a": 0, "decode-b": 0}
        assert a.publisher.counts["snapshots"] == 1 and a.publisher.counts["gaps"] == 0
        for w in (a, b, other_model, other_block):
            await w.publisher.close()
        assert await index.lookup(HASHES) == []  # a clean stop removes a worker at once
        await index.close()

    asyncio.run(scenario())


def test_gaps_are_repaired_by_a_snapshot(server):
    async def scenario():
        a = Worker(server.url, "prefill-a")
        index = PrefixIndex(server.url, MODEL, BS)
        a.cache(HASHES[:3])
        assert await a.publisher.sync()
        # Redis forgets everything (FLUSHALL: as after a restart without persistence).
        redis_client.connect_sync(server.url).flushall()
        a.cache(HASHES[3:4])
        assert await a.publisher.sync()  # the change batch finds no hash: a gap, so a snapshot
        assert a.publisher.counts["gaps"] == 1 and a.publisher.counts["snapshots"] == 2
        assert hits(await index.lookup(HASHES)) == {"prefill-a": 4}
        # A batch the index did not apply (seq moved): also a gap.
        redis_client.connect_sync(server.url).hincrby(prefix_index.worker_key("prefill-a"), "seq", 1)
        a.cache(HASHES[4:5])
        assert await a.publisher.sync()
        assert a.publisher.counts["gaps"] == 2 and hits(await index.lookup(HASHES)) == {"prefill-a": 5}
        await a.publisher.close()
        await index.close()

    asyncio.run(scenario())


def test_a_long_engine_step_neither_fails_the_heartbeat_nor_drops_the_worker(server):
    """The publisher's reads run between the engine's steps, and a fresh cluster's first
    burst makes steps of seconds: through a step longer than the TTL the worker stays in
    the index, and the heartbeat publishes once the step is over, with no error."""

    async def scenario():
        a = Worker(server.url, "prefill-a")
        a.cache(HASHES[:3])
        a.publisher.start()
        index = PrefixIndex(server.url, MODEL, BS)
        listed = lambda views: hits(views) == {"prefill-a": 3}  # noqa: E731
        try:
            for _ in range(50):
                if listed(await index.lookup(HASHES)):
                    break
                await asyncio.sleep(0.1)
            assert listed(await index.lookup(HASHES))
            a.step_s = prefix_index.TTL_S + 1.5  # the next heartbeat's read waits this long
            a.cache(HASHES[3:5])
            for _ in range(int(a.step_s / 0.2) + 5):  # listed all through the step
                assert hits(await index.lookup(HASHES)) in ({"prefill-a": 3}, {"prefill-a": 5})
                await asyncio.sleep(0.2)
            for _ in range(50):  # and the heartbeat after it publishes the blocks cached meanwhile
                if hits(await index.lookup(HASHES)) == {"prefill-a": 5}:
                    break
                await asyncio.sleep(0.1)
            assert hits(await index.lookup(HASHES)) == {"prefill-a": 5}
            assert a.publisher.counts["errors"] == 0
        finally:
            await a.publisher.close()

    asyncio.run(scenario())


def test_a_hung_engine_still_drops_its_worker_from_the_index(server, monkeypatch):
    """The keys are kept alive through a long step, not through a hung one: past
    LONG_STEP_S they expire, and lookups stop counting the worker."""
    monkeypatch.setattr(prefix_index, "LONG_STEP_S", 1.0)

    async def scenario():
        a = Worker(server.url, "prefill-a")
        a.cache(HASHES[:3])
        assert await a.publisher.sync()
        a.step_s = 60.0  # hung
        a.publisher.start()
        index = PrefixIndex(server.url, MODEL, BS)
        try:
            for _ in range(100):
                if not hits(await index.lookup(HASHES)):
                    break
                await asyncio.sleep(0.1)
            assert hits(await index.lookup(HASHES)) == {}
        finally:
            await a.publisher.close()

    asyncio.run(scenario())


def test_redis_down_then_back_on_the_same_port_recovers_without_restarting_workers():
    async def scenario(server):
        a = Worker(server.url, "prefill-a")
        a.cache(HASHES[:2])
        assert await a.publisher.sync()
        server.stop()
        a.cache(HASHES[2:6])  # changes while Redis is down are lost ...
        assert not await a.publisher.sync(timeout_s=1.0)
        index = PrefixIndex(server.url, MODEL, BS)
        with pytest.raises((OSError, TimeoutError, redis.exceptions.RedisError)):
            await index.lookup(HASHES)
        back = PrivateRedis(port=server.port, password_file=server.password_file)
        try:
            assert await a.publisher.sync()  # ... so the first sync after is a snapshot
            assert hits(await index.lookup(HASHES)) == {"prefill-a": 6}
            assert a.publisher.counts["errors"] >= 1
        finally:
            await a.publisher.close()
            await index.close()
            back.stop()

    with PrivateRedis() as server:
        asyncio.run(scenario(server))


def test_a_restarted_worker_stops_counting_its_old_generation_at_once(server):
    async def scenario():
        old = Worker(server.url, "prefill-a", generation=1)
        old.cache(HASHES)
        assert await old.publisher.sync()
        index = PrefixIndex(server.url, MODEL, BS)
        assert hits(await index.lookup(HASHES)) == {"prefill-a": 8}
        # The process restarts: same worker id, a new generation, an empty cache. The old
        # process never cleaned up (it died), yet its entries stop counting at once.
        new = Worker(server.url, "prefill-a", generation=2)
        assert await new.publisher.sync()
        assert hits(await index.lookup(HASHES)) == {"prefill-a": 0}
        # The old generation, should it come back, is fenced out: it cannot write.
        old.cache(HASHES[:1])
        assert not await old.publisher.sync()
        assert old.publisher.counts["gaps"] == 1 and old.publisher.counts["fenced"] == 1
        assert hits(await index.lookup(HASHES)) == {"prefill-a": 0}
        await new.publisher.close()
        await index.close()

    asyncio.run(scenario())


def test_a_dead_workers_entries_stop_counting_when_its_heartbeat_lapses(server, monkeypatch):
    monkeypatch.setattr(prefix_index, "TTL_S", 0.3)

    async def scenario():
        a, b = Worker(server.url, "prefill-a"), Worker(server.url, "prefill-b")
        a.cache(HASHES[:4])
        b.cache(HASHES[:2])
        monkeypatch.setattr(prefix_index, "HEARTBEAT_S", 0.1)
        a.publisher.start()  # heartbeats
        assert await b.publisher.sync()  # b dies after this: no heartbeat, no clean stop
        index = PrefixIndex(server.url, MODEL, BS)
        assert hits(await index.lookup(HASHES)) == {"prefill-a": 4, "prefill-b": 2}
        await asyncio.sleep(0.5)
        assert hits(await index.lookup(HASHES)) == {"prefill-a": 4}  # a heartbeats on
        client = redis_client.connect_sync(server.url)
        assert not client.exists(prefix_index.worker_key("prefill-b"))
        assert not client.sismember(prefix_index.WORKERS, "prefill-b")  # pruned by the lookup
        await a.publisher.close()
        await index.close()

    asyncio.run(scenario())


def test_lookup_timeout_is_a_timeout(server):
    async def scenario():
        index = PrefixIndex(server.url, MODEL, BS, timeout_s=1e-6)
        with pytest.raises(TimeoutError):
            await index.lookup(HASHES)
        await index.close()

    asyncio.run(scenario())
