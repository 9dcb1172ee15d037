"""`pdserve bench sweep` and `pdserve bench compare`, built on `bench serve`.

sweep    runs the workload at each --request-rates rate and reports SLO attainment:
         the fraction of requests (failed ones count as misses) whose TTFT and TPOT are
         both within --slo-ttft-ms / --slo-tpot-ms. The answer is the highest rate with
         attainment >= --attainment (0.9): goodput as DistServe defines it.
compare  runs the same workload against two targets, alternately for --rounds rounds
         (round r draws its prompts with --seed + r, the same for both), and reports B/A
         ratios of the medians over rounds. A target is a URL, or a
         local configuration it starts itself on a local Ray:
             [N]colocated[:ROUTING]   N replicas (default 1), each one engine doing both phases
             <P>p<D>d[:ROUTING]       P prefill and D decode replicas, e.g. 1p1d, 2p1d:round_robin
         and either with @T: T torch threads per replica instead of --torch-threads, so
         that configurations with the same total threads compare (colocated@2 vs 1p1d@1),
         and with /CORES: --engine-cores CORES (auto, own, shared; default auto: whether
         decode engines get cores of their own, cluster/host/engine_cores.py), e.g. 1p1d@1 vs
         1p1d@1/shared. Or offline[@T]: one engine in this process, no server
         (cluster/bench/offline_target.py), e.g. colocated@2 vs offline@2 for served TPOT over
         the offline step.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import statistics
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import ray
from ray import serve

from cluster.bench.flags import local_engine_config
from cluster.bench.offline_target import offline_target, run_offline
from cluster.bench.plots import plot_attainment, plot_compare
from cluster.bench.provenance import write_result
from cluster.bench.serve_bench import run_once
from cluster.config import APP_NAME, ClusterConfig, RoutingConfig, TierConfig
from cluster.host import engine_cores, local_nodes
from cluster.launch.app import build_app
from cluster.launch.ports import free_port
from cluster.launch.redis_server import PrivateRedis
from cluster.launch.serve import engine_cores_of, on_this_machine, start_local_nodes, start_local_ray

COMPARED = ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_itl_ms")


def attainment(result: dict, slo_ttft_ms: float, slo_tpot_ms: float) -> float:
    good = 0
    for ttft, e2el, out in zip(result["ttfts"], result["e2els"], result["output_lens"]):
        tpot = (e2el - ttft) / (out - 1) if out > 1 else 0.0
        good += ttft * 1e3 <= slo_ttft_ms and tpot * 1e3 <= slo_tpot_ms
    return good / max(1, result["completed"] + result["failed"])


def run_sweep(args) -> int:
    rates = [float(r) for r in args.request_rates.split(",")]
    points = []
    for rate in rates:
        run_args = copy.copy(args)
        run_args.request_rate = rate
        result = run_once(run_args)
        a = attainment(result, args.slo_ttft_ms, args.slo_tpot_ms)
        points.append({"request_rate": rate, "attainment": a, "completed": result["completed"], "failed": result["failed"],
                       "median_ttft_ms": result["median_ttft_ms"], "median_tpot_ms": result["median_tpot_ms"],
                       "output_throughput": result["output_throughput"]})
        print(f"rate {rate:g} req/s: {a:.1%} of requests within TTFT {args.slo_ttft_ms:g} ms and TPOT {args.slo_tpot_ms:g} ms")
    passing = [p["request_rate"] for p in points if p["attainment"] >= args.attainment]
    best = max(passing) if passing else None
    print(f"highest rate with >= {args.attainment:.0%} SLO attainment: {best if best is not None else 'none of the rates'}")
    summary = {"slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms, "attainment_target": args.attainment,
               "max_rate_meeting_slo": best, "points": points, "dataset_name": args.dataset_name}
    path = summary_path(args, "sweep.json")
    write_result(path, summary)
    plot = plot_attainment(rates, [p["attainment"] for p in points], args.attainment, path.with_name(f"{path.stem}-attainment.png"),
                           f"SLO attainment: TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:g} ms")
    print(f"wrote {path} and {plot}")
    return 0


def summary_path(args, default_name: str) -> Path:
    """Where a sweep or a comparison writes its JSON (its plot beside it, named after it):
    --result-dir / --result-filename, or default_name there."""
    out_dir = Path(args.result_dir or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir / (args.result_filename or default_name)


# ---- compare -----------------------------------------------------------------------------

LOCAL = re.compile(r"^(?:(\d*)colocated|(\d+)p(\d+)d)(?::(\w+))?(?:@(\d+))?(?:/(auto|own|shared))?$")


@dataclass(frozen=True)
class LocalTarget:
    """A local configuration: replicas per tier (prefill 0: colocated), routing, threads,
    and whether the decode engines get cores of their own where they can (cluster/host/engine_cores.py)."""

    prefill: int
    decode: int
    routing: str | None
    threads: int | None
    engine_cores: str = "auto"

    @property
    def colocated(self) -> bool:
        return self.prefill == 0


def local_target(spec: str) -> LocalTarget | None:
    """The configuration `spec` names (see the module docstring), or None if it names none."""
    m = LOCAL.match(spec)
    if not m:
        return None
    colocated, prefill, decode, routing, threads, engine_cores = m.groups()
    prefill, decode = (0, int(colocated or 1)) if prefill is None else (int(prefill), int(decode))
    if decode < 1 or (prefill < 1 and colocated is None):
        return None
    return LocalTarget(prefill, decode, routing, int(threads) if threads else None, engine_cores or "auto")


def parse_target(spec: str):
    """A URL, or a local configuration (see the module docstring)."""
    if spec.startswith(("http://", "https://")):
        return spec
    if local_target(spec) is None and offline_target(spec) is None:
        raise ValueError(f"target {spec!r}: give a URL, '[N]colocated[:routing][@threads][/cores]', "
                         "'<P>p<D>d[:routing][@threads][/cores]' or 'offline[@threads]' (e.g. 1p1d, "
                         "2p1d:round_robin, colocated@2, 2colocated@1, 1p1d@1/shared, offline@2)")
    return spec


@contextmanager
def local_ray(args, nodes_for: LocalTarget | None = None, specs: Sequence[str] = ()):
    """A local Ray with Serve's HTTP proxy on a free port and a private redis-server, for
    local targets (sets args._http_port and args._redis, which local_cluster reads).
    `nodes_for`: a Ray of several nodes instead, one per replica of that target's tiers
    (cluster/host/local_nodes.py), yielded; deploy with local_cluster(nodes=True).
    `specs`: the local targets it will serve; where they all give the decode engines the
    same cores of their own, everything it starts, and this process's load client, stays
    off them, as under `pdserve serve` (cluster/host/engine_cores.py: keep_off)."""
    cpus = max(4, os.cpu_count() or 1)
    nodes = None
    plans = {engine_cores_of(local_config(spec, args)) for spec in specs}
    cores_before = engine_cores.keep_off(plans.pop() if len(plans) == 1 and nodes_for is None else None)
    if nodes_for is None:
        start_local_ray(cpus, args.ingress, log_to_driver=False)
    else:
        nodes = start_local_nodes(cpus, args.ingress, log_to_driver=False)
    args._redis = None
    try:
        if nodes is not None:
            for tier, replicas in (("prefill", nodes_for.prefill), ("decode", nodes_for.decode)):
                for _ in range(replicas):
                    nodes.add_tier_node(tier)
        args._http_port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": args._http_port})
        args._redis = PrivateRedis()
        yield nodes
    finally:
        serve.shutdown()
        if nodes is not None:
            nodes.shutdown()
        ray.shutdown()
        if args._redis is not None:
            args._redis.stop()
        os.sched_setaffinity(0, cores_before)


def local_config(spec: str, args, routing: RoutingConfig | None = None, nodes: bool = False,
                 redis_url: str | None = None) -> ClusterConfig:
    """The cluster configuration of local target `spec` (see local_cluster)."""
    target = local_target(spec)
    threads = target.threads or args.torch_threads
    resources = local_nodes.placement() if nodes else {}
    decode = TierConfig(num_replicas=target.decode, num_cpus=0.5, torch_threads=threads, resources=resources.get("decode"))
    return ClusterConfig(
        engine=local_engine_config(args, served_model_name="bench"),
        prefill=decode if target.colocated else dataclasses.replace(decode, num_replicas=target.prefill,
                                                                    resources=resources.get("prefill")),
        decode=decode,
        router=TierConfig(num_cpus=0.1, resources=resources.get("router")),
        colocated=target.colocated,
        engine_cores=target.engine_cores,
        redis_url=redis_url,
        routing=dataclasses.replace(routing or RoutingConfig(), policy=target.routing or "kv_aware"),
    )


@contextmanager
def local_cluster(spec: str, args, routing: RoutingConfig | None = None, nodes: bool = False):
    """Deploy `spec` on the local Ray (local_ray) and yield its base URL. `routing`
    overrides the placement settings (its policy comes from the spec); `nodes`: each
    replica on a node of its tier (local_ray's `nodes_for`)."""
    config = local_config(spec, args, routing, nodes, redis_url=args._redis.url)
    serve.run(build_app(on_this_machine(config)), name=APP_NAME, route_prefix="/")
    try:
        yield f"http://127.0.0.1:{args._http_port}"
    finally:
        serve.delete(APP_NAME)


def run_compare(args) -> int:
    a_spec, b_spec = parse_target(args.target_a), parse_target(args.target_b)
    local = [s for s in (a_spec, b_spec) if local_target(s)]
    if (local or offline_target(a_spec) or offline_target(b_spec)) and not args.local_model:
        raise ValueError("local and offline targets need --local-model MODEL_DIR")
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    with local_ray(args, specs=local) if local else nullcontext():
        for round_ in range(args.rounds):
            for label, spec in (("A", a_spec), ("B", b_spec)):
                print(f"round {round_ + 1}/{args.rounds}: {label} = {spec}")
                run_args = copy.copy(args)
                # New prompts each round, the same for A and B: a target that lives across
                # rounds (a URL) must not find last round's prompts in its prefix cache.
                run_args.seed = args.seed + round_
                if label == "A" and args.interference_only_b:
                    run_args.interference_rate = 0.0  # B's figures over A's: what the interference costs
                if offline_target(spec):
                    runs[label].append(run_offline(spec, run_args))
                    continue
                with (local_cluster(spec, args) if not spec.startswith("http") else nullcontext(spec)) as url:
                    run_args.base_url = url
                    run_args.model = None if not spec.startswith("http") else args.model
                    if not spec.startswith("http"):
                        run_args.tokenizer = args.local_model
                    runs[label].append(run_once(run_args))
    medians = {k: (statistics.median(r[k] for r in runs["A"]), statistics.median(r[k] for r in runs["B"])) for k in COMPARED}
    print(f"{'metric (median of rounds)':<28}{'A: ' + args.target_a:>22}{'B: ' + args.target_b:>22}{'B/A':>8}")
    for k, (a, b) in medians.items():
        print(f"{k:<28}{a:>22.2f}{b:>22.2f}{(b / a if a else float('nan')):>8.2f}")
    for label in ("A", "B"):
        server = runs[label][-1].get("server_metrics")
        if server:
            print(f"{label} server metrics (last round): " + ", ".join(f"{k}={v:.3g}" for k, v in server.items()))
    summary = {"A": args.target_a, "B": args.target_b, "rounds": args.rounds, "medians": medians,
               "ratios_b_over_a": {k: (b / a if a else None) for k, (a, b) in medians.items()},
               "runs": {label: [{k: r[k] for k in (*COMPARED, "completed", "failed", "server_metrics")} for r in rs]
                        for label, rs in runs.items()}}
    path = summary_path(args, "compare.json")
    write_result(path, summary)
    plot = plot_compare((args.target_a, args.target_b), medians, path.with_suffix(".png"))
    print(f"wrote {path} and {plot}")
    return 0
