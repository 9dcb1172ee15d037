"""Token embedding, vocab-parallel: each tensor-parallel rank holds a contiguous block of
rows (cluster/model/sharding.py); a token outside a rank's block contributes zeros
there, and the all-reduce sums the one rank's row into every rank's output."""

import torch
import torch.nn.functional as F
from torch import nn

from cluster.model.tp_group import SINGLE, TensorParallelGroup
from kernels import quantized


class VocabEmbedding(nn.Embedding):
    def __init__(self, num_rows: int, hidden_size: int, vocab_start: int = 0, group: TensorParallelGroup = SINGLE):
        # Loaded, never initialised: on `meta` (loader.py) nn.Embedding's own normal_ init
        # would import torch._dynamo (~3 s) for nothing.
        super().__init__(num_rows, hidden_size, _weight=torch.empty(num_rows, hidden_size))
        self.vocab_start = vocab_start
        self.group = group
        # A GGUF table kept in its blocks (and shared with a tied lm_head): rows are
        # dequantized as they are looked up, and `weight` is empty.
        self.quantized_weight: quantized.QuantizedWeight | None = None

    def load_quantized(self, weight: quantized.QuantizedWeight) -> None:
        if (weight.out_features, weight.in_features) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"a quantized table of {weight.out_features} x {weight.in_features} "
                             f"for an embedding of {self.num_embeddings} x {self.embedding_dim}")
        self.quantized_weight = weight
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def dense_weight(self) -> torch.Tensor:
        """The table as a dense tensor (dequantized, float32, if it is kept quantized)."""
        return self.weight if self.quantized_weight is None else quantized.dequantize(self.quantized_weight)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized_weight is None:
            return F.embedding(ids, self.weight)
        return quantized.dequantize_rows(self.quantized_weight, ids).to(self.weight.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, hidden]
        if not self.group.is_parallel:
            return self._rows(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        h = self._rows(local.masked_fill(outside, 0))
        h.masked_fill_(outside[:, None], 0)
        return self.group.all_reduce_(h)
