"""The arbiter's grant model on its own: no socket, no NVML, no clock (gpufrac.agent.arbiter.grants)."""

from __future__ import annotations

import pytest

from gpufrac.agent.arbiter.grants import (
    GRANT_SETTLE,
    GRANT_STALE_AFTER,
    STALE_SLACK,
    GrantSweep,
    Share,
    free_for,
    guarantee_shortfall,
    kept_on_release,
    settle_left,
)

pytestmark = pytest.mark.unit

GiB = 1 << 30


def test_a_burst_is_bounded_by_the_pool_and_by_what_the_driver_has_free() -> None:
    shares = [
        Share(used=3 * GiB, request=4 * GiB, grant=0),
        Share(used=6 * GiB, request=4 * GiB, grant=2 * GiB),
    ]
    # committed: 4 + 0 and 4 + 2 -> pool 20 - 10 = 10; unused: 1 GiB of the first guarantee.
    assert free_for(shares, 20 * GiB, 20 * GiB, 0, lend=False) == 10 * GiB
    # The driver has less than the ledger's pool: the driver wins (less the margin and the unused).
    assert free_for(shares, 20 * GiB, 5 * GiB, GiB, lend=False) == 3 * GiB
    # Lending: the unused guarantee counts as free in the pool.
    assert free_for(shares, 20 * GiB, 20 * GiB, 0, lend=True) == 11 * GiB


def test_no_driver_reading_grants_nothing_and_an_unknown_usage_counts_as_all_it_may_use() -> None:
    assert free_for([], 20 * GiB, None, 0, lend=False) == 0
    unknown = Share(used=None, request=4 * GiB, grant=2 * GiB)
    assert unknown.holds == 6 * GiB and unknown.burst == 2 * GiB
    assert free_for([unknown], 10 * GiB, 10 * GiB, 0, lend=True) == 4 * GiB


def test_a_release_keeps_only_the_grant_in_use_and_waits_out_a_young_grant() -> None:
    assert kept_on_release(used=5 * GiB, request=4 * GiB, grant=3 * GiB) == GiB
    assert kept_on_release(used=2 * GiB, request=4 * GiB, grant=3 * GiB) == 0
    assert settle_left(None, 100.0) == 0.0
    assert 0 < settle_left(100.0, 100.0) <= GRANT_SETTLE
    assert settle_left(100.0, 100.0 + GRANT_SETTLE) == 0.0


def test_a_guarantee_is_short_by_what_others_may_still_charge() -> None:
    # 4 GiB request, 1 GiB held: 3 GiB still to come; 5 GiB free, 1 GiB margin, 2 GiB pending elsewhere.
    assert guarantee_shortfall(4 * GiB, GiB, 5 * GiB, GiB, 2 * GiB) == GiB
    assert guarantee_shortfall(4 * GiB, 4 * GiB, GiB, GiB, 0) == 0  # all held already


def test_the_sweep_takes_back_returned_grants_at_once_and_unused_ones_after_the_delay() -> None:
    s = GrantSweep()
    assert not s.returned_now("a", 0)
    assert s.returned_now("a", 1) and not s.returned_now("a", 1)
    unused = STALE_SLACK + 1
    assert not s.stale("a", unused, 10.0)
    assert not s.stale("a", unused, 10.0 + GRANT_STALE_AFTER - 0.5)
    assert s.stale("a", unused, 10.0 + GRANT_STALE_AFTER)
    s.used("a")  # granted again: the clock starts over
    assert not s.stale("a", unused, 100.0)
    assert not s.stale("a", STALE_SLACK, 200.0)  # within the slack: in use
    assert not s.stale("a", unused, 200.0 + GRANT_STALE_AFTER - 0.5)
