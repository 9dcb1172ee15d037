"""Which failures a request survives by moving to another worker (router/router.py
migrates it), and which reach the client: a worker's faults, ours (cluster/errors.py)
and Ray's, against the request's own errors and bugs."""

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from cluster.errors import EngineDeadError, KVCacheFullError, StalledError, TransferFailedError

# Failures of a worker, not of the request: another worker may serve it (and a client
# that still sees one, past the migration limit, may retry: HTTP 503 / UNAVAILABLE).
WORKER_FAULTS = (
    EngineDeadError,
    KVCacheFullError,
    TransferFailedError,
    StalledError,
    RayActorError,  # the replica died or is unreachable (ActorDiedError, ActorUnavailableError)
    BackPressureError,
    DeploymentUnavailableError,
)


def is_worker_fault(e: BaseException) -> bool:
    e = getattr(e, "cause", None) or e  # a worker's exception arrives wrapped in RayTaskError
    return isinstance(e, WORKER_FAULTS)


def can_migrate(e: BaseException) -> bool:
    """A worker fault that another worker may recover from; not one the failure policy
    chose to surface (kv_failure_policy=fail)."""
    e = getattr(e, "cause", None) or e
    return is_worker_fault(e) and not isinstance(e, TransferFailedError)
