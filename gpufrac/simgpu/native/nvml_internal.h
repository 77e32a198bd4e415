/*
 * simgpu fake libnvidia-ml.so.1: declarations shared by its source files.
 *
 * NVML's types are declared here (no CUDA toolkit needed to build), with the real
 * signatures' struct layouts, return codes and version words. The state shared
 * between the source files is the device-handle table and the visible-GPU list
 * that nvmlInit fills (nvml.c); everything else is private to one file.
 */
#ifndef GPUFRAC_SIMGPU_NVML_INTERNAL_H
#define GPUFRAC_SIMGPU_NVML_INTERNAL_H

#include <stdatomic.h>
#include <stdint.h>

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

/* ------------------------------------------------------------------ shared state (nvml.c) */

/* One handle per physical GPU. `index` is the physical index in the node file. */
struct nvmlDevice_st {
    uint32_t index;
};
extern SIM_HIDDEN struct nvmlDevice_st nv_dev[SIMGPU_MAX_GPUS];
extern SIM_HIDDEN uint32_t nv_visible[SIMGPU_MAX_GPUS]; /* visible index -> physical index */
extern SIM_HIDDEN _Atomic int nv_visible_count;

/* The node mapped at the last nvmlInit, or NULL when NVML is not initialised. */
SIM_HIDDEN simgpu_node_t *nv_node_if_init(void);

/* Validate init state and a device handle; on success *g is the GPU and *idx its
 * physical index. Lost GPUs answer GPU_IS_LOST unless allow_lost. */
SIM_HIDDEN nvmlReturn_t nv_dev_get(nvmlDevice_t d, simgpu_gpu_t **g, uint32_t *idx, int allow_lost);

#define DEV(h, g, idx)                                        \
    simgpu_gpu_t *g;                                          \
    uint32_t idx;                                             \
    do {                                                      \
        nvmlReturn_t _r = nv_dev_get((h), &g, &idx, 0);       \
        if (_r != NVML_SUCCESS) return _r;                    \
    } while (0)

#endif
