"""gpufrac: node-level GPU sharing for Kubernetes."""

__version__ = "0.1.0"
