"""Typed configuration. Built once, never mutated (frozen dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # KV cache size: an explicit block count wins over a memory budget.
    num_blocks: int | None = None
    memory_gib: float = 1.0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.memory_gib <= 0:
            raise ValueError(f"memory_gib must be > 0, got {self.memory_gib}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    max_num_seqs: int = 64  # requests in the running batch
    long_prefill_token_threshold: int = 0  # >0 caps one request's chunk per step

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")


@dataclass(frozen=True)
class EngineConfig:
    model: str  # a Hugging Face model directory
    dtype: str = "auto"
    served_model_name: str | None = None
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    device: str = "cpu"
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    seed: int = 0
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def model_id(self) -> str:
        return self.served_model_name or self.model
