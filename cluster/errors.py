"""Errors that cross process and tier boundaries: raised in the engine or a worker,
mapped to HTTP and gRPC statuses by the gateway (router/errors.py). Every tier imports
them from here, so no tier imports another to recognise a failure."""

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError


class InvalidRequestError(ValueError):
    """A request refused before any work on it (HTTP 400 / INVALID_ARGUMENT)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param  # the request field at fault, when there is one


class EngineDeadError(RuntimeError):
    """The engine thread has stopped: nothing more will run on this replica."""


class RankLostError(EngineDeadError):
    """A tensor-parallel rank of this replica died or stalled: the replica cannot step again."""


class KVCacheFullError(RuntimeError):
    """A decode worker had no room for the prompt's blocks in time (the caller may retry elsewhere)."""


class TransferFailedError(RuntimeError):
    """The KV transfer failed and the policy is `fail`."""


class StalledError(RuntimeError):
    """A stream made no progress for the stall timeout: its worker is presumed lost."""


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
