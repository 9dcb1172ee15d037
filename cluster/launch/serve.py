"""`pdserve serve`: run the Serve application (`pdserve status` reports on it: cluster/launch/status.py)."""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import ray
from ray import serve

from cluster.config import APP_NAME, ClusterConfig, GatewayConfig, from_dict
from cluster.engine.runner import check_kv_cache_fits, kv_cache_dtype, rank_kv_cache_bytes
from cluster.host import engine_cores, local_ray
from cluster.host.bind_policy import LOOPBACK, is_loopback
from cluster.host.local_nodes import LocalNodes
from cluster.host.openmp import waiting_env
from cluster.kv.redis_client import split_password_file
from cluster.launch import ingress, planner
from cluster.launch.app import build_app, grpc_options
from cluster.launch.lifetime import running, start_reaper, stop_processes
from cluster.launch.options import config_data
from cluster.launch.ports import port_free
from cluster.launch.redis_server import PrivateRedis
from cluster.model.builtin import model_or_builtin
from cluster.model.checkpoints import open_checkpoint
from cluster.model.families import parse_arch
from cluster.model.loader import serving_dtype
from cluster.model.sharding import check_divisible, shard_of
from router.auth import ENV_VAR, load_api_keys

STOP_POLL_S = 0.2  # how often a stop checks on itself
STOP_MARGIN_S = 10.0  # a stop ends within the longest drain timeout and this (Serve's and Ray's shutdown)
FORCED_STOP_GRACE_S = 3.0  # a stop cut short: SIGTERM to what is left, SIGKILL after this
RAY_CORE_PROCESSES = frozenset({"gcs_server", "raylet"})  # a local Ray is gone when one of them is


def config_from_args(args) -> ClusterConfig:
    """The ClusterConfig of `pdserve serve`'s flags (cluster/launch/options.py), with the
    built-in model when none is given and the API keys from flags, file and environment."""
    data = config_data(args)
    engine = data.setdefault("engine", {})
    engine["model"], served_name = model_or_builtin(engine.get("model"), engine.get("served_model_name"))
    if served_name is not None:
        engine["served_model_name"] = served_name
    gateway = data.setdefault("gateway", {})
    if gateway.get("api_key_file"):
        load_api_keys(None, gateway["api_key_file"], env={})  # fail now (exit 2) if it is missing or empty
        gateway["api_key_file"] = str(Path(gateway["api_key_file"]).expanduser().resolve())
    gateway["api_keys"] = load_api_keys(args.api_key)  # and $PDSERVE_API_KEY
    config = from_dict(ClusterConfig, data)
    remote = bool(args.address or os.environ.get("RAY_ADDRESS"))
    if config.redis_url and not remote:
        split_password_file(config.redis_url)  # a password file that is missing or empty: exit 2 now
    check_model(config, on_a_remote_cluster=remote)
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
        dtype = kv_cache_dtype(config.engine.cache, serving_dtype(config.engine.dtype, checkpoint, "cpu", config.engine.quantization))
        total = sum(most_replicas(t) * t.tensor_parallel_size
                    * rank_kv_cache_bytes(config.engine.cache, arch, shard_of(arch, 0, t.tensor_parallel_size), dtype)
                    for t in tiers)
        check_kv_cache_fits(total, "cpu", what="the KV caches of all replicas")


class ServeStartError(RuntimeError):
    """The application did not start (its replicas' own errors are in Ray's log)."""


def cpus_requested(config) -> float:
    """Ray's logical CPUs for every tier at its most replicas."""
    tiers = [(config.decode, most_replicas(config.decode)), (config.router, most_replicas(config.router))]
    if not config.colocated:
        tiers.append((config.prefill, most_replicas(config.prefill)))
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
    passively at OpenMP barriers if their threads outnumber its cores (cluster/host/openmp.py),
    and its decode engines get cores of their own if they leave one to spare, its prefill
    engines yielding to everything else (cluster/host/engine_cores.py)."""
    # The host's cores, as this process found them before it kept off the decode cores (keep_off).
    env = waiting_env(compute_threads(config), len(engine_cores.HOST_CORES))
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


def start_local_ray(num_cpus: int, ingress_mode: str, log_to_driver: bool = True, api_host: str = LOOPBACK,
                    api_ports: tuple[int, ...] = (), max_message_bytes: int = GatewayConfig.max_body_bytes) -> str:
    """Start a local Ray (cluster/host/local_ray.py) whose Serve reaches its gateways by
    `ingress_mode` (cluster/launch/ingress.py), its proxies serving the API on (api_host,
    api_ports) in proxy mode, gRPC messages up to `max_message_bytes`; returns the resolved
    mode, "direct" or "proxy"."""
    with ingress.settings(ingress_mode, max_message_bytes) as mode:
        local_ray.init(num_cpus, api_host, api_ports, log_to_driver=log_to_driver)
    return mode


def start_local_nodes(head_cpus: int, ingress_mode: str, log_to_driver: bool = True) -> LocalNodes:
    """A Ray of several nodes on this machine (cluster/host/local_nodes.py), the head's
    Serve reaching its gateways by `ingress_mode`; serve.start it with proxy_location
    "HeadOnly" (the nodes share one address: proxies on each would contend for the port)."""
    with ingress.settings(ingress_mode):
        return LocalNodes(head_cpus, log_to_driver=log_to_driver)


def check_exposure(host: str, config: ClusterConfig, allow_unauthenticated: bool) -> None:
    """An API reachable from the network needs API keys, or the operator's word that it may go
    without (a one-line error, exit 2, before anything starts)."""
    if not is_loopback(host) and not api_key_count(config) and not allow_unauthenticated:
        raise ValueError(f"--host {host} puts the API on the network: give it API keys (--api-key-file, --api-key or "
                         f"${ENV_VAR}), or pass --allow-unauthenticated to serve it to anyone who can reach it")


def api_key_count(config: ClusterConfig) -> int:
    """The keys the gateways will accept: the configured ones and the key file's."""
    gateway = config.gateway
    return len(load_api_keys(gateway.api_keys, gateway.api_key_file, env={}))


def exposure(host: str, config: ClusterConfig, remote: bool) -> str:
    """What `serve` exposes and how it is protected, in one line."""
    keys = api_key_count(config)
    auth = f"API key required ({keys} key{'s' if keys != 1 else ''})" if keys else "none"
    if remote:
        return f"auth: {auth}; the API's reach and the cluster's other ports are the Ray cluster's own (deploy/README.md)"
    reach = "this host only (loopback)" if is_loopback(host) else f"the network ({host})"
    if not keys and not is_loopback(host):
        auth += ": anyone who reaches it may generate (--allow-unauthenticated)"
    return f"API reachable from {reach}, every other port of the cluster on loopback; auth: {auth}"


class StopRequested(Exception):
    """SIGINT or SIGTERM while `serve` starts or serves: the stop begins."""


class _Stopping:
    """The signal handler for SIGINT and SIGTERM. Until the stop begins, a signal raises
    StopRequested (a start still deploying is cut short; a serving one stops, draining);
    once it has begun, a signal marks it forced, which ends the drain at once. Neither takes
    a lock: a handler that did (threading.Event.set does) would deadlock if it interrupted
    its own thread holding it."""

    def __init__(self):
        self.signum: int | None = None  # the first stop signal
        self.begun = False
        self.forced = False

    def handle(self, signum, _frame) -> None:
        self.signum = self.signum or signum
        if self.begun:
            self.forced = True
            return
        self.begun = True
        raise StopRequested


def run_serve(args) -> int:
    config = planner.planned(config_from_args(args))
    address = args.address or os.environ.get("RAY_ADDRESS")
    check_exposure(args.host, config, args.allow_unauthenticated)
    if not address:  # a local cluster: its proxies bind these ports here
        for what, port in (("HTTP", config.http_port), ("gRPC", config.grpc_port)):
            if port and not port_free(args.host, port):
                # Serve's proxies bind with SO_REUSEPORT: a second server would silently share it.
                raise ValueError(f"{what} port {port} is in use (another pdserve serve?); pass --{what.lower()}-port")
    # Everything this process starts for a local cluster stays off the decode engines' cores.
    engine_cores.keep_off(None if address else engine_cores_of(config))
    redis = None
    if config.redis_url is None:
        redis = PrivateRedis()
        config = dataclasses.replace(config, redis_url=redis.url)
        print(f"started a private redis-server at {redis.url}", file=sys.stderr)
    stopping = _Stopping()
    signal.signal(signal.SIGTERM, stopping.handle)
    # Also when started in the background from a script, which inherits SIGINT ignored.
    signal.signal(signal.SIGINT, stopping.handle)
    up = False
    ray_core: list[psutil.Process] = []  # a local Ray's GCS and raylet
    reaper = None
    try:
        # A local Ray gets enough logical CPUs for every replica's reservation; the real
        # use of the cores is bounded by each replica's torch threads.
        if address:
            local_ray.connect(address)
            ingress_mode = "the cluster's own (deploy/cluster.yaml)"
        else:
            reaper = start_reaper()  # so that even a kill -9 of this process leaves none of the local Ray behind
            config = on_this_machine(config)
            ingress_mode = start_local_ray(max(os.cpu_count() or 1, math.ceil(cpus_requested(config))), config.ingress,
                                           api_host=args.host, api_ports=(config.http_port, config.grpc_port),
                                           max_message_bytes=config.gateway.max_body_bytes)
            ray_core = [p for p in psutil.Process().children(recursive=True) if p.name() in RAY_CORE_PROCESSES]
        # After ray.init: Ray's core installs a fatal-signal handler for SIGTERM that would
        # abort the process after ours ran; replacing it keeps SIGTERM a clean, drained stop.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, stopping.handle)
        serve.start(http_options={"host": args.host, "port": config.http_port}, grpc_options=grpc_options(config.grpc_port))
        try:
            if config.planner.mode == "slo":
                planner.deploy(config, local=not address)
            else:
                serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        except RuntimeError as e:  # Serve gave up on a deployment whose replicas kept failing
            raise ServeStartError(f"{str(e).rstrip('.')} (the replicas' errors are in the log above)") from None
        tiers = "colocated" if config.colocated else f"{config.prefill.num_replicas} prefill + {config.decode.num_replicas} decode"
        if config.planner.mode == "slo":
            p = config.planner
            tiers = (f"prefill {p.min_prefill}-{p.max_prefill} + decode {p.min_decode}-{p.max_decode} (SLO planner: TTFT "
                     f"{p.ttft_ms:g} ms, ITL {p.itl_ms:g} ms, budget {planner.budget(config, local=not address):g})")
        print(f"pdserve is up: {tiers} replicas serving {config.engine.model_id} ({config.engine.model}).", file=sys.stderr)
        print(f"  OpenAI API: http://{args.host}:{config.http_port}/v1   gRPC: {args.host}:{config.grpc_port}", file=sys.stderr)
        print(f"  {exposure(args.host, config, remote=bool(address))}", file=sys.stderr)
        print(f"  ingress: {ingress_mode}. Ctrl-C stops it.", file=sys.stderr)
        up = True
        while True:
            time.sleep(STOP_POLL_S)
    except StopRequested:
        pass
    finally:
        stopping.begun = True  # a signal from now on cuts the stop short instead of raising inside it
        print("stopping: requests in flight finish first (--drain-timeout-s) ...", file=sys.stderr)
        drain_s = max(t.drain_timeout_s for t in (config.prefill, config.decode, config.router))
        with _forced_stop_after(drain_s + STOP_MARGIN_S, ray_core, stopping, redis, reaper):
            try:
                if ray.is_initialized():
                    _drain()
                ray_core.clear()  # from here on Ray's processes stop by our hand
                serve.shutdown()
                ray.shutdown()
            finally:
                if redis is not None:
                    redis.stop()
    if up and stopping.signum is not None:
        return 0  # stopped as asked, drained
    return 128 + (stopping.signum or signal.SIGINT)  # interrupted before it was up, as a shell reports it


@contextmanager
def _forced_stop_after(timeout_s: float, ray_core: list[psutil.Process], stopping: _Stopping, redis,
                       reaper: subprocess.Popen | None) -> Iterator[None]:
    """The stop inside ends within `timeout_s`, or it is cut short: when it overruns, when a
    second signal asks, or once one of `ray_core` (the local Ray's own processes, while the
    caller leaves them in the list) has died: a signal to the whole process group reaches
    them too, and every call into Ray would then wait on a GCS that is gone. Cut short,
    what this process started is stopped and it exits with 128 + the signal, skipping Ray's
    exit handlers (they wait on the same GCS); the reaper then stops what a dead Ray worker
    left orphaned (HAProxy), out of this process's tree."""
    done = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while not done.wait(STOP_POLL_S):
            if stopping.forced or time.monotonic() > deadline or not all(running(p) for p in ray_core):
                break
        else:
            return
        print("stopping at once: the local Ray is gone, the drain overran, or a second signal came", file=sys.stderr)
        if redis is not None:
            redis.stop()
        started = [p for p in psutil.Process().children(recursive=True) if reaper is None or p.pid != reaper.pid]
        stop_processes(started, FORCED_STOP_GRACE_S)
        sys.stderr.flush()
        os._exit(128 + (stopping.signum or signal.SIGTERM))

    watcher = threading.Thread(target=watch, name="pdserve-stop-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def _drain() -> None:
    """Delete the application before shutting Serve down: its replicas take no new
    request and finish what they run (each within its tier's drain_timeout_s) while the
    proxies still carry their streams; serve.shutdown alone would cut them."""
    try:
        serve.delete(APP_NAME)
    except Exception as e:  # noqa: BLE001 - never deployed, or Serve already gone: nothing to drain
        print(f"drain skipped: {e}", file=sys.stderr)
