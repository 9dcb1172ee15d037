"""cluster/testing/random_checkpoint.py: checkpoints Hugging Face transformers loads as is.

transformers is a test-only dependency; it is imported here, never by cluster/.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from cluster.testing.random_checkpoint import (
    ARCHS,
    count_parameters,
    make_model,
    model_config,
    param_shapes,
    train_tokenizer,
)
from cluster.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x  # 12345 67.89\n\n\ttab",
    "Crème brûlée 你好，世界 東京 안녕하세요 😀🚀 👨‍👩‍👧‍👦",
    "<|im_start|>user\nhi<|im_end|> [INST] <|eot_id|> I'm DON'T",
    "  leading and trailing  ",
]
ARCH_CLASS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def _load_hf(path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model


def _load_tensors(path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("model*.safetensors"))
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            assert sf.metadata() == {"format": "pt"}
            out.update({k: sf.get_tensor(k) for k in sf.keys()})
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: make_model(arch, "tiny", root / arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_in_transformers(tiny, arch):
    path = tiny[arch]
    cfg = json.loads((path / "config.json").read_text())
    model = _load_hf(path)
    assert type(model).__name__ == ARCH_CLASS[arch] == cfg["architectures"][0]
    assert cfg["model_type"] == arch and cfg["hidden_act"] == "silu" and cfg["rope_scaling"] is None
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA
    # Our parameter list is exactly HF's, and every value made it across.
    hf_state = model.state_dict()
    ours = _load_tensors(path)
    tied = {"lm_head.weight"} if cfg["tie_word_embeddings"] else set()
    assert set(ours) == set(param_shapes(cfg)) == set(hf_state) - tied
    for name, t in ours.items():
        assert torch.equal(hf_state[name], t), name
    assert count_parameters(cfg) == sum(p.numel() for p in model.parameters())
    ids = torch.tensor([[1, 5, 9, 200, cfg["vocab_size"] - 1]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 5, cfg["vocab_size"]) and torch.isfinite(logits).all()


def test_family_specific_shapes_and_fields(tiny):
    q3 = json.loads((tiny["qwen3"] / "config.json").read_text())
    assert q3["head_dim"] == 32 != q3["hidden_size"] // q3["num_attention_heads"]
    assert q3["use_sliding_window"] is False and q3["rope_theta"] == 1e6
    w = _load_tensors(tiny["qwen3"])
    assert w["model.layers.0.self_attn.q_norm.weight"].shape == (32,)
    assert w["model.layers.1.self_attn.k_norm.weight"].shape == (32,)
    assert w["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    assert "model.layers.0.self_attn.q_proj.bias" not in w

    w2 = _load_tensors(tiny["qwen2"])
    for p in ("q", "k", "v"):
        assert f"model.layers.0.self_attn.{p}_proj.bias" in w2
    assert "model.layers.0.self_attn.o_proj.bias" not in w2

    llama = json.loads((tiny["llama"] / "config.json").read_text())
    assert llama["attention_bias"] is False and llama["rope_theta"] == 10000.0
    mistral = json.loads((tiny["mistral"] / "config.json").read_text())
    assert mistral["sliding_window"] is None

    wl = _load_tensors(tiny["llama"])
    assert "lm_head.weight" in wl  # tiny is untied by default
    norm = wl["model.layers.0.input_layernorm.weight"]
    assert not torch.allclose(norm, torch.ones_like(norm)) and (norm - 1).abs().max() < 0.5
    mat = wl["model.layers.0.mlp.up_proj.weight"]
    assert 0.015 < mat.std().item() < 0.025


def test_generation_config(tiny):
    tok = Tokenizer.from_pretrained(tiny["llama"])
    gen = json.loads((tiny["llama"] / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")]
    assert gen["bos_token_id"] == tok.bos_token_id
    for arch in ("mistral", "qwen2", "qwen3"):
        gen = json.loads((tiny[arch] / "generation_config.json").read_text())
        assert isinstance(gen["eos_token_id"], int)
        cfg = json.loads((tiny[arch] / "config.json").read_text())
        assert gen["eos_token_id"] == Tokenizer.from_pretrained(tiny[arch]).eos_token_id
        assert cfg["eos_token_id"] is not None and cfg["bos_token_id"] is not None


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_tokenizer_agrees(tiny, arch):
    path = tiny[arch]
    ours = Tokenizer.from_pretrained(path)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    assert ours.vocab_size == json.loads((path / "config.json").read_text())["vocab_size"] == len(hf)
    for text in TEXTS:
        assert hf(text)["input_ids"] == ours.encode(text), text
        ids = ours.encode(text, add_special_tokens=False)
        assert hf.decode(ids, skip_special_tokens=True) == ours.decode(ids)
    msgs = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Hi 😀"},
        {"role": "assistant", "content": "Yo"},
        {"role": "user", "content": "More"},
    ]
    for gen in (True, False):
        expected = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == expected


def test_sharded_matches_single_file(tiny, tmp_path):
    path = make_model("qwen2", "tiny", tmp_path / "sharded", max_shard_bytes=64 * 1024)
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (path / "model.safetensors").exists()
    n = len(shards)
    assert [s.name for s in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    single = _load_tensors(tiny["qwen2"])
    sharded = _load_tensors(path)
    assert set(index["weight_map"]) == set(single) == set(sharded)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in single.values())
    for name, t in single.items():
        assert torch.equal(sharded[name], t), name
        with safe_open(str(path / index["weight_map"][name]), framework="pt") as sf:
            assert name in sf.keys()
    for f in shards:  # each shard respects the limit unless it is a single oversized tensor
        assert f.stat().st_size <= 64 * 1024 + 4096 or len(_load_tensors_file(f)) == 1
    a, b = _load_hf(tiny["qwen2"]).state_dict(), _load_hf(path).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Re-making unsharded in the same directory removes the stale shards.
    make_model("qwen2", "tiny", path)
    assert not list(path.glob("model-*.safetensors")) and not (path / "model.safetensors.index.json").exists()


def _load_tensors_file(f):
    with safe_open(str(f), framework="pt") as sf:
        return list(sf.keys())


def test_overrides(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256}
    path = make_model("llama", "tiny", tmp_path / "o",
                      overrides={"num_key_value_heads": 1, "tie_word_embeddings": True, "rope_scaling": rope})
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_key_value_heads"] == 1 and cfg["tie_word_embeddings"] is True and cfg["rope_scaling"] == rope
    w = _load_tensors(path)
    assert "lm_head.weight" not in w
    assert w["model.layers.0.self_attn.k_proj.weight"].shape == (16, 64)
    model = _load_hf(path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with pytest.raises(ValueError, match="multiple"):
        make_model("llama", "tiny", tmp_path / "bad", overrides={"num_key_value_heads": 3})


def test_dtype_vocab_and_seed(tiny, tmp_path):
    path = make_model("mistral", "tiny", tmp_path / "bf16", dtype="bfloat16", vocab_size=640, seed=1)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["vocab_size"] == 640
    w = _load_tensors(path)
    assert all(t.dtype == torch.bfloat16 for t in w.values())
    assert w["model.embed_tokens.weight"].shape == (640, 64)
    # Same tokenizer, different weights for a different seed.
    assert (path / "tokenizer.json").read_bytes() == (tiny["mistral"] / "tokenizer.json").read_bytes()
    base = _load_tensors(tiny["mistral"])["model.layers.0.mlp.up_proj.weight"]
    assert not torch.equal(w["model.layers.0.mlp.up_proj.weight"].float(), base)
    _load_hf(path)
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        make_model("mistral", "tiny", tmp_path / "v", vocab_size=100)
    with pytest.raises(ValueError, match="unknown arch"):
        make_model("gpt2", "tiny", tmp_path / "x")


def test_deterministic(tiny, tmp_path):
    again = make_model("llama", "tiny", tmp_path / "again")
    names = sorted(p.name for p in tiny["llama"].iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (again / name).read_bytes() == (tiny["llama"] / name).read_bytes(), name


def test_small_parameter_count():
    tok, _ = train_tokenizer("llama", "tiny")  # config arithmetic only needs token ids
    for arch in ARCHS:
        cfg = model_config(arch, "small", tok)
        assert cfg["vocab_size"] == 32000 and cfg["tie_word_embeddings"] is True
        assert cfg["hidden_size"] == 768 and cfg["num_hidden_layers"] == 12 and cfg["head_dim"] == 64
        assert 80e6 <= count_parameters(cfg) <= 130e6, (arch, count_parameters(cfg))


def test_the_benchmark_shape_is_smollm2_135m_with_a_4096_vocabulary():
    tok, _ = train_tokenizer("llama", "smollm2")
    cfg = model_config("llama", "smollm2", tok)
    assert cfg["vocab_size"] == tok.get_vocab_size(with_added_tokens=True) == 4096
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["intermediate_size"], cfg["head_dim"]) == (576, 30, 9, 3, 1536, 64)
    assert 105e6 <= count_parameters(cfg) <= 110e6  # SmolLM2-135M less 45k embedding rows


@pytest.mark.slow
def test_make_small_llama(tmp_path):
    """The benchmark checkpoint really builds (~5 s, ~400 MB on disk)."""
    path = make_model("llama", "small", tmp_path / "small")
    cfg = json.loads((path / "config.json").read_text())
    shapes = param_shapes(cfg)
    with safe_open(str(path / "model.safetensors"), framework="pt") as sf:
        assert set(sf.keys()) == set(shapes)
        assert tuple(sf.get_slice("model.embed_tokens.weight").get_shape()) == (32000, 768)
    tok = Tokenizer.from_pretrained(path)
    assert 7000 <= tok.vocab_size <= 8000 < cfg["vocab_size"]
    text = "Crème brûlée 你好 😀 and some English text about functions."
    assert tok.decode(tok.encode(text)) == text
