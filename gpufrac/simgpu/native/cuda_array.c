/*
 * simgpu fake libcuda.so.1 — CUDA arrays and mipmapped arrays: created in a
 * context, charged to its GPU like any device allocation (cuda_mem.c), released
 * by their destroy call or with their context.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "cuda_internal.h"

/* ------------------------------------------------------------------ arrays */

struct CUarray_st {
    cu_obj_t hdr;
    void *mem;
    size_t size;
    uint32_t gpu;
    CUDA_ARRAY3D_DESCRIPTOR desc;
};

static size_t format_bytes(int format) {
    switch (format) {
    case 0x01: case 0x08: return 1; /* (UN)SIGNED_INT8 */
    case 0x02: case 0x09: case 0x10: return 2; /* (UN)SIGNED_INT16, HALF */
    case 0x03: case 0x0a: case 0x20: return 4; /* (UN)SIGNED_INT32, FLOAT */
    default: return 0;
    }
}

static CUresult array_create(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d) {
    struct CUctx_st *c;
    CUresult r = cu_need_ctx(&c);
    if (r) return r;
    size_t elem = format_bytes(d->Format);
    if (!pHandle || !elem || !d->Width || (d->NumChannels != 1 && d->NumChannels != 2 && d->NumChannels != 4))
        return CUDA_ERROR_INVALID_VALUE;
    size_t h = d->Height ? d->Height : 1, z = d->Depth ? d->Depth : 1, row = d->Width * elem * d->NumChannels;
    if (row / d->Width != elem * d->NumChannels || h > SIZE_MAX / row || z > SIZE_MAX / (row * h))
        return CUDA_ERROR_INVALID_VALUE;
    size_t size = cu_round_up(row * h * z, 512);
    struct CUarray_st *arr = calloc(1, sizeof *arr);
    if (!arr) return CUDA_ERROR_OUT_OF_MEMORY;
    if ((r = cu_charge(c->gpu, size))) {
        free(arr);
        return r;
    }
    arr->mem = cu_map_anon(size, PROT_READ | PROT_WRITE);
    if (!arr->mem) {
        cu_uncharge(c->gpu, size);
        free(arr);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    arr->size = size, arr->gpu = c->gpu, arr->desc = *d;
    cu_obj_add(arr, OBJ_ARRAY, c);
    *pHandle = arr;
    return CUDA_SUCCESS;
}

/* Mipmapped arrays: level l is max(1, dim >> l) in each dimension; every level is
 * laid out like an array of its own (512-byte aligned). The chain is charged as one.
 * A layered or cubemap array's Depth counts layers (faces): every level keeps them
 * all, and only width and height bound the number of levels. */
#define ARRAY3D_LAYERED 0x01
#define ARRAY3D_CUBEMAP 0x04
struct CUmipmappedArray_st {
    cu_obj_t hdr;
    void *mem;
    size_t size;
    uint32_t gpu;
    unsigned int levels;
    CUDA_ARRAY3D_DESCRIPTOR desc;
};

static size_t mip_dim(size_t v, unsigned int l) { return v ? (v >> l ? v >> l : 1) : 0; }

CU_API CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                       unsigned int numMipmapLevels) {
    CU_ENTER();
    struct CUctx_st *c;
    CUresult r = cu_need_ctx(&c);
    if (r) return r;
    if (!pHandle || !d) return CUDA_ERROR_INVALID_VALUE;
    size_t elem = format_bytes(d->Format);
    if (!elem || !d->Width || (d->NumChannels != 1 && d->NumChannels != 2 && d->NumChannels != 4))
        return CUDA_ERROR_INVALID_VALUE;
    int layers = (d->Flags & (ARRAY3D_LAYERED | ARRAY3D_CUBEMAP)) != 0;
    size_t biggest = d->Width > d->Height ? d->Width : d->Height;
    if (!layers && d->Depth > biggest) biggest = d->Depth;
    unsigned int max_levels = 1;
    while (biggest >> max_levels) max_levels++;
    if (numMipmapLevels == 0 || numMipmapLevels > max_levels) return CUDA_ERROR_INVALID_VALUE;
    size_t size = 0;
    for (unsigned int l = 0; l < numMipmapLevels; l++) {
        size_t w = mip_dim(d->Width, l), h = d->Height ? mip_dim(d->Height, l) : 1, z = d->Depth ? (layers ? d->Depth : mip_dim(d->Depth, l)) : 1;
        size_t row = w * elem * d->NumChannels;
        if (row / w != elem * d->NumChannels || h > SIZE_MAX / row || z > SIZE_MAX / (row * h))
            return CUDA_ERROR_INVALID_VALUE;
        size_t lv = cu_round_up(row * h * z, 512);
        if (size + lv < size) return CUDA_ERROR_INVALID_VALUE;
        size += lv;
    }
    struct CUmipmappedArray_st *m = calloc(1, sizeof *m);
    if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
    if ((r = cu_charge(c->gpu, size))) {
        free(m);
        return r;
    }
    m->mem = cu_map_anon(size, PROT_READ | PROT_WRITE);
    if (!m->mem) {
        cu_uncharge(c->gpu, size);
        free(m);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    m->size = size, m->gpu = c->gpu, m->levels = numMipmapLevels, m->desc = *d;
    cu_obj_add(m, OBJ_MIPMAP, c);
    *pHandle = m;
    return CUDA_SUCCESS;
}

void cu_mipmap_release(struct CUmipmappedArray_st *m) {
    if (!cu_obj_del(m, OBJ_MIPMAP)) return;
    cu_unmap(m->mem, m->size);
    cu_uncharge(m->gpu, m->size);
    free(m);
}

CU_API CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray) {
    CU_ENTER();
    if (!cu_obj_ok(hMipmappedArray, OBJ_MIPMAP)) return CUDA_ERROR_INVALID_HANDLE;
    cu_mipmap_release(hMipmappedArray);
    return CUDA_SUCCESS;
}

void cu_array_release(struct CUarray_st *a) {
    if (!cu_obj_del(a, OBJ_ARRAY)) return;
    cu_unmap(a->mem, a->size);
    cu_uncharge(a->gpu, a->size);
    free(a);
}

CU_API CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *pAllocateArray) {
    CU_ENTER();
    if (!pAllocateArray) return CUDA_ERROR_INVALID_VALUE;
    CUDA_ARRAY3D_DESCRIPTOR d = {pAllocateArray->Width, pAllocateArray->Height, 0, pAllocateArray->Format,
                                 pAllocateArray->NumChannels, 0};
    return array_create(pHandle, &d);
}

CU_API CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pAllocateArray) {
    CU_ENTER();
    if (!pAllocateArray) return CUDA_ERROR_INVALID_VALUE;
    return array_create(pHandle, pAllocateArray);
}

CU_API CUresult cuArrayDestroy(CUarray hArray) {
    CU_ENTER();
    if (!cu_obj_ok(hArray, OBJ_ARRAY)) return CUDA_ERROR_INVALID_HANDLE;
    cu_array_release(hArray);
    return CUDA_SUCCESS;
}

CU_API CUresult cuArrayGetDescriptor_v2(CUDA_ARRAY_DESCRIPTOR *pArrayDescriptor, CUarray hArray) {
    CU_ENTER();
    if (!pArrayDescriptor) return CUDA_ERROR_INVALID_VALUE;
    if (!cu_obj_ok(hArray, OBJ_ARRAY)) return CUDA_ERROR_INVALID_HANDLE;
    *pArrayDescriptor = (CUDA_ARRAY_DESCRIPTOR){hArray->desc.Width, hArray->desc.Height, hArray->desc.Format,
                                                hArray->desc.NumChannels};
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ symbols */

const cu_sym_t cu_syms_array[] = {
    CU_SYM("cuArrayCreate", 3020, cuArrayCreate_v2),
    CU_SYM("cuArray3DCreate", 3020, cuArray3DCreate_v2),
    CU_SYM("cuArrayDestroy", 2000, cuArrayDestroy),
    CU_SYM("cuArrayGetDescriptor", 3020, cuArrayGetDescriptor_v2),
    CU_SYM("cuMipmappedArrayCreate", 5000, cuMipmappedArrayCreate),
    CU_SYM("cuMipmappedArrayDestroy", 5000, cuMipmappedArrayDestroy),
};
const size_t cu_syms_array_n = sizeof cu_syms_array / sizeof cu_syms_array[0];
