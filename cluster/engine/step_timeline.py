"""The engine's last steps, one record each: a timeline of what its thread did, to find
where a slow inter-token gap comes from (`pdserve bench protect` reads the decode tier's).

    t           wall-clock time the step began (seconds since the epoch)
    step_s      the whole step: schedule, forward, sample, outputs
    cpu_s       CPU time the engine thread got in it (its own clock): step_s - cpu_s is
                time the thread waited (another process or thread on its core, the GIL)
    between_s   from the end of the step before to the start of this one, while requests
                ran in both: the engine thread's work outside steps (adds, commits, aborts,
                calls, handing out outputs); idle waits are not counted (0)
    decode      tokens of requests past their prompt (one each)
    prompt      prompt tokens (chunks: the step's prompt work)
    prompt_context  over its prompt chunks, tokens x their mean position: what attention
                adds to a chunk grows with how much of its prompt came before

Records are kept in a ring of MAX_STEPS (the last minutes of a busy engine) and read
between steps (Engine.timeline, on the engine thread); recording costs two clock reads.
"""

from __future__ import annotations

import time
from collections import deque
from typing import NamedTuple

MAX_STEPS = 16384


class StepRecord(NamedTuple):
    t: float
    step_s: float
    cpu_s: float
    between_s: float
    decode: int
    prompt: int
    prompt_context: float = 0.0


class StepTimeline:
    def __init__(self, max_steps: int = MAX_STEPS) -> None:
        self._steps: deque[StepRecord] = deque(maxlen=max_steps)
        self._last_end: float | None = None  # perf_counter at the end of the last step that left requests running

    def begin(self) -> tuple[float, float, float]:
        """Clocks at the start of a step (pass to `end`)."""
        return time.time(), time.perf_counter(), time.thread_time()

    def end(self, began: tuple[float, float, float], decode: int, prompt: int, still_running: bool,
            prompt_context: float = 0.0) -> None:
        """Record the step begun at `began`; `still_running`: requests remain in the batch (so
        the gap to the next step is the engine thread's work, not an idle wait)."""
        wall, start, cpu = began
        now = time.perf_counter()
        between = start - self._last_end if self._last_end is not None else 0.0
        self._steps.append(StepRecord(wall, now - start, time.thread_time() - cpu, between, decode, prompt,
                                      prompt_context))
        self._last_end = now if still_running else None

    def since(self, t: float) -> list[StepRecord]:
        """The recorded steps that began at or after wall-clock time `t`, oldest first."""
        return [s for s in self._steps if s.t >= t]
