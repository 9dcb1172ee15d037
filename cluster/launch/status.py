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
    for tier, count in silent.items():
        if count:
            print(f"{count} running {tier} replica(s) did not answer within {STATUS_DEADLINE_S:g} s (hung, busy beyond it, or killed)",
                  file=sys.stderr)
    return 0
