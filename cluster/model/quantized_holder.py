"""What a module whose weight may stay in GGUF's blocks shares (Linear, VocabEmbedding)."""

from __future__ import annotations

import torch
from torch import nn

from kernels import quantized


class HoldsQuantizedWeight:
    """A module with a dense `weight` [rows, columns] that may instead keep it quantized
    (kernels/quantized.py): `quantized_weight` is then its only copy, and `weight` is empty,
    so whatever reads it densely fails loudly, never silently."""

    weight: nn.Parameter
    quantized_weight: quantized.QuantizedWeight | None = None

    def dense_shape(self) -> tuple[int, int]:
        raise NotImplementedError

    def load_quantized(self, weight: quantized.QuantizedWeight) -> None:
        rows, columns = self.dense_shape()
        if (weight.out_features, weight.in_features) != (rows, columns):
            raise ValueError(f"a quantized weight of {weight.out_features} x {weight.in_features} "
                             f"for a {type(self).__name__} of {rows} x {columns}")
        self.quantized_weight = weight
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def dense_weight(self) -> torch.Tensor:
        """The weight as a dense tensor (dequantized, float32, if it is kept quantized)."""
        return self.weight if self.quantized_weight is None else quantized.dequantize(self.quantized_weight)
