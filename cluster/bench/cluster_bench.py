"""`pdserve bench cluster`: end-to-end latency of colocated against disaggregated (1P1D),
same workload, on a local Ray, through the router's streaming interface.

Each configuration is deployed in turn and receives the same prompts (random token
ids, --input-len each, exactly --output-len greedy tokens, --concurrency at a time);
rounds alternate the configurations (--rounds) and medians across rounds are reported.
TTFT is the time to the first delta with a token; TPOT = (latency - TTFT) / (tokens - 1).
The KV transfer line reads the workers' transport counters.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path

import ray
import torch
from ray import serve
from tqdm import tqdm

from cluster.bench.provenance import write_result
from cluster.config import CacheConfig, ClusterConfig, EngineConfig, SchedulerConfig, TierConfig
from cluster.engine.sampling_params import SamplingParams
from cluster.host import local_ray
from cluster.launch.app import build_app


async def _one(router, prompt, params) -> dict:
    start = time.perf_counter()
    first = None
    n = 0
    async for out in router.options(stream=True).generate.remote(prompt, params):
        if out.new_token_ids and first is None:
            first = time.perf_counter() - start
        n += len(out.new_token_ids)
    latency = time.perf_counter() - start
    return {"ttft": first, "latency": latency, "tokens": n, "tpot": (latency - first) / max(1, n - 1)}


async def _workload(router, prompts, params, concurrency) -> list[dict]:
    gate = asyncio.Semaphore(concurrency)

    async def limited(p):
        async with gate:
            return await _one(router, p, params)

    return await asyncio.gather(*(limited(p) for p in prompts))


def _summary(results: list[dict], wall: float) -> dict:
    ttft = [r["ttft"] * 1e3 for r in results]
    tpot = [r["tpot"] * 1e3 for r in results]
    return {
        "median_ttft_ms": statistics.median(ttft),
        "p99_ttft_ms": sorted(ttft)[max(0, int(0.99 * len(ttft)) - 1)],
        "median_tpot_ms": statistics.median(tpot),
        "output_throughput": sum(r["tokens"] for r in results) / wall,
    }


def run_cluster_bench(args) -> int:
    engine = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.input_len + args.output_len + 16,
        cache=CacheConfig(memory_gib=1.0),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.chunk),
    )
    tier = TierConfig(num_cpus=0.5, torch_threads=args.torch_threads)
    configs = {
        "colocated": ClusterConfig(engine=engine, decode=tier, colocated=True, router=TierConfig(num_cpus=0.1)),
        "1P1D": ClusterConfig(engine=engine, prefill=tier, decode=tier, router=TierConfig(num_cpus=0.1)),
    }
    g = torch.Generator().manual_seed(0)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    prompts = [torch.randint(10, vocab, (args.input_len,), generator=g).tolist() for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    local_ray.init(8, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 0})
    rounds: dict[str, list[dict]] = {name: [] for name in configs}
    transfers: dict = {}
    try:
        with tqdm(total=args.rounds * len(configs), desc="cluster bench", unit="run") as bar:
            for _ in range(args.rounds):
                for name, config in configs.items():
                    router = serve.run(build_app(config), name="bench", route_prefix=None)
                    asyncio.run(_workload(router, prompts[:2], params, 2))  # warm-up
                    start = time.perf_counter()
                    results = asyncio.run(_workload(router, prompts, params, args.concurrency))
                    rounds[name].append(_summary(results, time.perf_counter() - start))
                    if name == "1P1D":
                        stats = router.worker_stats.remote().result()
                        transfers = next(iter(stats["decode"].values()))["transport"]
                    serve.delete("bench")
                    bar.update()
    finally:
        serve.shutdown()
        ray.shutdown()

    summary = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rounds.items()}
    print(f"\n{args.num_prompts} prompts x {args.input_len} tokens -> {args.output_len} tokens, concurrency {args.concurrency}")
    print(f"{'config':>10} {'TTFT med ms':>12} {'TTFT p99 ms':>12} {'TPOT med ms':>12} {'out tok/s':>10}")
    for name, s in summary.items():
        ttft, p99, tpot = s["median_ttft_ms"], s["p99_ttft_ms"], s["median_tpot_ms"]
        print(f"{name:>10} {ttft:>12.1f} {p99:>12.1f} {tpot:>12.1f} {s['output_throughput']:>10.1f}")
    c, d = summary["colocated"], summary["1P1D"]
    print(f"1P1D / colocated: TTFT {d['median_ttft_ms'] / c['median_ttft_ms']:.2f}x, TPOT {d['median_tpot_ms'] / c['median_tpot_ms']:.2f}x")
    if transfers.get("transfers_ok"):
        per = transfers["bytes_received"] / transfers["transfers_ok"]
        secs = transfers["seconds_receiving"] / transfers["transfers_ok"]
        print(f"KV transfer (last 1P1D round): {per / 1e6:.2f} MB and {secs * 1e3:.1f} ms per request (mean, receive side)")
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_result(out / "cluster-bench.json", {"summary": summary, "rounds": rounds, "transport": transfers})
    return 0
