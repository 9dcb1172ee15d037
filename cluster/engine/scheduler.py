"""Continuous batching under a token budget, FCFS, preemption by recompute.

`schedule()` returns plain data: how many tokens each request computes this step.
`update_from_output()` applies what the model produced. Neither touches a model,
so both are tested without one.

One step:
  1. Running requests, in admission order, each get
     min(tokens left to compute, remaining budget) tokens; a prompt chunk leaves one
     token to each decode after it, so no decode skips a step behind a long prompt.
     Prompts in progress leave room (up to half of the step's prompt tokens) to the
     waiting prompts that are shorter than what they have left, so a short prompt
     starts in the next step instead of after a long one's last chunk. If blocks run
     out, the most recently admitted running request is preempted (blocks freed,
     progress reset to zero, put back at the front of the waiting queue) until it fits.
  2. If nothing was preempted, waiting requests are admitted in FCFS order while
     budget, `max_num_seqs` and blocks allow, starting from their cached prefix. One
     whose next block a prompt in progress is computing waits for it (a burst of one
     prefix computes it once, then each request its own suffix); those behind go on.
A request whose prompt is longer than the remaining budget is prefilled in chunks
across steps, interleaved with the decodes of other requests.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from cluster.config import SchedulerConfig
from cluster.engine.kv_cache_manager import KVCacheManager, num_reusable_blocks
from cluster.engine.request import Request, RequestStatus
from cluster.kv.hashing import BlockHash


@dataclass(frozen=True)
class ScheduledChunk:
    """What the model runner needs for one request this step."""

    request_id: str
    token_ids: list[int]  # tokens whose KV this step computes
    start_pos: int  # position of token_ids[0] == num_computed_tokens before the step
    block_ids: list[int]  # the request's whole block table
    sample: bool  # chunk reaches the last known token: sample the next one


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    chunks: list[ScheduledChunk] = field(default_factory=list)
    new_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class RequestUpdate:
    """A request's progress after one step: new tokens and, if it ended, why."""

    request_id: str
    new_token_ids: list[int]
    status: RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int):
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.receiving: dict[str, Request] = {}  # WAITING_FOR_KV: blocks reserved, KV in flight
        self.held: dict[str, Request] = {}  # finished, blocks kept until released (hold_kv)
        self.prefix_query_tokens = 0  # prompt tokens of admitted requests ...
        self.prefix_hit_tokens = 0  # ... and those found in the prefix cache

    # ---- queue management ------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request (abort, or a stop string found by the output processor)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_KV:
            del self.receiving[request_id]
        else:
            self.waiting.remove(request)
        request.status = status
        if request.hold_kv and status != RequestStatus.FINISHED_ABORTED:
            self.held[request_id] = request
        else:
            self.kv.free(request)
        return request

    def release_held(self, request_id: str) -> bool:
        """Free the blocks of a finished hold_kv request (its KV was sent, or never will be)."""
        request = self.held.pop(request_id, None)
        if request is not None:
            self.kv.free(request)
        return request is not None

    def _count_prefix_lookup(self, num_prompt_tokens: int, num_cached: int) -> None:
        """Prefix-cache effectiveness, counted once per request at its first admission."""
        self.prefix_query_tokens += num_prompt_tokens
        self.prefix_hit_tokens += num_cached

    # ---- KV computed elsewhere (disaggregated decode) ------------------------------
    def add_remote_request(self, request: Request) -> tuple[list[int], int] | None:
        """Reserve blocks for a request whose prompt KV a prefill worker will send.

        Returns (block ids to receive into, prompt tokens already cached here), or None
        if the blocks do not fit now. The request waits, unscheduled, until commit_remote.
        """
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        cached_blocks, num_cached = self.kv.cached_prefix(request)
        request.num_computed_tokens = num_cached
        if not self.kv.allocate_slots(request, request.num_tokens - num_cached, cached_blocks):
            request.num_computed_tokens = 0
            return None
        request.status = RequestStatus.WAITING_FOR_KV
        request.num_cached_prompt_tokens = num_cached
        self._count_prefix_lookup(request.num_prompt_tokens, num_cached)
        self.requests[request.request_id] = request
        self.receiving[request.request_id] = request
        return self.kv.block_table(request.request_id)[num_cached // self.kv.block_size :], num_cached

    def accept_remote_token(self, request_id: str, first_token_id: int) -> RequestUpdate | None:
        """The prefill worker's first token, while the prompt's KV is still in flight: it
        joins the request's output now (so it streams at once) and may end the request.

        Until commit_remote the request holds its blocks whatever happens (hold_kv): the
        receiving thread writes into them. Ended here, it waits in `held` until released.
        """
        request = self.receiving.get(request_id)
        if request is None or request.hold_kv:  # hold_kv: its first token is in already
            return None
        request.hold_kv = True
        request.output_token_ids.append(first_token_id)
        status = request.stop_status(self.max_model_len)
        if status is not None:
            self.finish_request(request_id, status)
        return RequestUpdate(request_id, [first_token_id], request.status)

    def commit_remote(self, request_id: str, kv_received: bool) -> bool:
        """The prompt's KV arrived (or not): join the running batch, after its first token.

        With kv_received=False the prompt beyond the cached prefix is recomputed here:
        progress just stays at the cached prefix and the scheduler does the rest.
        """
        request = self.receiving.get(request_id)
        if request is None or not request.hold_kv:
            return False
        if kv_received:  # the KV of every token but the one just accepted
            request.num_computed_tokens = request.num_tokens - 1
        self._join_running(request)
        return True

    def compute_here(self, request_id: str) -> bool:
        """The prefill worker of a reserved request is lost before its first token: the
        request computes its prompt here (from the cached prefix, in the reserved blocks)
        and samples its first token itself, like any local request."""
        request = self.receiving.get(request_id)
        if request is None or request.hold_kv:
            return False
        self._join_running(request)
        return True

    def _join_running(self, request: Request) -> None:
        del self.receiving[request.request_id]
        request.hold_kv = False
        self.kv.cache_computed_blocks(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def has_schedulable(self) -> bool:
        """Requests a step could compute. Those waiting for KV are unfinished but not
        schedulable: only a message (commit, abort) changes that, never a step."""
        return bool(self.running or self.waiting)

    @property
    def num_decoding(self) -> int:
        """Running requests past their prompt: each computes one token per step."""
        return sum(r.num_computed_tokens == r.num_tokens - 1 for r in self.running)

    # ---- one step ---------------------------------------------------------------
    def schedule(self, prompt_budget: int | None = None) -> SchedulerOutput:
        """`prompt_budget` caps the step's prompt tokens (chunks of prompts, as opposed to
        the one token of each decoding request), within the step's token budget."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        prompt_left = budget if prompt_budget is None else prompt_budget
        computing = self._blocks_in_progress()
        in_progress_left = prompt_left - self._room_for_shorter_waiting(prompt_left // 2, computing)
        decodes_left = self.num_decoding  # a prompt chunk leaves their token to the decodes after it
        scheduled: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._chunk_size(request, budget)
            decoding = request.num_computed_tokens == request.num_tokens - 1
            decodes_left -= decoding
            if not decoding:
                n = min(n, in_progress_left, budget - decodes_left)
                if n <= 0:  # no prompt work left in this step: it continues in the next
                    i += 1
                    continue
            while not self.kv.allocate_slots(request, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                out.num_scheduled_tokens[request.request_id] = n
                scheduled.append(request)
                budget -= n
                prompt_left -= 0 if decoding else n
                in_progress_left -= 0 if decoding else n
                i += 1

        passed_over: list[Request] = []  # waiting for a prefix in progress: keep their place
        while self.waiting and budget > 0 and prompt_left > 0 and not out.preempted_request_ids:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            cached_blocks, num_cached = self.kv.cached_prefix(request)
            if self._waits_for_prefix(request, num_cached, computing):
                passed_over.append(self.waiting.popleft())
                continue
            request.num_computed_tokens = num_cached
            n = min(self._chunk_size(request, budget), prompt_left)
            if not self.kv.allocate_slots(request, n, cached_blocks):
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            computing.update(request.block_hashes[num_cached // self.kv.block_size :])
            request.num_cached_prompt_tokens = min(num_cached, request.num_prompt_tokens)
            if request.status == RequestStatus.WAITING:
                out.new_request_ids.append(request.request_id)
                self._count_prefix_lookup(request.num_prompt_tokens, request.num_cached_prompt_tokens)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.num_scheduled_tokens[request.request_id] = n
            scheduled.append(request)
            budget -= n
            prompt_left -= n
        self.waiting.extendleft(reversed(passed_over))

        for request in scheduled:
            n = out.num_scheduled_tokens[request.request_id]
            start = request.num_computed_tokens
            out.chunks.append(
                ScheduledChunk(
                    request_id=request.request_id,
                    token_ids=request.token_slice(start, start + n),
                    start_pos=start,
                    block_ids=list(self.kv.block_table(request.request_id)),
                    sample=start + n == request.num_tokens,
                )
            )
        return out

    def _blocks_in_progress(self) -> set[BlockHash]:
        """The hashes of the blocks that prompts in progress have yet to compute (each is
        cached once its step ends). Empty when no prompt is in progress: no hashing on a
        decode-only step's path."""
        computing: set[BlockHash] = set()
        for r in self.running:
            if r.num_computed_tokens < r.num_tokens - 1:
                computing.update(r.block_hashes[r.num_computed_tokens // self.kv.block_size :])
        return computing

    def _waits_for_prefix(self, request: Request, num_cached: int, computing: set[BlockHash]) -> bool:
        """Whether the request's next reusable block is being computed by a prompt in
        progress: computing it again would cost the same tokens the other is spending, and
        once cached it is free."""
        if not computing:
            return False
        next_block = num_cached // self.kv.block_size
        reusable = num_reusable_blocks(request.num_tokens, self.kv.block_size)
        return next_block < reusable and request.block_hashes[next_block] in computing

    def _room_for_shorter_waiting(self, limit: int, computing: set[BlockHash]) -> int:
        """Prompt tokens (at most `limit`) the prompts in progress leave to the waiting
        requests that, in FCFS order, each have fewer tokens to compute than one in progress
        has left: a short prompt is not blocked behind a long one's every chunk, while a
        long one still waits its turn instead of sharing steps with the first (which would
        delay both first tokens). Requests waiting for a prefix in progress are passed over."""
        longest = max((r.num_tokens - r.num_computed_tokens for r in self.running
                       if r.num_computed_tokens < r.num_tokens - 1), default=0)
        if not longest:  # no prompt in progress: no prefix lookups on the step's path
            return 0
        tokens = 0
        for admitted, request in enumerate(self.waiting, start=len(self.running)):
            if tokens >= limit or admitted >= self.config.max_num_seqs:
                break
            num_cached = self.kv.cached_prefix(request)[1]
            if self._waits_for_prefix(request, num_cached, computing):
                continue
            need = request.num_tokens - num_cached
            if need >= longest:
                break
            tokens += need
        return min(tokens, limit)

    def _chunk_size(self, request: Request, budget: int) -> int:
        left = request.num_tokens - request.num_computed_tokens
        n = min(left, budget)
        if self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        tail = self.config.stream_kv_tail_tokens
        if request.stream_kv and tail and left > 2 * tail:  # its last `tail` tokens: a chunk of their own
            n = min(n, left - tail)
        return n

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- apply results ------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[RequestUpdate]:
        """Advance progress by what was computed; append sampled tokens; finish stops.

        `sampled` maps request id -> next token for every chunk with `sample=True`.
        Requests finished meanwhile (aborted between schedule and update) are skipped.
        """
        updates: list[RequestUpdate] = []
        for chunk in out.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += len(chunk.token_ids)
            self.kv.cache_computed_blocks(request)
            if not chunk.sample:
                continue
            request.output_token_ids.append(sampled[chunk.request_id])
            status = request.stop_status(self.max_model_len)
            if status is not None:
                self.finish_request(request.request_id, status)
            updates.append(RequestUpdate(request.request_id, [request.output_token_ids[-1]], request.status))
        return updates

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        for request in self.running:
            assert request.status == RequestStatus.RUNNING
            assert 0 <= request.num_computed_tokens < request.num_tokens
            assert len(self.kv.block_table(request.request_id)) * self.kv.block_size >= request.num_computed_tokens
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert not self.kv.block_table(request.request_id)
        for request in self.receiving.values():
            assert request.status == RequestStatus.WAITING_FOR_KV
        for request in self.held.values():
            assert request.status.is_finished and request.request_id not in self.requests
        assert len(self.running) + len(self.waiting) + len(self.receiving) == len(self.requests)
