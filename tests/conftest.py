"""Shared test set-up. TRITON_INTERPRET must be set before triton is first imported,
so that the Triton kernels can run (interpreted) against CPU tensors, and the CPU
capability limits (PDSERVE_CPU_DISABLE, e.g. `avx512` to run the whole suite as on an
AVX2-only CPU) before torch is."""

import os

import cluster  # noqa: F401 - first: applies PDSERVE_CPU_DISABLE before torch is imported

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from cluster.testing.random_checkpoint import make_model

# Tests share two cores with whatever else runs; keep torch from oversubscribing.
torch.set_num_threads(2)

# Tiny checkpoints exercising every family and its variants (GQA/MQA/MHA, tied or not,
# sharded or not, llama3 rope scaling, explicit head_dim).
TINY_VARIANTS = {
    "llama": dict(
        arch="llama",
        overrides={
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
        max_shard_bytes=200_000,
    ),
    "mistral": dict(arch="mistral", overrides={"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "qwen2": dict(arch="qwen2", overrides={"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "qwen3": dict(arch="qwen3", overrides={"tie_word_embeddings": False}),
}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Build each tiny variant once per session: {name: model_dir}."""
    root = tmp_path_factory.mktemp("models")
    return {
        name: make_model(v["arch"], "tiny", root / name, overrides=v.get("overrides"), max_shard_bytes=v.get("max_shard_bytes"))
        for name, v in TINY_VARIANTS.items()
    }


@pytest.fixture(scope="session")
def tiny_llama(tiny_models):
    return tiny_models["llama"]


@pytest.fixture
def two_torch_threads():
    """torch (and the C kernels, which take torch's count) on two threads, whatever the suite set."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def wide_model(tmp_path_factory):
    """The tiny checkpoint's tokenizer on a model wide enough that prefilling a few hundred
    tokens takes seconds, not milliseconds, and a stream of a few hundred tokens outlasts a
    redeploy: long enough to see a replica busy (from outside, through stats calls or
    Serve) and kill or remove it there."""
    return make_model(
        "qwen2",
        "tiny",
        tmp_path_factory.mktemp("wide"),
        overrides={
            "hidden_size": 512,
            "intermediate_size": 2048,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "tie_word_embeddings": True,
        },
    )
