"""`pdserve bench transport`: KV transfer throughput between a prefill and a decode worker's
transports, in two processes of this machine, on each path the tiers can take:

    shared_memory   both on one Ray node: the payload through a /dev/shm slot
    sockets         on different Ray nodes: the payload over the pair's gloo TCP sockets
                    (here over loopback, so the figure is the transport's own ceiling:
                    packing, copies and the kernel's TCP stack, no wire)

Each transfer moves `--blocks` KV blocks of the given geometry (default: the built-in
SmolLM2-135M's, bf16, 16-token blocks: 360 KiB per block) from the sender's cache into
the receiver's, packed, sent and unpacked as a hand-off does. Throughput is payload bytes
over the wall time of --transfers transfers back to back, until the receiver has written
the last one. One torch thread per side, as a worker's transport runs beside its engine.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from pathlib import Path

import torch

from cluster.bench.plots import plot_transport
from cluster.bench.provenance import write_result
from cluster.host.cpu_features import cpu_summary
from cluster.kv.transport.torch_dist import TorchDistTransport

PATHS = ("shared_memory", "sockets")
DEADLINE_S = 600.0


def _caches(layers: int, blocks: int, block_size: int, kv_heads: int, head_dim: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    shape = (blocks, block_size, kv_heads, head_dim)
    return [tuple(torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(2)) for _ in range(layers)]


def _receive(geometry: dict, plan: list[int], endpoints, done) -> None:
    """The decode side (a child process): receive every transfer of `plan` (block counts)."""
    torch.set_num_threads(1)
    caches = _caches(**geometry, seed=2)
    with TorchDistTransport("decode", "bench-decode", "cpu", timeout_s=60, node_id="node-decode") as kv:
        endpoints[0].put(kv.endpoint)
        peer = endpoints[1].get(timeout=60)
        kv.connect("bench-prefill", peer)
        for transfer_id, n in enumerate(plan):
            kv.receive("bench-prefill", peer, caches, list(range(n)), transfer_id)
            done.put(transfer_id)


def _run_path(path: str, geometry: dict, plan: list[int]) -> list[float]:
    """Seconds per round of transfers of one size: sends them all, waits for the last."""
    ctx = multiprocessing.get_context("spawn")
    endpoints, done = (ctx.Queue(), ctx.Queue()), ctx.Queue()
    child = ctx.Process(target=_receive, args=(geometry, plan, endpoints, done), daemon=True)
    child.start()
    caches = _caches(**geometry, seed=1)
    # The sender names the receiver's Ray node for the shared-memory path, another for sockets.
    node_id = "node-decode" if path == "shared_memory" else "node-prefill"
    try:
        with TorchDistTransport("prefill", "bench-prefill", "cpu", timeout_s=60, node_id=node_id) as kv:
            peer = endpoints[0].get(timeout=60)
            endpoints[1].put(kv.endpoint)
            if kv.path_to(peer) != path:
                raise RuntimeError(f"asked for the {path} path, the transport takes {kv.path_to(peer)}")
            kv.connect("bench-decode", peer)
            seconds = []
            for transfer_id, n in enumerate(plan):
                start = time.perf_counter()
                kv.send("bench-decode", peer, caches, list(range(n)), transfer_id)
                if done.get(timeout=DEADLINE_S) != transfer_id:
                    raise RuntimeError("the receiver finished transfers out of order")
                seconds.append(time.perf_counter() - start)
            return seconds
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()


def run_transport_bench(args) -> int:
    sizes = [int(b) for b in args.blocks.split(",")]
    if not sizes or min(sizes) < 1 or args.transfers < 1:
        raise ValueError("--blocks takes positive block counts (e.g. 1,16,64) and --transfers must be >= 1")
    geometry = {"layers": args.layers, "blocks": max(sizes), "block_size": args.block_size, "kv_heads": args.kv_heads,
                "head_dim": args.head_dim}
    block_bytes = args.layers * 2 * args.block_size * args.kv_heads * args.head_dim * torch.bfloat16.itemsize
    plan = [n for n in sizes for _ in range(args.transfers + 1)]  # the first of each size warms up
    print(f"CPU: {cpu_summary()}; {block_bytes / 1024:.0f} KiB per block")
    runs = []
    for path in PATHS:
        seconds = _run_path(path, geometry, plan)
        for i, n in enumerate(sizes):
            timed = seconds[i * (args.transfers + 1) + 1 : (i + 1) * (args.transfers + 1)]
            median = statistics.median(timed)
            runs.append({"path": path, "blocks": n, "payload_mb": n * block_bytes / 1e6, "median_ms": median * 1e3,
                         "gb_per_s": n * block_bytes / median / 1e9, "transfers": len(timed)})
            print(f"{path:>14}  {n:>4} blocks ({n * block_bytes / 1e6:7.2f} MB): {median * 1e3:8.2f} ms, "
                  f"{runs[-1]['gb_per_s']:6.2f} GB/s", flush=True)
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {"geometry": {**geometry, "dtype": "bfloat16", "block_bytes": block_bytes}, "runs": runs}
    write_result(out / "transport.json", result)
    print(f"wrote {out / 'transport.json'} and {plot_transport(result, out / 'transport.png')}")
    return 0
