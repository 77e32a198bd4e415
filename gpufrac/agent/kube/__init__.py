"""The agent's only door to the Kubernetes apiserver: its API client, pods, Events, its Node,
evictions, and in DRA mode its ResourceClaims and ResourceSlice. The composition root
(gpufrac.agent.main) makes one ApiClient (connect) and hands it to each of these; no other
module of the agent talks to the apiserver.

* client: make_api_client / connect: in-cluster service account, a kubeconfig, or a host.
* podcache: PodCache, this node's pods kept by a list + watch in one thread (PodInfo).
* recorder: EventRecorder, Events on pods (aggregated as client-go does) and the
  DisruptionTarget pod condition (ObjectRef names the object).
* nodes: NodeLabeler, the agent's gpufrac.dev/ labels on its own Node.
* evict: PodEvictor, the policy/v1 Eviction subresource (a DELETE only as the fallback).
* claims: ClaimReader, the ResourceClaims the DRA driver prepares (resource.k8s.io/v1).
* resourceslices: SlicePublisher, the node's ResourceSlice kept as the agent wants it.

An apiserver that is slow, down or refusing never stalls the loop or crashes the
agent: blocking calls run in threads, errors are logged and counted.
"""
