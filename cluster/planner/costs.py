"""What an engine's steps cost, fitted online from its own step timeline (no offline profile).

    decode-only step   t = decode_base + decode_per_seq * running
    step with prompts  t = prompt_base + prompt_per_token * prompt_tokens
                           + prompt_attention * prompt_context + decode_per_seq * running

prompt_context: over the step's prompt chunks, tokens x their mean position. A prompt of
L tokens has L^2 / 2 of it in all, whatever its chunks: attention makes a prompt cost more
than its length says (the built-in model on one Zen 4 core: 2.7 ms a token at the start
of a prompt, 4.9 ms at 1-2k). t is the step's whole iteration: the step and the engine
thread's work before it while requests ran (StepRecord.between_s: outputs handed out,
requests added), which every token gap holds too.

Each replica fits its engine (`StepCostModel.observe`, from `Engine.timeline`) and reports
the coefficients through Serve's autoscaling metrics; the planner combines a tier's
replicas (`EngineCosts.from_reports`). Old steps fade (a half-life in steps), so the fit follows
an engine whose costs move (longer contexts, a neighbour on its memory bus).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, fields

import numpy as np

from cluster.engine.step_timeline import StepRecord

HALF_LIFE_STEPS = 2000
CONTEXT_SCALE = 1000.0  # prompt context is fitted in thousands (features of like size solve better)
MIN_SAMPLES = 8  # effective (decayed) samples before a fit is reported (a prefill engine batches prompts: few steps)


class DecayingFit:
    """Least squares y ~ x @ w with non-negative w, each sample's weight halving every
    `half_life` samples. Keeps only the normal equations' sums: O(features^2) memory."""

    def __init__(self, num_features: int, half_life: float = HALF_LIFE_STEPS):
        self.decay = 0.5 ** (1.0 / half_life)
        self.xtx = np.zeros((num_features, num_features))
        self.xty = np.zeros(num_features)
        self.samples = 0.0  # the decayed count

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        """Rows `x` (samples x features) with targets `y`, oldest first."""
        n = len(y)
        if n == 0:
            return
        weights = self.decay ** np.arange(n - 1, -1, -1, dtype=float)
        keep = self.decay**n
        self.xtx = self.xtx * keep + (x * weights[:, None]).T @ x
        self.xty = self.xty * keep + (x * weights[:, None]).T @ y
        self.samples = self.samples * keep + float(weights.sum())

    def coefficients(self) -> np.ndarray | None:
        """The fit, or None before MIN_SAMPLES. A feature whose unconstrained coefficient
        comes out negative (a cost cannot be; too little spread in it so far) is dropped
        and the rest refitted."""
        if self.samples < MIN_SAMPLES:
            return None
        active = list(range(len(self.xty)))
        while active:
            a = self.xtx[np.ix_(active, active)]
            # A small ridge: a feature that never varied (one batch size so far) stays near 0.
            w = np.linalg.solve(a + 1e-9 * np.trace(a) * np.eye(len(active)), self.xty[active])
            if (w >= 0).all():
                out = np.zeros(len(self.xty))
                out[active] = w
                return out
            active.pop(int(np.argmin(w)))
        return np.zeros(len(self.xty))


@dataclass(frozen=True)
class EngineCosts:
    """One engine's step costs (seconds); `chunk_tokens`: its prompt tokens per step."""

    decode_base_s: float
    decode_per_seq_s: float
    prompt_base_s: float
    prompt_per_token_s: float
    chunk_tokens: int
    prompt_attention_s: float = 0.0  # per token per position before it

    def decode_step_s(self, running: float) -> float:
        return self.decode_base_s + self.decode_per_seq_s * running

    def prefill_s(self, prompt_tokens: float) -> float:
        """A prompt's compute alone on the engine, in chunks of `chunk_tokens`."""
        if prompt_tokens <= 0:
            return 0.0
        return (math.ceil(prompt_tokens / self.chunk_tokens) * self.prompt_base_s + self.prompt_per_token_s * prompt_tokens
                + self.prompt_attention_s * prompt_tokens**2 / 2)

    def chunk_s(self, tokens: int, context: float, running: int = 0) -> float:
        """A step of `tokens` prompt tokens whose tokens x mean position is `context`,
        beside `running` decoding requests."""
        return (self.prompt_base_s + self.prompt_per_token_s * tokens + self.prompt_attention_s * context
                + self.decode_per_seq_s * running)

    @staticmethod
    def from_reports(preferred: Iterable[Mapping[str, float]], fallback: Iterable[Mapping[str, float]] = ()) -> EngineCosts | None:
        """A tier's costs from its replicas' reports (`StepCostModel.report`): each term the
        median over the replicas that fitted it (one slow replica does not move it), from
        `fallback` (the other tier: same model, same hardware) where none of `preferred` has
        (a disaggregated decode tier never computes prompts). None while a term is unknown."""
        preferred, fallback = list(preferred), list(fallback)
        values = {}
        for f in fields(EngineCosts):
            for reports in (preferred, fallback):
                known = [r[f.name] for r in reports if f.name in r]
                if known:
                    values[f.name] = float(np.median(known))
                    break
            else:
                if f.default is MISSING:  # (a term with a default: a replica from before it)
                    return None
        return EngineCosts(**{**values, "chunk_tokens": max(1, round(values["chunk_tokens"]))})


class StepCostModel:
    """A replica's engine costs, fitted from the step records it sees (each once)."""

    def __init__(self, chunk_tokens: int, half_life: float = HALF_LIFE_STEPS):
        self.chunk_tokens = chunk_tokens
        self.decode = DecayingFit(2, half_life)  # [1, running]
        self.prompt = DecayingFit(4, half_life)  # [1, prompt tokens, prompt context / CONTEXT_SCALE, running]

    def observe(self, steps: Iterable[StepRecord]) -> None:
        decode_rows, prompt_rows = [], []
        for s in steps:
            if s.prompt:
                prompt_rows.append((1.0, s.prompt, s.prompt_context / CONTEXT_SCALE, s.decode, s.step_s + s.between_s))
            elif s.decode:
                decode_rows.append((1.0, s.decode, s.step_s + s.between_s))
        if decode_rows:
            d = np.array(decode_rows)
            self.decode.add(d[:, :2], d[:, 2])
        if prompt_rows:
            p = np.array(prompt_rows)
            self.prompt.add(p[:, :4], p[:, 4])

    def report(self) -> dict[str, float]:
        """The terms fitted so far: decode ones once decode-only steps were seen often
        enough, prompt ones once steps with prompts were (a disaggregated tier sees one kind)."""
        out: dict[str, float] = {}
        d, p = self.decode.coefficients(), self.prompt.coefficients()
        if d is not None:
            out.update(decode_base_s=d[0], decode_per_seq_s=d[1])
        if p is not None:
            out.update(prompt_base_s=p[0], prompt_per_token_s=p[1], prompt_attention_s=p[2] / CONTEXT_SCALE,
                       chunk_tokens=self.chunk_tokens)
        return {k: float(v) for k, v in out.items()}
