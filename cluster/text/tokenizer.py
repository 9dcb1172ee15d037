"""Tokenization at the edge: `tokenizer.json` (the `tokenizers` library), chat templates
(jinja2, sandboxed), UTF-8-safe incremental detokenization and stop strings.

Three pieces, each small:

- `Tokenizer`: loads a Hugging Face model directory (`tokenizer.json` required,
  `tokenizer_config.json` optional) and encodes, decodes, renders chat templates.
- `IncrementalDetokenizer`: turns a growing list of output token ids into text deltas,
  never emitting half a UTF-8 character (vLLM / TGI "prefix offset / read offset").
- `StopChecker`: finds stop strings in the output text (also across token boundaries)
  and says how much of the text may be streamed to the client right now.

The gateway tokenizes with `Tokenizer`; the engine owns one `IncrementalDetokenizer`
and one `StopChecker` per request.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

REPLACEMENT_CHAR = "\ufffd"  # what a lossy UTF-8 decode yields for an incomplete character


class ChatTemplateError(ValueError):
    """The chat template refused the messages (its `raise_exception(...)` was called)."""


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a plain string or an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, dict):
        return value.get("content")
    return str(value)


def _pick_chat_template(value: Any) -> str | None:
    """`chat_template` is either a string or a list of {"name", "template"}; take "default"."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, dict) and entry.get("name") == "default":
                return entry.get("template")
    return None


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    # Like Hugging Face's override of jinja's tojson: no HTML escaping, unicode kept.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_chat_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """A model's tokenizer: `tokenizer.json` plus the few fields of `tokenizer_config.json`
    serving needs (special tokens, whether to prepend BOS, the chat template).

    BOS is added by this class, never by the `tokenizers` post-processor, so it can never
    be added twice. Chat-rendered prompts usually already contain BOS (the template writes
    `{{ bos_token }}`): tokenize them with `encode_chat`, or `encode(..., add_special_tokens=False)`.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
        model_max_length: int | None = None,
    ) -> None:
        self._tok = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        self.bos_token_id = self._lookup(bos_token)
        self.eos_token_id = self._lookup(eos_token)
        self.pad_token_id = self._lookup(pad_token)
        if add_bos_token and self.bos_token_id is None:
            raise ValueError(f"add_bos_token is set but bos_token {bos_token!r} is not in the vocabulary")
        special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        special |= {i for i in (self.bos_token_id, self.eos_token_id, self.pad_token_id) if i is not None}
        self.all_special_ids: frozenset[int] = frozenset(special)
        self._template: jinja2.Template | None = None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        """Load from a Hugging Face model directory.

        `tokenizer.json` is required. `tokenizer_config.json` is optional; if it does not
        say `add_bos_token`, BOS is prepended exactly when the tokenizer.json
        post-processor would add it (what Hugging Face does for e.g. Llama 3).
        A `chat_template.jinja` file is used when the config carries no template.
        """
        model_dir = Path(model_dir)
        tok_file = model_dir / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"tokenizer.json not found in model directory {str(model_dir)!r} "
                "(pdserve needs a fast-tokenizer file 'tokenizer.json')"
            )
        backend = tokenizers.Tokenizer.from_file(str(tok_file))
        cfg_file = model_dir / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}

        bos = _token_content(cfg.get("bos_token"))
        template = _pick_chat_template(cfg.get("chat_template"))
        jinja_file = model_dir / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        if "add_bos_token" in cfg:
            add_bos = bool(cfg["add_bos_token"])
        else:
            add_bos = _post_processor_adds(backend, bos)
        max_len = cfg.get("model_max_length")
        return cls(
            backend,
            bos_token=bos,
            eos_token=_token_content(cfg.get("eos_token")),
            pad_token=_token_content(cfg.get("pad_token")),
            add_bos_token=add_bos,
            chat_template=template,
            # HF writes a huge sentinel (1e30) for "no limit".
            model_max_length=int(max_len) if isinstance(max_len, (int, float)) and max_len < 1e18 else None,
        )

    def _lookup(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of tokens including added (special) tokens."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tok

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; BOS first when the model wants it and add_special_tokens.
        (Through encode_batch, which lets go of the GIL, as `encode` does not: a prompt
        tokenized on another thread leaves the event loop running. Same ids.)"""
        ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos_token:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render `messages` ([{"role", "content"}, ...]) with the model's chat template.

        `extra` (e.g. `tools=...`) is passed to the template as further variables.
        Raises ValueError if the model has no template, ChatTemplateError if the template
        rejects the messages.
        """
        if self.chat_template is None:
            raise ValueError("model has no chat template (tokenizer_config.json has no 'chat_template')")
        if self._template is None:
            self._template = _compile_chat_template(self.chat_template)
        return self._template.render(
            **extra,
            messages=messages,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            add_generation_prompt=add_generation_prompt,
        )

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> list[int]:
        """Render the chat template (`extra`: as apply_chat_template's) and tokenize it; the
        template supplies any BOS itself."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **extra), add_special_tokens=False)


def _post_processor_adds(backend: tokenizers.Tokenizer, bos: str | None) -> bool:
    """Does tokenizer.json's post-processor prepend `bos` (e.g. Llama 3's TemplateProcessing)?"""
    if bos is None or backend.token_to_id(bos) is None:
        return False
    with_special = backend.encode("a", add_special_tokens=True).ids
    without = backend.encode("a", add_special_tokens=False).ids
    return len(with_special) > len(without) and with_special[0] == backend.token_to_id(bos)


# Tokens decoded before the read offset to give the decoder context (leading spaces,
# SentencePiece "▁" handling). vLLM uses the same value.
_INITIAL_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Output ids -> text deltas, UTF-8 safe, O(window) per step.

    Offsets into `ids` (prompt then output tokens)::

        ids:  [ .... prompt .... | out0 out1 out2 out3 out4 ]
                          ^prefix_offset   ^read_offset      ^len(ids)
                          '-- context ---'-- not yet emitted -'

    Each step decodes `ids[prefix:read]` and `ids[prefix:]`; the difference is the new
    text. If it ends with U+FFFD the last token(s) hold only part of a multi-byte
    character: emit nothing and wait (offsets stay). Otherwise emit it and slide the
    window: prefix <- read, read <- len(ids). The window is a handful of tokens
    unless the model keeps producing incomplete bytes.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids)
        self.read_offset = len(self.ids)
        self.prefix_offset = max(0, self.read_offset - _INITIAL_CONTEXT_TOKENS)
        self._text = ""

    @property
    def text(self) -> str:
        """All output text emitted so far (prompt excluded)."""
        return self._text

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Append output tokens; return the newly finalised text ("" if held back)."""
        self.ids.extend(new_token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """End of stream: emit whatever is held back, even an incomplete character."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read_offset >= len(self.ids):
            return ""
        decode = self._tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset], self._skip)
        new_text = decode(self.ids[self.prefix_offset :], self._skip)
        if len(new_text) <= len(prefix_text):
            # Only skipped (special) tokens so far; keep them in the window.
            if final:
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return ""
        if new_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._text += delta
        return delta


@dataclass(frozen=True)
class StopOutcome:
    """Result of `StopChecker.process` for one engine step.

    text:    the output text, cut just before the stop string if one was found
    delta:   what to send to the client now (text[emitted_before:emitted])
    emitted: total characters of `text` the client has received after sending `delta`
    stopped: a stop string was found; the request finishes with finish_reason "stop"
    """

    text: str
    delta: str
    emitted: int
    stopped: bool


class StopChecker:
    """Stop strings over streamed text.

    Contract (the engine calls this after every append of detokenized text):

    - `find(text, emitted)`: index in `text` where the earliest stop string starts, or
      None. Only the tail `text[max(0, emitted - max_stop_len + 1):]` is searched, so a
      step costs O(new text + max_stop_len). Correct as long as `text[:emitted]` was
      already checked on earlier steps (it contains no complete stop string).
    - `safe_len(text, finished)`: how many leading characters may be sent to the client.
      While unfinished, the last `max_stop_len - 1` characters are held back: they could
      be the start of a stop string that completes on a later token. Once finished (or
      with no stop strings) everything is safe.
    - `process(text, emitted, finished)`: both of the above in one call; the stop string
      itself is never part of the returned text. If the caller emitted more than
      `safe_len` allowed, a stop string may start before `emitted`: `text` is still cut
      there and `delta` is empty (the client already saw its beginning).
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        if isinstance(stop, str):
            stop = (stop,)
        self.stop: tuple[str, ...] = tuple(s for s in stop if s)
        self.max_stop_len = max((len(s) for s in self.stop), default=0)

    def __bool__(self) -> bool:
        return bool(self.stop)

    def find(self, text: str, emitted: int) -> int | None:
        if not self.stop:
            return None
        start = max(0, emitted - self.max_stop_len + 1)
        best: int | None = None
        for s in self.stop:
            i = text.find(s, start)
            if i != -1 and (best is None or i < best):
                best = i
        return best

    def safe_len(self, text: str, finished: bool = False) -> int:
        if finished or not self.stop:
            return len(text)
        return max(0, len(text) - (self.max_stop_len - 1))

    def process(self, text: str, emitted: int, finished: bool = False) -> StopOutcome:
        stop_at = self.find(text, emitted)
        if stop_at is not None:
            text = text[:stop_at]
            end = len(text)
        else:
            end = self.safe_len(text, finished)
        delta = text[emitted:end] if end > emitted else ""
        return StopOutcome(text=text, delta=delta, emitted=max(emitted, end), stopped=stop_at is not None)
