"""Gateway errors: one table maps each to its HTTP status, OpenAI error type and gRPC code,
so the two APIs refuse the same things the same way."""

from __future__ import annotations

import logging

import grpc

from cluster.errors import InvalidRequestError
from cluster.serving.faults import is_worker_fault

log = logging.getLogger(__name__)


class GatewayError(Exception):
    status = 500
    type = "server_error"
    grpc_code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, param: str | None = None, retry_after_s: int | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": None}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}


class BadRequest(GatewayError):
    status, type, grpc_code = 400, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT


class Unauthorized(GatewayError):
    status, type, grpc_code = 401, "authentication_error", grpc.StatusCode.UNAUTHENTICATED


class NotFound(GatewayError):
    status, type, grpc_code = 404, "not_found_error", grpc.StatusCode.NOT_FOUND


class AlreadyExists(GatewayError):
    status, type, grpc_code = 409, "invalid_request_error", grpc.StatusCode.ALREADY_EXISTS


class PayloadTooLarge(GatewayError):
    status, type, grpc_code = 413, "invalid_request_error", grpc.StatusCode.RESOURCE_EXHAUSTED


class RateLimited(GatewayError):
    status, type, grpc_code = 429, "rate_limit_error", grpc.StatusCode.RESOURCE_EXHAUSTED


class Overloaded(GatewayError):
    """Admission refused: too many requests running and queued. Retry later."""

    status, type, grpc_code = 503, "overloaded_error", grpc.StatusCode.UNAVAILABLE


class Unavailable(GatewayError):
    status, type, grpc_code = 503, "service_unavailable_error", grpc.StatusCode.UNAVAILABLE


class Aborted(GatewayError):
    """A gRPC Generate ended by its client's Abort (499: nginx's "client closed request")."""

    status, type, grpc_code = 499, "cancelled_error", grpc.StatusCode.CANCELLED


def from_exception(e: BaseException) -> GatewayError:
    """What a client is told about `e`: its own message for input it can fix, a generic
    one (never a trace or an object address) for faults of ours, which are logged."""
    e = getattr(e, "cause", None) or e  # a worker's exception arrives wrapped in RayTaskError
    if isinstance(e, GatewayError):
        return e
    if isinstance(e, InvalidRequestError):  # also when raised in a worker (RayTaskError is a subclass)
        return BadRequest(str(e), param=e.param)
    if is_worker_fault(e):
        log.warning("request failed in a worker: %s", e)
        return Unavailable("a worker could not serve this request; retry", retry_after_s=1)
    log.error("request failed", exc_info=e)
    return GatewayError("internal error; the request was not completed")
