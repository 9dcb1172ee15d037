"""`pdserve serve`'s options, declared once.

Each flag names the ClusterConfig fields it sets. A flag's type, default and validation
are the field's own (cluster/config.py), and `deploy/serve.yaml`'s `args` are parsed by
the same `from_dict(ClusterConfig, ...)`, so the command line, the Serve config and the
defaults cannot disagree: adding an option is one Flag here (or none, for YAML only).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass

from cluster.config import (
    DTYPES,
    ENGINE_CORES,
    FAILURE_POLICIES,
    INGRESS_MODES,
    KV_CACHE_DTYPE_HELP,
    KV_CACHE_DTYPES,
    PLACEMENT_STRATEGIES,
    PLANNERS,
    QUANTIZATIONS,
    ROUTING_POLICIES,
    ClusterConfig,
)


@dataclass(frozen=True)
class Flag:
    name: str  # "--max-running-requests"
    paths: tuple[str, ...]  # the ClusterConfig fields it sets, dotted: ("gateway.max_running_requests",)
    help: str
    choices: tuple[str, ...] | None = None


SERVE_FLAGS = (
    Flag("--model", ("engine.model",), "Hugging Face model directory or .gguf file (default: the built-in SmolLM2-135M-Instruct)"),
    Flag("--served-model-name", ("engine.served_model_name",),
         "the model id clients send (default: the model's directory or file name; smollm2-135m-instruct for the built-in model)"),
    Flag("--dtype", ("engine.dtype",), "auto: by device and CPU capabilities (float32 with quantized weights)", DTYPES),
    Flag("--quantization", ("engine.quantization",), "auto: a GGUF file's Q4_0/Q4_1/Q8_0 weights are read in their "
         "blocks by the CPU kernels; q8_0, q4_0: every other linear and embedding weight quantized at load too; none: "
         "dequantized at load", QUANTIZATIONS),
    Flag("--max-model-len", ("engine.max_model_len",), "prompt + output tokens per request (default: the model's)"),
    Flag("--enforce-eager", ("engine.enforce_eager",), "GPU: decode steps run eagerly, without CUDA graphs"),
    Flag("--kv-cache-gib", ("engine.cache.memory_gib",), "KV cache per replica"),
    Flag("--kv-cache-dtype", ("engine.cache.dtype",), KV_CACHE_DTYPE_HELP, KV_CACHE_DTYPES),
    Flag("--max-num-batched-tokens", ("engine.scheduler.max_num_batched_tokens",),
         "tokens one engine step computes at most (prompt chunks + decodes)"),
    Flag("--max-step-slowdown", ("engine.scheduler.max_step_slowdown",),
         "while requests decode, a step carries prompt work up to this many decode steps' time (0: no cap)"),
    Flag("--decode-step-slowdown", ("decode_step_slowdown",), "decode protection: a disaggregated decode engine "
         "keeps prompt work beside its decodes within this many decode-only steps' time (0: no cap)"),
    Flag("--prefill-replicas", ("prefill.num_replicas",), "prefill tier replicas"),
    Flag("--decode-replicas", ("decode.num_replicas",), "decode tier replicas"),
    Flag("--torch-threads", ("prefill.torch_threads", "decode.torch_threads"), "torch threads per worker replica rank"),
    Flag("--tensor-parallel-size", ("prefill.tensor_parallel_size", "decode.tensor_parallel_size"),
         "ranks (processes, or GPUs) each worker replica's model is split over; both tiers"),
    Flag("--prefill-tp", ("prefill.tensor_parallel_size",), "tensor-parallel ranks per prefill replica"),
    Flag("--decode-tp", ("decode.tensor_parallel_size",), "tensor-parallel ranks per decode (or colocated) replica"),
    Flag("--tp-placement", ("prefill.placement_strategy", "decode.placement_strategy"),
         "Ray placement of a replica's ranks (STRICT_PACK: one node)", PLACEMENT_STRATEGIES),
    Flag("--colocated", ("colocated",), "one engine per replica doing both phases (no prefill tier)"),
    Flag("--http-port", ("http_port",), "OpenAI HTTP API port"),
    Flag("--grpc-port", ("grpc_port",), "gRPC API port"),
    Flag("--ingress", ("ingress",), "how clients reach the gateways on a local Ray: direct (HAProxy in front of the "
         "gateway replicas' own HTTP and gRPC servers), proxy (Serve's proxy actors), auto (direct where Serve ships "
         "HAProxy)", INGRESS_MODES),
    Flag("--engine-cores", ("engine_cores",), "a local CPU cluster: each decode engine thread gets a core of its own "
         "and prefill engines yield, when every engine thread has a core (auto), whenever the decode threads leave a "
         "core to spare (own), or never (shared)",
         ENGINE_CORES),
    Flag("--redis-url", ("redis_url",), "prefix index and rate limits (default: a private redis-server on a free port)"),
    Flag("--otlp-endpoint", ("otlp_endpoint",), "an OTLP/HTTP collector (http://host:4318): every replica sends it a "
         "trace of each request's phases (default: no tracing)"),
    Flag("--routing", ("routing.policy",), "how the gateway places requests on workers (kv_aware: the Redis prefix index)",
         ROUTING_POLICIES),
    Flag("--load-margin", ("routing.load_margin",), "load beats affinity: a worker carrying this many requests "
         "over the least-loaded one of its tier gets no new request"),
    Flag("--max-local-prefill-tokens", ("routing.max_local_prefill_tokens",), "a prompt of at most this many uncached tokens "
         "is computed by its decode worker when the prefill tier's queue would start it later (conditional "
         "disaggregation); 0: every prompt goes to the prefill tier"),
    Flag("--saturated-prefill-queue-tokens", ("routing.saturated_prefill_queue_tokens",), "beside running decodes, "
         "a decode worker computes a prompt only once this many prompt tokens queue on the prefill tier"),
    Flag("--migration-limit", ("routing.migration_limit",), "re-issues of a request whose decode worker fails mid-stream "
         "(0: the client gets the error)"),
    Flag("--stall-timeout-s", ("routing.stall_timeout_s",), "a stream without a token for this long counts as a failed worker"),
    Flag("--kv-failure-policy", ("transport.failure_policy",), "a failed prefill worker or KV transfer: retry on another "
         "prefill replica, recompute on the decode worker, or fail the request", FAILURE_POLICIES),
    Flag("--kv-transfer-timeout-s", ("transport.timeout_s",), "bound on each KV transfer wait (rendezvous, send, receive)"),
    Flag("--drain-timeout-s", ("prefill.drain_timeout_s", "decode.drain_timeout_s", "router.drain_timeout_s"),
         "a replica being stopped finishes its requests within this, then hands the rest to other replicas"),
    Flag("--api-key-file", ("gateway.api_key_file",), "file of API keys, one per line"),
    Flag("--max-running-requests", ("gateway.max_running_requests",), "generations (choices) streaming at once, per gateway "
         "replica, shared fairly between API keys"),
    Flag("--max-queued-requests", ("gateway.max_queued_requests",), "generations waiting for a slot, per gateway replica, "
         "each API key with work an equal share; beyond: 503"),
    Flag("--max-running-per-key", ("gateway.max_running_per_key",), "generations one API key may stream at once, per "
         "gateway replica, even with slots free (0: no cap; under contention keys share fairly anyway)"),
    Flag("--rate-limit-rps", ("gateway.rate_limit_rps",), "choices/s per API key (a request of p prompts x n takes p x n), "
         "shared through Redis (0: off)"),
    Flag("--rate-limit-burst", ("gateway.rate_limit_burst",), "token bucket size (0: the rate)"),
    Flag("--max-prompts-per-request", ("gateway.max_prompts_per_request",), "prompts one /v1/completions request may carry"),
    Flag("--max-choices-per-request", ("gateway.max_choices_per_request",), "generations one request may ask for (prompts x n)"),
    Flag("--max-request-input-tokens", ("gateway.max_request_input_tokens",), "prompt tokens of one request, over all its prompts"),
    Flag("--planner", ("planner.mode",), "slo: size the prefill and decode tiers from the TTFT/ITL targets while serving "
         "(cluster/planner); off: the tiers' fixed replica counts", PLANNERS),
    Flag("--slo-ttft-ms", ("planner.ttft_ms",), "the planner's mean time-to-first-token target"),
    Flag("--slo-itl-ms", ("planner.itl_ms",), "the planner's mean inter-token-latency target"),
    Flag("--prefill-min-replicas", ("planner.min_prefill",), "the planner's bounds (0: decode replicas compute every prompt)"),
    Flag("--prefill-max-replicas", ("planner.max_prefill",), "the planner's bounds"),
    Flag("--decode-min-replicas", ("planner.min_decode",), "the planner's bounds"),
    Flag("--decode-max-replicas", ("planner.max_decode",), "the planner's bounds"),
    Flag("--planner-interval-s", ("planner.interval_s",), "seconds between the planner's decisions (a move needs two "
         "in a row)"),
    Flag("--planner-downscale-s", ("planner.downscale_s",), "how long the planner's choice of a cheaper split must "
         "last before replicas go"),
    Flag("--planner-profile", ("planner.profile",), "a replica profile (pdserve bench profile): the planner sizes from "
         "it until the replicas have fitted their own step costs"),
    Flag("--planner-budget", ("planner.budget",), "resource units both tiers' replicas may use together (cores on a CPU "
         "cluster, GPUs on a GPU one; default: this machine's cores, or every tier at its max on a Ray cluster)"),
)


def config_field(path: str, root: type = ClusterConfig) -> tuple[type, object]:
    """(type, default) of a dotted ClusterConfig field; the type without `| None`."""
    cls = root
    *parents, name = path.split(".")
    for part in parents:
        cls = typing.get_type_hints(cls)[part]
    hint = typing.get_type_hints(cls)[name]
    if isinstance(hint, types.UnionType):
        hint = next(t for t in hint.__args__ if t is not type(None))
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return hint, field.default


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    for flag in SERVE_FLAGS:
        kind, default = config_field(flag.paths[0])
        shown = "" if default in (None, dataclasses.MISSING) else f" (default: {default})"
        dest = flag.name.removeprefix("--").replace("-", "_")
        if kind is bool:
            parser.add_argument(flag.name, dest=dest, action="store_true", default=None, help=flag.help)
        else:
            parser.add_argument(flag.name, dest=dest, type=kind, choices=flag.choices, default=None, help=flag.help + shown)


def config_data(args: argparse.Namespace) -> dict:
    """The flags given on the command line, as nested ClusterConfig data (the rest keep
    their config defaults)."""
    data: dict = {}
    for flag in SERVE_FLAGS:
        value = getattr(args, flag.name.removeprefix("--").replace("-", "_"))
        if value is None:
            continue
        for path in flag.paths:
            *parents, name = path.split(".")
            node = data
            for part in parents:
                node = node.setdefault(part, {})
            node[name] = value
    return data

