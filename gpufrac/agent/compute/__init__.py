"""Compute shares: each container's share of its GPU's compute, held by pacing its launches
from the driver's measured utilisation (docs/compute.md).

control.py decides (pure), feed.py reads NVML's per-process utilisation for the whole agent,
loop.py runs the control period on the agent's loop.
"""

from gpufrac.agent.compute.feed import FeedView, UtilisationFeed
from gpufrac.agent.compute.loop import ComputeFigures, ComputeLoop

__all__ = ["ComputeFigures", "ComputeLoop", "FeedView", "UtilisationFeed"]
