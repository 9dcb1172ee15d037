"""How much prompt work a step may take while requests decode, so that decodes stall by
at most a bounded factor when long prompts join the batch (chunked prefill's knob).

    decode-only step   costs D seconds   (learned: exponential average of such steps)
    prompt work        costs c seconds per token (learned from steps that carry it)
    a step with decodes gets at most (max_step_slowdown - 1) x D / c prompt tokens,
    at least `floor` (prompts always progress), at most the step's token budget

With nothing decoding the whole token budget goes to prompts (throughput). Costs are
measured online from the engine's own steps, so the same rule fits a CPU core or a GPU,
a small model or a large one. Until both costs are known, the budget is the maximum.
"""

from __future__ import annotations

EMA = 0.2  # weight of the newest step in the averages
MIN_PROMPT_CHUNK = 32  # prompt tokens a step may always carry, so prompts keep progressing


class StepBudget:
    def __init__(self, max_tokens: int, max_step_slowdown: float, floor: int):
        self.max_tokens = max_tokens
        self.max_step_slowdown = max_step_slowdown
        self.floor = min(floor, max_tokens)
        self.decode_step_s: float | None = None
        self.prompt_token_s: float | None = None

    def prompt_tokens(self, num_decoding: int) -> int:
        """Prompt tokens the next step may compute, given how many requests decode in it."""
        if num_decoding == 0 or self.max_step_slowdown <= 0 or self.decode_step_s is None or not self.prompt_token_s:
            return self.max_tokens
        allowed = (self.max_step_slowdown - 1.0) * self.decode_step_s / self.prompt_token_s
        return max(self.floor, min(self.max_tokens, int(allowed)))

    def observe(self, num_decode_tokens: int, num_prompt_tokens: int, seconds: float) -> None:
        """Learn from one step: how many decode and prompt tokens it ran, and how long it took."""
        if num_prompt_tokens == 0:
            if num_decode_tokens:
                self.decode_step_s = _average(self.decode_step_s, seconds)
            return
        base = self.decode_step_s if num_decode_tokens and self.decode_step_s is not None else 0.0
        per_token = max(seconds - base, 0.0) / num_prompt_tokens
        self.prompt_token_s = _average(self.prompt_token_s, per_token)


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new
