/*
 * Helpers over the node-state file shared by the fake libnvidia-ml.so.1 and
 * the fake libcuda.so.1. Each library links its own (hidden) copy.
 */
#ifndef GPUFRAC_SIMGPU_SIMSTATE_H
#define GPUFRAC_SIMGPU_SIMSTATE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "nodestate.h"

#define SIM_HIDDEN __attribute__((visibility("hidden")))

/* The mapped $SIMGPU_STATE (mapped on first use). NULL if unset or invalid;
 * the reason goes to stderr. */
SIM_HIDDEN simgpu_node_t *sim_node(void);
/* Re-read $SIMGPU_STATE and map it if it names another file (nvmlInit and cuInit
 * call this, so one test process can use several simulated nodes in turn). */
SIM_HIDDEN simgpu_node_t *sim_node_reload(void);

SIM_HIDDEN uint64_t sim_now_ns(void); /* CLOCK_REALTIME */

/* Processes are named as the kernel's initial pid namespace names them, as a real driver
 * (in the kernel) does, whatever namespace they run in: this process's pid so (read off the
 * host's /proc, $SIMGPU_HOST_PROC, where the container runtime emulator mounts it for a pod
 * with a pid namespace of its own; getpid() elsewhere), and whether such a pid still exists. */
SIM_HIDDEN int32_t sim_self_pid(void);
SIM_HIDDEN int sim_pid_exists(int32_t pid);

/* This process's slot on `gpu`, claimed on first use. NULL if the table is full. */
SIM_HIDDEN simgpu_proc_t *sim_my_slot(simgpu_node_t *n, uint32_t gpu);

/* A slot given back by its own process: its liveness lock released (see simstate.c). */
SIM_HIDDEN void sim_slot_unlock(simgpu_node_t *n, const simgpu_proc_t *s);

/* Reap slots of processes that no longer exist; returns bytes given back. */
SIM_HIDDEN uint64_t sim_reap_dead(simgpu_node_t *n);

/* Take `bytes` of physical memory on `gpu` for the calling process; 0 on
 * success, -1 if it does not fit (physical OOM). Reaps dead processes once
 * before giving up. */
SIM_HIDDEN int sim_mem_take(simgpu_node_t *n, uint32_t gpu, uint64_t bytes);
SIM_HIDDEN void sim_mem_give(simgpu_node_t *n, uint32_t gpu, uint64_t bytes);

/* Append an event (e.g. XID) to a GPU's ring and wake every nvmlEventSetWait. */
SIM_HIDDEN void sim_post_event(simgpu_node_t *n, uint32_t gpu, uint64_t type, uint64_t data);

/* Sleep while the node's event_wake word still equals `seen`, at most timeout_ns
 * (a shared futex on the MAP_SHARED file: posters in any process wake it). May
 * return early (spuriously, on a signal); callers re-check their condition. */
SIM_HIDDEN void sim_event_sleep(simgpu_node_t *n, uint32_t seen, uint64_t timeout_ns);

/* Indices of GPUs visible to this process, after NVIDIA_VISIBLE_DEVICES
 * (container runtime) and, if `cuda` is set, CUDA_VISIBLE_DEVICES. Entries are
 * indices or UUIDs; "all" or unset = every GPU. Returns the count. */
SIM_HIDDEN int sim_visible_gpus(simgpu_node_t *n, int cuda, uint32_t out[SIMGPU_MAX_GPUS]);

#endif
