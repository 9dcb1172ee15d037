"""Random-weight checkpoints in Hugging Face format, made entirely locally.

`make_model("qwen3", "tiny", out_dir)` writes what a Hub download would hold:

    config.json, generation_config.json          HF field names, per family
    model.safetensors                             (or model-0000i-of-0000N + index.json)
    tokenizer.json, tokenizer_config.json         byte-level BPE trained here, chat template

Weights are seeded normals (std 0.02; norm weights 1 + noise so norms are not the
identity), so outputs are deterministic but meaningless: good for comparing engines
token for token and for benchmarks. The tokenizer is trained on a fixed corpus
(standard-library docstrings plus multilingual/emoji text in this file), so the same
arguments give the same files. Nothing is downloaded, nothing is cached globally, and
Hugging Face transformers is not imported (the tests load the result with it).
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from cluster.testing import ARCHS, SIZES

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# --------------------------------------------------------------------------- families

_LLAMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Mistral's [INST] format: the closing [/INST] already is the generation prompt, so
# add_generation_prompt changes nothing (as in Mistral's own template). A system message
# is folded into the first user turn.
_MISTRAL_TEMPLATE = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set loop_messages = messages %}{% endif %}"
    "{{ bos_token }}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + (system + '\\n\\n' if loop.first and system else '') + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user, assistant and system roles are supported') }}{% endif %}"
    "{% endfor %}"
)


@dataclass(frozen=True)
class _Family:
    special_tokens: tuple[str, ...]
    bos: str | None  # tokenizer_config bos_token
    eos: str  # tokenizer_config eos_token (the chat turn end)
    pad: str | None
    config_bos: str  # config.json bos_token_id
    config_eos: str  # config.json eos_token_id
    generation_eos: tuple[str, ...]  # generation_config eos_token_id (a list if > 1)
    add_bos_token: bool
    chat_template: str
    split_regex: str | None = None  # pre-tokenizer split; None: ByteLevel's GPT-2 regex
    nfc: bool = False  # NFC-normalize before tokenizing (Qwen)


# Pre-tokenizer regexes of the real families: Hugging Face's Qwen2Tokenizer rebuilds its
# pre-tokenizer with exactly this one, so ours must match for AutoTokenizer to agree.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


_LLAMA = _Family(
    special_tokens=("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"),
    bos="<|begin_of_text|>",
    eos="<|eot_id|>",
    pad=None,
    config_bos="<|begin_of_text|>",
    config_eos="<|end_of_text|>",
    generation_eos=("<|end_of_text|>", "<|eot_id|>"),
    add_bos_token=True,
    chat_template=_LLAMA_TEMPLATE,
    split_regex=_LLAMA3_SPLIT,
)
_QWEN = _Family(
    special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    bos=None,
    eos="<|im_end|>",
    pad="<|endoftext|>",
    config_bos="<|endoftext|>",
    config_eos="<|im_end|>",
    generation_eos=("<|im_end|>",),
    add_bos_token=False,
    chat_template=_CHATML_TEMPLATE,
    split_regex=_QWEN2_SPLIT,
    nfc=True,
)
_MISTRAL = _Family(
    special_tokens=("<s>", "</s>", "[INST]", "[/INST]"),
    bos="<s>",
    eos="</s>",
    pad=None,
    config_bos="<s>",
    config_eos="</s>",
    generation_eos=("</s>",),
    add_bos_token=True,
    chat_template=_MISTRAL_TEMPLATE,
)

_FAMILY = {"llama": _LLAMA, "mistral": _MISTRAL, "qwen2": _QWEN, "qwen3": _QWEN}
_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# ------------------------------------------------------------------------------ sizes

_SIZE_CONFIG: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
    "small": dict(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    # SmolLM2-135M's shape with a 4096-token vocabulary: the README's benchmark model.
    "smollm2": dict(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
}
_QWEN3_TINY_HEAD_DIM = 32  # != hidden/heads (16): catches code that assumes head_dim = hidden/heads
_TOKENIZER_VOCAB = {"tiny": 512, "small": 8000, "smollm2": 4096}
_MODEL_VOCAB = {"tiny": None, "small": 32000, "smollm2": None}  # None: exactly the tokenizer's size

# ----------------------------------------------------------------------------- corpus

# Standard-library modules whose docstrings form the English/code part of the corpus.
# Fixed and sorted, so the corpus (and the trained tokenizer) is the same on every run.
_CORPUS_MODULES = tuple(
    sorted(
        [
            "abc", "argparse", "array", "ast", "base64", "bisect", "calendar", "cmd", "codecs",
            "collections", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime",
            "decimal", "difflib", "doctest", "enum", "filecmp", "fnmatch", "fractions", "functools",
            "getopt", "gettext", "glob", "graphlib", "gzip", "hashlib", "heapq", "hmac", "html",
            "inspect", "io", "ipaddress", "itertools", "json", "linecache", "logging", "math",
            "mimetypes", "numbers", "operator", "optparse", "pathlib", "pickle", "pprint", "queue",
            "random", "re", "sched", "secrets", "shelve", "shlex", "shutil", "statistics", "string",
            "struct", "tarfile", "tempfile", "textwrap", "timeit", "tokenize", "trace", "traceback",
            "types", "typing", "unicodedata", "unittest", "uuid", "warnings", "weakref", "zipfile",
        ]
    )
)
_TINY_CORPUS_MODULES = 24  # the first N of the sorted list: enough for a 512-token vocab, fast

# Multi-byte text so the tokenizer learns (and splits) accented letters, CJK and emoji.
_MULTILINGUAL = """\
Français : Le cœur a ses raisons que la raison ne connaît point. Où est la bibliothèque ? À bientôt, Noël, garçon, élève.
Deutsch: Größe, Übermäßig, schön, Straße, Fräulein, Äpfel und Öl. Grüß Gott! Die Bücher liegen auf dem Tisch.
Español: ¿Dónde está el niño? ¡Qué bien! El pingüino comió piña en la montaña. Mañana será otro día.
Português: Não há coração que não sinta. Ação, informação, São Paulo, pão, irmã.
Русский: Привет, мир! Как дела? Москва — столица России. Съешь же ещё этих мягких французских булок.
Ελληνικά: Καλημέρα κόσμε. Η γλώσσα μου έδωσαν ελληνική. Ευχαριστώ πολύ.
中文：你好，世界！我们今天学习机器学习和自然语言处理。大语言模型可以生成文本。北京、上海、广州。
日本語：こんにちは世界。東京は日本の首都です。ひらがな、カタカナ、漢字を使います。ありがとうございます。
한국어: 안녕하세요, 세계! 서울은 한국의 수도입니다. 감사합니다. 한글은 아름답습니다.
العربية: مرحبا بالعالم. اللغة العربية جميلة. شكرا جزيلا.
हिन्दी: नमस्ते दुनिया। भारत एक विशाल देश है। धन्यवाद।
עברית: שלום עולם. תודה רבה.
Tiếng Việt: Xin chào thế giới. Cảm ơn bạn rất nhiều.
Emoji: 😀 😃 😄 😁 😆 🙂 🙃 😉 😊 😍 🤔 🤖 🚀 🌍 🌟 🔥 💡 🎉 🍕 🐍 ❤️ 👍 👋🏽 👨‍👩‍👧‍👦 🇫🇷 🇯🇵 ✅ ⚡ ☕ ∑ ∫ √ π ≈ ≠ ≤ ≥ → ⇒ € £ ¥ © ® ™ ° ± × ÷
Mixed: The café serves crème brûlée 🍮 and 拉面 🍜; naïve résumé, coöperate, jalapeño, smörgåsbord 🎶.
"""


def _docstrings(module_name: str) -> Iterator[str]:
    """Docstrings of a module and of its public members (and their members), in name order."""
    module = importlib.import_module(module_name)
    if module.__doc__:
        yield inspect.cleandoc(module.__doc__)
    for name in sorted(vars(module)):
        obj = vars(module)[name]
        if name.startswith("_") or getattr(obj, "__module__", None) != module_name:
            continue
        doc = getattr(obj, "__doc__", None)
        if isinstance(doc, str):
            yield inspect.cleandoc(doc)
        if inspect.isclass(obj):
            for attr in sorted(vars(obj)):
                member_doc = getattr(vars(obj)[attr], "__doc__", None)
                if not attr.startswith("_") and callable(vars(obj)[attr]) and isinstance(member_doc, str):
                    yield inspect.cleandoc(member_doc)


def training_corpus(num_modules: int | None = None) -> list[str]:
    """The deterministic tokenizer-training corpus (a list of documents)."""
    docs: list[str] = []
    with warnings.catch_warnings():  # e.g. typing.io's DeprecationWarning on attribute access
        warnings.simplefilter("ignore")
        for module_name in _CORPUS_MODULES[:num_modules]:
            docs.extend(_docstrings(module_name))
    docs.extend([_MULTILINGUAL] * 3)  # repeated so common multi-byte sequences get merges
    return docs


# -------------------------------------------------------------------------- tokenizer


def train_tokenizer(arch: str, size: str) -> tuple[Tokenizer, dict[str, Any]]:
    """Train the byte-level BPE for `arch`/`size`; return it and its tokenizer_config."""
    family = _FAMILY[arch]
    tok = Tokenizer(models.BPE())
    if family.split_regex is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2 regex
    else:
        # Llama 3 / Qwen2 layout: split by the family's regex, then map bytes to symbols.
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(family.split_regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if family.nfc:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TOKENIZER_VOCAB[size],
        min_frequency=2,
        special_tokens=list(family.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = training_corpus(_TINY_CORPUS_MODULES if size == "tiny" else None)
    tok.train_from_iterator(corpus, trainer=trainer)

    post = [processors.ByteLevel(trim_offsets=False)]
    if family.add_bos_token:
        # What Llama 3's tokenizer.json does; pdserve's Tokenizer adds BOS itself instead
        # (tokenizing with add_special_tokens=False), Hugging Face relies on this.
        bos, bos_id = family.bos, tok.token_to_id(family.bos)
        post.append(
            processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, bos_id)])
        )
    tok.post_processor = processors.Sequence(post)

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": family.bos,
        "eos_token": family.eos,
        "add_bos_token": family.add_bos_token,
        "add_eos_token": False,
        "model_max_length": _SIZE_CONFIG[size]["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": family.chat_template,
    }
    if family.pad is not None:
        config["pad_token"] = family.pad
    return tok, config


# ----------------------------------------------------------------------------- config


def model_config(arch: str, size: str, tokenizer: Tokenizer, *, overrides: dict | None = None,
                 dtype: str = "float32", vocab_size: int | None = None) -> dict[str, Any]:
    """config.json for `arch`/`size`, `overrides` applied last."""
    family = _FAMILY[arch]
    shape = dict(_SIZE_CONFIG[size])
    tok_vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    vocab = vocab_size or _MODEL_VOCAB[size] or tok_vocab
    if vocab < tok_vocab:
        raise ValueError(f"vocab_size {vocab} is smaller than the tokenizer's {tok_vocab} tokens")
    if arch == "qwen3" and size == "tiny":
        shape["head_dim"] = _QWEN3_TINY_HEAD_DIM
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURE[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        **shape,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6 if arch.startswith("qwen") else 1e-5,
        "rope_theta": 1000000.0 if arch.startswith("qwen") else 10000.0,
        "rope_scaling": None,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
        "bos_token_id": tokenizer.token_to_id(family.config_bos),
        "eos_token_id": tokenizer.token_to_id(family.config_eos),
        "torch_dtype": dtype,
    }
    if arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    elif arch == "mistral":
        cfg.update(sliding_window=None)
    else:  # qwen2 / qwen3
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=shape["num_hidden_layers"])
        if arch == "qwen3":
            cfg.update(attention_bias=False)
    cfg.update(overrides or {})
    if "head_dim" not in cfg:
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    _check_config(cfg)
    return cfg


def _check_config(cfg: dict[str, Any]) -> None:
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    if cfg["head_dim"] % 2:
        raise ValueError(f"head_dim ({cfg['head_dim']}) must be even for rotary embeddings")


def param_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every parameter of the HF model described by `cfg`, by its exact HF name, in order."""
    arch = cfg["model_type"]
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q_out, kv_out = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    # As in HF: qwen2 always has q/k/v biases; llama and qwen3 bias q/k/v/o when
    # attention_bias; only llama has mlp_bias; mistral has no biases.
    attn_bias = arch in ("llama", "qwen3") and bool(cfg.get("attention_bias"))
    qkv_bias = arch == "qwen2" or attn_bias
    mlp_bias = arch == "llama" and bool(cfg.get("mlp_bias"))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        for name, out in (("q", q_out), ("k", kv_out), ("v", kv_out)):
            shapes[f"{p}.self_attn.{name}_proj.weight"] = (out, h)
            if qkv_bias:
                shapes[f"{p}.self_attn.{name}_proj.bias"] = (out,)
        shapes[f"{p}.self_attn.o_proj.weight"] = (h, q_out)
        if attn_bias:
            shapes[f"{p}.self_attn.o_proj.bias"] = (h,)
        if arch == "qwen3":
            shapes[f"{p}.self_attn.q_norm.weight"] = (d,)
            shapes[f"{p}.self_attn.k_norm.weight"] = (d,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
        shapes[f"{p}.mlp.gate_proj.weight"] = (inter, h)
        shapes[f"{p}.mlp.up_proj.weight"] = (inter, h)
        shapes[f"{p}.mlp.down_proj.weight"] = (h, inter)
        if mlp_bias:
            for name, out in (("gate", inter), ("up", inter), ("down", h)):
                shapes[f"{p}.mlp.{name}_proj.bias"] = (out,)
    shapes["model.norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    return shapes


def count_parameters(cfg: dict[str, Any]) -> int:
    """Parameter count from the config alone (tied embeddings counted once)."""
    return sum(math.prod(s) for s in param_shapes(cfg).values())


# ---------------------------------------------------------------------------- weights


def random_weights(cfg: dict[str, Any], seed: int, dtype: str) -> dict[str, torch.Tensor]:
    """Seeded random tensors for `param_shapes(cfg)`: matrices and biases N(0, 0.02),
    norm weights 1 + N(0, 0.05). Drawn in float32 in a fixed order, then cast."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in param_shapes(cfg).items():
        t = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            t = t.mul_(0.05).add_(1.0)
        else:
            t = t.mul_(0.02)
        out[name] = t.to(_DTYPES[dtype]).contiguous()
    return out


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def save_weights(tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int | None) -> None:
    """One model.safetensors, or shards of at most max_shard_bytes (a tensor larger than
    that gets a shard of its own) plus model.safetensors.index.json."""
    for stale in [*out_dir.glob("model*.safetensors"), out_dir / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    meta = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(tensors, str(out_dir / "model.safetensors"), metadata=meta)
        return
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name, t in tensors.items():
        size = _tensor_bytes(t)
        if shards[-1] and used + size > max_shard_bytes:
            shards.append({})
            used = 0
        shards[-1][name] = t
        used += size
    n = len(shards)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata=meta)
        weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": sum(_tensor_bytes(t) for t in tensors.values())}, "weight_map": weight_map}
    _write_json(out_dir / "model.safetensors.index.json", index)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------- public


def make_model(
    arch: str,
    size: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    overrides: dict | None = None,
    max_shard_bytes: int | None = None,
    dtype: str = "float32",
    vocab_size: int | None = None,
) -> Path:
    """Write a random-weight `arch` checkpoint of `size` into `out_dir`; return its Path.

    overrides: config.json keys applied on top (e.g. {"num_key_value_heads": 1,
        "tie_word_embeddings": True, "rope_scaling": {...}}); weight shapes follow them.
    max_shard_bytes: shard the weights (HF index format) instead of one file.
    dtype: storage dtype, "float32" | "bfloat16" | "float16".
    vocab_size: model vocabulary (>= the tokenizer's; default: the tokenizer's for tiny,
        32000 for small).
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {tuple(_DTYPES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer, tok_config = train_tokenizer(arch, size)
    cfg = model_config(arch, size, tokenizer, overrides=overrides, dtype=dtype, vocab_size=vocab_size)
    family = _FAMILY[arch]
    gen_eos = [tokenizer.token_to_id(t) for t in family.generation_eos]
    generation = {
        "bos_token_id": cfg["bos_token_id"],
        "eos_token_id": gen_eos if len(gen_eos) > 1 else gen_eos[0],
    }
    if family.pad is not None:
        generation["pad_token_id"] = tokenizer.token_to_id(family.pad)

    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tok_config)
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", generation)
    save_weights(random_weights(cfg, seed, dtype), out, max_shard_bytes)
    return out
