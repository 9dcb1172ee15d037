"""The SLO planner's last decision, as it published it to Redis (cluster/planner/policy.py),
for /metrics and `pdserve status`. Reading it never fails a scrape: no Redis, no planner,
or a slow answer is None."""

from __future__ import annotations

import json

from cluster.config import APP_NAME
from cluster.kv import redis_client
from cluster.planner.policy import STATUS_KEY

REDIS_TIMEOUT_S = 0.2


class PlannerStatus:
    def __init__(self, redis_url: str | None):
        self._redis = None
        if redis_url:
            self._redis = redis_client.connect(redis_url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)

    async def read(self) -> dict | None:
        if self._redis is None:
            return None
        try:
            raw = await self._redis.get(STATUS_KEY.format(app=APP_NAME))
        except Exception:  # noqa: BLE001 - Redis down: the metrics render without the planner's
            return None
        return json.loads(raw) if raw else None
