"""How much prompt work a step may take while requests decode, so that decodes stall by
at most a bounded factor when long prompts join the batch (chunked prefill's knob).

    decode-only step   takes D seconds   (learned: average of such steps)
    prompt work        takes c seconds per token, next to decodes (learned from the
                       steps that carry both, net of D; from prompt-only steps until one
                       such step is seen)
    a step with decodes gets at most (max_step_slowdown - 1) x D / c prompt tokens,
    at least `floor` (SchedulerConfig.min_prompt_chunk: prompts always progress; a
    disaggregated decode tier's is 1, so that its cap holds), at most the step's token budget

Prompt work is dearer per token next to decodes and late in a long prompt (each chunk
attends to all of the prompt before it), so c is learned from exactly those steps and
follows them as they change. With nothing decoding, the whole token budget goes to
prompts (throughput). Measured online from the engine's own steps, the rule fits a CPU
core or a GPU, a small model or a large one. Until D and c are known: the whole budget.
"""

from __future__ import annotations

EMA = 0.3  # weight of the newest step in the averages: follows a long prompt as it grows


class StepBudget:
    def __init__(self, max_tokens: int, max_step_slowdown: float, floor: int):
        self.max_tokens = max_tokens
        self.max_step_slowdown = max_step_slowdown
        self.floor = min(floor, max_tokens)
        self.decode_step_s: float | None = None
        self.prompt_token_s: float | None = None  # next to decodes
        self.alone_prompt_token_s: float | None = None  # in steps without decodes

    def prompt_tokens(self, num_decoding: int) -> int:
        """Prompt tokens the next step may compute, given how many requests decode in it."""
        per_token = self.prompt_token_s or self.alone_prompt_token_s
        if num_decoding == 0 or self.max_step_slowdown <= 0 or self.decode_step_s is None or not per_token:
            return self.max_tokens
        allowed = (self.max_step_slowdown - 1.0) * self.decode_step_s / per_token
        return max(self.floor, min(self.max_tokens, int(allowed)))

    def observe(self, num_decode_tokens: int, num_prompt_tokens: int, seconds: float) -> None:
        """Learn from one step: how many decode and prompt tokens it ran, and how long it took."""
        if num_prompt_tokens == 0:
            if num_decode_tokens:
                self.decode_step_s = _average(self.decode_step_s, seconds)
        elif num_decode_tokens == 0:
            self.alone_prompt_token_s = _average(self.alone_prompt_token_s, seconds / num_prompt_tokens)
        elif self.decode_step_s is not None:
            per_token = max(seconds - self.decode_step_s, 0.0) / num_prompt_tokens
            self.prompt_token_s = _average(self.prompt_token_s, per_token)


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new
