"""Errors that cross process and tier boundaries: raised in the engine or a worker,
mapped to HTTP and gRPC statuses by the gateway (router/errors.py). Every tier imports
them from here, so no tier imports another to recognise a failure."""


class InvalidRequestError(ValueError):
    """A request refused before any work on it (HTTP 400 / INVALID_ARGUMENT)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param  # the request field at fault, when there is one


class EngineDeadError(RuntimeError):
    """The engine thread has stopped: nothing more will run on this replica."""


class KVCacheFullError(RuntimeError):
    """A decode worker had no room for the prompt's blocks in time (the caller may retry elsewhere)."""


class TransferFailedError(RuntimeError):
    """The KV transfer failed and the policy is `fail`."""


# Failures of a worker, not of the request: the client may retry (HTTP 503 / UNAVAILABLE).
WORKER_FAULTS = (EngineDeadError, KVCacheFullError, TransferFailedError)
