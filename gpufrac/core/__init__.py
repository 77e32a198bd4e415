"""The bottom layer: types and helpers every other part of gpufrac uses.

Nothing here imports another gpufrac package, a transport (grpc), the Kubernetes client,
prometheus-client or NVML: units, the node config and its policy, annotation parsing, GPU
and slice types, errors, logging, tables and output formats, the event loop, native paths.
"""
