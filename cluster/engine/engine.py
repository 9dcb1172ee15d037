"""The engine: scheduler + model runner + sampler + output processing, one process.

    add_request() -> [ step() ]* -> RequestOutput deltas (tokens, text, finish reason)

`step()` is synchronous and single-threaded; `AsyncEngine` (async_engine.py) drives it
from a background thread for streaming callers.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from cluster.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.engine.grammar import Constraint, GrammarCompiler, allowed_tokens, bitmask_words
from cluster.engine.input_processor import InputProcessor, Prompt, TokenizedRequest
from cluster.engine.kv_cache_manager import KVCacheManager
from cluster.engine.outputs import RequestOutput, TokenLogprob
from cluster.engine.request import Request, RequestStatus
from cluster.engine.runner import ModelRunner, check_kv_cache_fits, kv_cache_dtype, num_kv_blocks, rank_kv_cache_bytes
from cluster.engine.sampler import SampleInput, Sampler
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.scheduler import Scheduler, SchedulerOutput
from cluster.engine.step_budget import StepBudget
from cluster.engine.step_timeline import StepTimeline
from cluster.engine.step_times import StepTimes
from cluster.engine.tp_ranks import TensorParallelRanks, resolved
from cluster.errors import InvalidRequestError
from cluster.host.engine_cores import place_engine_thread
from cluster.host.memory import keep_freed_memory
from cluster.host.openmp import wait_settings
from cluster.kv.block_pool import BlockPool
from cluster.kv.transport.packing import KVCaches
from cluster.model.checkpoints import open_checkpoint
from cluster.model.families import parse_arch, resolve_max_model_len
from cluster.model.loader import load_model, serving_dtype
from cluster.model.sharding import Shard, shard_of
from cluster.model.tp_group import SINGLE
from cluster.text.tokenizer import IncrementalDetokenizer, StopChecker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVLayout:
    """A replica's KV cache as the KV transport sees it: rank 0's caches and shard (its
    KV heads), the model's KV head count, and the actors of ranks 1..N-1, which move
    their own heads."""

    caches: KVCaches
    shard: Shard
    num_kv_heads: int
    rank_actors: tuple  # ray ActorHandles of RankWorker


@dataclass
class Completion:
    """A whole finished request, as the batch `generate()` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None


@dataclass
class _OutputState:
    """Per-request output processing: detokenization and stop strings."""

    request: Request
    detokenizer: IncrementalDetokenizer
    stops: StopChecker
    text: str = ""  # detokenized output (uncut)
    emitted: int = 0  # characters of `text` already sent
    stream_kv: bool = False  # report its prompt's KV progress (RequestOutput.kv_progress)
    constraint: Constraint | None = None  # its grammar, advanced with every output token
    error: str | None = None  # why it was aborted, when its grammar failed (RequestOutput.error)


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        # On the engine thread, before its first parallel op: its OpenMP team inherits the cores.
        self.placement = place_engine_thread(config.num_threads or torch.get_num_threads(), config.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.device == "cpu":
            keep_freed_memory()  # activations are reused step after step: no page faults for them
        torch.manual_seed(config.seed)
        checkpoint = open_checkpoint(config.model)
        # What every rank must agree on is decided here, before any other rank starts.
        arch = parse_arch(checkpoint.config())
        dtype = serving_dtype(config.dtype, checkpoint, config.device, config.quantization)
        shard = shard_of(arch, 0, config.tensor_parallel_size)  # ShardingError before any rank starts
        kv_dtype = kv_cache_dtype(config.cache, dtype)
        num_blocks = num_kv_blocks(config.cache, arch, shard, kv_dtype)
        block_size = config.cache.block_size
        ranks_here = config.tensor_parallel_size if config.device == "cpu" else 1  # on CUDA, a device each
        check_kv_cache_fits(ranks_here * rank_kv_cache_bytes(config.cache, arch, shard, kv_dtype), config.device)
        max_model_len = resolve_max_model_len(config.max_model_len, arch)
        if num_blocks * block_size < max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks * block_size} tokens, less than one sequence of "
                f"max_model_len {max_model_len}: give it more memory or lower max_model_len"
            )
        self.config = config = resolved(config, dtype, kv_dtype, num_blocks)
        self.ranks = TensorParallelRanks(config) if config.tensor_parallel_size > 1 else None
        try:
            group = self.ranks.group if self.ranks is not None else SINGLE
            self.loaded = load_model(checkpoint, config.dtype, config.device, config.max_model_len, group, config.quantization)
            if self.ranks is not None:
                self.ranks.start()
        except BaseException:
            if self.ranks is not None:
                self.ranks.close(lambda: None)
            raise
        self.tokenizer = checkpoint.tokenizer()
        self.max_model_len = self.loaded.max_model_len
        self.inputs = InputProcessor(self.tokenizer, self.loaded.arch.vocab_size, self.max_model_len)
        self.eos_token_ids = self.loaded.eos_token_ids | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )
        self.pool = BlockPool(num_blocks, block_size, config.cache.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, config.model_id)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        s = config.scheduler
        self.step_budget = StepBudget(s.max_num_batched_tokens, s.max_step_slowdown, floor=s.min_prompt_chunk)
        self.step_times = StepTimes()
        self.timeline = StepTimeline()
        # CUDA graphs for decode steps on one GPU; tensor-parallel steps stay eager (their
        # all-reduces run through TensorParallelGroup, not captured).
        graphs = torch.device(config.device).type == "cuda" and not config.enforce_eager and self.ranks is None
        self.runner = ModelRunner(self.loaded, num_blocks, block_size, config.device,
                                  decode_graphs=config.scheduler.max_num_seqs if graphs else 0, kv_dtype=kv_dtype)
        self.sampler = Sampler()
        self.grammars = GrammarCompiler(self.tokenizer, self.loaded.arch.vocab_size, self.eos_token_ids)
        self._outputs: dict[str, _OutputState] = {}
        self.finish_counts: Counter[str] = Counter()  # finished requests by finish reason
        self._ids = itertools.count()

    @classmethod
    def from_pretrained(
        cls,
        model: str,
        *,
        cache: CacheConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        **kwargs,
    ) -> Engine:
        return cls(EngineConfig(model=model, cache=cache or CacheConfig(), scheduler=scheduler or SchedulerConfig(), **kwargs))

    # ---- requests ------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None, **options) -> str:
        """Validate and queue a prompt (the offline API); raises InvalidRequestError before
        any work. `options`: as `add`'s."""
        return self.add(self.inputs.process(prompt, params or SamplingParams()), request_id, **options)

    def add(
        self,
        request: TokenizedRequest,
        request_id: str | None = None,
        hold_kv: bool = False,
        generated: Sequence[int] = (),
        stream_kv: bool = False,
    ) -> str:
        """Queue a request made at the edge (validated there: only its cheap invariants are
        checked again); returns its id.

        hold_kv: when it finishes, keep its blocks (for sending to a decode worker)
        until `release(request_id)`.
        generated: output tokens another worker already streamed to the client (a
        migrated request): it resumes after them, as if it had produced them itself.
        stream_kv: report its prompt's KV as each chunk computes (RequestOutput.kv_progress),
        so that a prefill worker sends it while the rest computes.
        """
        queued = self._new_request(request, request_id, hold_kv, generated)
        queued.stream_kv = self._outputs[queued.request_id].stream_kv = stream_kv
        self.scheduler.add_request(queued)
        return queued.request_id

    def _new_request(self, request: TokenizedRequest, request_id: str | None, hold_kv: bool, generated: Sequence[int] = ()) -> Request:
        ids, params = request.prompt_token_ids, request.params
        self.inputs.validate_length(len(ids), params)  # O(1): the ids were checked where the request was made
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._outputs or request_id in self.scheduler.requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        if len(generated) >= params.max_tokens or any(not 0 <= t < self.loaded.arch.vocab_size for t in generated):
            raise InvalidRequestError(f"cannot resume after {len(generated)} generated tokens (max_tokens {params.max_tokens})")
        request = Request(
            request_id, ids, params, eos_token_ids=frozenset(self.eos_token_ids), hold_kv=hold_kv, output_token_ids=list(generated)
        )
        state = _OutputState(
            request,
            IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens),
            StopChecker(params.stop),
            constraint=self.grammars.constraint(params.structured) if params.structured is not None else None,
        )
        self._replay(state, generated)
        self._outputs[request_id] = state
        return request

    @staticmethod
    def _replay(state: _OutputState, generated: Sequence[int]) -> None:
        """Bring a resumed request's detokenizer and stop checker to where the worker that
        streamed `generated` left them (token by token, as it ran), so that text held back
        there (a partial stop string, an unfinished character) is neither lost nor repeated;
        its grammar is advanced past them, never sampled again."""
        for token in generated:
            state.text += state.detokenizer.step([token])
            outcome = state.stops.process(state.text, state.emitted, False)
            if outcome.stopped:
                raise InvalidRequestError("the generated tokens already end the request (a stop string)")
            state.text, state.emitted = outcome.text, outcome.emitted
            if state.constraint is not None:
                if not state.constraint.advance([token]):
                    raise InvalidRequestError(f"the generated tokens break the request's {state.constraint.spec.kind} constraint")
                if state.constraint.done:
                    raise InvalidRequestError("the generated tokens already end the request (its grammar is complete)")

    # ---- disaggregation: KV computed on another worker ------------------------------
    def block_table(self, request_id: str) -> list[int]:
        """Block ids holding the request's KV (also for held, finished requests)."""
        return list(self.kv.block_table(request_id))

    def release(self, request_id: str) -> bool:
        """Free a finished hold_kv request's blocks."""
        return self.scheduler.release_held(request_id)

    def add_remote_request(
        self, request: TokenizedRequest, request_id: str | None = None, generated: Sequence[int] = ()
    ) -> tuple[str, list[int], int] | None:
        """Reserve blocks for a request's prompt (and `generated` tokens, see `add`) whose KV
        arrives from a prefill worker.

        Returns (request id, block ids to receive the uncached part into, tokens already
        in this engine's prefix cache), or None if the blocks do not fit now.
        """
        queued = self._new_request(request, request_id, hold_kv=False, generated=generated)
        reserved = self.scheduler.add_remote_request(queued)
        if reserved is None:
            del self._outputs[queued.request_id]
            return None
        block_ids, num_cached = reserved
        return queued.request_id, block_ids, num_cached

    def accept_first_token(self, request_id: str, token_id: int, logprob: TokenLogprob | None = None) -> RequestOutput | None:
        """The token the prefill worker sampled, for a request reserved with
        add_remote_request whose KV is still arriving: its delta (text, stop strings,
        finish) now, so the client gets it before the transfer ends. If it ends the request,
        the blocks stay held until `abort`/`release`, after the receive is over. A token the
        request's grammar refuses is an InvalidRequestError (the request is not changed)."""
        state = self._outputs.get(request_id)
        if state is not None and state.constraint is not None and not state.constraint.accepts(token_id):
            raise InvalidRequestError(f"the prefill worker's token {token_id} breaks the request's {state.constraint.spec.kind} constraint")
        update = self.scheduler.accept_remote_token(request_id, token_id)
        if update is None:
            return None
        return self._process(request_id, update.new_token_ids, update.status, logprob)

    def commit_remote(self, request_id: str, kv_received: bool) -> bool:
        """Join a remote-prefilled request (first token accepted) to the running batch.

        kv_received=False (the transfer failed, policy `recompute`): the prompt beyond
        the local cached prefix is recomputed here before decoding continues.
        """
        return self.scheduler.commit_remote(request_id, kv_received)

    def compute_here(self, request_id: str) -> bool:
        """A reserved request whose prefill worker was lost before its first token: it
        computes its prompt (beyond the local cached prefix) and first token here."""
        return self.scheduler.compute_here(request_id)

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now and free its blocks; returns its final (empty) delta."""
        state = self._outputs.pop(request_id, None)
        if state is None:
            self.release(request_id)  # a finished hold_kv request whose transfer was abandoned
            return None
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        return self._delta(state, [], "")

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def has_schedulable(self) -> bool:
        return self.scheduler.has_schedulable

    @property
    def num_unfinished(self) -> int:
        return self.scheduler.num_unfinished

    # ---- one step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        began = self.timeline.begin()
        sched = self.scheduler.schedule(self.step_budget.prompt_tokens(self.scheduler.num_decoding))
        if sched.is_empty:
            return []
        start = time.perf_counter()
        request_ids, logits = self.runner.execute(sched)
        rows = self._sample_inputs(request_ids)
        sampled = dict(zip(request_ids, self.sampler(logits, rows)))
        decoding = [len(c.token_ids) == 1 and c.sample for c in sched.chunks]
        num_decode = sum(decoding)
        seconds = time.perf_counter() - start
        self.step_budget.observe(num_decode, sched.total_tokens - num_decode, seconds)
        self.step_times.observe(num_decode, sched.total_tokens - num_decode, seconds)
        updates = self.scheduler.update_from_output(sched, {rid: s.token_id for rid, s in sampled.items()})
        outputs = [self._process(u.request_id, u.new_token_ids, u.status, sampled[u.request_id]) for u in updates]
        outputs += self._kv_progress(sched)
        num_prompt = sched.total_tokens - num_decode
        prompt_context = 0.0  # prompt tokens x their mean position (the planner's attention term)
        if num_prompt:  # (a decode-only step has none: no pass over its chunks)
            prompt_context = sum(len(c.token_ids) * (c.start_pos + len(c.token_ids) / 2)
                                 for c, decode in zip(sched.chunks, decoding) if not decode)
        self.timeline.end(began, num_decode, num_prompt, still_running=bool(self.scheduler.running),
                          prompt_context=prompt_context)
        return outputs

    def _kv_progress(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """Progress outputs of the stream_kv requests this step computed a chunk of without
        sampling (the sampling one's output holds its blocks), or preempted."""
        progress = []
        for request_id in [c.request_id for c in sched.chunks if not c.sample] + sched.preempted_request_ids:
            state = self._outputs.get(request_id)
            if state is not None and state.stream_kv:
                r = state.request
                computed = r.num_computed_tokens if r.status == RequestStatus.RUNNING else 0
                progress.append(RequestOutput(
                    request_id, [], "", False, None, r.num_prompt_tokens, len(r.output_token_ids),
                    r.num_cached_prompt_tokens, kv_progress=(computed, self.block_table(request_id) if computed else []),
                ))
        return progress

    def _sample_inputs(self, request_ids: list[str]) -> list[SampleInput]:
        """The step's rows to sample; a constrained row carries its grammar's allowed tokens
        (all such rows' masks filled, then unpacked at once; other rows cost nothing)."""
        states = [self._outputs[rid] for rid in request_ids]
        rows = [
            SampleInput(s.request.params, s.request.prompt_token_ids, s.request.output_token_ids,
                        self._generator(s.request), self._banned(s.request))
            for s in states
        ]
        constrained = [i for i, s in enumerate(states) if s.constraint is not None]
        if constrained:
            bitmask = torch.empty((len(constrained), bitmask_words(self.grammars.vocab_size)), dtype=torch.int32)
            for j, i in enumerate(constrained):
                states[i].constraint.fill(bitmask[j])
            for i, allowed in zip(constrained, allowed_tokens(bitmask, self.grammars.vocab_size)):
                rows[i].allowed = allowed
        return rows

    def _banned(self, request: Request) -> tuple[int, ...]:
        """Before min_tokens, stop tokens cannot be sampled (vLLM's min_tokens)."""
        if len(request.output_token_ids) >= request.params.min_tokens:
            return ()
        eos = () if request.params.ignore_eos else tuple(request.eos_token_ids)
        return eos + request.params.stop_token_ids

    def _generator(self, request: Request) -> torch.Generator | None:
        """A seeded request draws token i from a generator seeded by (seed, i): the same
        output whichever worker samples which token (prefill samples the first)."""
        if request.params.seed is None:
            return None
        position = len(request.output_token_ids)
        seed = (request.params.seed * 1_000_003 + position) % (1 << 63)
        return torch.Generator(device=self.config.device).manual_seed(seed)

    def _process(
        self, request_id: str, new_ids: list[int], status: RequestStatus, sampled: TokenLogprob | None
    ) -> RequestOutput:
        state = self._outputs[request_id]
        params = state.request.params
        # A stop token (eos or stop_token_ids) ends the request but is not part of the text.
        stopped_by_token = status == RequestStatus.FINISHED_STOPPED
        text_ids = new_ids[:-1] if stopped_by_token else new_ids
        state.text += state.detokenizer.step(text_ids)
        finished = status.is_finished
        if state.constraint is not None and not finished:
            finished = self._advance_grammar(state, new_ids)
        if finished:
            state.text += state.detokenizer.flush()
        outcome = state.stops.process(state.text, state.emitted, finished)
        if outcome.stopped and not finished:
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
            finished = True
        state.text, state.emitted = outcome.text, outcome.emitted
        logprobs = None
        if params.logprobs is not None and sampled is not None:
            logprobs = [sampled]
        if finished:
            del self._outputs[request_id]
        return self._delta(state, new_ids, outcome.delta, logprobs)

    def _advance_grammar(self, state: _OutputState, new_ids: list[int]) -> bool:
        """Advance the request's grammar past its new tokens; True if that ends the request:
        the grammar is complete (a stop), or it failed (an abort with the reason as the
        request's error, never an unconstrained continuation)."""
        request_id = state.request.request_id
        if not state.constraint.advance(new_ids):
            # A grammar past the parser's limits mid-way (llguidance: "Current row has N
            # items; max is 2000"), or a library fault: the request ends, with why.
            reason = state.constraint.error.strip().splitlines()[0] if state.constraint.error else "it refused a token it allowed"
            log.warning("request %s: its %s constraint failed: %s", request_id, state.constraint.spec.kind, reason)
            made = len(state.request.output_token_ids)
            state.error = f"the request's {state.constraint.spec.kind} constraint failed after {made} tokens: {reason}"
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
            return True
        if state.constraint.done:
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
            return True
        return False

    def _delta(self, state: _OutputState, new_ids: list[int], new_text: str, logprobs=None) -> RequestOutput:
        r = state.request
        if r.status.is_finished:
            self.finish_counts[r.status.finish_reason] += 1
        return RequestOutput(
            request_id=r.request_id,
            new_token_ids=list(new_ids),
            new_text=new_text,
            finished=r.status.is_finished,
            finish_reason=r.status.finish_reason if r.status.is_finished else None,
            num_prompt_tokens=r.num_prompt_tokens,
            num_output_tokens=len(r.output_token_ids),
            num_cached_tokens=r.num_cached_prompt_tokens,
            logprobs=logprobs,
            held_block_ids=self.block_table(r.request_id) if r.request_id in self.scheduler.held else None,
            error=state.error,
        )

    @property
    def idle_tick_s(self) -> float | None:
        """How often an idle engine calls `idle_tick` (None: never needed)."""
        return min(5.0, self.config.tp_timeout_s / 4) if self.ranks is not None else None

    def idle_tick(self) -> None:
        """Idle: check the tensor-parallel ranks (RankLostError if one is gone)."""
        if self.ranks is not None:
            self.runner.heartbeat()

    def kv_layout(self) -> KVLayout:
        """Where this replica's KV cache lives, for moving it: fixed once built."""
        return KVLayout(
            caches=self.runner.kv_caches,
            shard=self.loaded.model.shard,
            num_kv_heads=self.loaded.arch.num_kv_heads,
            rank_actors=tuple(self.ranks.actors) if self.ranks is not None else (),
        )

    def check_health(self) -> None:
        """RankLostError if a tensor-parallel rank of this replica is gone."""
        if self.ranks is not None:
            self.ranks.check()

    def rank_info(self) -> list[dict]:
        """Every rank of this replica: rank 0 (this process) first."""
        here = {
            "rank": 0,
            "pid": os.getpid(),
            "torch_threads": torch.get_num_threads(),
            "openmp_wait": wait_settings(),
            **self.placement.info(),
            "kv_heads": list(self.loaded.model.shard.kv_heads),
            "collectives": self.loaded.model.group.transport,
        }
        return [here, *(self.ranks.info if self.ranks is not None else [])]

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (idempotent; nothing to do with one rank)."""
        ranks, self.ranks = self.ranks, None
        if ranks is not None:
            ranks.close(self.runner.stop_followers)
        self.placement.release()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def load(self) -> dict:
        """What the router weighs (published to the prefix index with each heartbeat)."""
        s = self.scheduler
        return {
            "queued_tokens": sum(r.num_tokens - r.num_computed_tokens for r in s.waiting),
            "waiting": len(s.waiting),
            "running": len(s.running) + len(s.receiving),
            "kv_usage": round(self.pool.usage, 4),
        }

    def checked_stats(self) -> dict:
        """Queue depths and KV usage, after asserting the block invariant (for workers' stats)."""
        self.check_integrity()
        s = self.scheduler
        return {
            **self.load(),
            "running": len(s.running),
            "receiving": len(s.receiving),
            "held": len(s.held),
            "num_blocks": self.pool.num_blocks,
            "kv_cache_dtype": self.config.cache.dtype,  # resolved: the model's for auto
            "used_blocks": self.pool.num_used_blocks,
            "kv_usage": self.pool.usage,
            "finished": dict(self.finish_counts),
            "prefix_query_tokens": s.prefix_query_tokens,
            "prefix_hit_tokens": s.prefix_hit_tokens,
            "step_seconds": self.step_times.snapshot(),
        }

    # ---- batch API ---------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[Completion]:
        """Run prompts to completion together (continuous batching); results in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError("need one SamplingParams per prompt")
        results: dict[str, Completion] = {}
        try:
            for prompt, p in zip(prompts, params):
                rid = self.add_request(prompt, p)
                results[rid] = Completion(rid, list(self._outputs[rid].request.prompt_token_ids))
            with tqdm(total=len(results), desc="Generating", unit="req", disable=not use_tqdm) as bar:
                while any(c.finish_reason is None for c in results.values()):
                    for out in self.step():
                        c = results.get(out.request_id)
                        if c is None:
                            continue
                        c.token_ids += out.new_token_ids
                        c.text += out.new_text
                        c.num_cached_tokens = out.num_cached_tokens
                        if out.logprobs is not None:
                            c.logprobs = (c.logprobs or []) + out.logprobs
                        if out.finished:
                            c.finish_reason = out.finish_reason
                            bar.update()
        finally:
            for rid, c in results.items():
                if c.finish_reason is None:
                    self.abort(rid)
        return list(results.values())
