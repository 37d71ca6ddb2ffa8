"""Typed domain errors shared by all services.

Cores raise these; servicers map them to gRPC status codes in one place
(``services.common.server.map_errors``). Anything else that escapes a handler is an internal
error: it is logged with its stack trace and reaches the client as a bare ``INTERNAL``.
"""

from __future__ import annotations

import enum


class Code(enum.Enum):
    """The status codes a domain error may carry; names match ``grpc.StatusCode``."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    CANCELLED = "CANCELLED"


class TandemError(Exception):
    """Base of every error a client may see. ``message`` is safe to show to the caller."""

    code: Code = Code.FAILED_PRECONDITION

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(TandemError):
    code = Code.INVALID_ARGUMENT


class NotFound(TandemError):
    code = Code.NOT_FOUND


class AlreadyExists(TandemError):
    code = Code.ALREADY_EXISTS


class FailedPrecondition(TandemError):
    code = Code.FAILED_PRECONDITION


class ResourceExhausted(TandemError):
    code = Code.RESOURCE_EXHAUSTED


class Unavailable(TandemError):
    code = Code.UNAVAILABLE


class DeadlineExceeded(TandemError):
    code = Code.DEADLINE_EXCEEDED


class Unauthenticated(TandemError):
    code = Code.UNAUTHENTICATED


class PermissionDenied(TandemError):
    code = Code.PERMISSION_DENIED


class Cancelled(TandemError):
    code = Code.CANCELLED
