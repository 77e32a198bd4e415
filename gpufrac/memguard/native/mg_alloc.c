/*
 * memguard: the allocation hooks of plain device memory (cuMemAlloc,
 * cuMemAllocManaged, cuMemAllocPitch, legacy and _v2) and every free of a
 * device pointer (cuMemFree, cuMemFreeAsync: a pool allocation freed either
 * way goes back to its pool's count, mg_pool.c). ALLOC_HOOK and FREE_HOOK
 * (mg_internal.h) are the shape of each.
 */
#include "mg_internal.h"

/* --- allocation --- */

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

/* --- frees --- */

FREE_HOOK(cuMemFree_v2, g_ptrs, dptr, 0, (CUdeviceptr dptr), dptr)
FREE_HOOK(cuMemFree, g_ptrs, dptr, 0, (CUdeviceptr_v1 dptr), dptr)
FREE_HOOK(cuMemFreeAsync, g_ptrs, dptr, 1, (CUdeviceptr dptr, CUstream hStream), dptr, hStream)
FREE_HOOK(cuMemFreeAsync_ptsz, g_ptrs, dptr, 1, (CUdeviceptr dptr, CUstream hStream), dptr, hStream)

static CUresult mg_free_v1_adapter(CUdeviceptr p) {
    __typeof__(&mg_h_cuMemFree) f = REAL(cuMemFree);
    return f ? f((CUdeviceptr_v1)p) : CUDA_ERROR_NOT_FOUND;
}

MG_SYMBOLS_ALLOC(MG_XALIAS)
