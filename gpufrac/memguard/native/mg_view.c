/*
 * memguard: memory queries (cuMemGetInfo, cuDeviceTotalMem, NVML's memory
 * info): the container's view, total = its limit, free = limit - its usage.
 */
#include <limits.h>

#include "mg_internal.h"

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

/* --- memory queries: total = limit, free = limit - container usage --- */

/* The legacy entry points report 32 bits, saturated as the driver does. */
static inline unsigned int mg_u32(uint64_t v) { return v > UINT_MAX ? UINT_MAX : (unsigned int)v; }

HOOK CUresult mg_h_cuMemGetInfo_v2(size_t *free_, size_t *total) {
    mg_swap_gate(); /* the driver answers a locked process's query only once it is restored */
    CUresult rc = CALL_REAL(cuMemGetInfo_v2, free_, total);
    uint64_t vf, vt;
    if (rc == CUDA_SUCCESS && free_ && total && mg_view(*free_, *total, &vf, &vt)) {
        *free_ = (size_t)vf;
        *total = (size_t)vt;
    }
    return rc;
}

HOOK CUresult mg_h_cuMemGetInfo(unsigned int *free_, unsigned int *total) {
    mg_swap_gate();
    CUresult rc = CALL_REAL(cuMemGetInfo, free_, total);
    uint64_t vf, vt;
    if (rc == CUDA_SUCCESS && free_ && total && mg_view(*free_, *total, &vf, &vt)) {
        *free_ = mg_u32(vf);
        *total = mg_u32(vt);
    }
    return rc;
}

HOOK CUresult mg_h_cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    mg_swap_gate();
    CUresult rc = CALL_REAL(cuDeviceTotalMem_v2, bytes, dev);
    uint64_t vf, vt;
    if (rc == CUDA_SUCCESS && bytes && mg_view(*bytes, *bytes, &vf, &vt)) *bytes = (size_t)vt;
    return rc;
}

HOOK CUresult mg_h_cuDeviceTotalMem(unsigned int *bytes, CUdevice dev) {
    mg_swap_gate();
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

MG_SYMBOLS_VIEW(MG_XALIAS)
