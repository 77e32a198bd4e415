/*
 * memguard: the CUDA allocation shim (LD_PRELOAD).
 *
 * It holds every process of a container to the container's GPU-memory request
 * and limit, which the agent publishes in $GPUFRAC_CONTAINER_DIR/config
 * (memguard_abi.h). Usage is counted per container in the shared usage file.
 *
 * How calls reach the hooks. One table (MG_SYMBOLS below) lists every entry
 * point: exported name, the base name and cudaVersion under which the driver's
 * cuGetProcAddress hands it out, per-thread-stream variant or not, and the
 * hook. It drives all three ways a program finds a driver function:
 *   1. direct symbol: each hook is exported under the driver's name, so a
 *      program linked against libcuda binds to it first (LD_PRELOAD);
 *   2. dlsym(handle, name) on a libcuda / libnvidia-ml handle (ctypes, pynvml,
 *      cudart's bootstrap): dlsym itself is overridden; when the real lookup
 *      returns the driver's own function for a table entry, the hook is
 *      returned instead;
 *   3. cuGetProcAddress / _v2 (CUDA 12 runtimes, cuda-python): the real query
 *      runs first, so the driver keeps deciding which variant (legacy, _v2,
 *      _ptsz) a (name, version, flags) means; the answer is swapped for the
 *      hook of that variant (matched by address, else by the table's versions).
 * The real function behind each entry is resolved once, by name, from the
 * already-loaded driver library, and cached in g_real[].
 *
 * Accounting. usage->total_used is the container's total: bytes are reserved
 * there by CAS *before* the real allocation (so concurrent processes can never
 * overshoot the limit together) and given back if the driver fails. Each
 * process owns a slot (claimed by CAS on pid) holding its own bytes, so when it
 * dies whoever notices subtracts exactly those bytes once (CAS pid -> -1).
 * Every subtraction saturates at zero. No lock is shared between processes;
 * a process killed at any instruction leaves both files usable.
 * Per process, device pointers / array handles / VMM handles map to their
 * counted size in lock-free open-addressing tables (no per-call scans).
 *
 * Order of the two counters: a kill landing between the total and the slot
 * update can only leave the container over-counted by that one allocation
 * (never under-counted, which would loosen the limit): on allocation the total
 * is charged before the slot, on free the slot is credited before the total.
 * A kill during the real driver call is exact: both counters hold the bytes.
 *
 * Fast path (within request + grant): atomic loads of the config under its
 * seqlock, one CAS on the total, relaxed atomics on the slot and one table
 * insert: no syscall, no getenv, no lock, no scan.
 *
 * Memory pools (cuMemAllocAsync & co.) also count what a pool keeps reserved
 * after frees; see "stream-ordered allocation" below. Those calls take a
 * process-local mutex (never one in a shared file) and read the pool's
 * attributes through the driver.
 */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "memguard_abi.h"
#include "mg_internal.h"

#define MG_LIKELY(x) __builtin_expect(!!(x), 1)
#define MG_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define MG_EXPORT __attribute__((visibility("default")))
#define MG_COLD __attribute__((cold, noinline))
/* dlsym is called by the sanitizer runtimes while they start (before ASan is
 * ready), so that path must not be instrumented. */
#define MG_NOSAN __attribute__((no_sanitize("address", "undefined")))
/* Our dlsym must reach the real one by a sibling call (see dlsym below), also
 * at the ASan build's -O1: clang is told at the call, GCC for the function. */
#if defined(__clang__)
#define MG_SIBCALL
#define MG_TAIL __attribute__((musttail))
#else
#define MG_SIBCALL __attribute__((optimize("optimize-sibling-calls")))
#define MG_TAIL
#endif

/* Spin-wait hint while a seqlock writer finishes. */
static inline void mg_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* ------------------------------------------------------------------------ */
/* The few CUDA driver / NVML types the hooks need (ABI of cuda.h / nvml.h).  */

typedef int CUresult;
#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_FOUND 500
typedef unsigned long long CUdeviceptr; /* CUdeviceptr_v2 */
typedef unsigned int CUdeviceptr_v1;    /* legacy (pre-3.2) ABI of the unsuffixed symbols */
typedef int CUdevice;
typedef unsigned long long cuuint64_t;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUctx_st *CUcontext;
typedef struct CUfunc_st *CUfunction;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef struct CUarray_st *CUarray;
typedef struct CUmipmappedArray_st *CUmipmappedArray;
typedef struct CUmemPoolProps_st CUmemPoolProps; /* read through mg_loc_head_t */
typedef struct CUmemAllocationProp_st CUmemAllocationProp; /* only passed through */
typedef struct CUlaunchConfig_st CUlaunchConfig;           /* only passed through */
typedef int CUdriverProcAddressQueryResult;
#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM 0x2ULL

typedef struct {
    size_t Width;
    size_t Height;
    int Format; /* CUarray_format */
    unsigned int NumChannels;
} CUDA_ARRAY_DESCRIPTOR; /* _v2 */

typedef struct {
    size_t Width;
    size_t Height;
    size_t Depth;
    int Format;
    unsigned int NumChannels;
    unsigned int Flags;
} CUDA_ARRAY3D_DESCRIPTOR; /* _v2 */

typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
#define NVML_ERROR_FUNCTION_NOT_FOUND 13
typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;
typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_MEMORY 20
#define NVML_ERROR_UNKNOWN 999
typedef struct {
    unsigned long long bar1Total;
    unsigned long long bar1Free;
    unsigned long long bar1Used;
} nvmlBAR1Memory_t;
/* Per-process records NVML hands out, by layout: each starts with the pid except
 * nvmlProcessUtilizationInfo_v1_t (a timestamp first). Only their size and the
 * pid's place matter to the shim. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t; /* _v2 and _v3 */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
    unsigned long long usedGpuCcProtectedMemory;
} nvmlProcessDetail_v1_t;
typedef struct {
    unsigned int version;
    unsigned int mode;
    unsigned int numProcArrayEntries;
    nvmlProcessDetail_v1_t *procArray;
} nvmlProcessDetailList_t;
typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil, memUtil, encUtil, decUtil;
} nvmlProcessUtilizationSample_t;
typedef struct {
    unsigned long long timeStamp;
    unsigned int pid, smUtil, memUtil, encUtil, decUtil, jpgUtil, ofaUtil;
} nvmlProcessUtilizationInfo_v1_t;
typedef struct {
    unsigned int version;
    unsigned int processSamplesCount;
    unsigned long long lastSeenTimeStamp;
    nvmlProcessUtilizationInfo_v1_t *procUtilArray;
} nvmlProcessesUtilizationInfo_t;

/* ------------------------------------------------------------------------ */
/* The hook table.                                                           */

static const char *const g_lib_names[] = {"libcuda.so.1", "libnvidia-ml.so.1"};

/* X(exported name, base name for cuGetProcAddress, cudaVersion the driver maps
 *   base to this variant from, library, per-thread default stream variant) */
#define MG_SYMBOLS(X)                                                          \
    X(cuGetProcAddress, "cuGetProcAddress", 11030, LIB_CUDA, 0)                \
    X(cuGetProcAddress_v2, "cuGetProcAddress", 12000, LIB_CUDA, 0)             \
    X(cuMemAlloc, "cuMemAlloc", 2000, LIB_CUDA, 0)                             \
    X(cuMemAlloc_v2, "cuMemAlloc", 3020, LIB_CUDA, 0)                          \
    X(cuMemAllocPitch, "cuMemAllocPitch", 2000, LIB_CUDA, 0)                   \
    X(cuMemAllocPitch_v2, "cuMemAllocPitch", 3020, LIB_CUDA, 0)                \
    X(cuMemAllocManaged, "cuMemAllocManaged", 6000, LIB_CUDA, 0)               \
    X(cuMemAllocAsync, "cuMemAllocAsync", 11020, LIB_CUDA, 0)                  \
    X(cuMemAllocAsync_ptsz, "cuMemAllocAsync", 11020, LIB_CUDA, 1)             \
    X(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", 11020, LIB_CUDA, 0)  \
    X(cuMemAllocFromPoolAsync_ptsz, "cuMemAllocFromPoolAsync", 11020, LIB_CUDA, 1) \
    X(cuMemFreeAsync, "cuMemFreeAsync", 11020, LIB_CUDA, 0)                    \
    X(cuMemFreeAsync_ptsz, "cuMemFreeAsync", 11020, LIB_CUDA, 1)               \
    X(cuMemPoolTrimTo, "cuMemPoolTrimTo", 11020, LIB_CUDA, 0)                  \
    X(cuMemPoolDestroy, "cuMemPoolDestroy", 11020, LIB_CUDA, 0)                \
    X(cuStreamSynchronize, "cuStreamSynchronize", 2000, LIB_CUDA, 0)           \
    X(cuStreamSynchronize_ptsz, "cuStreamSynchronize", 7000, LIB_CUDA, 1)      \
    X(cuEventSynchronize, "cuEventSynchronize", 2000, LIB_CUDA, 0)             \
    X(cuCtxSynchronize, "cuCtxSynchronize", 2000, LIB_CUDA, 0)                 \
    X(cuCtxSynchronize_v2, "cuCtxSynchronize", 13000, LIB_CUDA, 0)             \
    X(cuMemFree, "cuMemFree", 2000, LIB_CUDA, 0)                               \
    X(cuMemFree_v2, "cuMemFree", 3020, LIB_CUDA, 0)                            \
    X(cuMemCreate, "cuMemCreate", 10020, LIB_CUDA, 0)                          \
    X(cuMemRelease, "cuMemRelease", 10020, LIB_CUDA, 0)                        \
    X(cuMemMap, "cuMemMap", 10020, LIB_CUDA, 0)                                \
    X(cuMemUnmap, "cuMemUnmap", 10020, LIB_CUDA, 0)                            \
    X(cuMemRetainAllocationHandle, "cuMemRetainAllocationHandle", 11000, LIB_CUDA, 0) \
    X(cuArrayCreate_v2, "cuArrayCreate", 3020, LIB_CUDA, 0)                    \
    X(cuArray3DCreate_v2, "cuArray3DCreate", 3020, LIB_CUDA, 0)                \
    X(cuArrayDestroy, "cuArrayDestroy", 2000, LIB_CUDA, 0)                     \
    X(cuMipmappedArrayCreate, "cuMipmappedArrayCreate", 5000, LIB_CUDA, 0)     \
    X(cuMipmappedArrayDestroy, "cuMipmappedArrayDestroy", 5000, LIB_CUDA, 0)   \
    X(cuMemPoolCreate, "cuMemPoolCreate", 11020, LIB_CUDA, 0)                  \
    X(cuMemGetInfo, "cuMemGetInfo", 2000, LIB_CUDA, 0)                         \
    X(cuMemGetInfo_v2, "cuMemGetInfo", 3020, LIB_CUDA, 0)                      \
    X(cuDeviceTotalMem, "cuDeviceTotalMem", 2000, LIB_CUDA, 0)                 \
    X(cuDeviceTotalMem_v2, "cuDeviceTotalMem", 3020, LIB_CUDA, 0)              \
    X(cuLaunchKernel, "cuLaunchKernel", 4000, LIB_CUDA, 0)                     \
    X(cuLaunchKernel_ptsz, "cuLaunchKernel", 7000, LIB_CUDA, 1)                \
    X(cuLaunchKernelEx, "cuLaunchKernelEx", 11060, LIB_CUDA, 0)                \
    X(cuLaunchKernelEx_ptsz, "cuLaunchKernelEx", 11060, LIB_CUDA, 1)           \
    X(cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel", 9000, LIB_CUDA, 0) \
    X(cuLaunchCooperativeKernel_ptsz, "cuLaunchCooperativeKernel", 9000, LIB_CUDA, 1) \
    X(cuGraphLaunch, "cuGraphLaunch", 10000, LIB_CUDA, 0)                      \
    X(cuGraphLaunch_ptsz, "cuGraphLaunch", 10000, LIB_CUDA, 1)                 \
    X(nvmlDeviceGetMemoryInfo, "nvmlDeviceGetMemoryInfo", 0, LIB_NVML, 0)      \
    X(nvmlDeviceGetMemoryInfo_v2, "nvmlDeviceGetMemoryInfo_v2", 0, LIB_NVML, 0)      \
    X(nvmlDeviceGetComputeRunningProcesses, "", 0, LIB_NVML, 0)                \
    X(nvmlDeviceGetComputeRunningProcesses_v2, "", 0, LIB_NVML, 0)             \
    X(nvmlDeviceGetComputeRunningProcesses_v3, "", 0, LIB_NVML, 0)             \
    X(nvmlDeviceGetGraphicsRunningProcesses, "", 0, LIB_NVML, 0)               \
    X(nvmlDeviceGetGraphicsRunningProcesses_v2, "", 0, LIB_NVML, 0)            \
    X(nvmlDeviceGetGraphicsRunningProcesses_v3, "", 0, LIB_NVML, 0)            \
    X(nvmlDeviceGetMPSComputeRunningProcesses, "", 0, LIB_NVML, 0)             \
    X(nvmlDeviceGetMPSComputeRunningProcesses_v2, "", 0, LIB_NVML, 0)          \
    X(nvmlDeviceGetMPSComputeRunningProcesses_v3, "", 0, LIB_NVML, 0)          \
    X(nvmlDeviceGetRunningProcessDetailList, "", 0, LIB_NVML, 0)               \
    X(nvmlDeviceGetProcessUtilization, "", 0, LIB_NVML, 0)                     \
    X(nvmlDeviceGetProcessesUtilizationInfo, "", 0, LIB_NVML, 0)               \
    X(nvmlDeviceGetBAR1MemoryInfo, "", 0, LIB_NVML, 0)

/* The other sources' entries (mg_internal.h) take the first indices. */
enum {
    S_EXTRA_LAST = S_EXTRA_COUNT - 1,
#define MG_ENUM(sym, base, ver, lib, ptds) S_##sym,
    MG_SYMBOLS(MG_ENUM)
#undef MG_ENUM
    S_COUNT
};

typedef struct {
    const char *name;
    const char *base;
    int version;
    unsigned char lib;
    unsigned char ptds;
    void *hook;
} mg_sym_t;

static const mg_sym_t g_syms[S_COUNT];        /* defined after the hooks */
static void *_Atomic g_real[S_COUNT];          /* the driver's functions, resolved once */
static void *_Atomic g_lib_handle[2];

typedef void *(*dlsym_fn)(void *, const char *);
static dlsym_fn _Atomic g_real_dlsym;

/* ------------------------------------------------------------------------ */
/* Process state.                                                            */

enum { MODE_UNINIT = 0, MODE_INITING, MODE_OFF, MODE_ON, MODE_BROKEN, MODE_DONE };
static _Atomic int g_mode;

static const mg_config_t *g_cfg;
static mg_usage_t *g_usage;
static mg_proc_slot_t *_Atomic g_slot;
static pthread_mutex_t g_claim_mu = PTHREAD_MUTEX_INITIALIZER;
static char g_dir[PATH_MAX];
static char g_sock_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
static int32_t g_pid;
static uint64_t g_start; /* this process's /proc starttime, set when it claims a slot */
static _Atomic int g_warned_track, g_warned_slots, g_warned_config, g_warned_nvml_ns;
static int g_nvml_pids_local; /* NVML's pids are this pid namespace's (see "NVML: the container's view") */

void mg_log(const char *fmt, ...) {
    char buf[512];
    int n = snprintf(buf, sizeof buf, "memguard[%d]: ", (int)getpid());
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof buf) n += vsnprintf(buf + n, sizeof buf - (size_t)n, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n >= sizeof buf - 1) n = (int)sizeof buf - 2;
    buf[n++] = '\n';
    ssize_t w = write(STDERR_FILENO, buf, (size_t)n); /* one write: lines from many processes do not interleave */
    (void)w;
}

#define MG_WARN_ONCE(flag, ...)                                      \
    do {                                                             \
        if (!atomic_exchange_explicit(&(flag), 1, memory_order_relaxed)) \
            mg_log(__VA_ARGS__);                                     \
    } while (0)

/* Saturating atomic subtraction: a counter never wraps to "17 TB used". */
static void mg_sat_sub(_Atomic uint64_t *a, uint64_t v) {
    uint64_t cur = atomic_load_explicit(a, memory_order_relaxed);
    uint64_t next;
    do {
        next = cur > v ? cur - v : 0;
    } while (!atomic_compare_exchange_weak_explicit(a, &cur, next, memory_order_acq_rel, memory_order_relaxed));
}

static uint64_t mg_coarse_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts); /* vDSO: no system call */
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ------------------------------------------------------------------------ */
/* Lock-free pointer -> counted size tables (one per kind of handle).        */

#define KEY_EMPTY 0ull
#define KEY_TOMB UINT64_MAX
#define MAX_PROBE 256

typedef struct {
    _Atomic uint64_t key;
    _Atomic uint64_t size;
    _Atomic uint64_t aux; /* g_handles: references; g_maps: the mapped handle */
    _Atomic uint64_t slop; /* g_ptrs, pool allocations: footprint - size (see mg_pool_alloc) */
} mg_ent_t;

typedef struct {
    mg_ent_t *_Atomic ents;
    uint64_t mask;
    unsigned shift;
} mg_tab_t;

static mg_tab_t g_ptrs, g_arrays, g_handles, g_maps;
static mg_tab_t g_hostpools; /* pools created with a host location: never counted */

static int mg_tab_init(mg_tab_t *t, unsigned bits) {
    size_t bytes = sizeof(mg_ent_t) << bits;
    /* Untouched pages cost nothing: only slots that are used get memory. */
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return -1;
    t->mask = (1ull << bits) - 1;
    t->shift = 64 - bits;
    atomic_store_explicit(&t->ents, (mg_ent_t *)p, memory_order_release);
    return 0;
}

static inline uint64_t mg_hash(const mg_tab_t *t, uint64_t key) {
    return (key * 0x9E3779B97F4A7C15ull) >> t->shift;
}

/* Returns 0, or -1 if the key cannot be stored (then it stays counted). */
static int mg_tab_put_slop(mg_tab_t *t, uint64_t key, uint64_t size, uint64_t aux, uint64_t slop) {
    mg_ent_t *e = atomic_load_explicit(&t->ents, memory_order_acquire);
    if (!e || key == KEY_EMPTY || key == KEY_TOMB) return -1;
    uint64_t h = mg_hash(t, key);
    for (unsigned n = 0; n < MAX_PROBE; n++, h = (h + 1) & t->mask) {
        uint64_t k = atomic_load_explicit(&e[h].key, memory_order_relaxed);
        if (k != KEY_EMPTY && k != KEY_TOMB) continue;
        if (atomic_compare_exchange_strong_explicit(&e[h].key, &k, key, memory_order_acq_rel, memory_order_relaxed)) {
            atomic_store_explicit(&e[h].size, size, memory_order_release);
            atomic_store_explicit(&e[h].aux, aux, memory_order_release);
            atomic_store_explicit(&e[h].slop, slop, memory_order_release);
            return 0;
        }
    }
    return -1;
}

static int mg_tab_put(mg_tab_t *t, uint64_t key, uint64_t size, uint64_t aux) {
    return mg_tab_put_slop(t, key, size, aux, 0);
}

/* Removes `key`; returns 1 and its size (and aux, slop, if asked) if it was there. */
static int mg_tab_take_slop(mg_tab_t *t, uint64_t key, uint64_t *size, uint64_t *aux, uint64_t *slop) {
    mg_ent_t *e = atomic_load_explicit(&t->ents, memory_order_acquire);
    if (!e || key == KEY_EMPTY || key == KEY_TOMB) return 0;
    uint64_t h = mg_hash(t, key);
    for (unsigned n = 0; n < MAX_PROBE; n++, h = (h + 1) & t->mask) {
        uint64_t k = atomic_load_explicit(&e[h].key, memory_order_acquire);
        if (k == KEY_EMPTY) return 0;
        if (k != key) continue;
        uint64_t sz = atomic_load_explicit(&e[h].size, memory_order_acquire);
        uint64_t ax = atomic_load_explicit(&e[h].aux, memory_order_acquire);
        uint64_t sl = atomic_load_explicit(&e[h].slop, memory_order_acquire);
        if (atomic_compare_exchange_strong_explicit(&e[h].key, &k, KEY_TOMB, memory_order_acq_rel,
                                                    memory_order_relaxed)) {
            *size = sz;
            if (aux) *aux = ax;
            if (slop) *slop = sl;
            return 1;
        }
        return 0; /* another thread freed the same pointer first */
    }
    return 0;
}

static int mg_tab_take(mg_tab_t *t, uint64_t key, uint64_t *size, uint64_t *aux) {
    return mg_tab_take_slop(t, key, size, aux, NULL);
}

/* The live entry of `key`, or NULL. */
static mg_ent_t *mg_tab_find(mg_tab_t *t, uint64_t key) {
    mg_ent_t *e = atomic_load_explicit(&t->ents, memory_order_acquire);
    if (!e || key == KEY_EMPTY || key == KEY_TOMB) return NULL;
    uint64_t h = mg_hash(t, key);
    for (unsigned n = 0; n < MAX_PROBE; n++, h = (h + 1) & t->mask) {
        uint64_t k = atomic_load_explicit(&e[h].key, memory_order_acquire);
        if (k == KEY_EMPTY) return NULL;
        if (k == key) return &e[h];
    }
    return NULL;
}

static void mg_tab_reset(mg_tab_t *t) {
    mg_ent_t *e = atomic_exchange_explicit(&t->ents, NULL, memory_order_acq_rel);
    if (e) munmap(e, sizeof(mg_ent_t) * (t->mask + 1));
    mg_tab_init(t, 64 - t->shift);
}

/* ------------------------------------------------------------------------ */
/* Real symbol resolution.                                                   */

static MG_NOSAN dlsym_fn mg_init_real_dlsym(void) {
    /* glibc >= 2.34 has dlsym in libc (GLIBC_2.34, plus the GLIBC_2.2.5 /
     * GLIBC_2.17 compat versions); older glibc in libdl. We export dlsym
     * ourselves, so the real one is reached only through dlvsym. */
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.0"};
    dlsym_fn f = atomic_load_explicit(&g_real_dlsym, memory_order_acquire);
    for (size_t i = 0; !f && i < sizeof versions / sizeof versions[0]; i++) {
        void *p = dlvsym(RTLD_NEXT, "dlsym", versions[i]);
        memcpy(&f, &p, sizeof f);
    }
    if (f) atomic_store_explicit(&g_real_dlsym, f, memory_order_release);
    return f;
}

static inline MG_NOSAN dlsym_fn mg_real_dlsym(void) {
    dlsym_fn f = atomic_load_explicit(&g_real_dlsym, memory_order_acquire);
    return MG_LIKELY(f != NULL) ? f : mg_init_real_dlsym();
}

/* The loaded driver library (by soname, as the app itself loads it). */
static void *mg_lib(int lib) {
    void *h = atomic_load_explicit(&g_lib_handle[lib], memory_order_acquire);
    if (h) return h;
    h = dlopen(g_lib_names[lib], RTLD_LAZY | RTLD_NOLOAD);
    if (!h) h = dlopen(g_lib_names[lib], RTLD_LAZY); /* direct call before the app loaded it */
    if (!h) return NULL;
    void *expected = NULL;
    if (!atomic_compare_exchange_strong(&g_lib_handle[lib], &expected, h)) dlclose(h);
    return atomic_load_explicit(&g_lib_handle[lib], memory_order_acquire);
}

static MG_COLD void *mg_resolve(int i) {
    void *h = mg_lib(g_syms[i].lib);
    dlsym_fn real_dlsym = mg_real_dlsym();
    if (!h || !real_dlsym) return NULL;
    void *p = real_dlsym(h, g_syms[i].name);
    if (!p || p == g_syms[i].hook) return NULL;
    void *expected = NULL;
    atomic_compare_exchange_strong(&g_real[i], &expected, p);
    return atomic_load_explicit(&g_real[i], memory_order_acquire);
}

static inline void *mg_real(int i) {
    void *p = atomic_load_explicit(&g_real[i], memory_order_acquire);
    return MG_LIKELY(p != NULL) ? p : mg_resolve(i);
}

void *mg_real_fn(int i) { return mg_real(i); }

void *mg_driver_fn(int lib, const char *name) {
    void *h = mg_lib(lib);
    dlsym_fn real_dlsym = mg_real_dlsym();
    return h && real_dlsym ? real_dlsym(h, name) : NULL;
}

/* The real function of hook `sym`, typed like the hook. */
#define REAL(sym) ((__typeof__(&mg_h_##sym))mg_real(S_##sym))
/* Call it, or report "not found" if the driver lacks it. */
#define CALL_REAL(sym, ...)                                                         \
    __extension__({                                                                 \
        __typeof__(&mg_h_##sym) f_ = REAL(sym);                                     \
        f_ ? f_(__VA_ARGS__) : (g_syms[S_##sym].lib == LIB_NVML ? NVML_ERROR_FUNCTION_NOT_FOUND \
                                                                : CUDA_ERROR_NOT_FOUND); \
    })

/* Driver functions the shim calls for itself and does not hook (memory pools). */
enum { P_cuMemPoolGetAttribute, P_cuPointerGetAttribute, P_cuCtxGetDevice, P_cuDeviceGetMemPool, P_COUNT };
static const char *const g_plain_names[P_COUNT] = {"cuMemPoolGetAttribute", "cuPointerGetAttribute",
                                                   "cuCtxGetDevice", "cuDeviceGetMemPool"};
static void *_Atomic g_plain[P_COUNT];

static void *mg_plain(int i) {
    void *p = atomic_load_explicit(&g_plain[i], memory_order_acquire);
    if (MG_LIKELY(p != NULL)) return p;
    void *h = mg_lib(LIB_CUDA);
    dlsym_fn real_dlsym = mg_real_dlsym();
    p = h && real_dlsym ? real_dlsym(h, g_plain_names[i]) : NULL;
    if (p) atomic_store_explicit(&g_plain[i], p, memory_order_release);
    return p;
}

/* ------------------------------------------------------------------------ */
/* Files and init.                                                           */

static int mg_map_file(const char *path, int writable, size_t want, void **out, char *err, size_t errlen) {
    int fd = open(path, (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
    if (fd < 0) {
        snprintf(err, errlen, "cannot open %s: %s", path, strerror(errno));
        return errno == ENOENT ? -2 : -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || (size_t)st.st_size < want) {
        snprintf(err, errlen, "%s is %lld bytes, want %zu (truncated or foreign file)", path,
                 (long long)st.st_size, want);
        close(fd);
        return -1;
    }
    void *p = mmap(NULL, want, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        snprintf(err, errlen, "cannot map %s: %s", path, strerror(errno));
        return -1;
    }
    *out = p;
    return 0;
}

static int mg_check_header(const void *p, uint64_t magic, size_t size, const char *path, char *err, size_t errlen) {
    const mg_config_t *h = p; /* magic, abi_version and file_size lead both structs */
    if (h->magic != magic || h->abi_version != MG_ABI_VERSION || h->file_size != size) {
        snprintf(err, errlen, "%s: bad magic %#llx, version %u or size %u (want version %u, size %zu)", path,
                 (unsigned long long)h->magic, h->abi_version, h->file_size, MG_ABI_VERSION, size);
        return -1;
    }
    return 0;
}

static unsigned mg_track_bits(void) {
    /* Read once at init: how many live allocations per kind this process may
     * track (power of two). Default 2^18. */
    const char *s = getenv("MEMGUARD_TRACK_BITS");
    long v = s ? strtol(s, NULL, 10) : 18;
    return v < 10 ? 10 : v > 26 ? 26 : (unsigned)v;
}

static void mg_atfork_child(void);
static void mg_reap_at_start(void);
static int mg_nvml_pids_local(void);

static int mg_do_init(void) {
    char err[PATH_MAX + 200], path[PATH_MAX + 16];
    mg_init_real_dlsym();
    g_pid = (int32_t)getpid();
    const char *dir = getenv("GPUFRAC_CONTAINER_DIR");
    if (!dir || !*dir) dir = MG_DEFAULT_DIR;
    snprintf(g_dir, sizeof g_dir, "%s", dir);
    if ((size_t)snprintf(g_sock_path, sizeof g_sock_path, "%s/%s", g_dir, MG_SOCKET_FILE) >= sizeof g_sock_path)
        g_sock_path[0] = 0; /* too long for a unix socket: no arbiter */

    void *cfg = NULL, *usage = NULL;
    snprintf(path, sizeof path, "%s/%s", g_dir, MG_CONFIG_FILE);
    int rc = mg_map_file(path, 0, sizeof(mg_config_t), &cfg, err, sizeof err);
    if (rc == -2) {
        mg_log("no config at %s: GPU memory is not limited (pass-through)", path);
        return MODE_OFF;
    }
    if (rc == 0 && mg_check_header(cfg, MG_CONFIG_MAGIC, sizeof(mg_config_t), path, err, sizeof err) != 0) rc = -1;
    if (rc != 0) {
        mg_log("%s; refusing GPU allocations until the agent repairs it", err);
        return MODE_BROKEN;
    }
    g_cfg = cfg;
    snprintf(path, sizeof path, "%s/%s", g_dir, MG_USAGE_FILE);
    rc = mg_map_file(path, 1, sizeof(mg_usage_t), &usage, err, sizeof err);
    if (rc == 0 && mg_check_header(usage, MG_USAGE_MAGIC, sizeof(mg_usage_t), path, err, sizeof err) != 0) rc = -1;
    if (rc != 0) {
        /* Without the shared counter the container's limit cannot be held
         * across its processes: refuse rather than loosen it. */
        mg_log("%s; refusing GPU allocations (container usage cannot be counted)", err);
        return MODE_BROKEN;
    }
    g_usage = usage;
    unsigned bits = mg_track_bits();
    if (mg_tab_init(&g_ptrs, bits) || mg_tab_init(&g_arrays, bits > 16 ? 16 : bits) ||
        mg_tab_init(&g_handles, bits) || mg_tab_init(&g_maps, bits) || mg_tab_init(&g_hostpools, 10)) {
        mg_log("cannot map allocation tables: %s; refusing GPU allocations", strerror(errno));
        return MODE_BROKEN;
    }
    g_nvml_pids_local = mg_nvml_pids_local();
    pthread_atfork(NULL, NULL, mg_atfork_child);
    mg_reap_at_start();
    return MODE_ON;
}

static MG_COLD int mg_init_slow(void) {
    int m = atomic_load_explicit(&g_mode, memory_order_acquire);
    while (m == MODE_UNINIT || m == MODE_INITING) {
        int expected = MODE_UNINIT;
        if (atomic_compare_exchange_strong(&g_mode, &expected, MODE_INITING)) {
            m = mg_do_init();
            atomic_store_explicit(&g_mode, m, memory_order_release);
            return m;
        }
        sched_yield(); /* another thread of this process is initialising */
        m = atomic_load_explicit(&g_mode, memory_order_acquire);
    }
    return m;
}

static inline int mg_mode(void) {
    int m = atomic_load_explicit(&g_mode, memory_order_acquire);
    return MG_LIKELY(m >= MODE_OFF) ? m : mg_init_slow();
}

__attribute__((constructor)) static void mg_constructor(void) { mg_mode(); }

/* ------------------------------------------------------------------------ */
/* Process slots.                                                            */

/* starttime (field 22) and state (field 3) of /proc/<pid>/stat; 0 on failure. */
static uint64_t mg_proc_start(int32_t pid, char *state) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* comm may hold spaces and parentheses */
    if (!p || p[1] != ' ') return 0;
    p += 2;
    if (state) *state = *p;
    for (int field = 3; field < 22; field++) {
        p = strchr(p, ' ');
        if (!p) return 0;
        p++;
    }
    return strtoull(p, NULL, 10);
}

/* Is the owner of slot `s` (which showed `pid`) gone? `full` also catches pid
 * reuse (start time differs) and zombies, at the price of reading /proc. */
static int mg_owner_dead(const mg_proc_slot_t *s, int32_t pid, int full) {
    if (kill(pid, 0) != 0 && errno == ESRCH) return 1;
    if (!full) return 0;
    char state = 0;
    uint64_t st = mg_proc_start(pid, &state);
    if (st == 0) return 0; /* unreadable: assume alive (never reclaim a live process's bytes) */
    if (state == 'Z' || state == 'X') return 1;
    uint64_t recorded = __atomic_load_n(&s->start_time, __ATOMIC_ACQUIRE);
    return recorded != 0 && recorded != st;
}

/* Give back the slot's bytes exactly once: only the CAS winner subtracts. */
static uint64_t mg_release_slot(mg_proc_slot_t *s, int32_t pid) {
    int32_t expected = pid;
    if (!atomic_compare_exchange_strong(&s->pid, &expected, -1)) return 0;
    uint64_t used = atomic_exchange(&s->used_bytes, 0);
    mg_sat_sub(&g_usage->total_used, used);
    __atomic_store_n(&s->start_time, 0, __ATOMIC_RELAXED);
    atomic_store_explicit(&s->peak_bytes, 0, memory_order_relaxed);
    atomic_store_explicit(&s->launches, 0, memory_order_relaxed);
    atomic_store_explicit(&s->last_activity_ns, 0, memory_order_relaxed);
    atomic_store_explicit(&s->oom_refusals, 0, memory_order_relaxed);
    atomic_store_explicit(&s->swapped, 0, memory_order_relaxed);
    atomic_store_explicit(&s->pid, 0, memory_order_release);
    return used + 1; /* non-zero: a slot was reclaimed even if it held no bytes */
}

/* Reclaim the slots of dead processes; returns how many. */
static MG_COLD int mg_reap(int full) {
    int reaped = 0;
    for (int i = 0; i < MG_MAX_PROCS; i++) {
        mg_proc_slot_t *s = &g_usage->slots[i];
        int32_t pid = atomic_load_explicit(&s->pid, memory_order_acquire);
        if (pid <= 0 || s == atomic_load_explicit(&g_slot, memory_order_relaxed)) continue;
        if (pid == g_pid) {
            /* Our pid, not our slot: a previous process with this pid died
             * without giving it back (its start time differs from ours), or an
             * earlier image of this very process (same start time) that called
             * exec, which skips destructors; the driver freed that image's
             * memory at exec. Only this process claims slots under its pid and
             * it claims one (g_slot), so either way the slot is stale. */
            uint64_t st = __atomic_load_n(&s->start_time, __ATOMIC_ACQUIRE);
            if (st != 0 && g_start != 0 && (full || st == g_start) && mg_release_slot(s, pid)) reaped++;
            continue;
        }
        if (mg_owner_dead(s, pid, full) && mg_release_slot(s, pid)) reaped++;
    }
    return reaped;
}

/* At init: give back the slots of processes that are gone, so the first
 * cuMemGetInfo (often a framework's sizing, before any allocation) is exact:
 *   - a predecessor killed by a signal (SIGKILL, the OOM killer) runs no
 *     destructor; the driver freed its memory as it died;
 *   - earlier images of this process (exec keeps the pid and start time but
 *     runs no destructor; the driver freed their memory).
 * The same lock-free reclaim as the allocation path (CAS on the slot's pid),
 * at its cheap level: one kill(pid, 0) per occupied slot, /proc read only if a
 * slot carries our own pid. A killed process not yet waited for (a zombie) is
 * caught by the full reap of the next allocation that does not fit. */
static MG_COLD void mg_reap_at_start(void) {
    for (int i = 0; i < MG_MAX_PROCS; i++) {
        if (atomic_load_explicit(&g_usage->slots[i].pid, memory_order_relaxed) != g_pid) continue;
        g_start = mg_proc_start(g_pid, NULL);
        break;
    }
    mg_reap(0);
}

static mg_proc_slot_t *mg_try_claim(uint64_t start) {
    for (int i = 0; i < MG_MAX_PROCS; i++) {
        mg_proc_slot_t *s = &g_usage->slots[i];
        int32_t expected = 0;
        if (atomic_load_explicit(&s->pid, memory_order_relaxed) != 0) continue;
        if (!atomic_compare_exchange_strong(&s->pid, &expected, g_pid)) continue;
        /* Fields were zeroed by whoever freed the slot. start_time goes last:
         * a reaper treats 0 as "being claimed" and then only trusts kill(). */
        atomic_store_explicit(&s->used_bytes, 0, memory_order_relaxed);
        atomic_store_explicit(&s->peak_bytes, 0, memory_order_relaxed);
        atomic_store_explicit(&s->launches, 0, memory_order_relaxed);
        atomic_store_explicit(&s->oom_refusals, 0, memory_order_relaxed);
        atomic_store_explicit(&s->swapped, 0, memory_order_relaxed);
        atomic_store_explicit(&s->last_activity_ns, mg_coarse_now_ns(), memory_order_relaxed);
        __atomic_store_n(&s->start_time, start, __ATOMIC_RELEASE);
        return s;
    }
    return NULL;
}

static MG_COLD mg_proc_slot_t *mg_claim_slot(void) {
    /* Process-local mutex: only this process's threads ever take it. */
    pthread_mutex_lock(&g_claim_mu);
    mg_proc_slot_t *s = atomic_load_explicit(&g_slot, memory_order_acquire);
    if (!s) {
        uint64_t start = mg_proc_start(g_pid, NULL);
        g_start = start;
        mg_reap(0);
        s = mg_try_claim(start);
        if (!s && mg_reap(1) > 0) s = mg_try_claim(start);
        if (s)
            atomic_store_explicit(&g_slot, s, memory_order_release);
        else
            MG_WARN_ONCE(g_warned_slots, "%s/%s: all %d process slots are taken; refusing GPU allocations",
                         g_dir, MG_USAGE_FILE, MG_MAX_PROCS);
    }
    pthread_mutex_unlock(&g_claim_mu);
    return s;
}

static inline mg_proc_slot_t *mg_slot(void) {
    mg_proc_slot_t *s = atomic_load_explicit(&g_slot, memory_order_acquire);
    return MG_LIKELY(s != NULL) ? s : mg_claim_slot();
}

static void mg_pools_reset(void);

static void mg_atfork_child(void) {
    /* The child owns none of the parent's allocations (CUDA contexts do not
     * survive fork) and is another process: fresh slot, fresh tables. */
    pthread_mutex_init(&g_claim_mu, NULL);
    mg_pools_reset();
    g_pid = (int32_t)getpid();
    g_start = 0;
    atomic_store(&g_slot, NULL);
    if (atomic_load(&g_mode) == MODE_ON) {
        mg_tab_reset(&g_ptrs);
        mg_tab_reset(&g_arrays);
        mg_tab_reset(&g_handles);
        mg_tab_reset(&g_maps);
        mg_tab_reset(&g_hostpools);
    }
}

static void mg_exit_return_grant(void);

__attribute__((destructor)) static void mg_destructor(void) {
    /* A clean exit gives the slot back at once (the driver frees the memory
     * at exit); a killed process is reaped by the next one to notice. Later
     * calls during teardown pass through uncounted. */
    if (atomic_load(&g_mode) != MODE_ON) return;
    atomic_store(&g_mode, MODE_DONE);
    mg_proc_slot_t *s = atomic_exchange(&g_slot, NULL);
    if (s && (int32_t)getpid() == g_pid && mg_release_slot(s, g_pid) > 1) mg_exit_return_grant();
}

/* ------------------------------------------------------------------------ */
/* Limits.                                                                   */

typedef struct {
    uint64_t request, limit, grant, generation;
    uint32_t flags, arbiter_timeout_ms, wait_timeout_ms;
} mg_limits_t;

#define LOAD_CFG(field) __atomic_load_n(&g_cfg->field, __ATOMIC_RELAXED)

/* An odd seq that never turned even: its writer died mid-update. Later reads
 * fail at once while the seq stays at that value, rather than spin again. */
static _Atomic uint64_t g_stuck_seq;

static MG_COLD int mg_config_stuck(uint64_t seq) {
    if (seq & 1) atomic_store_explicit(&g_stuck_seq, seq, memory_order_relaxed);
    MG_WARN_ONCE(g_warned_config, "%s/%s: an agent update never completed (seqlock stays odd)", g_dir,
                 MG_CONFIG_FILE);
    return -1;
}

/* A consistent snapshot of the config (seqlock reader). */
static int mg_read_limits(mg_limits_t *l) {
    for (unsigned spin = 0;; spin++) {
        uint64_t s1 = atomic_load_explicit(&g_cfg->seq, memory_order_acquire);
        if (MG_LIKELY(!(s1 & 1))) {
            l->request = LOAD_CFG(request_bytes);
            l->limit = LOAD_CFG(limit_bytes);
            l->grant = LOAD_CFG(grant_bytes);
            l->generation = LOAD_CFG(generation);
            l->flags = LOAD_CFG(flags);
            l->arbiter_timeout_ms = LOAD_CFG(arbiter_timeout_ms);
            l->wait_timeout_ms = LOAD_CFG(wait_timeout_ms);
            atomic_thread_fence(memory_order_acquire);
            if (atomic_load_explicit(&g_cfg->seq, memory_order_relaxed) == s1) {
                if (l->limit < l->request) l->limit = l->request; /* never a limit below the guarantee */
                return 0;
            }
        } else if (s1 == atomic_load_explicit(&g_stuck_seq, memory_order_relaxed)) {
            return -1;
        }
        /* A writer is mid-update (microseconds) or was descheduled: back off,
         * and give up after about a second rather than hang the app. */
        if (spin < 1000) {
            mg_cpu_relax();
        } else if (spin < 1000 + 100000) {
            sched_yield();
        } else {
            return mg_config_stuck(s1);
        }
    }
}

/* ------------------------------------------------------------------------ */
/* Slow path: the arbiter (docs/arbiter-protocol.md).                       */

/* Wait up to `ms` for `events` on fd. */
static int mg_poll(int fd, short events, int ms) {
    struct pollfd p = {.fd = fd, .events = events};
    int r;
    do {
        r = poll(&p, 1, ms);
    } while (r < 0 && errno == EINTR);
    return r == 1 && (p.revents & events) ? 0 : -1;
}

static uint64_t mg_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Milliseconds left until `deadline` (mg_now_ms() clock), 0 once it passed. */
static int mg_left_ms(uint64_t deadline) {
    uint64_t now = mg_now_ms();
    return now >= deadline ? 0 : (int)(deadline - now);
}

/* Connect the (blocking) socket fd by `deadline`. On a unix socket a full listen
 * backlog is EAGAIN, never EINPROGRESS, so a non-blocking connect cannot wait
 * for room; a blocking one waits up to SO_SNDTIMEO and is woken as soon as the
 * agent accepts. Should the kernel still answer EAGAIN early (or a signal
 * interrupt the wait), retry after a short sleep, until the deadline. */
static MG_COLD int mg_connect_by(int fd, const struct sockaddr_un *addr, uint64_t deadline) {
    for (long nap_ms = 1;; nap_ms = nap_ms < 5 ? nap_ms + 1 : 5) {
        int left = mg_left_ms(deadline);
        if (left <= 0) return -1;
        struct timeval tv = {.tv_sec = left / 1000, .tv_usec = (left % 1000) * 1000};
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        if (connect(fd, (const struct sockaddr *)addr, sizeof *addr) == 0 || errno == EISCONN) return 0;
        if (errno != EAGAIN && errno != EINTR) return -1; /* no socket, nobody listening: no at once */
        left = mg_left_ms(deadline);
        if (left <= 0) return -1;
        struct timespec ts = {0, (nap_ms < left ? nap_ms : left) * 1000000L};
        nanosleep(&ts, NULL);
    }
}

/*
 * THE single place the shim asks the agent for burst memory.
 *
 * Called when an allocation of `bytes` would take the container to
 * `total_after`, past request + grant but within the limit. Returns 1 when the
 * agent granted: it has already raised config.grant_bytes (new generation)
 * before replying, so the caller re-reads the config and retries. Returns 0 to
 * refuse: no socket, no agent, timeout, denial, garbage. Never grants blindly.
 *
 * Protocol (mg_burst_req_t / mg_burst_rep_t in memguard_abi.h): one request
 * per connection on $GPUFRAC_CONTAINER_DIR/arbiter.sock; the agent identifies
 * the caller by SO_PEERCRED, not by the message. Connect and send are bounded
 * by arbiter_timeout_ms (a full backlog is waited out within it); the reply by
 * arbiter_timeout_ms + wait_timeout_ms, since the agent's wait resolver may
 * hold the request that long. Without await_reply (RELEASE): one non-blocking
 * connect and send, failing at once.
 */
static MG_COLD int mg_arbiter_io(uint16_t op, uint64_t bytes, uint64_t total_after, const mg_limits_t *l,
                                 int await_reply) {
    if (!g_sock_path[0]) return 0;
    struct stat st;
    if (stat(g_sock_path, &st) != 0 || !S_ISSOCK(st.st_mode)) return 0;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | (await_reply ? 0 : SOCK_NONBLOCK), 0);
    if (fd < 0) return 0;
    int granted = 0;
    int timeout = l->arbiter_timeout_ms ? (int)(l->arbiter_timeout_ms > 600000 ? 600000 : l->arbiter_timeout_ms) : 2000;
    int reply_timeout = timeout + (int)(l->wait_timeout_ms > 600000 ? 600000 : l->wait_timeout_ms);
    uint64_t deadline = mg_now_ms() + (uint64_t)timeout;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    memcpy(addr.sun_path, g_sock_path, strlen(g_sock_path) + 1);
    if (!await_reply) {
        if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) goto out; /* full backlog: EAGAIN, at once */
    } else if (mg_connect_by(fd, &addr, deadline) != 0 || fcntl(fd, F_SETFL, O_NONBLOCK) != 0) {
        goto out;
    }
    mg_burst_req_t req = {.magic = MG_BURST_MAGIC, .version = MG_ABI_VERSION, .op = op,
                          .pid = g_pid, .bytes = bytes, .total_after = total_after, .generation = l->generation};
    if (mg_poll(fd, POLLOUT, mg_left_ms(deadline)) != 0 ||
        send(fd, &req, sizeof req, MSG_NOSIGNAL) != (ssize_t)sizeof req)
        goto out;
    if (!await_reply) {
        granted = 1; /* sent: the agent reads it after we close (a unix socket keeps queued bytes) */
        goto out;
    }
    mg_burst_rep_t rep;
    size_t got = 0;
    while (got < sizeof rep) {
        if (mg_poll(fd, POLLIN, reply_timeout) != 0) goto out;
        ssize_t n = recv(fd, (char *)&rep + got, sizeof rep - got, 0);
        if (n <= 0) {
            if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
            goto out;
        }
        got += (size_t)n;
    }
    granted = rep.magic == MG_BURST_MAGIC && rep.status == MG_BURST_GRANTED;
out:
    close(fd);
    return granted;
}

/* A request that waits for the agent's answer: 1 if granted. */
static MG_COLD int mg_ask_arbiter(uint16_t op, uint64_t bytes, uint64_t total_after, const mg_limits_t *l) {
    return mg_arbiter_io(op, bytes, total_after, l, 1);
}

/* Grants flow back (docs/arbiter-protocol.md, RELEASE). When a free leaves the
 * container using less than request + grant by more than max(64 MiB, grant/8),
 * the agent is told at once, so a burst waiting elsewhere on the GPU gets the
 * memory within milliseconds instead of after the agent's 10 s stale-grant sweep.
 *
 * Why op RELEASE, sent without waiting for the reply, rather than only the
 * grant_returned counter: the agent reads the counter in its once-a-second sweep,
 * too slow for a waiter; the op wakes it now. Not awaiting the reply keeps the
 * free's cost at one non-blocking connect and one 40-byte send on a unix socket
 * (tens of microseconds; a full backlog fails at once with EAGAIN), never a wait
 * on a busy agent. Nothing is held meanwhile. If the send fails (agent away), the
 * counter is bumped instead, and the agent's sweep (or, after a restart, its
 * reconcile) takes the grant back. Identity is SO_PEERCRED as for a burst.
 *
 * At most one RELEASE per process and config generation: the agent's lowered
 * grant comes with a new generation; until then further frees do not resend. */
#define MG_RETURN_MIN (64ull << 20)
static _Atomic uint64_t g_returned_gen = UINT64_MAX;

/* Grant the container holds but does not use (never the guarantee); 0 if none. */
static uint64_t mg_unused_grant(mg_limits_t *l, uint64_t *used) {
    /* No grant (the common case): one load decides, without the seqlock. A
     * grant being raised at this instant is seen by the next free. */
    if (!g_usage || !g_cfg || LOAD_CFG(grant_bytes) == 0) return 0;
    if (mg_read_limits(l) != 0 || l->grant == 0 || (l->flags & MG_FLAG_WHOLE_GPU)) return 0;
    uint64_t held = l->request + l->grant;
    if (held < l->request || held > l->limit) held = l->limit;
    *used = atomic_load_explicit(&g_usage->total_used, memory_order_relaxed);
    uint64_t unused = *used >= held ? 0 : held - *used;
    return unused > l->grant ? l->grant : unused;
}

void mg_maybe_return_grant(void) {
    mg_limits_t l;
    uint64_t used = 0, unused = mg_unused_grant(&l, &used);
    if (MG_LIKELY(unused == 0)) return;
    uint64_t slack = l.grant / 8 > MG_RETURN_MIN ? l.grant / 8 : MG_RETURN_MIN;
    if (unused <= slack) return;
    uint64_t gen = atomic_load_explicit(&g_returned_gen, memory_order_relaxed);
    if (gen == l.generation ||
        !atomic_compare_exchange_strong_explicit(&g_returned_gen, &gen, l.generation, memory_order_relaxed,
                                                 memory_order_relaxed))
        return; /* sent for this generation already, or another thread is sending now */
    if (!mg_arbiter_io(MG_BURST_OP_RELEASE, unused, used, &l, 0))
        atomic_fetch_add_explicit(&g_usage->grant_returned, unused, memory_order_relaxed);
}

/* At exit the op would reach the agent after this process is gone (it could not be
 * identified), so the exit only adds what it leaves unused to the counter: the
 * agent's sweep takes the grant back within a second. */
static void mg_exit_return_grant(void) {
    mg_limits_t l;
    uint64_t used = 0, unused = mg_unused_grant(&l, &used);
    if (unused) atomic_fetch_add_explicit(&g_usage->grant_returned, unused, memory_order_relaxed);
}

/* Swap-in (gpufrac/agent/swap.py): the agent moved this process's GPU
 * memory to host RAM (slot->swapped) and its CUDA calls block in the driver
 * until it is restored. So before the next launch or allocation, ask the agent
 * to bring it back (op SWAP_IN, arbitrated like a burst); the agent restores,
 * clears the flag, then replies. Denied, timed out or agent away: ask again,
 * backing off up to a second (the process cannot do GPU work meanwhile anyway). */
static MG_COLD void mg_swap_in(mg_proc_slot_t *s) {
    long delay_ms = 5;
    while (atomic_load_explicit(&s->swapped, memory_order_acquire)) {
        mg_limits_t l;
        if (mg_read_limits(&l) != 0) memset(&l, 0, sizeof l);
        if (mg_ask_arbiter(MG_BURST_OP_SWAP_IN, 0, 0, &l) && !atomic_load_explicit(&s->swapped, memory_order_acquire))
            return;
        struct timespec ts = {delay_ms / 1000, (delay_ms % 1000) * 1000000L};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
        }
        if (delay_ms < 1000) delay_ms *= 2;
    }
}

/* ------------------------------------------------------------------------ */
/* Accounting.                                                               */

static MG_COLD CUresult mg_refuse(mg_proc_slot_t *s) {
    if (s) atomic_fetch_add_explicit(&s->oom_refusals, 1, memory_order_relaxed);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult mg_x_refuse(void) { return mg_refuse(atomic_load_explicit(&g_slot, memory_order_acquire)); }

const char *mg_container_dir(void) { return g_dir; }

uint64_t mg_container_total(void) {
    return g_usage ? atomic_load_explicit(&g_usage->total_used, memory_order_acquire) : 0;
}

uint64_t mg_process_counted(void) {
    mg_proc_slot_t *s = atomic_load_explicit(&g_slot, memory_order_acquire);
    return s ? atomic_load_explicit(&s->used_bytes, memory_order_acquire) : 0;
}

/* NVML's pids are this namespace's (see "NVML: the container's view"): ours is getpid(). */
unsigned mg_nvml_self_pid(void) { return g_nvml_pids_local && g_pid > 0 ? (unsigned)g_pid : 0; }

/* NVML's pids are another namespace's (the host's): mg_ctx.c may learn which is
 * this process's; not under MEMGUARD_NVML_PIDS=none (no per-process figures). */
int mg_nvml_pids_foreign(void) {
    const char *e = getenv("MEMGUARD_NVML_PIDS");
    return !g_nvml_pids_local && !(e && strcmp(e, "none") == 0);
}

/* This process's share of bytes already added to the total (and its peak). */
static void mg_slot_add(mg_proc_slot_t *s, uint64_t bytes) {
    uint64_t mine = atomic_fetch_add_explicit(&s->used_bytes, bytes, memory_order_relaxed) + bytes;
    uint64_t peak = atomic_load_explicit(&s->peak_bytes, memory_order_relaxed);
    while (mine > peak && !atomic_compare_exchange_weak_explicit(&s->peak_bytes, &peak, mine, memory_order_relaxed,
                                                                 memory_order_relaxed)) {
    }
}

/* Count bytes the driver already holds, limit or not (the truth is never
 * left uncounted; a limit check comes before or right after, see mg_admit). */
void mg_force_charge(uint64_t bytes) {
    mg_proc_slot_t *s = mg_slot();
    if (!s || bytes == 0) return; /* no slot: this process has no allocation to count either */
    uint64_t cur = atomic_load_explicit(&g_usage->total_used, memory_order_relaxed), next;
    do {
        next = cur + bytes < cur ? UINT64_MAX : cur + bytes;
    } while (!atomic_compare_exchange_weak_explicit(&g_usage->total_used, &cur, next, memory_order_acq_rel,
                                                    memory_order_relaxed));
    mg_slot_add(s, bytes);
}

/* `bytes` were counted by force (the driver had already reserved them): may
 * the container keep them? Yes within request + grant; past it, the arbiter
 * decides as for any burst (the total already holds them); past the limit, no. */
MG_COLD int mg_admit(uint64_t bytes) {
    mg_proc_slot_t *s = mg_slot();
    if (!s) return 0;
    int reaped = 0, asked = 0;
    for (;;) {
        mg_limits_t l;
        if (mg_read_limits(&l) != 0 || (l.flags & MG_FLAG_DISABLED)) return 0;
        if (l.flags & MG_FLAG_WHOLE_GPU) return 1;
        uint64_t fast = l.request + l.grant;
        if (fast > l.limit || fast < l.request) fast = l.limit;
        uint64_t cur = atomic_load_explicit(&g_usage->total_used, memory_order_relaxed);
        if (cur <= fast) return 1;
        if (!reaped) {
            reaped = 1;
            if (mg_reap(1) > 0) continue;
        }
        if (cur > l.limit || asked) return 0;
        asked = 1;
        if (!mg_ask_arbiter(MG_BURST_OP_BURST, bytes, cur, &l)) return 0;
    }
}

/* Count `bytes` for this process before the real allocation. */
CUresult mg_charge(uint64_t bytes) {
    mg_proc_slot_t *s = mg_slot();
    if (MG_UNLIKELY(!s)) return CUDA_ERROR_OUT_OF_MEMORY;
    if (MG_UNLIKELY(atomic_load_explicit(&s->swapped, memory_order_acquire))) mg_swap_in(s);
    if (bytes == 0) return CUDA_SUCCESS;
    _Atomic uint64_t *total = &g_usage->total_used;
    int reaped = 0, asked = 0;
    for (;;) {
        mg_limits_t l;
        if (MG_UNLIKELY(mg_read_limits(&l) != 0) || MG_UNLIKELY(l.flags & MG_FLAG_DISABLED)) return mg_refuse(s);
        uint64_t fast = l.request + l.grant;
        if (fast > l.limit || fast < l.request) fast = l.limit;
        if (l.flags & MG_FLAG_WHOLE_GPU) fast = l.limit = UINT64_MAX; /* count, never limit */
        uint64_t cur = atomic_load_explicit(total, memory_order_relaxed), want;
        for (;;) {
            want = cur + bytes;
            if (want < cur) want = UINT64_MAX; /* overflow: certainly past the limit */
            if (want > fast) break;
            if (atomic_compare_exchange_weak_explicit(total, &cur, want, memory_order_acq_rel, memory_order_relaxed)) {
                mg_slot_add(s, bytes);
                return CUDA_SUCCESS;
            }
        }
        /* Slow path: dead processes may still hold bytes; then the arbiter. */
        if (!reaped) {
            reaped = 1;
            if (mg_reap(1) > 0) continue;
        }
        if (want > l.limit || asked) return mg_refuse(s);
        asked = 1;
        if (!mg_ask_arbiter(MG_BURST_OP_BURST, bytes, want, &l)) return mg_refuse(s);
    }
}

/* Give back `bytes` counted for this process (slot first, then total). */
void mg_uncharge(uint64_t bytes) {
    mg_proc_slot_t *s = atomic_load_explicit(&g_slot, memory_order_acquire);
    if (!s || bytes == 0) return;
    mg_sat_sub(&s->used_bytes, bytes);
    mg_sat_sub(&g_usage->total_used, bytes);
}

/* The real driver refused `bytes` (already counted) for lack of memory. Within the
 * container's request that memory is guaranteed, so others' bursts hold it
 * (lendUnusedRequests, or bursts granted meanwhile): ask the agent to take it back
 * (op RECLAIM, docs/arbiter-protocol.md). 1: it is free again, retry the real
 * allocation once. Past the request (grant-backed) the OOM stands, as before.
 * Only after a driver failure: the fast path never gets here. */
static MG_COLD int mg_reclaim(CUresult rc, uint64_t bytes) {
    if (rc != CUDA_ERROR_OUT_OF_MEMORY || bytes == 0 || !g_usage) return 0;
    mg_limits_t l;
    if (mg_read_limits(&l) != 0 || (l.flags & (MG_FLAG_DISABLED | MG_FLAG_WHOLE_GPU))) return 0;
    uint64_t used = atomic_load_explicit(&g_usage->total_used, memory_order_relaxed);
    if (used > l.request) return 0;
    return mg_ask_arbiter(MG_BURST_OP_RECLAIM, bytes, used, &l);
}

/* After the real allocation: remember the size, or give it back on failure. */
static void mg_settle(mg_tab_t *t, CUresult rc, uint64_t key, uint64_t bytes) {
    if (rc != CUDA_SUCCESS) {
        mg_uncharge(bytes);
    } else if (bytes && mg_tab_put(t, key, bytes, 1) != 0) {
        MG_WARN_ONCE(g_warned_track,
                     "allocation table full (MEMGUARD_TRACK_BITS): some memory stays counted after free");
    }
}

/* After the real free: uncount, or keep counting if the driver refused. */
static void mg_freed(mg_tab_t *t, CUresult rc, uint64_t key, int found, uint64_t bytes) {
    if (!found) return; /* double free or foreign pointer: nothing of ours to give back */
    if (rc == CUDA_SUCCESS) {
        mg_uncharge(bytes);
        mg_maybe_return_grant();
    } else {
        mg_tab_put(t, key, bytes, 1);
    }
}

static inline int mg_on(void) { return mg_mode() == MODE_ON; }
static inline int mg_refusing(void) { return mg_mode() == MODE_BROKEN; }
int mg_x_on(void) { return mg_on(); }
int mg_x_refusing(void) { return mg_refusing(); }

/* The container's view of memory, given the driver's. Returns 0 to leave the
 * driver's numbers as they are. */
static int mg_view(uint64_t real_free, uint64_t real_total, uint64_t *vfree, uint64_t *vtotal) {
    int m = mg_mode();
    if (m == MODE_BROKEN) {
        *vtotal = real_total;
        *vfree = 0;
        return 1;
    }
    if (m != MODE_ON) return 0;
    mg_limits_t l;
    if (mg_read_limits(&l) != 0) {
        *vtotal = real_total;
        *vfree = 0;
        return 1;
    }
    if (l.flags & MG_FLAG_WHOLE_GPU) return 0;
    uint64_t total = l.limit < real_total ? l.limit : real_total;
    uint64_t used = atomic_load_explicit(&g_usage->total_used, memory_order_relaxed);
    uint64_t free_ = used >= total ? 0 : total - used;
    if (free_ > real_free) free_ = real_free; /* other containers' bursts may have taken the rest */
    if (l.flags & MG_FLAG_DISABLED) free_ = 0;
    *vtotal = total;
    *vfree = free_;
    return 1;
}

/* Bytes of a CUDA array, from its descriptor. Unknown formats count 16 bytes
 * per element, the largest of any format (over-count rather than under). */
static uint64_t mg_array_bytes(size_t w, size_t h, size_t d, int format, unsigned channels) {
    uint64_t elem;
    switch (format) {
    case 0x01: case 0x08: elem = 1; break;            /* (UN)SIGNED_INT8 */
    case 0x02: case 0x09: case 0x10: elem = 2; break; /* (UN)SIGNED_INT16, HALF */
    case 0x03: case 0x0a: case 0x20: elem = 4; break; /* (UN)SIGNED_INT32, FLOAT */
    default: elem = 16; channels = 1; break;
    }
    if (channels == 0) channels = 1;
    uint64_t n = (uint64_t)w, r;
    if (__builtin_mul_overflow(n, (uint64_t)(h ? h : 1), &r) || __builtin_mul_overflow(r, (uint64_t)(d ? d : 1), &r) ||
        __builtin_mul_overflow(r, elem * channels, &r))
        return UINT64_MAX;
    return r;
}

/* Bytes of a mipmapped array: every level (each dimension halved, at least 1)
 * counted as an array of its own, rounded up to 512 bytes as the driver lays
 * levels out at least that aligned. A layered or cubemap array's Depth is its
 * layers (faces), which every level keeps. More levels than any image can have
 * (64) are refused by the driver; they count nothing more here. */
#define MG_ARRAY3D_LAYERED 0x01
#define MG_ARRAY3D_CUBEMAP 0x04
static uint64_t mg_mip_bytes(const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned int levels) {
    uint64_t total = 0;
    int layers = (d->Flags & (MG_ARRAY3D_LAYERED | MG_ARRAY3D_CUBEMAP)) != 0;
    for (unsigned int l = 0; l < levels && l < 64; l++) {
        size_t w = d->Width >> l ? d->Width >> l : 1;
        size_t h = d->Height ? (d->Height >> l ? d->Height >> l : 1) : 0;
        size_t z = d->Depth ? (layers ? d->Depth : d->Depth >> l ? d->Depth >> l : 1) : 0;
        uint64_t b = mg_array_bytes(w, h, z, d->Format, d->NumChannels);
        if (b > UINT64_MAX - 511 || total + ((b + 511) & ~511ull) < total) return UINT64_MAX;
        total += (b + 511) & ~511ull;
    }
    return total;
}

/* Where a cuMemCreate / cuMemPoolCreate allocation lives: the head shared by
 * CUmemAllocationProp and CUmemPoolProps (type, handle types, CUmemLocation).
 * CUmemLocationType HOST 2, HOST_NUMA 3, HOST_NUMA_CURRENT 4 are host RAM the
 * GPU reaches over the bus (NCCL's cuMem host buffers): not GPU memory, never
 * counted. Every other type (DEVICE 1, or one this shim does not know) counts.
 * Only for pinned memory (allocation type PINNED 1): for MANAGED (2, CUDA 13
 * managed pools) the location is only preferred, and the memory moves onto the
 * GPU that touches it, so it counts like cuMemAllocManaged's. */
typedef struct {
    int type, handle_types;
    struct {
        int type, id;
    } location;
} mg_loc_head_t;

static int mg_loc_host(const void *props) {
    if (!props || ((const mg_loc_head_t *)props)->type != 1) return 0;
    int t = ((const mg_loc_head_t *)props)->location.type;
    return t == 2 || t == 3 || t == 4;
}

/* ------------------------------------------------------------------------ */
/* Hooks. Each is exported under the driver's name (alias below).            */

#define HOOK static

/* --- allocation --- */

/* Every counted allocation: refuse while the files are broken, pass through
 * when the container is not limited; otherwise charge `bytes` first, call the
 * driver, then remember the handle in `out` under `tab` (or give the bytes
 * back if the driver failed). */
#define ALLOC_HOOK(sym, tab, out, bytes, params, ...)                                                     \
    HOOK CUresult mg_h_##sym params {                                                                      \
        if (!mg_on()) return mg_refusing() ? CUDA_ERROR_OUT_OF_MEMORY : CALL_REAL(sym, __VA_ARGS__);      \
        uint64_t bytes_ = (bytes);                                                                         \
        CUresult rc = mg_charge(bytes_);                                                                   \
        if (rc != CUDA_SUCCESS) return rc;                                                                 \
        rc = CALL_REAL(sym, __VA_ARGS__);                                                                  \
        if (MG_UNLIKELY(rc == CUDA_ERROR_OUT_OF_MEMORY) && mg_reclaim(rc, bytes_)) rc = CALL_REAL(sym, __VA_ARGS__); \
        mg_settle(&(tab), rc, rc == CUDA_SUCCESS && (out) ? (uint64_t)(uintptr_t)(*(out)) : 0, bytes_); \
        return rc;                                                                                         \
    }

ALLOC_HOOK(cuMemAlloc_v2, g_ptrs, dptr, bytesize, (CUdeviceptr * dptr, size_t bytesize), dptr, bytesize)
ALLOC_HOOK(cuMemAlloc, g_ptrs, dptr, bytesize, (CUdeviceptr_v1 * dptr, unsigned int bytesize), dptr, bytesize)
ALLOC_HOOK(cuMemAllocManaged, g_ptrs, dptr, bytesize, (CUdeviceptr * dptr, size_t bytesize, unsigned int flags),
           dptr, bytesize, flags)

/* Pitched: the driver picks the pitch, so charge width*height first and the
 * padding once it is known; if the padding does not fit, undo the allocation. */
static CUresult mg_pitch_settle(CUresult rc, uint64_t key, uint64_t pitch, uint64_t height, uint64_t charged,
                                CUresult (*real_free)(CUdeviceptr)) {
    if (rc != CUDA_SUCCESS) {
        mg_uncharge(charged);
        return rc;
    }
    uint64_t actual;
    if (__builtin_mul_overflow(pitch, height, &actual)) actual = UINT64_MAX;
    if (actual > charged) {
        if (mg_charge(actual - charged) != CUDA_SUCCESS) {
            if (real_free) real_free(key);
            mg_uncharge(charged);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    } else if (actual < charged) {
        mg_uncharge(charged - actual);
    }
    mg_settle(&g_ptrs, CUDA_SUCCESS, key, actual);
    return CUDA_SUCCESS;
}

HOOK CUresult mg_h_cuMemFree_v2(CUdeviceptr dptr);
static CUresult mg_free_v1_adapter(CUdeviceptr p);

/* The _v2 (size_t) and legacy 32-bit cuMemAllocPitch differ only in types. */
#define PITCH_HOOK(sym, ptr_t, dim_t, real_free)                                                              \
    HOOK CUresult mg_h_##sym(ptr_t *dptr, dim_t *pPitch, dim_t WidthInBytes, dim_t Height,                   \
                             unsigned int ElementSizeBytes) {                                                  \
        if (!mg_on())                                                                                          \
            return mg_refusing() ? CUDA_ERROR_OUT_OF_MEMORY                                                    \
                                 : CALL_REAL(sym, dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);       \
        uint64_t est;                                                                                          \
        if (__builtin_mul_overflow((uint64_t)WidthInBytes, (uint64_t)Height, &est)) return CUDA_ERROR_OUT_OF_MEMORY; \
        CUresult rc = mg_charge(est);                                                                          \
        if (rc != CUDA_SUCCESS) return rc;                                                                     \
        rc = CALL_REAL(sym, dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);                             \
        if (MG_UNLIKELY(rc == CUDA_ERROR_OUT_OF_MEMORY) && mg_reclaim(rc, est))                               \
            rc = CALL_REAL(sym, dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);                         \
        rc = mg_pitch_settle(rc, rc == CUDA_SUCCESS ? *dptr : 0, rc == CUDA_SUCCESS ? *pPitch : 0, Height, est, \
                             real_free);                                                                       \
        if (rc != CUDA_SUCCESS && dptr) *dptr = 0;                                                             \
        return rc;                                                                                             \
    }

PITCH_HOOK(cuMemAllocPitch_v2, CUdeviceptr, size_t, REAL(cuMemFree_v2))
PITCH_HOOK(cuMemAllocPitch, CUdeviceptr_v1, unsigned int, mg_free_v1_adapter)

/* --- stream-ordered allocation: memory pools ---
 *
 * A pool reserves physical memory and hands allocations out of it. After
 * cuMemFreeAsync the block stays reserved in the pool (NVML shows it used) until
 * the pool gives it back: at a stream/event/context synchronize, down to its
 * CU_MEMPOOL_ATTR_RELEASE_THRESHOLD (default 0; PyTorch's cudaMallocAsync
 * backend sets UINT64_MAX, i.e. never), at cuMemPoolTrimTo, or when the pool is
 * destroyed (with its last outstanding allocation). So per pool the container is
 * charged for
 *     its live allocations (per pointer, at their size, as for cuMemAlloc)
 *   + its idle reservation = RESERVED_MEM_CURRENT - USED_MEM_CURRENT,
 * the latter read from the driver after every call that can change it (alloc,
 * free, trim, synchronize, destroy) and charged or uncharged by the difference
 * from what was last counted (g_pool[], process-local: pools are per process).
 *
 * The limit is checked BEFORE a pool grows: an allocation first takes what the
 * pool holds idle (already counted: no new charge), and charges only the rest
 * through mg_charge (fast path, arbiter, or CUDA_ERROR_OUT_OF_MEMORY). If the
 * pool could not serve it from the idle memory after all (fragmentation, or
 * another pool than expected), the pool grew by more than was charged: the
 * extra is counted at once (never under) and must pass mg_admit; if it does
 * not, the allocation is freed, the pool trimmed back and the caller gets
 * CUDA_ERROR_OUT_OF_MEMORY.
 *
 * Order, so a count is never below what the driver holds: idle is charged
 * before a freed block's live bytes are uncharged. Races between threads can
 * only over-count for a moment (until the next reconcile of that pool). Not
 * counted: the rounding of each live allocation up to the pool's granularity
 * (USED_MEM - sizes), as for every other allocation kind.
 *
 * g_pool_mu is a process-local mutex (a dead process takes it with it); it is
 * held across the driver's pool calls (non-blocking) but never across a
 * synchronize, an arbiter request or mg_charge.
 */

#define MG_POOL_SLOTS 512 /* pools one process may have counted at once (power of two) */
#define CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT 5
#define CU_MEMPOOL_ATTR_USED_MEM_CURRENT 7
#define CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE 17

typedef struct {
    uint64_t key;  /* the CUmemoryPool; KEY_EMPTY, KEY_TOMB */
    uint64_t idle; /* bytes counted for its idle reservation */
    uint64_t live; /* this process's counted allocations from it */
    uint64_t res;  /* RESERVED_MEM_CURRENT as last read (valid if known; can only be high) */
    uint64_t used; /* USED_MEM_CURRENT as last read, followed through frees (valid if known) */
    int known;     /* res/used were read; each later change went through a hook under g_pool_mu */
    int destroyed; /* cuMemPoolDestroy returned while allocations were live */
    unsigned pos;  /* 1 + index in g_pool_active while on it, else 0 */
    /* The block freed into it last (stream-ordered, footprint known), until the
     * next allocation from it or a reading of it: see mg_pool_alloc. */
    uint64_t lf_ptr, lf_size, lf_foot;
} mg_pool_t;

/* Pool frees whose real call runs without g_pool_mu (cuMemFree on a pool
 * pointer, which may block; mg_pool_undo): while any is in flight, USED may
 * drop under an allocation's feet, so no footprint is derived from it. */
static _Atomic unsigned g_pool_unlocked;
/* Synchronizes and trims in flight (the real call, then the reconcile): the
 * driver may be releasing pool memory behind the records meanwhile. */
static _Atomic unsigned g_pool_syncing;

static void mg_sync_begin(void) { atomic_fetch_add(&g_pool_syncing, 1); }
static void mg_sync_end(void) { atomic_fetch_sub(&g_pool_syncing, 1); }
#define MG_FOOT_UNKNOWN UINT64_MAX /* an entry's slop: the footprint could not be told */
/* The pool this thread's last cuMemAllocAsync came from: the guess for the next
 * one (checked after the call with cuPointerGetAttribute). */
static _Thread_local uint64_t t_pool_guess __attribute__((tls_model("initial-exec")));

static pthread_mutex_t g_pool_mu = PTHREAD_MUTEX_INITIALIZER;
static mg_pool_t g_pool[MG_POOL_SLOTS];
static uint16_t g_pool_active[MG_POOL_SLOTS]; /* pools with idle > 0 or a last freed block: see mg_pool_activity */
static _Atomic unsigned g_pool_nactive;
static _Atomic int g_warned_pools;

typedef CUresult (*mg_pool_attr_fn)(CUmemoryPool, int, void *);
typedef CUresult (*mg_ptr_attr_fn)(void *, int, CUdeviceptr);
typedef CUresult (*mg_ctx_dev_fn)(CUdevice *);
typedef CUresult (*mg_dev_pool_fn)(CUmemoryPool *, CUdevice);

static void mg_pools_reset(void) {
    pthread_mutex_init(&g_pool_mu, NULL);
    memset(g_pool, 0, sizeof g_pool);
    atomic_store(&g_pool_nactive, 0);
    atomic_store(&g_pool_unlocked, 0);
    atomic_store(&g_pool_syncing, 0);
    t_pool_guess = 0;
}

static inline unsigned mg_pool_hash(uint64_t key) {
    return (unsigned)((key * 0x9E3779B97F4A7C15ull) >> 40) & (MG_POOL_SLOTS - 1);
}

/* The pool's record (created if asked), or NULL. Callers hold g_pool_mu. */
static mg_pool_t *mg_pool_find(uint64_t key, int create) {
    if (key == KEY_EMPTY || key == KEY_TOMB) return NULL;
    mg_pool_t *free_slot = NULL;
    unsigned h = mg_pool_hash(key);
    for (unsigned n = 0; n < MG_POOL_SLOTS; n++, h = (h + 1) & (MG_POOL_SLOTS - 1)) {
        mg_pool_t *p = &g_pool[h];
        if (p->key == key) return p;
        if (p->key == KEY_TOMB && !free_slot) free_slot = p;
        if (p->key == KEY_EMPTY) {
            if (!free_slot) free_slot = p;
            break;
        }
    }
    if (!create || !free_slot) return NULL;
    *free_slot = (mg_pool_t){.key = key};
    return free_slot;
}

/* A pool is on the active list while it has idle memory counted or a last
 * freed block recorded: what a synchronize must reconcile. */
static void mg_pool_activity(mg_pool_t *p) {
    unsigned n = atomic_load_explicit(&g_pool_nactive, memory_order_relaxed);
    int active = p->idle || p->lf_ptr;
    if (active && !p->pos) {
        g_pool_active[n] = (uint16_t)(p - g_pool);
        p->pos = ++n;
    } else if (!active && p->pos) {
        unsigned last = g_pool_active[--n];
        g_pool_active[p->pos - 1] = (uint16_t)last;
        g_pool[last].pos = p->pos;
        p->pos = 0;
    }
    atomic_store_explicit(&g_pool_nactive, n, memory_order_release);
}

static void mg_pool_set_idle(mg_pool_t *p, uint64_t idle) {
    p->idle = idle;
    mg_pool_activity(p);
}

/* Record (key != 0) or forget (0) the block freed into the pool last. Callers hold g_pool_mu. */
static void mg_pool_lf(mg_pool_t *p, uint64_t key, uint64_t size, uint64_t foot) {
    int was = p->lf_ptr != 0;
    p->lf_ptr = key, p->lf_size = size, p->lf_foot = foot;
    if (was != (key != 0)) mg_pool_activity(p);
}

/* Drop the record (its idle already uncounted). */
static void mg_pool_remove(mg_pool_t *p) {
    mg_pool_lf(p, 0, 0, 0);
    mg_pool_set_idle(p, 0);
    p->key = KEY_TOMB;
    unsigned i = (unsigned)(p - g_pool);
    if (g_pool[(i + 1) & (MG_POOL_SLOTS - 1)].key != KEY_EMPTY) return;
    while (g_pool[i].key == KEY_TOMB) { /* the end of a probe run: tombstones there are dead weight */
        g_pool[i].key = KEY_EMPTY;
        i = (i - 1) & (MG_POOL_SLOTS - 1);
    }
}

static int mg_pool_read(uint64_t pool, uint64_t *reserved, uint64_t *used) {
    mg_pool_attr_fn get = (mg_pool_attr_fn)mg_plain(P_cuMemPoolGetAttribute);
    cuuint64_t r = 0, u = 0;
    if (!get || get((CUmemoryPool)(uintptr_t)pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &r) != CUDA_SUCCESS ||
        get((CUmemoryPool)(uintptr_t)pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &u) != CUDA_SUCCESS)
        return -1;
    *reserved = r;
    if (used) *used = u;
    return 0;
}

/* Count the pool's idle reservation as the driver reports it now. Returns the
 * bytes charged by force (0 if it shrank or stayed). Callers hold g_pool_mu. */
static uint64_t mg_pool_apply(mg_pool_t *p, uint64_t r, uint64_t u) {
    uint64_t truth = r > u ? r - u : 0, grew = 0;
    if (truth > p->idle)
        mg_force_charge(grew = truth - p->idle);
    else
        mg_uncharge(p->idle - truth);
    mg_pool_set_idle(p, truth);
    p->res = r, p->used = u, p->known = 1;
    mg_pool_lf(p, 0, 0, 0);
    return grew;
}

static uint64_t mg_pool_reconcile(mg_pool_t *p) {
    uint64_t r, u;
    if (p->destroyed || mg_pool_read(p->key, &r, &u) != 0) { /* cannot tell: keep what is counted */
        p->known = 0;
        mg_pool_lf(p, 0, 0, 0);
        return 0;
    }
    /* Nothing released or taken since it was recorded: the last freed block is
     * still the pool's, still reusable without a read. */
    uint64_t lf = p->known && r == p->res && u == p->used ? p->lf_ptr : 0, lsz = p->lf_size, lft = p->lf_foot;
    uint64_t grew = mg_pool_apply(p, r, u);
    if (lf) mg_pool_lf(p, lf, lsz, lft);
    return grew;
}

/* After a synchronize: pools release what they hold above their threshold. */
static void mg_pools_synced(void) {
    if (MG_LIKELY(atomic_load_explicit(&g_pool_nactive, memory_order_acquire) == 0)) return;
    pthread_mutex_lock(&g_pool_mu);
    /* Backwards: a pool leaving the list is replaced by the last one, already seen. */
    for (unsigned i = atomic_load_explicit(&g_pool_nactive, memory_order_relaxed); i-- > 0;)
        if (i < atomic_load_explicit(&g_pool_nactive, memory_order_relaxed))
            mg_pool_reconcile(&g_pool[g_pool_active[i]]);
    pthread_mutex_unlock(&g_pool_mu);
    mg_maybe_return_grant();
}

/* The pool cuMemAllocAsync will use: the current pool of the calling thread's device. */
static uint64_t mg_current_pool(void) {
    mg_ctx_dev_fn ctx_dev = (mg_ctx_dev_fn)mg_plain(P_cuCtxGetDevice);
    mg_dev_pool_fn dev_pool = (mg_dev_pool_fn)mg_plain(P_cuDeviceGetMemPool);
    CUdevice dev;
    CUmemoryPool pool = NULL;
    if (!ctx_dev || !dev_pool || ctx_dev(&dev) != CUDA_SUCCESS || dev_pool(&pool, dev) != CUDA_SUCCESS) return 0;
    return (uint64_t)(uintptr_t)pool;
}

enum { PA_ASYNC, PA_ASYNC_PTSZ, PA_POOL, PA_POOL_PTSZ };

/* Hooks defined further down whose real functions are called from here. */
HOOK CUresult mg_h_cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
HOOK CUresult mg_h_cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
HOOK CUresult mg_h_cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream);
HOOK CUresult mg_h_cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                                CUstream hStream);
HOOK CUresult mg_h_cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream);
HOOK CUresult mg_h_cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream);
HOOK CUresult mg_h_cuStreamSynchronize(CUstream hStream);
HOOK CUresult mg_h_cuStreamSynchronize_ptsz(CUstream hStream);
HOOK CUresult mg_h_cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep);

static CUresult mg_pool_real_alloc(int how, CUdeviceptr *d, size_t n, CUmemoryPool pool, CUstream s) {
    switch (how) {
    case PA_ASYNC: return CALL_REAL(cuMemAllocAsync, d, n, s);
    case PA_ASYNC_PTSZ: return CALL_REAL(cuMemAllocAsync_ptsz, d, n, s);
    case PA_POOL: return CALL_REAL(cuMemAllocFromPoolAsync, d, n, pool, s);
    default: return CALL_REAL(cuMemAllocFromPoolAsync_ptsz, d, n, pool, s);
    }
}

/* Give back `take` bytes an allocation borrowed from the pool's idle count. */
static void mg_pool_untake(uint64_t pool, uint64_t take) {
    if (!take) return;
    pthread_mutex_lock(&g_pool_mu);
    mg_pool_t *p = mg_pool_find(pool, 0);
    if (p) {
        mg_pool_set_idle(p, p->idle + take);
        mg_pool_reconcile(p);
    } else {
        mg_uncharge(take);
    }
    pthread_mutex_unlock(&g_pool_mu);
}

/* A counted pool allocation went away (freed, or undone). Callers hold g_pool_mu. */
static void mg_pool_dropped(uint64_t pool) {
    mg_pool_t *p = mg_pool_find(pool, 0);
    if (!p) return;
    if (p->live) p->live--;
    if (!p->destroyed) {
        mg_pool_reconcile(p);
    } else if (p->live == 0) { /* the destroyed pool's last allocation: the driver frees the pool now */
        mg_uncharge(p->idle);
        mg_pool_remove(p);
    }
}

/* The driver granted more than was checked against the limit and the
 * container may not keep it: free the allocation, let the pool release what
 * it grew by (down to `keep`), and refuse. */
static MG_COLD CUresult mg_pool_undo(int how, CUdeviceptr d, CUstream hs, uint64_t pool, uint64_t n, uint64_t keep,
                                     int can_trim) {
    uint64_t bytes = 0, aux = 0, slop = 0;
    int mine = mg_tab_take_slop(&g_ptrs, d, &bytes, &aux, &slop);
    atomic_fetch_add(&g_pool_unlocked, 1); /* the free and synchronize below run without g_pool_mu */
    CUresult rc = how == PA_ASYNC_PTSZ || how == PA_POOL_PTSZ ? CALL_REAL(cuMemFreeAsync_ptsz, d, hs)
                                                              : CALL_REAL(cuMemFreeAsync, d, hs);
    if (rc == CUDA_SUCCESS) { /* the freed block must be seen completed before the pool may release it */
        if (how == PA_ASYNC_PTSZ || how == PA_POOL_PTSZ)
            (void)CALL_REAL(cuStreamSynchronize_ptsz, hs);
        else
            (void)CALL_REAL(cuStreamSynchronize, hs);
    }
    pthread_mutex_lock(&g_pool_mu);
    if (rc == CUDA_SUCCESS && can_trim) (void)CALL_REAL(cuMemPoolTrimTo, (CUmemoryPool)(uintptr_t)pool, keep);
    if (rc == CUDA_SUCCESS && mine) mg_pool_dropped(aux);
    else if (rc == CUDA_SUCCESS) { /* never recorded: still follow what the pool holds now */
        mg_pool_t *p = mg_pool_find(pool, 0);
        if (p) mg_pool_reconcile(p);
    }
    atomic_fetch_sub(&g_pool_unlocked, 1);
    pthread_mutex_unlock(&g_pool_mu);
    if (rc == CUDA_SUCCESS) {
        mg_pools_synced(); /* the synchronize released other pools' memory too */
        mg_uncharge(mine ? bytes : n);
    } else if (mine) {
        mg_tab_put_slop(&g_ptrs, d, bytes, aux, slop); /* still allocated: still counted */
    } /* else: still allocated and never recorded: stays counted (never under) */
    return mg_refuse(atomic_load_explicit(&g_slot, memory_order_acquire));
}

/* Steady state (the pool known, the guess right): g_pool_mu held once across
 * the real call and one RESERVED + USED read after it (none when the block
 * freed last comes back for the same size); no charge at all when the pool
 * served the allocation from idle memory already counted. The reservation before the call
 * is the one last read (the driver only grows a pool inside a hooked call made
 * under g_pool_mu; releases it misses can only make it high, never low). */
static CUresult mg_pool_alloc(int how, CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream hs) {
    if (!mg_on()) return mg_refusing() ? CUDA_ERROR_OUT_OF_MEMORY : mg_pool_real_alloc(how, dptr, size, pool, hs);
    if (!dptr || size == 0) return mg_pool_real_alloc(how, dptr, size, pool, hs); /* refused, nothing to count */
    /* Captured into a graph: a memory node, counted when the graph gets its memory (mg_graph.c). */
    if (MG_UNLIKELY(atomic_load_explicit(&mg_capturing, memory_order_relaxed)) && mg_stream_capturing(hs))
        return mg_pool_real_alloc(how, dptr, size, pool, hs);
    /* A host-located pool hands out host RAM: not GPU memory. */
    if (pool && MG_UNLIKELY(mg_tab_find(&g_hostpools, (uint64_t)(uintptr_t)pool) != NULL))
        return mg_pool_real_alloc(how, dptr, size, pool, hs);
    uint64_t n = size;
    int by_stream = how == PA_ASYNC || how == PA_ASYNC_PTSZ;
    uint64_t want_pool = (uint64_t)(uintptr_t)pool;
    if (by_stream) want_pool = t_pool_guess ? t_pool_guess : mg_current_pool();

    /* 1. What the pool holds idle serves first: those bytes are counted already. */
    uint64_t take = 0;
    pthread_mutex_lock(&g_pool_mu);
    mg_pool_t *p = mg_pool_find(want_pool, 0);
    if (p && !p->destroyed && p->idle) {
        take = p->idle < n ? p->idle : n;
        mg_pool_set_idle(p, p->idle - take);
    }

    /* 2. The rest against the limit: fast path, the arbiter, or a refusal. */
    CUresult rc;
    if (take < n) {
        pthread_mutex_unlock(&g_pool_mu);
        rc = mg_charge(n - take);
        if (rc != CUDA_SUCCESS) {
            mg_pool_untake(want_pool, take);
            return rc;
        }
        pthread_mutex_lock(&g_pool_mu);
    }

    /* 3. The driver call; the pool's reservation before it as last read. */
    uint64_t r0 = 0, extra = 0, got = want_pool;
    int have_r0 = 0, reclaimed = 0;
    for (;;) {
        p = mg_pool_find(want_pool, 0);
        if (p && p->known && !p->destroyed)
            r0 = p->res, have_r0 = 1;
        else
            have_r0 = want_pool && mg_pool_read(want_pool, &r0, NULL) == 0;
        rc = mg_pool_real_alloc(how, dptr, size, pool, hs);
        if (rc == CUDA_SUCCESS) break; /* still holding g_pool_mu */
        if (p) mg_pool_lf(p, 0, 0, 0); /* a refused allocation may have made the pool release blocks */
        pthread_mutex_unlock(&g_pool_mu);
        if (rc != CUDA_ERROR_OUT_OF_MEMORY || reclaimed || !mg_reclaim(rc, n)) {
            mg_pool_untake(want_pool, take);
            mg_uncharge(n - take);
            return rc;
        }
        reclaimed = 1;
        pthread_mutex_lock(&g_pool_mu);
    }
    uint64_t d = *dptr, r1 = 0, u1 = 0;
    int have_ru = 0;
    /* The block freed into the pool last came back, for an allocation of the
     * same size: the pool served it from its own reservation (a block it holds
     * is not reserved again), so RESERVED stands, USED grew by that block's
     * footprint, and the pool is the one it was freed into (it keeps the block
     * until a synchronize or trim releases it, and none is in flight): no
     * driver read. Anything else reads the pool, as below. */
    if (p && p->known && !p->destroyed && p->lf_ptr == d && d && p->lf_size == n && p->lf_foot >= n &&
        p->lf_foot != MG_FOOT_UNKNOWN && atomic_load(&g_pool_unlocked) == 0 &&
        atomic_load(&g_pool_syncing) == 0) {
        r1 = p->res, u1 = p->used + p->lf_foot, have_ru = 1;
        if (by_stream) t_pool_guess = got;
    } else if (by_stream) { /* which pool it really came from */
        /* The guessed pool's USED grew: it was that one. Only a hooked
         * allocation, made under g_pool_mu, can make a pool's USED grow (frees
         * made without the mutex only lower it, and none is in flight). */
        if (p && p->known && !p->destroyed && atomic_load(&g_pool_unlocked) == 0 &&
            mg_pool_read(want_pool, &r1, &u1) == 0 && u1 > p->used)
            have_ru = 1;
        else {
            mg_ptr_attr_fn attr = (mg_ptr_attr_fn)mg_plain(P_cuPointerGetAttribute);
            void *h = NULL;
            if (attr && attr(&h, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, d) == CUDA_SUCCESS && h)
                got = (uint64_t)(uintptr_t)h;
        }
        t_pool_guess = got;
    }
    if (got != want_pool) {
        /* Another pool than the one that lent its idle bytes: they go back to
         * it, this allocation is counted in full, and all of it needs admission. */
        mg_pool_t *lender = mg_pool_find(want_pool, 0);
        if (lender && take) mg_pool_set_idle(lender, lender->idle + take);
        else mg_uncharge(take);
        if (lender) mg_pool_reconcile(lender);
        mg_force_charge(take);
        extra = n;
    }
    mg_pool_t *rec = mg_pool_find(got, 1);
    if (rec && rec->destroyed) rec->destroyed = 0, rec->known = 0; /* the handle of a destroyed pool came back */
    uint64_t forced = 0, foot = MG_FOOT_UNKNOWN;
    if (rec && (have_ru || mg_pool_read(got, &r1, &u1) == 0)) {
        if (got == want_pool && have_r0 && r1 > r0 && r1 - r0 > n - take)
            extra = r1 - r0 - (n - take); /* the pool grew by more than was checked */
        /* The footprint (USED grew by it; at least n): what a free will make idle. */
        if (rec->known && u1 >= rec->used && u1 - rec->used >= n && atomic_load(&g_pool_unlocked) == 0)
            foot = u1 - rec->used;
        forced = mg_pool_apply(rec, r1, u1);
    } else if (rec) {
        rec->known = 0;
    }
    int put = rec && mg_tab_put_slop(&g_ptrs, d, n, got, foot == MG_FOOT_UNKNOWN ? foot : foot - n) == 0;
    if (put) rec->live++;
    if (forced > extra) extra = forced;
    pthread_mutex_unlock(&g_pool_mu);
    if (!rec) {
        MG_WARN_ONCE(g_warned_pools, "more than %d memory pools: refusing allocations from more", MG_POOL_SLOTS);
        *dptr = 0;
        return mg_pool_undo(how, d, hs, got, n, 0, 0);
    }
    if (!put)
        MG_WARN_ONCE(g_warned_track,
                     "allocation table full (MEMGUARD_TRACK_BITS): some memory stays counted after free");

    /* 4. Whatever the pool grew by beyond the check must still fit. */
    if (MG_UNLIKELY(extra) && !mg_admit(extra)) {
        *dptr = 0;
        return mg_pool_undo(how, d, hs, got, n, r0, have_r0 && got == want_pool);
    }
    return CUDA_SUCCESS;
}

HOOK CUresult mg_h_cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    return mg_pool_alloc(PA_ASYNC, dptr, bytesize, NULL, hStream);
}
HOOK CUresult mg_h_cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    return mg_pool_alloc(PA_ASYNC_PTSZ, dptr, bytesize, NULL, hStream);
}
HOOK CUresult mg_h_cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream) {
    return mg_pool_alloc(PA_POOL, dptr, bytesize, pool, hStream);
}
HOOK CUresult mg_h_cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                                CUstream hStream) {
    return mg_pool_alloc(PA_POOL_PTSZ, dptr, bytesize, pool, hStream);
}

/* Before the real free of a pool allocation: a stream-ordered free only
 * enqueues (never blocks), so it runs under g_pool_mu and the pool's USED is
 * followed without a read; cuMemFree may block, so it runs unlocked. */
static int mg_pool_free_begin(int in_order) {
    if (in_order) {
        pthread_mutex_lock(&g_pool_mu);
        return 1;
    }
    atomic_fetch_add(&g_pool_unlocked, 1);
    return 0;
}

/* A pool allocation was freed (any free entry point). The driver keeps the
 * block reserved (it releases only at a synchronize, a trim or a destroy), so
 * its footprint moves from USED to idle: counted as idle before the live bytes
 * go, with no driver call when the footprint is known and the free was made
 * under g_pool_mu; else the pool is read. */
static void mg_pool_freed(CUresult rc, uint64_t key, uint64_t bytes, uint64_t pool, uint64_t slop, int locked) {
    if (!locked) pthread_mutex_lock(&g_pool_mu);
    if (rc != CUDA_SUCCESS) {
        mg_tab_put_slop(&g_ptrs, key, bytes, pool, slop);
    } else {
        uint64_t foot;
        foot = slop == MG_FOOT_UNKNOWN || bytes + slop < bytes ? MG_FOOT_UNKNOWN : bytes + slop;
        mg_pool_t *p = mg_pool_find(pool, 0);
        uint64_t idle_in = 0, gone = bytes;
        if (p) {
            if (p->live) p->live--;
            if (p->destroyed && p->live == 0) { /* its last allocation: the driver frees the pool now */
                gone += p->idle;
                mg_pool_remove(p);
            } else if (p->destroyed) { /* the block stays with the dying pool */
                if (foot != MG_FOOT_UNKNOWN) mg_pool_set_idle(p, p->idle + (idle_in = foot));
            } else if (locked && p->known && foot != MG_FOOT_UNKNOWN && p->used >= foot) {
                p->used -= foot;
                mg_pool_set_idle(p, p->idle + (idle_in = foot));
                mg_pool_lf(p, key, bytes, foot);
            } else {
                mg_pool_reconcile(p);
            }
        }
        if (idle_in >= gone) /* idle counted before the live bytes go: never under */
            mg_force_charge(idle_in - gone);
        else
            mg_uncharge(gone - idle_in);
    }
    if (!locked) atomic_fetch_sub(&g_pool_unlocked, 1);
    pthread_mutex_unlock(&g_pool_mu);
    if (rc == CUDA_SUCCESS) mg_maybe_return_grant();
}

HOOK CUresult mg_h_cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep) {
    mg_sync_begin();
    CUresult rc = CALL_REAL(cuMemPoolTrimTo, pool, minBytesToKeep);
    if (rc != CUDA_SUCCESS || !mg_on()) {
        mg_sync_end();
        return rc;
    }
    pthread_mutex_lock(&g_pool_mu);
    mg_pool_t *p = mg_pool_find((uint64_t)(uintptr_t)pool, 0);
    if (p) mg_pool_reconcile(p);
    pthread_mutex_unlock(&g_pool_mu);
    mg_sync_end();
    mg_maybe_return_grant();
    return rc;
}

/* The driver frees a destroyed pool's memory at once if nothing allocated from
 * it is outstanding, else with the last outstanding allocation: its idle stays
 * counted until then (the driver's reservation cannot be read any more). */
/* Pools on a host location are remembered so their allocations pass uncounted. */
HOOK CUresult mg_h_cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props) {
    CUresult rc = CALL_REAL(cuMemPoolCreate, pool, props);
    if (rc == CUDA_SUCCESS && pool && mg_on() && mg_loc_host(props) &&
        mg_tab_put(&g_hostpools, (uint64_t)(uintptr_t)*pool, 0, 0) != 0)
        MG_WARN_ONCE(g_warned_pools, "too many host memory pools: allocations from more are counted as GPU memory");
    return rc;
}

HOOK CUresult mg_h_cuMemPoolDestroy(CUmemoryPool pool) {
    if (!mg_on()) return CALL_REAL(cuMemPoolDestroy, pool);
    uint64_t none = 0;
    if (mg_tab_take(&g_hostpools, (uint64_t)(uintptr_t)pool, &none, NULL)) {
        CUresult hrc = CALL_REAL(cuMemPoolDestroy, pool);
        if (hrc != CUDA_SUCCESS) mg_tab_put(&g_hostpools, (uint64_t)(uintptr_t)pool, 0, 0);
        return hrc;
    }
    uint64_t freed = 0;
    pthread_mutex_lock(&g_pool_mu);
    CUresult rc = CALL_REAL(cuMemPoolDestroy, pool);
    mg_pool_t *p = rc == CUDA_SUCCESS ? mg_pool_find((uint64_t)(uintptr_t)pool, 0) : NULL;
    if (p && p->live == 0) {
        freed = p->idle;
        mg_pool_remove(p);
    } else if (p) {
        p->destroyed = 1;
    }
    pthread_mutex_unlock(&g_pool_mu);
    if (freed) {
        mg_uncharge(freed);
        mg_maybe_return_grant();
    }
    return rc;
}

/* Synchronize points: where pools release memory above their threshold. */
#define SYNC_HOOK(sym, params, ...)                   \
    HOOK CUresult mg_h_##sym params {                 \
        mg_sync_begin();                              \
        CUresult rc = CALL_REAL(sym, __VA_ARGS__);    \
        if (mg_on()) mg_pools_synced();               \
        mg_sync_end();                                \
        return rc;                                    \
    }

SYNC_HOOK(cuStreamSynchronize, (CUstream hStream), hStream)
SYNC_HOOK(cuStreamSynchronize_ptsz, (CUstream hStream), hStream)
SYNC_HOOK(cuEventSynchronize, (CUevent hEvent), hEvent)
HOOK CUresult mg_h_cuCtxSynchronize(void) {
    mg_sync_begin();
    CUresult rc = CALL_REAL(cuCtxSynchronize);
    if (mg_on()) mg_pools_synced();
    mg_sync_end();
    return rc;
}
SYNC_HOOK(cuCtxSynchronize_v2, (CUcontext ctx), ctx)

/* --- frees --- */

/* Take the size out of the table before the real free (another thread's
 * allocation may get the same address right after it); put it back if the
 * driver refuses the free. Pool allocations (any free entry point may free
 * them) leave their block idle in the pool: see mg_pool_freed. */
#define FREE_HOOK(sym, tab, key, in_order, params, ...)                 \
    HOOK CUresult mg_h_##sym params {                                   \
        if (!mg_on()) return CALL_REAL(sym, __VA_ARGS__);               \
        uint64_t bytes = 0, aux = 0, slop = 0, key_ = (uint64_t)(key);  \
        int found = mg_tab_take_slop(&(tab), key_, &bytes, &aux, &slop); \
        if (found && aux > 1) { /* a pool allocation (aux: its pool) */ \
            int locked_ = mg_pool_free_begin(in_order);                 \
            CUresult rc = CALL_REAL(sym, __VA_ARGS__);                  \
            mg_pool_freed(rc, key_, bytes, aux, slop, locked_);         \
            return rc;                                                  \
        }                                                               \
        CUresult rc = CALL_REAL(sym, __VA_ARGS__);                      \
        mg_freed(&(tab), rc, key_, found, bytes);                       \
        return rc;                                                      \
    }

FREE_HOOK(cuMemFree_v2, g_ptrs, dptr, 0, (CUdeviceptr dptr), dptr)
FREE_HOOK(cuMemFree, g_ptrs, dptr, 0, (CUdeviceptr_v1 dptr), dptr)
FREE_HOOK(cuMemFreeAsync, g_ptrs, dptr, 1, (CUdeviceptr dptr, CUstream hStream), dptr, hStream)
FREE_HOOK(cuMemFreeAsync_ptsz, g_ptrs, dptr, 1, (CUdeviceptr dptr, CUstream hStream), dptr, hStream)
FREE_HOOK(cuArrayDestroy, g_arrays, (uintptr_t)hArray, 0, (CUarray hArray), hArray)
FREE_HOOK(cuMipmappedArrayDestroy, g_arrays, (uintptr_t)hArray, 0, (CUmipmappedArray hArray), hArray)

static CUresult mg_free_v1_adapter(CUdeviceptr p) {
    __typeof__(&mg_h_cuMemFree) f = REAL(cuMemFree);
    return f ? f((CUdeviceptr_v1)p) : CUDA_ERROR_NOT_FOUND;
}

/* --- virtual memory management: physical memory is cuMemCreate's; address
 * reservations (cuMemAddressReserve) are not memory and are not hooked.
 *
 * The driver frees a cuMemCreate allocation only when its handle is released
 * AND every mapping of it is unmapped (cuMemRelease, cuMemUnmap in the driver
 * API reference); cuMemRetainAllocationHandle adds a handle reference. Releasing
 * the handle right after cuMemMap is the documented pattern (vectorAddMMAP), so
 * the bytes stay counted until the last reference goes:
 *   g_handles: handle -> bytes, refs (cuMemCreate's + retains + live mappings);
 *   g_maps:    mapping base -> mapping size, handle.
 * refs only ever rises from a non-zero value (CAS); whoever takes it from 1 to 0
 * removes the entry and uncounts the bytes, exactly once. References are dropped
 * before the real call (the driver may hand the same handle or address out again
 * right after it) and restored if the driver refuses. Handles this process did
 * not count (created before the shim was on, imported) pass through. --- */

ALLOC_HOOK(cuMemCreate, g_handles, handle, mg_loc_host(prop) ? 0 : size,
           (CUmemGenericAllocationHandle * handle, size_t size, const CUmemAllocationProp *prop,
            unsigned long long flags),
           handle, size, prop, flags)

/* One more reference to a counted handle; 0 if it is not counted here. */
static int mg_href_get(uint64_t h) {
    mg_ent_t *e = mg_tab_find(&g_handles, h);
    if (!e) return 0;
    uint64_t r = atomic_load_explicit(&e->aux, memory_order_acquire);
    do {
        if (r == 0) return 0; /* its last reference is going: not ours to revive */
    } while (!atomic_compare_exchange_weak_explicit(&e->aux, &r, r + 1, memory_order_acq_rel, memory_order_acquire));
    return 1;
}

enum { HREF_NONE, HREF_DROPPED, HREF_LAST };

/* Drop one reference. HREF_LAST: it was the last one; the entry is gone and
 * *bytes are to be uncounted once the driver call succeeded. */
static int mg_href_drop(uint64_t h, uint64_t *bytes) {
    mg_ent_t *e = mg_tab_find(&g_handles, h);
    if (!e) return HREF_NONE;
    uint64_t r = atomic_load_explicit(&e->aux, memory_order_acquire);
    do {
        if (r == 0) return HREF_NONE;
    } while (!atomic_compare_exchange_weak_explicit(&e->aux, &r, r - 1, memory_order_acq_rel, memory_order_acquire));
    if (r > 1) return HREF_DROPPED;
    *bytes = atomic_load_explicit(&e->size, memory_order_acquire);
    uint64_t k = h;
    atomic_compare_exchange_strong_explicit(&e->key, &k, KEY_TOMB, memory_order_acq_rel, memory_order_relaxed);
    return HREF_LAST;
}

/* The driver refused the call a reference was dropped for: take it back. */
static void mg_href_undo(uint64_t h, int dropped, uint64_t bytes) {
    if (dropped == HREF_DROPPED) mg_href_get(h);
    else if (dropped == HREF_LAST) mg_tab_put(&g_handles, h, bytes, 1);
}

static void mg_vmm_freed(uint64_t bytes) {
    if (!bytes) return;
    mg_uncharge(bytes);
    mg_maybe_return_grant();
}

HOOK CUresult mg_h_cuMemRelease(CUmemGenericAllocationHandle handle) {
    if (!mg_on()) return CALL_REAL(cuMemRelease, handle);
    uint64_t bytes = 0;
    int dropped = mg_href_drop(handle, &bytes);
    CUresult rc = CALL_REAL(cuMemRelease, handle);
    if (rc != CUDA_SUCCESS) mg_href_undo(handle, dropped, bytes);
    else if (dropped == HREF_LAST) mg_vmm_freed(bytes);
    return rc;
}

HOOK CUresult mg_h_cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
    CUresult rc = CALL_REAL(cuMemRetainAllocationHandle, handle, addr);
    if (rc == CUDA_SUCCESS && handle && mg_on()) mg_href_get(*handle);
    return rc;
}

HOOK CUresult mg_h_cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                            unsigned long long flags) {
    CUresult rc = CALL_REAL(cuMemMap, ptr, size, offset, handle, flags);
    /* The mapping holds the allocation: a reference, dropped at its unmap. One
     * that cannot be recorded is kept (counted until exit, never under). */
    if (rc == CUDA_SUCCESS && mg_on() && mg_href_get(handle) && mg_tab_put(&g_maps, ptr, size, handle) != 0)
        MG_WARN_ONCE(g_warned_track,
                     "allocation table full (MEMGUARD_TRACK_BITS): some memory stays counted after free");
    return rc;
}

/* The range is whole mappings (the driver refuses anything else), usually one. */
#define MG_UNMAP_BATCH 32

HOOK CUresult mg_h_cuMemUnmap(CUdeviceptr ptr, size_t size) {
    if (!mg_on()) return CALL_REAL(cuMemUnmap, ptr, size);
    struct {
        uint64_t base, size, handle, bytes;
        int dropped;
    } m[MG_UNMAP_BATCH];
    unsigned n = 0;
    uint64_t cur = ptr, end = ptr + size < ptr ? UINT64_MAX : ptr + size;
    while (cur < end && n < MG_UNMAP_BATCH && mg_tab_take(&g_maps, cur, &m[n].size, &m[n].handle)) {
        m[n].base = cur;
        m[n].bytes = 0;
        m[n].dropped = mg_href_drop(m[n].handle, &m[n].bytes);
        cur = m[n].size && cur + m[n].size > cur ? cur + m[n].size : end;
        n++;
    }
    CUresult rc = CALL_REAL(cuMemUnmap, ptr, size);
    if (rc != CUDA_SUCCESS) {
        while (n--) {
            mg_href_undo(m[n].handle, m[n].dropped, m[n].bytes);
            mg_tab_put(&g_maps, m[n].base, m[n].size, m[n].handle);
        }
        return rc;
    }
    uint64_t freed = 0;
    for (unsigned i = 0; i < n; i++)
        if (m[i].dropped == HREF_LAST) freed += m[i].bytes;
    /* More mappings than one batch: the rest, after the fact. */
    uint64_t msize, h, bytes = 0;
    while (cur < end && mg_tab_take(&g_maps, cur, &msize, &h)) {
        if (mg_href_drop(h, &bytes) == HREF_LAST) freed += bytes;
        cur = msize && cur + msize > cur ? cur + msize : end;
    }
    mg_vmm_freed(freed);
    return rc;
}

/* --- arrays --- */

/* A NULL descriptor counts nothing: the driver refuses it (INVALID_VALUE). */
ALLOC_HOOK(cuArrayCreate_v2, g_arrays, pHandle,
           d ? mg_array_bytes(d->Width, d->Height, 0, d->Format, d->NumChannels) : 0,
           (CUarray * pHandle, const CUDA_ARRAY_DESCRIPTOR *d), pHandle, d)
ALLOC_HOOK(cuArray3DCreate_v2, g_arrays, pHandle,
           d ? mg_array_bytes(d->Width, d->Height, d->Depth, d->Format, d->NumChannels) : 0,
           (CUarray * pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d), pHandle, d)

ALLOC_HOOK(cuMipmappedArrayCreate, g_arrays, pHandle, d ? mg_mip_bytes(d, numMipmapLevels) : 0,
           (CUmipmappedArray * pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned int numMipmapLevels), pHandle, d,
           numMipmapLevels)

/* --- memory queries: total = limit, free = limit - container usage --- */

/* The legacy entry points report 32 bits, saturated as the driver does. */
static inline unsigned int mg_u32(uint64_t v) { return v > UINT_MAX ? UINT_MAX : (unsigned int)v; }

HOOK CUresult mg_h_cuMemGetInfo_v2(size_t *free_, size_t *total) {
    CUresult rc = CALL_REAL(cuMemGetInfo_v2, free_, total);
    uint64_t vf, vt;
    if (rc == CUDA_SUCCESS && free_ && total && mg_view(*free_, *total, &vf, &vt)) {
        *free_ = (size_t)vf;
        *total = (size_t)vt;
    }
    return rc;
}

HOOK CUresult mg_h_cuMemGetInfo(unsigned int *free_, unsigned int *total) {
    CUresult rc = CALL_REAL(cuMemGetInfo, free_, total);
    uint64_t vf, vt;
    if (rc == CUDA_SUCCESS && free_ && total && mg_view(*free_, *total, &vf, &vt)) {
        *free_ = mg_u32(vf);
        *total = mg_u32(vt);
    }
    return rc;
}

HOOK CUresult mg_h_cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    CUresult rc = CALL_REAL(cuDeviceTotalMem_v2, bytes, dev);
    uint64_t vf, vt;
    if (rc == CUDA_SUCCESS && bytes && mg_view(*bytes, *bytes, &vf, &vt)) *bytes = (size_t)vt;
    return rc;
}

HOOK CUresult mg_h_cuDeviceTotalMem(unsigned int *bytes, CUdevice dev) {
    CUresult rc = CALL_REAL(cuDeviceTotalMem, bytes, dev);
    uint64_t vf, vt;
    if (rc == CUDA_SUCCESS && bytes && mg_view(*bytes, *bytes, &vf, &vt)) *bytes = mg_u32(vt);
    return rc;
}

HOOK nvmlReturn_t mg_h_nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    nvmlReturn_t rc = CALL_REAL(nvmlDeviceGetMemoryInfo, device, memory);
    uint64_t vf, vt;
    if (rc == NVML_SUCCESS && memory && mg_view(memory->free, memory->total, &vf, &vt)) {
        memory->total = vt;
        memory->free = vf;
        memory->used = vt - vf;
    }
    return rc;
}

HOOK nvmlReturn_t mg_h_nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    nvmlReturn_t rc = CALL_REAL(nvmlDeviceGetMemoryInfo_v2, device, memory);
    uint64_t vf, vt;
    if (rc == NVML_SUCCESS && memory && mg_view(memory->free, memory->total, &vf, &vt)) {
        /* The container's total excludes the driver's reservation (the agent
         * hands out allocatable = total - reserved), so reserved is 0 here and
         * total = reserved + used + free still holds. */
        memory->total = vt;
        memory->reserved = 0;
        memory->free = vf;
        memory->used = vt - vf;
    }
    return rc;
}

/* --- NVML: the container's view of processes, utilisation and BAR1 ---
 *
 * NVML's process lists and per-process utilisation name every process on the
 * GPU, whichever container it is in. Under the shim a process sees only its
 * own container's: the processes holding a slot in the container's usage file,
 * i.e. those running the shim. A process of the container that does not run
 * the shim is not listed either (nothing tells the shim it belongs here; it is
 * not held to the limit either). Entries of other containers are never shown.
 *
 * Pids: NVML reports pids as the kernel's initial pid namespace sees them; the
 * slots hold pids of the container's namespace. They compare only when the two
 * are the same: a process in the initial pid namespace (hostPID, a simulated
 * node on a host), or MEMGUARD_NVML_PIDS=local, set where NVML reports pids of
 * the caller's namespace (simgpu in a container); =none: never; =host: NVML's pids
 * are another namespace's even here (as in a container). Elsewhere the shim cannot
 * tell which host pid is whose, so it lists no process at all (never a
 * neighbour's: a container pid can equal a neighbour's host pid), and says so
 * once in the log.
 *
 * This is a view, not a wall: a process that does not load the shim calls NVML
 * directly and sees what the driver shows (docs/architecture.md, the shim's model).
 *
 * BAR1 (the aperture the host maps device memory through): total is clamped to
 * the container's limit (it can map no more of its own memory than that); free
 * is at most the driver's free BAR1, so a neighbour's use shows only where it
 * cuts into what this container could map. */

#define PROC_NS_INIT_INO "4026531836" /* the initial pid namespace's inode (PROC_PID_INIT_INO) */

static int mg_nvml_pids_local(void) {
    const char *e = getenv("MEMGUARD_NVML_PIDS");
    if (e && strcmp(e, "local") == 0) return 1;
    if (e && (strcmp(e, "none") == 0 || strcmp(e, "host") == 0)) return 0;
    char buf[64];
    ssize_t n = readlink("/proc/self/ns/pid", buf, sizeof buf - 1);
    if (n <= 0) return 0;
    buf[n] = 0;
    return strcmp(buf, "pid:[" PROC_NS_INIT_INO "]") == 0;
}

/* May this process see NVML's entry for `pid`? A slot left by a dead process
 * whose pid another (a neighbour's) now has does not count: the start time
 * recorded in the slot must be that pid's. */
static int mg_nvml_ours(unsigned int pid) {
    if (!g_usage || !g_nvml_pids_local || pid == 0 || pid > INT32_MAX) return 0;
    for (int i = 0; i < MG_MAX_PROCS; i++) {
        const mg_proc_slot_t *s = &g_usage->slots[i];
        if (atomic_load_explicit(&s->pid, memory_order_acquire) != (int32_t)pid) continue;
        uint64_t recorded = __atomic_load_n(&s->start_time, __ATOMIC_ACQUIRE);
        uint64_t now = recorded ? mg_proc_start((int32_t)pid, NULL) : 0;
        if (!recorded || now == recorded) return 1; /* 0: being claimed right now, by the pid itself */
    }
    return 0;
}

/* Filter NVML's answers? Not for a process the shim does not manage (no
 * config: not a gpufrac container); always once it has a usage file. */
static int mg_nvml_filtering(void) {
    int m = mg_mode();
    if (m == MODE_OFF) return 0;
    if (m != MODE_BROKEN && !g_nvml_pids_local)
        MG_WARN_ONCE(g_warned_nvml_ns, "NVML reports host pids, which this pid namespace cannot match to the "
                                       "container's processes: NVML process lists show none");
    return 1;
}

/* One NVML list call into `buf` holding `*n` records (buf NULL: a size query). */
typedef nvmlReturn_t (*mg_nvml_fill_fn)(const void *ctx, void *buf, unsigned int *n);

/* Answer a per-process NVML list with the container's entries only, under
 * NVML's buffer rules: *count too small for them (or no array while there are
 * some) -> NVML_ERROR_INSUFFICIENT_SIZE and the count needed; else copied.
 * The driver's whole list is read into a buffer of our own first, so neither
 * the count nor the entries of other containers reach the caller. `none_rc` is
 * what the call answers when nothing is left (lists: SUCCESS, samples: NOT_FOUND). */
static MG_COLD nvmlReturn_t mg_nvml_filter(mg_nvml_fill_fn fill, const void *ctx, unsigned int *count, void *out,
                                           size_t esz, size_t pid_off, nvmlReturn_t none_rc) {
    unsigned int cap = 0, n = 0;
    char *buf = NULL;
    nvmlReturn_t rc = NVML_ERROR_INSUFFICIENT_SIZE;
    for (int tries = 0; tries < 8 && rc == NVML_ERROR_INSUFFICIENT_SIZE; tries++) {
        n = cap;
        rc = fill(ctx, buf, &n);
        if (rc != NVML_ERROR_INSUFFICIENT_SIZE) break;
        cap = n + n / 2 + 8; /* room for processes that start meanwhile */
        free(buf);
        buf = calloc(cap, esz);
        if (!buf) return NVML_ERROR_MEMORY;
    }
    if (rc == NVML_ERROR_INSUFFICIENT_SIZE) rc = NVML_ERROR_UNKNOWN; /* the list kept growing */
    if (rc != NVML_SUCCESS && rc != none_rc) {
        free(buf);
        return rc;
    }
    if (rc != NVML_SUCCESS || !buf) n = 0; /* nothing at all */
    unsigned int kept = 0;
    for (unsigned int i = 0; i < n && buf; i++) {
        unsigned int pid;
        memcpy(&pid, buf + (size_t)i * esz + pid_off, sizeof pid);
        if (!mg_nvml_ours(pid)) continue;
        if (kept != i) memmove(buf + (size_t)kept * esz, buf + (size_t)i * esz, esz);
        kept++;
    }
    if (kept == 0) {
        rc = none_rc;
        if (rc == NVML_SUCCESS) *count = 0;
    } else if (*count < kept || !out) {
        *count = kept;
        rc = NVML_ERROR_INSUFFICIENT_SIZE;
    } else {
        memcpy(out, buf, (size_t)kept * esz);
        *count = kept;
        rc = NVML_SUCCESS;
    }
    free(buf);
    return rc;
}

typedef nvmlReturn_t (*mg_nvml_list_fn)(nvmlDevice_t, unsigned int *, void *);
typedef struct {
    mg_nvml_list_fn f;
    nvmlDevice_t dev;
} mg_list_ctx_t;

static nvmlReturn_t mg_fill_list(const void *ctx, void *buf, unsigned int *n) {
    const mg_list_ctx_t *c = ctx;
    return c->f(c->dev, n, buf);
}

/* The running-process lists: (device, count, array), one record type per version. */
#define NVML_LIST_HOOK(sym, info_t)                                                                            \
    HOOK nvmlReturn_t mg_h_##sym(nvmlDevice_t device, unsigned int *infoCount, info_t *infos) {               \
        if (!infoCount || !mg_nvml_filtering()) return CALL_REAL(sym, device, infoCount, infos);              \
        mg_list_ctx_t c = {(mg_nvml_list_fn)REAL(sym), device};                                                \
        if (!c.f) return NVML_ERROR_FUNCTION_NOT_FOUND;                                                        \
        return mg_nvml_filter(mg_fill_list, &c, infoCount, infos, sizeof(info_t), offsetof(info_t, pid),      \
                              NVML_SUCCESS);                                                                   \
    }

NVML_LIST_HOOK(nvmlDeviceGetComputeRunningProcesses, nvmlProcessInfo_v1_t)
NVML_LIST_HOOK(nvmlDeviceGetComputeRunningProcesses_v2, nvmlProcessInfo_t)
NVML_LIST_HOOK(nvmlDeviceGetComputeRunningProcesses_v3, nvmlProcessInfo_t)
NVML_LIST_HOOK(nvmlDeviceGetGraphicsRunningProcesses, nvmlProcessInfo_v1_t)
NVML_LIST_HOOK(nvmlDeviceGetGraphicsRunningProcesses_v2, nvmlProcessInfo_t)
NVML_LIST_HOOK(nvmlDeviceGetGraphicsRunningProcesses_v3, nvmlProcessInfo_t)
NVML_LIST_HOOK(nvmlDeviceGetMPSComputeRunningProcesses, nvmlProcessInfo_v1_t)
NVML_LIST_HOOK(nvmlDeviceGetMPSComputeRunningProcesses_v2, nvmlProcessInfo_t)
NVML_LIST_HOOK(nvmlDeviceGetMPSComputeRunningProcesses_v3, nvmlProcessInfo_t)

typedef struct {
    nvmlReturn_t (*f)(nvmlDevice_t, nvmlProcessDetailList_t *);
    nvmlDevice_t dev;
    const nvmlProcessDetailList_t *in;
} mg_detail_ctx_t;

static nvmlReturn_t mg_fill_detail(const void *ctx, void *buf, unsigned int *n) {
    const mg_detail_ctx_t *c = ctx;
    nvmlProcessDetailList_t l = *c->in;
    l.numProcArrayEntries = *n;
    l.procArray = buf;
    nvmlReturn_t rc = c->f(c->dev, &l);
    *n = l.numProcArrayEntries;
    return rc;
}

HOOK nvmlReturn_t mg_h_nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t device, nvmlProcessDetailList_t *plist) {
    if (!plist || !mg_nvml_filtering()) return CALL_REAL(nvmlDeviceGetRunningProcessDetailList, device, plist);
    mg_detail_ctx_t c = {REAL(nvmlDeviceGetRunningProcessDetailList), device, plist};
    if (!c.f) return NVML_ERROR_FUNCTION_NOT_FOUND;
    return mg_nvml_filter(mg_fill_detail, &c, &plist->numProcArrayEntries, plist->procArray,
                          sizeof(nvmlProcessDetail_v1_t), offsetof(nvmlProcessDetail_v1_t, pid), NVML_SUCCESS);
}

typedef struct {
    nvmlReturn_t (*f)(nvmlDevice_t, nvmlProcessUtilizationSample_t *, unsigned int *, unsigned long long);
    nvmlDevice_t dev;
    unsigned long long last_seen;
} mg_usample_ctx_t;

static nvmlReturn_t mg_fill_usample(const void *ctx, void *buf, unsigned int *n) {
    const mg_usample_ctx_t *c = ctx;
    return c->f(c->dev, buf, n, c->last_seen);
}

/* Per-process utilisation: "no sample" is NVML_ERROR_NOT_FOUND. */
HOOK nvmlReturn_t mg_h_nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                                       unsigned int *processSamplesCount,
                                                       unsigned long long lastSeenTimeStamp) {
    if (!processSamplesCount || !mg_nvml_filtering())
        return CALL_REAL(nvmlDeviceGetProcessUtilization, device, utilization, processSamplesCount,
                         lastSeenTimeStamp);
    mg_usample_ctx_t c = {REAL(nvmlDeviceGetProcessUtilization), device, lastSeenTimeStamp};
    if (!c.f) return NVML_ERROR_FUNCTION_NOT_FOUND;
    return mg_nvml_filter(mg_fill_usample, &c, processSamplesCount, utilization,
                          sizeof(nvmlProcessUtilizationSample_t), offsetof(nvmlProcessUtilizationSample_t, pid),
                          NVML_ERROR_NOT_FOUND);
}

typedef struct {
    nvmlReturn_t (*f)(nvmlDevice_t, nvmlProcessesUtilizationInfo_t *);
    nvmlDevice_t dev;
    const nvmlProcessesUtilizationInfo_t *in;
} mg_uinfo_ctx_t;

static nvmlReturn_t mg_fill_uinfo(const void *ctx, void *buf, unsigned int *n) {
    const mg_uinfo_ctx_t *c = ctx;
    nvmlProcessesUtilizationInfo_t u = *c->in;
    u.processSamplesCount = *n;
    u.procUtilArray = buf;
    nvmlReturn_t rc = c->f(c->dev, &u);
    *n = u.processSamplesCount;
    return rc;
}

HOOK nvmlReturn_t mg_h_nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t device,
                                                             nvmlProcessesUtilizationInfo_t *procesesUtilInfo) {
    nvmlProcessesUtilizationInfo_t *p = procesesUtilInfo;
    if (!p || !mg_nvml_filtering()) return CALL_REAL(nvmlDeviceGetProcessesUtilizationInfo, device, p);
    mg_uinfo_ctx_t c = {REAL(nvmlDeviceGetProcessesUtilizationInfo), device, p};
    if (!c.f) return NVML_ERROR_FUNCTION_NOT_FOUND;
    return mg_nvml_filter(mg_fill_uinfo, &c, &p->processSamplesCount, p->procUtilArray,
                          sizeof(nvmlProcessUtilizationInfo_v1_t), offsetof(nvmlProcessUtilizationInfo_v1_t, pid),
                          NVML_ERROR_NOT_FOUND);
}

HOOK nvmlReturn_t mg_h_nvmlDeviceGetBAR1MemoryInfo(nvmlDevice_t device, nvmlBAR1Memory_t *bar1Memory) {
    nvmlReturn_t rc = CALL_REAL(nvmlDeviceGetBAR1MemoryInfo, device, bar1Memory);
    if (rc != NVML_SUCCESS || !bar1Memory) return rc;
    int m = mg_mode();
    mg_limits_t l;
    if (m == MODE_OFF) return rc;
    int known = m == MODE_ON && mg_read_limits(&l) == 0;
    if (known && (l.flags & MG_FLAG_WHOLE_GPU)) return rc;
    uint64_t total = bar1Memory->bar1Total;
    if (known && l.limit < total) total = l.limit;
    uint64_t free_ = bar1Memory->bar1Free < total ? bar1Memory->bar1Free : total;
    if (!known || (l.flags & MG_FLAG_DISABLED)) free_ = 0;
    bar1Memory->bar1Total = total;
    bar1Memory->bar1Free = free_;
    bar1Memory->bar1Used = total - free_;
    return rc;
}

/* --- launches: activity for the idle detector, and the swap-in gate --- */

static inline void mg_activity(void) {
    if (!mg_on()) return;
    mg_proc_slot_t *s = mg_slot();
    if (MG_UNLIKELY(!s)) return;
    /* Only this process's threads write its slot; a lost increment between
     * two of its threads is harmless, a locked add on every launch is not. */
    atomic_store_explicit(&s->launches, atomic_load_explicit(&s->launches, memory_order_relaxed) + 1,
                          memory_order_relaxed);
    atomic_store_explicit(&s->last_activity_ns, mg_coarse_now_ns(), memory_order_relaxed);
    if (MG_UNLIKELY(atomic_load_explicit(&s->swapped, memory_order_acquire))) mg_swap_in(s);
}

#define LAUNCH_PARAMS                                                                                     \
    (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ, unsigned int blockDimX, \
     unsigned int blockDimY, unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,          \
     void **kernelParams, void **extra)
#define LAUNCH_ARGS \
    f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams, extra
#define COOP_PARAMS                                                                                       \
    (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ, unsigned int blockDimX, \
     unsigned int blockDimY, unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,          \
     void **kernelParams)
#define COOP_ARGS f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams

#define LAUNCH_HOOK(sym, params, ...)             \
    HOOK CUresult mg_h_##sym params {              \
        mg_activity();                             \
        return CALL_REAL(sym, __VA_ARGS__);        \
    }

LAUNCH_HOOK(cuLaunchKernel, LAUNCH_PARAMS, LAUNCH_ARGS)
LAUNCH_HOOK(cuLaunchKernel_ptsz, LAUNCH_PARAMS, LAUNCH_ARGS)
LAUNCH_HOOK(cuLaunchCooperativeKernel, COOP_PARAMS, COOP_ARGS)
LAUNCH_HOOK(cuLaunchCooperativeKernel_ptsz, COOP_PARAMS, COOP_ARGS)
LAUNCH_HOOK(cuLaunchKernelEx, (const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra),
            config, f, kernelParams, extra)
LAUNCH_HOOK(cuLaunchKernelEx_ptsz, (const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra),
            config, f, kernelParams, extra)
/* A graph launch: while some executable graph's memory is not counted yet, the
 * launch goes through mg_graph_launch (limit check first); else one atomic load. */
#define GRAPH_LAUNCH_HOOK(sym)                                                                    \
    HOOK CUresult mg_h_##sym(CUgraphExec hGraphExec, CUstream hStream) {                          \
        mg_activity();                                                                            \
        if (MG_UNLIKELY(atomic_load_explicit(&mg_graph_unmapped, memory_order_relaxed)) && mg_on()) \
            return mg_graph_launch(mg_real(S_##sym), hGraphExec, hStream);                        \
        return CALL_REAL(sym, hGraphExec, hStream);                                               \
    }
GRAPH_LAUNCH_HOOK(cuGraphLaunch)
GRAPH_LAUNCH_HOOK(cuGraphLaunch_ptsz)

/* --- symbol lookup --- */

static int mg_find(const char *name) {
    /* Not the fast path: runs once per function a program looks up. */
    for (int i = 0; i < S_COUNT; i++)
        if (strcmp(g_syms[i].name, name) == 0) return i;
    return -1;
}

/* The hook to hand out instead of `p`, the driver's answer for cuGetProcAddress(symbol, version, flags). */
static void *mg_proc_hook(const char *symbol, void *p, int version, cuuint64_t flags) {
    int want_ptds = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    int best = -1, best_any = -1;
    for (int i = 0; i < S_COUNT; i++) {
        const mg_sym_t *e = &g_syms[i];
        if (e->lib != LIB_CUDA) continue;
        /* Asked by a variant's own name (cuGraphInstantiateWithFlags): the driver's export. */
        if (strcmp(e->base, symbol) != 0) {
            if (strcmp(e->name, symbol) == 0 && mg_real(i) == p) return e->hook;
            continue;
        }
        if (p == e->hook) return p;
        if (mg_real(i) == p) return e->hook; /* the driver's own choice, matched by address */
        if (e->version > version) continue;
        if (e->ptds == want_ptds && (best < 0 || e->version > g_syms[best].version)) best = i;
        if (!e->ptds && (best_any < 0 || e->version > g_syms[best_any].version)) best_any = i;
    }
    if (best < 0) best = best_any; /* no per-thread variant of this function */
    if (best < 0) return p;        /* older than anything hooked: the driver's legacy answer */
    /* The driver answered with an address no export has (an internal entry):
     * use it as the real function of the variant the table names. */
    void *expected = NULL;
    atomic_compare_exchange_strong(&g_real[best], &expected, p);
    return g_syms[best].hook;
}

HOOK CUresult mg_h_cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                       CUdriverProcAddressQueryResult *symbolStatus) {
    CUresult rc = CALL_REAL(cuGetProcAddress_v2, symbol, pfn, cudaVersion, flags, symbolStatus);
    if (rc == CUDA_SUCCESS && symbol && pfn && *pfn) *pfn = mg_proc_hook(symbol, *pfn, cudaVersion, flags);
    return rc;
}

HOOK CUresult mg_h_cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    CUresult rc = CALL_REAL(cuGetProcAddress, symbol, pfn, cudaVersion, flags);
    if (rc == CUDA_SUCCESS && symbol && pfn && *pfn) *pfn = mg_proc_hook(symbol, *pfn, cudaVersion, flags);
    return rc;
}

static MG_COLD void *mg_dlsym_hooked(void *handle, const char *name) {
    dlsym_fn real = mg_real_dlsym();
    void *p = real ? real(handle, name) : NULL;
    if (!p) return p;
    int i = mg_find(name);
    if (i < 0 || p == g_syms[i].hook) return p;
    /* Hand out the hook only for the driver library's own function. */
    return mg_real(i) == p ? g_syms[i].hook : p;
}

/* dlsym itself: the way ctypes, pynvml and cudart's bootstrap find driver
 * functions, which LD_PRELOAD alone does not reach (a handle-scoped lookup
 * never sees the preloaded library). */
MG_EXPORT MG_NOSAN MG_SIBCALL void *dlsym(void *handle, const char *name) {
    if (handle != RTLD_NEXT &&
        ((name[0] == 'c' && name[1] == 'u') || (name[0] == 'n' && name[1] == 'v' && name[2] == 'm')))
        return mg_dlsym_hooked(handle, name);
    /* A sibling call, so glibc still sees the caller's return address and
     * RTLD_NEXT means "after the caller", not "after memguard". */
    MG_TAIL return mg_real_dlsym()(handle, name);
}

/* ------------------------------------------------------------------------ */
/* The table and the exports.                                                */

static const mg_sym_t g_syms[S_COUNT] = {
#define MG_ROW(sym, base, ver, lib, ptds) [S_##sym] = {#sym, base, ver, lib, ptds, (void *)mg_h_##sym},
    MG_SYMBOLS_EXTRA(MG_ROW)
    MG_SYMBOLS(MG_ROW)
#undef MG_ROW
};

/* Export each hook under the driver's name. The table holds the local
 * address, so another library interposing the same name cannot redirect it. */
#define MG_ALIAS(sym, base, ver, lib, ptds) \
    extern __typeof__(mg_h_##sym) sym __attribute__((alias("mg_h_" #sym), visibility("default")));
MG_SYMBOLS(MG_ALIAS)
#undef MG_ALIAS
