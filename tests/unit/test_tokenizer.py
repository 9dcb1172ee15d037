"""cluster/text/tokenizer.py against tiny checkpoints made by make_model (no downloads)."""

from __future__ import annotations

import json
import shutil

import jinja2.exceptions
import pytest

from cluster.testing.random_checkpoint import ARCHS, make_model
from cluster.text.tokenizer import (
    REPLACEMENT_CHAR,
    ChatTemplateError,
    IncrementalDetokenizer,
    StopChecker,
    Tokenizer,
)

MULTIBYTE = [
    "Crème brûlée, naïve façade, Größe, ¿Dónde está?",
    "你好，世界！机器学习。東京は日本の首都です。안녕하세요",
    "Emoji: 😀🚀🔥 👋🏽 👨‍👩‍👧‍👦 🇫🇷 — done ✅",
    "Mixed 42 + π ≈ 3.14159; привет мир 🐍 def f(x): return x",
]
ASCII = ["Hello, world!", "The quick brown fox jumps over the lazy dog.", "  two  spaces\n\nnewlines\ttabs  "]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok_models")
    return {arch: make_model(arch, "tiny", root / arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def toks(model_dirs):
    return {arch: Tokenizer.from_pretrained(d) for arch, d in model_dirs.items()}


@pytest.fixture(scope="module")
def llama(toks):
    return toks["llama"]


# ------------------------------------------------------------------ encode / decode


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip(toks, arch):
    tok = toks[arch]
    for text in ASCII + MULTIBYTE:
        ids = tok.encode(text, add_special_tokens=False)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
        # With BOS (llama / mistral) the special token is skipped on decode.
        assert tok.decode(tok.encode(text)) == text


def test_bos_added_once_only_when_configured(toks):
    for arch in ("llama", "mistral"):
        tok = toks[arch]
        assert tok.add_bos_token and tok.bos_token_id is not None
        ids = tok.encode("hello there")
        assert ids[0] == tok.bos_token_id
        assert ids.count(tok.bos_token_id) == 1  # the post-processor does not add a second one
        assert ids[1:] == tok.encode("hello there", add_special_tokens=False)
        assert tok.encode("", add_special_tokens=True) == [tok.bos_token_id]
    for arch in ("qwen2", "qwen3"):
        tok = toks[arch]
        assert not tok.add_bos_token and tok.bos_token_id is None
        assert tok.encode("hello there") == tok.encode("hello there", add_special_tokens=False)


def test_special_tokens_and_vocab(model_dirs, toks):
    llama = toks["llama"]
    cfg = json.loads((model_dirs["llama"] / "config.json").read_text())
    assert llama.vocab_size == cfg["vocab_size"]
    assert llama.eos_token_id == llama.token_to_id("<|eot_id|>")
    assert llama.bos_token_id == llama.token_to_id("<|begin_of_text|>")
    for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"):
        assert llama.token_to_id(t) in llama.all_special_ids
    assert toks["qwen3"].eos_token_id == toks["qwen3"].token_to_id("<|im_end|>")
    assert toks["qwen3"].pad_token_id == toks["qwen3"].token_to_id("<|endoftext|>")
    # Special tokens in text are matched as single ids; skipped or kept on decode.
    ids = llama.encode("hi<|eot_id|>", add_special_tokens=False)
    assert ids[-1] == llama.eos_token_id
    assert llama.decode(ids) == "hi"
    assert llama.decode(ids, skip_special_tokens=False) == "hi<|eot_id|>"
    assert llama.id_to_token(llama.eos_token_id) == "<|eot_id|>"


def test_decode_ignores_ids_beyond_the_tokenizer(llama):
    # A model vocab may be larger than the tokenizer's; such ids must not crash decode.
    hi = llama.encode("hi", add_special_tokens=False)
    assert llama.decode(hi + [llama.vocab_size + 1000]) == "hi"


# ------------------------------------------------------------------ detokenizer


def _splits_characters(tok: Tokenizer, ids: list[int]) -> bool:
    """Precondition for the detokenizer tests: some character spans several tokens."""
    return any(REPLACEMENT_CHAR in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_detokenizer_never_emits_broken_utf8(toks, arch, chunk):
    tok = toks[arch]
    prompt_ids = tok.encode("Translate: ")
    for text in MULTIBYTE:
        out_ids = tok.encode(text, add_special_tokens=False)
        assert _splits_characters(tok, out_ids), text
        detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=True)
        deltas = []
        for k in range(0, len(out_ids), chunk):
            delta = detok.step(out_ids[k : k + chunk])
            assert REPLACEMENT_CHAR not in delta
            deltas.append(delta)
        deltas.append(detok.flush())
        assert "".join(deltas) == tok.decode(out_ids) == text
        assert detok.text == text
        assert detok.flush() == ""


def test_detokenizer_holds_back_then_completes(llama):
    ids = llama.encode("🚀", add_special_tokens=False)
    assert len(ids) >= 2
    detok = IncrementalDetokenizer(llama, [])
    for i in ids[:-1]:
        assert detok.step([i]) == ""
    assert detok.step(ids[-1:]) == "🚀"


def test_detokenizer_flush_emits_incomplete_tail(llama):
    ids = llama.encode("ok 🚀", add_special_tokens=False)
    detok = IncrementalDetokenizer(llama, llama.encode("x"))
    out = "".join(detok.step([i]) for i in ids[:-1])
    assert out == "ok "
    tail = detok.flush()
    assert tail.endswith(REPLACEMENT_CHAR)
    assert detok.text == "ok " + tail


def test_detokenizer_cost_per_step_is_a_window(llama):
    calls: list[int] = []
    real_decode = llama.decode

    class Spy:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return real_decode(ids, skip_special_tokens)

    text = " ".join(MULTIBYTE * 6)
    out_ids = llama.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(Spy(), llama.encode("prompt " * 50))
    deltas = [detok.step([i]) for i in out_ids] + [detok.flush()]
    assert "".join(deltas) == text
    assert len(out_ids) > 200
    assert max(calls) <= 12  # a few context tokens + one incomplete character, never the sequence


def test_detokenizer_special_tokens(llama):
    out = llama.encode("done<|eot_id|>", add_special_tokens=False)
    skip = IncrementalDetokenizer(llama, [], skip_special_tokens=True)
    keep = IncrementalDetokenizer(llama, [], skip_special_tokens=False)
    assert "".join(skip.step([i]) for i in out) + skip.flush() == "done"
    assert "".join(keep.step([i]) for i in out) + keep.flush() == "done<|eot_id|>"


# ------------------------------------------------------------------ stop strings


def _stream(tok: Tokenizer, out_ids: list[int], stop: list[str]) -> tuple[str, list[str], bool]:
    """The engine loop: detokenize, append, check stop, emit safe text only."""
    detok = IncrementalDetokenizer(tok, tok.encode("Q: "))
    checker = StopChecker(stop)
    text, emitted, sent = "", 0, []
    for n, i in enumerate(out_ids):
        text += detok.step([i])
        finished = n == len(out_ids) - 1
        if finished:
            text += detok.flush()
        res = checker.process(text, emitted, finished)
        text, emitted = res.text, res.emitted
        if res.delta:
            sent.append(res.delta)
        if res.stopped:
            return text, sent, True
    return text, sent, False


def test_stop_string_spanning_tokens_is_cut(llama):
    full = "The answer is 42. END of answer, more text"
    out_ids = llama.encode(full, add_special_tokens=False)
    stop = ". END"
    # The stop string really spans token boundaries.
    pieces = [llama.decode([i]) for i in out_ids]
    assert stop not in pieces and not any(stop in p for p in pieces)
    text, sent, stopped = _stream(llama, out_ids, [stop, "never"])
    assert stopped
    assert text == "The answer is 42"
    assert "".join(sent) == text  # nothing of the stop string ever reached the client


def test_stop_string_with_multibyte_text(llama):
    full = "Voilà 😀 la fin 🚀 suite"
    out_ids = llama.encode(full, add_special_tokens=False)
    text, sent, stopped = _stream(llama, out_ids, ["🚀"])
    assert stopped and text == "Voilà 😀 la fin "
    assert "".join(sent) == text


def test_no_stop_emits_everything_at_the_end(llama):
    full = "nothing to stop here, ENDING soon"
    out_ids = llama.encode(full, add_special_tokens=False)
    text, sent, stopped = _stream(llama, out_ids, ["ENDX"])
    assert not stopped
    assert text == full and "".join(sent) == full


def test_stop_checker_contract():
    c = StopChecker(["abc", "xyz1"])
    assert c.max_stop_len == 4
    # Earliest occurrence wins, wherever each stop string is in the list.
    assert c.find("..xyz1..abc", 0) == 2
    assert c.find("no stop", 0) is None
    # Only the tail from emitted - max_len + 1 is searched.
    assert c.find("abc" + "-" * 10, emitted=10) is None
    assert c.find("-" * 8 + "xyz1", emitted=9) == 8
    # Hold back max_len - 1 characters until finished.
    assert c.safe_len("0123456789") == 7
    assert c.safe_len("0123456789", finished=True) == 10
    assert c.safe_len("ab") == 0
    r = c.process("hello ab", emitted=0)
    assert (r.delta, r.emitted, r.stopped) == ("hello", 5, False)
    r = c.process("hello abc tail", emitted=5)
    assert (r.text, r.delta, r.emitted, r.stopped) == ("hello ", " ", 6, True)
    # No stop strings: nothing is held back or searched.
    none = StopChecker([])
    assert not none and none.find("abc", 0) is None and none.safe_len("abc") == 3
    assert StopChecker("abc").stop == ("abc",)


# ------------------------------------------------------------------ chat templates

MSGS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi 😀"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Again?"},
]


def test_chat_template_llama(toks):
    tok = toks["llama"]
    out = tok.apply_chat_template(MSGS)
    assert out == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi 😀<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAgain?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    no_gen = tok.apply_chat_template(MSGS, add_generation_prompt=False)
    assert out == no_gen + "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ids = tok.encode_chat(MSGS)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert tok.token_to_id("<|start_header_id|>") in ids


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_chat_template_chatml(toks, arch):
    out = toks[arch].apply_chat_template(MSGS[:2])
    assert out == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 😀<|im_end|>\n<|im_start|>assistant\n"
    assert toks[arch].apply_chat_template(MSGS[:2], add_generation_prompt=False) == out.removesuffix(
        "<|im_start|>assistant\n"
    )


def test_chat_template_mistral(toks):
    tok = toks["mistral"]
    out = tok.apply_chat_template(MSGS)
    assert out == "<s>[INST] Be brief.\n\nHi 😀 [/INST]Hello.</s>[INST] Again? [/INST]"
    with pytest.raises(ChatTemplateError, match="alternate"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


# ------------------------------------------------------------------ loading


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json") as err:
        Tokenizer.from_pretrained(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_config_variants(model_dirs, tmp_path):
    """AddedToken dicts, a chat_template list, and add_bos_token absent from the config."""
    shutil.copy(model_dirs["llama"] / "tokenizer.json", tmp_path / "tokenizer.json")
    # tokenizer.json alone: no config, no special tokens, no template.
    bare = Tokenizer.from_pretrained(tmp_path)
    assert bare.bos_token_id is None and bare.eos_token_id is None and not bare.add_bos_token
    with pytest.raises(ValueError, match="model has no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])

    cfg = {
        "bos_token": {"content": "<|begin_of_text|>", "special": True},
        "eos_token": {"content": "<|end_of_text|>", "lstrip": False},
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS"},
            # Newlines after tags and indentation before them vanish (trim_blocks, lstrip_blocks).
            {"name": "default", "template": "{% for m in messages %}\n    {% if m %}{{ m['content'] }}|{% endif %}\n{% endfor %}\n"},
        ],
        "model_max_length": 1000000000000000019884624838656,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.bos_token_id == tok.token_to_id("<|begin_of_text|>")
    assert tok.eos_token_id == tok.token_to_id("<|end_of_text|>")
    assert tok.model_max_length is None
    assert tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a|b|"
    # add_bos_token absent: follows what tokenizer.json's post-processor does (Llama 3 style).
    assert tok.add_bos_token and tok.encode("x").count(tok.bos_token_id) == 1

    cfg["add_bos_token"] = False
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_pretrained(tmp_path).encode("x") == tok.encode("x", add_special_tokens=False)


def test_sandboxed_template(model_dirs, tmp_path):
    shutil.copy(model_dirs["qwen2"] / "tokenizer.json", tmp_path / "tokenizer.json")
    cfg = {"chat_template": "{{ messages.append(1) }}{{ raise_exception('nope') }}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_pretrained(tmp_path)

    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ raise_exception('nope') }}"}))
    with pytest.raises(ChatTemplateError, match="nope"):
        Tokenizer.from_pretrained(tmp_path).apply_chat_template([])
