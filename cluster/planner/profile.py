"""What one replica of each tier costs, as a file: the seed of a live planner
(`pdserve serve --planner-profile`) and the model of a simulated one (`pdserve plan
--simulate`). Written by `pdserve bench profile` (the engine measured offline, with the
same fit the replicas make online: cluster/planner/costs.py).

    prefill, decode    the tiers' EngineCosts (step costs and prompt tokens per step)
    *_step_slowdown    the step budget beside decodes (engine/step_budget.py) of a
                       disaggregated decode engine (its least prompt chunk: 1 token) and of a
                       colocated one (its least: colocated_min_prompt_chunk)
    replica_start_s    a replica asked for until it serves (process, model load, warm-up)
    handoff_s          a prompt's first token until its KV is in at a decode replica
    overhead_s         what a request spends outside the engines (the edge, the calls)
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from cluster.planner.costs import EngineCosts


@dataclass(frozen=True)
class Profile:
    prefill: EngineCosts
    decode: EngineCosts
    decode_step_slowdown: float
    colocated_step_slowdown: float
    colocated_min_prompt_chunk: int
    replica_start_s: float = 10.0
    handoff_s: float = 0.0
    overhead_s: float = 0.0
    source: dict = field(default_factory=dict)  # where it was measured: CPU, model, command

    def costs(self) -> dict[str, dict[str, float]]:
        """Per tier, the figures a replica reports (StepCostModel.report's names)."""
        return {"prefill": dataclasses.asdict(self.prefill), "decode": dataclasses.asdict(self.decode)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            data = json.loads(Path(path).read_text())
            return cls(**{**data, "prefill": EngineCosts(**data["prefill"]), "decode": EngineCosts(**data["decode"])})
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a replica profile (pdserve bench profile writes one): {e}") from None
