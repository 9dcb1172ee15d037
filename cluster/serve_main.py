"""`pdserve serve` and `pdserve status`: run the Serve application, report on it."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import socket
import sys
import threading
from pathlib import Path

import ray
from ray import serve

from cluster import ingress
from cluster.app import build_app, grpc_options
from cluster.config import RAY_SYSTEM_CONFIG, ClusterConfig, from_dict
from cluster.model.builtin import model_or_builtin
from cluster.model.families import parse_arch
from cluster.model.loader import open_checkpoint
from cluster.model.sharding import check_divisible
from cluster.openmp import usable_cpus, waiting_env
from cluster.redis_server import PrivateRedis
from cluster.serve_options import config_data
from router.auth import load_api_keys

APP_NAME = "pdserve"


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
    check_tensor_parallel(config)
    return config


def check_tensor_parallel(config: ClusterConfig) -> None:
    """A TP size the model cannot be split over fails here, in one line, rather than as
    replicas that never start. (Only when the model is on this machine: with --address it
    may exist only on the cluster's nodes, whose replicas then say the same.)"""
    tiers = [config.decode] if config.colocated else [config.prefill, config.decode]
    sizes = {t.tensor_parallel_size for t in tiers} - {1}
    if not sizes or not Path(config.engine.model).exists():
        return
    arch = parse_arch(open_checkpoint(config.engine.model).config())
    for size in sorted(sizes):
        check_divisible(arch, size)


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def cpus_requested(config) -> float:
    tiers = [(config.decode, config.decode.num_replicas), (config.router, config.router.num_replicas)]
    if not config.colocated:
        tiers.append((config.prefill, config.prefill.num_replicas))
    return sum(t.num_cpus * t.tensor_parallel_size * n for t, n in tiers)


def compute_threads(config: ClusterConfig) -> int:
    """Torch threads of all the cluster's worker ranks, at its most replicas."""
    tiers = [config.decode] if config.colocated else [config.prefill, config.decode]
    return sum(t.torch_threads * t.tensor_parallel_size * (t.autoscaling or {}).get("max_replicas", t.num_replicas)
               for t in tiers)


def on_this_machine(config: ClusterConfig) -> ClusterConfig:
    """`config` for a cluster whose replicas all run on this machine: its workers wait
    passively at OpenMP barriers if their threads outnumber its cores (cluster/openmp.py)."""
    env = waiting_env(compute_threads(config), usable_cpus())
    if not env:
        return config
    prefill, decode = (dataclasses.replace(t, env={**env, **(t.env or {})}) for t in (config.prefill, config.decode))
    return dataclasses.replace(config, prefill=prefill, decode=decode)


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
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
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
            config = on_this_machine(config)
            ingress_mode = start_local_ray(max(os.cpu_count() or 1, math.ceil(cpus_requested(config))), config.ingress)
        # After ray.init: Ray's core installs a fatal-signal handler for SIGTERM that would
        # abort the process after ours ran; replacing it keeps SIGTERM a clean, drained stop.
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        serve.start(http_options={"host": args.host, "port": config.http_port}, grpc_options=grpc_options(config.grpc_port))
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        tiers = "colocated" if config.colocated else f"{config.prefill.num_replicas} prefill + {config.decode.num_replicas} decode"
        print(f"pdserve is up: {tiers} replicas serving {config.engine.model_id} ({config.engine.model}).", file=sys.stderr)
        print(f"  OpenAI API: http://{args.host}:{config.http_port}/v1   gRPC: {args.host}:{config.grpc_port}", file=sys.stderr)
        print(f"  ingress: {ingress_mode}; auth: {'API key required' if config.gateway.api_keys else 'none'}. Ctrl-C stops it.",
              file=sys.stderr)
        try:
            while not stop.wait(1.0):
                pass
        except KeyboardInterrupt:
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
    return 0


def _drain() -> None:
    """Delete the application before shutting Serve down: its replicas take no new
    request and finish what they run (each within its tier's drain_timeout_s) while the
    proxies still carry their streams; serve.shutdown alone would cut them."""
    try:
        serve.delete(APP_NAME)
    except Exception as e:  # noqa: BLE001 - never deployed, or Serve already gone: nothing to drain
        print(f"drain skipped: {e}", file=sys.stderr)


def run_status(args) -> int:
    ray.init(address=args.address or os.environ.get("RAY_ADDRESS") or "auto", include_dashboard=False, log_to_driver=False)
    router = serve.get_app_handle(APP_NAME)
    stats = router.worker_stats.remote().result()
    print(json.dumps(stats, indent=2))
    return 0
