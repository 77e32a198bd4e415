"""The kubelet's DRA front end: gpufrac as a DRA driver (a node in mode dra).

A thin adapter, as gpufrac.deviceplugin is: registration on the kubelet's plugins_registry
(pluginregistration v1), the DRAPlugin service (v1, and v1beta1 for a kubelet that asks for
it) and the DRAResourceHealth service on the driver's socket; every decision (booking,
files, persistence, what a claim gets) belongs to its Backend, the agent's allocation
service (gpufrac.agent.booking.allocation_service). Imports gpufrac.core, gpufrac.memguard and
gpufrac.proto only (pyproject.toml's import-linter contract `dra`).
"""
