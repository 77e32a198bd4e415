/*
 * simgpu fake libcuda.so.1 — memcpy and memset, synchronous and stream-ordered,
 * with the per-thread-default-stream twins (_ptds / _ptsz) that real libcuda
 * exports. Copies move real bytes at call time; a device-side pointer must lie in
 * a live allocation the device may access (for VMM memory: mapped, with access
 * set), otherwise CUDA_ERROR_INVALID_VALUE, as the real driver answers.
 */
#include <string.h>

#include "cuda_internal.h"

enum { SIDE_HOST = 0, SIDE_DEVICE = 1, SIDE_ANY = 2 };

/* A host pointer cannot be checked beyond NULL; an address inside a VMM
 * reservation is device memory even when nothing is mapped there. */
static int side_ok(uintptr_t p, size_t n, int side, int write) {
    if (!p) return 0;
    if (side == SIDE_DEVICE) return cu_dev_range_ok(p, n, write);
    cu_alloc_t a;
    if (cu_reg_find(p, &a) == 0) { /* pinned host and managed memory are host memory too */
        int hostlike = a.kind == MEM_HOST || a.kind == MEM_MANAGED;
        return (side == SIDE_ANY || hostlike) && cu_dev_range_ok(p, n, write);
    }
    return !cu_vmm_reserved(p);
}

/* Order after earlier work: a synchronous copy waits for the null stream; an
 * async one may not be captured (graphs here hold kernels only). */
static CUresult order(CUstream h, int async) {
    CU_STREAM(async ? h : NULL, c, s);
    if (c->sticky) return c->sticky;
    if (s->capture) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    if (!async) cu_ctx_wait(c, atomic_load(&s->done_ctx));
    return CUDA_SUCCESS;
}

static CUresult copy(uintptr_t dst, int dside, uintptr_t src, int sside, size_t n, CUstream h, int async) {
    CUresult r = order(h, async);
    if (r) return r;
    if (n == 0) return CUDA_SUCCESS;
    if (!side_ok(dst, n, dside, 1) || !side_ok(src, n, sside, 0)) return CUDA_ERROR_INVALID_VALUE;
    memmove((void *)dst, (const void *)src, n);
    return CUDA_SUCCESS;
}

static CUresult set(CUdeviceptr dst, uint32_t value, size_t width, size_t count, CUstream h, int async) {
    CUresult r = order(h, async);
    if (r) return r;
    if (count == 0) return CUDA_SUCCESS;
    if (dst % width || count > SIZE_MAX / width || !cu_dev_range_ok((uintptr_t)dst, count * width, 1))
        return CUDA_ERROR_INVALID_VALUE;
    if (width == 1) {
        memset((void *)(uintptr_t)dst, (int)(value & 0xff), count);
    } else if (width == 2) {
        uint16_t *p = (uint16_t *)(uintptr_t)dst;
        for (size_t i = 0; i < count; i++) p[i] = (uint16_t)value;
    } else {
        uint32_t *p = (uint32_t *)(uintptr_t)dst;
        for (size_t i = 0; i < count; i++) p[i] = value;
    }
    return CUDA_SUCCESS;
}

#define U(p) ((uintptr_t)(p))

CU_API CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount) {
    CU_ENTER();
    return copy(U(dst), SIDE_ANY, U(src), SIDE_ANY, ByteCount, NULL, 0);
}
CU_API CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount) {
    CU_ENTER();
    return copy(U(dstDevice), SIDE_DEVICE, U(srcHost), SIDE_HOST, ByteCount, NULL, 0);
}
CU_API CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
    CU_ENTER();
    return copy(U(dstHost), SIDE_HOST, U(srcDevice), SIDE_DEVICE, ByteCount, NULL, 0);
}
CU_API CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount) {
    CU_ENTER();
    return copy(U(dstDevice), SIDE_DEVICE, U(srcDevice), SIDE_DEVICE, ByteCount, NULL, 0);
}
CU_API CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream) {
    CU_ENTER();
    return copy(U(dst), SIDE_ANY, U(src), SIDE_ANY, ByteCount, hStream, 1);
}
CU_API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                     CUstream hStream) {
    CU_ENTER();
    return copy(U(dstDevice), SIDE_DEVICE, U(srcHost), SIDE_HOST, ByteCount, hStream, 1);
}
CU_API CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream) {
    CU_ENTER();
    return copy(U(dstHost), SIDE_HOST, U(srcDevice), SIDE_DEVICE, ByteCount, hStream, 1);
}
CU_API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                                     CUstream hStream) {
    CU_ENTER();
    return copy(U(dstDevice), SIDE_DEVICE, U(srcDevice), SIDE_DEVICE, ByteCount, hStream, 1);
}

CU_API CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N) {
    CU_ENTER();
    return set(dstDevice, uc, 1, N, NULL, 0);
}
CU_API CUresult cuMemsetD16_v2(CUdeviceptr dstDevice, unsigned short us, size_t N) {
    CU_ENTER();
    return set(dstDevice, us, 2, N, NULL, 0);
}
CU_API CUresult cuMemsetD32_v2(CUdeviceptr dstDevice, unsigned int ui, size_t N) {
    CU_ENTER();
    return set(dstDevice, ui, 4, N, NULL, 0);
}
CU_API CUresult cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream) {
    CU_ENTER();
    return set(dstDevice, uc, 1, N, hStream, 1);
}
CU_API CUresult cuMemsetD16Async(CUdeviceptr dstDevice, unsigned short us, size_t N, CUstream hStream) {
    CU_ENTER();
    return set(dstDevice, us, 2, N, hStream, 1);
}
CU_API CUresult cuMemsetD32Async(CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream) {
    CU_ENTER();
    return set(dstDevice, ui, 4, N, hStream, 1);
}

/* Per-thread default stream twins (see CU_TWIN). */
CU_TWIN(cuMemcpy_ptds, cuMemcpy, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n))
CU_TWIN(cuMemcpyHtoD_v2_ptds, cuMemcpyHtoD_v2, (CUdeviceptr d, const void *s, size_t n), (d, s, n))
CU_TWIN(cuMemcpyDtoH_v2_ptds, cuMemcpyDtoH_v2, (void *d, CUdeviceptr s, size_t n), (d, s, n))
CU_TWIN(cuMemcpyDtoD_v2_ptds, cuMemcpyDtoD_v2, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n))
CU_TWIN(cuMemcpyAsync_ptsz, cuMemcpyAsync, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream h), (d, s, n, h))
CU_TWIN(cuMemcpyHtoDAsync_v2_ptsz, cuMemcpyHtoDAsync_v2, (CUdeviceptr d, const void *s, size_t n, CUstream h),
        (d, s, n, h))
CU_TWIN(cuMemcpyDtoHAsync_v2_ptsz, cuMemcpyDtoHAsync_v2, (void *d, CUdeviceptr s, size_t n, CUstream h), (d, s, n, h))
CU_TWIN(cuMemcpyDtoDAsync_v2_ptsz, cuMemcpyDtoDAsync_v2, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream h),
        (d, s, n, h))
CU_TWIN(cuMemsetD8_v2_ptds, cuMemsetD8_v2, (CUdeviceptr d, unsigned char v, size_t n), (d, v, n))
CU_TWIN(cuMemsetD16_v2_ptds, cuMemsetD16_v2, (CUdeviceptr d, unsigned short v, size_t n), (d, v, n))
CU_TWIN(cuMemsetD32_v2_ptds, cuMemsetD32_v2, (CUdeviceptr d, unsigned int v, size_t n), (d, v, n))
CU_TWIN(cuMemsetD8Async_ptsz, cuMemsetD8Async, (CUdeviceptr d, unsigned char v, size_t n, CUstream h), (d, v, n, h))
CU_TWIN(cuMemsetD16Async_ptsz, cuMemsetD16Async, (CUdeviceptr d, unsigned short v, size_t n, CUstream h),
        (d, v, n, h))
CU_TWIN(cuMemsetD32Async_ptsz, cuMemsetD32Async, (CUdeviceptr d, unsigned int v, size_t n, CUstream h), (d, v, n, h))

const cu_sym_t cu_syms_copy[] = {
    CU_SYM("cuMemcpy", 4000, cuMemcpy),
    CU_SYM_PT("cuMemcpy", 4000, cuMemcpy_ptds),
    CU_SYM("cuMemcpyHtoD", 3020, cuMemcpyHtoD_v2),
    CU_SYM_PT("cuMemcpyHtoD", 3020, cuMemcpyHtoD_v2_ptds),
    CU_SYM("cuMemcpyDtoH", 3020, cuMemcpyDtoH_v2),
    CU_SYM_PT("cuMemcpyDtoH", 3020, cuMemcpyDtoH_v2_ptds),
    CU_SYM("cuMemcpyDtoD", 3020, cuMemcpyDtoD_v2),
    CU_SYM_PT("cuMemcpyDtoD", 3020, cuMemcpyDtoD_v2_ptds),
    CU_SYM("cuMemcpyAsync", 4000, cuMemcpyAsync),
    CU_SYM_PT("cuMemcpyAsync", 4000, cuMemcpyAsync_ptsz),
    CU_SYM("cuMemcpyHtoDAsync", 3020, cuMemcpyHtoDAsync_v2),
    CU_SYM_PT("cuMemcpyHtoDAsync", 3020, cuMemcpyHtoDAsync_v2_ptsz),
    CU_SYM("cuMemcpyDtoHAsync", 3020, cuMemcpyDtoHAsync_v2),
    CU_SYM_PT("cuMemcpyDtoHAsync", 3020, cuMemcpyDtoHAsync_v2_ptsz),
    CU_SYM("cuMemcpyDtoDAsync", 3020, cuMemcpyDtoDAsync_v2),
    CU_SYM_PT("cuMemcpyDtoDAsync", 3020, cuMemcpyDtoDAsync_v2_ptsz),
    CU_SYM("cuMemsetD8", 3020, cuMemsetD8_v2),
    CU_SYM_PT("cuMemsetD8", 3020, cuMemsetD8_v2_ptds),
    CU_SYM("cuMemsetD16", 3020, cuMemsetD16_v2),
    CU_SYM_PT("cuMemsetD16", 3020, cuMemsetD16_v2_ptds),
    CU_SYM("cuMemsetD32", 3020, cuMemsetD32_v2),
    CU_SYM_PT("cuMemsetD32", 3020, cuMemsetD32_v2_ptds),
    CU_SYM("cuMemsetD8Async", 3020, cuMemsetD8Async),
    CU_SYM_PT("cuMemsetD8Async", 3020, cuMemsetD8Async_ptsz),
    CU_SYM("cuMemsetD16Async", 3020, cuMemsetD16Async),
    CU_SYM_PT("cuMemsetD16Async", 3020, cuMemsetD16Async_ptsz),
    CU_SYM("cuMemsetD32Async", 3020, cuMemsetD32Async),
    CU_SYM_PT("cuMemsetD32Async", 3020, cuMemsetD32Async_ptsz),
};
const size_t cu_syms_copy_n = sizeof cu_syms_copy / sizeof cu_syms_copy[0];
