"""PLACE KEPT FOR the compute-share scenarios on a real GPU (issue 30, part 3). NOT WRITTEN YET.

Compute shares are being built in another change (the compute-share issue); until it has
landed there is nothing of gpufrac's to run here, and nothing is faked: the one test below
skips, naming why, and bench/gpu_suite.sh's report lists the compute-share goals as not
measured.

Once the feature lands, replace the skip with the simgpu scenarios run with real kernels,
each as its own test recording its figures (tests/gpu/gpu_support.record):
  * shares 10/90, 30/70 and 25/25/50, fair and strict: measured shares, convergence time;
  * a short-kernel workload's latency beside a long-kernel neighbour;
  * launch overhead with the share enforcement on against off.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_compute_shares_on_real_kernels() -> None:
    pytest.skip(
        "compute shares have not landed in gpufrac yet: nothing to measure (see this module's docstring)"
    )
