"""PodEvictor: ends a pod through the policy/v1 Eviction subresource (so PodDisruptionBudgets
hold), reads the pod to tell a gone pod from an unserved subresource, and DELETEs only as
the fallback the node config allows."""

from __future__ import annotations

import asyncio
import enum
import json
import math
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

# The longest retry hint taken from the apiserver: "inf" would put an eviction off for ever.
MAX_RETRY_AFTER = 3600.0


class EvictResult(enum.Enum):
    EVICTED = "evicted"
    DELETED = "deleted"
    GONE = "gone"  # the pod (with that uid) no longer exists
    BLOCKED = "blocked"  # 429: a PodDisruptionBudget refuses it now
    UNAVAILABLE = "unavailable"  # the Eviction API cannot be used (missing, forbidden)
    FAILED = "failed"  # anything else; retried


@dataclass(frozen=True)
class EvictOutcome:
    result: EvictResult
    detail: str = ""
    retry_after: float | None = None


def status_detail(e: ApiException) -> tuple[str, float | None]:
    """The apiserver's message (with its causes) and retry hint from an error response."""
    try:
        parsed: object = json.loads(e.body or "{}")
    except (TypeError, ValueError):
        parsed = {}
    body: dict[str, Any] = parsed if isinstance(parsed, dict) else {}
    message = str(body.get("message") or e.reason or f"HTTP {e.status}")
    details: dict[str, Any] = body["details"] if isinstance(body.get("details"), dict) else {}
    causes = [
        str(c.get("message")) for c in details.get("causes") or [] if isinstance(c, dict) and c.get("message")
    ]
    if causes:
        message += " (" + "; ".join(causes) + ")"
    retry: float | None = None
    raw = details.get("retryAfterSeconds") or (e.headers or {}).get("Retry-After")
    try:
        retry = float(raw) if raw else None
    except (TypeError, ValueError, OverflowError):  # OverflowError: an integer past a float
        retry = None
    if retry is not None:  # NaN or negative says nothing; infinity and the like wait the longest
        retry = None if math.isnan(retry) or retry < 0 else min(retry, MAX_RETRY_AFTER)
    return message, retry


class PodEvictor:
    """Evicts pods through the policy/v1 Eviction subresource (PodDisruptionBudgets hold);
    the idle reaper's (gpufrac.agent.idle.reaper) way to end a pod.

    A plain DELETE is used only when `allow_delete` is set AND the Eviction API itself
    is unusable (not served, forbidden); a PodDisruptionBudget's 429 is never
    answered with a delete. Every call carries the pod's uid as a precondition, so a
    new pod that took the same name is never hit. Blocking calls run in a thread."""

    def __init__(
        self, api: client.ApiClient, *, allow_delete: bool = False, request_timeout: float = 10.0
    ) -> None:
        self._v1 = client.CoreV1Api(api)
        self.allow_delete = allow_delete
        self._timeout = request_timeout

    async def evict(self, namespace: str, name: str, uid: str) -> EvictOutcome:
        outcome = await asyncio.to_thread(self._evict, namespace, name, uid)
        if outcome.result is EvictResult.UNAVAILABLE and self.allow_delete:
            return await asyncio.to_thread(self._delete, namespace, name, uid, outcome.detail)
        return outcome

    def _evict(self, namespace: str, name: str, uid: str) -> EvictOutcome:
        body: dict[str, Any] = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
        }
        if uid:
            body["deleteOptions"] = {"preconditions": {"uid": uid}}
        try:
            # The client sends a plain dict body as it is; its hints name only the model class.
            self._v1.create_namespaced_pod_eviction(
                name,
                namespace,
                body,  # type: ignore[arg-type]
                _preload_content=False,
                _request_timeout=self._timeout,
            )
        except ApiException as e:
            detail, retry = status_detail(e)
            if e.status == 429:
                return EvictOutcome(EvictResult.BLOCKED, detail, retry)
            if e.status == 409:  # the uid precondition failed: another pod has the name now
                return EvictOutcome(EvictResult.GONE, detail)
            if e.status == 404:
                # The pod is gone, or the apiserver does not serve the subresource: ask which.
                return self._missing(namespace, name, uid, detail)
            if e.status in (403, 405):
                return EvictOutcome(EvictResult.UNAVAILABLE, f"Eviction API: HTTP {e.status} {detail}")
            return EvictOutcome(EvictResult.FAILED, f"HTTP {e.status} {detail}", retry)
        except Exception as e:  # connection refused, timeouts
            return EvictOutcome(EvictResult.FAILED, f"{type(e).__name__}: {e}")
        return EvictOutcome(EvictResult.EVICTED)

    def _missing(self, namespace: str, name: str, uid: str, detail: str) -> EvictOutcome:
        try:
            resp = self._v1.read_namespaced_pod(
                name, namespace, _preload_content=False, _request_timeout=self._timeout
            )
            # _preload_content=False returns the raw response, not the V1Pod its hints name.
            pod = json.loads(resp.data)  # type: ignore[attr-defined]
        except ApiException as e:
            if e.status == 404:
                return EvictOutcome(EvictResult.GONE, detail)
            return EvictOutcome(EvictResult.FAILED, f"HTTP {e.status} {e.reason}")
        except Exception as e:
            return EvictOutcome(EvictResult.FAILED, f"{type(e).__name__}: {e}")
        if uid and (pod.get("metadata") or {}).get("uid") not in (None, uid):
            return EvictOutcome(EvictResult.GONE, "a new pod has the name")
        return EvictOutcome(EvictResult.UNAVAILABLE, f"Eviction API not served: {detail}")

    def _delete(self, namespace: str, name: str, uid: str, why: str) -> EvictOutcome:
        body = {"preconditions": {"uid": uid}} if uid else {}
        try:
            # A plain dict body again (sent as it is).
            self._v1.delete_namespaced_pod(
                name,
                namespace,
                body=body,  # type: ignore[arg-type]
                _preload_content=False,
                _request_timeout=self._timeout,
            )
        except ApiException as e:
            if e.status in (404, 409):
                return EvictOutcome(EvictResult.GONE, status_detail(e)[0])
            return EvictOutcome(EvictResult.FAILED, f"delete: HTTP {e.status} {status_detail(e)[0]}")
        except Exception as e:
            return EvictOutcome(EvictResult.FAILED, f"delete: {type(e).__name__}: {e}")
        return EvictOutcome(EvictResult.DELETED, why)
