"""Errors that cross process and tier boundaries: raised in the engine or a worker,
mapped to HTTP and gRPC statuses by the gateway (router/errors.py). Every tier imports
them from here, so no tier imports another to recognise a failure. The engine raises them
too, so this module imports no Ray: which of them a request survives is cluster/serving/faults.py."""


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
