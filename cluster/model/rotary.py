"""Rotary position embedding: builds the cos/sin table once, applies it per step.

Supported `rope_type`s: default, linear, llama3 (Llama 3.1's frequency-band scaling), and
freq_factors (explicit per-frequency divisors: how GGUF files of Llama 3.1+ carry it).
The table is fp32 `[max_positions, head_dim]`: cos in the first half, sin in the second.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from cluster.model.families import SUPPORTED_ROPE_TYPES
from kernels import apply_rotary


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the band between blended.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        # On `meta` (loader.py builds the model there) the table waits for rebuild(): meta
        # ops on it would go through torch._refs, whose first use imports torch._dynamo (~3 s).
        on_meta = torch.get_default_device().type == "meta"
        table = torch.empty(max_positions, head_dim, dtype=torch.float32) if on_meta else self._table()
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def _table(self) -> torch.Tensor:
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv_freq)  # [P, D/2]
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [P, D]

    def rebuild(self) -> None:
        """Recompute the table in place (after the model was materialised from `meta`)."""
        with torch.device(self.cos_sin_cache.device):
            self.cos_sin_cache = self._table()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, Hq, D]; k: [T, Hk, D]
        return apply_rotary(q, k, positions, self.cos_sin_cache)
