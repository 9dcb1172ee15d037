"""The router -> decode boundary. The stream back is the engine's RequestOutput deltas."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.engine.sampling_params import SamplingParams
from cluster.routing import RouteHint


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    route: RouteHint = RouteHint()  # which decode replica (read by Serve's request router)
    prefill_route: RouteHint = RouteHint()  # which prefill replica the decode worker should call
