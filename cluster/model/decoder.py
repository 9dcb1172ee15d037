"""The decoder-only transformer every supported family composes.

Parameter names equal the Hugging Face checkpoint names, so loading is a name match;
after loading, `fuse()` merges q/k/v and gate/up into single matmuls.
"""

from __future__ import annotations

import torch
from torch import nn

from cluster.model import cpu_step
from cluster.model.attention import Attention, AttentionMetadata
from cluster.model.embedding import VocabEmbedding
from cluster.model.families import ModelArch
from cluster.model.linear import Linear, pack_linears_for_cpu
from cluster.model.mlp import GatedMLP
from cluster.model.norm import RMSNorm
from cluster.model.rotary import RotaryEmbedding
from cluster.model.sharding import Shard, shard_of
from cluster.model.tp_group import SINGLE, TensorParallelGroup

KVCache = tuple[torch.Tensor, torch.Tensor]


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, rotary: RotaryEmbedding, shard: Shard, group: TensorParallelGroup):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(
            arch.hidden_size,
            shard.num_heads,
            shard.num_kv_heads,
            arch.head_dim,
            rotary,
            qkv_bias=arch.qkv_bias,
            qk_norm_eps=arch.rms_norm_eps if arch.qk_norm else None,
            group=group,
        )
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = GatedMLP(arch.hidden_size, shard.intermediate_size, group)

    def forward(self, h, positions, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        # h: [T, hidden]
        h = h + self.self_attn(self.input_layernorm(h), positions, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderBody(nn.Module):
    """Hugging Face's `model.*` submodule: embeddings, layers, final norm."""

    def __init__(self, arch: ModelArch, max_positions: int, shard: Shard, group: TensorParallelGroup):
        super().__init__()
        rotary = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling)
        self.embed_tokens = VocabEmbedding(shard.vocab_rows, arch.hidden_size, shard.vocab_start, group)
        self.layers = nn.ModuleList(DecoderLayer(arch, rotary, shard, group) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class CausalLM(nn.Module):
    """One tensor-parallel rank's part of the model (all of it when `group` has one rank)."""

    cpu_step_plan: cpu_step.StepPlan | None = None  # built by the first CPU step in one C call
    uniform_linear_weights = True  # every layer's linears of one weight dtype or quantized format (set by fuse)

    def __init__(self, arch: ModelArch, max_positions: int, group: TensorParallelGroup = SINGLE):
        super().__init__()
        self.arch = arch
        self.group = group
        self.shard = shard_of(arch, group.rank, group.size)
        self.model = DecoderBody(arch, max_positions, self.shard, group)
        self.lm_head = Linear(arch.hidden_size, self.shard.vocab_rows, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Tied checkpoints have no lm_head tensor: the head reads the embedding matrix.
        Called again after materialising from `meta`, which unties shared parameters, and
        after loading, which may have kept the table quantized."""
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            self.lm_head.quantized_weight = self.model.embed_tokens.quantized_weight

    def fuse(self) -> None:
        """After loading: merge projections, then pre-pack weights where that is faster."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        pack_linears_for_cpu([module for module in self.modules() if isinstance(module, Linear)])
        layer_linears = [m for layer in self.model.layers for m in layer.modules() if isinstance(m, Linear)]
        self.uniform_linear_weights = len({_weight_kind(m) for m in layer_linears}) <= 1

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],  # one per layer
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)  # [T, hidden]
        if cpu_step.applies(self, h, meta, kv_caches[0]):  # a CPU step of few rows: all layers in one C call
            h = cpu_step.step_layers(self, h, positions, kv_caches, meta)
        else:
            for layer, kv_cache in zip(self.model.layers, kv_caches):
                h = layer(h, positions, kv_cache, meta)
        return self.model.norm(h)

    @torch.inference_mode()
    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        # h: [N, hidden] -> [N, vocab] fp32 (vocab-parallel: every rank's rows, gathered)
        logits = self.group.all_gather_last(self.lm_head(h).float())
        return logits[:, : self.arch.vocab_size] if self.group.is_parallel else logits


def _weight_kind(linear: Linear) -> object:
    """What the C step reads of a linear: its quantized format, or its weight's dtype (which
    fixes the packed copy's: pack_linears_for_cpu packs all alike)."""
    return linear.quantized_weight.fmt if linear.quantized_weight is not None else linear.weight.dtype
