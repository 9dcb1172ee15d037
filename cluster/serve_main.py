"""`pdserve serve`: run the Serve application (`pdserve status` reports on it: cluster/status.py)."""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import time
from pathlib import Path

import ray
from ray import serve

from cluster import engine_cores, ingress
from cluster.app import build_app, grpc_options
from cluster.config import APP_NAME, RAY_SYSTEM_CONFIG, ClusterConfig, from_dict
from cluster.engine.runner import check_kv_cache_fits, kv_cache_dtype, rank_kv_cache_bytes
from cluster.lifetime import start_reaper
from cluster.model.builtin import model_or_builtin
from cluster.model.checkpoints import open_checkpoint
from cluster.model.families import parse_arch
from cluster.model.loader import resolve_dtype
from cluster.model.sharding import check_divisible, shard_of
from cluster.openmp import usable_cpus, waiting_env
from cluster.ports import port_free
from cluster.redis_server import PrivateRedis
from cluster.serve_options import config_data
from router.auth import load_api_keys

STOP_POLL_S = 0.2  # how soon a SIGTERM's stop begins


def config_from_args(args) -> ClusterConfig:
    """The ClusterConfig of `pdserve serve`'s flags (cluster/serve_options.py), with the
    built-in model when none is given and the API keys from flags, file and environment."""
    data = config_data(args)
    engine = data.setdefault("engine", {})
    engine["model"], served_name = model_or_builtin(engine.get("model"), engine.get("served_model_name"))
    if served_name is not None:
        engine["served_model_name"] = served_name
    gateway = data.setdefault("gateway", {})
    if gateway.get("api_key_file"):
        load_api_keys(None, gateway["api_key_file"], env={})  # fail now (exit 2) if it is missing or empty
        gateway["api_key_file"] = str(Path(gateway["api_key_file"]).resolve())
    gateway["api_keys"] = load_api_keys(args.api_key)  # and $PDSERVE_API_KEY
    config = from_dict(ClusterConfig, data)
    check_model(config, on_a_remote_cluster=bool(args.address or os.environ.get("RAY_ADDRESS")))
    return config


def check_model(config: ClusterConfig, on_a_remote_cluster: bool) -> None:
    """A model the replicas could not load fails here, in one line, before Ray starts,
    rather than as replicas that fail and restart until Serve gives up: it must exist,
    be of a supported family, have a tokenizer and split over each tier's TP size. (On a
    remote cluster the model may exist only on its nodes: if it is not here, its
    replicas say the same.)"""
    if on_a_remote_cluster and not Path(config.engine.model).exists():
        return
    checkpoint = open_checkpoint(config.engine.model)
    arch = parse_arch(checkpoint.config())
    checkpoint.tokenizer()
    tiers = [config.decode] if config.colocated else [config.prefill, config.decode]
    for size in sorted({t.tensor_parallel_size for t in tiers} - {1}):
        check_divisible(arch, size)
    if not on_a_remote_cluster and config.engine.device == "cpu":  # every replica's cache is on this host
        dtype = kv_cache_dtype(config.engine.cache, resolve_dtype(config.engine.dtype, arch.torch_dtype, "cpu"))
        total = sum(most_replicas(t) * t.tensor_parallel_size
                    * rank_kv_cache_bytes(config.engine.cache, arch, shard_of(arch, 0, t.tensor_parallel_size), dtype)
                    for t in tiers)
        check_kv_cache_fits(total, "cpu", what="the KV caches of all replicas")


class ServeStartError(RuntimeError):
    """The application did not start (its replicas' own errors are in Ray's log)."""


def cpus_requested(config) -> float:
    tiers = [(config.decode, config.decode.num_replicas), (config.router, config.router.num_replicas)]
    if not config.colocated:
        tiers.append((config.prefill, config.prefill.num_replicas))
    return sum(t.num_cpus * t.tensor_parallel_size * n for t, n in tiers)


def compute_threads(config: ClusterConfig) -> int:
    """Torch threads of all the cluster's worker ranks, at its most replicas."""
    tiers = [config.decode] if config.colocated else [config.prefill, config.decode]
    return sum(tier_threads(t) for t in tiers)


def tier_threads(tier) -> int:
    """Torch threads of a tier's worker ranks, at its most replicas."""
    return tier.torch_threads * tier.tensor_parallel_size * most_replicas(tier)


def most_replicas(tier) -> int:
    return (tier.autoscaling or {}).get("max_replicas", tier.num_replicas)


def on_this_machine(config: ClusterConfig) -> ClusterConfig:
    """`config` for a cluster whose replicas all run on this machine: its workers wait
    passively at OpenMP barriers if their threads outnumber its cores (cluster/openmp.py),
    and its decode engines get cores of their own if they leave one to spare, its prefill
    engines yielding to everything else (cluster/engine_cores.py)."""
    env = waiting_env(compute_threads(config), usable_cpus())
    cores = engine_cores_of(config)
    prefill_env = {**env, **(cores.prefill_env if cores else {})}
    decode_env = {**env, **(cores.decode_env if cores else {})}
    if not prefill_env and not decode_env:
        return config
    prefill, decode = (dataclasses.replace(t, env={**extra, **(t.env or {})})
                       for t, extra in ((config.prefill, prefill_env), (config.decode, decode_env)))
    return dataclasses.replace(config, prefill=prefill, decode=decode)


def engine_cores_of(config: ClusterConfig) -> engine_cores.CorePlan | None:
    """The decode engines' own cores on this host for `config`, if they get some."""
    if config.engine.device != "cpu":
        return None
    return engine_cores.plan(tier_threads(config.decode), compute_threads(config), config.engine_cores)


def start_local_ray(num_cpus: int, ingress_mode: str, log_to_driver: bool = True) -> str:
    """Start a local Ray whose Serve reaches its gateways by `ingress_mode`
    (cluster/ingress.py); returns the resolved mode, "direct" or "proxy"."""
    with ingress.settings(ingress_mode) as mode:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=log_to_driver,
                 _system_config=dict(RAY_SYSTEM_CONFIG))
    return mode


def run_serve(args) -> int:
    config = config_from_args(args)
    address = args.address or os.environ.get("RAY_ADDRESS")
    if not address:  # a local cluster: its proxies bind these ports here
        for what, port in (("HTTP", config.http_port), ("gRPC", config.grpc_port)):
            if port and not port_free(args.host, port):
                # Serve's proxies bind with SO_REUSEPORT: a second server would silently share it.
                raise ValueError(f"{what} port {port} is in use (another pdserve serve?); pass --{what.lower()}-port")
    redis = None
    if config.redis_url is None:
        redis = PrivateRedis()
        config = dataclasses.replace(config, redis_url=redis.url)
        print(f"started a private redis-server at {redis.url}", file=sys.stderr)
    # SIGTERM asks for the same stop as Ctrl-C. Its handler only appends: a handler that takes
    # a lock (threading.Event.set does) deadlocks if it interrupts its own thread holding it.
    stop_signals: list[int] = []

    def request_stop(signum, _frame) -> None:
        stop_signals.append(signum)

    signal.signal(signal.SIGTERM, request_stop)
    up = False
    # Ctrl-C raises KeyboardInterrupt even when started in the background from a script
    # (which would otherwise inherit SIGINT as ignored and never stop on it).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        # A local Ray gets enough logical CPUs for every replica's reservation; the real
        # use of the cores is bounded by each replica's torch threads.
        if address:
            ray.init(address=address, include_dashboard=False)
            ingress_mode = "the cluster's own (deploy/cluster.yaml)"
        else:
            start_reaper()  # so that even a kill -9 of this process leaves none of the local Ray behind
            config = on_this_machine(config)
            ingress_mode = start_local_ray(max(os.cpu_count() or 1, math.ceil(cpus_requested(config))), config.ingress)
        # After ray.init: Ray's core installs a fatal-signal handler for SIGTERM that would
        # abort the process after ours ran; replacing it keeps SIGTERM a clean, drained stop.
        signal.signal(signal.SIGTERM, request_stop)
        serve.start(http_options={"host": args.host, "port": config.http_port}, grpc_options=grpc_options(config.grpc_port))
        try:
            serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        except RuntimeError as e:  # Serve gave up on a deployment whose replicas kept failing
            raise ServeStartError(f"{str(e).rstrip('.')} (the replicas' errors are in the log above)") from None
        tiers = "colocated" if config.colocated else f"{config.prefill.num_replicas} prefill + {config.decode.num_replicas} decode"
        print(f"pdserve is up: {tiers} replicas serving {config.engine.model_id} ({config.engine.model}).", file=sys.stderr)
        print(f"  OpenAI API: http://{args.host}:{config.http_port}/v1   gRPC: {args.host}:{config.grpc_port}", file=sys.stderr)
        print(f"  ingress: {ingress_mode}; auth: {'API key required' if config.gateway.api_keys else 'none'}. Ctrl-C stops it.",
              file=sys.stderr)
        up = True
        while not stop_signals:
            time.sleep(STOP_POLL_S)
    except KeyboardInterrupt:  # Ctrl-C, while serving or still starting: the same clean stop
        pass
    finally:
        print("stopping: requests in flight finish first (--drain-timeout-s) ...", file=sys.stderr)
        try:
            if ray.is_initialized():
                _drain()
            serve.shutdown()
            ray.shutdown()
        finally:
            if redis is not None:
                redis.stop()
    return 0 if up else 130  # 130: interrupted before it was up, as a shell reports Ctrl-C


def _drain() -> None:
    """Delete the application before shutting Serve down: its replicas take no new
    request and finish what they run (each within its tier's drain_timeout_s) while the
    proxies still carry their streams; serve.shutdown alone would cut them."""
    try:
        serve.delete(APP_NAME)
    except Exception as e:  # noqa: BLE001 - never deployed, or Serve already gone: nothing to drain
        print(f"drain skipped: {e}", file=sys.stderr)
