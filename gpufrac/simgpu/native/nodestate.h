/*
 * simgpu node-state file: the one shared picture of a simulated GPU node.
 *
 * A fixed-layout file, mmap'd MAP_SHARED by every process that touches the
 * simulated node: the fake libnvidia-ml.so.1, the fake libcuda.so.1 and the
 * Python side (gpufrac/simgpu/nodestate.py mirrors this layout with ctypes;
 * a test compares offsets). The path comes from $SIMGPU_STATE.
 *
 * Concurrency: many processes read and write at once. Static fields are
 * written once, by the creator, before anyone maps the file. Dynamic fields
 * are C11 atomics (lock-free on x86-64 and aarch64), so a process killed at
 * any instruction leaves nothing locked. Process slots are claimed by CAS on
 * `pid`; a slot whose process is gone is reaped by whoever notices first
 * (CAS pid -> SIMGPU_PID_REAPING), which subtracts its usage exactly once.
 * The one exception is each GPU's compute schedule (which context runs when):
 * played under the GPU's sched_lock, a robust mutex, which the kernel hands on
 * (EOWNERDEAD) when a holder dies, so nothing stays locked there either.
 */
#ifndef GPUFRAC_SIMGPU_NODESTATE_H
#define GPUFRAC_SIMGPU_NODESTATE_H

#include <stdatomic.h>
#include <stdint.h>

#define SIMGPU_MAGIC 0x31305550474d4953ULL /* "SIMGPU01" little-endian */
#define SIMGPU_ABI_VERSION 2u /* 2: the compute model (time slices, context time) */

#define SIMGPU_MAX_GPUS 16
#define SIMGPU_MAX_NVLINKS 18
#define SIMGPU_MAX_PROCS 1024
#define SIMGPU_EVENT_RING 64
#define SIMGPU_CPU_WORDS 4 /* CPU affinity bitmask: 256 CPUs */
#define SIMGPU_SEG_RING 32 /* runs of a context kept to map its context time to wall time */
#define SIMGPU_SCHED_LOCK_BYTES 64 /* room for a pthread_mutex_t on every Linux ABI */
#define SIMGPU_SCHED_READY 0xffffffffu /* simgpu_gpu_t.sched_init once its lock is made */
#define SIMGPU_TIMESLICE_US 2000 /* the time slice when a spec names none (a guess: docs/simgpu.md) */

#define SIMGPU_UUID_LEN 80
#define SIMGPU_NAME_LEN 96
#define SIMGPU_BUSID_LEN 32

/* simgpu_gpu_t.nvlink_peer value for a link into an NVSwitch fabric (DGX/HGX):
 * every pair of GPUs with fabric links talks over NVLink. */
#define SIMGPU_NVLINK_NVSWITCH (-2)

#define SIMGPU_PID_FREE 0
#define SIMGPU_PID_REAPING (-1)

/* nvmlGpuTopologyLevel_t values, stored in simgpu_gpu_t.topo_level. */
#define SIMGPU_TOPO_INTERNAL 0
#define SIMGPU_TOPO_SINGLE 10
#define SIMGPU_TOPO_MULTIPLE 20
#define SIMGPU_TOPO_HOSTBRIDGE 30
#define SIMGPU_TOPO_NODE 40
#define SIMGPU_TOPO_SYSTEM 50

/* CUprocessState values (checkpoint API), stored in simgpu_proc_t.ckpt_state. */
#define SIMGPU_CKPT_RUNNING 0
#define SIMGPU_CKPT_LOCKED 1
#define SIMGPU_CKPT_CHECKPOINTED 2
#define SIMGPU_CKPT_FAILED 3

typedef struct {
    uint64_t seq;     /* 1-based sequence number; 0 = empty slot */
    uint64_t type;    /* NVML event type bit (nvmlEventTypeXidCriticalError = 8) */
    uint64_t data;    /* XID number */
    uint64_t time_us; /* CLOCK_REALTIME, microseconds */
} simgpu_event_t;

typedef struct {
    /* --- static, written by the creator --- */
    char uuid[SIMGPU_UUID_LEN];         /* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" */
    char name[SIMGPU_NAME_LEN];         /* "NVIDIA H100 80GB HBM3" */
    char pci_bus_id[SIMGPU_BUSID_LEN];  /* "00000000:18:00.0" (NVML format) */
    uint32_t pci_domain;
    uint32_t pci_bus;
    uint32_t pci_device;
    uint32_t pci_device_id;             /* (device << 16) | vendor 0x10de */
    uint32_t pci_subsystem_id;
    uint32_t minor;                     /* /dev/nvidiaN */
    int32_t numa_node;                  /* -1 if none */
    uint32_t nvlink_count;              /* links that exist (active or not) */
    int32_t nvlink_peer[SIMGPU_MAX_NVLINKS]; /* peer GPU index per link, -1 = none */
    uint32_t topo_level[SIMGPU_MAX_GPUS];    /* SIMGPU_TOPO_* to each GPU index */
    uint64_t cpu_affinity[SIMGPU_CPU_WORDS];
    uint64_t total_bytes;
    uint64_t reserved_bytes;            /* driver/firmware reservation (NVML v2 "reserved") */
    uint32_t sm_count;
    uint32_t cc_major;
    uint32_t cc_minor;
    uint16_t ctx_mib;                   /* device memory one CUDA context takes, MiB */
    uint8_t mig_mode;                   /* nvmlDeviceGetMigMode's current (and pending) mode: 1 = on */
    uint8_t pad0;                       /* (these four bytes were padding: same layout) */
    /* --- dynamic --- */
    _Atomic uint64_t used_bytes;        /* sum of live processes' physical allocations */
    _Atomic uint32_t util_gpu_override; /* 0 = derive from activity; else percent + 1 */
    _Atomic uint32_t util_mem_override;
    _Atomic uint32_t lost;              /* 1 = fell off the bus: NVML_ERROR_GPU_IS_LOST */
    _Atomic uint32_t pad1;
    _Atomic uint64_t event_seq;         /* last event sequence number written */
    simgpu_event_t events[SIMGPU_EVENT_RING]; /* ring: events[(seq-1) % RING] */
    /* --- compute model (simstate.c, sim_sched_*; docs/simgpu.md "Compute model") --- */
    uint32_t timeslice_us;              /* static: how long the driver lets one context hold the GPU
                                           while another has work */
    _Atomic uint32_t sched_init;        /* 0: lock not made; SIMGPU_SCHED_READY: made; else the maker's pid */
    uint32_t holder;                    /* 1 + the proc slot index whose context holds the GPU; 0 = none */
    uint32_t pad2;
    uint64_t sched_now_ns;              /* CLOCK_REALTIME ns up to which the schedule has been played */
    uint64_t slice_end_ns;              /* when the holder's time slice ends */
    _Atomic uint64_t busy_ns_total;     /* time some context's work ran (the device's busy time) */
    _Atomic uint64_t switches;          /* context switches played */
    unsigned char sched_lock[SIMGPU_SCHED_LOCK_BYTES]; /* pthread_mutex_t: robust, process-shared */
} simgpu_gpu_t;

/* One run of a context on the GPU: wall time [wall_ns, wall_ns + len_ns) was its
 * context time [ctx_ns, ctx_ns + len_ns). */
typedef struct {
    uint64_t wall_ns;
    uint64_t ctx_ns;
    uint64_t len_ns;
} simgpu_seg_t;

/* One slot per (process, GPU) that has touched the GPU. */
typedef struct {
    _Atomic int32_t pid;                /* SIMGPU_PID_FREE, SIMGPU_PID_REAPING, or owner pid */
    uint32_t gpu;                       /* GPU index; valid while pid > 0 */
    _Atomic uint64_t used_bytes;        /* physical memory held (0 while checkpointed) */
    _Atomic uint64_t swapped_bytes;     /* memory moved to host by a checkpoint */
    _Atomic uint64_t launches;          /* kernel launches, total */
    _Atomic uint64_t last_launch_ns;    /* CLOCK_REALTIME ns of the last launch; 0 = never */
    _Atomic uint64_t busy_until_ns;     /* CLOCK_REALTIME ns its last run on the GPU ended (played so far) */
    _Atomic uint64_t busy_ns_total;     /* time its work ran on the GPU (played so far), for utilisation */
    _Atomic uint32_t ckpt_state;        /* SIMGPU_CKPT_* (per process: same in all its slots) */
    _Atomic uint32_t api_inflight;      /* fake libcuda: API calls in progress (checkpoint lock waits for 0) */
    uint64_t start_time;                /* /proc/<pid>/stat starttime: guards against pid reuse */
    /* --- compute model: written under the GPU's sched_lock --- */
    uint64_t ctx_ns;                    /* context time: how long its work has held the GPU */
    uint64_t work_end_ns;               /* context time at which all its submitted work is done */
    uint64_t sm_end_ns;                 /* context time at which its kernels' SM work is done */
    uint64_t seg_count;                 /* runs recorded; the newest is segs[(seg_count-1) % RING] */
    simgpu_seg_t segs[SIMGPU_SEG_RING];
} simgpu_proc_t;

typedef struct {
    uint64_t magic;                     /* SIMGPU_MAGIC */
    uint32_t abi_version;               /* SIMGPU_ABI_VERSION */
    uint32_t file_size;                 /* sizeof(simgpu_node_t) */
    uint32_t gpu_count;
    uint32_t cuda_driver_version;       /* e.g. 12080 (cuDriverGetVersion) */
    char driver_version[32];            /* e.g. "570.124.06" */
    char nvml_version[32];              /* e.g. "12.570.124.06" */
    char node_name[64];
    uint32_t checkpoint_supported;      /* 1: cuCheckpointProcess* work */
    _Atomic uint32_t event_wake;        /* bumped after every posted event: the shared futex word
                                           nvmlEventSetWait sleeps on (was padding: same layout) */
    simgpu_gpu_t gpus[SIMGPU_MAX_GPUS];
    simgpu_proc_t procs[SIMGPU_MAX_PROCS];
} simgpu_node_t;

#endif
