"""A container's policy as the shim reads it: flag bits and workload-class numbers.

The values are memguard's ABI (gpufrac/memguard/native/memguard_abi.h); they live here so
that the policy (gpufrac.core, which imports no other gpufrac package) and the ABI module
(gpufrac.memguard.abi, which encodes the files) share one table.
"""

from __future__ import annotations

FLAG_POD_KNOWN = 1 << 0
FLAG_PREEMPTIBLE = 1 << 1
FLAG_SWAPPABLE = 1 << 2
FLAG_WHOLE_GPU = 1 << 3
FLAG_DISABLED = 1 << 4

CLASS_BATCH, CLASS_INTERACTIVE, CLASS_INFERENCE = 0, 1, 2
CLASS_NAMES = {"batch": CLASS_BATCH, "interactive": CLASS_INTERACTIVE, "inference": CLASS_INFERENCE}
CLASS_BY_NUMBER = {v: k for k, v in CLASS_NAMES.items()}
