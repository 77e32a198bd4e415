"""Compute shares: each container's share of its GPU's compute, held by pacing its launches
from the driver's measured utilisation (docs/compute.md).

control  what each container may use, and the pace that holds it there (pure)
loop     the control period on the agent's loop: measures, decides, writes the paces, tells
hold     a container that skips the shim held from outside (its GPU processes stopped in turns)

NVML's per-process samples come from gpu/utilisation.py, which the activity tracker reads too.
"""
