"""`pdserve status`: what a running cluster's replicas report. It imports Ray and Serve
only: a status call costs Ray's start-up, not torch's."""

from __future__ import annotations

import json
import sys

from ray import serve
from ray.serve.exceptions import RayServeException

from cluster.config import APP_NAME
from cluster.host import local_ray

STATUS_DEADLINE_S = 5.0  # the replicas heard by then are listed: a hung one must not hang the call


def run_status(args) -> int:
    local_ray.connect(args.address, log_to_driver=False)
    try:
        router = serve.get_app_handle(APP_NAME)
    except RayServeException as e:  # Ray is up, but no Serve or no pdserve application on it
        raise ConnectionError(f"no pdserve application on this Ray cluster ({e})") from None
    stats, silent = router.poll_workers.remote(STATUS_DEADLINE_S).result()
    print(json.dumps(stats, indent=2))
    planner = router.planner_status.remote().result()
    if planner:
        print(planner_line(planner))
    for tier, count in silent.items():
        if count:
            print(f"{count} running {tier} replica(s) did not answer within {STATUS_DEADLINE_S:g} s (hung, busy beyond it, or killed)",
                  file=sys.stderr)
    return 0


def planner_line(status: dict) -> str:
    """One line of the SLO planner's last decision."""
    def ms(key: str) -> str:
        return "-" if status.get(key) is None else f"{status[key] * 1e3:.0f} ms"

    line = f"planner: {status.get('state')}, {status.get('current')}"
    if status.get("chosen") and status["chosen"] != status.get("current"):
        line += f" -> {status['chosen']}"
    forecast = status.get("forecast")
    if forecast:
        line += (f"; forecast {forecast['requests_per_s']:.2f} req/s, {forecast['prompt_tokens']:.0f} prompt / "
                 f"{forecast['output_tokens']:.0f} output tokens")
    return (line + f"; TTFT {ms('observed_ttft_s')} observed, {ms('predicted_ttft_s')} predicted, {ms('slo_ttft_s')} target"
            f"; ITL {ms('observed_itl_s')} observed, {ms('predicted_itl_s')} predicted, {ms('slo_itl_s')} target")
