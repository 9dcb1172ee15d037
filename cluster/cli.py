"""`pdserve` command line: make-model, generate, bench, plan, serve, status."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys

from cluster.bench.flags import (
    add_abuse_flags,
    add_chaos_flags,
    add_chunk_flag,
    add_compare_flags,
    add_kv_cache_dtype_flag,
    add_plan_flags,
    add_profile_flags,
    add_protect_flags,
    add_quantization_flag,
    add_serve_flags,
    add_sweep_flags,
    add_trace_flags,
    positive_ints,
)
from cluster.config import DTYPES, CacheConfig, EngineConfig
from cluster.host.cpu_features import CpuCapabilityError, detect
from cluster.launch.options import add_serve_flags as add_config_flags
from cluster.testing import ARCHS, SIZES

# Parsing a command line (and --help) imports neither torch nor Ray: each command's code
# is imported when it runs (`_runs`, and the imports inside the _cmd_* functions).


def _runs(target: str):
    """The command handler `module:function`, imported when the command runs."""
    module, name = target.split(":")

    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), name)(args)

    return run


def _cmd_make_model(args: argparse.Namespace) -> int:
    from cluster.testing.random_checkpoint import make_model  # noqa: PLC0415 - torch, only for this command

    out = make_model(args.arch, args.size, args.out, seed=args.seed, dtype=args.dtype, max_shard_bytes=args.max_shard_bytes)
    print(out)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    # torch, only for this command
    from cluster.engine.engine import Engine  # noqa: PLC0415
    from cluster.engine.sampling_params import SamplingParams  # noqa: PLC0415
    from cluster.model.builtin import model_or_builtin  # noqa: PLC0415

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        stop=tuple(args.stop or ()),
    )
    model, served_name = model_or_builtin(args.model, None)
    config = EngineConfig(
        model=model,
        served_model_name=served_name,
        dtype=args.dtype,
        quantization=args.quantization,
        max_model_len=args.max_model_len,
        num_threads=args.threads,
        cache=CacheConfig(memory_gib=args.kv_cache_gib, dtype=args.kv_cache_dtype),
        tensor_parallel_size=args.tensor_parallel_size,
    )
    engine = Engine(config)
    prompt = args.prompt if args.chat is None else engine.tokenizer.encode_chat([{"role": "user", "content": args.chat}])
    done = engine.generate([prompt], params)[0]
    if args.json:
        print(
            json.dumps(
                {
                    "prompt_token_ids": done.prompt_token_ids,
                    "token_ids": done.token_ids,
                    "text": done.text,
                    "finish_reason": done.finish_reason,
                }
            )
        )
    else:
        print(done.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    sub = p.add_subparsers(dest="command", required=True)

    mm = sub.add_parser("make-model", help="write a random-weight Hugging Face checkpoint with a locally trained tokenizer")
    mm.add_argument("--arch", choices=ARCHS, default="llama")
    mm.add_argument("--size", choices=SIZES, default="tiny", help="smollm2: SmolLM2-135M's shape, vocab 4096 (the benchmarks')")
    mm.add_argument("--out", required=True)
    mm.add_argument("--seed", type=int, default=0)
    mm.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    mm.add_argument("--max-shard-bytes", type=int, default=None, help="shard the safetensors above this size")
    mm.set_defaults(fn=_cmd_make_model)

    g = sub.add_parser("generate", help="generate from one prompt in this process (no Ray)")
    g.add_argument("--model", help="Hugging Face model directory or .gguf file (default: the built-in SmolLM2-135M-Instruct)")
    text = g.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", help="raw text to continue")
    text.add_argument("--chat", help="a user message, rendered with the model's chat template")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--dtype", choices=DTYPES, default="auto")
    add_quantization_flag(g)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--kv-cache-gib", type=float, default=1.0)
    add_kv_cache_dtype_flag(g)
    g.add_argument("--threads", type=int, default=None, help="torch intra-op threads (per tensor-parallel rank)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ranks (processes, or GPUs) the model is split over")
    g.add_argument("--json", action="store_true", help="last stdout line is a JSON object")
    g.set_defaults(fn=_cmd_generate)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    be = bsub.add_parser("engine", help="offline engine throughput against transformers and the bandwidth roofline")
    be.add_argument("--model", required=True)
    be.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    add_quantization_flag(be)
    be.add_argument("--llama-cpp-python", help="the Python of a venv with llama-cpp-python: llama.cpp on the same GGUF "
                    "file and threads, batch 1, as a baseline")
    be.add_argument("--input-len", type=int, default=256)
    be.add_argument("--output-len", type=int, default=64)
    add_kv_cache_dtype_flag(be)
    be.add_argument("--batch-sizes", type=positive_ints, default="1,16")
    be.add_argument("--threads", type=int, default=None, help="torch threads (per tensor-parallel rank)")
    be.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ranks the model is split over")
    be.add_argument("--rounds", type=int, default=3, help="alternating rounds per system; medians reported")
    be.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    be.add_argument("--result-dir", default="bench-results")
    be.set_defaults(fn=_runs("cluster.bench.engine_bench:run_engine_bench"))

    bc = bsub.add_parser("cluster", help="end-to-end TTFT/TPOT: colocated against 1P1D on a local Ray")
    bc.add_argument("--model", required=True)
    bc.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    bc.add_argument("--num-prompts", type=int, default=16)
    bc.add_argument("--input-len", type=int, default=512)
    bc.add_argument("--output-len", type=int, default=64)
    bc.add_argument("--concurrency", type=int, default=4)
    add_chunk_flag(bc)
    bc.add_argument("--torch-threads", type=int, default=1, help="per replica")
    bc.add_argument("--rounds", type=int, default=2)
    bc.add_argument("--result-dir", default="bench-results")
    bc.set_defaults(fn=_runs("cluster.bench.cluster_bench:run_cluster_bench"))

    bs = bsub.add_parser("serve", help="online serving benchmark against an OpenAI-compatible server (vllm bench serve's flags)")
    add_serve_flags(bs)
    bs.set_defaults(fn=_runs("cluster.bench.serve_bench:run_serve_bench"))
    bw = bsub.add_parser("sweep", help="request-rate sweep: the highest rate meeting TTFT and TPOT SLOs for 90%% of requests")
    add_serve_flags(bw)
    add_sweep_flags(bw)
    bw.set_defaults(fn=_runs("cluster.bench.sweep_compare:run_sweep"))
    bm = bsub.add_parser("compare", help="the same workload against two targets (URLs or local configs), alternately, as ratios")
    add_serve_flags(bm)
    add_compare_flags(bm)
    bm.set_defaults(fn=_runs("cluster.bench.sweep_compare:run_compare"))
    ba = bsub.add_parser("abuse", help="a victim key's TTFT alone and beside an abusive key (fan-out, or fuzzing and "
                         "never-read streams), the abuser's server errors, restarts and leaked blocks")
    add_abuse_flags(ba)
    ba.set_defaults(fn=_runs("cluster.bench.abuse_bench:run_abuse_bench"))
    bg = bsub.add_parser("grammar", help="what a new output constraint costs the requests already running: its compile, "
                         "off the engine thread, against their step gaps")
    bg.add_argument("--model", required=True)
    bg.add_argument("--dtype", choices=DTYPES, default="auto")
    bg.add_argument("--threads", type=int, default=1, help="torch threads (as a worker replica's default)")
    bg.add_argument("--max-model-len", type=int, default=2048)
    bg.add_argument("--running", type=int, default=8, help="plain requests decoding when the schema arrives")
    bg.add_argument("--properties", type=int, default=600, help="string fields (each with a pattern) of the new schema")
    bg.add_argument("--result-dir", default="bench-results")
    bg.set_defaults(fn=_runs("cluster.bench.grammar_bench:run_grammar_bench"))
    bt = bsub.add_parser("transport", help="KV transfer throughput between two processes here: shared memory (one Ray "
                         "node) against TCP sockets (different Ray nodes)")
    bt.add_argument("--blocks", default="1,16,64", help="blocks per transfer, comma-separated")
    bt.add_argument("--transfers", type=int, default=10, help="timed transfers per size and path")
    bt.add_argument("--layers", type=int, default=30, help="geometry (default: the built-in SmolLM2-135M's)")
    bt.add_argument("--kv-heads", type=int, default=3)
    bt.add_argument("--head-dim", type=int, default=64)
    bt.add_argument("--block-size", type=int, default=16)
    bt.add_argument("--result-dir", default="bench-results")
    bt.set_defaults(fn=_runs("cluster.bench.transport_bench:run_transport_bench"))
    bp = bsub.add_parser("protect", help="decode protection over a grid: running decodes' p99 ITL alone and beside long "
                         "prompts of several lengths and rates, and the long prompts' first-to-second token gap")
    add_protect_flags(bp)
    bp.set_defaults(fn=_runs("cluster.bench.protect_bench:run_protect_bench"))
    bo = bsub.add_parser("trace", help="a time-varying workload against each target (the SLO planner, fixed splits): "
                         "SLO attainment per phase, replicas per tier over time, replica-seconds, and a plot")
    add_trace_flags(bo)
    bo.set_defaults(fn=_runs("cluster.bench.trace_bench:run_trace_bench"))
    bf = bsub.add_parser("profile", help="one replica's step costs, measured offline: a profile for the SLO planner's "
                         "seed (serve --planner-profile) and its simulation (plan --simulate)")
    add_profile_flags(bf)
    bf.set_defaults(fn=_runs("cluster.bench.profile_bench:run_profile_bench"))
    bx = bsub.add_parser("chaos", help="a serving load on a local cluster while replicas are killed and requests aborted; "
                         "checks that none failed, texts match an offline run and no KV block leaked")
    add_chaos_flags(bx)
    bx.set_defaults(fn=_runs("cluster.bench.chaos_bench:run_chaos"))

    pl = sub.add_parser("plan", help="the tiers' split a workload needs, from a replica profile: for a steady load, "
                        "or simulated over a trace (--simulate), at any size")
    add_plan_flags(pl)
    pl.set_defaults(fn=_runs("cluster.bench.plan:run_plan"))

    s = sub.add_parser("serve", help="start the serving cluster on Ray (local unless RAY_ADDRESS/--address)")
    add_config_flags(s)
    s.add_argument("--host", default="127.0.0.1", help="where the HTTP and gRPC APIs listen (0.0.0.0: every interface; "
                   "every other port of a local cluster listens on loopback)")
    s.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve a non-loopback --host without API keys (anyone who reaches it may generate)")
    s.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a local Ray)")
    s.add_argument("--api-key", action="append", help="require this API key (repeatable; also $PDSERVE_API_KEY)")
    s.set_defaults(fn=_runs("cluster.launch.serve:run_serve"))

    st = sub.add_parser("status", help="replicas per tier, queue depths and KV usage of a running cluster")
    st.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else 'auto')")
    st.set_defaults(fn=_runs("cluster.launch.status:run_status"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # pdserve's own notices (e.g. which dtype `auto` chose, and why) on stderr.
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    logging.getLogger("cluster").setLevel(logging.INFO)
    try:
        detect()  # a bad PDSERVE_CPU_DISABLE is a one-line error too
        status = args.fn(args)
        sys.stdout.flush()  # here, where a reader gone is caught, not at the interpreter's exit
        return status
    except BrokenPipeError:
        # The reader stopped early (`pdserve status | head`): no error to report. stdout goes
        # nowhere from now on, so that the interpreter's flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE  # as a process that SIGPIPE ended
    except Exception as e:
        if not isinstance(e, _user_errors()):
            raise
        print(f"pdserve {args.command}: error: {e}", file=sys.stderr)
        return 2


# The errors a user fixes from the message alone (one line, exit status 2) beyond the
# built-in ones, as (module, name): cluster.launch.serve imports torch and Ray.
_USER_ERROR_TYPES = (
    ("cluster.model.checkpoint", "ModelLoadError"),
    ("cluster.launch.serve", "ServeStartError"),
)


def _user_errors() -> tuple[type[Exception], ...]:
    """The errors a user fixes from the message alone. An error type whose module was never
    imported cannot have been raised, so only those already imported are looked up: a
    command that failed before importing torch or Ray does not import them to say so.
    (InvalidRequestError and UnsupportedModelError are ValueErrors.)"""
    imported = tuple(getattr(sys.modules[module], name) for module, name in _USER_ERROR_TYPES if module in sys.modules)
    return (CpuCapabilityError, FileNotFoundError, ValueError, ConnectionError, *imported)


if __name__ == "__main__":
    sys.exit(main())
