"""`pdserve bench grammar`: what a new output constraint costs the requests already running.

An AsyncEngine (as a worker runs it) decodes `--running` plain requests; once they step
steadily, a request arrives with a JSON schema of `--properties` fields it has not seen, and
later one with the same schema again. Reported: the new schema's compile time (on a thread
of its own, not the engine's), the running requests' step gaps before and around each
arrival, and how many grammars were compiled (the repeat compiles nothing). The goal: a new
schema delays the others' steps by no more than one step. Writes a JSON and a PNG timeline.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from pathlib import Path

from cluster.bench.plots import plot_step_gaps
from cluster.bench.provenance import write_result
from cluster.config import EngineConfig
from cluster.engine.async_engine import AsyncEngine
from cluster.engine.engine import Engine
from cluster.engine.input_processor import TokenizedRequest
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.structured_outputs import StructuredOutputs
from cluster.host.cpu_features import cpu_summary

SETTLE_S = 3.0  # plain decoding before the first arrival
AROUND_S = 0.3  # the window after an arrival's compile in which a step gap counts as its


def schema_of(properties: int) -> dict:
    """A schema of `properties` required string fields, each with a pattern: a large grammar.
    (Hundreds of optional ones make llguidance's parser rows too wide to serve: see the
    README's structured-outputs limits.)"""
    names = [f"field_{i}" for i in range(properties)]
    return {"type": "object", "required": names, "additionalProperties": False, "properties": {
        name: {"type": "string", "pattern": f"[a-z]{{2,{8 + i % 7}}}(-[0-9]{{1,4}}){{0,3}}"} for i, name in enumerate(names)
    }}


async def _measure(engine: AsyncEngine, running: int, spec: StructuredOutputs) -> dict:
    prompt = engine.engine.tokenizer.encode("Tell me a long story about the sea.")
    steps: list[float] = []  # when the first running request got each token

    async def plain(i: int) -> None:  # decodes until cancelled: a request that reaches the context starts again
        params = SamplingParams(max_tokens=engine.engine.max_model_len - len(prompt), temperature=0, ignore_eos=True)
        for n in itertools.count():
            async for _ in engine.stream(TokenizedRequest(prompt, params), f"plain-{i}.{n}"):
                if i == 0:
                    steps.append(time.perf_counter())

    async def constrained(name: str) -> dict:
        request = TokenizedRequest(prompt, SamplingParams(max_tokens=4, temperature=0, structured=spec))
        arrived = time.perf_counter()
        await engine.prepare(request)
        compiled = time.perf_counter()
        async for _ in engine.stream(request, name):
            pass
        return {"arrived": arrived, "compiled": compiled, "compile_ms": (compiled - arrived) * 1e3}

    tasks = [asyncio.create_task(plain(i)) for i in range(running)]
    await asyncio.sleep(SETTLE_S)
    compiles_before = engine.engine.grammars.compiles
    new = await constrained("new-schema")
    await asyncio.sleep(1.0)
    repeat = await constrained("repeated-schema")
    await asyncio.sleep(1.0)
    compiles = engine.engine.grammars.compiles - compiles_before
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

    gaps = [(b, (b - a) * 1e3) for a, b in zip(steps, steps[1:])]
    steady = [g for t, g in gaps if steps[0] + 1.0 < t < new["arrived"]]

    def around(event: dict) -> list[float]:
        return [g for t, g in gaps if event["arrived"] <= t <= event["compiled"] + AROUND_S]

    return {
        "steady_step_ms": {"median": statistics.median(steady), "max": max(steady), "count": len(steady)},
        "new_schema": {"compile_ms": new["compile_ms"], "gaps_ms": around(new)},
        "repeated_schema": {"compile_ms": repeat["compile_ms"], "gaps_ms": around(repeat)},
        "grammars_compiled": compiles,
        "timeline": {"t": [t - steps[0] for t, _ in gaps], "gap_ms": [g for _, g in gaps],
                     "new_arrived": new["arrived"] - steps[0], "new_compiled": new["compiled"] - steps[0],
                     "repeat_arrived": repeat["arrived"] - steps[0]},
    }


def run_grammar_bench(args) -> int:
    config = EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads, max_model_len=args.max_model_len)
    print(f"CPU: {cpu_summary()}; loading {args.model} ...", flush=True)
    engine = AsyncEngine(lambda: Engine(config))
    spec = StructuredOutputs.json_schema(schema_of(args.properties))
    try:
        result = asyncio.run(_measure(engine, args.running, spec))
    finally:
        engine.shutdown()
    steady = result["steady_step_ms"]["median"]
    worst = max(result["new_schema"]["gaps_ms"], default=0.0)
    worst_repeat = max(result["repeated_schema"]["gaps_ms"], default=0.0)  # its prompt's step, without a compile
    result.update({"model": args.model, "running": args.running, "properties": args.properties, "threads": args.threads,
                   "worst_gap_over_steady_step": worst / steady, "repeat_worst_gap_over_steady_step": worst_repeat / steady})
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = write_result(out / "grammar-compile.json", result)
    plot_step_gaps(result, out / "grammar-compile.png")
    print(f"steady step {steady:.1f} ms; new schema ({args.properties} properties) compiled in "
          f"{result['new_schema']['compile_ms']:.1f} ms off the engine thread; the running requests' worst gap around it "
          f"{worst:.1f} ms ({result['worst_gap_over_steady_step']:.2f}x a step; around the same schema's repeat, which "
          f"compiles nothing: {worst_repeat:.1f} ms); grammars compiled: {result['grammars_compiled']}; wrote {path}")
    return 0
