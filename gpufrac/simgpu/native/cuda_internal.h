/*
 * simgpu fake libcuda.so.1: declarations shared by its source files.
 *
 * The driver API types are declared here with the real layouts (no CUDA toolkit
 * needed to build). Objects handed out as handles (contexts, streams, events,
 * modules, pools, graphs, arrays) start with a cu_obj_t header and are kept in
 * a live-object set, so a stale or bogus handle is refused with an error code
 * instead of being dereferenced.
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

#include "simstate.h"

#define CU_API __attribute__((visibility("default")))

/* ------------------------------------------------------------------ driver API types */

typedef enum cudaError_enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_DEINITIALIZED = 4,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_ALREADY_MAPPED = 208,
    CUDA_ERROR_NOT_MAPPED = 211,
    CUDA_ERROR_UNSUPPORTED_LIMIT = 215,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701,
    CUDA_ERROR_CONTEXT_IS_DESTROYED = 709,
    CUDA_ERROR_NOT_PERMITTED = 800,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
    CUDA_ERROR_STREAM_CAPTURE_UNMATCHED = 903,
    CUDA_ERROR_TIMEOUT = 909,
    CUDA_ERROR_UNKNOWN = 999
} CUresult;

typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long cuuint64_t;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUarray_st *CUarray;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUuuid_st {
    char bytes[16];
} CUuuid;

typedef struct {
    int type; /* CUmemLocationType: 1 = device */
    int id;
} CUmemLocation;

typedef struct {
    int type;                 /* CUmemAllocationType: 1 = pinned */
    int requestedHandleTypes; /* CUmemAllocationHandleType */
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;

typedef struct {
    CUmemLocation location;
    int flags; /* CUmemAccess_flags: 0 none, 1 read, 3 read-write */
} CUmemAccessDesc;

typedef struct {
    int allocType;
    int handleTypes;
    CUmemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
} CUmemPoolProps;

typedef struct {
    size_t Width, Height;
    int Format;
    unsigned int NumChannels;
} CUDA_ARRAY_DESCRIPTOR;

typedef struct {
    size_t Width, Height, Depth;
    int Format;
    unsigned int NumChannels;
    unsigned int Flags;
} CUDA_ARRAY3D_DESCRIPTOR;

typedef struct {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    void *attrs; /* CUlaunchAttribute *: accepted, ignored */
    unsigned int numAttrs;
} CUlaunchConfig;

typedef struct {
    CUfunction func;
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    void **kernelParams;
    void **extra;
} CUDA_KERNEL_NODE_PARAMS_v1;

typedef struct {
    CUfunction func;
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    void **kernelParams;
    void **extra;
    void *kern; /* CUkernel */
    CUcontext ctx;
} CUDA_KERNEL_NODE_PARAMS_v2;

/* Checkpoint API arguments: 64 bytes each; reserved bytes must be zero. */
typedef struct {
    unsigned int timeoutMs; /* 0 = no timeout */
    unsigned int reserved0;
    cuuint64_t reserved1[7];
} CUcheckpointLockArgs;
typedef struct {
    cuuint64_t reserved[8];
} CUcheckpointCheckpointArgs;
typedef struct {
    CUuuid oldUuid, newUuid;
} CUcheckpointGpuPair;
typedef struct {
    CUcheckpointGpuPair *gpuPairs;
    unsigned int gpuPairsCount;
    char reserved[52 - sizeof(void *)];
    cuuint64_t reserved1;
} CUcheckpointRestoreArgs;
typedef struct {
    cuuint64_t reserved[8];
} CUcheckpointUnlockArgs;

#define CU_STREAM_LEGACY ((CUstream)0x1)
#define CU_STREAM_PER_THREAD ((CUstream)0x2)
#define CU_LAUNCH_PARAM_END ((void *)0x00)
#define CU_LAUNCH_PARAM_BUFFER_POINTER ((void *)0x01)
#define CU_LAUNCH_PARAM_BUFFER_SIZE ((void *)0x02)

/* ------------------------------------------------------------------ objects */

enum { OBJ_CTX = 1, OBJ_STREAM, OBJ_EVENT, OBJ_MODULE, OBJ_FUNC, OBJ_POOL, OBJ_GRAPH, OBJ_GRAPH_NODE,
       OBJ_GRAPH_EXEC, OBJ_ARRAY, OBJ_VMM_ALLOC };

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
    _Atomic uint64_t done_ns;
    struct CUgraph_st *capture; /* non-NULL while capturing */
};

struct CUctx_st {
    cu_obj_t hdr;
    int dev;            /* ordinal */
    uint32_t gpu;       /* physical GPU index in the node state */
    unsigned int flags;
    int primary;
    int refs;           /* primary: retain count; 0 = inactive */
    CUresult sticky;    /* a kernel fault poisons the context, as on a real GPU */
    _Atomic uint64_t done_ns; /* when the last work submitted in this context completes */
    uint64_t id;
    struct CUstream_st null_stream; /* NULL, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD */
};

struct CUevent_st {
    cu_obj_t hdr;
    unsigned int flags;
    int recorded;
    uint64_t at_ns; /* completion time of the work it was recorded after */
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

enum { MEM_DEVICE = 1, MEM_PITCH, MEM_MANAGED, MEM_HOST, MEM_ARRAY, MEM_POOL, MEM_VMM };

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
/* Free every allocation of `ctx` (context destroy / primary reset). */
SIM_HIDDEN void cu_mem_free_ctx(struct CUctx_st *ctx);
/* Allocate device memory charged to the current context's GPU. */
SIM_HIDDEN CUresult cu_mem_alloc(CUdeviceptr *dptr, size_t size, uint8_t kind, unsigned int flags);
SIM_HIDDEN CUresult cu_mem_free(CUdeviceptr dptr);
SIM_HIDDEN void cu_array_release(struct CUarray_st *a);

/* ------------------------------------------------------------------ streams, kernels (cuda_exec.c) */

/* Resolve a stream handle (NULL, legacy and per-thread mean the context's null stream). */
SIM_HIDDEN CUresult cu_stream_get(CUstream h, struct CUctx_st **ctx, struct CUstream_st **s);
/* Account simulated busy time for work submitted to a stream. */
SIM_HIDDEN void cu_stream_work(struct CUctx_st *ctx, struct CUstream_st *s, uint64_t dur_ns, int launch);
SIM_HIDDEN void cu_sleep_until(uint64_t t_ns);
/* Gather a launch's arguments (kernelParams or the packed `extra` buffer) into buf. */
SIM_HIDDEN CUresult cu_kernel_pack(const struct CUfunc_st *f, void **params, void **extra,
                                   unsigned char buf[KERN_MAX_PARAM_BYTES]);
/* Run a fake kernel on a stream: real bytes now, simulated busy time on the stream. */
SIM_HIDDEN void cu_kernel_exec(struct CUctx_st *ctx, struct CUstream_st *s, int kernel, const unsigned char *buf);
/* Record a kernel launch into a graph being captured (cuda_graph.c). */
SIM_HIDDEN CUresult cu_graph_capture_kernel(struct CUgraph_st *g, const struct CUfunc_st *f,
                                            const unsigned char *buf);
SIM_HIDDEN void cu_ctx_streams_destroy(struct CUctx_st *ctx);

/* ------------------------------------------------------------------ pools (cuda_pool.c) */

/* Release free pool memory above each pool's release threshold (at synchronize). */
SIM_HIDDEN void cu_pools_release(void);
/* Pool block being freed by cuMemFree/cuMemFreeAsync: back to its pool. */
SIM_HIDDEN CUresult cu_pool_free_block(const cu_alloc_t *a);

/* ------------------------------------------------------------------ symbol table (cuda.c) */

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
extern SIM_HIDDEN const cu_sym_t cu_syms_core[], cu_syms_ctx[], cu_syms_mem[], cu_syms_copy[], cu_syms_pool[], cu_syms_vmm[],
    cu_syms_exec[], cu_syms_graph[], cu_syms_ckpt[];
extern SIM_HIDDEN const size_t cu_syms_core_n, cu_syms_ctx_n, cu_syms_mem_n, cu_syms_copy_n, cu_syms_pool_n, cu_syms_vmm_n,
    cu_syms_exec_n, cu_syms_graph_n, cu_syms_ckpt_n;

static inline size_t cu_round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

#define CU_GRANULARITY ((size_t)2 << 20) /* VMM and pool granularity: 2 MiB */

#endif
