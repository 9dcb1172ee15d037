"""`pdserve bench protect`: decode protection over a grid of mixes, not one workload.

On one cluster (--target: a local configuration it starts, default 1p1d@1, or a URL),
for each number of running decodes (--running) and decode output length (--output-lens):

    alone    the decodes by themselves: `running` streams at a time, --requests-per-decode
             each, of --decode-input-len prompt tokens
    beside   the same decodes with long prompts arriving (Poisson), one run per prompt
             length (--prompt-lens) and arrival rate (--arrival-rates); each long prompt
             asks for 2 tokens, so its second token waits for the hand-off

and per cell: the decodes' p99 ITL beside over alone (the inflation decode protection
must keep small), the long prompts' first-to-second token gap over the decodes' median ITL
beside (and every handed-off request's, short ones included: the decode tier's `handoff`
phase), how many long prompts arrived and ended, and the prefill tier's busy fraction (its
engines' step seconds over the run, from /metrics): a cell whose prefill tier is busy
>= --saturated of the time is marked saturated. Every cell's alone and beside runs are
back to back on the same cluster, prompts drawn with the same seed. Writes protect.json and
protect.png (a heat map per decode mix).

On a local target the decode workers' own step timelines come too: per cell, how many of
their steps were slow (over 1.2x the alone median of their batch size) and why (prompt work
beside the decodes, the engine thread's work between steps, its core taken, longer compute:
cluster/bench/decode_timeline.py); every cell's steps in protect-steps.json, the worst
unsaturated cell's drawn in protect-steps.png.
"""

from __future__ import annotations

import copy
import itertools
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cluster.bench.decode_timeline import alone_medians, attribute, decode_timelines
from cluster.bench.offline_target import offline_target
from cluster.bench.plots import plot_decode_steps, plot_protect
from cluster.bench.provenance import write_result
from cluster.bench.serve_bench import measure
from cluster.bench.sweep_compare import local_cluster, local_ray, local_target, parse_target
from cluster.host.cpu_features import cpu_summary
from cluster.model.builtin import builtin_model_path


def _ints(text: str, flag: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"{flag} takes positive integers, comma-separated (got {text!r})")
    return values


def _floats(text: str, flag: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or min(values) <= 0:
        raise ValueError(f"{flag} takes positive numbers, comma-separated (got {text!r})")
    return values


def _run(args, url: str, running: int, output_len: int, prompt_len: int = 0, rate: float = 0.0,
         timelines: bool = False) -> tuple[dict, dict | None]:
    """The run's result, and with `timelines` the decode workers' steps during it."""
    run_args = copy.copy(args)
    run_args.base_url, run_args.model, run_args.tokenizer = url, None, args.local_model
    run_args.dataset_name, run_args.random_input_len, run_args.random_output_len = "random", args.decode_input_len, output_len
    run_args.num_prompts, run_args.max_concurrency = running * args.requests_per_decode, running
    run_args.request_rate, run_args.ignore_eos, run_args.num_warmups = float("inf"), True, 0
    run_args.percentile_metrics, run_args.metric_percentiles = "ttft,tpot,itl", "50,99"  # what _cell reads
    run_args.interference_rate, run_args.interference_input_len, run_args.interference_output_len = rate, prompt_len, 2
    began = []
    result = measure(run_args, on_start=lambda: began.append(time.time()))[0]
    return result, decode_timelines(began[0]) if timelines else None


def _cell(args, alone: dict, beside: dict, prompt_len: int, rate: float) -> dict:
    interference = beside["interference"]
    gaps = interference["first_to_second_token_ms"]
    server = beside.get("server_metrics") or {}
    busy = server.get("prefill_engine_busy_s", 0.0) / beside["duration"]
    return {
        "prompt_len": prompt_len,
        "arrival_rate": rate,
        "p99_itl_alone_ms": alone["p99_itl_ms"],
        "p99_itl_beside_ms": beside["p99_itl_ms"],
        "p99_itl_inflation": beside["p99_itl_ms"] / alone["p99_itl_ms"],
        "median_itl_beside_ms": beside["median_itl_ms"],
        "long_prompts_ended": interference["completed"],
        "long_prompts_failed": interference["failed"],
        "first_to_second_ms": gaps,
        "max_gap_over_median_itl": max(gaps) / beside["median_itl_ms"] if gaps else None,
        "decodes_failed": alone["failed"] + beside["failed"],
        "local_prefills": server.get("route_local_prefills", 0.0),  # prompts (of either kind) computed beside the decodes
        "handoff_mean_ms": server.get("handoff_mean_ms"),  # every handed-off request's first token to its second, beside
        "prefill_busy": busy,
        "saturated": busy >= args.saturated,
        "duration_s": beside["duration"],
    }


def _print_cell(running: int, output_len: int, cell: dict) -> None:
    gap = cell["max_gap_over_median_itl"]
    line = (f"protect: {running} decodes x {output_len} tokens, {cell['prompt_len']}-token prompts at {cell['arrival_rate']}/s: "
            f"p99 ITL {cell['p99_itl_inflation']:.2f}x, max first-to-second gap "
            f"{'-' if gap is None else f'{gap:.2f}x'} the median ITL ({cell['long_prompts_ended']} ended), "
            f"prefill busy {cell['prefill_busy']:.0%}{' (saturated)' if cell['saturated'] else ''}, "
            f"{cell['local_prefills']:.0f} prompts computed on decode")
    if cell["handoff_mean_ms"] is not None:
        line += f", every hand-off's first-to-second {cell['handoff_mean_ms']:.0f} ms (mean)"
    if "decode_steps_beside" in cell:
        steps = cell["decode_steps_beside"]
        causes = ", ".join(f"{cause} {n}" for cause, n in steps["slow_steps_by_cause"].items() if n)
        line += f"; decode steps slow: {steps['slow_steps']} of {steps['decode_steps']}{f' ({causes})' if causes else ''}"
    print(line, flush=True)


@contextmanager
def _target(args) -> Iterator[str]:
    """The base URL of --target: a local configuration started for the run, or a URL."""
    if offline_target(parse_target(args.target)):
        raise ValueError("--target offline: bench protect needs a server (a URL or a local configuration)")
    if local_target(args.target) is None:
        yield args.target
        return
    with local_ray(args, specs=[args.target]), local_cluster(args.target, args) as url:
        yield url


def run_protect_bench(args) -> int:
    running_counts, output_lens = _ints(args.running, "--running"), _ints(args.output_lens, "--output-lens")
    prompt_lens, rates = _ints(args.prompt_lens, "--prompt-lens"), _floats(args.arrival_rates, "--arrival-rates")
    args.local_model = args.local_model or str(builtin_model_path())
    print(f"CPU: {cpu_summary()}")
    mixes, steps = [], {}
    local = local_target(args.target) is not None
    with _target(args) as url:
        for running, output_len in itertools.product(running_counts, output_lens):
            cells = []
            for prompt_len, rate in itertools.product(prompt_lens, rates):
                # Alone, then beside, for every cell: the pair shares the machine's state of the moment.
                alone, alone_steps = _run(args, url, running, output_len, timelines=local)
                beside, beside_steps = _run(args, url, running, output_len, prompt_len, rate, timelines=local)
                cell = _cell(args, alone, beside, prompt_len, rate)
                if local:  # the decode tier's own account of its steps (cluster/bench/decode_timeline.py)
                    medians = alone_medians(alone_steps)
                    cell["decode_steps_alone"] = attribute(alone_steps, medians)
                    cell["decode_steps_beside"] = attribute(beside_steps, medians)
                    steps[f"{running}x{output_len}/{prompt_len}@{rate:g}"] = {"alone_medians_s": medians, "beside": beside_steps}
                cells.append(cell)
                _print_cell(running, output_len, cell)
            mixes.append({"running": running, "output_len": output_len, "cells": cells})
    unsaturated = [c for m in mixes for c in m["cells"] if not c["saturated"]]
    summary = {
        "worst_p99_itl_inflation_unsaturated": max((c["p99_itl_inflation"] for c in unsaturated), default=None),
        "worst_gap_over_median_itl": max((c["max_gap_over_median_itl"] for m in mixes for c in m["cells"]
                                          if c["max_gap_over_median_itl"] is not None), default=None),
        "median_p99_itl_inflation": statistics.median(c["p99_itl_inflation"] for m in mixes for c in m["cells"]),
    }
    print(f"protect: {summary}")
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {"target": args.target, "decode_input_len": args.decode_input_len, "summary": summary, "mixes": mixes,
              "args": {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "fn"}}
    write_result(out / "protect.json", result)
    print(f"wrote {out / 'protect.json'} and {plot_protect(result, out / 'protect.png')}")
    if steps:  # the worst unsaturated cell's decode steps, drawn; every cell's, kept
        write_result(out / "protect-steps.json", steps)
        worst = max((c for m in mixes for c in m["cells"]), key=lambda c: (not c["saturated"], c["p99_itl_inflation"]))
        mix = next(m for m in mixes if worst in m["cells"])
        key = f"{mix['running']}x{mix['output_len']}/{worst['prompt_len']}@{worst['arrival_rate']:g}"
        print(f"wrote {out / 'protect-steps.json'} and {plot_decode_steps(key, steps[key], out / 'protect-steps.png')}")
    failed = sum(c["decodes_failed"] for m in mixes for c in m["cells"])
    if failed:
        print(f"FAIL: {failed} decode requests failed: their cells' figures do not hold")
    return 1 if failed else 0
