"""A GGUF file (llama.cpp's format) read directly as a Checkpoint: no conversion step.

    metadata   general.architecture + `<arch>.*` keys -> a Hugging Face config dict
    tokenizer  `tokenizer.*` keys -> cluster/model/gguf_tokenizer.py
    tensors    llama.cpp names -> Hugging Face names, dequantized (the `gguf` package's
               numpy kernels) to float32, which the loader casts to the serving dtype; or,
               in a format the caller keeps (`keep`), as stored (QuantizedTensor)

llama.cpp's converter permutes the rows of q_proj and k_proj for its `llama` rope
(adjacent pairs rotate together, where Hugging Face rotates the two halves of a head);
`_unpermute` restores Hugging Face's order. Qwen2/3 files are not permuted.

Every failure is a ModelLoadError naming the file: unknown architecture, an unsupported
tensor type, a truncated or corrupt file, a tokenizer this reader cannot rebuild.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from cluster.model.checkpoint import Checkpoint, ModelLoadError, QuantizedTensor, Slice, SliceSelector
from cluster.model.gguf_reader import MappedGGUFReader
from cluster.model.gguf_tokenizer import build_tokenizer, read_vocab
from cluster.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # also Mistral's files: llama.cpp converts them to `llama`
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
PERMUTED_QK = frozenset({"llama", "mistral"})
# Each checked against transformers' own GGUF reader (tests/integration/test_gguf.py).
SUPPORTED_TYPES = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1+: per-frequency divisors instead of rope_scaling metadata


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_TENSOR.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def _unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head, rows [0, 2, 4, ..., 1, 3, ...] back
    to [0, 1, 2, ...] (its converter reshapes (heads, 2, d/2) and swaps the last two)."""
    shape = w.shape
    return w.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


class GGUFCheckpoint(Checkpoint):
    def __init__(self, path: Path):
        self.path = path
        try:
            self._reader = MappedGGUFReader(path)
        except Exception as e:  # noqa: BLE001 - gguf raises ValueError, KeyError, IndexError ... on bad bytes
            raise ModelLoadError(f"{path}: not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}") from None
        self.arch = self._meta("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ModelLoadError(
                f"{path}: architecture {self.arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
            )
        self._tensors = {t.name: t for t in self._reader.tensors}
        unsupported = sorted({t.tensor_type.name for t in self._tensors.values() if t.tensor_type not in SUPPORTED_TYPES})
        if unsupported:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
            raise ModelLoadError(f"{path}: tensor type {', '.join(unsupported)} is not supported; supported: {supported}")
        self._config = self._hf_config()

    def _meta(self, key: str, default=None):
        field = self._reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as e:  # noqa: BLE001 - a corrupt field
            raise ModelLoadError(f"{self.path}: metadata {key!r} is unreadable: {e}") from None

    def _required(self, key: str):
        value = self._meta(key)
        if value is None:
            raise ModelLoadError(f"{self.path}: metadata {key!r} is missing")
        return value

    def _hf_config(self) -> dict:
        a = self.arch + "."
        hidden = self._required(a + "embedding_length")
        heads = self._required(a + "attention.head_count")
        head_dim = self._meta(a + "attention.key_length", hidden // heads)
        rotary = self._meta(a + "rope.dimension_count", head_dim)
        if rotary != head_dim:
            raise ModelLoadError(f"{self.path}: partial rotary embeddings ({rotary} of {head_dim} dims) are not supported")
        tokens = self._meta("tokenizer.ggml.tokens") or []
        embedding = self._tensors.get("token_embd.weight")
        if embedding is None:
            raise ModelLoadError(f"{self.path}: tensor token_embd.weight is missing")
        config = {
            "architectures": [ARCHITECTURES[self.arch]],
            "vocab_size": int(embedding.shape[-1]),
            "hidden_size": hidden,
            "intermediate_size": self._required(a + "feed_forward_length"),
            "num_hidden_layers": self._required(a + "block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._meta(a + "attention.head_count_kv", heads),
            "head_dim": head_dim,
            "rms_norm_eps": float(self._required(a + "attention.layer_norm_rms_epsilon")),
            "rope_theta": float(self._meta(a + "rope.freq_base", 10000.0)),
            "rope_scaling": self._rope_scaling(),
            "max_position_embeddings": self._required(a + "context_length"),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
            "bos_token_id": self._meta("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._meta("tokenizer.ggml.eos_token_id"),
        }
        if tokens and len(tokens) > config["vocab_size"]:
            raise ModelLoadError(f"{self.path}: {len(tokens)} tokens but an embedding of {config['vocab_size']} rows")
        return config

    def _rope_scaling(self) -> dict | None:
        a = self.arch + "."
        if ROPE_FREQS in self._tensors:
            factors = dequantize(self._tensors[ROPE_FREQS].data, self._tensors[ROPE_FREQS].tensor_type)
            return {"rope_type": "freq_factors", "factors": [float(x) for x in np.asarray(factors).reshape(-1)]}
        kind = self._meta(a + "rope.scaling.type")
        if kind in (None, "none"):
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(self._required(a + "rope.scaling.factor"))}
        raise ModelLoadError(f"{self.path}: rope scaling {kind!r} is not supported; supported: linear, Llama 3 frequency factors")

    def config(self) -> dict:
        return self._config

    def eos_token_ids(self) -> frozenset[int]:
        keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        return frozenset(i for i in (self._meta(k) for k in keys) if i is not None)

    def tokenizer(self) -> Tokenizer:
        try:
            return build_tokenizer(read_vocab(self._reader))
        except Exception as e:  # noqa: BLE001 - GGUFTokenizerError, or tokenizers' plain Exception
            raise ModelLoadError(f"{self.path}: cannot rebuild its tokenizer: {e}") from None

    def quantized_formats(self) -> frozenset[str]:
        return frozenset(t.tensor_type.name for t in self._tensors.values()
                         if t.tensor_type not in (Q.F32, Q.F16, Q.BF16))

    def num_tensors(self) -> int:
        return sum(1 for name in self._tensors if hf_name(name) is not None)

    def tensors(self, select: SliceSelector | None = None,
                keep: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        import torch  # noqa: PLC0415 - only here: the gateway reads a file's config and tokenizer without torch (~2.5 s)

        head_dim = self._config["head_dim"]
        for name, t in self._tensors.items():
            target = hf_name(name)
            if target is None:
                if name != ROPE_FREQS:  # read into the config
                    log.warning("%s: ignoring tensor %s", self.path, name)
                continue
            shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions innermost first
            data, shape, rest = _raw_part(t, shape, select(target) if select else None)
            if t.tensor_type.name in keep and len(shape) == 2 and rest is None:
                yield target, self._stored(name, t, data, shape)
                continue
            try:
                values = dequantize(data, t.tensor_type)
            except Exception as e:  # noqa: BLE001 - data cut short or inconsistent with its header
                raise ModelLoadError(f"{self.path}: tensor {name} is unreadable (truncated or corrupt?): {e}") from None
            if values.size != int(np.prod(shape)):
                raise ModelLoadError(f"{self.path}: tensor {name} holds {values.size} values, its header says {shape}")
            values = np.ascontiguousarray(values, dtype=np.float32).reshape(shape)
            tensor = torch.from_numpy(values if values.flags.writeable else values.copy())  # F32 data is a read-only map
            if rest is not None:
                dim, start, stop = rest
                tensor = tensor.narrow(dim, start, stop - start).contiguous()
            if self.arch in PERMUTED_QK and name.endswith(("attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias")):
                tensor = _unpermute(tensor, tensor.shape[0] // head_dim)  # whole heads, also in a rank's slice
            yield target, tensor


    def _stored(self, name: str, t, data: np.ndarray, shape: tuple[int, ...]) -> QuantizedTensor:
        import torch  # noqa: PLC0415 - as in tensors()

        block, block_bytes = GGML_QUANT_SIZES[t.tensor_type]
        if data.shape != (shape[0], shape[1] // block * block_bytes):
            raise ModelLoadError(f"{self.path}: tensor {name} holds {data.shape} bytes, its header says {shape}")
        rows = torch.from_numpy(np.array(data))  # a copy: the map is read-only, and closed with the file
        if self.arch in PERMUTED_QK and name.endswith(("attn_q.weight", "attn_k.weight")):
            rows = _unpermute(rows, shape[0] // self._config["head_dim"])  # rows move whole
        return QuantizedTensor(t.tensor_type.name, rows.contiguous(), (shape[0], shape[1]))


def _raw_part(t, shape: tuple[int, ...], part: Slice | None) -> tuple[np.ndarray, tuple[int, ...], Slice | None]:
    """The stored bytes of only `part` of tensor `t` where they can be cut out before
    dequantizing: whole rows, or column ranges on quantization-block boundaries. Returns
    (data, its shape, what is still to be cut after dequantizing)."""
    if part is None:
        return t.data, shape, None
    dim, start, stop = part
    if dim == 0 and t.data.shape[0] == shape[0]:  # a row's values are stored together
        return t.data[start:stop], (stop - start, *shape[1:]), None
    block, block_bytes = GGML_QUANT_SIZES[t.tensor_type]
    if dim == 1 and t.data.ndim == 2 and start % block == 0 and stop % block == 0:
        columns = slice(start // block * block_bytes, stop // block * block_bytes)
        if t.data.dtype != np.uint8:  # unquantized types are stored as typed values
            columns = slice(start, stop)
        return t.data[:, columns], (shape[0], stop - start), None
    return t.data, shape, part
