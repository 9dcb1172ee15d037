"""Small helpers the integration and e2e tests share."""

import asyncio
import json
import re
import subprocess
import sys
import time

from cluster.kv.block_pool import BlockPool
from cluster.kv.prefix_index import IndexPublisher

PDSERVE = [sys.executable, "-m", "cluster.cli"]  # `pdserve`, as an operator runs it


def run_all(commands: list[list[str]], timeout_s: float = 300, **popen) -> list[subprocess.CompletedProcess]:
    """Run the commands at once and wait for every one: a CLI call that fails early costs
    mostly its start-up (importing torch and Ray, seconds), which the cores then share."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen) for c in commands]
    try:
        outputs = [p.communicate(timeout=timeout_s) for p in procs]  # then each has its returncode
        return [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]
    finally:
        for p in procs:
            if p.poll() is None:  # timed out, or another one did: none outlives the call
                p.kill()
                p.wait()


def fresh_imports(code: str, modules: tuple[str, ...], env: dict | None = None) -> tuple[list[str], subprocess.CompletedProcess]:
    """Which of `modules` (a package counts with any of its submodules) a fresh interpreter
    has imported once `code` ran, and the run itself: start-up costs are in what is imported."""
    probe = (f"{code}\nimport json as _json, sys as _sys\n"
             f"print(_json.dumps(sorted(m for m in {modules!r} if any(n == m or n.startswith(m + '.') for n in _sys.modules))))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), r


def wait_until(predicate, timeout_s: float = 20.0, interval_s: float = 0.2) -> bool:
    """Poll `predicate` until it holds or the time is up (for state that settles
    asynchronously, such as blocks returning after an abort); never a speed assertion."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def metric(text: str, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(\{{[^}}]*\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def all_blocks_returned(handle) -> bool:
    """Every worker of every tier has no request running and no block in use."""
    stats = handle.worker_stats.remote().result()
    return all(s["used_blocks"] == 0 and s["running"] == 0 for tier in stats.values() for s in tier.values())


class IndexedWorker:
    """A real block pool and the IndexPublisher a worker would run over it, with a given
    load: the prefix index's side of a worker, without an engine."""

    def __init__(self, url, worker_id, tier="prefill", model_id="model-a", block_size=4, generation=None, load=None,
                 step_s=0.0):
        self.step_s = step_s  # how long the load read waits: an engine's reads run between its steps
        self.pool = BlockPool(64, block_size)
        self.load = {"queued_tokens": 7, "waiting": 0, "running": 2, "kv_usage": 0.0, **(load or {})}
        self.publisher = IndexPublisher(
            url, worker_id, tier, replica=worker_id.split("-", 1)[1], model_id=model_id, block_size=block_size,
            take_events=self._take, snapshot=self._snapshot, load=self._load, generation=generation,
        )

    async def _take(self):
        return self.pool.take_events()

    async def _snapshot(self):
        self.pool.take_events()
        return self.pool.cached_hashes()

    async def _load(self):
        await asyncio.sleep(self.step_s)
        return self.load

    def cache(self, hashes):
        blocks = self.pool.allocate(len(hashes))
        for b, h in zip(blocks, hashes):
            self.pool.cache_block(b, h)
        self.pool.free(reversed(blocks))  # idle but still cached

    def evict_all(self):
        self.pool.reset_prefix_cache()


def step_to_end(engine) -> dict[str, list[int]]:
    """Step an Engine until nothing is unfinished, asserting its block invariant after every
    step; the token ids each request produced."""
    produced: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            produced.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.check_integrity()
    return produced
