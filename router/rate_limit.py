"""Per-API-key token buckets in Redis, shared by every gateway replica.

One Lua script refills and takes atomically, so replicas never race. Keys hold a hash of
the API key, never the key itself:

    pdserve:ratelimit:<sha256(key)[:24]>  HASH {tokens, ts}   expires when it would be full

If Redis is down or slow the limiter lets the request through (requests never fail
because the limiter cannot decide) and counts the error.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math

from cluster.kv import redis_client
from router.errors import RateLimited

log = logging.getLogger(__name__)

KEY_PREFIX = "pdserve:ratelimit:"
REDIS_TIMEOUT_S = 0.2  # per Redis operation; a decision takes two

# KEYS[1] bucket; ARGV: rate (tokens/s), burst, now (s), cost (tokens). Returns {allowed, retry_after_ms}.
TOKEN_BUCKET = """
local rate, burst, now, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1]) or burst
local ts = tonumber(state[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local allowed, retry_ms = 0, math.ceil((cost - tokens) / rate * 1000)
if tokens >= cost then
  tokens = tokens - cost
  allowed, retry_ms = 1, 0
end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'ts', now)
redis.call('PEXPIRE', KEYS[1], math.ceil((burst - tokens) / rate * 1000) + 1000)
return {allowed, retry_ms}
"""


class RateLimiter:
    def __init__(self, redis_url: str | None, rate_per_s: float, burst: int, errors=None):
        """`errors`: a counter (prometheus child) of decisions Redis could not make."""
        self.rate = rate_per_s
        self.burst = burst or max(1, math.ceil(rate_per_s))
        self.errors = errors
        self._redis = None
        self._script = None
        if rate_per_s > 0 and redis_url:
            self._redis = redis_client.connect(redis_url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)
            self._script = self._redis.register_script(TOKEN_BUCKET)

    @property
    def enabled(self) -> bool:
        return self._redis is not None

    async def acquire(self, api_key: str, cost: int = 1) -> float | None:
        """None if a request of `cost` tokens (its choices) may go now, else seconds until the
        bucket holds them. Raises RateLimited for a cost over the burst: it never could."""
        if self._redis is None:
            return None
        if cost > self.burst:
            raise RateLimited(f"a request of {cost} choices needs {cost} rate-limit tokens, and this API key's bucket holds "
                              f"{self.burst} (rate_limit_burst)")
        bucket = KEY_PREFIX + hashlib.sha256(api_key.encode()).hexdigest()[:24]

        async def take() -> list[int]:
            seconds, micros = await self._redis.time()  # one clock for every replica: Redis's
            return await self._script(keys=[bucket], args=[self.rate, self.burst, seconds + micros / 1e6, cost])

        try:
            allowed, retry_ms = await asyncio.wait_for(take(), REDIS_TIMEOUT_S * 2)
        except Exception as e:  # noqa: BLE001 - the limiter never fails a request
            if self.errors is not None:
                self.errors.inc()
            log.warning("rate limiter could not reach Redis, letting the request through: %s", type(e).__name__)
            return None
        return None if allowed else max(retry_ms / 1000.0, 0.001)
