"""`pdserve bench profile`: what one replica's steps cost, measured offline, written as a
profile (cluster/planner/profile.py): the seed of a live planner (`serve
--planner-profile`) and the model of a simulated one (`pdserve plan --simulate`).

The engine is built as a local target's replica is (the same flags, --torch-threads each),
then runs prompts of each --prompt-lens alone (steps with prompt tokens only), batches of
each --batch-sizes decoding (decode-only steps), and a prompt joining each batch (steps with
both). The steps are fitted by the same StepCostModel every replica runs online
(cluster/planner/costs.py). The replica start is the engine's own (model load, KV cache,
warm-up) unless --replica-start-s gives one measured on the cluster (Serve's process start
comes on top). With --base-url, requests sent one at a time to that server measure what a
request spends outside the engines: overhead_s, its median TTFT there minus the same
prompt's on the engine here, and what a served step adds to the engine's (the worker's
loop, the delta channel, the processes beside it): its median token gap there minus the
fitted step of one request, added to both step bases.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import statistics
import time

import aiohttp
import torch
from tqdm import tqdm

from cluster.bench import datasets
from cluster.bench.engine_bench import random_prompts
from cluster.bench.flags import local_engine_config
from cluster.bench.openai_client import send
from cluster.bench.provenance import provenance
from cluster.config import ClusterConfig
from cluster.engine.engine import Engine
from cluster.engine.sampling_params import SamplingParams
from cluster.model.builtin import builtin_model_path
from cluster.model.gguf_tokenizer import load_tokenizer
from cluster.planner.costs import EngineCosts, StepCostModel
from cluster.planner.profile import Profile

JOINING_PROMPT = 256  # tokens of the prompt that joins each decoding batch
OVERHEAD_PROMPT = 32  # tokens of the requests that measure the overhead ...
OVERHEAD_OUTPUT = 16  # ... and their answers' (their token gaps: a served step)


def run_engine(engine: Engine, prompts: list[list[int]], max_tokens: int, joining: list[int] | None = None) -> None:
    """Run `prompts` to their end, from an empty prefix cache (their compute, not hits);
    `joining` is added halfway through their decoding (before it: decode-only steps)."""
    engine.pool.reset_prefix_cache()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    steps = 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
        if joining is not None and steps == 1 + max_tokens // 2:
            engine.add_request(joining, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))


def measure_costs(engine: Engine, prompt_lens: list[int], batch_sizes: list[int], decode_steps: int, rounds: int) -> EngineCosts:
    scheduler = engine.config.scheduler
    model = StepCostModel(chunk_tokens=min(scheduler.max_num_batched_tokens,
                                           scheduler.long_prefill_token_threshold or scheduler.max_num_batched_tokens))
    vocab = engine.loaded.arch.vocab_size
    work = [("prompt", n) for n in prompt_lens] + [("batch", b) for b in batch_sizes]
    seen = time.time()
    seeds = iter(range(100, 10**6))  # every prompt its own
    with tqdm(total=len(work) * rounds, desc="profiling the engine's steps", unit="run") as bar:
        for _ in range(rounds):
            for kind, n in work:
                if kind == "prompt":
                    run_engine(engine, random_prompts(1, n, vocab, seed=next(seeds)), max_tokens=1)
                else:
                    run_engine(engine, random_prompts(n, 16, vocab, seed=next(seeds)), max_tokens=decode_steps,
                               joining=random_prompts(1, JOINING_PROMPT, vocab, seed=next(seeds))[0])
                steps = engine.timeline.since(seen)
                model.observe(steps)
                seen = steps[-1].t + 1e-9 if steps else seen
                bar.update()
    report = model.report()
    if len(report) < len(dataclasses.fields(EngineCosts)):
        raise RuntimeError(f"too few steps to fit the engine's costs ({sorted(report)}): raise --rounds")
    return EngineCosts(**{**report, "chunk_tokens": int(report["chunk_tokens"])})


def engine_ttft(engine: Engine, prompts: list[list[int]]) -> float:
    """Median time to a prompt's first token on the engine alone (its compute, no edge)."""
    times = []
    for prompt in prompts:
        began = time.perf_counter()
        run_engine(engine, [prompt], max_tokens=1)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


async def served_timing(base_url: str, api_key: str | None, model: str | None, prompts: list[str]) -> tuple[float, float]:
    """Median TTFT and token gap of requests sent one at a time (the prompt's compute
    included; each its own prompt: no prefix-cache hit)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(base_url=base_url, headers=headers) as session:
        if model is None:
            async with session.get("/v1/models") as response:
                response.raise_for_status()
                model = (await response.json())["data"][0]["id"]
        ttfts, gaps = [], []
        for prompt in prompts:
            result = await send(session, "/v1/completions", model, prompt, OVERHEAD_OUTPUT, True, OVERHEAD_PROMPT)
            if not result.success:
                raise RuntimeError(f"{base_url}: a request failed ({result.error}: {result.detail})")
            ttfts.append(result.ttft)
            gaps.append((result.latency - result.ttft) / (OVERHEAD_OUTPUT - 1))
    return statistics.median(ttfts), statistics.median(gaps)


def run_profile_bench(args) -> int:
    args.local_model = args.local_model or str(builtin_model_path())
    torch.set_num_threads(args.torch_threads)
    print(f"loading {args.local_model} ({args.torch_threads} thread(s)) ...")
    began = time.perf_counter()
    engine = Engine(local_engine_config(args, num_threads=args.torch_threads))
    run_engine(engine, random_prompts(1, 16, engine.loaded.arch.vocab_size, seed=1), max_tokens=4)  # warm-up
    engine_start_s = time.perf_counter() - began
    costs = measure_costs(engine, args.prompt_lens, args.batch_sizes, args.decode_steps, args.rounds)
    overhead_s = step_overhead_s = 0.0
    if args.base_url:  # the same prompts served and on the engine alone
        tokenizer, rng = load_tokenizer(args.local_model), random.Random(time.time_ns())
        prompts = [datasets.random_text(rng, tokenizer, OVERHEAD_PROMPT) for _ in range(args.overhead_requests)]
        served, gap = asyncio.run(served_timing(args.base_url, args.api_key, args.model, prompts))
        alone = engine_ttft(engine, [tokenizer.encode(p, add_special_tokens=False) for p in prompts])
        overhead_s = max(0.0, served - alone)
        step_overhead_s = max(0.0, gap - costs.decode_step_s(1))
        costs = dataclasses.replace(costs, decode_base_s=costs.decode_base_s + step_overhead_s,
                                    prompt_base_s=costs.prompt_base_s + step_overhead_s)
    cluster = ClusterConfig(engine=engine.config)
    profile = Profile(
        prefill=costs, decode=costs,
        decode_step_slowdown=cluster.decode_step_slowdown,
        colocated_step_slowdown=engine.config.scheduler.max_step_slowdown,
        colocated_min_prompt_chunk=engine.config.scheduler.min_prompt_chunk,
        replica_start_s=args.replica_start_s if args.replica_start_s is not None else engine_start_s,
        overhead_s=overhead_s,
        source={**provenance(), "model": args.local_model, "threads": args.torch_threads,
                "dtype": str(engine.loaded.dtype), "engine_start_s": engine_start_s,
                "served_step_overhead_s": step_overhead_s},
    )
    profile.save(args.out)
    print(f"decode step {1e3 * costs.decode_base_s:.1f} ms + {1e3 * costs.decode_per_seq_s:.2f} ms per request; "
          f"prompt step {1e3 * costs.prompt_base_s:.1f} ms + {1e6 * costs.prompt_per_token_s:.0f} us per token "
          f"(chunks of {costs.chunk_tokens}); engine start {engine_start_s:.1f} s; a served request's overhead "
          f"{1e3 * overhead_s:.0f} ms and its step's {1e3 * step_overhead_s:.1f} ms")
    print(f"wrote {args.out}")
    return 0
