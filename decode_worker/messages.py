"""The router -> decode boundary. The stream back is the engine's RequestOutput deltas."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
