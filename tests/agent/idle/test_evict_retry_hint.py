"""The apiserver's retry hint on a refused eviction is used only within sense.

`retryAfterSeconds` (or a Retry-After header) puts the idle reaper's next try off
(gpufrac.agent.idle.actions). A hint that is no number, negative, NaN, infinite or an
integer too long for a float must neither raise (a traceback every reaper pass) nor put the
eviction off for ever.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from gpufrac.agent.kube.evict import MAX_RETRY_AFTER, status_detail

pytestmark = pytest.mark.unit


def refusal(details: dict[str, Any] | None = None, header: str | None = None) -> ApiException:
    e = ApiException(status=429, reason="Too Many Requests")
    e.body = json.dumps({"message": "Cannot evict pod", "details": details or {}})
    e.headers = {"Retry-After": header} if header is not None else {}
    return e


@pytest.mark.parametrize(
    ("details", "header", "want"),
    [
        ({"retryAfterSeconds": 10}, None, 10.0),
        (None, "5", 5.0),
        ({"retryAfterSeconds": 10**400}, None, None),  # no float holds it
        (None, "inf", MAX_RETRY_AFTER),
        (None, "1e999", MAX_RETRY_AFTER),
        (None, "nan", None),
        (None, "-3", None),
        (None, "soon", None),
    ],
)
def test_a_retry_hint_is_a_finite_delay_or_none(
    details: dict[str, Any] | None, header: str | None, want: float | None
) -> None:
    message, retry = status_detail(refusal(details, header))
    assert message == "Cannot evict pod"
    assert retry == want
