"""Typed domain errors shared by all services.

Cores raise these; servicers map them to gRPC status codes in one place
(``services.common.server.ErrorMappingInterceptor``). Anything else that escapes a handler is an
internal error: it is logged with its stack trace and reaches the client as a bare ``INTERNAL``.

This module is the one table between codes and errors: ``Code`` names match ``grpc.StatusCode``
names, ``Code.number`` is the google.rpc code carried in per-item results, and ``error_class``
goes back from either to the exception type. No gRPC import here: cores use it too.
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

    @property
    def number(self) -> int:
        """The google.rpc.Code number (as in ``grpc.StatusCode.X.value[0]``)."""
        return _NUMBERS[self]


_NUMBERS = {
    Code.CANCELLED: 1, Code.INVALID_ARGUMENT: 3, Code.DEADLINE_EXCEEDED: 4, Code.NOT_FOUND: 5,
    Code.ALREADY_EXISTS: 6, Code.PERMISSION_DENIED: 7, Code.RESOURCE_EXHAUSTED: 8,
    Code.FAILED_PRECONDITION: 9, Code.UNAVAILABLE: 14, Code.UNAUTHENTICATED: 16,
}


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


_CLASSES: dict[object, type[TandemError]] = {}
for _cls in (InvalidArgument, NotFound, AlreadyExists, FailedPrecondition, ResourceExhausted, Unavailable,
             DeadlineExceeded, Unauthenticated, PermissionDenied, Cancelled):
    _CLASSES[_cls.code] = _CLASSES[_cls.code.value] = _CLASSES[_cls.code.number] = _cls


def error_class(code: Code | str | int) -> type[TandemError] | None:
    """The error type for a ``Code``, a status code name or a google.rpc number; None for codes
    Tandem does not map (OK, UNKNOWN, INTERNAL, ...)."""
    return _CLASSES.get(code)
