"""The agent's only door to the Kubernetes apiserver: its API client, pods, Events, its Node,
evictions. The composition root (gpufrac.agent.main) makes one ApiClient (connect) and hands
it to each of these; no other module of the agent talks to the apiserver.

* client: make_api_client / connect: in-cluster service account, a kubeconfig, or a host.
* podcache: PodCache, this node's pods kept by a list + watch in one thread (PodInfo).
* recorder: EventRecorder, Events on pods (aggregated as client-go does) and the
  DisruptionTarget pod condition; objref: ObjectRef, the object one is about.
* nodes: NodeLabeler, the agent's gpufrac.dev/ labels on its own Node.
* evict: PodEvictor, the policy/v1 Eviction subresource (a DELETE only as the fallback).

An apiserver that is slow, down or refusing never stalls the loop or crashes the
agent: blocking calls run in threads, errors are logged and counted.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Each name is imported from its module when first asked for (PEP 562), so importing one
# of them, ObjectRef above all, loads only its own module: ObjectRef needs no Kubernetes
# client, and the GPU suite (bench/gpu_suite.sh) runs the arbiter and swap on a node that
# has none.
_WHERE = {
    "KubeConfigError": "client",
    "connect": "client",
    "make_api_client": "client",
    "EvictOutcome": "evict",
    "EvictResult": "evict",
    "PodEvictor": "evict",
    "NodeLabeler": "nodes",
    "PodCache": "podcache",
    "PodInfo": "podcache",
    "PodListener": "podcache",
    "DISRUPTION_TARGET": "recorder",
    "EventRecorder": "recorder",
    "ObjectRef": "objref",
}

if TYPE_CHECKING:
    from gpufrac.agent.kube.client import KubeConfigError, connect, make_api_client
    from gpufrac.agent.kube.evict import EvictOutcome, EvictResult, PodEvictor
    from gpufrac.agent.kube.nodes import NodeLabeler
    from gpufrac.agent.kube.objref import ObjectRef
    from gpufrac.agent.kube.podcache import PodCache, PodInfo, PodListener
    from gpufrac.agent.kube.recorder import DISRUPTION_TARGET, EventRecorder


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # asked once
    return value


__all__ = [
    "DISRUPTION_TARGET",
    "EventRecorder",
    "EvictOutcome",
    "EvictResult",
    "KubeConfigError",
    "NodeLabeler",
    "ObjectRef",
    "PodCache",
    "PodEvictor",
    "PodInfo",
    "PodListener",
    "connect",
    "make_api_client",
]
