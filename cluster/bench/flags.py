"""The `pdserve bench` subcommands' flags, apart from the code that runs them, so that
parsing a command line (and `--help`) imports neither torch nor Ray."""

from __future__ import annotations

import argparse
import os

from cluster.bench.datasets import DATASETS
from cluster.config import (
    INGRESS_MODES,
    KV_CACHE_DTYPE_HELP,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    CacheConfig,
    EngineConfig,
    PlannerConfig,
    RoutingConfig,
    SchedulerConfig,
)


def add_serve_flags(p) -> None:
    """`vllm bench serve`'s flags (same names and meanings)."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--model", help="the model name the server serves (default: the first of /v1/models)")
    p.add_argument("--tokenizer", help="model directory or .gguf file whose tokenizer to use (default: --model; "
                   "the built-in model's file when the server serves it)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="sent as a Bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--dataset-name", choices=DATASETS, default="random")
    p.add_argument("--dataset-path", help="ShareGPT JSON for sharegpt / multi_turn")
    p.add_argument("--num-prompts", type=int, default=100, help="requests (multi_turn: conversations)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1.0 is Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-prefix-len", type=int, default=0)
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    p.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    p.add_argument("--prefix-repetition-output-len", type=int, default=128)
    p.add_argument("--prefix-repetition-hot-fraction", type=float, default=0.0,
                   help="pdserve: this fraction of the requests share the first prefix (skew); the rest cycle through all")
    p.add_argument("--interference-rate", type=float, default=0.0,
                   help="pdserve: also send long prompts at this rate (req/s) while the workload runs; not measured")
    p.add_argument("--json-schema", metavar="PATH",
                   help="pdserve: every request asks for output matching this JSON schema (response_format json_schema)")
    p.add_argument("--interference-input-len", type=int, default=1536)
    p.add_argument("--interference-output-len", type=int, default=2)
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="of ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 25,50,99")
    p.add_argument("--goodput", nargs="+", metavar="METRIC:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--save-result", action="store_true", help="write the result JSON and PNG plots")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--metadata", nargs="*", metavar="KEY=VALUE", help="added to the result JSON")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--disable-tqdm", action="store_true")


def add_sweep_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--request-rates", required=True, help="comma-separated, e.g. 0.5,1,2,4")
    p.add_argument("--slo-ttft-ms", type=float, required=True)
    p.add_argument("--slo-tpot-ms", type=float, required=True)
    p.add_argument("--attainment", type=float, default=0.9, help="fraction of requests that must meet both SLOs")


def add_compare_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target-a", required=True,
                   help="URL, 'colocated[:routing]', '<P>p<D>d[:routing]' or 'offline' (an engine in this process)")
    p.add_argument("--target-b", required=True)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds; medians reported")
    p.add_argument("--interference-only-b", action="store_true",
                   help="send the --interference-* load to target B only (A = the same target alone, e.g. colocated vs colocated)")
    add_local_target_flags(p)


def add_chunk_flag(p: argparse.ArgumentParser) -> None:
    """--chunk: the step budget of the engines a benchmark starts, pdserve serve's by default."""
    p.add_argument("--chunk", type=int, default=SchedulerConfig().max_num_batched_tokens,
                   help="max_num_batched_tokens of each engine (default: pdserve serve's)")


def add_kv_cache_dtype_flag(p: argparse.ArgumentParser) -> None:
    """--kv-cache-dtype: of the engines a command starts, as pdserve serve's flag."""
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help=KV_CACHE_DTYPE_HELP)


def add_quantization_flag(p: argparse.ArgumentParser) -> None:
    """--quantization: of the engines a command starts, as pdserve serve's flag."""
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="auto",
                   help="auto: a GGUF file's Q4_0/Q4_1/Q8_0 weights read in their blocks; q8_0, q4_0: every other "
                   "linear quantized at load too; none: dequantized at load")


def add_local_target_flags(p: argparse.ArgumentParser) -> None:
    """How local_cluster builds a local target's engines."""
    p.add_argument("--local-model", help="model directory or .gguf file for local targets")
    p.add_argument("--ingress", choices=INGRESS_MODES, default="auto", help="how clients reach local targets' gateways")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    add_kv_cache_dtype_flag(p)
    add_quantization_flag(p)
    add_chunk_flag(p)
    p.add_argument("--max-step-slowdown", type=float, default=SchedulerConfig().max_step_slowdown,
                   help="of local engines (0: prompt chunks are not capped while requests decode)")
    p.add_argument("--torch-threads", type=int, default=1, help="per local worker replica")


def local_engine_config(args, **fields) -> EngineConfig:
    """The engine of a local target's replica, or of the offline target, from the flags
    add_local_target_flags declares (`fields`: the EngineConfig fields they do not set)."""
    return EngineConfig(
        model=args.local_model, dtype=args.dtype, quantization=args.quantization, max_model_len=args.max_model_len,
        cache=CacheConfig(memory_gib=args.kv_cache_gib, dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.chunk, max_step_slowdown=args.max_step_slowdown),
        **fields,
    )


def add_chaos_flags(p) -> None:
    add_serve_flags(p)
    add_local_target_flags(p)
    p.set_defaults(dtype="float32", local_model=None)  # float32: greedy text comparable with the offline run
    p.add_argument("--target", default="1p2d", help="local configuration: '<P>p<D>d[:routing]' or 'colocated'")
    p.add_argument("--kill", default="decode:SIGKILL@5s",
                   help="TIER:SIGNAL@STARTs[/EVERYs],... (SIGKILL, SIGSTOP, SIGTERM; NODE with --nodes)")
    p.add_argument("--nodes", action="store_true",
                   help="each replica on a Ray node of its own on this machine (KV moves over TCP between them)")
    p.add_argument("--hang-s", type=float, default=10.0, help="a SIGSTOPped replica is continued after this long")
    p.add_argument("--abort-ratio", type=float, default=0.0, help="fraction of requests the client drops mid-way")
    p.add_argument("--migration-limit", type=int, default=RoutingConfig().migration_limit)
    p.add_argument("--stall-timeout-s", type=float, default=5.0, help="a stream silent this long moves (SIGSTOP faults)")
    p.add_argument("--idle-timeout-s", type=float, default=180.0, help="wait at most this long for the idle cluster")


def add_protect_flags(p) -> None:
    """`pdserve bench protect`: decodes' p99 ITL alone and beside long prompts, over a grid."""
    add_serve_flags(p)
    add_local_target_flags(p)
    p.set_defaults(result_dir="bench-results")
    p.add_argument("--target", default="1p1d@1",
                   help="a local configuration, '<P>p<D>d[:routing][@threads][/cores]', or a server's URL")
    p.add_argument("--running", default="4,16", help="running decodes, comma-separated")
    p.add_argument("--output-lens", default="128", help="the decodes' output tokens, comma-separated")
    p.add_argument("--decode-input-len", type=int, default=128, help="the decodes' prompt tokens")
    p.add_argument("--requests-per-decode", type=int, default=6, help="requests each decode slot runs per measurement")
    p.add_argument("--prompt-lens", default="512,2048,4096", help="long prompts' tokens, comma-separated")
    p.add_argument("--arrival-rates", default="0.05,0.2,1", help="long prompts per second, comma-separated")
    p.add_argument("--saturated", type=float, default=0.9, help="a cell whose prefill tier is busy this fraction is saturated")


def add_trace_flags(p) -> None:
    """`pdserve bench trace`: a phased (or recorded) workload against each target in turn."""
    add_local_target_flags(p)
    p.set_defaults(dtype="auto")  # (--local-model: the built-in model by default)
    p.add_argument("--targets", default="planner,1p1d@1,2colocated@1,colocated@2",
                   help="comma-separated: 'planner' (pdserve serve --planner slo) and local configurations")
    p.add_argument("--trace", help="JSONL, one {t, prompt_len, output_len[, phase]} per request (default: the built-in "
                   "phases: chat, long prompts, long answers in bursts, quiet)")
    p.add_argument("--phase-s", type=float, default=150.0, help="each built-in phase's length")
    p.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    p.add_argument("--slo-itl-ms", type=float, default=60.0, help="a request's mean inter-token time (TPOT) target")
    p.add_argument("--planner-budget", type=int, default=2, help="cores the planner's tiers share (one per replica)")
    p.add_argument("--planner-profile", default=None, help="a replica profile (pdserve bench profile) to seed the planner")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--result-dir", default="bench-results")
    p.add_argument("--result-filename", default=None)


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of integers >= 1 (argparse type: a bad one is a usage error)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1 separated by commas, got {text!r}")
    return values


def add_profile_flags(p) -> None:
    """`pdserve bench profile`: one replica's step costs, offline, as a planner profile."""
    add_local_target_flags(p)
    p.set_defaults(dtype="auto")  # (--local-model: the built-in model by default)
    p.add_argument("--prompt-lens", type=positive_ints, default="64,256,1024,2048", help="prompts run alone")
    p.add_argument("--batch-sizes", type=positive_ints, default="1,2,4,8,16,32", help="batches run decoding")
    p.add_argument("--decode-steps", type=int, default=32, help="tokens each batch decodes")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--replica-start-s", type=float, default=None,
                   help="a replica's start as measured on the cluster (default: the engine's own, without Serve's)")
    p.add_argument("--base-url", default=None, help="a running server to measure a request's overhead outside the engines")
    p.add_argument("--model", default=None, help="the model id that server serves (default: its first)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="sent as a Bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--overhead-requests", type=int, default=16)
    p.add_argument("--out", default="profile.json")


def add_plan_flags(p) -> None:
    """`pdserve plan`: the split a workload needs, from a replica profile."""
    planner = PlannerConfig()
    p.add_argument("--profile", required=True, help="a replica profile (pdserve bench profile writes one)")
    p.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    p.add_argument("--slo-itl-ms", type=float, default=60.0, help="a request's mean inter-token time (TPOT) target")
    p.add_argument("--prefill-min-replicas", type=int, default=planner.min_prefill)
    p.add_argument("--prefill-max-replicas", type=int, default=planner.max_prefill)
    p.add_argument("--decode-min-replicas", type=int, default=planner.min_decode)
    p.add_argument("--decode-max-replicas", type=int, default=planner.max_decode)
    p.add_argument("--budget", type=float, default=None, help="replicas both tiers may use together (default: both maxima)")
    p.add_argument("--rate", type=float, default=1.0, help="steady load: requests/s")
    p.add_argument("--prompt-len", type=int, default=512, help="steady load: prompt tokens computed per request")
    p.add_argument("--output-len", type=int, default=128, help="steady load: output tokens per request")
    p.add_argument("--simulate", action="store_true", help="run --targets over a trace on the model of the cluster")
    p.add_argument("--targets", default="planner", help="comma-separated: planner, '<P>p<D>d', '<N>colocated'")
    p.add_argument("--trace", help="JSONL, one {t, prompt_len, output_len[, phase]} per request (default: built-in phases)")
    p.add_argument("--day", type=float, default=None, metavar="PEAK_RATE",
                   help="the built-in day instead: 24 phases (one an hour) peaking at this many requests/s")
    p.add_argument("--phase-s", type=float, default=150.0, help="each built-in phase's length")
    p.add_argument("--rate-scale", type=float, default=1.0, help="the built-in phases' rates times this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--planner-interval-s", type=float, default=planner.interval_s)
    p.add_argument("--planner-downscale-s", type=float, default=planner.downscale_s)
    p.add_argument("--request-timeout", type=float, default=600.0, help="a request slower than this failed")
    p.add_argument("--compare-with", help="a `pdserve bench trace` result of the same trace: measured beside simulated")
    p.add_argument("--result-dir", default="bench-results")
    p.add_argument("--result-filename", default=None)


def add_abuse_flags(p) -> None:
    """`pdserve bench abuse`: a victim key's TTFT alone and beside an abusive key."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--grpc-target", default="127.0.0.1:9000")
    p.add_argument("--model", help="the model name the server serves (default: the first of /v1/models)")
    p.add_argument("--api-key", required=True, help="the victim's key")
    p.add_argument("--abuser-key", required=True, help="another key the server accepts")
    p.add_argument("--mode", choices=("fanout", "fuzz"), default="fanout")
    p.add_argument("--fanout-prompts", type=int, default=100)
    p.add_argument("--fanout-n", type=int, default=16)
    p.add_argument("--fuzz-examples", type=int, default=200, help="schemathesis examples per operation and mode")
    p.add_argument("--abuser-threads", type=int, default=1, help="the abuser's concurrent senders (0: none)")
    p.add_argument("--never-read-http", type=int, default=24, help="fuzz: HTTP streams opened and never read, per phase")
    p.add_argument("--never-read-grpc", type=int, default=8, help="fuzz: gRPC streams opened and never read, per phase")
    p.add_argument("--rounds", type=int, default=3, help="alone/abused phase pairs")
    p.add_argument("--phase-s", type=float, default=30.0)
    p.add_argument("--victim-max-tokens", type=int, default=8)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--result-dir", default=None, help="write abuse-<mode>.json and its plot here")
