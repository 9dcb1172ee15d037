"""Small helpers the integration and e2e tests share."""

import time


def wait_until(predicate, timeout_s: float = 20.0, interval_s: float = 0.2) -> bool:
    """Poll `predicate` until it holds or the time is up (for state that settles
    asynchronously, such as blocks returning after an abort); never a speed assertion."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def all_blocks_returned(handle) -> bool:
    """Every worker of every tier has no request running and no block in use."""
    stats = handle.worker_stats.remote().result()
    return all(s["used_blocks"] == 0 and s["running"] == 0 for tier in stats.values() for s in tier.values())
