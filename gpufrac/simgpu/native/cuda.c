/*
 * simgpu fake libcuda.so.1 — core: init, versions, error names, devices,
 * contexts, the live-object set and this area's cuGetProcAddress section.
 *
 * Loaded by cuda-python (dlopen "libcuda.so.1" through LD_LIBRARY_PATH), by the
 * CUDA runtime, by ctypes and by C programs linked against it. Every exported
 * function has the real driver signature and error codes. The other areas live
 * in the other cuda_*.c files; each adds its section to the one symbol table
 * that drives cuGetProcAddress (cuda_procaddr.c).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"

#define DEFAULT_DRIVER_VERSION 12080 /* cuDriverGetVersion when no node state is mapped */

simgpu_node_t *_Atomic cu_g_node;
int cu_g_ndev;
uint32_t cu_g_devs[SIMGPU_MAX_GPUS];
static pthread_mutex_t g_init_lock = PTHREAD_MUTEX_INITIALIZER;

/* ------------------------------------------------------------------ errors */

static const struct {
    int code;
    const char *name, *text;
} k_errors[] = {
    {0, "CUDA_SUCCESS", "no error"},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {4, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {5, "CUDA_ERROR_PROFILER_DISABLED", "profiler disabled while using external profiling tool"},
    {34, "CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"},
    {36, "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER", "the provided PTX requires a newer driver"},
    {46, "CUDA_ERROR_DEVICE_UNAVAILABLE", "CUDA-capable device(s) is/are busy or unavailable"},
    {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {102, "CUDA_ERROR_DEVICE_NOT_LICENSED", "device doesn't have valid Grid license"},
    {200, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {202, "CUDA_ERROR_CONTEXT_ALREADY_CURRENT", "context already current"},
    {205, "CUDA_ERROR_MAP_FAILED", "mapping of buffer object failed"},
    {206, "CUDA_ERROR_UNMAP_FAILED", "unmapping of buffer object failed"},
    {207, "CUDA_ERROR_ARRAY_IS_MAPPED", "array is mapped"},
    {208, "CUDA_ERROR_ALREADY_MAPPED", "resource already mapped"},
    {209, "CUDA_ERROR_NO_BINARY_FOR_GPU", "no kernel image is available for execution on the device"},
    {210, "CUDA_ERROR_ALREADY_ACQUIRED", "resource already acquired"},
    {211, "CUDA_ERROR_NOT_MAPPED", "resource not mapped"},
    {212, "CUDA_ERROR_NOT_MAPPED_AS_ARRAY", "resource not mapped as array"},
    {213, "CUDA_ERROR_NOT_MAPPED_AS_POINTER", "resource not mapped as pointer"},
    {214, "CUDA_ERROR_ECC_UNCORRECTABLE", "uncorrectable ECC error encountered"},
    {215, "CUDA_ERROR_UNSUPPORTED_LIMIT", "limit is not supported on this architecture"},
    {216, "CUDA_ERROR_CONTEXT_ALREADY_IN_USE", "exclusive-thread device already in use by a different thread"},
    {217, "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED", "peer access is not supported between these two devices"},
    {218, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
    {300, "CUDA_ERROR_INVALID_SOURCE", "device kernel image is invalid"},
    {301, "CUDA_ERROR_FILE_NOT_FOUND", "file not found"},
    {304, "CUDA_ERROR_OPERATING_SYSTEM", "OS call failed or operation not supported on this OS"},
    {400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {401, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
    {500, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {600, "CUDA_ERROR_NOT_READY", "device not ready"},
    {700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources requested for launch"},
    {702, "CUDA_ERROR_LAUNCH_TIMEOUT", "the launch timed out and was terminated"},
    {704, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED", "peer access is already enabled"},
    {705, "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED", "peer access has not been enabled"},
    {708, "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE", "cannot set while device is active in this process"},
    {709, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
    {710, "CUDA_ERROR_ASSERT", "device-side assert triggered"},
    {712, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED", "part or all of the requested memory range is already mapped"},
    {713, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", "pointer does not correspond to a registered memory region"},
    {719, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {720, "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE", "too many blocks in cooperative launch"},
    {800, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {802, "CUDA_ERROR_SYSTEM_NOT_READY", "system not yet initialized"},
    {803, "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", "system has unsupported display driver / cuda driver combination"},
    {900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "operation not permitted when stream is capturing"},
    {901, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "operation failed due to a previous error during capture"},
    {902, "CUDA_ERROR_STREAM_CAPTURE_MERGE", "operation would result in a merge of separate capture sequences"},
    {903, "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED", "capture was not ended in the same stream as it began"},
    {904, "CUDA_ERROR_STREAM_CAPTURE_UNJOINED", "capturing stream has unjoined work"},
    {905, "CUDA_ERROR_STREAM_CAPTURE_ISOLATION", "dependency created on uncaptured work in another stream"},
    {906, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT", "operation would make the legacy stream depend on a capturing blocking stream"},
    {907, "CUDA_ERROR_CAPTURED_EVENT", "operation not permitted on an event last recorded in a capturing stream"},
    {908, "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD", "attempt to terminate a thread-local capture sequence from another thread"},
    {909, "CUDA_ERROR_TIMEOUT", "wait operation timed out"},
    {910, "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE", "the graph update was not performed because it included changes which violated constraints specific to instantiated graph update"},
    {999, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static CUresult error_field(CUresult error, const char **pStr, int text) {
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof k_errors / sizeof k_errors[0]; i++)
        if (k_errors[i].code == (int)error) {
            *pStr = text ? k_errors[i].text : k_errors[i].name;
            return CUDA_SUCCESS;
        }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CU_API CUresult cuGetErrorName(CUresult error, const char **pStr) { return error_field(error, pStr, 0); }
CU_API CUresult cuGetErrorString(CUresult error, const char **pStr) { return error_field(error, pStr, 1); }

/* ------------------------------------------------------------------ live-object set */

/* Open addressing over object pointers; TOMB marks a deleted entry. */
#define TOMB ((void *)1)
static pthread_mutex_t g_obj_lock = PTHREAD_MUTEX_INITIALIZER;
static void **g_set;
static size_t g_cap, g_fill;

static size_t ptr_hash(const void *p) {
    uint64_t x = (uint64_t)(uintptr_t)p;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return (size_t)x;
}

static void **set_find(const void *p) {
    if (!g_cap || !p || p == TOMB) return NULL;
    for (size_t i = ptr_hash(p) & (g_cap - 1), n = 0; n < g_cap; i = (i + 1) & (g_cap - 1), n++) {
        if (g_set[i] == p) return &g_set[i];
        if (!g_set[i]) return NULL;
    }
    return NULL;
}

static void set_put(void **set, size_t cap, void *p) {
    size_t i = ptr_hash(p) & (cap - 1);
    while (set[i] && set[i] != TOMB) i = (i + 1) & (cap - 1);
    set[i] = p;
}

void cu_obj_add(void *obj, uint32_t kind, struct CUctx_st *ctx) {
    cu_obj_t *h = obj;
    h->kind = kind;
    h->ctx = ctx;
    pthread_mutex_lock(&g_obj_lock);
    if ((g_fill + 1) * 2 > g_cap) { /* grow (or just sweep tombstones) */
        size_t cap = g_cap ? g_cap * 2 : 256;
        void **set = calloc(cap, sizeof *set);
        if (!set) abort(); /* out of host memory for a handle table: nothing sane to return */
        size_t live = 0;
        for (size_t i = 0; i < g_cap; i++)
            if (g_set[i] && g_set[i] != TOMB) set_put(set, cap, g_set[i]), live++;
        free(g_set);
        g_set = set, g_cap = cap, g_fill = live;
    }
    size_t i = ptr_hash(obj) & (g_cap - 1);
    while (g_set[i] && g_set[i] != TOMB) i = (i + 1) & (g_cap - 1);
    if (!g_set[i]) g_fill++;
    g_set[i] = obj;
    pthread_mutex_unlock(&g_obj_lock);
}

int cu_obj_del(void *obj, uint32_t kind) {
    pthread_mutex_lock(&g_obj_lock);
    void **e = set_find(obj);
    int ok = e && ((cu_obj_t *)obj)->kind == kind;
    if (ok) *e = TOMB;
    pthread_mutex_unlock(&g_obj_lock);
    return ok;
}

int cu_obj_ok(const void *obj, uint32_t kind) {
    pthread_mutex_lock(&g_obj_lock);
    int ok = set_find(obj) && ((const cu_obj_t *)obj)->kind == kind;
    pthread_mutex_unlock(&g_obj_lock);
    return ok;
}

size_t cu_obj_owned(uint32_t kind, struct CUctx_st *ctx, void **out, size_t max) {
    size_t n = 0;
    pthread_mutex_lock(&g_obj_lock);
    for (size_t i = 0; i < g_cap && n < max; i++) {
        cu_obj_t *h = g_set[i];
        if (h && (void *)h != TOMB && h->kind == kind && h->ctx == ctx) out[n++] = h;
    }
    pthread_mutex_unlock(&g_obj_lock);
    return n;
}

/* ------------------------------------------------------------------ init and devices */

/* Maps $SIMGPU_STATE and fixes the device list. A later cuInit that finds
 * $SIMGPU_STATE naming another node switches to it (one test process may use
 * several simulated nodes in turn, like nvmlInit); memory held on the previous
 * node stays accounted there only if freed before the switch. */
CU_API CUresult cuInit(unsigned int Flags) {
    if (Flags != 0) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&g_init_lock);
    simgpu_node_t *n = sim_node_reload();
    if (n && n != cu_node()) {
        uint32_t devs[SIMGPU_MAX_GPUS];
        int count = sim_visible_gpus(n, 1, devs);
        if (count > 0) {
            memcpy(cu_g_devs, devs, sizeof devs);
            cu_g_ndev = count;
            atomic_store(&cu_g_gate_slot, NULL); /* the gate slot lives in the old node */
            atomic_store_explicit(&cu_g_node, n, memory_order_release);
        }
    }
    if (!cu_initialized()) r = CUDA_ERROR_NO_DEVICE;
    pthread_mutex_unlock(&g_init_lock);
    return r;
}

CU_API CUresult cuDriverGetVersion(int *driverVersion) {
    if (!driverVersion) return CUDA_ERROR_INVALID_VALUE;
    simgpu_node_t *n = cu_node();
    if (!n && getenv("SIMGPU_STATE")) n = sim_node();
    *driverVersion = n && n->cuda_driver_version ? (int)n->cuda_driver_version : DEFAULT_DRIVER_VERSION;
    return CUDA_SUCCESS;
}

CUresult cu_check_dev(CUdevice dev) {
    if (!cu_initialized()) return CUDA_ERROR_NOT_INITIALIZED;
    return dev >= 0 && dev < cu_g_ndev ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

static simgpu_gpu_t *dev_gpu(CUdevice dev) { return &cu_node()->gpus[cu_g_devs[dev]]; }

CU_API CUresult cuDeviceGetCount(int *count) {
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    if (!cu_initialized()) return CUDA_ERROR_NOT_INITIALIZED;
    *count = cu_g_ndev;
    return CUDA_SUCCESS;
}

CU_API CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    if (!cu_initialized()) return CUDA_ERROR_NOT_INITIALIZED;
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= cu_g_ndev) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

CU_API CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    CUresult r = cu_check_dev(dev);
    if (r) return r;
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "%s", dev_gpu(dev)->name);
    return CUDA_SUCCESS;
}

/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" -> 16 bytes. */
static void uuid_bytes(const char *s, unsigned char out[16]) {
    memset(out, 0, 16);
    if (strncmp(s, "GPU-", 4) == 0) s += 4;
    for (int i = 0; i < 16 && *s;) {
        unsigned int b;
        if (*s == '-') {
            s++;
            continue;
        }
        if (sscanf(s, "%2x", &b) != 1) break;
        out[i++] = (unsigned char)b;
        s += 2;
    }
}

CU_API CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) {
    CUresult r = cu_check_dev(dev);
    if (r) return r;
    if (!uuid) return CUDA_ERROR_INVALID_VALUE;
    uuid_bytes(dev_gpu(dev)->uuid, (unsigned char *)uuid->bytes);
    return CUDA_SUCCESS;
}

CU_API CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) { return cuDeviceGetUuid_v2(uuid, dev); }

CU_API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    CUresult r = cu_check_dev(dev);
    if (r) return r;
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    *bytes = dev_gpu(dev)->total_bytes;
    return CUDA_SUCCESS;
}

/* The 32-bit legacy entry point (CUDA < 3.2 ABI): clamps, as it cannot say more. */
CU_API CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev) {
    size_t b = 0;
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = cuDeviceTotalMem_v2(&b, dev);
    if (!r) *bytes = b > 0xffffffffu ? 0xffffffffu : (unsigned int)b;
    return r;
}

/* Device attributes a workload or framework commonly asks for; others read 0. */
static int attribute(const simgpu_gpu_t *g, int a) {
    int hopper = g->cc_major >= 9, ampere100 = g->cc_major == 8 && g->cc_minor == 0;
    switch (a) {
    case 1: return 1024;                                   /* MAX_THREADS_PER_BLOCK */
    case 2: case 3: return 1024;                           /* MAX_BLOCK_DIM_X/Y */
    case 4: return 64;                                     /* MAX_BLOCK_DIM_Z */
    case 5: return 2147483647;                             /* MAX_GRID_DIM_X */
    case 6: case 7: return 65535;                          /* MAX_GRID_DIM_Y/Z */
    case 8: return 49152;                                  /* MAX_SHARED_MEMORY_PER_BLOCK */
    case 9: return 65536;                                  /* TOTAL_CONSTANT_MEMORY */
    case 10: return 32;                                    /* WARP_SIZE */
    case 11: return 2147483647;                            /* MAX_PITCH */
    case 12: case 82: return 65536;                        /* registers per block / per SM */
    case 13: return hopper ? 1980000 : 1410000;            /* CLOCK_RATE (kHz) */
    case 14: return 512;                                   /* TEXTURE_ALIGNMENT */
    case 15: case 19: case 31: case 41: case 78: return 1; /* overlap, map host, concurrent, UVA, prio */
    case 16: return (int)g->sm_count;                      /* MULTIPROCESSOR_COUNT */
    case 30: return 512;                                   /* SURFACE_ALIGNMENT */
    case 32: return hopper || ampere100;                   /* ECC_ENABLED */
    case 33: return (int)g->pci_bus;                       /* PCI_BUS_ID */
    case 34: return (int)g->pci_device;                    /* PCI_DEVICE_ID */
    case 36: return hopper ? 2619000 : 1593000;            /* MEMORY_CLOCK_RATE (kHz) */
    case 37: return hopper || ampere100 ? 5120 : 192;      /* GLOBAL_MEMORY_BUS_WIDTH */
    case 38: return hopper ? 52428800 : ampere100 ? 41943040 : 50331648; /* L2_CACHE_SIZE */
    case 39: return g->cc_major == 8 && g->cc_minor != 0 ? 1536 : 2048;   /* threads per SM */
    case 40: return hopper ? 3 : 2;                        /* ASYNC_ENGINE_COUNT */
    case 50: return (int)g->pci_domain;                    /* PCI_DOMAIN_ID */
    case 51: return 32;                                    /* TEXTURE_PITCH_ALIGNMENT */
    case 75: return (int)g->cc_major;
    case 76: return (int)g->cc_minor;
    case 79: case 80: case 83: case 89: case 90: case 95: case 96: return 1;
    case 81: return hopper ? 233472 : ampere100 ? 167936 : 102400; /* shared per SM */
    case 97: return hopper ? 232448 : ampere100 ? 166912 : 101376; /* shared per block opt-in */
    case 102: case 103: case 115: return 1;                /* VMM, POSIX fd handles, memory pools */
    case 106: return hopper ? 32 : 16;                     /* MAX_BLOCKS_PER_MULTIPROCESSOR */
    case 119: return 1;                                    /* MEMPOOL_SUPPORTED_HANDLE_TYPES: POSIX fd */
    case 120: return hopper;                               /* CLUSTER_LAUNCH */
    default: return 0;
    }
}

CU_API CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev) {
    CUresult r = cu_check_dev(dev);
    if (r) return r;
    if (!pi || attrib <= 0 || attrib > 160) return CUDA_ERROR_INVALID_VALUE;
    *pi = attribute(dev_gpu(dev), attrib);
    return CUDA_SUCCESS;
}

CU_API CUresult cuDeviceComputeCapability(int *major, int *minor, CUdevice dev) {
    CUresult r = cu_check_dev(dev);
    if (r) return r;
    if (!major || !minor) return CUDA_ERROR_INVALID_VALUE;
    *major = (int)dev_gpu(dev)->cc_major;
    *minor = (int)dev_gpu(dev)->cc_minor;
    return CUDA_SUCCESS;
}

CU_API CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev) {
    CUresult r = cu_check_dev(dev);
    if (r) return r;
    if (!pciBusId || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    const simgpu_gpu_t *g = dev_gpu(dev);
    snprintf(pciBusId, (size_t)len, "%04x:%02x:%02x.0", g->pci_domain, g->pci_bus, g->pci_device);
    return CUDA_SUCCESS;
}

/* Accepts domain:bus:device.function, domain:bus:device and bus:device.function (hex). */
CU_API CUresult cuDeviceGetByPCIBusId(CUdevice *dev, const char *pciBusId) {
    if (!cu_initialized()) return CUDA_ERROR_NOT_INITIALIZED;
    if (!dev || !pciBusId) return CUDA_ERROR_INVALID_VALUE;
    unsigned int dom = 0, bus = 0, d = 0, fn = 0;
    char tail;
    if (sscanf(pciBusId, "%x:%x:%x.%x%c", &dom, &bus, &d, &fn, &tail) != 4 &&
        sscanf(pciBusId, "%x:%x:%x%c", &dom, &bus, &d, &tail) != 3) {
        dom = 0;
        if (sscanf(pciBusId, "%x:%x.%x%c", &bus, &d, &fn, &tail) != 3) return CUDA_ERROR_INVALID_VALUE;
    }
    for (int i = 0; i < cu_g_ndev; i++) {
        const simgpu_gpu_t *g = dev_gpu(i);
        if (g->pci_domain == dom && g->pci_bus == bus && g->pci_device == d && fn == 0) {
            *dev = i;
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_INVALID_DEVICE;
}

/* ------------------------------------------------------------------ symbols */

CU_API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                    int *symbolStatus);
CU_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);

const cu_sym_t cu_syms_core[] = {
    CU_SYM("cuGetErrorString", 6000, cuGetErrorString),
    CU_SYM("cuGetErrorName", 6000, cuGetErrorName),
    CU_SYM("cuInit", 2000, cuInit),
    CU_SYM("cuDriverGetVersion", 2020, cuDriverGetVersion),
    CU_SYM("cuDeviceGet", 2000, cuDeviceGet),
    CU_SYM("cuDeviceGetCount", 2000, cuDeviceGetCount),
    CU_SYM("cuDeviceGetName", 2000, cuDeviceGetName),
    CU_SYM("cuDeviceGetUuid", 9020, cuDeviceGetUuid),
    CU_SYM("cuDeviceGetUuid", 11040, cuDeviceGetUuid_v2),
    CU_SYM("cuDeviceTotalMem", 2000, cuDeviceTotalMem),
    CU_SYM("cuDeviceTotalMem", 3020, cuDeviceTotalMem_v2),
    CU_SYM("cuDeviceGetAttribute", 2000, cuDeviceGetAttribute),
    CU_SYM("cuDeviceComputeCapability", 2000, cuDeviceComputeCapability),
    CU_SYM("cuDeviceGetPCIBusId", 4010, cuDeviceGetPCIBusId),
    CU_SYM("cuDeviceGetByPCIBusId", 4010, cuDeviceGetByPCIBusId),
    CU_SYM("cuGetProcAddress", 11030, cuGetProcAddress),
    CU_SYM("cuGetProcAddress", 12000, cuGetProcAddress_v2),
};
const size_t cu_syms_core_n = sizeof cu_syms_core / sizeof cu_syms_core[0];
