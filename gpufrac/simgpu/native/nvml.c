/*
 * simgpu fake libnvidia-ml.so.1: NVML over the simulated node-state file.
 *
 * Loaded by the real nvidia-ml-py (CDLL("libnvidia-ml.so.1") through
 * LD_LIBRARY_PATH). Every exported function has NVML's real signature, struct
 * layout, return codes and buffer-size rules, so code that works here works on a
 * real node. The types are declared here (no CUDA toolkit needed to build).
 *
 * Device handles point into a static table, one entry per physical GPU; only
 * GPUs visible after NVIDIA_VISIBLE_DEVICES (what the container runtime would
 * expose) are handed out, and indices are positions in that visible list.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "simstate.h"

#define NVML_API __attribute__((visibility("default")))

/* ------------------------------------------------------------------ NVML types */

typedef enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_ALREADY_INITIALIZED = 5,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_INSUFFICIENT_POWER = 8,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_IRQ_ISSUE = 11,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_CORRUPTED_INFOROM = 14,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_RESET_REQUIRED = 16,
    NVML_ERROR_OPERATING_SYSTEM = 17,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_IN_USE = 19,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_NO_DATA = 21,
    NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22,
    NVML_ERROR_INSUFFICIENT_RESOURCES = 23,
    NVML_ERROR_FREQ_NOT_SUPPORTED = 24,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_DEPRECATED = 26,
    NVML_ERROR_NOT_READY = 27,
    NVML_ERROR_GPU_NOT_FOUND = 28,
    NVML_ERROR_INVALID_STATE = 29,
    NVML_ERROR_UNKNOWN = 999
} nvmlReturn_t;

typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct nvmlEventSet_st *nvmlEventSet_t;
typedef unsigned int nvmlEnableState_t;
typedef unsigned int nvmlGpuTopologyLevel_t;
typedef unsigned int nvmlNvLinkCapability_t;
typedef unsigned int nvmlIntNvLinkDeviceType_t;
typedef unsigned int nvmlGpuP2PCapsIndex_t;
typedef unsigned int nvmlGpuP2PStatus_t;
typedef unsigned int nvmlAffinityScope_t;

#define NVML_STRUCT_VERSION(name, ver) ((unsigned int)(sizeof(name) | ((ver) << 24U)))
#define NVML_NVLINK_MAX_LINKS 18
#define NVML_VALUE_NOT_AVAILABLE_UINT 0xFFFFFFFFu

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;
#define nvmlMemory_v2 NVML_STRUCT_VERSION(nvmlMemory_v2_t, 2)

typedef struct {
    char busIdLegacy[16]; /* "%04X:%02X:%02X.0" */
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];       /* "%08X:%02X:%02X.0" */
} nvmlPciInfo_t;

/* The layout nvmlDeviceGetPciInfo (v1) fills: bus id, ids, then reserved words. */
typedef struct {
    char busId[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    unsigned int reserved0, reserved1, reserved2, reserved3;
} nvmlPciInfo_v1_t;

typedef struct {
    unsigned int version;
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId, baseClass, subClass;
    char busId[32];
} nvmlPciInfoExt_v1_t;
#define nvmlPciInfoExt_v1 NVML_STRUCT_VERSION(nvmlPciInfoExt_v1_t, 1)

typedef struct {
    unsigned int gpu, memory;
} nvmlUtilization_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t; /* = nvmlProcessInfo_v2_t (used by _v2 and _v3) */

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
    unsigned long long usedGpuCcProtectedMemory;
} nvmlProcessDetail_v1_t;

typedef struct {
    unsigned int version;
    unsigned int mode; /* nvmlProcessMode_t */
    unsigned int numProcArrayEntries;
    nvmlProcessDetail_v1_t *procArray;
} nvmlProcessDetailList_v1_t;
#define nvmlProcessDetailList_v1 NVML_STRUCT_VERSION(nvmlProcessDetailList_v1_t, 1)
enum { NVML_PROCESS_MODE_COMPUTE = 0, NVML_PROCESS_MODE_GRAPHICS = 1, NVML_PROCESS_MODE_MPS = 2, NVML_PROCESS_MODE_ALL = 3 };

typedef struct {
    unsigned long long bar1Total, bar1Free, bar1Used;
} nvmlBAR1Memory_t;

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
} nvmlProcessesUtilizationInfo_v1_t;
#define nvmlProcessesUtilizationInfo_v1 NVML_STRUCT_VERSION(nvmlProcessesUtilizationInfo_v1_t, 1)

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType, eventData;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlEventData_t;

#define nvmlEventTypeSingleBitEccError 0x1ULL
#define nvmlEventTypeDoubleBitEccError 0x2ULL
#define nvmlEventTypePState 0x4ULL
#define nvmlEventTypeXidCriticalError 0x8ULL
#define nvmlEventTypeClock 0x10ULL
#define SIM_SUPPORTED_EVENTS                                                                  \
    (nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError | nvmlEventTypePState | \
     nvmlEventTypeXidCriticalError | nvmlEventTypeClock)

enum { NVML_NVLINK_DEVICE_TYPE_GPU = 0, NVML_NVLINK_DEVICE_TYPE_SWITCH = 2 };
enum {
    NVML_NVLINK_CAP_P2P_SUPPORTED = 0,
    NVML_NVLINK_CAP_SYSMEM_ACCESS = 1,
    NVML_NVLINK_CAP_P2P_ATOMICS = 2,
    NVML_NVLINK_CAP_SYSMEM_ATOMICS = 3,
    NVML_NVLINK_CAP_SLI_BRIDGE = 4,
    NVML_NVLINK_CAP_VALID = 5,
    NVML_NVLINK_CAP_COUNT = 6
};
enum {
    NVML_P2P_CAPS_INDEX_READ = 0,
    NVML_P2P_CAPS_INDEX_WRITE = 1,
    NVML_P2P_CAPS_INDEX_NVLINK = 2,
    NVML_P2P_CAPS_INDEX_ATOMICS = 3,
    NVML_P2P_CAPS_INDEX_PCI = 4,
    NVML_P2P_CAPS_INDEX_UNKNOWN = 5
};
enum {
    NVML_P2P_STATUS_OK = 0,
    NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED = 3,
    NVML_P2P_STATUS_NOT_SUPPORTED = 5
};

/* ------------------------------------------------------------------ state */

/* One handle per physical GPU. `index` is the physical index in the node file. */
struct nvmlDevice_st {
    uint32_t index;
};
static struct nvmlDevice_st g_dev[SIMGPU_MAX_GPUS];

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_init_count;                    /* guarded by g_lock */
static simgpu_node_t *_Atomic g_n;          /* node mapped at the last nvmlInit */
static uint32_t g_visible[SIMGPU_MAX_GPUS]; /* visible index -> physical index */
static _Atomic int g_visible_count;

/* Registration of one GPU in an event set. */
typedef struct {
    uint32_t gpu;
    unsigned long long mask;
    uint64_t seen;      /* last event sequence number delivered (or skipped) */
    int lost_reported;  /* GPU_IS_LOST returned once for the current loss */
} sim_reg_t;

struct nvmlEventSet_st {
    uint32_t magic;
    int nregs;
    sim_reg_t regs[SIMGPU_MAX_GPUS];
};
#define EVENT_SET_MAGIC 0x45564e54u

static simgpu_node_t *node_if_init(void) {
    return atomic_load(&g_n);
}

static int visible_pos(uint32_t phys) {
    int count = atomic_load(&g_visible_count);
    for (int i = 0; i < count; i++)
        if (g_visible[i] == phys) return i;
    return -1;
}

/* Validate init state and a device handle; on success *g is the GPU and *idx its
 * physical index. Lost GPUs answer GPU_IS_LOST unless allow_lost. */
static nvmlReturn_t dev_get(nvmlDevice_t d, simgpu_gpu_t **g, uint32_t *idx, int allow_lost) {
    simgpu_node_t *n = node_if_init();
    if (!n) return NVML_ERROR_UNINITIALIZED;
    uintptr_t p = (uintptr_t)d, base = (uintptr_t)g_dev;
    if (p < base || p >= base + sizeof g_dev || (p - base) % sizeof g_dev[0] != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    uint32_t i = d->index;
    if (i >= n->gpu_count || visible_pos(i) < 0) return NVML_ERROR_INVALID_ARGUMENT;
    if (!allow_lost && atomic_load(&n->gpus[i].lost)) return NVML_ERROR_GPU_IS_LOST;
    *g = &n->gpus[i];
    *idx = i;
    return NVML_SUCCESS;
}

#define DEV(h, g, idx)                                        \
    simgpu_gpu_t *g;                                          \
    uint32_t idx;                                             \
    do {                                                      \
        nvmlReturn_t _r = dev_get((h), &g, &idx, 0);          \
        if (_r != NVML_SUCCESS) return _r;                    \
    } while (0)

static nvmlReturn_t copy_str(char *out, unsigned int length, const char *s) {
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    size_t need = strlen(s) + 1;
    if (length < need) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(out, s, need);
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------ init */

NVML_API nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    pthread_mutex_lock(&g_lock);
    /* Re-read $SIMGPU_STATE at every init so one test process can move between nodes. */
    simgpu_node_t *n = sim_node_reload();
    if (!n) {
        pthread_mutex_unlock(&g_lock);
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    for (uint32_t i = 0; i < SIMGPU_MAX_GPUS; i++) g_dev[i].index = i;
    uint32_t vis[SIMGPU_MAX_GPUS];
    int count = sim_visible_gpus(n, 0, vis);
    memcpy(g_visible, vis, sizeof(uint32_t) * (size_t)count);
    atomic_store(&g_visible_count, count);
    atomic_store(&g_n, n);
    g_init_count++;
    pthread_mutex_unlock(&g_lock);
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlInit_v2(void) {
    return nvmlInitWithFlags(0);
}

NVML_API nvmlReturn_t nvmlInit(void) {
    return nvmlInitWithFlags(0);
}

NVML_API nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&g_lock);
    if (g_init_count == 0) {
        pthread_mutex_unlock(&g_lock);
        return NVML_ERROR_UNINITIALIZED;
    }
    if (--g_init_count == 0) atomic_store(&g_n, NULL);
    pthread_mutex_unlock(&g_lock);
    return NVML_SUCCESS;
}

NVML_API const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_DEPRECATED: return "Deprecated";
    case NVML_ERROR_NOT_READY: return "Not Ready";
    case NVML_ERROR_GPU_NOT_FOUND: return "GPU not found";
    case NVML_ERROR_INVALID_STATE: return "Invalid state";
    default: return "Unknown Error";
    }
}

/* ------------------------------------------------------------------ system */

NVML_API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    simgpu_node_t *n = node_if_init();
    if (!n) return NVML_ERROR_UNINITIALIZED;
    return copy_str(version, length, n->driver_version);
}

NVML_API nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    simgpu_node_t *n = node_if_init();
    if (!n) return NVML_ERROR_UNINITIALIZED;
    return copy_str(version, length, n->nvml_version);
}

NVML_API nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion) {
    simgpu_node_t *n = node_if_init();
    if (!n) return NVML_ERROR_UNINITIALIZED;
    if (!cudaDriverVersion) return NVML_ERROR_INVALID_ARGUMENT;
    *cudaDriverVersion = (int)n->cuda_driver_version;
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion) {
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

/* ------------------------------------------------------------------ handles */

NVML_API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    if (!node_if_init()) return NVML_ERROR_UNINITIALIZED;
    if (!deviceCount) return NVML_ERROR_INVALID_ARGUMENT;
    *deviceCount = (unsigned int)atomic_load(&g_visible_count);
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount) {
    return nvmlDeviceGetCount_v2(deviceCount);
}

static nvmlReturn_t hand_out(simgpu_node_t *n, uint32_t phys, nvmlDevice_t *device) {
    if (atomic_load(&n->gpus[phys].lost)) return NVML_ERROR_GPU_IS_LOST;
    *device = &g_dev[phys];
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    simgpu_node_t *n = node_if_init();
    if (!n) return NVML_ERROR_UNINITIALIZED;
    if (!device || index >= (unsigned int)atomic_load(&g_visible_count)) return NVML_ERROR_INVALID_ARGUMENT;
    return hand_out(n, g_visible[index], device);
}

NVML_API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

NVML_API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    simgpu_node_t *n = node_if_init();
    if (!n) return NVML_ERROR_UNINITIALIZED;
    if (!uuid || !device) return NVML_ERROR_INVALID_ARGUMENT;
    int count = atomic_load(&g_visible_count);
    for (int i = 0; i < count; i++)
        if (strcmp(n->gpus[g_visible[i]].uuid, uuid) == 0) return hand_out(n, g_visible[i], device);
    return NVML_ERROR_NOT_FOUND;
}

/* Accepts "00000000:18:00.0", "0000:18:00.0" and "18:00.0", any case. */
static int parse_bus_id(const char *s, unsigned *dom, unsigned *bus, unsigned *dev) {
    unsigned fn = 0;
    char tail;
    if (sscanf(s, "%x:%x:%x.%x%c", dom, bus, dev, &fn, &tail) == 4) return 1;
    *dom = 0;
    return sscanf(s, "%x:%x.%x%c", bus, dev, &fn, &tail) == 3;
}

NVML_API nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device) {
    simgpu_node_t *n = node_if_init();
    if (!n) return NVML_ERROR_UNINITIALIZED;
    unsigned dom, bus, dev;
    if (!pciBusId || !device || !parse_bus_id(pciBusId, &dom, &bus, &dev)) return NVML_ERROR_INVALID_ARGUMENT;
    int count = atomic_load(&g_visible_count);
    for (int i = 0; i < count; i++) {
        const simgpu_gpu_t *g = &n->gpus[g_visible[i]];
        if (g->pci_domain == dom && g->pci_bus == bus && g->pci_device == dev)
            return hand_out(n, g_visible[i], device);
    }
    return NVML_ERROR_NOT_FOUND;
}

NVML_API nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByPciBusId_v2(pciBusId, device);
}

NVML_API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    DEV(device, g, idx);
    (void)g;
    if (!index) return NVML_ERROR_INVALID_ARGUMENT;
    *index = (unsigned int)visible_pos(idx);
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------ identity */

NVML_API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    DEV(device, g, idx);
    (void)idx;
    return copy_str(name, length, g->name);
}

NVML_API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    DEV(device, g, idx);
    (void)idx;
    return copy_str(uuid, length, g->uuid);
}

NVML_API nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber) {
    DEV(device, g, idx);
    (void)idx;
    if (!minorNumber) return NVML_ERROR_INVALID_ARGUMENT;
    *minorNumber = g->minor;
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor) {
    DEV(device, g, idx);
    (void)idx;
    if (!major || !minor) return NVML_ERROR_INVALID_ARGUMENT;
    *major = (int)g->cc_major;
    *minor = (int)g->cc_minor;
    return NVML_SUCCESS;
}

/* MIG-capable parts (A100, H100: compute capability 8.0 and 9.0) report the mode
 * their spec gives (NVML_DEVICE_MIG_ENABLE = 1, NVML_DEVICE_MIG_DISABLE = 0; the
 * simulation never has a mode change pending a reset); the others do not support it. */
NVML_API nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode,
                                           unsigned int *pendingMode) {
    DEV(device, g, idx);
    (void)idx;
    if (!currentMode || !pendingMode) return NVML_ERROR_INVALID_ARGUMENT;
    if (g->cc_minor != 0 || g->cc_major < 8) return NVML_ERROR_NOT_SUPPORTED;
    *currentMode = *pendingMode = g->mig_mode ? 1u : 0u;
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------ memory */

static uint64_t used_of(simgpu_gpu_t *g) {
    /* A real driver frees a process's memory as the process dies; the simulation has no
     * one to do that at death, so the readers do it: dead processes' memory is given
     * back before any memory reading. */
    simgpu_node_t *n = sim_node();
    if (n) sim_reap_dead(n);
    uint64_t used = atomic_load(&g->used_bytes);
    uint64_t cap = g->total_bytes > g->reserved_bytes ? g->total_bytes - g->reserved_bytes : 0;
    return used > cap ? cap : used;
}

/* v1 counts the driver's reservation as used (as real NVML does since r510). */
NVML_API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    DEV(device, g, idx);
    (void)idx;
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t used = used_of(g) + g->reserved_bytes;
    if (used > g->total_bytes) used = g->total_bytes;
    memory->total = g->total_bytes;
    memory->used = used;
    memory->free = g->total_bytes - used;
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    DEV(device, g, idx);
    (void)idx;
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != nvmlMemory_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    uint64_t used = used_of(g);
    memory->total = g->total_bytes;
    memory->reserved = g->reserved_bytes;
    memory->used = used;
    memory->free = g->total_bytes - g->reserved_bytes - used;
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------ PCI */

static void fill_pci(const simgpu_gpu_t *g, nvmlPciInfo_t *pci) {
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.0", g->pci_domain & 0xFFFFu,
             g->pci_bus & 0xFFu, g->pci_device & 0xFFu);
    snprintf(pci->busId, sizeof pci->busId, "%s", g->pci_bus_id);
    pci->domain = g->pci_domain;
    pci->bus = g->pci_bus;
    pci->device = g->pci_device;
    pci->pciDeviceId = g->pci_device_id;
    pci->pciSubSystemId = g->pci_subsystem_id;
}

NVML_API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    DEV(device, g, idx);
    (void)idx;
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    fill_pci(g, pci);
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    return nvmlDeviceGetPciInfo_v3(device, pci);
}

NVML_API nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_v1_t *pci) {
    DEV(device, g, idx);
    (void)idx;
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlPciInfo_t full;
    fill_pci(g, &full);
    memset(pci, 0, sizeof *pci);
    memcpy(pci->busId, full.busIdLegacy, sizeof pci->busId);
    pci->domain = full.domain;
    pci->bus = full.bus;
    pci->device = full.device;
    pci->pciDeviceId = full.pciDeviceId;
    pci->pciSubSystemId = full.pciSubSystemId;
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlDeviceGetPciInfoExt(nvmlDevice_t device, nvmlPciInfoExt_v1_t *pci) {
    DEV(device, g, idx);
    (void)idx;
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    if (pci->version != nvmlPciInfoExt_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    nvmlPciInfo_t full;
    fill_pci(g, &full);
    pci->domain = full.domain;
    pci->bus = full.bus;
    pci->device = full.device;
    pci->pciDeviceId = full.pciDeviceId;
    pci->pciSubSystemId = full.pciSubSystemId;
    pci->baseClass = 0x03; /* display controller */
    pci->subClass = 0x02;  /* 3D controller, as datacenter GPUs report */
    memcpy(pci->busId, full.busId, sizeof pci->busId);
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------ NUMA / CPU affinity */

NVML_API nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node) {
    DEV(device, g, idx);
    (void)idx;
    if (!node) return NVML_ERROR_INVALID_ARGUMENT;
    if (g->numa_node < 0) return NVML_ERROR_NOT_SUPPORTED;
    *node = (unsigned int)g->numa_node;
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlDeviceGetCpuAffinityWithinScope(nvmlDevice_t device, unsigned int cpuSetSize,
                                                          unsigned long *cpuSet, nvmlAffinityScope_t scope) {
    DEV(device, g, idx);
    (void)idx;
    /* Node and socket scope coincide on the simulated nodes (one NUMA node per socket). */
    if (!cpuSet || cpuSetSize == 0 || scope > 1) return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < cpuSetSize; i++)
        cpuSet[i] = i < SIMGPU_CPU_WORDS ? (unsigned long)g->cpu_affinity[i] : 0;
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlDeviceGetCpuAffinity(nvmlDevice_t device, unsigned int cpuSetSize,
                                               unsigned long *cpuSet) {
    return nvmlDeviceGetCpuAffinityWithinScope(device, cpuSetSize, cpuSet, 0);
}

/* The NUMA nodes close to the GPU: how a real x86 node reports GPU locality. */
NVML_API nvmlReturn_t nvmlDeviceGetMemoryAffinity(nvmlDevice_t device, unsigned int nodeSetSize,
                                                  unsigned long *nodeSet, nvmlAffinityScope_t scope) {
    DEV(device, g, idx);
    (void)idx;
    if (!nodeSet || nodeSetSize == 0 || scope > 1) return NVML_ERROR_INVALID_ARGUMENT;
    memset(nodeSet, 0, sizeof(unsigned long) * nodeSetSize);
    if (g->numa_node >= 0 && (unsigned)g->numa_node / 64 < nodeSetSize)
        nodeSet[g->numa_node / 64] = 1UL << (g->numa_node % 64);
    return NVML_SUCCESS;
}

static int cpu_in(const simgpu_gpu_t *g, unsigned int cpu) {
    return cpu < SIMGPU_CPU_WORDS * 64 && (g->cpu_affinity[cpu / 64] >> (cpu % 64)) & 1;
}

/* The count/array protocol of the topology queries: *count == 0 asks for the
 * size; otherwise up to *count handles are written and *count is set. */
static nvmlReturn_t fill_devices(const uint32_t *phys, unsigned int found, unsigned int *count,
                                 nvmlDevice_t *deviceArray) {
    if (*count == 0) {
        *count = found;
        return NVML_SUCCESS;
    }
    if (!deviceArray) return NVML_ERROR_INVALID_ARGUMENT;
    if (*count < found) found = *count;
    for (unsigned int i = 0; i < found; i++) deviceArray[i] = &g_dev[phys[i]];
    *count = found;
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlSystemGetTopologyGpuSet(unsigned int cpuNumber, unsigned int *count,
                                                  nvmlDevice_t *deviceArray) {
    simgpu_node_t *n = node_if_init();
    if (!n) return NVML_ERROR_UNINITIALIZED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    uint32_t phys[SIMGPU_MAX_GPUS];
    unsigned int found = 0;
    int vc = atomic_load(&g_visible_count);
    for (int i = 0; i < vc; i++)
        if (cpu_in(&n->gpus[g_visible[i]], cpuNumber)) phys[found++] = g_visible[i];
    return fill_devices(phys, found, count, deviceArray);
}

/* ------------------------------------------------------------------ topology / NVLink */

NVML_API nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1, nvmlDevice_t device2,
                                                          nvmlGpuTopologyLevel_t *pathInfo) {
    DEV(device1, g1, i1);
    DEV(device2, g2, i2);
    (void)i1;
    (void)g2;
    if (!pathInfo) return NVML_ERROR_INVALID_ARGUMENT;
    *pathInfo = g1->topo_level[i2];
    return NVML_SUCCESS;
}

/* GPUs (other than `device`) whose path to it is at `level` or closer. */
NVML_API nvmlReturn_t nvmlDeviceGetTopologyNearestGpus(nvmlDevice_t device, nvmlGpuTopologyLevel_t level,
                                                       unsigned int *count, nvmlDevice_t *deviceArray) {
    DEV(device, g, idx);
    if (!count || level > SIMGPU_TOPO_SYSTEM) return NVML_ERROR_INVALID_ARGUMENT;
    uint32_t phys[SIMGPU_MAX_GPUS];
    unsigned int found = 0;
    int vc = atomic_load(&g_visible_count);
    for (int i = 0; i < vc; i++)
        if (g_visible[i] != idx && g->topo_level[g_visible[i]] <= level) phys[found++] = g_visible[i];
    return fill_devices(phys, found, count, deviceArray);
}

/* Number of NVLink links usable between two GPUs: direct, or via the NVSwitch fabric. */
static unsigned nvlinks_between(const simgpu_gpu_t *a, uint32_t b_idx, const simgpu_gpu_t *b) {
    unsigned direct = 0, fa = 0, fb = 0;
    for (uint32_t l = 0; l < a->nvlink_count && l < SIMGPU_MAX_NVLINKS; l++) {
        if (a->nvlink_peer[l] == (int32_t)b_idx) direct++;
        if (a->nvlink_peer[l] == SIMGPU_NVLINK_NVSWITCH) fa++;
    }
    for (uint32_t l = 0; l < b->nvlink_count && l < SIMGPU_MAX_NVLINKS; l++)
        if (b->nvlink_peer[l] == SIMGPU_NVLINK_NVSWITCH) fb++;
    return direct + (fa < fb ? fa : fb);
}

/* A GPU without NVLink does not support the link queries; a link index past
 * the GPU's links is invalid. */
static nvmlReturn_t link_check(const simgpu_gpu_t *g, unsigned int link) {
    if (g->nvlink_count == 0) return NVML_ERROR_NOT_SUPPORTED;
    if (link >= g->nvlink_count || link >= SIMGPU_MAX_NVLINKS) return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

#define LINK(g, link)                                     \
    do {                                                  \
        nvmlReturn_t _r = link_check((g), (link));        \
        if (_r != NVML_SUCCESS) return _r;                \
    } while (0)

NVML_API nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link,
                                               nvmlEnableState_t *isActive) {
    DEV(device, g, idx);
    (void)idx;
    LINK(g, link);
    if (!isActive) return NVML_ERROR_INVALID_ARGUMENT;
    *isActive = g->nvlink_peer[link] != -1;
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlDeviceGetNvLinkVersion(nvmlDevice_t device, unsigned int link, unsigned int *version) {
    DEV(device, g, idx);
    (void)idx;
    LINK(g, link);
    if (!version) return NVML_ERROR_INVALID_ARGUMENT;
    /* NVLink generation by architecture: Volta 2, Ampere 3, Hopper 4, Blackwell 5. */
    *version = g->cc_major >= 10 ? 5 : g->cc_major == 9 ? 4 : g->cc_major == 8 ? 3 : 2;
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlDeviceGetNvLinkCapability(nvmlDevice_t device, unsigned int link,
                                                    nvmlNvLinkCapability_t capability, unsigned int *capResult) {
    DEV(device, g, idx);
    (void)idx;
    LINK(g, link);
    if (!capResult || capability >= NVML_NVLINK_CAP_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    int up = g->nvlink_peer[link] != -1;
    switch (capability) {
    case NVML_NVLINK_CAP_P2P_SUPPORTED:
    case NVML_NVLINK_CAP_P2P_ATOMICS:
    case NVML_NVLINK_CAP_VALID: *capResult = (unsigned)up; break;
    default: *capResult = 0; /* x86 hosts: no NVLink to system memory, no SLI */
    }
    return NVML_SUCCESS;
}

/* NVSwitches of the fabric get PCI ids of their own; link l lands on switch l*4/18
 * (4 switches, as on DGX/HGX H100). */
static void nvswitch_pci(unsigned int link, nvmlPciInfo_t *pci) {
    unsigned bus = (0xC1u + link * 4 / SIMGPU_MAX_NVLINKS) & 0xFFu;
    memset(pci, 0, sizeof *pci);
    pci->bus = bus;
    pci->pciDeviceId = 0x22A310DEu; /* NVSwitch (Hopper generation) */
    pci->pciSubSystemId = 0x179610DEu;
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "0000:%02X:00.0", bus);
    snprintf(pci->busId, sizeof pci->busId, "00000000:%02X:00.0", bus);
}

NVML_API nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link,
                                                          nvmlPciInfo_t *pci) {
    DEV(device, g, idx);
    (void)idx;
    LINK(g, link);
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    int32_t peer = g->nvlink_peer[link];
    if (peer == SIMGPU_NVLINK_NVSWITCH) {
        nvswitch_pci(link, pci);
        return NVML_SUCCESS;
    }
    simgpu_node_t *n = node_if_init();
    if (peer < 0 || (uint32_t)peer >= n->gpu_count) return NVML_ERROR_NOT_SUPPORTED;
    fill_pci(&n->gpus[peer], pci);
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link,
                                                          nvmlIntNvLinkDeviceType_t *pNvLinkDeviceType) {
    DEV(device, g, idx);
    (void)idx;
    LINK(g, link);
    if (!pNvLinkDeviceType) return NVML_ERROR_INVALID_ARGUMENT;
    int32_t peer = g->nvlink_peer[link];
    if (peer == -1) return NVML_ERROR_NOT_SUPPORTED;
    *pNvLinkDeviceType = peer == SIMGPU_NVLINK_NVSWITCH ? NVML_NVLINK_DEVICE_TYPE_SWITCH
                                                        : NVML_NVLINK_DEVICE_TYPE_GPU;
    return NVML_SUCCESS;
}

/* P2P: always over NVLink where the pair has links; over PCIe only below one host
 * bridge (across root complexes or sockets the chipset does not route it). */
NVML_API nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t device1, nvmlDevice_t device2,
                                             nvmlGpuP2PCapsIndex_t p2pIndex, nvmlGpuP2PStatus_t *p2pStatus) {
    DEV(device1, g1, i1);
    DEV(device2, g2, i2);
    (void)i1;
    if (!p2pStatus || p2pIndex >= NVML_P2P_CAPS_INDEX_UNKNOWN) return NVML_ERROR_INVALID_ARGUMENT;
    if (g1 == g2) return NVML_ERROR_INVALID_ARGUMENT;
    int nvl = nvlinks_between(g1, i2, g2) > 0;
    int pcie_ok = g1->topo_level[i2] <= SIMGPU_TOPO_HOSTBRIDGE;
    switch (p2pIndex) {
    case NVML_P2P_CAPS_INDEX_NVLINK: *p2pStatus = nvl ? NVML_P2P_STATUS_OK : NVML_P2P_STATUS_NOT_SUPPORTED; break;
    case NVML_P2P_CAPS_INDEX_PCI:
        *p2pStatus = pcie_ok ? NVML_P2P_STATUS_OK : NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED;
        break;
    default:
        *p2pStatus = (nvl || pcie_ok) ? NVML_P2P_STATUS_OK : NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED;
    }
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------ utilisation */

/* Utilisation is measured like NVML's sampler: busy time between two queries from
 * this process. A slot's busy time up to now is its total minus the part of the
 * last kernel that still lies in the future. */
static uint64_t busy_to_now(simgpu_proc_t *s, uint64_t now) {
    uint64_t total = atomic_load(&s->busy_ns_total), until = atomic_load(&s->busy_until_ns);
    uint64_t ahead = until > now ? until - now : 0;
    return total > ahead ? total - ahead : 0;
}

typedef struct {
    simgpu_node_t *node;
    int32_t pid;
    uint64_t start_time, busy, at;
} sample_t;
static sample_t g_proc_sample[SIMGPU_MAX_PROCS];
static sample_t g_gpu_sample[SIMGPU_MAX_GPUS];
static pthread_mutex_t g_sample_lock = PTHREAD_MUTEX_INITIALIZER;

/* Percent busy since this process's previous sample of the same key; on the first
 * sample, whether it is busy right now. Updates the sample. */
static unsigned int percent_since(sample_t *prev, simgpu_node_t *n, int32_t pid, uint64_t st, uint64_t busy,
                                  uint64_t now, int busy_now) {
    unsigned int pct;
    if (prev->node == n && prev->pid == pid && prev->start_time == st && now > prev->at) {
        uint64_t d = busy > prev->busy ? busy - prev->busy : 0;
        uint64_t span = now - prev->at;
        pct = d >= span ? 100 : (unsigned int)(d * 100 / span);
    } else {
        pct = busy_now ? 100 : 0;
    }
    *prev = (sample_t){n, pid, st, busy, now};
    return pct;
}

static int slot_on(simgpu_proc_t *s, uint32_t gpu, int32_t *pid_out) {
    int32_t pid = atomic_load(&s->pid);
    if (pid <= 0 || s->gpu != gpu) return 0;
    *pid_out = pid;
    return 1;
}

NVML_API nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    DEV(device, g, idx);
    if (!utilization) return NVML_ERROR_INVALID_ARGUMENT;
    simgpu_node_t *n = node_if_init();
    uint64_t now = sim_now_ns(), busy = 0;
    int busy_now = 0;
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++) {
        int32_t pid;
        if (!slot_on(&n->procs[i], idx, &pid)) continue;
        busy += busy_to_now(&n->procs[i], now);
        busy_now |= atomic_load(&n->procs[i].busy_until_ns) > now;
    }
    pthread_mutex_lock(&g_sample_lock);
    unsigned int pct = percent_since(&g_gpu_sample[idx], n, 0, 0, busy, now, busy_now);
    pthread_mutex_unlock(&g_sample_lock);
    uint32_t og = atomic_load(&g->util_gpu_override), om = atomic_load(&g->util_mem_override);
    /* 0 = derive from kernel activity; otherwise the test's value + 1. Memory
     * bandwidth is modelled as half the SM activity. */
    utilization->gpu = og ? og - 1 : pct;
    utilization->memory = om ? om - 1 : utilization->gpu / 2;
    return NVML_SUCCESS;
}

typedef struct {
    unsigned int pid, sm, mem;
    unsigned long long ts;
} proc_util_t;

/* Per-process samples newer than lastSeen (microseconds); returns the count. */
static unsigned int collect_proc_util(simgpu_node_t *n, uint32_t gpu, unsigned long long lastSeen,
                                      proc_util_t out[SIMGPU_MAX_PROCS]) {
    sim_reap_dead(n);
    uint64_t now = sim_now_ns();
    unsigned int count = 0;
    pthread_mutex_lock(&g_sample_lock);
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++) {
        simgpu_proc_t *s = &n->procs[i];
        int32_t pid;
        if (!slot_on(s, gpu, &pid)) continue;
        uint64_t last = atomic_load(&s->last_launch_ns), until = atomic_load(&s->busy_until_ns);
        if (last == 0) continue; /* never ran a kernel: no sample */
        uint64_t active = until > now ? now : (until > last ? until : last);
        unsigned long long ts = active / 1000;
        unsigned int pct = percent_since(&g_proc_sample[i], n, pid, s->start_time, busy_to_now(s, now), now,
                                         until > now);
        if (ts <= lastSeen) continue;
        out[count++] = (proc_util_t){(unsigned)pid, pct, pct / 2, ts};
    }
    pthread_mutex_unlock(&g_sample_lock);
    return count;
}

/* The per-process samples of `gpu` newer than last_seen, written into `array`
 * by `put`, with NVML's rules: none -> NOT_FOUND; no array or too small ->
 * INSUFFICIENT_SIZE and the count needed. */
static nvmlReturn_t process_samples(uint32_t gpu, unsigned long long last_seen, unsigned int *count, void *array,
                                    void (*put)(void *array, unsigned int i, const proc_util_t *u)) {
    static proc_util_t buf[SIMGPU_MAX_PROCS]; /* 24 KiB: off the caller's stack */
    static pthread_mutex_t buf_lock = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&buf_lock);
    unsigned int found = collect_proc_util(node_if_init(), gpu, last_seen, buf);
    nvmlReturn_t r = NVML_SUCCESS;
    if (found == 0) {
        r = NVML_ERROR_NOT_FOUND;
    } else if (!array || *count < found) {
        *count = found;
        r = NVML_ERROR_INSUFFICIENT_SIZE;
    } else {
        for (unsigned int i = 0; i < found; i++) put(array, i, &buf[i]);
        *count = found;
    }
    pthread_mutex_unlock(&buf_lock);
    return r;
}

static void put_sample(void *array, unsigned int i, const proc_util_t *u) {
    ((nvmlProcessUtilizationSample_t *)array)[i] = (nvmlProcessUtilizationSample_t){u->pid, u->ts, u->sm, u->mem, 0, 0};
}

static void put_info(void *array, unsigned int i, const proc_util_t *u) {
    ((nvmlProcessUtilizationInfo_v1_t *)array)[i] =
        (nvmlProcessUtilizationInfo_v1_t){u->ts, u->pid, u->sm, u->mem, 0, 0, 0, 0};
}

NVML_API nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                                      unsigned int *processSamplesCount,
                                                      unsigned long long lastSeenTimeStamp) {
    DEV(device, g, idx);
    (void)g;
    if (!processSamplesCount) return NVML_ERROR_INVALID_ARGUMENT;
    return process_samples(idx, lastSeenTimeStamp, processSamplesCount, utilization, put_sample);
}

NVML_API nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t device,
                                                            nvmlProcessesUtilizationInfo_v1_t *procesesUtilInfo) {
    DEV(device, g, idx);
    (void)g;
    nvmlProcessesUtilizationInfo_v1_t *p = procesesUtilInfo;
    if (!p) return NVML_ERROR_INVALID_ARGUMENT;
    if (p->version != nvmlProcessesUtilizationInfo_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    return process_samples(idx, p->lastSeenTimeStamp, &p->processSamplesCount, p->procUtilArray, put_info);
}

/* ------------------------------------------------------------------ processes */

typedef struct {
    unsigned int pid;
    unsigned long long used;
} proc_mem_t;

/* Live compute processes on a GPU and their memory, one entry per pid. A process
 * whose memory is checkpointed to the host has no GPU context, so it is absent. */
static unsigned int collect_procs(simgpu_node_t *n, uint32_t gpu, proc_mem_t out[SIMGPU_MAX_PROCS]) {
    sim_reap_dead(n);
    unsigned int count = 0;
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++) {
        simgpu_proc_t *s = &n->procs[i];
        int32_t pid;
        if (!slot_on(s, gpu, &pid) || atomic_load(&s->ckpt_state) == SIMGPU_CKPT_CHECKPOINTED) continue;
        out[count++] = (proc_mem_t){(unsigned)pid, atomic_load(&s->used_bytes)};
    }
    return count;
}

/* NVML's buffer rule: too small (or NULL with a zero count) -> INSUFFICIENT_SIZE
 * and the needed count; no processes -> SUCCESS with 0. */
#define RUNNING_PROCESSES(device, infoCount, infos, FILL)                     \
    do {                                                                      \
        DEV(device, g, idx);                                                  \
        (void)g;                                                              \
        if (!infoCount) return NVML_ERROR_INVALID_ARGUMENT;                   \
        static proc_mem_t buf[SIMGPU_MAX_PROCS];                              \
        static pthread_mutex_t buf_lock = PTHREAD_MUTEX_INITIALIZER;          \
        pthread_mutex_lock(&buf_lock);                                        \
        unsigned int found = collect_procs(node_if_init(), idx, buf);         \
        nvmlReturn_t r = NVML_SUCCESS;                                        \
        if (*infoCount < found || (found && !infos)) {                        \
            r = NVML_ERROR_INSUFFICIENT_SIZE;                                 \
        } else {                                                              \
            for (unsigned int i = 0; i < found; i++) FILL;                    \
        }                                                                     \
        *infoCount = found;                                                   \
        pthread_mutex_unlock(&buf_lock);                                      \
        return r;                                                             \
    } while (0)

NVML_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                              nvmlProcessInfo_t *infos) {
    RUNNING_PROCESSES(device, infoCount, infos,
                      (infos[i] = (nvmlProcessInfo_t){buf[i].pid, buf[i].used, NVML_VALUE_NOT_AVAILABLE_UINT,
                                                      NVML_VALUE_NOT_AVAILABLE_UINT}));
}

NVML_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                              nvmlProcessInfo_t *infos) {
    return nvmlDeviceGetComputeRunningProcesses_v3(device, infoCount, infos);
}

NVML_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                           nvmlProcessInfo_v1_t *infos) {
    RUNNING_PROCESSES(device, infoCount, infos, (infos[i] = (nvmlProcessInfo_v1_t){buf[i].pid, buf[i].used}));
}

/* No graphics or MPS clients on a simulated compute node: every version answers
 * an empty list (SUCCESS, count 0) with NVML's argument checks. */
static nvmlReturn_t no_processes(nvmlDevice_t device, unsigned int *infoCount) {
    DEV(device, g, idx);
    (void)g;
    (void)idx;
    if (!infoCount) return NVML_ERROR_INVALID_ARGUMENT;
    *infoCount = 0;
    return NVML_SUCCESS;
}

#define NO_PROCESSES(sym, info_t)                                                                 \
    NVML_API nvmlReturn_t sym(nvmlDevice_t device, unsigned int *infoCount, info_t *infos) {      \
        (void)infos;                                                                              \
        return no_processes(device, infoCount);                                                   \
    }
NO_PROCESSES(nvmlDeviceGetGraphicsRunningProcesses, nvmlProcessInfo_v1_t)
NO_PROCESSES(nvmlDeviceGetGraphicsRunningProcesses_v2, nvmlProcessInfo_t)
NO_PROCESSES(nvmlDeviceGetGraphicsRunningProcesses_v3, nvmlProcessInfo_t)
NO_PROCESSES(nvmlDeviceGetMPSComputeRunningProcesses, nvmlProcessInfo_v1_t)
NO_PROCESSES(nvmlDeviceGetMPSComputeRunningProcesses_v2, nvmlProcessInfo_t)
NO_PROCESSES(nvmlDeviceGetMPSComputeRunningProcesses_v3, nvmlProcessInfo_t)

/* All processes of one kind (mode) in one versioned struct; compute processes are
 * the only kind here. The count rules are those of the list calls above. */
NVML_API nvmlReturn_t nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t device, nvmlProcessDetailList_v1_t *plist) {
    DEV(device, g, idx);
    (void)g;
    if (!plist) return NVML_ERROR_INVALID_ARGUMENT;
    if (plist->version != nvmlProcessDetailList_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (plist->mode > NVML_PROCESS_MODE_ALL) return NVML_ERROR_INVALID_ARGUMENT;
    static proc_mem_t buf[SIMGPU_MAX_PROCS];
    static pthread_mutex_t buf_lock = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&buf_lock);
    unsigned int found = 0;
    if (plist->mode == NVML_PROCESS_MODE_COMPUTE || plist->mode == NVML_PROCESS_MODE_ALL)
        found = collect_procs(node_if_init(), idx, buf);
    nvmlReturn_t r = NVML_SUCCESS;
    if (plist->numProcArrayEntries < found || (found && !plist->procArray)) {
        r = NVML_ERROR_INSUFFICIENT_SIZE;
    } else {
        for (unsigned int i = 0; i < found; i++)
            plist->procArray[i] = (nvmlProcessDetail_v1_t){buf[i].pid, buf[i].used, NVML_VALUE_NOT_AVAILABLE_UINT,
                                                            NVML_VALUE_NOT_AVAILABLE_UINT, 0};
    }
    plist->numProcArrayEntries = found;
    pthread_mutex_unlock(&buf_lock);
    return r;
}

/* BAR1, the PCIe aperture through which the host maps device memory. Data-center
 * parts size it at the power of two at or above their memory (H100 80 GB and
 * A100 80 GB: 128 GiB, A100 40 GB: 64 GiB, L4: 32 GiB). Used: an estimate of what
 * the driver maps, 1 MiB for the device plus 2 MiB per process with a context on it. */
#define SIM_BAR1_BASE (1ull << 20)
#define SIM_BAR1_PER_PROC (2ull << 20)
NVML_API nvmlReturn_t nvmlDeviceGetBAR1MemoryInfo(nvmlDevice_t device, nvmlBAR1Memory_t *bar1Memory) {
    DEV(device, g, idx);
    if (!bar1Memory) return NVML_ERROR_INVALID_ARGUMENT;
    simgpu_node_t *n = node_if_init();
    sim_reap_dead(n);
    uint64_t total = 1;
    while (total < g->total_bytes && total < (1ull << 62)) total <<= 1;
    uint64_t used = SIM_BAR1_BASE;
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++) {
        int32_t pid;
        if (slot_on(&n->procs[i], idx, &pid)) used += SIM_BAR1_PER_PROC;
    }
    if (used > total) used = total;
    *bar1Memory = (nvmlBAR1Memory_t){total, total - used, used};
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------ events */

static nvmlReturn_t set_check(nvmlEventSet_t set) {
    if (!node_if_init()) return NVML_ERROR_UNINITIALIZED;
    if (!set || set->magic != EVENT_SET_MAGIC) return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    if (!node_if_init()) return NVML_ERROR_UNINITIALIZED;
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    struct nvmlEventSet_st *s = calloc(1, sizeof *s);
    if (!s) return NVML_ERROR_MEMORY;
    s->magic = EVENT_SET_MAGIC;
    *set = s;
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    nvmlReturn_t r = set_check(set);
    if (r != NVML_SUCCESS) return r;
    set->magic = 0;
    free(set);
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes) {
    DEV(device, g, idx);
    (void)g;
    (void)idx;
    if (!eventTypes) return NVML_ERROR_INVALID_ARGUMENT;
    *eventTypes = SIM_SUPPORTED_EVENTS;
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                               nvmlEventSet_t set) {
    DEV(device, g, idx);
    nvmlReturn_t r = set_check(set);
    if (r != NVML_SUCCESS) return r;
    if (eventTypes & ~SIM_SUPPORTED_EVENTS) return NVML_ERROR_NOT_SUPPORTED;
    sim_reg_t *reg = NULL;
    for (int i = 0; i < set->nregs; i++)
        if (set->regs[i].gpu == idx) reg = &set->regs[i];
    if (!reg) {
        reg = &set->regs[set->nregs++];
        reg->gpu = idx;
        reg->seen = atomic_load(&g->event_seq); /* only events from now on */
        reg->lost_reported = 0;
    }
    reg->mask |= eventTypes;
    return NVML_SUCCESS;
}

/* Next pending event of a registration that matches its mask; 1 if one was found. */
static int next_event(simgpu_gpu_t *g, sim_reg_t *reg, simgpu_event_t *out) {
    for (;;) {
        uint64_t last = atomic_load(&g->event_seq);
        if (reg->seen >= last) return 0;
        if (last - reg->seen > SIMGPU_EVENT_RING) reg->seen = last - SIMGPU_EVENT_RING; /* overrun: skip lost */
        uint64_t want = reg->seen + 1;
        simgpu_event_t *e = &g->events[(want - 1) % SIMGPU_EVENT_RING];
        if (__atomic_load_n(&e->seq, __ATOMIC_ACQUIRE) != want) return 0; /* writer not done yet */
        simgpu_event_t copy = {want, e->type, e->data, e->time_us};
        if (__atomic_load_n(&e->seq, __ATOMIC_ACQUIRE) != want) continue; /* overwritten meanwhile */
        reg->seen = want;
        if (copy.type & reg->mask) {
            *out = copy;
            return 1;
        }
    }
}

NVML_API nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    nvmlReturn_t r = set_check(set);
    if (r != NVML_SUCCESS) return r;
    if (!data) return NVML_ERROR_INVALID_ARGUMENT;
    simgpu_node_t *n = node_if_init();
    uint64_t deadline = sim_now_ns() + (uint64_t)timeoutms * 1000000ull;
    for (;;) {
        /* Loaded before the scan: an event posted after it changes the word, so the
         * futex wait below returns at once instead of sleeping through it. */
        uint32_t seen = atomic_load(&n->event_wake);
        for (int i = 0; i < set->nregs; i++) {
            sim_reg_t *reg = &set->regs[i];
            simgpu_gpu_t *g = &n->gpus[reg->gpu];
            simgpu_event_t e;
            if (next_event(g, reg, &e)) {
                data->device = &g_dev[reg->gpu];
                data->eventType = e.type;
                data->eventData = e.data;
                data->gpuInstanceId = data->computeInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT;
                return NVML_SUCCESS;
            }
            /* After its events, a GPU that fell off the bus says so once per loss. */
            if (atomic_load(&g->lost)) {
                if (!reg->lost_reported) {
                    reg->lost_reported = 1;
                    return NVML_ERROR_GPU_IS_LOST;
                }
            } else {
                reg->lost_reported = 0;
            }
        }
        uint64_t now = sim_now_ns();
        if (now >= deadline) return NVML_ERROR_TIMEOUT;
        /* Block like the real driver does. Loss is a plain flag nobody wakes us for,
         * and a poster killed between its event and its wake leaves the word as is:
         * look again at least every 50 ms for those. */
        uint64_t left = deadline - now;
        sim_event_sleep(n, seen, left < 50000000ull ? left : 50000000ull);
    }
}

NVML_API nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    return nvmlEventSetWait_v2(set, data, timeoutms);
}

/* ------------------------------------------------------------------ test hooks */

/* Fault injection from the test side (gpufrac/simgpu/faults.py): post an event to
 * a GPU's ring of a node-state file the caller has mapped. Goes through the same
 * atomic sequence as the fake drivers so concurrent posters never collide. Not
 * part of NVML (no nvml prefix). */
NVML_API int simgpu_post_event(void *node, unsigned int gpu, unsigned long long type, unsigned long long data) {
    simgpu_node_t *n = node;
    if (!n || n->magic != SIMGPU_MAGIC || gpu >= n->gpu_count) return -1;
    sim_post_event(n, gpu, type, data);
    return 0;
}
