"""Typed configuration. Built once, never mutated (frozen dataclasses)."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

DTYPES = ("auto", "bfloat16", "float16", "float32")
# auto: a GGUF file's Q4_0 / Q4_1 / Q8_0 weights stay in their blocks where the CPU kernels read
# them (a TP rank its shard's); none: every tensor is dequantized at load; q8_0, q4_0: those kept, and every
# other linear and embedding weight quantized to that format at load (cluster/model/loader.py)
QUANTIZATIONS = ("auto", "none", "q8_0", "q4_0")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32")
KV_CACHE_DTYPE_HELP = "auto: the model's dtype; bfloat16 halves a float32 model's KV memory and attention reads"
PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")  # Ray placement groups
ROUTING_POLICIES = ("kv_aware", "prefix_hash", "round_robin", "power_of_two")
INGRESS_MODES = ("auto", "direct", "proxy")  # cluster/launch/ingress.py
ENGINE_CORES = ("auto", "own", "shared")  # cluster/host/engine_cores.py
GGUF_SUFFIX = ".gguf"
APP_NAME = "pdserve"  # the Serve application `pdserve serve` runs and `pdserve status` asks
# For every local Ray pdserve starts (deploy/cluster.yaml's `ray start` commands set the
# same): Ray runs its workers at nice 15 by default, below every ordinary process on the
# host, so on a CPU node the engines would yield their cores to anything else running
# there (a load client, a build). The replicas are the service itself: nice 0.
# Read-only: ray.init adds its own keys to the dict it gets (a session's spill directory),
# so each call passes a copy.
RAY_SYSTEM_CONFIG = types.MappingProxyType({"worker_niceness": 0})
# A local Ray (`pdserve serve` without --address, the benchmarks' and tests' clusters) shares
# this host's cores with the engines: Serve's controller reconciles every 0.25 s, not 0.1 s,
# unless the user set an interval. At full load on 2 cores the controller then takes 1.7% of
# a core instead of 3.4%, and Ray's GCS, which it calls, 1.1% instead of 2.0%. At 0.5 s
# replica deaths, deploys and stops took seconds longer. A cluster of `ray start` nodes
# (deploy/cluster.yaml) keeps Serve's default: its head node has cores to spare.
LOCAL_SERVE_ENVIRONMENT = types.MappingProxyType({"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.25"})


def default_served_name(model: str) -> str:
    """The model id clients send when none is configured: the model directory's or the
    GGUF file's name, never a filesystem path."""
    path = Path(model)
    return path.stem if path.suffix == GGUF_SUFFIX else path.name


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # KV cache size: an explicit block count wins over a memory budget.
    num_blocks: int | None = None
    memory_gib: float = 1.0
    enable_prefix_caching: bool = True
    # The cache's element type (KV_CACHE_DTYPES). bfloat16 under a float32 model halves the
    # cache's memory and the decode attention's reads, at the cost of rounding each K/V row
    # once, as it is stored (cluster/engine/runner.py: kv_cache_dtype).
    dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.memory_gib <= 0:
            raise ValueError(f"memory_gib must be > 0, got {self.memory_gib}")
        if self.dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"the KV cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.dtype!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    max_num_seqs: int = 64  # requests in the running batch
    long_prefill_token_threshold: int = 0  # >0 caps one request's chunk per step
    # While requests decode, a step carries only as much prompt work as keeps it within
    # this many decode-only steps' time (learned online, cluster/engine/step_budget.py):
    # a long prompt joining the batch stalls each decode at most ~this much. 0: no cap.
    max_step_slowdown: float = 2.0
    # ... but at least this many prompt tokens, so that prompts progress at a useful rate
    # (where one token costs more than the cap allows, the floor sets the step).
    min_prompt_chunk: int = 32
    # A prompt whose KV streams to a decode worker (a prefill tier's) and has more than
    # twice this many tokens left computes its last this-many in a chunk of their own: the
    # KV of the rest is sent while that chunk computes, so only the last chunk's is still
    # on its way at the first token (the second token waits for it). 0: whole budget.
    stream_kv_tail_tokens: int = 512

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.min_prompt_chunk < 1:
            raise ValueError("max_num_batched_tokens, max_num_seqs and min_prompt_chunk must be >= 1")
        if self.stream_kv_tail_tokens < 0:
            raise ValueError("stream_kv_tail_tokens must be >= 0")
        if self.max_step_slowdown != 0 and self.max_step_slowdown <= 1:
            raise ValueError("max_step_slowdown must be 0 (off) or > 1")


@dataclass(frozen=True)
class EngineConfig:
    model: str  # a Hugging Face model directory or a .gguf file
    dtype: str = "auto"
    quantization: str = "auto"  # QUANTIZATIONS
    served_model_name: str | None = None  # default: default_served_name(model)
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    device: str = "cpu"
    enforce_eager: bool = False  # CUDA: run decode steps eagerly, no CUDA graphs (vLLM's flag)
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    seed: int = 0
    cache: CacheConfig = CacheConfig()  # memory_gib: per rank
    scheduler: SchedulerConfig = SchedulerConfig()
    # Tensor parallelism (cluster/engine/tp_ranks.py): ranks per replica, one torch process group;
    # num_threads applies to each rank. Ranks are placed by a Ray placement group.
    tensor_parallel_size: int = 1
    tp_placement: str = "STRICT_PACK"  # STRICT_PACK: a replica's ranks share a node
    tp_timeout_s: float = 60.0  # a collective waiting longer means a rank is lost
    tp_shared_memory: bool = True  # CPU ranks on one host: collectives through /dev/shm, not gloo

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tp_placement not in PLACEMENT_STRATEGIES:
            raise ValueError(f"tp_placement must be one of {', '.join(PLACEMENT_STRATEGIES)}, got {self.tp_placement!r}")
        if self.tp_timeout_s <= 0:
            raise ValueError("tp_timeout_s must be > 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def model_id(self) -> str:
        """The served model name; also salts every KV block hash of this model."""
        return self.served_model_name or default_served_name(self.model)


FAILURE_POLICIES = ("retry", "recompute", "fail")


@dataclass(frozen=True)
class TransportConfig:
    """How KV blocks move from prefill to decode workers (cluster/kv/transport/)."""

    timeout_s: float = 30.0  # bound on every wait: rendezvous, send, receive
    # When a prefill worker fails before its reply (retry: ask another prefill replica,
    # then compute on decode; recompute: compute on decode at once; fail: the request
    # ends with an error), and when a transfer fails or times out (retry and recompute:
    # decode recomputes the prompt; fail: the request ends with an error).
    failure_policy: str = "recompute"
    shared_memory: bool = True  # between workers on one node, payloads skip the sockets (CPU caches)
    fail_transfer_ids: tuple[int, ...] = ()  # fault injection (tests): these transfers fail
    fail_every_nth: int = 0  # fault injection (tests): every nth transfer fails
    fail_midway: bool = False  # fault injection (tests): ... at their second part, after the first went

    def __post_init__(self) -> None:
        if self.failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"failure_policy must be one of {FAILURE_POLICIES}, got {self.failure_policy!r}")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")


@dataclass(frozen=True)
class TierConfig:
    """One Serve deployment's scaling and placement."""

    num_replicas: int = 1
    autoscaling: dict | None = None  # Serve autoscaling_config; replaces num_replicas when set
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict | None = None  # custom resources, e.g. {"prefill_node": 0.01} to pin a tier to its nodes
    torch_threads: int = 1  # torch intra-op threads per replica rank (replicas share the cores)
    env: dict | None = None  # environment variables of its replicas' processes (Ray's runtime_env)
    # Tensor parallelism: ranks per replica, each a process with `num_cpus`/`num_gpus` of its
    # own (one bundle of the replica's placement group; STRICT_PACK keeps them on one node).
    tensor_parallel_size: int = 1
    placement_strategy: str = "STRICT_PACK"
    # Requests Serve hands one replica at once (Serve's default is 5). Workers queue
    # inside their engine and the gateway admits on its own limits, so this is only a
    # ceiling; too low a value would silently cap the decode batch.
    max_ongoing_requests: int = 1024
    # A replica being stopped (scale-down, redeploy, shutdown) takes no new request and
    # has this long to finish what it runs; then it stops, and the router migrates what
    # is left to the remaining replicas (RoutingConfig.migration_limit).
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.num_replicas < 1 and not self.autoscaling:  # Serve takes 0 replicas only as an autoscaling minimum
            raise ValueError(f"num_replicas must be >= 1 (or autoscaling set), got {self.num_replicas}")
        if self.torch_threads < 1 or self.max_ongoing_requests < 1:
            raise ValueError("torch_threads and max_ongoing_requests must be >= 1")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"placement_strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}, got {self.placement_strategy!r}")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")


@dataclass(frozen=True)
class GatewayConfig:
    """The HTTP and gRPC edge: keys, admission and rate limits (per gateway replica,
    except the rate limit, whose buckets live in Redis and so are shared)."""

    api_keys: tuple[str, ...] = field(default=(), repr=False)  # none here or in the file: no auth; never logged
    api_key_file: str | None = None  # one key per line, read by each gateway replica (e.g. a mounted secret)
    # Admission, counted in choices (prompts x n) and shared fairly between keys (router/admission.py).
    max_running_requests: int = 256  # choices streaming at once
    max_queued_requests: int = 256  # choices waiting for a running slot
    max_running_per_key: int = 0  # choices one key may stream at once, even with slots free (0: no cap)
    queue_timeout_s: float = 30.0  # a queued request gives up (503) after this
    retry_after_s: int = 1  # Retry-After on 429/503
    rate_limit_rps: float = 0.0  # per API key, token bucket refill; 0 disables
    rate_limit_burst: int = 0  # bucket size (default: max(1, rate_limit_rps))
    max_body_bytes: int = 4 * 1024 * 1024  # larger request bodies get 413
    # Work one request may ask for: each choice (prompt x n) is a generation, holding an
    # admission slot and a rate-limit token; prompt tokens over all of its prompts.
    max_prompts_per_request: int = 32
    max_choices_per_request: int = 64
    max_request_input_tokens: int = 65536
    ready_timeout_s: float = 20.0  # /ready's real check (two tokens through every tier) must finish within this
    ready_interval_s: float = 10.0  # /ready answers with the last check, made at most this often

    def __post_init__(self) -> None:
        if self.max_running_requests < 1 or self.max_queued_requests < 0 or self.max_running_per_key < 0:
            raise ValueError("max_running_requests must be >= 1, max_queued_requests and max_running_per_key >= 0")
        if min(self.max_prompts_per_request, self.max_choices_per_request, self.max_request_input_tokens) < 1:
            raise ValueError("max_prompts_per_request, max_choices_per_request and max_request_input_tokens must be >= 1")
        if self.ready_timeout_s <= 0 or self.ready_interval_s < 0:
            raise ValueError("ready_timeout_s must be > 0 and ready_interval_s >= 0")
        if self.rate_limit_rps < 0 or self.rate_limit_burst < 0 or self.max_body_bytes < 1:
            raise ValueError("rate limits must be >= 0 and max_body_bytes >= 1")
        if any(not isinstance(k, str) or not k for k in self.api_keys):
            raise ValueError("API keys must be non-empty strings")


@dataclass(frozen=True)
class RoutingConfig:
    """How the gateway places requests on workers (router/router.py, cluster/serving/routing.py)."""

    policy: str = "kv_aware"  # kv_aware | prefix_hash | round_robin | power_of_two
    index_timeout_s: float = 0.05  # a prefix-index lookup slower than this falls back to prefix_hash
    # kv_aware cost, in tokens of prefill work: moving one token's KV costs this much ...
    transfer_weight: float = 0.1
    # ... and each request already running on a decode worker this much.
    running_weight: float = 16.0
    # Load beats affinity (kv_aware, prefix_hash): a worker carrying more than this many
    # requests (queued + running) over the least-loaded worker of its tier gets no new
    # request, whatever it caches; the least-loaded one gets it, unless more prompt tokens
    # queue there.
    load_margin: int = 4
    # Conditional disaggregation (kv_aware, with a prefill tier): a prompt of at most this many
    # uncached tokens is computed by its decode worker when the prefill worker's queue would
    # start it later than the decode worker could finish it at its step budget's rate
    # (router/placement.py: computes_locally). Longer prompts always go to the prefill tier:
    # beside decodes they would slow them for many steps. 0: every prompt goes there.
    max_local_prefill_tokens: int = 512
    # ... and, while requests run on that decode worker, only when the prefill tier is
    # saturated: this many prompt tokens queue at its least-loaded worker. A prompt computed
    # beside decodes slows every step of theirs (up to the step budget's max_step_slowdown),
    # a price worth paying only when the prefill tier cannot keep up; a short burst on a
    # tier that keeps up waits there instead.
    saturated_prefill_queue_tokens: int = 8192
    # A request whose decode worker fails mid-stream (died, unreachable, no progress for
    # stall_timeout_s) is re-issued to another one with the tokens streamed so far, at
    # most migration_limit times; the client's stream goes on without a gap or repeat.
    migration_limit: int = 3
    stall_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {ROUTING_POLICIES}, got {self.policy!r}")
        if self.index_timeout_s <= 0 or self.transfer_weight < 0 or self.running_weight < 0:
            raise ValueError("index_timeout_s must be > 0 and the weights >= 0")
        if self.load_margin < 0:
            raise ValueError("load_margin must be >= 0")
        if self.max_local_prefill_tokens < 0 or self.saturated_prefill_queue_tokens < 0:
            raise ValueError("max_local_prefill_tokens and saturated_prefill_queue_tokens must be >= 0")
        if self.migration_limit < 0 or self.stall_timeout_s <= 0:
            raise ValueError("migration_limit must be >= 0 and stall_timeout_s > 0")


PLANNERS = ("off", "slo")


@dataclass(frozen=True)
class PlannerConfig:
    """The SLO planner (cluster/planner): with mode "slo" it sizes the prefill and decode
    tiers within these bounds so that the mean TTFT and ITL stay within the targets, the
    tiers' replicas together using at most `budget` resource units (a replica of a tier
    costs its num_gpus, or num_cpus on a CPU cluster, times its tensor_parallel_size).
    "off": the tiers' own num_replicas (or Serve autoscaling) as before."""

    mode: str = "off"
    ttft_ms: float = 2000.0
    itl_ms: float = 100.0
    min_prefill: int = 0  # 0: the decode tier may compute every prompt (as colocated)
    max_prefill: int = 1
    min_decode: int = 1
    max_decode: int = 2
    budget: float | None = None  # None: this machine's cores (a local CPU cluster), else every tier at its max
    interval_s: float = 5.0  # between decisions
    confirm: int = 2  # another split this many decisions in a row before the tiers move ...
    downscale_s: float = 30.0  # ... and to a cheaper split, for this long
    profile: str | None = None  # a replica profile (pdserve bench profile): the costs known before replicas fit theirs

    def __post_init__(self) -> None:
        if self.mode not in PLANNERS:
            raise ValueError(f"planner must be one of {PLANNERS}, got {self.mode!r}")
        if self.ttft_ms <= 0 or self.itl_ms <= 0:
            raise ValueError("the SLO targets (ttft_ms, itl_ms) must be > 0")
        if not 0 <= self.min_prefill <= self.max_prefill or not 1 <= self.min_decode <= self.max_decode:
            raise ValueError("planner bounds need 0 <= min_prefill <= max_prefill and 1 <= min_decode <= max_decode")
        if self.budget is not None and self.budget <= 0:
            raise ValueError("the planner's budget must be > 0")
        if self.interval_s <= 0 or self.confirm < 1 or self.downscale_s < 0:
            raise ValueError("planner interval_s must be > 0, confirm >= 1 and downscale_s >= 0")


@dataclass(frozen=True)
class ClusterConfig:
    engine: EngineConfig
    prefill: TierConfig = TierConfig()
    decode: TierConfig = TierConfig()
    router: TierConfig = TierConfig(num_cpus=0.5)
    transport: TransportConfig = TransportConfig()
    colocated: bool = False  # one engine per replica doing both phases (decode tier only)
    http_port: int = 8000
    grpc_port: int = 9000
    # How clients reach the gateways (cluster/launch/ingress.py): a local Ray's setting; a Ray
    # cluster's own is set where it starts (deploy/cluster.yaml).
    ingress: str = "auto"
    # A local CPU cluster's decode engines on cores of their own, its prefill engines
    # yielding: when every engine thread has a core (auto), whenever the decode threads
    # leave one to spare (own), or never (shared): cluster/host/engine_cores.py.
    engine_cores: str = "auto"
    redis_url: str | None = None
    gateway: GatewayConfig = GatewayConfig()
    routing: RoutingConfig = RoutingConfig()
    # An OTLP/HTTP collector's base URL (http://host:4318): every replica exports a span per
    # phase of each request there (cluster/serving/tracing.py). None: no tracing.
    otlp_endpoint: str | None = None
    # Decode protection: a disaggregated decode tier's engines keep the prompt work they do
    # beside their decodes (prompts of a saturated prefill tier, recomputes after a failed
    # transfer) within this many decode-only steps' time, with no minimum chunk (the
    # engine's max_step_slowdown and min_prompt_chunk are for engines that do both phases).
    decode_step_slowdown: float = 1.2
    planner: PlannerConfig = PlannerConfig()

    def __post_init__(self) -> None:
        if self.otlp_endpoint is not None and not self.otlp_endpoint.startswith(("http://", "https://")):
            raise ValueError(f"otlp_endpoint must be an http(s) URL, got {self.otlp_endpoint!r}")
        if self.engine.tensor_parallel_size != 1:  # it would be silently overridden by the tiers'
            raise ValueError("set tensor_parallel_size per tier (prefill, decode), not on the engine")
        if self.ingress not in INGRESS_MODES:
            raise ValueError(f"ingress must be one of {INGRESS_MODES}, got {self.ingress!r}")
        if self.engine_cores not in ENGINE_CORES:
            raise ValueError(f"engine_cores must be one of {ENGINE_CORES}, got {self.engine_cores!r}")
        for name in ("http_port", "grpc_port"):
            if not 0 < getattr(self, name) < 65536:
                raise ValueError(f"{name} must be a TCP port (1-65535), got {getattr(self, name)}")
        if self.decode_step_slowdown != 0 and self.decode_step_slowdown <= 1:
            raise ValueError("decode_step_slowdown must be 0 (off) or > 1")
        if self.planner.mode != "off" and self.colocated:
            raise ValueError("the SLO planner sizes a disaggregated cluster's two tiers: not with colocated")

    def engine_for(self, tier: TierConfig, role: str) -> EngineConfig:
        """The engine config of one tier's replicas ("prefill" or "decode"): its threads, its
        TP layout and its step budget (scheduler_for)."""
        return dataclasses.replace(
            self.engine,
            num_threads=tier.torch_threads,
            tensor_parallel_size=tier.tensor_parallel_size,
            tp_placement=tier.placement_strategy,
            scheduler=self.scheduler_for(role),
        )

    def scheduler_for(self, role: str) -> SchedulerConfig:
        """A disaggregated decode tier's engines: decode_step_slowdown, no minimum chunk;
        every other engine: the engine's own."""
        if role != "decode" or self.colocated:
            return self.engine.scheduler
        return dataclasses.replace(self.engine.scheduler, max_step_slowdown=self.decode_step_slowdown, min_prompt_chunk=1)


def from_dict(cls, data: dict):
    """Build a (nested) config dataclass from plain data, e.g. Serve YAML `args`.
    Unknown keys are an error that names the allowed ones."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"unknown {cls.__name__} keys {sorted(unknown)}; allowed: {sorted(names)}")
    kwargs = {}
    for key, value in data.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            value = from_dict(hint, value)
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[key] = value
    return cls(**kwargs)
