"""Write a Hugging Face checkpoint as a GGUF file, as llama.cpp's converter lays it out:
its tensor names, its q/k row permutation for `llama`, its tokenizer metadata. For tests
of the GGUF reader (against transformers, which reads GGUF with its own code).

Weights are stored as F32, F16, BF16, or quantized with the `gguf` package's quantizers
(Q8_0, Q4_0, Q4_1). The `gguf` package cannot quantize K-quants: for those
(Q2_K ... Q6_K) every 2-D weight is random blocks with small scales, a valid file whose
values are whatever its bytes say (fine for comparing two readers of the same file).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, TokenType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize
from safetensors.numpy import load_file

GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# Byte offsets of each K-quant block's f16 scale fields (ggml's block_qN_K structs).
_K_SCALE_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def gguf_name(hf: str) -> str:
    if hf in _NAMES:
        return _NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)  # model.layers.N.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: per head, rows of the two rotary halves interleaved."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_k_blocks(qtype: Q, shape: tuple[int, int], rng: np.random.Generator, scale: float = 2e-4) -> np.ndarray:
    block, nbytes = GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    data = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    for offset in _K_SCALE_OFFSETS[qtype]:
        data[..., offset : offset + 2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    if qtype == Q.Q6_K:  # int8 sub-block scales: keep them small and signed
        data[..., 192:208] = rng.integers(-8, 8, size=(rows, cols // block, 16)).astype(np.int8).view(np.uint8)
    return data.reshape(rows, -1)


def _encode(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> tuple[np.ndarray, Q]:
    if w.ndim == 1 or qtype == Q.F32:
        return w.astype(np.float32), Q.F32
    if qtype == Q.F16:
        return w.astype(np.float16), Q.F16
    if qtype in _K_SCALE_OFFSETS:
        return _random_k_blocks(qtype, w.shape, rng), qtype
    return quantize(w.astype(np.float32), qtype), qtype


def export_gguf(model_dir: str | Path, out: str | Path, weight_type: str = "F32", pre: str = "default", seed: int = 0) -> Path:
    """Write `model_dir` (a Hugging Face checkpoint of a supported family, float weights,
    byte-level BPE tokenizer) as `out`; 2-D weights in `weight_type`, norms in F32."""
    model_dir, out = Path(model_dir), Path(out)
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = GGUF_ARCH[cfg["architectures"][0]]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    qtype = Q[weight_type]
    rng = np.random.default_rng(seed)

    w = GGUFWriter(out, arch)
    w.add_name("pdserve test model")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    _add_tokenizer(w, model_dir, cfg, pre)

    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    for name, value in tensors.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        value = value.astype(np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            value = permute(value, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            value = permute(value, kv_heads)
        data, dtype = _encode(value, qtype if name.endswith("weight") else Q.F32, rng)
        w.add_tensor(gguf_name(name), data, raw_dtype=dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_tokenizer(w: GGUFWriter, model_dir: Path, cfg: dict, pre: str) -> None:
    """A byte-level BPE is written as llama.cpp's `gpt2` vocabulary (with its merges); a
    BPE with byte fallback (SentencePiece style, "▁" for spaces) as `llama`, whose token
    scores (-id: BPE training numbers tokens in merge order) stand in for the merges."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    sentencepiece = bool(tok["model"].get("byte_fallback"))
    vocab = dict(tok["model"]["vocab"])
    special = set()
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        if added.get("special"):
            special.add(added["content"])
    size = cfg["vocab_size"]
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [TokenType.UNUSED] * size
    for token, i in vocab.items():
        tokens[i] = token
        if sentencepiece and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            types[i] = TokenType.BYTE
        elif token in special:
            types[i] = TokenType.CONTROL
        else:
            types[i] = TokenType.NORMAL
    w.add_token_list(tokens)
    w.add_token_types(types)
    if sentencepiece:
        w.add_tokenizer_model("llama")
        w.add_token_scores([-float(i) for i in range(size)])
        unk = tok["model"].get("unk_token")
        if unk is not None:
            w.add_unk_token_id(vocab[unk])
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    for key, add in (("bos_token", w.add_bos_token_id), ("eos_token", w.add_eos_token_id), ("pad_token", w.add_pad_token_id)):
        if tok_cfg.get(key):
            add(vocab[tok_cfg[key]])
    w.add_add_bos_token(bool(tok_cfg.get("add_bos_token")))
    if tok_cfg.get("chat_template"):
        w.add_chat_template(tok_cfg["chat_template"])
