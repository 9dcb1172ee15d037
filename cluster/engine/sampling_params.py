"""Per-request sampling and stopping parameters, validated once at the edge."""

from __future__ import annotations

from dataclasses import dataclass


class InvalidRequestError(ValueError):
    """A request the engine refuses before doing any work on it (maps to HTTP 400)."""


@dataclass(frozen=True)
class SamplingParams:
    """What to sample and when to stop. Defaults are OpenAI's / vLLM's.

    temperature == 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable
    those filters. Penalties follow vLLM: repetition_penalty (1 = off) acts on prompt
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

    def __post_init__(self) -> None:
        # Normalise list inputs so params stay hashable and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidRequestError(msg)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not 0.0 <= self.temperature <= 100.0:
            bad(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            bad(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad(f"logprobs must be in [0, 20], got {self.logprobs!r}")
        if any(not s for s in self.stop):
            bad("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative")
