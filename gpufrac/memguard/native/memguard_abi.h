/*
 * memguard shared file formats: the contract between the agent and the shim.
 *
 * Per container the agent creates a host directory (mounted into the container
 * at $GPUFRAC_CONTAINER_DIR, default /var/run/gpufrac) holding:
 *   config  - written by the agent only; mounted read-only; the shim maps it
 *             PROT_READ. Updated in place under a seqlock (odd seq = writing).
 *   usage   - written by the shim (every process of the container); one slot
 *             per process plus the container-wide total, all C11 atomics.
 *   compute - written by the shim (every process of the container): the container's
 *             launch clock while its compute share holds its launches back (the pace
 *             itself is the agent's, in config). Optional: without it (a container
 *             admitted by an older agent) each process keeps a clock of its own.
 *   arbiter/arbiter.sock - the agent's unix socket for the slow path (bursts,
 *             swap-in), the container's own, in a directory mounted read-only: a restarted
 *             agent binds a new socket (a new inode) there, which a mount of the
 *             directory shows and a mount of the socket file would not. Containers
 *             admitted by an older agent have the socket file mounted at
 *             arbiter.sock instead; the shim falls back to that.
 * gpufrac/memguard/abi.py mirrors these structs with ctypes; a test
 * compiles a probe against this header and compares sizes and offsets.
 *
 * No lock lives in either file: a process killed at any instruction leaves
 * both files consistent (its slot is reclaimed by the next one to notice).
 */
#ifndef GPUFRAC_MEMGUARD_ABI_H
#define GPUFRAC_MEMGUARD_ABI_H

#include <stdatomic.h>
#include <stdint.h>

#define MG_CONFIG_MAGIC 0x3147464347464d47ULL /* "GMFGCFG1" little-endian */
#define MG_USAGE_MAGIC 0x3147534547464d47ULL  /* "GMFGESG1" little-endian */
#define MG_COMPUTE_MAGIC 0x3150434347464d47ULL /* "GMFGCCP1" little-endian */
#define MG_ABI_VERSION 1u

#define MG_MAX_PROCS 256
#define MG_UUID_LEN 80
#define MG_NAME_LEN 128

#define MG_CONFIG_FILE "config"
#define MG_USAGE_FILE "usage"
#define MG_COMPUTE_FILE "compute"
#define MG_SOCKET_DIR "arbiter"
#define MG_SOCKET_FILE "arbiter.sock"
#define MG_DEFAULT_DIR "/var/run/gpufrac"

/* config.flags */
#define MG_FLAG_POD_KNOWN (1u << 0)   /* limit comes from the pod's annotations */
#define MG_FLAG_PREEMPTIBLE (1u << 1) /* burst memory may be reclaimed by killing */
#define MG_FLAG_SWAPPABLE (1u << 2)   /* may be swapped to host RAM */
#define MG_FLAG_WHOLE_GPU (1u << 3)   /* whole GPU(s): account, never limit */
#define MG_FLAG_DISABLED (1u << 4)    /* agent revoked the container: refuse all allocations */

/* The least config.arbiter_timeout_ms the agent writes (its config refuses less: the agent must
 * read a request within it, gpufrac/core/units.py); the shim reads a smaller value as this one.
 * Both timeouts are otherwise read as written, the whole u32 range (the agent's read timeout and
 * wait resolver use the same figures). */
#define MG_MIN_ARBITER_TIMEOUT_MS 100u

/* config.workload_class */
#define MG_CLASS_BATCH 0
#define MG_CLASS_INTERACTIVE 1
#define MG_CLASS_INFERENCE 2

typedef struct {
    uint64_t magic;                  /* MG_CONFIG_MAGIC */
    uint32_t abi_version;            /* MG_ABI_VERSION */
    uint32_t file_size;              /* sizeof(mg_config_t) */
    _Atomic uint64_t seq;            /* seqlock: odd while the agent writes */
    uint64_t generation;             /* bumped by every agent update */
    char gpu_uuid[MG_UUID_LEN];      /* the GPU this container's memory lives on */
    uint64_t request_bytes;          /* guaranteed */
    uint64_t limit_bytes;            /* hard ceiling, >= request */
    uint64_t grant_bytes;            /* current burst grant above request (<= limit - request) */
    uint32_t flags;                  /* MG_FLAG_* */
    uint32_t workload_class;         /* MG_CLASS_* */
    uint32_t arbiter_timeout_ms;     /* give up on the agent after this long */
    uint32_t wait_timeout_ms;        /* wait resolver bound for this container */
    int32_t priority;                /* pod.spec.priority */
    /* The container's compute share as a launch pace: while non-zero, its kernel and graph
     * launches (all its processes together) start at least this many ns apart. Written by
     * the agent alone, outside the seqlock (one aligned word, read with one atomic load on
     * every launch); 0 = launches pass at once. Was padding: an older shim ignores it. */
    _Atomic uint32_t compute_pace_ns;
    /* informational, for `gpufrac memguard inspect` and logs */
    char namespace_[64];
    char pod[MG_NAME_LEN];
    char container[64];
    char pod_uid[40];
} mg_config_t;

typedef struct {
    _Atomic int32_t pid;             /* 0 free, -1 being reaped, >0 owner (container pid ns) */
    _Atomic int32_t host_pid;        /* its pid as NVML names it, from the agent (0: not known);
                                        what was padding: same layout, same ABI version */
    uint64_t start_time;             /* /proc/self/stat starttime (ticks since boot) */
    _Atomic uint64_t used_bytes;     /* this process's counted GPU memory */
    _Atomic uint64_t peak_bytes;
    _Atomic uint64_t launches;       /* kernel/graph launches */
    _Atomic uint64_t last_activity_ns; /* CLOCK_MONOTONIC ns of the last launch */
    _Atomic uint64_t oom_refusals;   /* allocations the shim refused */
    _Atomic uint32_t swapped;        /* 1 while the agent holds it swapped out */
    _Atomic uint32_t pad1;
} mg_proc_slot_t;

typedef struct {
    uint64_t magic;                  /* MG_USAGE_MAGIC */
    uint32_t abi_version;
    uint32_t file_size;              /* sizeof(mg_usage_t) */
    _Atomic uint64_t total_used;     /* container-wide: reserved by CAS before the real allocation */
    _Atomic uint64_t grant_returned; /* bytes of grant the shim no longer needs (agent reclaims) */
    mg_proc_slot_t slots[MG_MAX_PROCS];
} mg_usage_t;

/* The compute file: the shim's launch clock, shared by the container's processes. The
 * tenant can write it, so it steers only the tenant's own launches; what the agent
 * decides rests on the driver's utilisation figures (docs/compute.md). */
typedef struct {
    uint64_t magic;                  /* MG_COMPUTE_MAGIC */
    uint32_t abi_version;            /* MG_ABI_VERSION */
    uint32_t file_size;              /* sizeof(mg_compute_t) */
    _Atomic uint64_t next_ns;        /* CLOCK_MONOTONIC ns: the next free launch slot while paced */
    _Atomic uint64_t held_ns;        /* time launches waited for their slot, all processes */
    _Atomic uint64_t held_launches;  /* launches that waited */
    _Atomic uint64_t paced_launches; /* launches that took a slot */
} mg_compute_t;

/*
 * Slow path on arbiter/arbiter.sock (the agent's side: gpufrac/agent/arbiter/,
 * docs/arbiter-protocol.md). One request and one reply per connection, both fixed-size,
 * native byte order. The agent identifies the caller by SO_PEERCRED, never by
 * `pid`. On MG_BURST_GRANTED the agent has ALREADY published the larger
 * grant_bytes in config (generation >= rep.generation) before replying; the
 * shim then re-reads the config and retries its reservation. Anything else
 * (denial, timeout, short reply, bad magic) makes the allocation fail with
 * CUDA_ERROR_OUT_OF_MEMORY.
 */
#define MG_BURST_MAGIC 0x3142474dU /* "MGB1" little-endian */
#define MG_BURST_OP_BURST 1u
#define MG_BURST_GRANTED 0u
#define MG_BURST_DENIED 1u
/* Added with the arbiter (docs/arbiter-protocol.md). RELEASE: the shim gives back
 * grant it no longer uses (`bytes` informational; the agent re-reads usage), so
 * waiters wake at once. SWAP_IN: reserved for the swap resolver. Every status but
 * GRANTED means refused; the others only say why. */
#define MG_BURST_OP_RELEASE 2u
#define MG_BURST_OP_SWAP_IN 3u
#define MG_BURST_REFUSED 2u     /* caller is not a container this agent serves */
#define MG_BURST_INVALID 3u     /* malformed request (magic, version, op, size) */
#define MG_BURST_UNAVAILABLE 4u /* op not available on this node */
/* RECLAIM: the driver refused an allocation that stays within the container's
 * request (its guarantee is held by others' bursts): the agent takes burst memory
 * back for it; GRANTED means the request is physically free again, retry once. */
#define MG_BURST_OP_RECLAIM 4u
/* The caller's container is over its per-container arbiter limits (connections,
 * requests in flight, request rate): refused at once, like every status but GRANTED. */
#define MG_BURST_BUSY 5u
/* IDENTIFY: the caller asks for its own pid as the agent sees it (SO_PEERCRED, the host's
 * pid namespace, where NVML's pids are): GRANTED carries it in the reply's `generation`. */
#define MG_BURST_OP_IDENTIFY 5u

typedef struct {
    uint32_t magic;        /* MG_BURST_MAGIC */
    uint16_t version;      /* MG_ABI_VERSION */
    uint16_t op;           /* MG_BURST_OP_BURST */
    int32_t pid;           /* informational (container pid namespace) */
    uint32_t pad0;
    uint64_t bytes;        /* the allocation that does not fit request + grant */
    uint64_t total_after;  /* container total_used if it were granted */
    uint64_t generation;   /* config generation the shim decided on */
} mg_burst_req_t;

typedef struct {
    uint32_t magic;        /* MG_BURST_MAGIC */
    uint16_t version;      /* MG_ABI_VERSION */
    uint16_t status;       /* MG_BURST_GRANTED / MG_BURST_DENIED */
    uint64_t generation;   /* config generation that carries the grant */
} mg_burst_rep_t;

#endif
