"""`pdserve bench chaos`: a `bench serve` workload against a local cluster while its
replicas are killed (SIGKILL), hung (SIGSTOP, SIGCONT after --hang-s) or stopped
(SIGTERM), or, with --nodes (each replica on a Ray node of its own), whole nodes fail
(NODE: the raylet and every process on it, SIGKILL; a fresh node of the tier joins at
once, as the autoscaler would add one), and the client itself drops a fraction of the
requests; then the checks a client of a fault-tolerant server relies on:

    failed          requests the client did not drop that did not complete      (0)
    mismatched      completed texts unlike an offline greedy run of the prompt  (0)
    leaked_blocks   KV blocks in use on any replica once the cluster is idle    (0)

--kill takes TIER:SIGNAL@STARTs[/EVERYs], comma-separated, e.g.
`decode:SIGKILL@5s,prefill:SIGKILL@12s`, `decode:SIGKILL@60s/120s` (at 60 s, then
every 120 s while the load runs) or `decode:NODE@20s` (with --nodes). The victim is the
tier's replica holding the most requests (or its node); Serve starts a replacement for
a dead one.
"""

from __future__ import annotations

import copy
import heapq
import os
import random
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ray import serve

from cluster.bench.plots import plot_chaos
from cluster.bench.provenance import write_result
from cluster.bench.serve_bench import measure
from cluster.bench.sweep_compare import local_cluster, local_ray, local_target
from cluster.config import APP_NAME, CacheConfig, EngineConfig, RoutingConfig
from cluster.engine.engine import Engine
from cluster.engine.sampling_params import SamplingParams
from cluster.host.local_nodes import LocalNodes
from cluster.model.builtin import builtin_model_path

SIGNALS = ("SIGKILL", "SIGSTOP", "SIGTERM", "NODE")
VICTIM_STATS_DEADLINE_S = 3.0  # how long picking a victim waits for the replicas' stats
FAULT = re.compile(rf"^(prefill|decode):({'|'.join(SIGNALS)})@(\d+(?:\.\d+)?)s(?:/(\d+(?:\.\d+)?)s)?$")


@dataclass(frozen=True)
class Fault:
    tier: str
    signal: str
    at_s: float
    every_s: float | None = None


def parse_faults(spec: str) -> list[Fault]:
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        m = FAULT.match(part)
        if not m:
            raise ValueError(f"--kill {part!r}: expected TIER:SIGNAL@STARTs[/EVERYs] with TIER prefill|decode "
                             f"and SIGNAL one of {', '.join(SIGNALS)} (e.g. decode:SIGKILL@5s)")
        every = float(m.group(4)) if m.group(4) else None
        if every is not None and every <= 0:
            raise ValueError(f"--kill {part!r}: the period must be positive")
        faults.append(Fault(m.group(1), m.group(2), float(m.group(3)), every))
    return faults


class FaultInjector(threading.Thread):
    """Injects the faults on schedule (seconds from start()) until stop(); every replica
    it hung is continued by stop() at the latest."""

    def __init__(self, handle, faults: list[Fault], hang_s: float, nodes: LocalNodes | None = None):
        super().__init__(daemon=True, name="chaos")
        self.handle, self.faults, self.hang_s, self.nodes = handle, faults, hang_s, nodes
        self.injected: list[dict] = []
        self._stopped = threading.Event()
        self._hung: dict[int, threading.Timer] = {}  # pid -> its SIGCONT
        self._t0 = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()
        super().start()

    def run(self) -> None:
        due = [(f.at_s, i, f) for i, f in enumerate(self.faults)]
        heapq.heapify(due)
        while due:
            at, i, fault = heapq.heappop(due)
            if self._stopped.wait(max(0.0, self._t0 + at - time.perf_counter())):
                return
            self.injected.append(self._inject(fault))
            print(f"chaos: {self.injected[-1]}", flush=True)
            if fault.every_s:
                heapq.heappush(due, (at + fault.every_s, i, fault))

    def _inject(self, fault: Fault) -> dict:
        record = {"t_s": round(time.perf_counter() - self._t0, 2), "tier": fault.tier, "signal": fault.signal}
        # Within a deadline: a replica an earlier SIGSTOP still holds would hold the call until it
        # resumes; those heard are the live candidates.
        heard, _ = self.handle.poll_workers.remote(VICTIM_STATS_DEADLINE_S).result()
        stats = list(heard.get(fault.tier, {}).values())  # (colocated: no prefill tier)
        if not stats:
            return {**record, "skipped": "no live replica"}
        victim = max(stats, key=lambda s: (s["running"] + s["waiting"], random.random()))
        pid = victim["pid"]
        record.update(worker_id=victim["worker_id"], pid=pid, requests=victim["running"] + victim["waiting"])
        if fault.signal == "NODE":
            node = self.nodes.by_id(victim["node_id"])
            self.nodes.kill(node.name)
            return {**record, "node": node.name, "replacement": self.nodes.add_tier_node(fault.tier).name}
        os.kill(pid, getattr(signal, fault.signal))
        if fault.signal == "SIGSTOP":
            self._hung[pid] = threading.Timer(self.hang_s, self._resume, (pid,))
            self._hung[pid].start()
        return record

    def _resume(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # Serve replaced it meanwhile

    def stop(self) -> None:
        self._stopped.set()
        self.join()
        for pid, timer in self._hung.items():
            timer.cancel()
            self._resume(pid)


def abort_plan(ratio: float, seed: int):
    """Which requests the client drops (round(ratio * n) of them, drawn by seed), and
    after how many chunks (0: before the first token, while the prompt is computed or
    its KV handed over)."""

    def plan(work) -> list[int | None]:
        rng = random.Random(seed)
        dropped = set(rng.sample(range(len(work)), round(ratio * len(work))))
        return [rng.randint(0, max(1, w.output_len // 2)) if i in dropped else None for i, w in enumerate(work)]

    return plan


def wait_idle(handle, replicas: dict[str, int], timeout_s: float) -> tuple[dict, float]:
    """Poll until every tier runs its number of replicas and none holds a request or a
    block in use; (the last stats, seconds waited)."""
    t0 = time.perf_counter()
    while True:
        stats = handle.worker_stats.remote().result()
        idle = all(s["running"] + s["waiting"] == 0 and s["used_blocks"] == 0 for tier in stats.values() for s in tier.values())
        if (idle and all(len(stats.get(t, {})) == n for t, n in replicas.items())) or time.perf_counter() - t0 > timeout_s:
            return stats, time.perf_counter() - t0
        time.sleep(1.0)


def offline_texts(args, requests: list) -> list[str]:
    """Greedy texts of `requests` from an engine in this process (`pdserve generate`'s).

    Its cache holds every request at once (the cluster's may be tiny, to force evictions):
    run a few at a time, with preemptions, the reference took 3x as long."""
    block_size = CacheConfig.block_size
    # a block of slack per request: a prompt's text may re-tokenize a little longer
    blocks = sum(-(-(r.prompt_len + r.output_len) // block_size) + 1 for r in requests)
    engine = Engine(EngineConfig(model=args.local_model, dtype=args.dtype, max_model_len=args.max_model_len,
                                 cache=CacheConfig(num_blocks=blocks, dtype=args.kv_cache_dtype)))
    params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=args.ignore_eos) for r in requests]
    return [c.text for c in engine.generate([r.prompt for r in requests], params, use_tqdm=not args.disable_tqdm)]


def run_chaos(args) -> int:
    target = local_target(args.target)
    if target is None:
        raise ValueError(f"--target {args.target!r}: give a local configuration such as 1p2d or 2p1d")
    if args.endpoint != "/v1/completions":
        raise ValueError("bench chaos checks texts against an offline run of the prompts: use --endpoint /v1/completions")
    if not 0.0 <= args.abort_ratio <= 1.0:
        raise ValueError(f"--abort-ratio must be within [0, 1], got {args.abort_ratio}")
    faults = parse_faults(args.kill)
    if any(f.signal == "NODE" for f in faults) and not args.nodes:
        raise ValueError("--kill TIER:NODE@...: node faults need --nodes (each replica on a Ray node of its own)")
    args.local_model = args.local_model or str(builtin_model_path())
    routing = RoutingConfig(migration_limit=args.migration_limit, stall_timeout_s=args.stall_timeout_s)
    replicas = {"decode": target.decode} if target.colocated else {"prefill": target.prefill, "decode": target.decode}
    with (local_ray(args, target if args.nodes else None, specs=[args.target]) as nodes,
          local_cluster(args.target, args, routing, args.nodes) as url):
        run_args = copy.copy(args)
        run_args.base_url, run_args.model, run_args.tokenizer = url, None, args.local_model
        handle = serve.get_app_handle(APP_NAME)
        injector = FaultInjector(handle, faults, args.hang_s, nodes)
        try:
            result, work, results = measure(run_args, abort_plan(args.abort_ratio, args.seed), on_start=injector.start)
        finally:
            if injector.is_alive():
                injector.stop()
        print("chaos: load done; waiting for the cluster to be idle", flush=True)
        stats, idle_s = wait_idle(handle, replicas, args.idle_timeout_s)
    completed = [i for i, r in enumerate(results) if r.success]
    print(f"chaos: offline greedy reference for {len(completed)} completed requests", flush=True)
    reference = offline_texts(args, [work[i] for i in completed])
    mismatched = [i for i, want in zip(completed, reference) if results[i].text != want]
    leaked = {wid: s["used_blocks"] for tier in stats.values() for wid, s in tier.items() if s["used_blocks"]}
    server = result.get("server_metrics") or {}
    chaos = {
        "target": args.target,
        "nodes": args.nodes,
        "requests": len(results),
        "completed": result["completed"],
        "aborted": result["aborted"],
        "failed": result["failed"],
        "failure_breakdown": result["failure_breakdown"],
        "errors": result["errors"],
        "mismatched": len(mismatched),
        "migrated": server.get("request_migrations", 0.0),
        "route_fallbacks": server.get("route_fallbacks", 0.0),
        "faults": injector.injected,
        "leaked_blocks": leaked,
        "replicas_at_end": {tier: len(s) for tier, s in stats.items()},
        "idle_after_s": round(idle_s, 1),
        "survived_on_decode": {k: sum(s.get(k, 0) for s in stats.get("decode", {}).values())
                               for k in ("prefill_faults", "recomputed", "computed_here")},
        "duration_s": result["duration"],
        **{k: result[k] for k in ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_itl_ms")},
        "output_throughput_over_time": result["output_throughput_over_time"],
        "args": {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "fn"},
    }
    ok = chaos["failed"] == 0 and not mismatched and not leaked
    print_chaos(chaos, ok)
    out = Path(args.result_dir or ".")
    out.mkdir(parents=True, exist_ok=True)
    write_result(out / "chaos.json", chaos)
    print(f"wrote {out / 'chaos.json'} and {plot_chaos(chaos, out / 'chaos.png')}")
    return 0 if ok else 1


def print_chaos(chaos: dict, ok: bool) -> None:
    rows = [
        ("Requests", chaos["requests"]),
        ("Completed", chaos["completed"]),
        ("Aborted by the client", chaos["aborted"]),
        ("Failed (not aborted)", f"{chaos['failed']} {chaos['failure_breakdown'] or ''}"),
        ("Texts unlike the offline run", chaos["mismatched"]),
        ("Migrated (router re-issues)", int(chaos["migrated"])),
        ("Faults injected", sum(1 for f in chaos["faults"] if "pid" in f)),
        ("Leaked KV blocks once idle", sum(chaos["leaked_blocks"].values())),
        ("Idle after load (s)", chaos["idle_after_s"]),
    ]
    print("{s:=^60}".format(s=" Chaos Benchmark Result "))
    for label, value in rows:
        print(f"{label:<44}{value!s:>16}")
    print("=" * 60)
    print("PASS: no client saw a fault, no block leaked" if ok else "FAIL: see failed / mismatched / leaked above")
