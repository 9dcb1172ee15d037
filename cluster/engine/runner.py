"""Turns a SchedulerOutput into one forward pass over the paged KV cache.

The runner owns the KV cache tensors (one K and one V per layer, each
`[num_blocks, block_size, num_kv_heads, head_dim]`, this rank's KV heads under tensor
parallelism) and nothing else; which block holds what is the block pool's business.

Decode-only steps on a GPU replay a CUDA graph (cluster/engine/decode_graphs.py) when the
runner is built with `decode_graphs`.

Tensor parallelism: rank 0's runner broadcasts each step's plan before running it, and
every other rank's runner `follow`s: the same plan, the same forward pass, on its shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from cluster.config import CacheConfig
from cluster.engine.decode_graphs import DecodeGraphs
from cluster.engine.scheduler import SchedulerOutput
from cluster.model.attention import AttentionMetadata, PrefillSeq
from cluster.model.families import ModelArch
from cluster.model.loader import TORCH_DTYPES, LoadedModel
from cluster.model.sharding import Shard
from kernels import cpu as cpu_kernels
from kernels import decode_gather


def kv_cache_dtype(cache: CacheConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The model's dtype unless `cache.dtype` names another. A K/V row is rounded to it once,
    as it is stored, and every attention reads the stored rows (a prompt's own as well:
    cluster/model/attention.py), so a token's K/V is the same whether it was computed in
    this step, an earlier chunk, a cached prefix or another worker."""
    return model_dtype if cache.dtype == "auto" else TORCH_DTYPES[cache.dtype]


def kv_bytes_per_block(arch: ModelArch, shard: Shard, block_size: int, dtype: torch.dtype) -> int:
    """One block's KV on one rank (its KV heads)."""
    per_token = 2 * arch.num_layers * shard.num_kv_heads * arch.head_dim * dtype.itemsize
    return per_token * block_size


def num_kv_blocks(cache: CacheConfig, arch: ModelArch, shard: Shard, dtype: torch.dtype) -> int:
    """Blocks that fit in `cache.memory_gib` on each rank (the same count on every rank)."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    return max(1, int(cache.memory_gib * 2**30) // kv_bytes_per_block(arch, shard, cache.block_size, dtype))


def rank_kv_cache_bytes(cache: CacheConfig, arch: ModelArch, shard: Shard, dtype: torch.dtype) -> int:
    """What one rank's KV cache allocates."""
    return num_kv_blocks(cache, arch, shard, dtype) * kv_bytes_per_block(arch, shard, cache.block_size, dtype)


def check_kv_cache_fits(nbytes: int, device: str, what: str = "the KV cache") -> None:
    """KV caches larger than the memory free for them fail before a model loads, in one
    line, rather than as allocations that swap the host or get processes killed (Ray's
    memory monitor kills workers, its Serve controller among them, near a full node).
    `nbytes`: all that will be allocated on this host (CPU) or on `device` (CUDA)."""
    if device == "cpu":
        free, where = psutil.virtual_memory().available, "this host"
    else:
        free, where = torch.cuda.mem_get_info(torch.device(device))[0], device
    if nbytes > free:
        raise ValueError(f"{what} would take {nbytes / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB free on "
                         f"{where}: give it less (--kv-cache-gib)")


HEARTBEAT = "heartbeat"  # a step plan that runs no model: rank 0 is idle


@dataclass(frozen=True)
class BatchInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [N] rows of the hidden states to sample from
    sample_request_ids: list[str]  # [N]


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, device: str = "cpu",
                 decode_graphs: int = 0, kv_dtype: torch.dtype | None = None):
        """decode_graphs > 0: decode-only steps of up to that many tokens run through
        DecodeGraphs (captured here on CUDA; without CUDA, eagerly on its padded buffers).
        kv_dtype: the KV cache's (kv_cache_dtype), the model's by default."""
        self.model = loaded.model
        self.arch = loaded.arch
        self.group = loaded.model.group
        self.block_size = block_size
        self.device = torch.device(device)
        shape = (num_blocks, block_size, loaded.model.shard.num_kv_heads, self.arch.head_dim)
        kv_dtype = kv_dtype or loaded.dtype
        self.kv_caches = [
            (torch.zeros(shape, dtype=kv_dtype, device=device), torch.zeros(shape, dtype=kv_dtype, device=device))
            for _ in range(self.arch.num_layers)
        ]
        self.decode_graphs = None
        if decode_graphs:
            max_blocks = -(-loaded.max_model_len // block_size)
            self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, decode_graphs, max_blocks, self.device)
            if self.device.type == "cuda":
                self.decode_graphs.capture()

    def execute(self, sched: SchedulerOutput) -> tuple[list[str], torch.Tensor]:
        """Run the step; returns (request ids to sample, their logits [N, vocab] fp32)."""
        if self.group.is_parallel:
            self.group.broadcast_object(sched)  # the other ranks' `follow` gets it
        return self._run(sched)

    def follow(self) -> bool:
        """A rank other than 0: run rank 0's next step (its logits are rank 0's to sample).
        False once rank 0 sends the stop (None)."""
        sched = self.group.broadcast_object()
        if sched is None:
            return False
        if sched == HEARTBEAT:
            self.group.all_reduce_(torch.zeros(1))
        else:
            self._run(sched)
        return True

    def heartbeat(self) -> None:
        """Rank 0, while idle: one round trip through every rank, so that a lost rank is
        found before the next request (RankLostError), and no collective waits out
        its timeout on an idle replica."""
        if self.group.is_parallel:
            self.group.broadcast_object(HEARTBEAT)
            self.group.all_reduce_(torch.zeros(1))

    def stop_followers(self) -> None:
        """Rank 0: release the other ranks from `follow`."""
        if self.group.is_parallel:
            self.group.broadcast_object(None)

    def _run(self, sched: SchedulerOutput) -> tuple[list[str], torch.Tensor]:
        batch = self.prepare(sched)
        if self.decode_graphs is not None and self.decode_graphs.takes(batch.input_ids, batch.meta):
            hidden = self.decode_graphs.run(batch.input_ids, batch.positions, batch.meta)  # [T, hidden]
        else:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)  # [T, hidden]
        logits = self.model.compute_logits(hidden[batch.sample_rows])  # [N, vocab]
        return batch.sample_request_ids, logits

    def prepare(self, sched: SchedulerOutput) -> BatchInputs:
        bs = self.block_size
        decodes = [c for c in sched.chunks if len(c.token_ids) == 1]
        prefills = [c for c in sched.chunks if len(c.token_ids) > 1]

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        for c in decodes:
            input_ids.append(c.token_ids[0])
            positions.append(c.start_pos)
            slots.append(c.block_ids[c.start_pos // bs] * bs + c.start_pos % bs)
        max_blocks = max((len(c.block_ids) for c in decodes), default=0)
        decode_tables = torch.tensor([c.block_ids + [0] * (max_blocks - len(c.block_ids)) for c in decodes], dtype=torch.int32)
        decode_lens = torch.tensor([c.start_pos + 1 for c in decodes], dtype=torch.int32)

        prefill_seqs: list[PrefillSeq] = []
        for c in prefills:
            start, n = c.start_pos, len(c.token_ids)
            end = start + n
            pos = range(start, end)
            prefill_seqs.append(
                PrefillSeq(
                    query_start=len(input_ids),
                    query_len=n,
                    context_len=end,
                    block_ids=torch.tensor(c.block_ids[: -(-end // bs)], dtype=torch.int64, device=self.device),
                )
            )
            input_ids.extend(c.token_ids)
            positions.extend(pos)
            slots.extend(c.block_ids[p // bs] * bs + p % bs for p in pos)

        row = 0
        for c in decodes + prefills:
            row += len(c.token_ids)
            if c.sample:
                sample_rows.append(row - 1)
                sample_ids.append(c.request_id)

        def t(x, dtype=torch.int64):
            return torch.tensor(x, dtype=dtype, device=self.device)

        decode_tables, decode_lens = decode_tables.to(self.device), decode_lens.to(self.device)
        meta = AttentionMetadata(
            slot_mapping=t(slots),
            num_decode_tokens=len(decodes),
            decode_block_tables=decode_tables,
            decode_context_lens=decode_lens,
            prefills=tuple(prefill_seqs),
            # Only torch's reference attention reads it; the C kernel walks the block table itself.
            decode_gather=decode_gather(decode_tables, decode_lens, bs)
            if decodes and self.device.type == "cpu" and not cpu_kernels.available()
            else None,
        )
        return BatchInputs(t(input_ids), t(positions), meta, t(sample_rows), sample_ids)
