"""Tandem's typed errors as OpenAI HTTP errors: status code + ``{"error": {...}}`` body. Pure.

The body has OpenAI's shape (``message``, ``type``, ``param``, ``code``), so the official client
raises its matching exception (``BadRequestError`` for 400, ``AuthenticationError`` for 401 ...).
Anything that is not a :class:`TandemError` is a 500 whose message says nothing internal.
"""

from __future__ import annotations

from services.common.errors import Code, InvalidArgument, TandemError

HTTP_STATUS: dict[Code, int] = {
    Code.INVALID_ARGUMENT: 400,
    Code.FAILED_PRECONDITION: 400,
    Code.UNAUTHENTICATED: 401,
    Code.PERMISSION_DENIED: 403,
    Code.NOT_FOUND: 404,
    Code.ALREADY_EXISTS: 409,
    Code.RESOURCE_EXHAUSTED: 429,  # no capacity before the deadline: retry later (clients back off)
    Code.CANCELLED: 499,
    Code.UNAVAILABLE: 503,
    Code.DEADLINE_EXCEEDED: 504,
}
_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error", 499: "cancelled", 503: "service_unavailable", 504: "timeout",
}
INTERNAL_MESSAGE = "internal error (see the router's log)"


class RequestError(InvalidArgument):
    """A 400 that names the offending request field (``param``, OpenAI's dotted path)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.error_code = code


class BodyTooLarge(InvalidArgument):
    """A request body over the router's ``max_receive_bytes`` (HTTP 413; gRPC refuses the same
    size as RESOURCE_EXHAUSTED)."""

    http_status = 413

    def __init__(self, limit: int):
        super().__init__(f"the request body is larger than {limit} bytes (--max-receive-bytes)")
        self.error_code = "request_too_large"


class ModelNotFound(TandemError):
    """The request names a model this router does not serve (OpenAI: 404 ``model_not_found``)."""

    code = Code.NOT_FOUND

    def __init__(self, model: str):
        super().__init__(f"The model `{model}` does not exist.")
        self.param = "model"
        self.error_code = "model_not_found"


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}}


def http_error(exc: BaseException) -> tuple[int, dict]:
    """(HTTP status, OpenAI error body) of any exception (pure; internal details never shown)."""
    if isinstance(exc, TandemError):
        status = getattr(exc, "http_status", None) or HTTP_STATUS.get(exc.code, 500)
        code = getattr(exc, "error_code", None)
        if code is None:
            code = "invalid_api_key" if exc.code is Code.UNAUTHENTICATED else exc.code.value.lower()
        return status, error_body(status, exc.message, param=getattr(exc, "param", None), code=code)
    return 500, error_body(500, INTERNAL_MESSAGE, code="internal")
