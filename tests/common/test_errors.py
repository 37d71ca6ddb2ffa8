"""The one status <-> error table (``services.common.errors``) agrees with gRPC's own codes, and
the server-side mapping uses it."""

from __future__ import annotations

import grpc
import pytest

from services.common import errors
from services.common.server import status_code_of

ALL = [errors.InvalidArgument, errors.NotFound, errors.AlreadyExists, errors.FailedPrecondition,
       errors.ResourceExhausted, errors.Unavailable, errors.DeadlineExceeded, errors.Unauthenticated,
       errors.PermissionDenied, errors.Cancelled]


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_each_error_round_trips_through_name_number_and_status(cls):
    code = cls.code
    status = status_code_of(cls("x"))
    assert status.name == code.value and status.value[0] == code.number
    assert errors.error_class(code) is errors.error_class(code.value) is errors.error_class(code.number) is cls


def test_every_code_has_exactly_one_error_and_unmapped_codes_have_none():
    assert sorted(c.code.value for c in ALL) == sorted(c.value for c in errors.Code)
    for name in ("OK", "UNKNOWN", "INTERNAL", "DATA_LOSS"):
        assert errors.error_class(name) is None and errors.error_class(grpc.StatusCode[name].value[0]) is None
