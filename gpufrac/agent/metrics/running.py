"""The module-level counting API: each call goes to the running agent's Metrics (the one
whose start() ran last and has not stopped); with no agent running it does nothing.

Kept while the parts that count take no metrics object of their own; see
gpufrac.agent.metrics for the calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpufrac.agent.metrics.containers import Container

if TYPE_CHECKING:
    from gpufrac.agent.metrics.registry import Metrics

_active: Metrics | None = None


def activate(metrics: Metrics) -> None:
    global _active
    _active = metrics


def deactivate(metrics: Metrics) -> None:
    global _active
    if _active is metrics:
        _active = None


def active() -> Metrics | None:
    return _active


def count_wait(container: Container, seconds: float) -> None:
    if _active is not None:
        _active.count_wait(container, seconds)


def count_eviction(container: Container) -> None:
    if _active is not None:
        _active.count_eviction(container)


def count_swap(container: Container, direction: str) -> None:
    if _active is not None:
        _active.count_swap(container, direction)


def count_arbiter_request(kind: str, outcome: str) -> None:
    if _active is not None:
        _active.count_arbiter_request(kind, outcome)


def count_arbiter_limited(limit: str) -> None:
    if _active is not None:
        _active.count_arbiter_limited(limit)


def count_reap(action: str, reason: str = "idle") -> None:
    if _active is not None:
        _active.count_reap(action, reason)


def count_watchdog(action: str) -> None:
    if _active is not None:
        _active.count_watchdog(action)


def set_watchdog_unowned(processes: int, used_bytes: int) -> None:
    if _active is not None:
        _active.set_watchdog_unowned(processes, used_bytes)


def count_annotation_error(key: str) -> None:
    if _active is not None:
        _active.count_annotation_error(key)


def count_reconcile_error() -> None:
    if _active is not None:
        _active.count_reconcile_error()


def count_usage_mismatch() -> None:
    if _active is not None:
        _active.count_usage_mismatch()
