"""Supported model families and their Hugging Face `config.json` -> ModelArch.

The families differ only in a few switches of one decoder (see decoder.py):
  Llama 2/3 : optional `attention_bias`, optional llama3 rope scaling
  Mistral   : Llama layout; a sliding window caps the usable context
  Qwen2     : q/k/v projections carry a bias
  Qwen3     : per-head RMSNorm on q and k, explicit `head_dim`
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from cluster.model.checkpoint import ModelLoadError

log = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")  # rotary.py builds each


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None
    torch_dtype: str | None


def _llama(cfg: dict) -> dict:
    return {"qkv_bias": bool(cfg.get("attention_bias", False)), "qk_norm": False}


def _mistral(cfg: dict) -> dict:
    return {**_llama(cfg), "sliding_window": cfg.get("sliding_window")}


def _qwen2(cfg: dict) -> dict:
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    return {"qkv_bias": True, "qk_norm": False, "sliding_window": window}


def _qwen3(cfg: dict) -> dict:
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    return {"qkv_bias": bool(cfg.get("attention_bias", False)), "qk_norm": True, "sliding_window": window}


FAMILIES = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
}


class UnsupportedModelError(ValueError):
    pass


def parse_arch(cfg: dict) -> ModelArch:
    """Read a Hugging Face config dict; refuse anything this engine cannot run exactly."""
    names = cfg.get("architectures") or []
    arch = next((a for a in names if a in FAMILIES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"unsupported architecture {names or cfg.get('model_type')!r}; supported: {', '.join(FAMILIES)}"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"unsupported hidden_act {cfg['hidden_act']!r}; supported: silu")
    num_heads = cfg["num_attention_heads"]
    num_kv_heads = cfg.get("num_key_value_heads") or num_heads
    if num_heads % num_kv_heads:
        raise UnsupportedModelError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    theta, scaling = _rope(cfg)
    family = {"sliding_window": None, **FAMILIES[arch](cfg)}
    return ModelArch(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        **family,
    )


def _rope(cfg: dict) -> tuple[float, dict | None]:
    # transformers v4 writes rope_theta + rope_scaling; v5 writes rope_parameters.
    params = cfg.get("rope_parameters")
    if params:
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = params if params.get("rope_type", "default") != "default" else None
    else:
        theta, scaling = cfg.get("rope_theta", 10000.0), cfg.get("rope_scaling")
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
    return float(theta), scaling


def resolve_max_model_len(requested: int | None, arch: ModelArch) -> int:
    limit = arch.max_position_embeddings
    if requested is not None and requested > limit:
        raise ModelLoadError(f"max_model_len {requested} exceeds the model's max_position_embeddings {limit}")
    n = requested or limit
    if arch.sliding_window and n > arch.sliding_window:
        # Attention here is full, not windowed: exact only within one window.
        log.warning("capping max_model_len %d to the sliding window %d", n, arch.sliding_window)
        n = arch.sliding_window
    return n
