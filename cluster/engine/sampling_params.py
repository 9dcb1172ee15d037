"""Per-request sampling and stopping parameters, validated once at the edge."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cluster.engine.structured_outputs import StructuredOutputs
from cluster.errors import InvalidRequestError


@dataclass(frozen=True)
class Limit:
    """A numeric range a request field must lie in. Declared once (LIMITS): the engine
    checks it, the HTTP schema publishes it, and both APIs refuse with its message."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low itself is refused
    integer: bool = False
    note: str = ""

    def contains(self, value) -> bool:
        if self.integer and (not isinstance(value, int) or isinstance(value, bool)):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high

    def message(self, name: str, value) -> str:
        kind = "an integer " if self.integer else ""
        if self.high is None:
            where = f"{'>' if self.low_open else '>='} {self.low:g}"
        else:
            where = f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"
        return f"{name} must be {kind}{where}{self.note}, got {value!r}"

    def bounds(self) -> dict:
        """pydantic Field keywords (ge/gt/le) for the published schema."""
        out = {"gt" if self.low_open else "ge": self.low} if self.low is not None else {}
        return out | ({"le": self.high} if self.high is not None else {})


LIMITS = {
    "max_tokens": Limit(1, integer=True),
    "min_tokens": Limit(0, integer=True),
    "temperature": Limit(0, 2, note=" (0 is greedy)"),
    "top_p": Limit(0, 1, low_open=True),
    "top_k": Limit(-1, integer=True, note=" (0 or -1 disables it)"),
    "min_p": Limit(0, 1),
    "repetition_penalty": Limit(0, 2, low_open=True),
    "presence_penalty": Limit(-2, 2),
    "frequency_penalty": Limit(-2, 2),
    "logprobs": Limit(0, 20, integer=True),
    "n": Limit(1, 16, integer=True),  # choices per prompt (the HTTP API's `n`)
}
MAX_STOP_STRINGS = 16
GREEDY_BELOW = 1e-5  # a temperature under this samples greedily (vLLM's _SAMPLING_EPS)


@dataclass(frozen=True)
class SamplingParams:
    """What to sample and when to stop. Defaults are OpenAI's / vLLM's.

    temperature == 0 means greedy, as does any below GREEDY_BELOW (vLLM's rule: 1/T of a
    tiny T overflows, and the sampler's weights would turn NaN). top_k <= 0 and top_p == 1
    and min_p == 0 disable those filters. Penalties follow vLLM: repetition_penalty (1 = off) acts on prompt
    and output tokens; presence/frequency penalties (0 = off) on output tokens only.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return with each token
    skip_special_tokens: bool = True
    # What the output must match. Only its size is checked here: compiling it costs up to tens
    # of ms, so the edge validates it off its event loop (StructuredOutputs.validate).
    structured: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        # Normalise list inputs so params stay hashable and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self.validate()
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_first_token(self, num_generated: int = 0) -> SamplingParams:
        """What a prefill worker samples the request's next token with (its first, or the
        first after `num_generated` already streamed, for a migrated request): one token,
        under the same bans (min_tokens keeps stop tokens out of it); stop strings are the
        decode side's."""
        n = num_generated + 1
        return dataclasses.replace(self, max_tokens=n, min_tokens=min(self.min_tokens, n), stop=())

    def validate(self) -> None:
        for name, limit in LIMITS.items():
            value = getattr(self, name, None)
            if value is not None and not limit.contains(value):
                raise InvalidRequestError(limit.message(name, value), param=name)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})", "min_tokens")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63):
            raise InvalidRequestError(f"seed must be a 64-bit integer, got {self.seed!r}", "seed")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings are supported", "stop")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty", "stop")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative", "stop_token_ids")
