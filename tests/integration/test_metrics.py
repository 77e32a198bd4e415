

from metrics_support import node_fixture, InprocNode, http_get  # noqa
from gpufrac.deviceplugin.slices import MEMORY, FRACTION

def test_smoke(node: InprocNode) -> None:
    p = node.admit("server", MEMORY, 8, {"gpufrac.dev/gpu-memory-limit": "24Gi"})
    node.admit("frac", FRACTION, 25)
    s = node.wait_scrape(lambda s: s.get("gpufrac_container_memory_limit_bytes", pod="server") == 24 * 2**30, "limit")
    print(s.text)
    print(http_get(node.url + "/healthz"), http_get(node.url + "/readyz"))
    from gpufrac.agent import status
    print(status.format_status(status.fetch(str(node.status_socket))))
