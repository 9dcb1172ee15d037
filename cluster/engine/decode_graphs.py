"""CUDA graphs for decode steps: the model's decode-only forward is captured once per batch
size bucket and replayed with each step's inputs copied into the graph's static buffers.

Why: on a GPU a small model's decode step is bound by kernel launches (per layer about ten
kernels, each several microseconds of CPU to launch), not by the GPU's work; a graph
launches them all in one call. The CPU's counterpart is cluster/model/cpu_step.py (every
layer in one C call).

Invariants:
  - a step of n decode tokens runs the smallest bucket >= n; rows n.. of the bucket are
    padding: slot -1 (store_kv skips it, so the KV cache is untouched), context length 0
    (decode attention gives zeros), token 0 at position 0. Their hidden states are dropped.
  - every input is a view of one static buffer sized for the largest bucket, which the
    captured kernels read at replay; a block table's columns past a row's context are never
    read, so the table buffer is not cleared between steps.
  - the returned hidden states are a view of the graph's output: read before the next run.
  - only decode-only steps (every chunk one token) no larger than the largest bucket, on one
    tensor-parallel rank (the engine decides); every other step runs eagerly.

Without CUDA (tests) nothing is captured and `run` runs the model eagerly on the same
padded buffers: the padding a graph replays is checked on any machine.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from cluster.model.attention import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, then every multiple of 8, up to max_batch (a
    step pads to the next one, so at most 7 rows are wasted)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, model, kv_caches: list[KVCache], max_batch: int, max_blocks: int, device: torch.device):
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.sizes = capture_sizes(max_batch)
        self.max_blocks = max_blocks

        def buffer(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device)

        n = self.sizes[-1]
        self.input_ids, self.positions, self.slot_mapping = buffer(n), buffer(n), buffer(n)
        self.block_tables, self.context_lens = buffer(n, max_blocks, dtype=torch.int32), buffer(n, dtype=torch.int32)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # bucket -> (graph, its output)

    def takes(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        """A decode-only step that fits the largest bucket."""
        n = input_ids.shape[0]
        return (0 < n <= self.sizes[-1] and meta.num_decode_tokens == n and not meta.prefills
                and meta.decode_block_tables.shape[1] <= self.max_blocks)

    def bucket(self, n: int) -> int:
        return next(size for size in self.sizes if size >= n)

    def capture(self) -> None:
        """One graph per bucket, the largest first so that the shared memory pool is sized
        by it. Captured with every row padding: capturing writes nothing to the KV cache."""
        pool = torch.cuda.graph_pool_handle()
        warmup = torch.cuda.Stream(self.device)
        for size in tqdm(sorted(self.sizes, reverse=True), desc="capturing CUDA graphs", unit="graph", disable=None):
            self._pad(0, size)
            # A first run outside the capture: Triton compiles its kernels, cuBLAS picks its own.
            warmup.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(warmup):
                self._forward(size)
            torch.cuda.current_stream(self.device).wait_stream(warmup)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(size)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize(self.device)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's hidden states [n, hidden] (`takes` must hold)."""
        n, width = input_ids.shape[0], meta.decode_block_tables.shape[1]
        size = self.bucket(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:n, :width].copy_(meta.decode_block_tables)
        self.context_lens[:n].copy_(meta.decode_context_lens)
        self._pad(n, size)
        if size in self.graphs:
            graph, out = self.graphs[size]
            graph.replay()
            return out[:n]
        return self._forward(size)[:n]

    def _pad(self, n: int, size: int) -> None:
        """Rows [n, size) become padding (the module docstring's invariants)."""
        self.input_ids[n:size] = 0
        self.positions[n:size] = 0
        self.slot_mapping[n:size] = -1
        self.context_lens[n:size] = 0

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            num_decode_tokens=size,
            decode_block_tables=self.block_tables[:size],
            decode_context_lens=self.context_lens[:size],
            prefills=(),
        )
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
