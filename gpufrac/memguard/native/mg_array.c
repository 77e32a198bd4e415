/*
 * memguard: CUDA arrays and mipmapped arrays, counted at the size their
 * descriptor gives (never under).
 */
#include "mg_internal.h"

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

FREE_HOOK(cuArrayDestroy, g_arrays, (uintptr_t)hArray, 0, (CUarray hArray), hArray)
FREE_HOOK(cuMipmappedArrayDestroy, g_arrays, (uintptr_t)hArray, 0, (CUmipmappedArray hArray), hArray)

MG_SYMBOLS_ARRAY(MG_XALIAS)
