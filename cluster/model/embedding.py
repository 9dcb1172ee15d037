"""Token embedding, vocab-parallel: each tensor-parallel rank holds a contiguous block of
rows (cluster/model/sharding.py); a token outside a rank's block contributes zeros
there, and the all-reduce sums the one rank's row into every rank's output."""

import torch
import torch.nn.functional as F
from torch import nn

from cluster.model.quantized_holder import HoldsQuantizedWeight
from cluster.model.tp_group import SINGLE, TensorParallelGroup
from kernels import quantized


class VocabEmbedding(HoldsQuantizedWeight, nn.Embedding):
    """A table kept quantized (and shared with a tied lm_head) has its rows dequantized as
    they are looked up."""

    def __init__(self, num_rows: int, hidden_size: int, vocab_start: int = 0, group: TensorParallelGroup = SINGLE):
        # Loaded, never initialised: on `meta` (loader.py) nn.Embedding's own normal_ init
        # would import torch._dynamo (~3 s) for nothing.
        super().__init__(num_rows, hidden_size, _weight=torch.empty(num_rows, hidden_size))
        self.vocab_start = vocab_start
        self.group = group

    def dense_shape(self) -> tuple[int, int]:
        return self.num_embeddings, self.embedding_dim

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
