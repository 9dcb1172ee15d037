"""A request owns its tokens and its progress counter; nothing else.

Progress is counted in computed tokens, not phases: chunked prefill, prefix-cache
hits and KV received from a prefill worker all just advance `num_computed_tokens`.
Invariant while unfinished: 0 <= num_computed_tokens < num_tokens, i.e. there is
always at least one token whose KV is still to be computed (the last sampled one).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from cluster.engine.sampling_params import SamplingParams
from cluster.kv.hashing import BlockHash


class RequestStatus(enum.IntEnum):
    # Ordered: everything after PREEMPTED is finished.
    WAITING = 0
    WAITING_FOR_KV = 1  # blocks reserved; its prompt's KV is arriving from a prefill worker
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    cache_salt: str = ""
    hold_kv: bool = False  # on finish, keep the blocks until released (they are sent to a decode worker)
    stream_kv: bool = False  # its KV is sent as its chunks compute (SchedulerConfig.stream_kv_tail_tokens)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_cached_prompt_tokens: int = 0  # prefix-cache hit at (last) admission
    num_preemptions: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)  # of full blocks, filled lazily

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids in [start, end) across prompt and output without copying both."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def stop_status(self, max_model_len: int) -> RequestStatus | None:
        """Finish status implied by the last sampled token, or None to keep going."""
        num_out = len(self.output_token_ids)
        last = self.output_token_ids[-1]
        if num_out >= self.params.min_tokens:
            if last in self.params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if not self.params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if num_out >= self.params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
