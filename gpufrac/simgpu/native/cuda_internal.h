/*
 * simgpu fake libcuda.so.1: declarations shared by its source files.
 *
 * The driver API's types are in cuda_abi.h. Objects handed out as handles
 * (contexts, streams, events, modules, pools, graphs, arrays) start with a
 * cu_obj_t header and are kept in a live-object set, so a stale or bogus handle
 * is refused with an error code instead of being dereferenced.
 *
 * Device memory is host memory (mmap'd, MAP_NORESERVE), but every physical
 * allocation is charged to the simulated GPU in the node-state file and to this
 * process's proc slot there (cu_charge / cu_uncharge).
 */
#ifndef GPUFRAC_SIMGPU_CUDA_INTERNAL_H
#define GPUFRAC_SIMGPU_CUDA_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "cuda_abi.h"
#include "simstate.h"

#define CU_API __attribute__((visibility("default")))

/* ------------------------------------------------------------------ objects */

enum { OBJ_CTX = 1, OBJ_STREAM, OBJ_EVENT, OBJ_MODULE, OBJ_FUNC, OBJ_POOL, OBJ_GRAPH, OBJ_GRAPH_NODE,
       OBJ_GRAPH_EXEC, OBJ_ARRAY, OBJ_VMM_ALLOC, OBJ_MIPMAP };

typedef struct {
    uint32_t kind;
    uint32_t pad;
    struct CUctx_st *ctx; /* owning context (NULL for node-wide objects) */
} cu_obj_t;

/* Fake kernels of the built-in module (docs/simgpu.md has the params ABI). */
enum { KERN_FILL_U32 = 1, KERN_CHECK_U32, KERN_BUSY_US };
#define KERN_MAX_PARAM_BYTES 32

struct CUstream_st {
    cu_obj_t hdr;
    unsigned int flags;
    int priority;
    uint64_t id;
    _Atomic uint64_t done_ctx; /* context time at which its last work completes (the compute model) */
    struct CUgraph_st *capture; /* non-NULL while capturing */
};

#define CU_NLIMITS 11 /* CUlimit values 0..10 */

struct CUctx_st {
    cu_obj_t hdr;
    int dev;            /* ordinal */
    uint32_t gpu;       /* physical GPU index in the node state */
    unsigned int flags;
    int primary;
    int refs;           /* primary: retain count; 0 = inactive */
    CUresult sticky;    /* a kernel fault poisons the context, as on a real GPU */
    _Atomic uint64_t done_ctx; /* context time at which the last work submitted in it completes */
    uint64_t id;
    uint64_t charged;   /* device memory the context itself holds (cu_ctx_charge) */
    size_t limits[CU_NLIMITS]; /* cuCtxSetLimit values */
    uint64_t limit_charged[CU_NLIMITS]; /* device memory each limit holds above the default */
    struct CUstream_st null_stream; /* NULL, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD */
};

struct CUevent_st {
    cu_obj_t hdr;
    unsigned int flags;
    int recorded;
    uint32_t gpu;     /* the GPU of the stream it was recorded on */
    uint64_t at_ctx;  /* context time of the work it was recorded after */
    _Atomic uint64_t at_wall; /* wall time that work completed; 0 while not known yet */
};

struct CUfunc_st {
    cu_obj_t hdr;
    int kernel; /* KERN_* */
    const char *name;
    struct CUmod_st *mod;
};

struct CUmod_st {
    cu_obj_t hdr;
    struct CUfunc_st funcs[3];
    uint64_t charged; /* device memory of its code and data */
    uint32_t gpu;
};

/* ------------------------------------------------------------------ shared state (cuda.c) */

extern SIM_HIDDEN simgpu_node_t *_Atomic cu_g_node;
extern SIM_HIDDEN int cu_g_ndev;
extern SIM_HIDDEN uint32_t cu_g_devs[SIMGPU_MAX_GPUS]; /* ordinal -> physical GPU index */

static inline int cu_initialized(void) { return atomic_load_explicit(&cu_g_node, memory_order_acquire) != NULL; }
static inline simgpu_node_t *cu_node(void) { return atomic_load_explicit(&cu_g_node, memory_order_acquire); }

/* Checkpoint gate: every API entry counts itself in this process's gate slot and
 * waits while the process is LOCKED or CHECKPOINTED (see cuda_ckpt.c). */
extern SIM_HIDDEN simgpu_proc_t *_Atomic cu_g_gate_slot;
typedef struct {
    simgpu_proc_t *slot;
} cu_gate_t;
SIM_HIDDEN cu_gate_t cu_gate_enter(void);
static inline void cu_gate_leave(cu_gate_t *g) {
    if (g->slot) atomic_fetch_sub(&g->slot->api_inflight, 1);
}
/* First statement of every API function that touches the device. */
#define CU_ENTER()                                                                 \
    __attribute__((cleanup(cu_gate_leave))) cu_gate_t cu_gate_ = cu_gate_enter(); \
    (void)cu_gate_;                                                                \
    if (!cu_initialized()) return CUDA_ERROR_NOT_INITIALIZED

/* Contexts (cuda.c). */
SIM_HIDDEN struct CUctx_st *cu_current_ctx(void);
/* The calling thread's current context, or an error if there is none / it is dead. */
SIM_HIDDEN CUresult cu_need_ctx(struct CUctx_st **out);
SIM_HIDDEN CUresult cu_check_dev(CUdevice dev);
/* Claim this process's proc slot on a GPU (the process appears in NVML). */
SIM_HIDDEN simgpu_proc_t *cu_slot(uint32_t gpu);

/* Live-object set (cuda.c). */
SIM_HIDDEN void cu_obj_add(void *obj, uint32_t kind, struct CUctx_st *ctx);
SIM_HIDDEN int cu_obj_del(void *obj, uint32_t kind); /* 1 if it was live */
SIM_HIDDEN int cu_obj_ok(const void *obj, uint32_t kind);
/* Up to `max` live objects of `kind` owned by `ctx`; returns the count. */
SIM_HIDDEN size_t cu_obj_owned(uint32_t kind, struct CUctx_st *ctx, void **out, size_t max);

/* ------------------------------------------------------------------ memory (cuda_mem.c) */

enum { MEM_DEVICE = 1, MEM_PITCH, MEM_MANAGED, MEM_HOST, MEM_ARRAY, MEM_POOL, MEM_VMM, MEM_GRAPH };

typedef struct {
    uintptr_t base;
    size_t size;     /* addressable size */
    size_t charged;  /* bytes charged to the GPU (0 for host / VMM / pool blocks) */
    uint32_t gpu;
    uint8_t kind;
    uint8_t access;  /* VMM: CUmemAccess_flags currently set */
    struct CUctx_st *ctx;
    void *owner;     /* pool or VMM allocation handle */
    unsigned int flags;
} cu_alloc_t;

SIM_HIDDEN CUresult cu_charge(uint32_t gpu, uint64_t bytes);
SIM_HIDDEN void cu_uncharge(uint32_t gpu, uint64_t bytes);
SIM_HIDDEN void *cu_map_anon(size_t size, int prot); /* NULL on failure */
SIM_HIDDEN void cu_unmap(void *p, size_t size);
SIM_HIDDEN int cu_reg_insert(const cu_alloc_t *a);          /* 0 ok, -1 no memory */
SIM_HIDDEN int cu_reg_remove(uintptr_t base, cu_alloc_t *out); /* exact base; 0 ok */
SIM_HIDDEN int cu_reg_find(uintptr_t p, cu_alloc_t *out);     /* allocation containing p */
SIM_HIDDEN int cu_reg_overlaps(uintptr_t p, size_t len);       /* any allocation in [p, p+len)? */
SIM_HIDDEN int cu_reg_set_access(uintptr_t base, uint8_t access); /* exact base; 0 ok */
/* Is [p, p+len) inside one device-accessible allocation (write access if `write`)? */
SIM_HIDDEN int cu_dev_range_ok(uintptr_t p, size_t len, int write);
/* Is p inside a VMM address reservation (cuda_vmm.c)? Such addresses are never host memory. */
SIM_HIDDEN int cu_vmm_reserved(uintptr_t p);
/* CUmemLocation checks (cuda_vmm.c): a valid location; a host-located one. */
SIM_HIDDEN int cu_loc_ok(const CUmemLocation *l);
SIM_HIDDEN int cu_loc_host(const CUmemLocation *l);
/* Free every allocation of `ctx` (context destroy / primary reset). */
SIM_HIDDEN void cu_mem_free_ctx(struct CUctx_st *ctx);
/* Allocate device memory charged to the current context's GPU. */
SIM_HIDDEN CUresult cu_mem_alloc(CUdeviceptr *dptr, size_t size, uint8_t kind, unsigned int flags);
SIM_HIDDEN CUresult cu_mem_free(CUdeviceptr dptr);
SIM_HIDDEN void cu_array_release(struct CUarray_st *a); /* cuda_array.c */
SIM_HIDDEN void cu_mipmap_release(struct CUmipmappedArray_st *m);

/* ------------------------------------------------------------------ streams, kernels (cuda_exec.c, cuda_launch.c) */

/* Resolve a stream handle (NULL, legacy and per-thread mean the context's null stream). */
SIM_HIDDEN CUresult cu_stream_get(CUstream h, struct CUctx_st **ctx, struct CUstream_st **s);
/* Declare `c` and `s` for stream handle `h`, or return the error from the API function. */
#define CU_STREAM(h, c, s)                              \
    struct CUctx_st *c;                                 \
    struct CUstream_st *s;                              \
    do {                                                \
        CUresult stream_r_ = cu_stream_get((h), &c, &s); \
        if (stream_r_) return stream_r_;                \
    } while (0)
/* Submit a kernel of `dur_ns` asking for `blocks` thread blocks to a stream: the compute
 * model (simstate.h sim_sched_*) places it, and the process's slot counts the launch. */
SIM_HIDDEN void cu_stream_kernel(struct CUctx_st *ctx, struct CUstream_st *s, uint64_t dur_ns, uint64_t blocks);
/* Has the context's GPU work reached context time `target`? Sleep until it has. */
SIM_HIDDEN int cu_ctx_reached(struct CUctx_st *ctx, uint64_t target);
SIM_HIDDEN void cu_ctx_wait(struct CUctx_st *ctx, uint64_t target);
SIM_HIDDEN void cu_sleep_until(uint64_t t_ns);
/* Gather a launch's arguments (kernelParams or the packed `extra` buffer) into buf. */
SIM_HIDDEN CUresult cu_kernel_pack(const struct CUfunc_st *f, void **params, void **extra,
                                   unsigned char buf[KERN_MAX_PARAM_BYTES]);
/* Run a fake kernel of `blocks` thread blocks on a stream: real bytes now, simulated time on the GPU. */
SIM_HIDDEN void cu_kernel_exec(struct CUctx_st *ctx, struct CUstream_st *s, int kernel, uint64_t blocks,
                               const unsigned char *buf);
/* Record a kernel launch into a graph being captured (cuda_graph.c). */
SIM_HIDDEN CUresult cu_graph_capture_kernel(struct CUgraph_st *g, const struct CUfunc_st *f, uint64_t blocks,
                                            const unsigned char *buf);
SIM_HIDDEN void cu_ctx_streams_destroy(struct CUctx_st *ctx);
/* Stream-ordered allocation / free on a capturing stream: a memory node (cuda_graph.c). */
SIM_HIDDEN CUresult cu_graph_capture_alloc(struct CUgraph_st *g, int dev, size_t size, CUdeviceptr *dptr);
SIM_HIDDEN CUresult cu_graph_capture_free(struct CUgraph_st *g, CUdeviceptr dptr);

/* Per-thread default stream twins (_ptds / _ptsz). In the simulation the
 * per-thread and legacy default streams are the same queue (work runs at
 * submission), so each twin forwards to its legacy sibling; they exist so that
 * callers resolving them by name or with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
 * find real symbols. */
#define CU_TWIN(twin, legacy, params, args) \
    CU_API CUresult twin params;            \
    CU_API CUresult twin params { return legacy args; }

/* ------------------------------------------------------------------ pools (cuda_pool.c) */

/* Release free pool memory above each pool's release threshold (at synchronize). */
SIM_HIDDEN void cu_pools_release(void);
/* Pool block being freed by cuMemFree/cuMemFreeAsync: back to its pool. */
SIM_HIDDEN CUresult cu_pool_free_block(const cu_alloc_t *a);

/* ------------------------------------------------------------------ symbol table (cuda_procaddr.c) */

typedef struct {
    const char *name; /* the name cuGetProcAddress is asked for (base name) */
    int version;      /* CUDA version that introduced this variant */
    int ptds;         /* 1: the per-thread default stream variant (_ptds/_ptsz) */
    void *fn;
    const char *symbol; /* exported symbol */
} cu_sym_t;

#define CU_SYM(name, version, fn) {name, version, 0, (void *)(fn), #fn}
#define CU_SYM_PT(name, version, fn) {name, version, 1, (void *)(fn), #fn}

/* Each area contributes its section of the one symbol table. */
extern SIM_HIDDEN const cu_sym_t cu_syms_core[], cu_syms_ctx[], cu_syms_mem[], cu_syms_array[], cu_syms_copy[],
    cu_syms_pool[], cu_syms_vmm[], cu_syms_exec[], cu_syms_launch[], cu_syms_graph[],
    cu_syms_graph_exec[], cu_syms_ckpt[];
extern SIM_HIDDEN const size_t cu_syms_core_n, cu_syms_ctx_n, cu_syms_mem_n, cu_syms_array_n, cu_syms_copy_n,
    cu_syms_pool_n, cu_syms_vmm_n, cu_syms_exec_n, cu_syms_launch_n, cu_syms_graph_n,
    cu_syms_graph_exec_n, cu_syms_ckpt_n;

static inline size_t cu_round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

#define CU_GRANULARITY ((size_t)2 << 20) /* VMM and pool granularity: 2 MiB */

#endif
