"""The prefix index in Redis: which worker holds which KV blocks, kept true.

Workers (both tiers) publish their prefix caches; gateways look prompts up in it. Keys:

    pdserve:kv:workers                      SET   ids of workers that announced themselves
    pdserve:kv:worker:<id>                  HASH  tier, replica, generation, seq, model_id,
                                                  block_size, queued_tokens, waiting, running, kv_usage
    pdserve:kv:blocks:<id>:<generation>     SET   16-byte block hashes the worker holds now

Both keys of a worker expire TTL_S after its last heartbeat (every HEARTBEAT_S), so a dead
worker stops counting once its hash expires and its set goes with it; a worker that stops
cleanly deletes them at once, and so does a gateway that sees Serve drop its replica
(`PrefixIndex.forget`). A restarted worker has a new generation: lookups read only
the set of the generation its hash names, so the old generation's entries stop counting
the moment the new one announces itself, and expire unread.

Fencing: a snapshot is refused when the hash names a newer generation of the same worker,
and change batches are refused unless the generation matches, so an old process that
comes back cannot overwrite its successor.

Truth: every change batch is applied by a script that first checks the worker's
generation and `seq` (the number of batches applied since its last snapshot). A
mismatch, a missing hash (expired, Redis restarted or flushed) or a failed call is a
gap: the worker then publishes an authoritative snapshot (its whole cache, atomically)
before any further change. Lookups are one script call (one round trip) returning each
live worker's longest cached prefix among the prompt's block hashes, for workers whose
model id and block size equal the caller's (a mismatched hash never counts).

Memory: one set member per cached block per worker, 16 bytes of hash plus Redis's set
overhead (about 70 bytes per member in a hashtable-encoded set).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from cluster.kv import redis_client
from cluster.kv.hashing import BlockHash

log = logging.getLogger(__name__)

PREFIX = "pdserve:kv:"
WORKERS = PREFIX + "workers"
HEARTBEAT_S = 1.0
LONG_STEP_S = 30.0  # an engine read held longer than this (a hung step) stops keeping the keys alive
TTL_S = 3.0  # three missed heartbeats and a worker no longer counts
LOOKUP_CHUNK = 1000  # SMISMEMBER arguments per call (Lua's stack is bounded)


def _ttl_ms() -> int:
    return int(TTL_S * 1000)  # read at each use: tests shorten TTL_S


def worker_key(worker_id: str) -> str:
    return f"{PREFIX}worker:{worker_id}"


def blocks_key(worker_id: str, generation: int | str) -> str:
    return f"{PREFIX}blocks:{worker_id}:{generation}"


# KEYS: worker hash, blocks set, workers set.
# ARGV: worker id, generation, expected seq, ttl ms, n_fields, (field, value)*, n_stored,
# hash*, n_evicted, hash*. Returns the new seq, or -1 when the index does not hold what
# this worker published (a gap).
APPLY = """
local gen, seq = redis.call('HGET', KEYS[1], 'generation'), redis.call('HGET', KEYS[1], 'seq')
if gen ~= ARGV[2] or seq ~= ARGV[3] then return -1 end
local i = 5
local n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]); i = i + 2 end
local changed = false
n = tonumber(ARGV[i]); i = i + 1
if n > 0 then redis.call('SADD', KEYS[2], unpack(ARGV, i, i + n - 1)); changed = true end
i = i + n
n = tonumber(ARGV[i]); i = i + 1
if n > 0 then redis.call('SREM', KEYS[2], unpack(ARGV, i, i + n - 1)); changed = true end
local new_seq = tonumber(seq)
if changed then new_seq = redis.call('HINCRBY', KEYS[1], 'seq', 1) end
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('SADD', KEYS[3], ARGV[1])
return new_seq
"""

# KEYS: worker hash, blocks set, workers set. ARGV: worker id, ttl ms, generation,
# n_fields, (field, value)*, hash*. Replaces everything this worker had with the snapshot,
# unless a newer generation of the worker holds the hash: then -1 (fenced out).
SNAPSHOT = """
local cur, mine = redis.call('HGET', KEYS[1], 'generation'), ARGV[3]
if cur and (#cur > #mine or (#cur == #mine and cur > mine)) then return -1 end
local i = 5
local n = tonumber(ARGV[4])
redis.call('DEL', KEYS[1], KEYS[2])
for _ = 1, n do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]); i = i + 2 end
redis.call('HSET', KEYS[1], 'seq', 0)
local last = #ARGV
while i <= last do
  local j = math.min(i + 999, last)
  redis.call('SADD', KEYS[2], unpack(ARGV, i, j))
  i = j + 1
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
redis.call('SADD', KEYS[3], ARGV[1])
return 0
"""

# ARGV: model_id, block_size, hash*. Returns per live worker with that model and block
# size: {id, tier, replica, hit blocks, queued_tokens, running, kv_usage, waiting}.
# A worker out of the index, whichever generation it published. ARGV: worker id.
FORGET = """
local key = '""" + PREFIX + """worker:' .. ARGV[1]
local gen = redis.call('HGET', key, 'generation')
if gen then redis.call('DEL', '""" + PREFIX + """blocks:' .. ARGV[1] .. ':' .. gen) end
redis.call('DEL', key)
return redis.call('SREM', '""" + WORKERS + """', ARGV[1])
"""

LOOKUP = """
local out = {}
local n = #ARGV - 2
for _, id in ipairs(redis.call('SMEMBERS', '""" + WORKERS + """')) do
  local w = redis.call('HMGET', '""" + PREFIX + """worker:' .. id,
    'tier', 'replica', 'generation', 'model_id', 'block_size', 'queued_tokens', 'running', 'kv_usage', 'waiting')
  if not w[3] then
    redis.call('SREM', '""" + WORKERS + """', id)  -- expired: prune (its set expires on its own)
  elseif w[4] == ARGV[1] and w[5] == ARGV[2] then
    local key = '""" + PREFIX + """blocks:' .. id .. ':' .. w[3]
    local hit, i = 0, 3
    while i <= #ARGV do
      local j = math.min(i + """ + str(LOOKUP_CHUNK - 1) + """, #ARGV)
      local found = redis.call('SMISMEMBER', key, unpack(ARGV, i, j))
      local all = true
      for k = 1, #found do
        if found[k] == 1 then hit = hit + 1 else all = false; break end
      end
      if not all then break end
      i = j + 1
    end
    out[#out + 1] = {id, w[1], w[2], hit, w[6] or '0', w[7] or '0', w[8] or '0', w[9] or '0'}
  end
end
return out
"""


@dataclass(frozen=True)
class WorkerView:
    """One live worker as a lookup sees it: its cached prefix of the prompt, its load."""

    worker_id: str
    tier: str
    replica: str
    hit_blocks: int
    queued_tokens: int
    running: int  # in the batch, or receiving KV
    kv_usage: float
    waiting: int = 0  # queued in its engine

    @property
    def requests(self) -> int:
        return self.waiting + self.running


KVEvents = tuple[list[BlockHash], list[BlockHash]]  # (stored, evicted)


class IndexPublisher:
    """A worker's side: publishes its cache changes and load, heartbeats, and repairs
    gaps with snapshots. Runs as a task on the worker's event loop; never raises into
    the worker (Redis being down only means the index is stale until it returns)."""

    def __init__(
        self,
        redis_url: str,
        worker_id: str,
        tier: str,
        replica: str,
        model_id: str,
        block_size: int,
        take_events: Callable[[], Awaitable[KVEvents]],
        snapshot: Callable[[], Awaitable[list[BlockHash]]],
        load: Callable[[], Awaitable[dict]],
        generation: int | None = None,
    ):
        """`take_events()`: net changes since the last call; `snapshot()`: every hash
        held now, resetting the changes (both run on the engine's thread, so they are
        consistent with each other); `load()`: queued_tokens, waiting, running, kv_usage."""
        self.worker_id = worker_id
        self.generation = generation if generation is not None else time.time_ns()
        self._identity = {"tier": tier, "replica": replica, "generation": self.generation,
                          "model_id": model_id, "block_size": block_size}
        self._take_events, self._snapshot, self._load = take_events, snapshot, load
        self._redis = redis_client.connect(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self._apply = self._redis.register_script(APPLY)
        self._snapshot_script = self._redis.register_script(SNAPSHOT)
        self._keys = [worker_key(worker_id), blocks_key(worker_id, self.generation), WORKERS]
        self._seq = 0
        self._needs_snapshot = True
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._failing = False
        self.counts = {"snapshots": 0, "batches": 0, "gaps": 0, "errors": 0, "fenced": 0}

    @classmethod
    def for_engine(cls, engine, redis_url: str, worker_id: str, tier: str, replica: str, config) -> IndexPublisher:
        """A publisher for an AsyncEngine's prefix cache (EngineConfig `config`); every
        read runs on the engine's thread, between steps."""

        def snapshot(e) -> list[BlockHash]:
            e.pool.take_events()  # the snapshot covers them
            return e.pool.cached_hashes()

        return cls(
            redis_url, worker_id, tier, replica, config.model_id, config.cache.block_size,
            take_events=lambda: engine.call(lambda e: e.pool.take_events()),
            snapshot=lambda: engine.call(snapshot),
            load=lambda: engine.call(lambda e: e.load()),
        )

    def start(self) -> None:
        """Publish and heartbeat from a task on the running loop (a Serve replica's)."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    def nudge(self) -> None:
        """Publish now rather than at the next heartbeat (e.g. a request just cached blocks)."""
        self._wake.set()

    async def _run(self) -> None:
        while True:
            # Unbounded here: the engine's reads wait for its step (a fresh cluster's first
            # burst makes a step of seconds, which a bound would have logged as Redis being
            # down), and each Redis command is bounded by the client's socket timeouts.
            await self.sync(timeout_s=None)
            try:
                await asyncio.wait_for(self._wake.wait(), HEARTBEAT_S)
            except TimeoutError:
                pass
            self._wake.clear()

    async def sync(self, timeout_s: float | None = 2.0) -> bool:
        """Publish what changed (or a snapshot after a gap) and heartbeat. True if the
        index now holds this worker's cache; a caller that must not wait long (on a
        request's path, say) bounds it with `timeout_s` (None: no bound)."""
        try:
            async with asyncio.timeout(timeout_s):
                async with self._lock:
                    return await self._sync_locked()
        except Exception as e:  # noqa: BLE001 - the index must never fail a worker
            self._needs_snapshot = True  # changes taken but maybe not applied: a gap
            self.counts["errors"] += 1
            if not self._failing:
                log.warning("prefix index: cannot publish to Redis (%s); will resync when it is back", type(e).__name__)
            self._failing = True
            return False

    async def _sync_locked(self) -> bool:
        ttl_ms = _ttl_ms()
        fields = {**self._identity, **(await self._from_engine(self._load))}
        flat = [x for kv in fields.items() for x in kv]
        if not self._needs_snapshot:
            stored, evicted = await self._from_engine(self._take_events)
            seq = await self._apply(
                keys=self._keys,
                args=[self.worker_id, self.generation, self._seq, ttl_ms, len(fields), *flat,
                      len(stored), *stored, len(evicted), *evicted],
            )
            if seq >= 0:
                self._seq = seq
                self.counts["batches"] += bool(stored or evicted)
                self._recovered()
                return True
            self.counts["gaps"] += 1
            log.info("prefix index: gap detected for %s; publishing a snapshot", self.worker_id)
        hashes = await self._from_engine(self._snapshot)
        self._needs_snapshot = True  # until the snapshot is in
        args = [self.worker_id, ttl_ms, self.generation, len(fields), *flat, *hashes]
        if await self._snapshot_script(keys=self._keys, args=args) < 0:
            self.counts["fenced"] += 1
            log.error("prefix index: %s generation %d is fenced out by a newer one", self.worker_id, self.generation)
            return False
        self._seq, self._needs_snapshot = 0, False
        self.counts["snapshots"] += 1
        self._recovered()
        return True

    async def _from_engine(self, read: Callable[[], Awaitable]):
        """An engine read: it runs between the engine's steps, so a long step holds it (a
        2048-token prompt chunk takes seconds on a small CPU). Meanwhile the worker's keys
        are kept alive, so a step longer than TTL_S does not drop the worker from the index;
        but no longer than LONG_STEP_S, past which the engine is taken to be hung."""
        task = asyncio.ensure_future(read())
        give_up = time.monotonic() + LONG_STEP_S
        try:
            while not (await asyncio.wait({task}, timeout=HEARTBEAT_S))[0]:
                if time.monotonic() > give_up:
                    continue
                # Only the TTLs, not the scripts: they would publish the load read before the step.
                async with self._redis.pipeline(transaction=False) as keep_alive:
                    keep_alive.pexpire(self._keys[0], _ttl_ms())  # the worker's keys, not WORKERS
                    keep_alive.pexpire(self._keys[1], _ttl_ms())
                    await keep_alive.execute()
            return task.result()
        finally:
            task.cancel()  # (done already, unless sync was cancelled or timed out meanwhile)

    def _recovered(self) -> None:
        if self._failing:
            log.info("prefix index: publishing to Redis again")
        self._failing = False

    async def close(self) -> None:
        """Stop, and remove this worker from the index at once."""
        if self._task is not None:
            self._task.cancel()
        try:
            async with asyncio.timeout(2.0):
                await self._redis.delete(self._keys[0], self._keys[1])
                await self._redis.srem(WORKERS, self.worker_id)
        except Exception:  # noqa: BLE001 - the keys expire anyway
            pass
        await self._redis.aclose()


class PrefixIndex:
    """A gateway's side: one round trip answers where a prompt's prefix is cached."""

    def __init__(self, redis_url: str, model_id: str, block_size: int, timeout_s: float = 0.05):
        self.model_id = model_id
        self.block_size = block_size
        self.timeout_s = timeout_s
        self._redis = redis_client.connect(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self._lookup = self._redis.register_script(LOOKUP)
        self._forget = self._redis.register_script(FORGET)

    async def lookup(self, block_hashes: list[BlockHash]) -> list[WorkerView]:
        """Every live worker with its cached prefix of `block_hashes` and its load.
        Raises TimeoutError beyond `timeout_s`, or Redis's error when it is down."""
        async with asyncio.timeout(self.timeout_s):
            rows = await self._lookup(args=[self.model_id, self.block_size, *block_hashes])
        return [
            WorkerView(
                worker_id=row[0].decode(), tier=row[1].decode(), replica=row[2].decode(), hit_blocks=int(row[3]),
                queued_tokens=int(float(row[4])), running=int(float(row[5])), kv_usage=float(row[6]),
                waiting=int(float(row[7])),
            )
            for row in rows
        ]

    async def forget(self, worker_id: str) -> None:
        """Drop a worker known to be gone (Serve removed its replica) now, not at TTL."""
        await self._forget(args=[worker_id])

    async def close(self) -> None:
        await self._redis.aclose()
