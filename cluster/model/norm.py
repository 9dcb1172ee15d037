"""RMSNorm layer (Hugging Face numerics: normalise in fp32, scale in the input dtype)."""

import torch
from torch import nn

from kernels import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., size]
        return rms_norm(x, self.weight, self.eps)
