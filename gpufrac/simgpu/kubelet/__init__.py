"""A kubelet emulator: the device-manager and pod-resources sides of a kubelet.

It behaves as the real kubelet does towards device plugins
(docs/design.md section 4):

* start/restart: every socket in the device-plugin directory is removed, then
  kubelet.sock is created (Registration only); old plugins are never re-dialled;
  after a restart capacity is 0 until a plugin registers again;
* Register: version and resource-name checks, a blocking dial-back (10 s) and
  GetDevicePluginOptions inside the call, then ListAndWatch in the background;
* each ListAndWatch message is a full snapshot, only "Healthy" counts; when the
  stream ends every device of the resource turns unhealthy and nobody re-dials;
* admission, per container and resource: available = healthy - allocated,
  GetPreferredAllocation (if advertised) with one container request, then
  Allocate with exactly one ContainerAllocateRequest, then PreStartContainer (if
  required) at each container start; errors read like the kubelet's;
* no deallocate call: deleting a pod just forgets its devices;
* v1.PodResourcesLister (List, GetAllocatableResources, Get) on
  <root>/pod-resources/kubelet.sock from its own records, rate-limited like the
  kubelet's (100 QPS, burst 10), each device of a container its own entry (once
  per NUMA node), as the kubelet lists them.

model.py holds the records, emulator.py the kubelet (registration, ListAndWatch,
admission, containers), podresources.py the pod-resources server, agent_process.py
the agent run as a subprocess against it. dra.py is the kubelet's DRA side (plugin
registration, NodePrepareResources and NodeUnprepareResources, restarts, the runtime's CDI):
DraKubelet, for a node in DRA mode.

It runs its own asyncio loop in a background thread; the public methods are
synchronous and thread-safe (tests and the demo call them from anywhere).
"""

from gpufrac.simgpu.kubelet.agent_process import AgentProcess
from gpufrac.simgpu.kubelet.emulator import KubeletEmulator
from gpufrac.simgpu.kubelet.model import AdmissionError, Container, Pod, is_extended_resource_name

__all__ = [
    "AdmissionError",
    "AgentProcess",
    "Container",
    "KubeletEmulator",
    "Pod",
    "is_extended_resource_name",
]
