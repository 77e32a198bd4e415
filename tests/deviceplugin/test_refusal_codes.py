"""What the kubelet is told when the allocation service refuses: each kind of refusal
has its gRPC status code, and the ledger's refusals are of the kind their cause says."""

from __future__ import annotations

import grpc
import pytest

from gpufrac.core.errors import AllocationError, ErrorKind
from gpufrac.deviceplugin.server import STATUS_CODES, status_code

pytestmark = pytest.mark.unit


def test_every_kind_of_refusal_has_a_status_code() -> None:
    assert set(STATUS_CODES) == set(ErrorKind)


@pytest.mark.parametrize(
    ("kind", "code"),
    [
        (ErrorKind.INVALID_REQUEST, grpc.StatusCode.INVALID_ARGUMENT),
        (ErrorKind.STATE_CONFLICT, grpc.StatusCode.FAILED_PRECONDITION),
        (ErrorKind.NODE_FAILURE, grpc.StatusCode.INTERNAL),
    ],
)
def test_a_refusal_answers_with_the_code_of_its_kind(kind: ErrorKind, code: grpc.StatusCode) -> None:
    err = AllocationError(kind, "why")
    assert status_code(err) == code and err.message == "why" and str(err) == "why"
