"""`offline[@T]`, a target of `pdserve bench compare`: the same workload through one engine
in this process, with no server and no client, so that a served configuration's figures
can be put over the engine's own, side by side in one run (served TPOT over the offline
step at the same batch).

The engine is built as a local target's replica builds it (--local-model, --dtype,
--max-model-len, --kv-cache-gib, --kv-cache-dtype, --chunk, --max-step-slowdown; T
torch threads, else --torch-threads), takes the workload's prompt texts, and runs them in
a closed loop: --max-concurrency requests at a time (all of them without it), the next
one added as one finishes, as the load client does. Times are taken as each step
returns: TTFT from a request's admission to the step giving its first token, ITL
between the steps giving its tokens. The result has `bench serve`'s keys.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch

from cluster.bench import datasets
from cluster.bench.flags import local_engine_config
from cluster.bench.openai_client import RequestResult
from cluster.bench.serve_bench import summarize
from cluster.engine.engine import Engine
from cluster.engine.sampling_params import SamplingParams

OFFLINE = re.compile(r"^offline(?:@(\d+))?$")


@dataclass(frozen=True)
class OfflineTarget:
    threads: int | None  # None: --torch-threads


def offline_target(spec: str) -> OfflineTarget | None:
    """The offline target `spec` names, or None if it names none."""
    m = OFFLINE.match(spec)
    if not m or m.group(1) == "0":
        return None
    return OfflineTarget(int(m.group(1)) if m.group(1) else None)


def run_offline(spec: str, args) -> dict:
    """One run of the workload (args as `bench compare` has them) on an engine in this process."""
    target = offline_target(spec)
    if args.request_rate != float("inf"):
        raise ValueError("the offline target runs a closed loop: leave --request-rate at inf (use --max-concurrency)")
    if args.dataset_name == "multi_turn":
        raise ValueError("the offline target takes single-turn datasets, not multi_turn")
    if args.interference_rate > 0:
        raise ValueError("the offline target sends no --interference-* load (--interference-only-b with offline as A)")
    threads = target.threads or args.torch_threads
    torch.set_num_threads(threads)
    engine = Engine(local_engine_config(args, num_threads=threads))
    try:
        work = datasets.load(args, engine.tokenizer)
        results, duration = closed_loop(engine, work, args.max_concurrency or len(work), args.ignore_eos)
        decode = engine.checked_stats()["step_seconds"]["decode"]  # checked: every block freed, invariants hold
    finally:
        engine.close()
    steps = decode["buckets"][-1]
    return {
        "base_url": spec,
        "model_id": args.local_model,
        "dataset_name": args.dataset_name,
        "max_concurrency": args.max_concurrency,
        **summarize(args, results, duration),
        "server_metrics": {"decode_decode_step_mean_ms": 1e3 * decode["sum"] / steps} if steps else None,
    }


def closed_loop(engine: Engine, work: list, concurrency: int, ignore_eos: bool) -> tuple[list[RequestResult], float]:
    """Each request's result, in the workload's order, and the run's seconds."""
    results = [RequestResult(prompt_len=r.prompt_len) for r in work]
    waiting = list(range(len(work)))
    running: dict[str, int] = {}  # request id -> index in work
    last_token_at: dict[int, float] = {}
    start = time.perf_counter()

    def admit() -> None:
        while waiting and len(running) < concurrency:
            i = waiting.pop(0)
            params = SamplingParams(max_tokens=work[i].output_len, temperature=0.0, ignore_eos=ignore_eos)
            results[i].start = time.perf_counter()  # before the prompt's tokenization, as a client's send
            running[engine.add_request(work[i].prompt, params)] = i

    admit()
    while running:
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            i = running.get(out.request_id)
            if i is None:
                continue
            r = results[i]
            if out.new_token_ids:
                if r.output_len == 0:
                    r.ttft = now - r.start
                else:
                    r.itl.append(now - last_token_at[i])
                last_token_at[i] = now
                r.token_times.append(now)
                r.output_len += len(out.new_token_ids)
                r.text += out.new_text
            if out.finished:
                r.latency, r.success = now - r.start, True
                del running[out.request_id]
        admit()
    return results, time.perf_counter() - start
