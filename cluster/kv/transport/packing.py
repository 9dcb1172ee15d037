"""A transfer's payload: the blocks of every layer's K and V caches, packed into one
contiguous [layers, 2, n, block_size, kv_heads, head_dim] tensor and unpacked into the
receiver's blocks. Any transport moves this tensor; how is its own business."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cluster.host.openmp import serial_torch

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k, v), each [num_blocks, bs, Hk, D]


@dataclass(frozen=True)
class CacheGeometry:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def packed_shape(self, n: int) -> tuple[int, ...]:
        return (self.num_layers, 2, n, self.block_size, self.num_kv_heads, self.head_dim)

    def packed_nbytes(self, n: int) -> int:
        return torch.Size(self.packed_shape(n)).numel() * self.dtype.itemsize


def cache_geometry(kv_caches: KVCaches) -> CacheGeometry:
    """The shared shape of all layers' K and V caches; ValueError if they differ."""
    if not kv_caches:
        raise ValueError("kv_caches is empty")
    k0 = kv_caches[0][0]
    if k0.dim() != 4:
        raise ValueError(f"cache tensors must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k0.shape)}")
    for layer, (k, v) in enumerate(kv_caches):
        for t in (k, v):
            if t.shape != k0.shape or t.dtype != k0.dtype or t.device != k0.device:
                raise ValueError(
                    f"layer {layer}: cache {tuple(t.shape)} {t.dtype} on {t.device} differs from layer 0's "
                    f"{tuple(k0.shape)} {k0.dtype} on {k0.device}"
                )
    num_blocks, block_size, num_kv_heads, head_dim = k0.shape
    return CacheGeometry(len(kv_caches), num_blocks, block_size, num_kv_heads, head_dim, k0.dtype, k0.device)


def block_index(block_ids: Sequence[int], num_blocks: int, device: torch.device, unique: bool) -> torch.Tensor:
    ids = [int(b) for b in block_ids]
    bad = [b for b in ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"block ids {bad} out of range [0, {num_blocks})")
    if unique and len(set(ids)) != len(ids):
        raise ValueError(f"duplicate destination block ids in {ids}")
    return torch.tensor(ids, dtype=torch.long, device=device)  # [n]


def pack_blocks(kv_caches: KVCaches, block_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy the given blocks of every layer into one contiguous [L, 2, n, bs, Hk, D] tensor
    (`out`, when given: e.g. a shared-memory file's)."""
    geometry = cache_geometry(kv_caches)
    idx = block_index(block_ids, geometry.num_blocks, geometry.device, unique=False)  # [n]
    packed = out if out is not None else torch.empty(geometry.packed_shape(len(idx)), dtype=geometry.dtype, device=geometry.device)
    with serial_torch():  # a transfer's thread, not the engine's: no OpenMP team of its own
        for layer, (k, v) in enumerate(kv_caches):  # k, v: [num_blocks, bs, Hk, D]
            torch.index_select(k, 0, idx, out=packed[layer, 0])  # packed[layer, 0]: [n, bs, Hk, D]
            torch.index_select(v, 0, idx, out=packed[layer, 1])
    return packed


def unpack_blocks(kv_caches: KVCaches, block_ids: Sequence[int], packed: torch.Tensor) -> None:
    """Write packed [L, 2, n, bs, Hk, D] into the given blocks of every layer, in place."""
    geometry = cache_geometry(kv_caches)
    idx = block_index(block_ids, geometry.num_blocks, geometry.device, unique=True)  # [n]
    expected = geometry.packed_shape(len(idx))
    if tuple(packed.shape) != expected or packed.dtype != geometry.dtype or packed.device != geometry.device:
        raise ValueError(
            f"packed {tuple(packed.shape)} {packed.dtype} on {packed.device} does not fit {len(idx)} blocks "
            f"of this cache: expected {expected} {geometry.dtype} on {geometry.device}"
        )
    with serial_torch():
        for layer, (k, v) in enumerate(kv_caches):
            k.index_copy_(0, idx, packed[layer, 0])
            v.index_copy_(0, idx, packed[layer, 1])
