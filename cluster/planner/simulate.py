"""The cluster as a discrete-event model: the SLO planner (the same `SloPlanner`, on a
simulated clock) or a fixed split, serving a workload on replicas whose steps cost what a
profile says (cluster/planner/profile.py). `pdserve plan --simulate` runs it.

    prefill replica   prompts first come first served, in steps of at most chunk_tokens
                      prompt tokens, each costing what EngineCosts.chunk_s says; a
                      prompt's first token at the end of its last chunk (+ overhead_s), its
                      KV in at a decode replica handoff_s later
    decode replica    continuous batching: a step of n running requests takes
                      decode_base + decode_per_seq x n and gives each a token; a request
                      joins at the first step after its KV is in and leaves at its last.
                      With no prefill replica serving, it computes prompts too, under its
                      engine's step budget (engine/step_budget.py): beside n decodes a step
                      takes at most (s - 1) x step(n) / prompt_per_token prompt tokens (at
                      least min_prompt_chunk), alone a whole chunk
    Serve             a request goes, as it arrives, to the serving replicas with the least
                      work (prompt tokens queued; requests held); a replica asked for
                      serves replica_start_s later; one removed (a starting one first, else
                      the least busy) takes nothing new and leaves once its work is done
    planner           called every PLANNER_TICK_S; each serving replica reports what a real
                      one does: its tier's costs (the profile's) and its LoadMeter
                      (cluster/planner/load.py), fed by its simulated events

Left out: prefix-cache hits, KV capacity (no preemption), the network, other processes.
A decode replica runs as many steps at once as no arrival or hand-off to it comes between
(its batch cannot change), so a long trace on many replicas simulates in seconds.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

from cluster.planner.costs import EngineCosts
from cluster.planner.load import LoadMeter
from cluster.planner.policy import SloPlanner
from cluster.planner.profile import Profile
from cluster.planner.sizing import Split
from cluster.planner.workload import TraceRequest

PLANNER_TICK_S = 1.0  # Serve's control loop calls the policy every 0.1 s; it evaluates every interval_s
SAMPLE_S = 2.0  # replica counts recorded (as `pdserve bench trace` samples them)
TIERS = ("prefill", "decode")


@dataclass(eq=False)
class SimRequest:
    index: int
    arrival: float
    prompt_len: int
    output_len: int
    prompt_left: int
    tokens_left: int = 0  # decode steps still to run (output tokens after the first)
    first_token: float | None = None
    finish: float | None = None
    decode: DecodeReplica | None = None


@dataclass(frozen=True)
class SimResult:
    requests: list[SimRequest]  # in trace order; finish None: not done by the end
    samples: list[tuple[float, int, int]]  # (t, serving prefill, serving decode replicas)
    decisions: list[tuple[float, str]]  # (t, the split the planner moved to)


class Simulation:
    def __init__(self, profile: Profile, requests: list[TraceRequest], start: Split, planner: SloPlanner | None = None,
                 colocated: bool = False):
        """`start`: the split serving at t = 0 (the whole run, without a planner);
        `colocated`: the decode replicas are colocated engines (their step budget)."""
        self.profile, self.planner = profile, planner
        self.step_budget = ((profile.colocated_step_slowdown, profile.colocated_min_prompt_chunk) if colocated
                            else (profile.decode_step_slowdown, 1))
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self.requests = [SimRequest(i, r.t, r.prompt_len, r.output_len, r.prompt_len) for i, r in enumerate(requests)]
        self._unfinished = len(self.requests)
        self._next_arrival = 0
        self._unplaced: deque[SimRequest] = deque()  # arrived while no decode replica served
        self._ids = itertools.count()
        self.replicas: dict[str, list[Replica]] = {"prefill": [], "decode": []}
        for _ in range(start.prefill):
            self._add("prefill", ready_at=0.0)
        for _ in range(start.decode):
            self._add("decode", ready_at=0.0)
        self.samples: list[tuple[float, int, int]] = []
        self.decisions: list[tuple[float, str]] = []

    # ---- the event loop -------------------------------------------------------------
    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._order), fn))

    def next_event_time(self) -> float:
        return self._events[0][0] if self._events else math.inf

    def next_arrival_time(self) -> float:
        return self.requests[self._next_arrival].arrival if self._next_arrival < len(self.requests) else math.inf

    def run(self) -> SimResult:
        if self.requests:
            self.at(self.requests[0].arrival, self._arrive)
        self.at(0.0, self._sample)
        if self.planner is not None:
            self.at(0.0, self._plan)
        while self._events and self._unfinished:
            self.now, _, fn = heapq.heappop(self._events)
            fn()
        return SimResult(self.requests, self.samples, self.decisions)

    # ---- requests -------------------------------------------------------------------
    def _arrive(self) -> None:
        request = self.requests[self._next_arrival]
        self._next_arrival += 1
        if self._next_arrival < len(self.requests):
            self.at(self.requests[self._next_arrival].arrival, self._arrive)
        self._place(request)

    def _place(self, request: SimRequest) -> None:
        decode = self._least_busy("decode")
        if decode is None:
            self._unplaced.append(request)
            return
        request.decode = decode
        decode.held += 1
        decode.meter.arrived(request.prompt_len)
        prefill = self._least_busy("prefill")
        if prefill is not None:
            decode.coming += 1
            prefill.submit(request)
        else:
            decode.submit(request)  # colocated: no prefill replica serves

    def _least_busy(self, tier: str) -> Replica | None:
        serving = [r for r in self.replicas[tier] if r.serving()]
        return min(serving, key=lambda r: (r.work(), r.ident)) if serving else None

    def first_token(self, request: SimRequest, t: float, kv_local: bool) -> None:
        """The prompt's first token, computed at `t` (its step's end)."""
        request.first_token = t + self.profile.overhead_s
        request.decode.meter.first_token(request.first_token - request.arrival)
        request.decode.meter.generated(1)
        request.tokens_left = request.output_len - 1
        if request.tokens_left <= 0:
            request.decode.coming -= not kv_local  # (it will not join: done at its first token)
            self.finish(request, t)
        elif kv_local:
            request.decode.join(request)
        else:
            self.at(t + self.profile.handoff_s, lambda: request.decode.join(request))

    def finish(self, request: SimRequest, t: float) -> None:
        request.finish = t + self.profile.overhead_s
        self._unfinished -= 1
        decode = request.decode
        decode.held -= 1
        decode.meter.finished(request.output_len)
        decode.meter.ended(request.output_len)
        decode.leave_if_idle()

    # ---- Serve and the planner ------------------------------------------------------
    def _add(self, tier: str, ready_at: float) -> None:
        kind = PrefillReplica if tier == "prefill" else DecodeReplica
        replica = kind(self, f"{tier}-{next(self._ids)}", ready_at)
        self.replicas[tier].append(replica)
        if ready_at > self.now:
            self.at(ready_at, replica.ready)

    def _scale(self, tier: str, target: int) -> None:
        kept = [r for r in self.replicas[tier] if not r.draining]
        for _ in range(target - len(kept)):
            self._add(tier, self.now + self.profile.replica_start_s)
        # Serve stops a starting replica first, then the one with the least work.
        for replica in sorted(kept, key=lambda r: (r.serving(), r.work()))[: max(0, len(kept) - target)]:
            replica.draining = True
            replica.leave_if_idle()

    def remove(self, replica: Replica) -> None:
        if replica in self.replicas[replica.tier]:
            self.replicas[replica.tier].remove(replica)

    def replica_ready(self) -> None:
        while self._unplaced and self._least_busy("decode") is not None:
            self._place(self._unplaced.popleft())

    def counts(self) -> Split:
        return Split(*(sum(r.serving() for r in self.replicas[t]) for t in TIERS))

    def _sample(self) -> None:
        split = self.counts()
        self.samples.append((self.now, split.prefill, split.decode))
        self.at(self.now + SAMPLE_S, self._sample)

    def _plan(self) -> None:
        targets = {t: sum(not r.draining for r in self.replicas[t]) for t in TIERS}
        contexts = {t: SimpleNamespace(deployment_name=self.planner.tiers[t], deployment_id=t,
                                       target_num_replicas=targets[t], aggregated_metrics=self._metrics(t)) for t in TIERS}
        decided, _ = self.planner(contexts)
        if decided != targets:
            for tier in TIERS:
                self._scale(tier, decided[tier])
            self.decisions.append((self.now, str(Split(decided["prefill"], decided["decode"]))))
        self.at(self.now + PLANNER_TICK_S, self._plan)

    def _metrics(self, tier: str) -> dict[str, dict[str, float]]:
        """Serve's aggregated custom metrics of a tier: {name: {replica: value}}."""
        out: dict[str, dict[str, float]] = {}
        for replica in self.replicas[tier]:
            if replica.serving():
                for name, value in replica.report().items():
                    out.setdefault(name, {})[replica.ident] = value
        return out


class Replica:
    tier = ""

    def __init__(self, sim: Simulation, ident: str, ready_at: float):
        self.sim, self.ident, self.ready_at = sim, ident, ready_at
        self.costs: EngineCosts = getattr(sim.profile, self.tier)
        self.meter = LoadMeter(clock=lambda: sim.now)
        self.draining = False
        self.busy = False  # a step is running

    def serving(self) -> bool:
        return self.sim.now >= self.ready_at and not self.draining

    def ready(self) -> None:
        self.sim.replica_ready()
        self.kick()

    def report(self) -> dict[str, float]:
        return {**vars(self.costs), **self.meter.report()}

    def leave_if_idle(self) -> None:
        if self.draining and not self.busy and not self.work():
            self.sim.remove(self)

    def work(self) -> float:
        raise NotImplementedError

    def has_work(self) -> bool:
        raise NotImplementedError

    def kick(self) -> None:
        """Start a step, once this instant's other events are in (what arrives together steps
        together, as in an engine whose loop takes every message waiting)."""
        if self.busy or self.sim.now < self.ready_at or not self.has_work():
            self.leave_if_idle()
            return
        self.busy = True
        self.sim.at(self.sim.now, self._step)

    def _step(self) -> None:
        """Take the step's work and schedule its end (which clears `busy` and kicks)."""
        raise NotImplementedError

    def _prompt_chunk(self, prompts: deque[SimRequest], budget: int) -> tuple[int, float, list[SimRequest]]:
        """Take up to `budget` prompt tokens, first come first served: (tokens, tokens x their
        mean position, prompts done)."""
        tokens, context, done = 0, 0.0, []
        for request in prompts:
            take = min(request.prompt_left, budget - tokens)
            if take <= 0:
                break
            context += take * (request.prompt_len - request.prompt_left + take / 2)
            request.prompt_left -= take
            tokens += take
            if not request.prompt_left:
                done.append(request)
        for _ in done:
            prompts.popleft()
        return tokens, context, done


class PrefillReplica(Replica):
    tier = "prefill"

    def __init__(self, sim: Simulation, ident: str, ready_at: float):
        super().__init__(sim, ident, ready_at)
        self.prompts: deque[SimRequest] = deque()

    def work(self) -> float:
        return sum(r.prompt_left for r in self.prompts)

    def submit(self, request: SimRequest) -> None:
        self.prompts.append(request)
        self.kick()

    def has_work(self) -> bool:
        return bool(self.prompts)

    def _step(self) -> None:
        start = self.sim.now
        tokens, context, done = self._prompt_chunk(self.prompts, self.costs.chunk_tokens)

        def end() -> None:
            for request in done:
                self.sim.first_token(request, self.sim.now, kv_local=False)
            self.busy = False
            self.kick()

        self.sim.at(start + self.costs.chunk_s(tokens, context), end)


class DecodeReplica(Replica):
    tier = "decode"

    def __init__(self, sim: Simulation, ident: str, ready_at: float):
        super().__init__(sim, ident, ready_at)
        self.running: list[SimRequest] = []
        self.joining: list[SimRequest] = []
        self.prompts: deque[SimRequest] = deque()  # computed here (no prefill replica served them)
        self.held = 0  # requests placed here and not finished (their prompts computed anywhere)
        self.coming = 0  # placed here, their prompts computed by a prefill replica, not joined yet

    def work(self) -> float:
        return self.held

    def submit(self, request: SimRequest) -> None:
        self.prompts.append(request)
        self.kick()

    def join(self, request: SimRequest) -> None:
        self.coming -= 1
        self.joining.append(request)
        self.kick()

    def has_work(self) -> bool:
        return bool(self.running or self.joining or self.prompts)

    def _step(self) -> None:
        self.running.extend(self.joining)
        self.joining.clear()
        start, costs, n = self.sim.now, self.costs, len(self.running)
        decode_step = costs.decode_step_s(n)
        tokens, done, steps = 0, [], 1
        if self.prompts:
            budget = costs.chunk_tokens
            slowdown, floor = self.sim.step_budget
            if n and slowdown > 1 and costs.prompt_per_token_s > 0:
                allowed = int((slowdown - 1) * decode_step / costs.prompt_per_token_s)
                budget = max(floor, min(budget, allowed))
            tokens, context, done = self._prompt_chunk(self.prompts, budget)
            step = costs.chunk_s(tokens, context, running=n)
        else:
            step = decode_step
            # Steps at once until one of the batch ends or something may join it: an arrival, or
            # while prompts placed here compute elsewhere, any event (one may end such a prompt).
            steps = min(r.tokens_left for r in self.running)
            horizon = (self.sim.next_event_time() if self.coming else self.sim.next_arrival_time()) - start
            if math.isfinite(horizon) and step > 0:
                steps = max(1, min(steps, int(horizon // step)))
        stepped = list(self.running)

        def end() -> None:
            now = self.sim.now
            if stepped:
                self.meter.token_gap(step, count=len(stepped) * steps)
                self.meter.generated(len(stepped) * steps)
            for request in stepped:
                request.tokens_left -= steps
                if request.tokens_left <= 0:
                    self.sim.finish(request, now)
            self.running = [r for r in self.running if r.tokens_left > 0]
            for request in done:
                self.sim.first_token(request, now, kv_local=True)
            self.busy = False
            self.kick()

        self.sim.at(start + steps * step, end)
