"""Gated MLP (SwiGLU): down(silu(gate(x)) * up(x)), gate and up fused in one matmul."""

import torch
from torch import nn

from cluster.model.linear import Linear, fuse_linears
from cluster.model.tp_group import SINGLE, TensorParallelGroup
from kernels import silu_and_mul


class GatedMLP(nn.Module):
    """Tensor-parallel: gate/up hold this rank's intermediate rows, down_proj the matching
    columns; the ranks' partial outputs are summed."""

    def __init__(self, hidden_size: int, intermediate_size: int, group: TensorParallelGroup = SINGLE):
        super().__init__()
        self.group = group
        # Loaded under their Hugging Face names, then fused into gate_up_proj by fuse().
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_proj: Linear | None = None

    def fuse(self) -> None:
        self.gate_up_proj = fuse_linears(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> gate_up: [T, 2I] -> [T, I] -> [T, H]
        return self.group.all_reduce_(self.down_proj(silu_and_mul(self.gate_up_proj(x))))

