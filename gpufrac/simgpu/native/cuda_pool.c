/*
 * simgpu fake libcuda.so.1 — stream-ordered allocation: memory pools,
 * cuMemAllocAsync / cuMemAllocFromPoolAsync / cuMemFreeAsync and pool attributes.
 *
 * Behaviour modelled on the real driver:
 *   - A pool reserves backing memory in blocks of whole 2 MiB granules, charged
 *     to the GPU when reserved (so NVML counts a pool's reserved memory, not what
 *     the application is using from it).
 *   - Freed blocks stay reserved in the pool and are reused by later allocations;
 *     a larger free block is split (sub-allocated), so USED_MEM grows by the
 *     allocation's granules, not by the whole block it came from.
 *   - At every synchronize (stream, event, context) each pool releases free
 *     blocks back to the GPU until its reserved memory is at or below its
 *     CU_MEMPOOL_ATTR_RELEASE_THRESHOLD (default 0: everything free goes back).
 *     cuMemPoolTrimTo releases immediately down to the given size.
 *   - An allocation that does not fit first releases the pool's own free blocks
 *     and tries again; then it fails with CUDA_ERROR_OUT_OF_MEMORY.
 *   - USED_MEM counts the blocks handed out (whole granules), RESERVED_MEM the
 *     blocks held; the *_HIGH watermarks can only be reset (set to 0).
 */
#include <stdlib.h>
#include <sys/mman.h>

#include "cuda_internal.h"

typedef struct block {
    uintptr_t base;
    size_t size;
    struct block *next;
} block_t;

struct CUmemPoolHandle_st {
    cu_obj_t hdr;
    int dev;
    uint32_t gpu;
    int is_default, destroyed;
    int host; /* host-located pool: its blocks are host RAM, never charged to the GPU */
    int managed; /* CU_MEM_ALLOCATION_TYPE_MANAGED: its location is only preferred (below) */
    size_t max_size;
    uint64_t threshold, reserved, reserved_high, used, used_high;
    int reuse[3];
    block_t *free;
    struct CUmemPoolHandle_st *next;
};

static pthread_mutex_t g_pool_lock = PTHREAD_MUTEX_INITIALIZER;
static struct CUmemPoolHandle_st *g_pools, *g_default[SIMGPU_MAX_GPUS], *g_current[SIMGPU_MAX_GPUS];

static struct CUmemPoolHandle_st *pool_new(int dev, int is_default, size_t max_size) {
    struct CUmemPoolHandle_st *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->dev = dev, p->gpu = cu_g_devs[dev], p->is_default = is_default, p->max_size = max_size;
    p->reuse[0] = p->reuse[1] = p->reuse[2] = 1;
    p->next = g_pools;
    g_pools = p;
    cu_obj_add(p, OBJ_POOL, NULL);
    return p;
}

/* Callers hold g_pool_lock. */
static struct CUmemPoolHandle_st *default_pool(int dev) {
    if (!g_default[dev]) g_default[dev] = pool_new(dev, 1, 0);
    if (!g_current[dev]) g_current[dev] = g_default[dev];
    return g_current[dev];
}

static void trim_locked(struct CUmemPoolHandle_st *p, uint64_t keep) {
    while (p->reserved > keep && p->free) {
        block_t *b = p->free;
        p->free = b->next;
        cu_unmap((void *)b->base, b->size);
        if (!p->host) cu_uncharge(p->gpu, b->size);
        p->reserved -= b->size;
        free(b);
    }
}

static void unlink_locked(struct CUmemPoolHandle_st *p) {
    for (struct CUmemPoolHandle_st **pp = &g_pools; *pp; pp = &(*pp)->next)
        if (*pp == p) {
            *pp = p->next;
            break;
        }
    free(p);
}

void cu_pools_release(void) {
    pthread_mutex_lock(&g_pool_lock);
    for (struct CUmemPoolHandle_st *p = g_pools; p; p = p->next)
        if (p->reserved > p->threshold) trim_locked(p, p->threshold);
    pthread_mutex_unlock(&g_pool_lock);
}

static CUresult pool_alloc(CUdeviceptr *dptr, size_t size, struct CUmemPoolHandle_st *p, CUstream h) {
    CU_STREAM(h, c, s);
    if (!dptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
    if (s->capture) { /* captured: a memory node of the graph (cuda_graph.c) */
        if (p && p->host) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
        return cu_graph_capture_alloc(s->capture, p ? p->dev : c->dev, size, dptr);
    }
    pthread_mutex_lock(&g_pool_lock);
    if (!p) p = default_pool(c->dev);
    if (!p || p->destroyed) {
        pthread_mutex_unlock(&g_pool_lock);
        return p ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_OUT_OF_MEMORY;
    }
    size_t bsize = cu_round_up(size, CU_GRANULARITY);
    block_t *b = NULL;
    for (block_t **bp = &p->free; *bp; bp = &(*bp)->next) /* reuse a free block that fits */
        if ((*bp)->size >= bsize) {
            b = *bp;
            if (b->size > bsize) { /* sub-allocate: the rest stays free in the pool */
                block_t *rest = malloc(sizeof *rest);
                if (!rest) {
                    b = NULL;
                    break;
                }
                rest->base = b->base + bsize, rest->size = b->size - bsize, rest->next = b->next;
                b->size = bsize;
                *bp = rest;
            } else {
                *bp = b->next;
            }
            break;
        }
    if (!b) {
        if (p->max_size && p->reserved + bsize > p->max_size) trim_locked(p, 0);
        if ((p->max_size && p->reserved + bsize > p->max_size) ||
            (!p->host && cu_charge(p->gpu, bsize) != CUDA_SUCCESS &&
             (trim_locked(p, 0), cu_charge(p->gpu, bsize) != CUDA_SUCCESS))) {
            pthread_mutex_unlock(&g_pool_lock);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        void *mem = cu_map_anon(bsize, PROT_READ | PROT_WRITE);
        b = mem ? calloc(1, sizeof *b) : NULL;
        if (!b) {
            if (mem) cu_unmap(mem, bsize);
            if (!p->host) cu_uncharge(p->gpu, bsize);
            pthread_mutex_unlock(&g_pool_lock);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        b->base = (uintptr_t)mem, b->size = bsize;
        p->reserved += bsize;
        if (p->reserved > p->reserved_high) p->reserved_high = p->reserved;
    }
    /* For a pool block, `charged` is the block size (charged to the GPU by the pool). */
    cu_alloc_t a = {.base = b->base, .size = size, .charged = b->size, .gpu = p->gpu, .kind = MEM_POOL,
                    .ctx = c, .owner = p};
    if (cu_reg_insert(&a) != 0) {
        b->next = p->free, p->free = b;
        pthread_mutex_unlock(&g_pool_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    p->used += b->size;
    if (p->used > p->used_high) p->used_high = p->used;
    *dptr = b->base;
    free(b);
    pthread_mutex_unlock(&g_pool_lock);
    return CUDA_SUCCESS;
}

CUresult cu_pool_free_block(const cu_alloc_t *a) {
    cu_alloc_t got;
    block_t *b = malloc(sizeof *b);
    if (!b) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_pool_lock);
    if (cu_reg_remove(a->base, &got) != 0) { /* freed concurrently */
        pthread_mutex_unlock(&g_pool_lock);
        free(b);
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct CUmemPoolHandle_st *p = got.owner;
    b->base = got.base, b->size = got.charged, b->next = p->free;
    p->free = b;
    p->used = p->used >= got.charged ? p->used - got.charged : 0;
    if (p->destroyed && p->used == 0) { /* the last outstanding block of a destroyed pool */
        trim_locked(p, 0);
        unlink_locked(p);
    }
    pthread_mutex_unlock(&g_pool_lock);
    return CUDA_SUCCESS;
}

static int pool_ok(CUmemoryPool pool) { return cu_obj_ok(pool, OBJ_POOL); }

CU_API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    CU_ENTER();
    return pool_alloc(dptr, bytesize, NULL, hStream);
}

CU_API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream) {
    CU_ENTER();
    if (!pool_ok(pool)) return CUDA_ERROR_INVALID_HANDLE;
    return pool_alloc(dptr, bytesize, pool, hStream);
}

/* Stream-ordered free: pool blocks go back to their pool; other device memory
 * (cuMemAlloc) is freed outright, as the real driver allows. */
CU_API CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
    CU_ENTER();
    CU_STREAM(hStream, c, s);
    if (s->capture) return cu_graph_capture_free(s->capture, dptr);
    return cu_mem_free(dptr);
}

CU_API CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps) {
    CU_ENTER();
    /* allocType PINNED (1), or MANAGED (2, CUDA 13): managed memory whose location
     * is only its preferred one; the GPU that touches it pulls it in, and here
     * managed memory stays resident on the device (as cuMemAllocManaged's does), so
     * a managed pool is charged to the GPU whatever location it prefers. */
    if (!pool || !poolProps || (poolProps->allocType != 1 && poolProps->allocType != 2)) return CUDA_ERROR_INVALID_VALUE;
    int managed = poolProps->allocType == 2;
    /* A managed pool: no IPC, no maximum size, and location NONE (0) for no preference. */
    if (managed && (poolProps->handleTypes != 0 || poolProps->maxSize != 0)) return CUDA_ERROR_INVALID_VALUE;
    int on_host = cu_loc_host(&poolProps->location) || (managed && poolProps->location.type == 0);
    if (!on_host && poolProps->location.type != 1) return CUDA_ERROR_INVALID_VALUE;
    if (!on_host && cu_check_dev(poolProps->location.id)) return CUDA_ERROR_INVALID_DEVICE;
    if (poolProps->location.type != 0 && !cu_loc_ok(&poolProps->location)) return CUDA_ERROR_INVALID_VALUE;
    /* A host pool serves the device of the calling context (its blocks are host RAM). */
    struct CUctx_st *c = cu_current_ctx();
    pthread_mutex_lock(&g_pool_lock);
    struct CUmemPoolHandle_st *p = pool_new(on_host ? (c ? c->dev : 0) : poolProps->location.id, 0, poolProps->maxSize);
    if (p) p->host = on_host && !managed, p->managed = managed;
    pthread_mutex_unlock(&g_pool_lock);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    *pool = p;
    return CUDA_SUCCESS;
}

CU_API CUresult cuMemPoolDestroy(CUmemoryPool pool) {
    CU_ENTER();
    if (!pool_ok(pool)) return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&g_pool_lock);
    CUresult r = CUDA_SUCCESS;
    if (pool->is_default) {
        r = CUDA_ERROR_INVALID_VALUE;
    } else {
        cu_obj_del(pool, OBJ_POOL);
        for (int d = 0; d < SIMGPU_MAX_GPUS; d++)
            if (g_current[d] == pool) g_current[d] = g_default[d];
        pool->destroyed = 1;
        trim_locked(pool, 0);
        if (pool->used == 0) unlink_locked(pool); /* else: freed with its last block */
    }
    pthread_mutex_unlock(&g_pool_lock);
    return r;
}

CU_API CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep) {
    CU_ENTER();
    if (!pool_ok(pool)) return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&g_pool_lock);
    trim_locked(pool, minBytesToKeep);
    pthread_mutex_unlock(&g_pool_lock);
    return CUDA_SUCCESS;
}

/* CUmemPool_attribute: 1-3 reuse policies (int), 4 release threshold, 5 reserved,
 * 6 reserved high watermark, 7 used, 8 used high watermark (cuuint64_t). The
 * current sizes are read-only; a watermark can only be reset (set to 0). */
static CUresult pool_attr(CUmemoryPool pool, int attr, void *value, int set) {
    if (!pool_ok(pool)) return CUDA_ERROR_INVALID_HANDLE;
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = CUDA_SUCCESS;
    cuuint64_t *v = value;
    pthread_mutex_lock(&g_pool_lock);
    uint64_t *high = attr == 6 ? &pool->reserved_high : &pool->used_high;
    uint64_t now = attr == 6 ? pool->reserved : pool->used;
    switch (attr) {
    case 1: case 2: case 3:
        if (set) pool->reuse[attr - 1] = *(int *)value != 0;
        else *(int *)value = pool->reuse[attr - 1];
        break;
    case 4:
        if (set) pool->threshold = *v;
        else *v = pool->threshold;
        break;
    case 5: case 7:
        if (set) r = CUDA_ERROR_INVALID_VALUE;
        else *v = attr == 5 ? pool->reserved : pool->used;
        break;
    case 6: case 8:
        if (!set) *v = *high;
        else if (*v) r = CUDA_ERROR_INVALID_VALUE;
        else *high = now;
        break;
    default: r = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&g_pool_lock);
    return r;
}

CU_API CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value) {
    CU_ENTER();
    return pool_attr(pool, attr, value, 1);
}

CU_API CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value) {
    CU_ENTER();
    return pool_attr(pool, attr, value, 0);
}

/* The device's default pool, or the pool cuDeviceSetMemPool made current. */
static CUresult device_pool(CUmemoryPool *out, CUdevice dev, int current) {
    CUresult r = cu_check_dev(dev);
    if (r) return r;
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_pool_lock);
    struct CUmemPoolHandle_st *cur = default_pool(dev);
    *out = current ? cur : g_default[dev];
    pthread_mutex_unlock(&g_pool_lock);
    return *out ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CU_API CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev) {
    CU_ENTER();
    return device_pool(pool_out, dev, 0);
}

CU_API CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev) {
    CU_ENTER();
    return device_pool(pool, dev, 1);
}

CU_API CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool) {
    CU_ENTER();
    CUresult r = cu_check_dev(dev);
    if (r) return r;
    if (!pool_ok(pool)) return CUDA_ERROR_INVALID_HANDLE;
    if (pool->dev != dev || pool->host || pool->managed) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_pool_lock);
    g_current[dev] = pool;
    pthread_mutex_unlock(&g_pool_lock);
    return CUDA_SUCCESS;
}

/* Per-thread default stream twins (see CU_TWIN). */
CU_TWIN(cuMemAllocAsync_ptsz, cuMemAllocAsync, (CUdeviceptr * d, size_t n, CUstream h), (d, n, h))
CU_TWIN(cuMemAllocFromPoolAsync_ptsz, cuMemAllocFromPoolAsync, (CUdeviceptr * d, size_t n, CUmemoryPool p, CUstream h),
        (d, n, p, h))
CU_TWIN(cuMemFreeAsync_ptsz, cuMemFreeAsync, (CUdeviceptr d, CUstream h), (d, h))

const cu_sym_t cu_syms_pool[] = {
    CU_SYM("cuMemAllocAsync", 11020, cuMemAllocAsync),
    CU_SYM_PT("cuMemAllocAsync", 11020, cuMemAllocAsync_ptsz),
    CU_SYM("cuMemAllocFromPoolAsync", 11020, cuMemAllocFromPoolAsync),
    CU_SYM_PT("cuMemAllocFromPoolAsync", 11020, cuMemAllocFromPoolAsync_ptsz),
    CU_SYM("cuMemFreeAsync", 11020, cuMemFreeAsync),
    CU_SYM_PT("cuMemFreeAsync", 11020, cuMemFreeAsync_ptsz),
    CU_SYM("cuMemPoolCreate", 11020, cuMemPoolCreate),
    CU_SYM("cuMemPoolDestroy", 11020, cuMemPoolDestroy),
    CU_SYM("cuMemPoolTrimTo", 11020, cuMemPoolTrimTo),
    CU_SYM("cuMemPoolSetAttribute", 11020, cuMemPoolSetAttribute),
    CU_SYM("cuMemPoolGetAttribute", 11020, cuMemPoolGetAttribute),
    CU_SYM("cuDeviceGetDefaultMemPool", 11020, cuDeviceGetDefaultMemPool),
    CU_SYM("cuDeviceGetMemPool", 11020, cuDeviceGetMemPool),
    CU_SYM("cuDeviceSetMemPool", 11020, cuDeviceSetMemPool),
};
const size_t cu_syms_pool_n = sizeof cu_syms_pool / sizeof cu_syms_pool[0];
