"""GGUF files load directly, and mean what llama.cpp and transformers say they mean.

transformers reads GGUF with its own code (its dequantizers, its q/k un-permutation),
so greedy tokens equal to it, in fp32, check ours independently: the built-in SmolLM2
file, every supported family, every supported tensor type. Tokenizers rebuilt from GGUF
metadata equal the tokenizer.json they came from. Bad files fail with one line.
"""

import json
import os
import subprocess

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, trainers

from cluster.config import CacheConfig
from cluster.engine.engine import Engine
from cluster.engine.sampling_params import SamplingParams
from cluster.model.builtin import builtin_model_path
from cluster.model.checkpoints import open_checkpoint
from cluster.model.gguf_checkpoint import SUPPORTED_TYPES
from cluster.model.gguf_reader import MappedGGUFReader
from cluster.model.linear import Linear
from cluster.testing.gguf_export import export_gguf
from cluster.testing.random_checkpoint import make_model, training_corpus
from cluster.text.tokenizer import Tokenizer
from tests.helpers import PDSERVE, run_all

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,", "Water boils at 100"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
# K-quants need rows that are multiples of 256 values.
GGUF_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
# llama.cpp's `pre` for each random family's splitting regex (cluster/testing/random_checkpoint.py).
FAMILY_PRE = {"llama": "llama-bpe", "mistral": "gpt2", "qwen2": "qwen2", "qwen3": "qwen2"}


def hf_greedy(model, ids: list[int], n: int = GREEDY.max_tokens) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def hf_gguf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def smollm2():
    path = builtin_model_path()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return path, hf_gguf_model(path), hf_tokenizer


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """{family: HF checkpoint dir} of K-quant-friendly shape (qwen3: transformers reads
    its GGUF with Qwen3's default head_dim of 128)."""
    root = tmp_path_factory.mktemp("gguf-src")
    return {
        arch: make_model(arch, "tiny", root / arch, overrides={**GGUF_SHAPE, **({"head_dim": 128} if arch == "qwen3" else {})})
        for arch in FAMILY_PRE
    }


def test_builtin_smollm2_matches_transformers(smollm2):
    path, hf, hf_tokenizer = smollm2
    engine = Engine.from_pretrained(str(path), dtype="float32", max_model_len=512, cache=CacheConfig(num_blocks=64))
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    assert prompts == [hf_tokenizer(p)["input_ids"] for p in PROMPTS]
    outs = engine.generate(prompts, GREEDY)
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, ids)
    assert "Paris" in outs[0].text


def test_builtin_smollm2_is_read_in_its_blocks_at_the_files_size(smollm2):
    """By default its Q4_1 linears and Q8_0 table (the tied head) stay in their blocks, the
    activations in float32; nothing else is resident but the file's float32 norms."""
    path = smollm2[0]
    engine = Engine.from_pretrained(str(path), max_model_len=256, cache=CacheConfig(num_blocks=16))
    model = engine.loaded.model
    assert engine.loaded.dtype == torch.float32
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert {m.quantized_weight.fmt for m in linears} == {"Q4_1", "Q8_0"}
    assert model.lm_head.quantized_weight is model.model.embed_tokens.quantized_weight
    resident = sum(p.nbytes for p in model.parameters()) + sum({id(m.quantized_weight): m.quantized_weight.nbytes
                                                                 for m in linears}.values())
    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
    assert resident <= 1.01 * file_bytes, (resident, file_bytes)


def test_the_mapped_reader_reads_what_gguf_reads():
    """cluster/model/gguf_reader.py parses over a plain view of the map: every field, value and
    tensor of the built-in model's file as the gguf package's own reader gives them."""
    ours, theirs = MappedGGUFReader(builtin_model_path()), GGUFReader(builtin_model_path())
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data), key
        assert mine.contents() == field.contents(), key
    assert [(t.name, t.tensor_type, t.data_offset) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.data_offset) for t in theirs.tensors
    ]
    for mine, tensor in zip(ours.tensors, theirs.tensors):
        assert np.array_equal(mine.data, tensor.data), tensor.name


def test_generate_cli_matches_transformers(smollm2):
    path, hf, _ = smollm2
    r = subprocess.run([*PDSERVE, "generate", "--model", str(path), "--dtype", "float32", "--prompt", PROMPTS[1],
                        "--max-tokens", "16", "--ignore-eos", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["token_ids"] == hf_greedy(hf, result["prompt_token_ids"])


def test_chat_template_comes_from_the_file():
    # (the one-word form: the plain question's first token is a near-tie in bf16, see test_cpu_paths.QUESTION)
    r = subprocess.run([*PDSERVE, "generate", "--chat", "What is the capital of France? Answer in one word.", "--max-tokens", "12"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    tokenizer = open_checkpoint(builtin_model_path()).tokenizer()
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("family", FAMILY_PRE)
def test_every_family_matches_transformers(tmp_path, families, family):
    path = export_gguf(families[family], tmp_path / f"{family}.gguf", "Q8_0", pre=FAMILY_PRE[family])
    engine = Engine.from_pretrained(str(path), dtype="float32", cache=CacheConfig(num_blocks=64))
    assert engine.loaded.arch.architecture == ("Qwen3ForCausalLM" if family == "qwen3" else
                                               "Qwen2ForCausalLM" if family == "qwen2" else "LlamaForCausalLM")
    hf = hf_gguf_model(path)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:2]]
    for ids, out in zip(prompts, engine.generate(prompts, GREEDY)):
        assert out.token_ids == hf_greedy(hf, ids)


@pytest.mark.parametrize("weight_type", sorted(t.name for t in SUPPORTED_TYPES))
def test_every_tensor_type_matches_transformers(tmp_path, families, weight_type):
    path = export_gguf(families["llama"], tmp_path / f"llama-{weight_type}.gguf", weight_type, pre="llama-bpe")
    engine = Engine.from_pretrained(str(path), dtype="float32", cache=CacheConfig(num_blocks=64))
    hf = hf_gguf_model(path)
    model = engine.loaded.model
    # Same dequantized values (q/k un-permuted) as transformers before any fusing (Q4_0, Q4_1
    # and Q8_0 kept in their blocks: dequantized from the kernels' records) ...
    theirs = hf.state_dict()
    assert torch.equal(model.get_submodule("model.layers.0.mlp.down_proj").dense_weight(),
                       theirs["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(model.model.embed_tokens.dense_weight(), theirs["model.embed_tokens.weight"])
    kept = weight_type in ("Q4_0", "Q4_1", "Q8_0")
    assert (model.model.embed_tokens.quantized_weight is not None) == kept
    # ... and the same tokens.
    ids = engine.tokenizer.encode(PROMPTS[0])
    assert engine.generate([ids], GREEDY)[0].token_ids == hf_greedy(hf, ids)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_byte_level_tokenizer_equals_its_tokenizer_json(tmp_path, families, family):
    path = export_gguf(families[family], tmp_path / "t.gguf", "Q8_0", pre=FAMILY_PRE[family])
    ours, source = open_checkpoint(path).tokenizer(), Tokenizer.from_pretrained(families[family])
    texts = training_corpus(2)[:60] + ["Numbers 12345 and 3.14, don't WON'T", "  two  spaces\n\n\ttab", "😀 ünïcödé 中文"]
    texts.append(ours.apply_chat_template([{"role": "user", "content": "hi there"}]))
    for text in texts:
        assert ours.encode(text) == source.encode(text), text
        assert ours.decode(ours.encode(text)) == source.decode(source.encode(text))
    assert (ours.bos_token, ours.eos_token, ours.add_bos_token) == (source.bos_token, source.eos_token, source.add_bos_token)


def test_sentencepiece_tokenizer_splits_as_llama_cpp(tmp_path):
    """A SentencePiece vocabulary (no merges in the file: recovered from scores) encodes
    like transformers' reader of the same file, and prefixes a space to every text run,
    after special tokens too, as llama.cpp does."""
    model_dir = make_model("mistral", "tiny", tmp_path / "spm", overrides={"vocab_size": 1024})
    specials = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
    backend = HFTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    corpus = training_corpus(4)
    trainer = trainers.BpeTrainer(vocab_size=1024, limit_alphabet=150, special_tokens=specials + bytes_, show_progress=False)
    backend.train_from_iterator(corpus, trainer)
    assert len(json.loads(backend.to_str())["model"]["merges"]) > 300
    backend.save(str(model_dir / "tokenizer.json"))
    path = export_gguf(model_dir, tmp_path / "spm.gguf", "Q8_0")
    ours = open_checkpoint(path).tokenizer()
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert ours.add_bos_token and ours.encode("hi")[0] == ours.bos_token_id
    for text in corpus[:80] + ["émoji 😀 and bytes ☃", "Numbers 12345"]:
        assert ours.encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ours.encode(text)) == text.strip() or ours.decode(ours.encode(text)) == text
    inst = ours.encode("[INST] hi", add_special_tokens=False)
    assert inst[0] == ours.token_to_id("[INST]")
    assert "".join(ours.id_to_token(i) for i in inst[1:]) == "▁▁hi"  # " hi" after a special token gets the prefix too


# ---- bad files: one line naming the file and the problem, exit code 2 -----------------------------


def write_minimal(path, arch="llama", tensor_type=GGMLQuantizationType.F32):
    w = GGUFWriter(path, arch)
    w.add_block_count(1)
    data = torch.zeros(4, 32).numpy() if tensor_type == GGMLQuantizationType.F32 else torch.zeros(4, 18, dtype=torch.uint8).numpy()
    w.add_tensor("token_embd.weight", data, raw_dtype=tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def bad_files(tmp_path, families):
    good = export_gguf(families["qwen2"], tmp_path / "good.gguf", "Q4_0", pre="qwen2")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"this is not a gguf file" * 100)
    return {
        "unknown architecture": (write_minimal(tmp_path / "arch.gguf", arch="phi3"), "architecture 'phi3' is not supported"),
        "unsupported tensor type": (write_minimal(tmp_path / "iq4.gguf", tensor_type=GGMLQuantizationType.IQ4_NL),
                                    "tensor type IQ4_NL is not supported"),
        "truncated": (truncated, "truncated or corrupt"),
        "corrupt": (corrupt, "truncated or corrupt"),
        "missing": (tmp_path / "missing.gguf", "does not exist"),
    }


def test_bad_gguf_files_fail_with_one_line(tmp_path, families):
    cases = bad_files(tmp_path, families)
    runs = run_all([[*PDSERVE, "generate", "--model", str(path), "--prompt", "hi"] for path, _ in cases.values()],
                   timeout_s=120, env={**os.environ, "TQDM_DISABLE": "1"})
    for (what, (path, message)), r in zip(cases.items(), runs):
        assert r.returncode == 2, (what, r.stderr)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in r.stderr, (what, r.stderr)
        assert str(path) in lines[0] and message in lines[0], (what, lines[0])
