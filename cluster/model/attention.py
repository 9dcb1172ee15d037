"""Self-attention over a paged KV cache, for a flattened batch of sequences.

A step's tokens are laid out decode-first:

    [ d_0 d_1 ... d_{D-1} | p_0 p_0 p_0 ... | p_1 p_1 ... ]
      one token per          one contiguous chunk per prefilling sequence
      decoding sequence

Every token's K/V is first written into the cache at its slot; decode tokens then
attend through the block table (paged-attention kernel), and each prefill chunk
attends to its cached context plus itself, causally.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cluster.host.cpu_features import detect
from cluster.model.linear import Linear, fuse_linears
from cluster.model.norm import RMSNorm
from cluster.model.rotary import RotaryEmbedding
from cluster.model.tp_group import SINGLE, TensorParallelGroup
from kernels import DecodeGather, paged_attention_decode, store_kv
from kernels import cpu as cpu_kernels


def attention_in_fp32(q: torch.Tensor) -> bool:
    """CPU attention (decode and prefill) on half-precision Q/K/V runs in fp32 unless the
    CPU has AMX.
    Measured on an AMD EPYC with AVX-512-BF16, no AMX (2 threads, 9 query / 3 KV heads,
    D=64, ~260 context): torch's bf16 SDPA takes 961 us at batch 8 and 1876 us at 16,
    the same inputs cast to fp32 170 us and 298 us, casts included. An earlier
    measurement (its CPU not recorded, likely with AMX) found bf16 ~2x faster than the
    cast, so AMX CPUs keep bf16 until measured again. fp32 is also closer to exact."""
    return q.device.type == "cpu" and q.dtype != torch.float32 and not detect().amx


def prompt_attention_in_c(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """A prompt chunk attends in the C kernel, not in torch's SDPA, where the kernel multiplies
    bf16 in hardware (bf16 queries and cache; kernels/csrc/attention_run.c: amx_attend in AMX
    tiles, run_attend in AVX512-BF16 dot products). Per layer, 9 query / 3 KV heads, D=64:
      Intel Xeon with AMX, 1 thread, C vs masked SDPA: 56 tokens after 1456 cached 0.62 vs
      1.50 ms, 16 after 1024 0.18 vs 0.48 ms, 256 after 1024 2.1 vs 3.0 ms; a whole 1024-token
      prompt 4.6 ms against ~5 with SDPA's causal kernel.
      AMD EPYC with AVX-512-BF16, no AMX, C vs SDPA in fp32 (attention_in_fp32; cache reads
      and casts included), 1 thread: 32 after 224 0.19 vs 0.38 ms, 32 after 1024 0.72 vs
      1.40 ms, 256 after 1024 5.9 vs 11.3 ms, a whole 256-token prompt 0.91 vs 2.0 ms (causal),
      1024 tokens 11.4 vs 23.1 ms; 2 threads about the same ratios.
    Elsewhere (fp32; bf16 without AVX512-BF16) the C kernel computes in fp32 FMAs, no faster
    than SDPA for a long chunk, so SDPA stays."""
    return (q.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16 and cpu_kernels.usable(q, k_cache)
            and k_cache.is_contiguous() and cpu_kernels.bf16_products())


@dataclass(frozen=True)
class PrefillSeq:
    query_start: int  # index of its first token in the flattened batch
    query_len: int
    context_len: int  # tokens in cache after this step (cached prefix + this chunk)
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] int64


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [D, max_blocks] int32
    decode_context_lens: torch.Tensor  # [D] int32
    prefills: tuple[PrefillSeq, ...]
    decode_gather: DecodeGather | None = None  # CPU: the decode tokens' cache rows, shared by every layer


class Attention(nn.Module):
    """Tensor-parallel: this rank's query heads and the KV heads they read (cluster/model/
    sharding.py); o_proj holds the matching input columns and the ranks' outputs are summed."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        qkv_bias: bool,
        qk_norm_eps: float | None,
        group: TensorParallelGroup = SINGLE,
    ):
        super().__init__()
        self.group = group
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        self.rotary = rotary
        # Hugging Face names for loading; fuse() merges q/k/v into one matmul.
        self.q_proj = Linear(hidden_size, self.q_size, bias=qkv_bias)
        self.k_proj = Linear(hidden_size, self.kv_size, bias=qkv_bias)
        self.v_proj = Linear(hidden_size, self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.qkv_proj: Linear | None = None

    def fuse(self) -> None:
        self.qkv_proj = fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, Hk, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)  # q: [T, Hq, D]
        k = k.view(T, self.num_kv_heads, self.head_dim)  # k: [T, Hk, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)  # v: [T, Hk, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        k_cache, v_cache = kv_cache
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.prefills and k_cache.dtype != k.dtype:  # a prompt attends to its K/V as stored, as its decode and later chunks will
            k, v = k.to(k_cache.dtype).to(k.dtype), v.to(v_cache.dtype).to(v.dtype)

        D = meta.num_decode_tokens
        decoded = None
        if D:
            q_decode = q[:D]
            if attention_in_fp32(q) and not cpu_kernels.usable(q):  # the C kernel computes in fp32 itself
                q_decode = q_decode.float()  # (the reference casts K/V to q's dtype)
            decoded = paged_attention_decode(
                q_decode, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale, meta.decode_gather
            )
        if D and D == T and decoded.dtype == q.dtype:  # a decode-only step: nothing to assemble
            return self.group.all_reduce_(self.o_proj(decoded.view(T, self.q_size)))
        out = torch.empty_like(q)  # [T, Hq, D]
        if D:
            out[:D] = decoded
        for seq in meta.prefills:
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            out[rows] = self._prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, seq)
        return self.group.all_reduce_(self.o_proj(out.view(T, self.q_size)))

    def _prefill_attention(self, q, k, v, k_cache, v_cache, seq: PrefillSeq) -> torch.Tensor:
        # q: [Tq, Hq, D]; attends to context positions [0, context_len), causally.
        start = seq.context_len - seq.query_len
        if prompt_attention_in_c(q, k_cache):  # every row reads the cache (its own K/V is stored)
            tables = seq.block_ids.to(torch.int32).expand(seq.query_len, -1)
            lens = torch.arange(start + 1, seq.context_len + 1, dtype=torch.int32)
            return cpu_kernels.paged_attention_decode(q, k_cache, v_cache, tables, lens, self.scale)
        if start > 0:  # part of the context is only in the cache: read it back
            k = k_cache[seq.block_ids].flatten(0, 1)[: seq.context_len].to(q.dtype)  # [L, Hk, D]
            v = v_cache[seq.block_ids].flatten(0, 1)[: seq.context_len].to(q.dtype)
            q_pos = torch.arange(start, seq.context_len, device=q.device)
            mask = torch.arange(seq.context_len, device=q.device)[None, :] <= q_pos[:, None]  # [Tq, L]
        else:
            mask = None
        if attention_in_fp32(q):
            q, k, v = q.float(), k.float(), v.float()
        # 4-D inputs: CPU SDPA only takes its flash kernel (6x faster here) for [B, H, T, D].
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, Hq, Tq, D]
            k.transpose(0, 1).unsqueeze(0),  # [1, Hk, L, D]
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out[0].transpose(0, 1)  # [Tq, Hq, D]
