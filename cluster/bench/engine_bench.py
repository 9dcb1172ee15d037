"""`pdserve bench engine`: offline engine speed, side by side with its references.

For each batch size B, the same B random prompts (input_len tokens, greedy, exactly
output_len new tokens) run through
  - the pdserve engine (prefill timed apart from decode steps),
  - transformers `generate` (when installed), prefill timed by a 1-token generate,
  - llama.cpp on the same GGUF file and threads, batch 1 (--llama-cpp-python: the Python of
    a venv with llama-cpp-python; cluster/bench/llama_cpp_baseline.py),
and are compared with the memory-bandwidth roofline: one decode step must read every
weight once, so time/step >= weight bytes / read bandwidth (measured here, now).
In each of --rounds rounds every batch size and system runs in turn, and medians are
reported (the machine is shared and noisy); each batch's step over the first batch's is the
median of the rounds' ratios. Results: a table on stdout, JSON and a PNG bar chart in
--result-dir.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from cluster.bench.llama_cpp_baseline import LlamaCppBaseline
from cluster.bench.plots import plot_engine_bench
from cluster.bench.provenance import write_result
from cluster.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.engine.engine import Engine
from cluster.engine.runner import kv_bytes_per_block
from cluster.engine.sampling_params import SamplingParams
from cluster.host.cpu_features import cpu_summary
from cluster.model.linear import Linear
from kernels import cpu as cpu_kernels


def measure_read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of streaming reads: best of `repeats` fp32 sums over a buffer far larger
    than the caches (an fp32 sum is read-bound on CPU; a bf16 one is not)."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return num_bytes / best


def measure_matmul_flops(rows: int, arch, dtype: torch.dtype, repeats: int = 5) -> float:
    """FLOP/s of torch.matmul on a prefill-shaped product ([rows, hidden] x [hidden,
    intermediate], the model's widest), this dtype and thread count: the best of
    `repeats` and of both weight layouts (row- and column-major), so the reference is
    the highest torch.matmul reaches."""
    x = torch.randn(rows, arch.hidden_size, dtype=dtype)
    best = float("inf")
    for w in (torch.randn(arch.hidden_size, arch.intermediate_size, dtype=dtype),
              torch.randn(arch.intermediate_size, arch.hidden_size, dtype=dtype).t()):
        torch.matmul(x, w)
        for _ in range(repeats):
            t = time.perf_counter()
            torch.matmul(x, w)
            best = min(best, time.perf_counter() - t)
    return 2 * rows * arch.hidden_size * arch.intermediate_size / best


def layer_params(engine: Engine) -> int:
    """The layers' matmul weights (each multiplies every token once); the LM head apart."""
    return sum(m.in_features * m.out_features for m in engine.loaded.model.model.layers.modules() if isinstance(m, Linear))


def prefill_flops(engine: Engine, batch: int, input_len: int) -> float:
    """Matmul FLOPs of prefilling `batch` prompts: every layer weight once per token,
    the LM head once per prompt (only the last row is sampled), causal attention."""
    arch = engine.loaded.arch
    attention = 2 * arch.num_layers * arch.num_heads * arch.head_dim * input_len * (input_len + 1)  # QK^T and PV, causal half
    return batch * (2 * layer_params(engine) * input_len + attention + 2 * arch.hidden_size * arch.vocab_size)


def decode_step_bound_ms(engine: Engine, batch: int, context: float, wbytes: int, bandwidth: float,
                         matmul_flops: float) -> float:
    """The least a decode step of `batch` rows, `context` cached tokens each, can take here:
    its linears at the slower of reading the weights and their FMAs at torch.matmul's FLOP/s,
    then the attention reading every row's KV cache (the two run one after the other). At
    batch 1 the weights' read is all of it; at a batch whose FMAs outlast it (fp32 on AVX2),
    the step cannot keep the batch-1 step's time, however good the kernels."""
    arch, shard = engine.loaded.arch, engine.loaded.model.shard
    kv_token_bytes = kv_bytes_per_block(arch, shard, 1, getattr(torch, engine.config.cache.dtype)) * shard.size  # all ranks'
    linear_flops = 2 * batch * (layer_params(engine) + arch.hidden_size * arch.vocab_size)
    return 1e3 * (max(wbytes / bandwidth, linear_flops / matmul_flops) + batch * context * kv_token_bytes / bandwidth)


def weight_bytes(engine: Engine) -> int:
    """The weight bytes a decode step streams: every parameter once, a linear's as the copy
    its C kernel reads where it has one (an fp32 model's compact copies are bf16, a
    quantized weight's records are the file's bytes). The
    whole model's: tensor-parallel, rank 0's shard times the ranks, which read theirs at the
    same time from the same memory."""
    model = engine.loaded.model
    kernel_copies = {id(m.weight): m.kernel_weight.data for m in model.modules()
                     if isinstance(m, Linear) and m.kernel_weight is not None}
    read = [kernel_copies.get(id(p), p) for p in model.parameters()]
    # a weight kept quantized: its records (a tied table's once: the head reads it, the lookup a few rows)
    records = {id(m.quantized_weight): m.quantized_weight.data for m in model.modules()
               if isinstance(m, Linear) and m.quantized_weight is not None}
    return sum(t.numel() * t.element_size() for t in [*read, *records.values()]) * model.shard.size


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=g).tolist() for _ in range(n)]


def bench_pdserve(engine: Engine, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.pool.reset_prefix_cache()  # measure compute, not cache hits from the last run
    for p in prompts:
        engine.add_request(p, params)
    step_times, decode_times, generated = [], [], 0
    started: set[str] = set()  # requests with a first token
    start = time.perf_counter()
    first_token_at = None
    while engine.has_unfinished:
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        step_times.append(dt)
        generated += sum(len(o.new_token_ids) for o in outs)
        started.update(o.request_id for o in outs if o.new_token_ids)
        if first_token_at is None and len(started) == len(prompts):  # the last prompt's prefill ended here
            first_token_at = time.perf_counter() - start
        elif first_token_at is not None:
            decode_times.append(dt)
    total = time.perf_counter() - start
    return {
        "total_s": total,
        "prefill_s": first_token_at,
        "decode_step_ms_mean": 1e3 * statistics.mean(decode_times),
        "decode_step_ms_median": 1e3 * statistics.median(decode_times),
        "output_tokens": generated,
        "output_throughput": generated / total,
        "decode_throughput": len(prompts) / statistics.mean(decode_times),
    }


def load_transformers(model_dir: str, dtype: torch.dtype):
    try:  # an optional baseline: transformers is a test dependency, not a serving one
        import transformers  # noqa: PLC0415
    except ImportError:
        print("transformers is not installed: skipping that baseline")
        return None
    path = Path(model_dir)
    if path.suffix == ".gguf":  # transformers dequantizes GGUF files itself, as pdserve does
        return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def bench_transformers(model, prompts: list[list[int]], output_len: int) -> dict:
    """transformers' `generate`, timed per step: a stopping criterion (called once per
    generated token, never stopping) stamps each step, so the decode step is the mean gap
    between stamps, not a difference of two separately timed runs."""
    import transformers  # noqa: PLC0415 - present: load_transformers returned a model

    ids = torch.tensor(prompts)
    stamps: list[float] = []

    class StepClock(transformers.StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def run(n: int) -> float:
        stamps.clear()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                                 eos_token_id=None, stopping_criteria=transformers.StoppingCriteriaList([StepClock()]))
        assert out.shape[1] == ids.shape[1] + n and len(stamps) == n
        return start

    run(2)  # warm-up
    start = run(output_len)
    total = stamps[-1] - start
    decode_step = (stamps[-1] - stamps[0]) / (output_len - 1)
    return {
        "total_s": total,
        "prefill_s": stamps[0] - start,
        "decode_step_ms_mean": 1e3 * decode_step,
        "output_throughput": len(prompts) * output_len / total,
        "decode_throughput": len(prompts) / decode_step,
    }


def median_of(rounds: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


def run_engine_bench(args) -> int:
    batch_sizes = args.batch_sizes
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"measuring read bandwidth ({torch.get_num_threads()} threads) ...")
    bandwidth = measure_read_bandwidth()
    engine = Engine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            quantization=args.quantization,
            num_threads=args.threads,
            tensor_parallel_size=args.tensor_parallel_size,
            max_model_len=args.input_len + args.output_len + 16,
            cache=CacheConfig(memory_gib=2.0, dtype=args.kv_cache_dtype),
            # Each batch's prompts in one step, uncapped by the decode-latency budget: the
            # engine's own prefill and decode speeds, not the scheduler's interleaving.
            scheduler=SchedulerConfig(max_num_batched_tokens=max(2048, max(batch_sizes) * args.input_len),
                                      max_num_seqs=max(batch_sizes), max_step_slowdown=0.0),
        )
    )
    wbytes = weight_bytes(engine)
    roofline_ms = 1e3 * wbytes / bandwidth
    vocab = engine.loaded.arch.vocab_size
    bench_pdserve(engine, random_prompts(2, 32, vocab, seed=99), 4)  # warm-up
    step_rows = engine.config.scheduler.max_num_batched_tokens  # a prefill step's rows at most
    matmul_flops = measure_matmul_flops(min(step_rows, max(batch_sizes) * args.input_len), engine.loaded.arch, engine.loaded.dtype)
    results = {
        "model": args.model,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "kv_cache_dtype": engine.config.cache.dtype,
        "threads": torch.get_num_threads(),
        "tensor_parallel_size": args.tensor_parallel_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "weight_bytes": wbytes,
        "read_bandwidth_gbs": bandwidth / 1e9,
        "roofline_step_ms": roofline_ms,
        "matmul_gflops": matmul_flops / 1e9,
        "cpu_ops": cpu_kernels.describe(),  # PDSERVE_CPU_KERNELS=0 measures torch's reference ops
        "runs": [],
    }
    hf_model = None if args.no_transformers else load_transformers(args.model, engine.loaded.dtype)
    llama = (LlamaCppBaseline(args.llama_cpp_python, args.model, torch.get_num_threads(), args.input_len + args.output_len + 16)
             if args.llama_cpp_python else None)
    # Within a round every batch size runs, and each system, in turn: machine noise hits them
    # alike, and a batch's step over the first batch's is a ratio of neighbouring runs.
    prompts = {b: random_prompts(b, args.input_len, vocab) for b in batch_sizes}
    rounds: dict[int, dict[str, list[dict]]] = {b: {"pdserve": [], "transformers": [], "llama.cpp": []} for b in batch_sizes}
    for b in batch_sizes:
        # One untimed run of each first: the first time a shape runs, its activations
        # page-fault in and the GEMM libraries set up their kernels for it.
        bench_pdserve(engine, prompts[b], 2)
        if hf_model is not None:
            bench_transformers(hf_model, prompts[b], 2)
        if llama is not None and b == 1:
            llama.run(prompts[b][0], 2)
    with tqdm(total=len(batch_sizes) * args.rounds, desc="benchmark rounds", unit="batch") as bar:
        for _ in range(args.rounds):
            for b in batch_sizes:
                rounds[b]["pdserve"].append(bench_pdserve(engine, prompts[b], args.output_len))
                if hf_model is not None:
                    rounds[b]["transformers"].append(bench_transformers(hf_model, prompts[b], args.output_len))
                if llama is not None and b == 1:  # batch 1 only: llama-cpp-python runs one sequence
                    rounds[b]["llama.cpp"].append(llama.run(prompts[b][0], args.output_len))
                bar.update()
    first = batch_sizes[0]
    for b in batch_sizes:
        run = {"batch_size": b, "rounds": args.rounds}
        run.update({system: median_of(rs) for system, rs in rounds[b].items() if rs})
        run["pdserve"]["prefill_gflops"] = prefill_flops(engine, b, args.input_len) / run["pdserve"]["prefill_s"] / 1e9
        # at the decode steps' mean context
        run["step_bound_ms"] = decode_step_bound_ms(engine, b, args.input_len + (args.output_len - 1) / 2, wbytes, bandwidth,
                                                    matmul_flops)
        if b != first:  # the median of the rounds' ratios, each of two runs side by side
            pairs = zip(rounds[b]["pdserve"], rounds[first]["pdserve"])
            run["pdserve"]["step_over_first_batch"] = statistics.median(
                r["decode_step_ms_mean"] / r0["decode_step_ms_mean"] for r, r0 in pairs)
        results["runs"].append(run)
    engine.close()  # tensor parallel: the other ranks' processes
    if llama is not None:
        llama.close()

    print(f"\nCPU: {cpu_summary()}; CPU ops: {results['cpu_ops']}")
    print(f"weights {wbytes / 1e6:.0f} MB, read bandwidth {bandwidth / 1e9:.1f} GB/s -> roofline {roofline_ms:.1f} ms/step")
    print(f"{'batch':>5} {'system':>12} {'ms/step':>8} {'x roofline':>10} {'decode tok/s':>12} {'total tok/s':>11} {'prefill s':>9}")
    for run in results["runs"]:
        for system in ("pdserve", "transformers", "llama.cpp"):
            r = run.get(system)
            if not r:
                continue
            print(
                f"{run['batch_size']:>5} {system:>12} {r['decode_step_ms_mean']:>8.1f} "
                f"{r['decode_step_ms_mean'] / roofline_ms:>10.2f} {r['decode_throughput']:>12.1f} "
                f"{r['output_throughput']:>11.1f} {r['prefill_s']:>9.2f}"
            )
        print(f"{'':>5} step bound {run['step_bound_ms']:.1f} ms (weights or FMAs, then KV): pdserve at "
              f"{run['pdserve']['decode_step_ms_mean'] / run['step_bound_ms']:.2f}x")
        if "step_over_first_batch" in run["pdserve"]:
            print(f"{'':>5} pdserve step is {run['pdserve']['step_over_first_batch']:.2f}x batch {first}'s "
                  f"(median of {args.rounds} rounds' ratios)")
        for baseline in ("transformers", "llama.cpp"):
            if run.get(baseline):  # the median of the rounds' ratios, each of two runs side by side
                step = statistics.median(r["decode_step_ms_mean"] / r0["decode_step_ms_mean"]
                                         for r, r0 in zip(rounds[run["batch_size"]]["pdserve"], rounds[run["batch_size"]][baseline]))
                prefill = statistics.median(r0["prefill_s"] / r["prefill_s"]
                                            for r, r0 in zip(rounds[run["batch_size"]]["pdserve"], rounds[run["batch_size"]][baseline]))
                run["pdserve"][f"step_over_{baseline}"], run["pdserve"][f"prefill_speed_over_{baseline}"] = step, prefill
                print(f"{'':>5} pdserve's decode step is {step:.2f}x {baseline}'s; its prefill {prefill:.2f}x as fast")
        gflops = run["pdserve"]["prefill_gflops"]
        print(f"{'':>5} pdserve prefill {gflops:.0f} GFLOP/s = {gflops / results['matmul_gflops']:.0%} of torch.matmul's "
              f"{results['matmul_gflops']:.0f} GFLOP/s ({args.dtype}, {results['threads']} threads)")

    out_dir = Path(args.result_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = (f"engine-{Path(args.model).name}-{args.dtype}" + ("-dequantized" if args.quantization == "none" else "")
            + (f"-tp{args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""))
    write_result(out_dir / f"{stem}.json", results)
    plot_engine_bench(results, out_dir / f"{stem}.png")
    print(f"wrote {out_dir / stem}.json and .png")
    return 0
