"""The one API client of the agent: in-cluster service account, a kubeconfig, or an explicit host."""

from __future__ import annotations

import asyncio
import logging
import os

from kubernetes import client, config

log = logging.getLogger(__name__)


class KubeConfigError(RuntimeError):
    """No way to reach the apiserver was found."""


def make_api_client(
    host: str | None = None, kubeconfig: str | None = None, context: str | None = None
) -> client.ApiClient:
    """An ApiClient: explicit host, else in-cluster, else kubeconfig ($KUBECONFIG or ~/.kube/config)."""
    cfg = client.Configuration()
    if host:
        cfg.host = host.rstrip("/")
    elif kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]  # untyped in kubernetes
    else:
        try:
            # kubernetes.config is untyped.
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=kubeconfig, context=context, client_configuration=cfg
            )
        except (config.ConfigException, OSError) as e:
            raise KubeConfigError(
                f"cannot reach the apiserver: not in a cluster and no usable kubeconfig ({e})"
            ) from e
    return client.ApiClient(cfg)


async def connect(host: str | None, kubeconfig: str | None = None) -> client.ApiClient:
    """The agent's one ApiClient (the composition root makes it and hands it down); raises
    KubeConfigError when no apiserver can be reached. Loading a kubeconfig reads files and
    may run an exec credential plugin: done off the loop."""
    try:
        return await asyncio.to_thread(make_api_client, host=host or None, kubeconfig=kubeconfig or None)
    except KubeConfigError:
        raise
    except Exception as e:  # a kubeconfig the client cannot parse
        raise KubeConfigError(f"cannot use the kubeconfig: {type(e).__name__}: {e}") from e
