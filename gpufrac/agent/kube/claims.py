"""ClaimReader: ResourceClaims read from the apiserver (resource.k8s.io/v1) for the DRA
driver, which the kubelet names a claim to and nothing more (gpufrac.agent.booking.claims). The GET
runs in a worker thread; the claim comes back as JSON (a dict), parsed by gpufrac.core.claims."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpufrac.agent.kube.podcache import decode

log = logging.getLogger(__name__)


class ClaimReadError(Exception):
    """The apiserver did not give the claim (other than: it does not exist)."""


class ClaimReader:
    """GETs ResourceClaims; None for one that does not exist."""

    def __init__(self, api: client.ApiClient, *, request_timeout: float = 10.0) -> None:
        self._api = client.ResourceV1Api(api)
        self._request_timeout = request_timeout
        self.errors = 0

    async def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        def read() -> dict[str, Any]:
            resp = self._api.read_namespaced_resource_claim(
                name, namespace, _preload_content=False, _request_timeout=self._request_timeout
            )
            return decode(resp)

        try:
            return await asyncio.to_thread(read)
        except ApiException as e:
            if e.status == 404:
                return None
            self.errors += 1
            raise ClaimReadError(f"GET ResourceClaim {namespace}/{name}: {e.status} {e.reason}") from None
        except Exception as e:  # connection refused, timeouts, bad JSON
            self.errors += 1
            raise ClaimReadError(f"GET ResourceClaim {namespace}/{name}: {e}") from None
