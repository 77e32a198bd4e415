"""Registers the fixture modules of tests/ (each a plugin, loaded once for the whole suite)."""

# Every fixture module is registered here, once; test modules import its helpers and
# types, never its fixtures. One module per thing a test needs:
#   a simulated GPU node     make_sim_node, sim_node, in_process_nvml (simnode_fixtures.py)
#   the apiserver            kube_server (kube_fixtures.py)
#   a container under the shim   container, shim, flavour (memguard_fixtures.py)
#   the agent, a subprocess  make_sim, sim: with the kubelet emulator (agentsim_fixtures.py);
#                            e2e_node: plus the apiserver, runtime and workloads (e2e_support.py)
#   the agent, in-process    node: with metrics and status served (metrics_support.py)
#   the arbiter's parts      make_node: ledger, identity, arbiter on a loop (arbiter_harness.py)
# Polling with a deadline (no fixed sleeps): polling.py.
pytest_plugins = [
    "simnode_fixtures",
    "kube_fixtures",
    "memguard_fixtures",
    "agentsim_fixtures",
    "e2e_support",
    "arbiter_harness",
    "metrics_support",
]
