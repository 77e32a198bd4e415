/*
 * simgpu fake libnvidia-ml.so.1: NVML over the simulated node-state file.
 *
 * Loaded by the real nvidia-ml-py (CDLL("libnvidia-ml.so.1") through
 * LD_LIBRARY_PATH). Every exported function has NVML's real signature, struct
 * layout, return codes and buffer-size rules, so code that works here works on a
 * real node. The types are declared in nvml_internal.h (no CUDA toolkit needed).
 *
 * Device handles point into a static table, one entry per physical GPU; only
 * GPUs visible after NVIDIA_VISIBLE_DEVICES (what the container runtime would
 * expose) are handed out, and indices are positions in that visible list.
 *
 * Split by area like the fake libcuda: this file (init, system, handles,
 * identity), nvml_device.c (memory, PCI, affinity, topology, NVLink),
 * nvml_proc.c (utilisation, processes), nvml_event.c (event sets, test hook).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "nvml_internal.h"

/* ------------------------------------------------------------------ state */

SIM_HIDDEN struct nvmlDevice_st nv_dev[SIMGPU_MAX_GPUS];

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_init_count;                    /* guarded by g_lock */
static simgpu_node_t *_Atomic g_n;          /* node mapped at the last nvmlInit */
SIM_HIDDEN uint32_t nv_visible[SIMGPU_MAX_GPUS];
SIM_HIDDEN _Atomic int nv_visible_count;

SIM_HIDDEN simgpu_node_t *nv_node_if_init(void) {
    return atomic_load(&g_n);
}

static int visible_pos(uint32_t phys) {
    int count = atomic_load(&nv_visible_count);
    for (int i = 0; i < count; i++)
        if (nv_visible[i] == phys) return i;
    return -1;
}

SIM_HIDDEN nvmlReturn_t nv_dev_get(nvmlDevice_t d, simgpu_gpu_t **g, uint32_t *idx, int allow_lost) {
    simgpu_node_t *n = nv_node_if_init();
    if (!n) return NVML_ERROR_UNINITIALIZED;
    uintptr_t p = (uintptr_t)d, base = (uintptr_t)nv_dev;
    if (p < base || p >= base + sizeof nv_dev || (p - base) % sizeof nv_dev[0] != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    uint32_t i = d->index;
    if (i >= n->gpu_count || visible_pos(i) < 0) return NVML_ERROR_INVALID_ARGUMENT;
    if (!allow_lost && atomic_load(&n->gpus[i].lost)) return NVML_ERROR_GPU_IS_LOST;
    *g = &n->gpus[i];
    *idx = i;
    return NVML_SUCCESS;
}
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
    for (uint32_t i = 0; i < SIMGPU_MAX_GPUS; i++) nv_dev[i].index = i;
    uint32_t vis[SIMGPU_MAX_GPUS];
    int count = sim_visible_gpus(n, 0, vis);
    memcpy(nv_visible, vis, sizeof(uint32_t) * (size_t)count);
    atomic_store(&nv_visible_count, count);
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
    simgpu_node_t *n = nv_node_if_init();
    if (!n) return NVML_ERROR_UNINITIALIZED;
    return copy_str(version, length, n->driver_version);
}

NVML_API nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    simgpu_node_t *n = nv_node_if_init();
    if (!n) return NVML_ERROR_UNINITIALIZED;
    return copy_str(version, length, n->nvml_version);
}

NVML_API nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion) {
    simgpu_node_t *n = nv_node_if_init();
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
    if (!nv_node_if_init()) return NVML_ERROR_UNINITIALIZED;
    if (!deviceCount) return NVML_ERROR_INVALID_ARGUMENT;
    *deviceCount = (unsigned int)atomic_load(&nv_visible_count);
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount) {
    return nvmlDeviceGetCount_v2(deviceCount);
}

static nvmlReturn_t hand_out(simgpu_node_t *n, uint32_t phys, nvmlDevice_t *device) {
    if (atomic_load(&n->gpus[phys].lost)) return NVML_ERROR_GPU_IS_LOST;
    *device = &nv_dev[phys];
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    simgpu_node_t *n = nv_node_if_init();
    if (!n) return NVML_ERROR_UNINITIALIZED;
    if (!device || index >= (unsigned int)atomic_load(&nv_visible_count)) return NVML_ERROR_INVALID_ARGUMENT;
    return hand_out(n, nv_visible[index], device);
}

NVML_API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

NVML_API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    simgpu_node_t *n = nv_node_if_init();
    if (!n) return NVML_ERROR_UNINITIALIZED;
    if (!uuid || !device) return NVML_ERROR_INVALID_ARGUMENT;
    int count = atomic_load(&nv_visible_count);
    for (int i = 0; i < count; i++)
        if (strcmp(n->gpus[nv_visible[i]].uuid, uuid) == 0) return hand_out(n, nv_visible[i], device);
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
    simgpu_node_t *n = nv_node_if_init();
    if (!n) return NVML_ERROR_UNINITIALIZED;
    unsigned dom, bus, dev;
    if (!pciBusId || !device || !parse_bus_id(pciBusId, &dom, &bus, &dev)) return NVML_ERROR_INVALID_ARGUMENT;
    int count = atomic_load(&nv_visible_count);
    for (int i = 0; i < count; i++) {
        const simgpu_gpu_t *g = &n->gpus[nv_visible[i]];
        if (g->pci_domain == dom && g->pci_bus == bus && g->pci_device == dev)
            return hand_out(n, nv_visible[i], device);
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
