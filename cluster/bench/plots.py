"""PNG plots for the serving benchmarks (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _save(fig, path: Path, dpi: int = 110, layout: bool = True) -> Path:
    """Write the figure (laid out tight, or cropped to its contents) and free it."""
    if layout:
        fig.tight_layout()
    fig.savefig(path, dpi=dpi, **({} if layout else {"bbox_inches": "tight"}))
    plt.close(fig)
    return path

def _cdf(ax, values_ms, label):
    if values_ms:
        x = np.sort(values_ms)
        ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=label)


def plot_serve_result(result: dict, stem: Path) -> list[Path]:
    """Latency CDFs (TTFT, ITL) and output throughput over time, next to the JSON."""
    title = f"{result['model_id']} | {result['dataset_name']} | rate {result['request_rate']} req/s"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, name, values in (
        (axes[0], "TTFT", [t * 1e3 for t in result["ttfts"]]),
        (axes[1], "ITL", [t * 1e3 for itl in result["itls"] for t in itl]),
    ):
        _cdf(ax, values, name)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of " + ("requests" if name == "TTFT" else "token gaps"))
        ax.grid(alpha=0.3)
        ax.set_ylim(0, 1.01)
    fig.suptitle(title)
    cdf = _save(fig, stem.parent / (stem.name + "-latency_cdf.png"))

    fig, ax = plt.subplots(figsize=(8, 3.5))
    series = result["output_throughput_over_time"]
    ax.plot(range(len(series)), series, drawstyle="steps-post")
    ax.axhline(result["output_throughput"], linestyle="--", color="gray", label=f"mean {result['output_throughput']:.1f} tok/s")
    ax.set_xlabel("time since the first request (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    throughput = _save(fig, stem.parent / (stem.name + "-throughput.png"))
    return [cdf, throughput]


def plot_attainment(rates: list[float], attainment: list[float], target: float, path: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(rates, [a * 100 for a in attainment], marker="o")
    ax.axhline(target * 100, linestyle="--", color="gray", label=f"{target:.0%} target")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("requests meeting TTFT and TPOT SLOs (%)")
    ax.set_ylim(0, 101)
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_compare(labels: tuple[str, str], metrics: dict[str, tuple[float, float]], path: Path) -> Path:
    """Grouped bars of each metric for the two targets (medians over rounds)."""
    names = list(metrics)
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.6))
    for ax, name in zip(np.atleast_1d(axes), names):
        a, b = metrics[name]
        ax.bar([0, 1], [a, b], color=["#4c72b0", "#dd8452"])
        ax.set_xticks([0, 1], labels, rotation=15)
        ax.set_title(f"{name}\nB/A = {b / a:.2f}x" if a else name, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def plot_engine_bench(results: dict, path: Path) -> None:
    runs = results["runs"]
    systems = [s for s in ("pdserve", "transformers", "llama.cpp") if any(r.get(s) for r in runs)]
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        xs = [j + i * width for j in range(len(runs))]
        ax.bar(xs, [r[system]["decode_step_ms_mean"] if r.get(system) else 0 for r in runs], width, label=system)
    ax.axhline(results["roofline_step_ms"], color="k", linestyle="--", label="bandwidth roofline")
    if all("step_bound_ms" in r for r in runs):  # results written before it have none
        for j, r in enumerate(runs):
            ax.hlines(r["step_bound_ms"], j - width / 2, j + width * (len(systems) - 0.5), color="#c44e52",
                      label="step bound (weights or FMAs, then KV)" if j == 0 else None)
    ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(runs))])
    ax.set_xticklabels([f"batch {r['batch_size']}" for r in runs])
    ax.set_ylabel("ms per decode step (lower is better)")
    quantization = "" if results.get("quantization", "none") == "none" else f", quantization {results['quantization']}"
    ax.set_title(f"{Path(results['model']).name} {results['dtype']}{quantization}, {results['threads']} threads")
    ax.legend()
    _save(fig, path, dpi=120)


def plot_chaos(chaos: dict, path: Path) -> Path:
    """Output tokens/s over the run, with a line at each injected fault."""
    fig, ax = plt.subplots(figsize=(9, 3.8))
    series = chaos["output_throughput_over_time"]
    ax.plot(range(len(series)), series, drawstyle="steps-post", color="#4c72b0")
    ax.set_ylim(bottom=0)
    colors = {"SIGKILL": "#c44e52", "SIGSTOP": "#dd8452", "SIGTERM": "#8172b3", "NODE": "#937860"}
    for fault in chaos["faults"]:
        if "pid" in fault:
            ax.axvline(fault["t_s"], color=colors[fault["signal"]], linestyle="--", alpha=0.8)
            ax.annotate(f"{fault['tier']} {fault['signal']}", (fault["t_s"], ax.get_ylim()[1]), rotation=90,
                        fontsize=7, va="top", ha="right", color=colors[fault["signal"]])
    ax.set_xlabel("time since the load started (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{chaos['target']}: {chaos['completed']} completed, {chaos['aborted']} aborted, {chaos['failed']} failed, "
                 f"{int(chaos['migrated'])} migrated, {sum(chaos['leaked_blocks'].values())} blocks leaked", fontsize=9)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_transport(result: dict, path: Path) -> Path:
    """`pdserve bench transport`: GB/s per transfer size, one bar per path."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    sizes = sorted({r["blocks"] for r in result["runs"]})
    paths = list(dict.fromkeys(r["path"] for r in result["runs"]))
    width = 0.8 / len(paths)
    for j, name in enumerate(paths):
        rate = {r["blocks"]: r["gb_per_s"] for r in result["runs"] if r["path"] == name}
        ax.bar([i + j * width for i in range(len(sizes))], [rate[n] for n in sizes], width, label=name.replace("_", " "))
    mb = result["geometry"]["block_bytes"] / 1e6
    ax.set_xticks([i + width * (len(paths) - 1) / 2 for i in range(len(sizes))])
    ax.set_xticklabels([f"{n} blocks\n{n * mb:.1f} MB" for n in sizes])
    ax.set_ylabel("GB/s (higher is better)")
    ax.set_title("KV transfer, prefill to decode process on one machine", fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def plot_protect(result: dict, path: Path) -> Path:
    """`pdserve bench protect`: per decode mix, a heat map of the p99 ITL inflation over
    (long prompt length, arrival rate), each cell also giving the worst first-to-second
    token gap over the median ITL; saturated cells (prefill tier busy) are starred."""
    mixes = result["mixes"]
    fig, axes = plt.subplots(1, len(mixes), figsize=(4.2 * len(mixes), 3.6), squeeze=False)
    for ax, mix in zip(axes[0], mixes):
        lens = sorted({c["prompt_len"] for c in mix["cells"]})
        rates = sorted({c["arrival_rate"] for c in mix["cells"]})
        cell = {(c["prompt_len"], c["arrival_rate"]): c for c in mix["cells"]}
        grid = [[cell[(n, r)]["p99_itl_inflation"] for r in rates] for n in lens]
        image = ax.imshow(grid, cmap="RdYlGn_r", vmin=1.0, vmax=2.0, origin="lower", aspect="auto")
        for i, n in enumerate(lens):
            for j, r in enumerate(rates):
                c = cell[(n, r)]
                gap = c["max_gap_over_median_itl"]
                ax.text(j, i, f"{c['p99_itl_inflation']:.2f}x{'*' if c['saturated'] else ''}\n"
                        f"gap {'-' if gap is None else f'{gap:.1f}x'}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(rates)), [f"{r:g}/s" for r in rates])
        ax.set_yticks(range(len(lens)), [str(n) for n in lens])
        ax.set_xlabel("long prompts arriving")
        ax.set_ylabel("long prompt tokens")
        ax.set_title(f"{mix['running']} decodes x {mix['output_len']} tokens", fontsize=9)
    fig.colorbar(image, ax=axes[0].tolist(), label="decodes' p99 ITL, beside / alone")
    fig.suptitle(f"{result['target']}: p99 ITL inflation (goal <= 1.2x), worst first-to-second gap / median ITL "
                 "(goal <= 2x); * prefill saturated", fontsize=9)
    return _save(fig, path, layout=False)  # the colorbar spans the axes: cropped to fit, not laid out


def plot_decode_steps(cell: str, steps: dict, path: Path) -> Path:
    """`pdserve bench protect`: one cell's decode steps over time (beside the long prompts):
    each step's interval (the wait it put on every running request), split into its parts,
    against 1.2x the alone median of its batch size."""
    fig, ax = plt.subplots(figsize=(10, 3.8))
    for worker, line in steps["beside"].items():
        if not line:
            continue
        t0 = line[0]["t"]
        decode = [s for s in line if s["decode"]]
        t = [s["t"] - t0 for s in decode]
        interval = [1000 * (s["between_s"] + s["step_s"]) for s in decode]
        prompt = [s["prompt"] > 0 for s in decode]
        ax.scatter([x for x, p in zip(t, prompt) if not p], [y for y, p in zip(interval, prompt) if not p], s=4,
                   label=f"{worker}: decode-only step", color="#3182bd")
        ax.scatter([x for x, p in zip(t, prompt) if p], [y for y, p in zip(interval, prompt) if p], s=8,
                   label="step with prompt work", color="#e6550d")
        ax.scatter(t, [1000 * max(0.0, s["step_s"] - s["cpu_s"]) for s in decode], s=3, marker="x",
                   label="off its core (waited)", color="#756bb1")
        ax.scatter(t, [1000 * s["between_s"] for s in decode], s=3, marker="+", label="between steps",
                   color="#31a354")
    for seconds in steps["alone_medians_s"].values():
        ax.axhline(1200 * seconds, color="gray", linestyle=":", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("ms (log)")
    ax.set_title(f"decode steps, cell {cell} (dotted: 1.2x the alone median per batch size)", fontsize=9)
    ax.legend(fontsize=7, markerscale=2)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_phases(summary: dict, path: Path) -> Path:
    """`pdserve bench abuse`: the victim's p50 and p99 TTFT per round, alone and abused."""
    rounds = summary["rounds"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.2
    x = np.arange(len(rounds))
    for offset, (phase, q, color) in enumerate((("alone", 50, "#9ecae1"), ("abused", 50, "#fdae6b"),
                                                 ("alone", 99, "#3182bd"), ("abused", 99, "#e6550d"))):
        values = [float(np.percentile(r[phase], q)) if r[phase] else 0.0 for r in rounds]
        ax.bar(x + (offset - 1.5) * width, values, width, label=f"p{q} {phase}", color=color)
    ax.set_xticks(x, [f"round {i + 1}" for i in range(len(rounds))])
    ax.set_ylabel("victim TTFT (ms)")
    victim = summary["victim"]
    ax.set_title(f"abuser: {summary['mode']} | p99 abused/alone {victim['p99_ratio']:.2f}x | "
                 f"server errors {summary['abuser']['server_errors']}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def plot_step_gaps(result: dict, path: Path) -> Path:
    """The running requests' step gaps over time, with a new schema's compile shaded."""
    line = result["timeline"]
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.plot(line["t"], line["gap_ms"], marker=".", linewidth=0.8, label="a running request's step gap")
    ax.axvspan(line["new_arrived"], max(line["new_compiled"], line["new_arrived"] + 0.01), color="orange", alpha=0.4,
               label=f"new schema compiling ({result['new_schema']['compile_ms']:.1f} ms, off the engine thread)")
    ax.axvline(line["repeat_arrived"], color="green", linestyle="--", label="the same schema again (no compile)")
    ax.axhline(result["steady_step_ms"]["median"], color="gray", linestyle=":", label="steady median step")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("step gap (ms)")
    ax.set_title(f"{result['running']} running requests; a {result['properties']}-property schema arrives")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_trace(result: dict, path: Path) -> Path:
    """`pdserve bench trace`: on one time axis, the load (requests arriving per 30 s, the
    phases shaded), each target's replicas per tier, and each target's SLO attainment per
    30 s of request starts."""
    bin_s = 30.0
    end = result["phases"][-1][2]
    edges = list(range(0, int(end + bin_s), int(bin_s)))
    fig, (load, replicas, attain) = plt.subplots(3, 1, figsize=(10, 7.5), sharex=True)
    for ax in (load, replicas, attain):
        for i, (name, lo, hi) in enumerate(result["phases"]):
            ax.axvspan(lo, hi, color="#eeeeee" if i % 2 else "#ffffff", zorder=0)
            if ax is load:
                ax.text((lo + hi) / 2, 1.02, name, ha="center", va="bottom", fontsize=8, transform=ax.get_xaxis_transform())
    counts, _ = np.histogram(result["arrivals"], bins=edges)
    load.bar(edges[:-1], counts / bin_s, width=bin_s, align="edge", color="#9ecae1")
    load.set_ylabel("requests/s")
    for name, target in result["targets"].items():
        t = [s[0] for s in target["replicas"]]
        line, = replicas.step(t, [s[2] for s in target["replicas"]], where="post", label=f"{name}: decode")
        replicas.step(t, [s[1] for s in target["replicas"]], where="post", linestyle="--", color=line.get_color(),
                      label=f"{name}: prefill")
        per_bin = [[r["ok"] for r in target["requests"] if lo <= r["t"] < lo + bin_s] for lo in edges[:-1]]
        attain.plot([lo + bin_s / 2 for lo, b in zip(edges, per_bin) if b], [100 * sum(b) / len(b) for b in per_bin if b],
                    marker="o", markersize=3, color=line.get_color(),
                    label=f"{name}: {100 * target['attainment']:.0f}%, {target['core_seconds']:.0f} core-s")
    replicas.set_ylabel("replicas")
    replicas.legend(fontsize=7, ncol=2)
    attain.set_ylabel("SLO attainment (%)")
    attain.set_xlabel("time (s)")
    attain.set_ylim(-5, 105)
    attain.legend(fontsize=7)
    fig.suptitle(f"TTFT <= {result['slo_ttft_ms']:g} ms and TPOT <= {result['slo_itl_ms']:g} ms; {result['cpu']}", fontsize=9)
    return _save(fig, path)
