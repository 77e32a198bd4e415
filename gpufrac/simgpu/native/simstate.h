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

/* ------------------------------------------------------------------ the compute model
 * (docs/simgpu.md "Compute model"). Each GPU runs one context's work at a time: a
 * context with work holds it for up to the GPU's time slice while another context
 * has work, round robin; a context alone keeps it. A context's own clock, its
 * *context time* (simgpu_proc_t.ctx_ns), advances only while it holds the GPU with
 * work, so a kernel's completion is a context time, fixed when it is submitted,
 * and the wall time it is reached depends on everyone else's work. The schedule
 * is played lazily, up to now, by whoever looks: a launch, a wait, a query, NVML.
 * One slot per (process, GPU) is one context: a process's contexts on one GPU are
 * merged. */

/* Lock `gpu`'s schedule and play it up to now (returned). Short: never sleep inside. */
SIM_HIDDEN uint64_t sim_sched_enter(simgpu_node_t *n, uint32_t gpu);
SIM_HIDDEN void sim_sched_leave(simgpu_node_t *n, uint32_t gpu);
/* Inside enter/leave: submit a kernel of `s` that may start at context time `ready`
 * (its stream's last work), runs `dur_ns` when it has the SMs it asks for and asks
 * for `blocks` thread blocks (one per SM at a time). Returns its end, in context time. */
SIM_HIDDEN uint64_t sim_sched_kernel(simgpu_node_t *n, uint32_t gpu, simgpu_proc_t *s, uint64_t ready,
                                     uint64_t dur_ns, uint64_t blocks);
/* Has `s`'s context time reached `target`? (Plays the schedule; also true once its work
 * was dropped, or the slot is no longer this process's.) */
SIM_HIDDEN int sim_sched_reached(simgpu_node_t *n, uint32_t gpu, simgpu_proc_t *s, uint64_t target);
/* Inside enter/leave, `now` as enter returned it: is `s`'s work (NULL: anyone's) on the GPU now? */
SIM_HIDDEN int sim_sched_running(simgpu_node_t *n, uint32_t gpu, const simgpu_proc_t *s, uint64_t now);
/* Has the context of slot `s` (any process's) no work left to run? (Plays the schedule.) */
SIM_HIDDEN int sim_sched_idle(simgpu_node_t *n, uint32_t gpu, simgpu_proc_t *s);
/* Sleep until `s`'s context time reaches `target` (0: all the work it has now). */
SIM_HIDDEN void sim_sched_wait(simgpu_node_t *n, uint32_t gpu, simgpu_proc_t *s, uint64_t target);
/* The wall time (CLOCK_REALTIME ns) at which `s`'s context time reached `target`; 0 if it
 * has not yet. From the context's recent runs; an older one reads as the oldest kept. */
SIM_HIDDEN uint64_t sim_sched_wall_at(simgpu_node_t *n, uint32_t gpu, simgpu_proc_t *s, uint64_t target);

#endif
