/*
 * simgpu fake libcuda.so.1 — memory: the allocation registry, charging the
 * simulated GPU, cuMemAlloc/Free, pitch, managed, pinned host memory,
 * cuMemGetInfo, cuMemGetAddressRange and cuPointerGetAttribute(s).
 *
 * Device memory is host memory mapped MAP_NORESERVE (so a simulated 80 GiB GPU
 * costs nothing until touched). Each physical allocation is charged to the GPU's
 * used_bytes with sim_mem_take (physical OOM as on a real GPU) and to this
 * process's proc slot (NVML shows it per PID). Managed memory is charged to the
 * device it was allocated on: the simulation keeps it resident there.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "cuda_internal.h"

/* ------------------------------------------------------------------ charging */

CUresult cu_charge(uint32_t gpu, uint64_t bytes) {
    simgpu_proc_t *s = cu_slot(gpu);
    if (!s) return CUDA_ERROR_OUT_OF_MEMORY; /* process table full */
    if (sim_mem_take(cu_node(), gpu, bytes) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    atomic_fetch_add(&s->used_bytes, bytes);
    return CUDA_SUCCESS;
}

void cu_uncharge(uint32_t gpu, uint64_t bytes) {
    if (!bytes) return;
    simgpu_proc_t *s = cu_slot(gpu);
    if (s) { /* saturating: a slip must never read as a huge usage */
        uint64_t cur = atomic_load(&s->used_bytes);
        while (!atomic_compare_exchange_weak(&s->used_bytes, &cur, cur >= bytes ? cur - bytes : 0)) {
        }
    }
    sim_mem_give(cu_node(), gpu, bytes);
}

void *cu_map_anon(size_t size, int prot) {
    void *p = mmap(NULL, size, prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

void cu_unmap(void *p, size_t size) { munmap(p, size); }

/* ------------------------------------------------------------------ registry */

/* Sorted by base, non-overlapping; binary search under one mutex. */
static pthread_mutex_t g_reg_lock = PTHREAD_MUTEX_INITIALIZER;
static cu_alloc_t *g_reg;
static size_t g_reg_n, g_reg_cap;

static size_t reg_lower(uintptr_t p) { /* first index with base > p */
    size_t lo = 0, hi = g_reg_n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (g_reg[mid].base <= p) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

int cu_reg_insert(const cu_alloc_t *a) {
    pthread_mutex_lock(&g_reg_lock);
    if (g_reg_n == g_reg_cap) {
        size_t cap = g_reg_cap ? g_reg_cap * 2 : 256;
        cu_alloc_t *r = realloc(g_reg, cap * sizeof *r);
        if (!r) {
            pthread_mutex_unlock(&g_reg_lock);
            return -1;
        }
        g_reg = r, g_reg_cap = cap;
    }
    size_t i = reg_lower(a->base);
    memmove(&g_reg[i + 1], &g_reg[i], (g_reg_n - i) * sizeof *g_reg);
    g_reg[i] = *a;
    g_reg_n++;
    pthread_mutex_unlock(&g_reg_lock);
    return 0;
}

int cu_reg_remove(uintptr_t base, cu_alloc_t *out) {
    pthread_mutex_lock(&g_reg_lock);
    size_t i = reg_lower(base);
    int ok = i > 0 && g_reg[i - 1].base == base;
    if (ok) {
        if (out) *out = g_reg[i - 1];
        memmove(&g_reg[i - 1], &g_reg[i], (g_reg_n - i) * sizeof *g_reg);
        g_reg_n--;
    }
    pthread_mutex_unlock(&g_reg_lock);
    return ok ? 0 : -1;
}

static int find_locked(uintptr_t p, cu_alloc_t *out) {
    size_t i = reg_lower(p);
    if (i == 0 || p - g_reg[i - 1].base >= g_reg[i - 1].size) return -1;
    if (out) *out = g_reg[i - 1];
    return (int)(i - 1);
}

int cu_reg_find(uintptr_t p, cu_alloc_t *out) {
    pthread_mutex_lock(&g_reg_lock);
    int i = find_locked(p, out);
    pthread_mutex_unlock(&g_reg_lock);
    return i < 0 ? -1 : 0;
}

int cu_reg_overlaps(uintptr_t p, size_t len) {
    pthread_mutex_lock(&g_reg_lock);
    size_t i = reg_lower(p); /* entries [i-1] may contain p; entries from i start after p */
    int hit = (i > 0 && p - g_reg[i - 1].base < g_reg[i - 1].size) || (i < g_reg_n && g_reg[i].base < p + len);
    pthread_mutex_unlock(&g_reg_lock);
    return hit;
}

int cu_reg_set_access(uintptr_t base, uint8_t access) {
    pthread_mutex_lock(&g_reg_lock);
    size_t i = reg_lower(base);
    int ok = i > 0 && g_reg[i - 1].base == base;
    if (ok) g_reg[i - 1].access = access;
    pthread_mutex_unlock(&g_reg_lock);
    return ok ? 0 : -1;
}

static int accessible(const cu_alloc_t *a, int write) {
    if (a->kind == MEM_ARRAY) return 0;
    if (a->kind != MEM_VMM) return 1;
    return write ? a->access == 3 : a->access != 0;
}

/* A range may run across back-to-back VMM mappings of one reservation. */
int cu_dev_range_ok(uintptr_t p, size_t len, int write) {
    if (!p || p + len < p) return 0;
    pthread_mutex_lock(&g_reg_lock);
    int i = find_locked(p, NULL), ok = i >= 0;
    uintptr_t end = p + len;
    while (ok) {
        const cu_alloc_t *a = &g_reg[i];
        if (!accessible(a, write)) ok = 0;
        else if (end <= a->base + a->size) break;
        else if (a->kind != MEM_VMM || (size_t)i + 1 >= g_reg_n || g_reg[i + 1].base != a->base + a->size) ok = 0;
        else i++;
    }
    pthread_mutex_unlock(&g_reg_lock);
    return ok;
}

/* ------------------------------------------------------------------ alloc / free */

/* low32: the legacy (CUDA < 3.2) ABI has 32-bit device pointers, so such memory
 * must sit below 4 GiB (MAP_32BIT: the first 2 GiB); none left there = OOM. */
static CUresult mem_alloc(CUdeviceptr *dptr, size_t size, uint8_t kind, unsigned int flags, int low32) {
    struct CUctx_st *c;
    CUresult r = cu_need_ctx(&c);
    if (r) return r;
    if (!dptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
    if ((r = cu_charge(c->gpu, size))) return r;
    void *p = cu_map_anon(size, PROT_READ | PROT_WRITE);
    if (low32 && p) {
        cu_unmap(p, size);
        p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_32BIT, -1, 0);
        p = p == MAP_FAILED ? NULL : p;
    }
    cu_alloc_t a = {.base = (uintptr_t)p, .size = size, .charged = size, .gpu = c->gpu, .kind = kind,
                    .ctx = c, .flags = flags};
    if (!p || cu_reg_insert(&a) != 0) {
        if (p) cu_unmap(p, size);
        cu_uncharge(c->gpu, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *dptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

CUresult cu_mem_alloc(CUdeviceptr *dptr, size_t size, uint8_t kind, unsigned int flags) {
    return mem_alloc(dptr, size, kind, flags, 0);
}

/* Give an allocation's memory back (already removed from the registry). */
static void release(const cu_alloc_t *a) {
    cu_unmap((void *)a->base, a->size);
    cu_uncharge(a->gpu, a->charged);
}

CUresult cu_mem_free(CUdeviceptr dptr) {
    cu_alloc_t a;
    if (cu_reg_find((uintptr_t)dptr, &a) != 0 || a.base != (uintptr_t)dptr) return CUDA_ERROR_INVALID_VALUE;
    if (a.kind == MEM_POOL) return cu_pool_free_block(&a);
    if (a.kind == MEM_GRAPH) return CUDA_SUCCESS; /* stays with its executable graph (cuda_graph.c) */
    if (a.kind != MEM_DEVICE && a.kind != MEM_PITCH && a.kind != MEM_MANAGED) return CUDA_ERROR_INVALID_VALUE;
    if (cu_reg_remove(a.base, &a) != 0) return CUDA_ERROR_INVALID_VALUE; /* freed concurrently */
    release(&a);
    return CUDA_SUCCESS;
}

void cu_mem_free_ctx(struct CUctx_st *ctx) {
    for (;;) { /* collect under the lock, release outside it */
        cu_alloc_t batch[64];
        size_t n = 0;
        pthread_mutex_lock(&g_reg_lock);
        for (size_t i = 0; i < g_reg_n && n < 64;) {
            cu_alloc_t *a = &g_reg[i];
            if (a->ctx == ctx && a->kind != MEM_POOL && a->kind != MEM_VMM && a->kind != MEM_GRAPH) {
                batch[n++] = *a;
                memmove(a, a + 1, (g_reg_n - i - 1) * sizeof *a);
                g_reg_n--;
            } else {
                i++;
            }
        }
        pthread_mutex_unlock(&g_reg_lock);
        for (size_t i = 0; i < n; i++) release(&batch[i]);
        if (n < 64) break;
    }
    void *arrays[256];
    size_t n;
    while ((n = cu_obj_owned(OBJ_ARRAY, ctx, arrays, 256)) > 0) {
        for (size_t i = 0; i < n; i++) {
            struct CUarray_st *arr = arrays[i];
            cu_array_release(arr);
        }
    }
    while ((n = cu_obj_owned(OBJ_MIPMAP, ctx, arrays, 256)) > 0)
        for (size_t i = 0; i < n; i++) cu_mipmap_release(arrays[i]);
}

CU_API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    CU_ENTER();
    return cu_mem_alloc(dptr, bytesize, MEM_DEVICE, 0);
}

CU_API CUresult cuMemFree_v2(CUdeviceptr dptr) {
    CU_ENTER();
    return cu_mem_free(dptr);
}

/* Legacy 32-bit entry points, still exported by real libcuda for old binaries. */
CU_API CUresult cuMemAlloc(unsigned int *dptr, unsigned int bytesize) {
    CU_ENTER();
    CUdeviceptr p;
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = mem_alloc(&p, bytesize, MEM_DEVICE, 0, 1);
    if (!r) *dptr = (unsigned int)p;
    return r;
}

CU_API CUresult cuMemFree(unsigned int dptr) {
    CU_ENTER();
    return cu_mem_free(dptr);
}

CU_API CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                   unsigned int ElementSizeBytes) {
    CU_ENTER();
    if (!pPitch || !WidthInBytes || !Height) return CUDA_ERROR_INVALID_VALUE;
    if (ElementSizeBytes != 4 && ElementSizeBytes != 8 && ElementSizeBytes != 16) return CUDA_ERROR_INVALID_VALUE;
    size_t pitch = cu_round_up(WidthInBytes, 512);
    if (Height > SIZE_MAX / pitch) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = cu_mem_alloc(dptr, pitch * Height, MEM_PITCH, 0);
    if (!r) *pPitch = pitch;
    return r;
}

#define CU_MEM_ATTACH_GLOBAL 0x1
#define CU_MEM_ATTACH_HOST 0x2
CU_API CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    CU_ENTER();
    if (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST) return CUDA_ERROR_INVALID_VALUE;
    return cu_mem_alloc(dptr, bytesize, MEM_MANAGED, flags);
}

CU_API CUresult cuMemGetInfo_v2(size_t *free, size_t *total) {
    CU_ENTER();
    struct CUctx_st *c;
    CUresult r = cu_need_ctx(&c);
    if (r) return r;
    if (!free || !total) return CUDA_ERROR_INVALID_VALUE;
    const simgpu_gpu_t *g = &cu_node()->gpus[c->gpu];
    uint64_t used = atomic_load(&g->used_bytes) + g->reserved_bytes;
    *total = g->total_bytes;
    *free = used < g->total_bytes ? g->total_bytes - used : 0;
    return CUDA_SUCCESS;
}

/* 32-bit legacy entry point: clamps. */
CU_API CUresult cuMemGetInfo(unsigned int *free, unsigned int *total) {
    size_t f, t;
    if (!free || !total) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = cuMemGetInfo_v2(&f, &t);
    if (!r) {
        *free = f > 0xffffffffu ? 0xffffffffu : (unsigned int)f;
        *total = t > 0xffffffffu ? 0xffffffffu : (unsigned int)t;
    }
    return r;
}

CU_API CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr) {
    CU_ENTER();
    cu_alloc_t a;
    if (cu_reg_find((uintptr_t)dptr, &a) != 0 || a.kind == MEM_ARRAY) return CUDA_ERROR_NOT_FOUND;
    if (pbase) *pbase = a.base;
    if (psize) *psize = a.size;
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ pinned host memory */

#define CU_MEMHOSTALLOC_ALL 0x7u /* PORTABLE | DEVICEMAP | WRITECOMBINED */

static CUresult host_alloc(void **pp, size_t bytesize, unsigned int flags) {
    struct CUctx_st *c;
    CUresult r = cu_need_ctx(&c);
    if (r) return r;
    if (!pp || !bytesize || (flags & ~CU_MEMHOSTALLOC_ALL)) return CUDA_ERROR_INVALID_VALUE;
    void *p = cu_map_anon(bytesize, PROT_READ | PROT_WRITE);
    cu_alloc_t a = {.base = (uintptr_t)p, .size = bytesize, .gpu = c->gpu, .kind = MEM_HOST, .ctx = c,
                    .flags = flags};
    if (!p || cu_reg_insert(&a) != 0) {
        if (p) cu_unmap(p, bytesize);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *pp = p;
    return CUDA_SUCCESS;
}

CU_API CUresult cuMemAllocHost_v2(void **pp, size_t bytesize) {
    CU_ENTER();
    return host_alloc(pp, bytesize, 0);
}

CU_API CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags) {
    CU_ENTER();
    return host_alloc(pp, bytesize, Flags);
}

CU_API CUresult cuMemFreeHost(void *p) {
    CU_ENTER();
    cu_alloc_t a;
    if (cu_reg_find((uintptr_t)p, &a) != 0 || a.base != (uintptr_t)p || a.kind != MEM_HOST)
        return CUDA_ERROR_INVALID_VALUE;
    if (cu_reg_remove(a.base, &a) != 0) return CUDA_ERROR_INVALID_VALUE;
    release(&a);
    return CUDA_SUCCESS;
}

CU_API CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned int Flags) {
    CU_ENTER();
    cu_alloc_t a;
    if (!pdptr || Flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (cu_reg_find((uintptr_t)p, &a) != 0 || a.kind != MEM_HOST) return CUDA_ERROR_INVALID_VALUE;
    *pdptr = (CUdeviceptr)(uintptr_t)p; /* unified addressing: the same address */
    return CUDA_SUCCESS;
}

CU_API CUresult cuMemHostGetFlags(unsigned int *pFlags, void *p) {
    CU_ENTER();
    cu_alloc_t a;
    if (!pFlags) return CUDA_ERROR_INVALID_VALUE;
    if (cu_reg_find((uintptr_t)p, &a) != 0 || a.kind != MEM_HOST) return CUDA_ERROR_INVALID_VALUE;
    *pFlags = a.flags;
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ pointer attributes */

/* One attribute of an allocation (`a`), or of a pointer nobody allocated (`a` NULL: the
 * defaults cuPointerGetAttributes gives, zeroes of the attribute's size). */
static CUresult pointer_attr(const cu_alloc_t *a, CUdeviceptr ptr, int attribute, void *data) {
    int ordinal = 0;
    for (int i = 0; a && i < cu_g_ndev; i++)
        if (cu_g_devs[i] == a->gpu) ordinal = i;
    switch (attribute) {
    case 1: *(CUcontext *)data = a ? a->ctx : NULL; break;                         /* CONTEXT */
    case 2: *(unsigned int *)data = !a ? 0 : a->kind == MEM_HOST ? 1 : 2; break;    /* MEMORY_TYPE */
    case 3: case 4: *(void **)data = a ? (void *)(uintptr_t)ptr : NULL; break;     /* DEVICE/HOST_POINTER */
    case 8: *(int *)data = a && a->kind == MEM_MANAGED; break;                     /* IS_MANAGED */
    case 9: *(int *)data = a ? ordinal : 0; break;                                 /* DEVICE_ORDINAL */
    case 11: *(CUdeviceptr *)data = a ? a->base : 0; break;                        /* RANGE_START_ADDR */
    case 12: *(size_t *)data = a ? a->size : 0; break;                             /* RANGE_SIZE */
    case 13: *(int *)data = a != NULL; break;                                      /* MAPPED */
    case 17: *(void **)data = a && a->kind == MEM_POOL ? a->owner : NULL; break;   /* MEMPOOL_HANDLE */
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

CU_API CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr) {
    CU_ENTER();
    cu_alloc_t a;
    if (!data) return CUDA_ERROR_INVALID_VALUE;
    if (cu_reg_find((uintptr_t)ptr, &a) != 0 || a.kind == MEM_ARRAY) return CUDA_ERROR_INVALID_VALUE;
    return pointer_attr(&a, ptr, attribute, data);
}

/* Several attributes at once (cudaPointerGetAttributes calls it). Unlike the single query, a
 * pointer the driver does not know is no error: every attribute gets its default. */
CU_API CUresult cuPointerGetAttributes(unsigned int numAttributes, int *attributes, void **data, CUdeviceptr ptr) {
    CU_ENTER();
    if (!attributes || !data) return CUDA_ERROR_INVALID_VALUE;
    cu_alloc_t a;
    int known = cu_reg_find((uintptr_t)ptr, &a) == 0 && a.kind != MEM_ARRAY;
    for (unsigned int i = 0; i < numAttributes; i++) {
        if (!data[i]) return CUDA_ERROR_INVALID_VALUE;
        CUresult r = pointer_attr(known ? &a : NULL, ptr, attributes[i], data[i]);
        if (r != CUDA_SUCCESS) return r;
    }
    return CUDA_SUCCESS;
}

const cu_sym_t cu_syms_mem[] = {
    CU_SYM("cuMemAlloc", 2000, cuMemAlloc),
    CU_SYM("cuMemAlloc", 3020, cuMemAlloc_v2),
    CU_SYM("cuMemFree", 2000, cuMemFree),
    CU_SYM("cuMemFree", 3020, cuMemFree_v2),
    CU_SYM("cuMemAllocPitch", 3020, cuMemAllocPitch_v2),
    CU_SYM("cuMemAllocManaged", 6000, cuMemAllocManaged),
    CU_SYM("cuMemGetInfo", 2000, cuMemGetInfo),
    CU_SYM("cuMemGetInfo", 3020, cuMemGetInfo_v2),
    CU_SYM("cuMemGetAddressRange", 3020, cuMemGetAddressRange_v2),
    CU_SYM("cuMemAllocHost", 3020, cuMemAllocHost_v2),
    CU_SYM("cuMemHostAlloc", 2020, cuMemHostAlloc),
    CU_SYM("cuMemFreeHost", 2000, cuMemFreeHost),
    CU_SYM("cuMemHostGetDevicePointer", 3020, cuMemHostGetDevicePointer_v2),
    CU_SYM("cuMemHostGetFlags", 2030, cuMemHostGetFlags),
    CU_SYM("cuPointerGetAttribute", 4000, cuPointerGetAttribute),
    CU_SYM("cuPointerGetAttributes", 7000, cuPointerGetAttributes),
};
const size_t cu_syms_mem_n = sizeof cu_syms_mem / sizeof cu_syms_mem[0];
