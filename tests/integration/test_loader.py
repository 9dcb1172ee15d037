"""The Hugging Face loader refuses broken or unsupported checkpoints with clear errors,
and loads without torch's compiler stack."""

import json
import shutil

import pytest
import torch

from cluster.config import CacheConfig, EngineConfig
from cluster.engine.engine import Engine
from cluster.engine.sampling_params import SamplingParams
from cluster.host.cpu_features import DISABLE_ENV, compiler_isa_flags, detect
from cluster.model.families import UnsupportedModelError
from cluster.model.linear import Linear
from cluster.model.loader import ModelLoadError, load_model
from cluster.testing.random_checkpoint import make_model
from kernels import cpu
from tests.helpers import fresh_imports
from tests.unit.test_cpu_kernels import AVX2_FLAGS


@pytest.fixture
def copy_of(tmp_path, tiny_models):
    def copy(name):
        dst = tmp_path / name
        shutil.copytree(tiny_models[name], dst)
        return dst

    return copy


def edit_config(model_dir, **changes):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(changes)
    (model_dir / "config.json").write_text(json.dumps(cfg))


def test_sharded_checkpoint_loads_every_shard(tiny_models):
    model_dir = tiny_models["llama"]
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = load_model(model_dir, dtype="float32")
    assert loaded.arch.rope_scaling["rope_type"] == "llama3"
    assert len(loaded.eos_token_ids) == 2  # generation_config lists two eos ids


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_loading_imports_neither_dynamo_nor_sympy(tiny_models, name):
    """Every replica and rank loads a model at start: ops on the `meta` model that go through
    torch's Python references import torch._dynamo and sympy (~4 s of CPU) for nothing."""
    load = f"from cluster.model.loader import load_model; load_model({str(tiny_models[name])!r}, dtype='float32')"
    assert fresh_imports(load, ("torch._dynamo", "sympy"))[0] == []


def test_dtype_choice(tiny_models):
    """bf16 loads on every CPU (pre-packed only where the CPU has native bf16, fp32
    everywhere); `auto`
    follows the CPU, not the checkpoint's float32 (tests/unit/test_cpu_features.py has
    each CPU kind; tests/integration/test_cpu_paths.py forces them in real processes)."""
    bf16 = load_model(tiny_models["qwen2"], dtype="bfloat16").model
    assert bf16.lm_head.weight.dtype == torch.bfloat16
    packed = [m for m in bf16.modules() if getattr(m, "packed_weight", None) is not None]
    assert bool(packed) == (detect().native_bf16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert load_model(tiny_models["qwen2"], dtype="auto").dtype == (torch.bfloat16 if detect().native_bf16 else torch.float32)
    fp32 = load_model(tiny_models["qwen2"], dtype="float32").model
    packed = [m.packed_weight is not None for m in fp32.modules() if isinstance(m, Linear)]
    assert packed and all(packed) == torch.backends.mkldnn.is_available()


def test_a_bf16_checkpoint_in_fp32_streams_bf16_weights_and_generates_the_same(tmp_path, monkeypatch):
    """A bf16 checkpoint served in fp32: every linear's C-kernel copy is packed in bf16 (half
    the bytes a decode step streams) where the kernels multiply fp32 rows by bf16 weights,
    the AVX2 build here so that this runs on every CPU; widening is exact, so prompts decoded
    together generate the fp32 copies' tokens and logprobs bit for bit."""
    model_dir = make_model("llama", "tiny", tmp_path / "bf16", dtype="bfloat16", seed=3)
    prompts = [[5 + i, 17, 42 + 3 * i, 9] * (i + 1) for i in range(5)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    # AVX-512 forced off as PDSERVE_CPU_DISABLE does it: each model load builds the kernels
    # for what detect() reports (on an AVX-512 CPU, configuring AVX2 alone was undone there).
    monkeypatch.setenv(DISABLE_ENV, "avx512")
    detect.cache_clear()
    cpu.configure(AVX2_FLAGS)
    try:
        assert cpu.compact_weights()
        compact = Engine(EngineConfig(model=str(model_dir), dtype="float32", cache=CacheConfig(memory_gib=0.05)))
        weights = [m.kernel_weight.data.dtype for m in compact.loaded.model.modules() if isinstance(m, Linear)]
        assert weights and set(weights) == {torch.bfloat16}
        expected = compact.generate(prompts, params)
        compact.close()
        monkeypatch.setattr(cpu, "compact_weights", lambda: False)
        plain = Engine(EngineConfig(model=str(model_dir), dtype="float32", cache=CacheConfig(memory_gib=0.05)))
        weights = [m.kernel_weight.data.dtype for m in plain.loaded.model.modules() if isinstance(m, Linear)]
        assert set(weights) == {torch.float32}
        got = plain.generate(prompts, params)
        plain.close()
    finally:
        monkeypatch.undo()
        detect.cache_clear()
        cpu.configure(compiler_isa_flags(detect()))
    assert [(c.token_ids, c.logprobs) for c in got] == [(c.token_ids, c.logprobs) for c in expected]


def test_an_fp32_checkpoint_keeps_fp32_kernel_weights(tiny_models):
    """Its weights are not bf16 values: packing them in bf16 would round them."""
    model = load_model(tiny_models["llama"], dtype="float32").model
    weights = {m.kernel_weight.data.dtype for m in model.modules() if isinstance(m, Linear) and m.kernel_weight}
    assert weights == ({torch.float32} if cpu.available() else set())


def test_tied_head_shares_the_embedding(tiny_models):
    m = load_model(tiny_models["mistral"], dtype="float32").model
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()


def test_unsupported_architecture_names_the_supported_ones(copy_of):
    d = copy_of("qwen2")
    edit_config(d, architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(UnsupportedModelError, match="supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        load_model(d)


def test_missing_files(copy_of):
    d = copy_of("qwen2")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="expected model.safetensors"):
        load_model(d)
    (d / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json not found"):
        load_model(d)


def test_missing_shard(copy_of):
    d = copy_of("llama")
    next(d.glob("model-0000*-of-*.safetensors")).unlink()
    with pytest.raises(ModelLoadError, match="missing"):
        load_model(d)


def test_shape_mismatch_is_reported(copy_of):
    d = copy_of("qwen2")
    edit_config(d, intermediate_size=96)
    with pytest.raises(ModelLoadError, match="checkpoint shape"):
        load_model(d)


def test_context_beyond_the_model_is_refused(tiny_models):
    with pytest.raises(ModelLoadError, match="max_position_embeddings"):
        load_model(tiny_models["qwen2"], max_model_len=10**6)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_a_hugging_face_checkpoint_quantized_at_load_computes_with_its_blocks(tiny_models, fmt):
    """--quantization q8_0 / q4_0: every linear and the embedding quantized by gguf's own
    quantizer (the blocks are exactly its round trip), float32 activations, and the model's
    logits those of the dense model up to the quantization's error."""
    from gguf import GGMLQuantizationType  # noqa: PLC0415 - as the loader uses it
    from gguf.quants import dequantize as gguf_dequantize  # noqa: PLC0415
    from gguf.quants import quantize as gguf_quantize  # noqa: PLC0415

    from kernels import quantized  # noqa: PLC0415

    dense = load_model(tiny_models["qwen2"], dtype="float32", quantization="none").model
    loaded = load_model(tiny_models["qwen2"], quantization=fmt)
    model = loaded.model
    assert loaded.dtype == torch.float32
    down, dense_down = model.get_submodule("model.layers.0.mlp.down_proj"), dense.get_submodule("model.layers.0.mlp.down_proj")
    qtype = GGMLQuantizationType[fmt.upper()]
    round_trip = gguf_dequantize(gguf_quantize(dense_down.weight.numpy(), qtype), qtype)
    assert down.quantized_weight.fmt == fmt.upper() and down.weight.numel() == 0
    assert torch.equal(quantized.dequantize(down.quantized_weight), torch.from_numpy(round_trip))
    assert all(m.quantized_weight is not None for m in model.modules() if isinstance(m, Linear))
    engine = Engine.from_pretrained(str(tiny_models["qwen2"]), quantization=fmt, cache=CacheConfig(num_blocks=32))
    reference = Engine.from_pretrained(str(tiny_models["qwen2"]), dtype="float32", quantization="none",
                                       cache=CacheConfig(num_blocks=32))
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    prompt = list(range(3, 40))
    ours, theirs = (dict(e.generate([prompt], params)[0].logprobs[0].top) for e in (engine, reference))
    common = set(ours) & set(theirs)
    assert common, (ours, theirs)  # the top tokens overlap, at nearly the dense model's log-probabilities
    assert max(abs(ours[t] - theirs[t]) for t in common) < (0.05 if fmt == "q8_0" else 0.5), (ours, theirs)


def test_quantizing_where_the_kernels_cannot_read_it_is_refused_in_one_line(tiny_models, monkeypatch):
    from cluster.model.checkpoints import open_checkpoint  # noqa: PLC0415
    from cluster.model.loader import quantized_load  # noqa: PLC0415

    checkpoint = open_checkpoint(tiny_models["qwen2"])
    assert quantized_load(checkpoint, "q8_0", "cpu").quantize_to == "Q8_0"
    assert not quantized_load(checkpoint, "auto", "cpu")  # nothing stored quantized, nothing asked for
    with pytest.raises(ModelLoadError, match="needs the CPU kernels"):
        quantized_load(checkpoint, "q8_0", "cuda")
    monkeypatch.setenv(cpu.SWITCH_ENV, "0")
    cpu.reload()
    try:
        with pytest.raises(ModelLoadError, match="needs the CPU kernels"):
            quantized_load(checkpoint, "q4_0", "cpu")
    finally:
        monkeypatch.delenv(cpu.SWITCH_ENV)
        cpu.reload()
