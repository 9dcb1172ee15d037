"""Token embedding, vocab-parallel: each tensor-parallel rank holds a contiguous block of
rows (cluster/model/sharding.py); a token outside a rank's block contributes zeros
there, and the all-reduce sums the one rank's row into every rank's output."""

import torch
import torch.nn.functional as F
from torch import nn

from cluster.model.tp_group import SINGLE, TensorParallelGroup


class VocabEmbedding(nn.Embedding):
    def __init__(self, num_rows: int, hidden_size: int, vocab_start: int = 0, group: TensorParallelGroup = SINGLE):
        # Loaded, never initialised: on `meta` (loader.py) nn.Embedding's own normal_ init
        # would import torch._dynamo (~3 s) for nothing.
        super().__init__(num_rows, hidden_size, _weight=torch.empty(num_rows, hidden_size))
        self.vocab_start = vocab_start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, hidden]
        if not self.group.is_parallel:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        h.masked_fill_(outside[:, None], 0)
        return self.group.all_reduce_(h)
