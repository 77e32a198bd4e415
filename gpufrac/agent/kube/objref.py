"""ObjectRef: the object an Event is about, kept apart from the recorder so that the modules
naming one (events, the arbiter, swap) import no Kubernetes client: the GPU suite runs them
on a node that has none (bench/gpu_suite.sh)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpufrac.agent.kube.podcache import PodInfo


@dataclass(frozen=True)
class ObjectRef:
    """The object an Event is about (core/v1 ObjectReference)."""

    kind: str
    name: str
    namespace: str = ""
    uid: str = ""
    api_version: str = "v1"
    field_path: str = ""

    @classmethod
    def pod(cls, pod: PodInfo, container: str | None = None) -> ObjectRef:
        return cls.pod_named(pod.namespace, pod.name, pod.uid, container)

    @classmethod
    def pod_named(cls, namespace: str, name: str, uid: str = "", container: str | None = None) -> ObjectRef:
        """A pod (or one of its containers, as kubectl describe shows it) by name."""
        path = f"spec.containers{{{container}}}" if container else ""
        return cls("Pod", name, namespace, uid, field_path=path)
