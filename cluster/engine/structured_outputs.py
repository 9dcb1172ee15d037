"""What a request's output must match: a JSON schema, any JSON object, a regex, one of some
strings, or a Lark grammar (vLLM's `structured_outputs` kinds; OpenAI's `response_format`
maps onto the first two). Plain data, torch-free: the gateway makes and validates it, the
messages carry it with the request's SamplingParams, and each engine compiles it
(cluster/engine/grammar.py). The grammar library is llguidance (README: Structured outputs,
why).

JSON is generated compactly, with json.dumps' separators (", " and ": ") and no other
whitespace: a grammar that allowed any whitespace between tokens would let a small model
spend its whole max_tokens on newlines before the first key.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import llguidance

from cluster.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar's source; beyond it: 400
MAX_CHOICES = 256
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# What compiling one grammar may cost an engine (llguidance's own fuel and size limits):
# a grammar past them is refused at the edge, before anything is scheduled.
LIMITS = llguidance.LLParserLimits(max_grammar_size=200_000, initial_lexer_fuel=1_000_000, verbose_errors=False)


@dataclass(frozen=True)
class StructuredOutputs:
    """One constraint. `spec`: the JSON schema (a JSON string) for json, the regex,
    the Lark grammar; "" for json_object; `choices` for choice."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind not in KINDS:
            raise InvalidRequestError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidRequestError(f"the {self.kind} constraint is {len(self.spec)} characters; the limit is {MAX_SPEC_CHARS}")
        if self.kind == "choice":
            if not self.choices or len(self.choices) > MAX_CHOICES or not all(isinstance(c, str) and c for c in self.choices):
                raise InvalidRequestError(f"choice must be 1 to {MAX_CHOICES} non-empty strings")
            if sum(map(len, self.choices)) > MAX_SPEC_CHARS:
                raise InvalidRequestError(f"the choices are over {MAX_SPEC_CHARS} characters")

    @classmethod
    def json_schema(cls, schema: dict | str) -> StructuredOutputs:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise InvalidRequestError(f"the JSON schema is not JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise InvalidRequestError("a JSON schema must be an object")
        return cls("json", json.dumps(schema, separators=(",", ":")))  # property order kept: it is the output's

    def grammar(self) -> str:
        """The llguidance grammar (its JSON form); the compiled grammar's cache key."""
        return _grammar(self)

    def validate(self) -> None:
        """InvalidRequestError naming what is wrong, if the grammar cannot be compiled."""
        error = _validation_error(self.grammar())
        if error:
            raise InvalidRequestError(f"invalid {self.kind} constraint: {error}")


@functools.lru_cache(maxsize=512)
def _grammar(so: StructuredOutputs) -> str:
    if so.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(so.spec, overrides=JSON_OPTIONS)
    if so.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if so.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(so.spec)
    if so.kind == "choice":
        alternatives = " | ".join(json.dumps(c) for c in so.choices)  # Lark's string literals are JSON's
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    return llguidance.LLMatcher.grammar_from_lark(so.spec)


@functools.lru_cache(maxsize=512)
def _validation_error(grammar: str) -> str:
    """"" if valid, else the library's message (cached: a request's parameters are
    validated where they are made and again in every process that rebuilds them)."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None, limits=LIMITS)
    return messages[0].strip() if is_error else ""
