"""Registers the fixture modules of tests/ (each a plugin, loaded once for the whole suite)."""

# Every fixture module is registered here, once; test modules import its helpers and
# types, never its fixtures. One module per thing a test needs:
#   a simulated GPU node     make_sim_node, sim_node, in_process_nvml (fixtures/simnode.py)
#   the apiserver            kube_server (fixtures/kube.py)
#   a container under the shim   container, shim, flavour (fixtures/memguard.py)
#   the agent, a subprocess  make_sim, sim: with the kubelet emulator (fixtures/agentsim.py);
#                            e2e_node: plus the apiserver, runtime and workloads (fixtures/e2e.py)
#   the agent in DRA mode    dra_node: the kubelet's DRA side, the scheduler's (fixtures/dra.py)
#   the agent, in-process    node: with metrics and status served (fixtures/metrics.py)
#   the arbiter's parts      make_node: ledger, identity, arbiter on a loop (fixtures/arbiter_harness.py)
#   real cgroups alone       runtime: a container runtime (fixtures/hostile_tenant.py, with
#                            what a hostile tenant does from inside its container)
# Polling with a deadline (no fixed sleeps): fixtures/polling.py.
pytest_plugins = [
    "tests.fixtures.simnode",
    "tests.fixtures.kube",
    "tests.fixtures.memguard",
    "tests.fixtures.agentsim",
    "tests.fixtures.e2e",
    "tests.fixtures.dra",
    "tests.fixtures.arbiter_harness",
    "tests.fixtures.metrics",
    "tests.fixtures.hostile_tenant",
]
