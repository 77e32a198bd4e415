/*
 * simgpu fake libcuda.so.1 — the virtual memory management API: address
 * reservations, physical allocations (cuMemCreate/Release), map/unmap, access.
 *
 * Addresses are stable as on a GPU: cuMemAddressReserve reserves a host VA range
 * (PROT_NONE, MAP_NORESERVE); each cuMemCreate allocation is backed by its own
 * memfd, and cuMemMap maps that memfd into the reservation with MAP_FIXED, so
 * the same address reaches the same bytes wherever the allocation is mapped.
 * Mapped memory is inaccessible until cuMemSetAccess (PROT_NONE -> read/write).
 * Physical memory is charged at cuMemCreate and given back when the allocation's
 * last reference goes (its handle released and every mapping unmapped) — never
 * at reserve.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "cuda_internal.h"

typedef struct {
    cu_obj_t hdr;
    int fd;
    size_t size;
    uint32_t gpu;
    int handle_refs; /* cuMemCreate / cuMemRetainAllocationHandle minus cuMemRelease */
    int map_refs;    /* live mappings */
    int host;        /* host-located (HOST, HOST_NUMA, HOST_NUMA_CURRENT): no GPU memory */
    CUmemAllocationProp prop;
} vmm_alloc_t;

typedef struct {
    uintptr_t base;
    size_t size;
} reservation_t;

static pthread_mutex_t g_vmm_lock = PTHREAD_MUTEX_INITIALIZER;
static reservation_t *g_res;
static size_t g_res_n, g_res_cap;

int cu_vmm_reserved(uintptr_t p) {
    int hit = 0;
    pthread_mutex_lock(&g_vmm_lock);
    for (size_t i = 0; i < g_res_n && !hit; i++) hit = p - g_res[i].base < g_res[i].size;
    pthread_mutex_unlock(&g_vmm_lock);
    return hit;
}

/* Is [p, p+len) inside one reservation? Caller holds g_vmm_lock. */
static int in_reservation(uintptr_t p, size_t len) {
    for (size_t i = 0; i < g_res_n; i++)
        if (p >= g_res[i].base && p + len >= p && p + len <= g_res[i].base + g_res[i].size) return 1;
    return 0;
}

/* CUmemLocationType: DEVICE 1 (id = ordinal), HOST 2, HOST_NUMA 3 (id = NUMA
 * node), HOST_NUMA_CURRENT 4. Host-located memory is pinned host RAM the GPU
 * reaches over the bus (NCCL's cuMem host buffers): no GPU memory is charged. */
int cu_loc_host(const CUmemLocation *l) { return l->type == 2 || l->type == 3 || l->type == 4; }

int cu_loc_ok(const CUmemLocation *l) {
    if (l->type == 1) return cu_check_dev(l->id) == CUDA_SUCCESS;
    return l->type == 2 || l->type == 4 || (l->type == 3 && l->id >= 0);
}

static int prop_ok(const CUmemAllocationProp *prop) {
    return prop && prop->type == 1 /* PINNED */ && cu_loc_ok(&prop->location);
}

/* Drop one reference; the last one closes the memfd and gives the memory back.
 * Caller holds g_vmm_lock. */
static void alloc_unref(vmm_alloc_t *a, int handle) {
    if (handle) a->handle_refs--;
    else a->map_refs--;
    if (a->handle_refs > 0 || a->map_refs > 0) return;
    cu_obj_del(a, OBJ_VMM_ALLOC);
    close(a->fd);
    if (!a->host) cu_uncharge(a->gpu, a->size);
    free(a);
}

static vmm_alloc_t *handle_alloc(CUmemGenericAllocationHandle h) {
    vmm_alloc_t *a = (vmm_alloc_t *)(uintptr_t)h;
    return cu_obj_ok(a, OBJ_VMM_ALLOC) ? a : NULL;
}

CU_API CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                    unsigned long long flags) {
    CU_ENTER();
    if (!ptr || !size || size % CU_GRANULARITY || flags) return CUDA_ERROR_INVALID_VALUE;
    if (!alignment) alignment = CU_GRANULARITY;
    if (alignment & (alignment - 1) || size + alignment < size) return CUDA_ERROR_INVALID_VALUE;
    size_t span = size + alignment;
    void *hint = addr && addr % alignment == 0 ? (void *)(uintptr_t)addr : NULL;
    void *p = mmap(hint, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    uintptr_t base = cu_round_up((uintptr_t)p, alignment);
    if (base > (uintptr_t)p) munmap(p, base - (uintptr_t)p); /* trim to the aligned range */
    if ((uintptr_t)p + span > base + size) munmap((void *)(base + size), (uintptr_t)p + span - (base + size));
    pthread_mutex_lock(&g_vmm_lock);
    if (g_res_n == g_res_cap) {
        size_t cap = g_res_cap ? g_res_cap * 2 : 64;
        reservation_t *r = realloc(g_res, cap * sizeof *r);
        if (!r) {
            pthread_mutex_unlock(&g_vmm_lock);
            munmap((void *)base, size);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        g_res = r, g_res_cap = cap;
    }
    g_res[g_res_n++] = (reservation_t){base, size};
    pthread_mutex_unlock(&g_vmm_lock);
    *ptr = base;
    return CUDA_SUCCESS;
}

/* Unmap every mapping in [p, p+len) that lies wholly inside it. Caller holds g_vmm_lock. */
static void unmap_range(uintptr_t p, size_t len) {
    cu_alloc_t m;
    for (uintptr_t cur = p; cur < p + len;) {
        if (cu_reg_find(cur, &m) != 0 || m.kind != MEM_VMM) {
            cur += CU_GRANULARITY;
            continue;
        }
        cu_reg_remove(m.base, &m);
        mmap((void *)m.base, m.size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
        alloc_unref(m.owner, 0);
        cur = m.base + m.size;
    }
}

/* Freeing a reservation also unmaps whatever is still mapped in it. */
CU_API CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    CU_ENTER();
    pthread_mutex_lock(&g_vmm_lock);
    size_t i = 0;
    while (i < g_res_n && !(g_res[i].base == ptr && g_res[i].size == size)) i++;
    if (i == g_res_n) {
        pthread_mutex_unlock(&g_vmm_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    unmap_range(ptr, size);
    munmap((void *)(uintptr_t)ptr, size);
    g_res[i] = g_res[--g_res_n];
    pthread_mutex_unlock(&g_vmm_lock);
    return CUDA_SUCCESS;
}

CU_API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long flags) {
    CU_ENTER();
    if (!handle || !size || size % CU_GRANULARITY || flags || !prop_ok(prop)) return CUDA_ERROR_INVALID_VALUE;
    int host = cu_loc_host(&prop->location);
    struct CUctx_st *c = cu_current_ctx();
    uint32_t gpu = !host ? cu_g_devs[prop->location.id] : c ? c->gpu : cu_g_devs[0];
    CUresult r = host ? CUDA_SUCCESS : cu_charge(gpu, size);
    if (r) return r;
    vmm_alloc_t *a = calloc(1, sizeof *a);
    int fd = a ? memfd_create("simgpu-vmm", MFD_CLOEXEC) : -1;
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
        if (fd >= 0) close(fd);
        free(a);
        if (!host) cu_uncharge(gpu, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    a->fd = fd, a->size = size, a->gpu = gpu, a->handle_refs = 1, a->host = host, a->prop = *prop;
    cu_obj_add(a, OBJ_VMM_ALLOC, NULL);
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)a;
    return CUDA_SUCCESS;
}

CU_API CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    CU_ENTER();
    pthread_mutex_lock(&g_vmm_lock);
    vmm_alloc_t *a = handle_alloc(handle);
    CUresult r = a && a->handle_refs > 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (!r) alloc_unref(a, 1);
    pthread_mutex_unlock(&g_vmm_lock);
    return r;
}

CU_API CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                         unsigned long long flags) {
    CU_ENTER();
    if (flags || !size || size % CU_GRANULARITY || offset % CU_GRANULARITY || ptr % CU_GRANULARITY)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_vmm_lock);
    vmm_alloc_t *a = handle_alloc(handle);
    CUresult r = CUDA_SUCCESS;
    if (!a || a->handle_refs <= 0 || offset > a->size || size > a->size - offset) r = CUDA_ERROR_INVALID_VALUE;
    else if (!in_reservation(ptr, size)) r = CUDA_ERROR_INVALID_VALUE;
    else if (cu_reg_overlaps(ptr, size)) r = CUDA_ERROR_ALREADY_MAPPED;
    if (!r) {
        void *p = mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, a->fd, (off_t)offset);
        cu_alloc_t m = {.base = ptr, .size = size, .gpu = a->gpu, .kind = MEM_VMM, .owner = a};
        if (p == MAP_FAILED || cu_reg_insert(&m) != 0) {
            if (p != MAP_FAILED)
                mmap(p, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            a->map_refs++;
        }
    }
    pthread_mutex_unlock(&g_vmm_lock);
    return r;
}

/* The range must cover whole mappings (as the real driver requires). */
static int whole_mappings(uintptr_t p, size_t len) {
    cu_alloc_t m;
    uintptr_t cur = p;
    while (cur < p + len) {
        if (cu_reg_find(cur, &m) != 0 || m.kind != MEM_VMM || m.base != cur) return 0;
        cur += m.size;
    }
    return cur == p + len;
}

CU_API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    CU_ENTER();
    pthread_mutex_lock(&g_vmm_lock);
    CUresult r = size && ptr + size > ptr && whole_mappings(ptr, size) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (!r) unmap_range(ptr, size);
    pthread_mutex_unlock(&g_vmm_lock);
    return r;
}

CU_API CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    CU_ENTER();
    if (!desc || !count || !size) return CUDA_ERROR_INVALID_VALUE;
    int flags = 0;
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != 1 || cu_check_dev(desc[i].location.id)) return CUDA_ERROR_INVALID_DEVICE;
        if (desc[i].flags != 0 && desc[i].flags != 1 && desc[i].flags != 3) return CUDA_ERROR_INVALID_VALUE;
        if (desc[i].flags > flags) flags = desc[i].flags;
    }
    int prot = flags == 3 ? PROT_READ | PROT_WRITE : flags == 1 ? PROT_READ : PROT_NONE;
    pthread_mutex_lock(&g_vmm_lock);
    CUresult r = whole_mappings(ptr, size) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (!r && mprotect((void *)(uintptr_t)ptr, size, prot) != 0) r = CUDA_ERROR_INVALID_VALUE;
    cu_alloc_t m;
    for (uintptr_t cur = ptr; !r && cur < ptr + size; cur = m.base + m.size) {
        cu_reg_find(cur, &m);
        cu_reg_set_access(m.base, (uint8_t)flags);
    }
    pthread_mutex_unlock(&g_vmm_lock);
    return r;
}

CU_API CUresult cuMemGetAccess(unsigned long long *flags, const CUmemLocation *location, CUdeviceptr ptr) {
    CU_ENTER();
    cu_alloc_t m;
    if (!flags || !location || location->type != 1 || cu_check_dev(location->id)) return CUDA_ERROR_INVALID_VALUE;
    if (cu_reg_find(ptr, &m) != 0 || m.kind != MEM_VMM) return CUDA_ERROR_INVALID_VALUE;
    *flags = m.access;
    return CUDA_SUCCESS;
}

CU_API CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop, int option) {
    CU_ENTER();
    if (!granularity || !prop_ok(prop) || (option != 0 && option != 1)) return CUDA_ERROR_INVALID_VALUE;
    *granularity = CU_GRANULARITY;
    return CUDA_SUCCESS;
}

CU_API CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                       CUmemGenericAllocationHandle handle) {
    CU_ENTER();
    if (!prop) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_vmm_lock);
    vmm_alloc_t *a = handle_alloc(handle);
    if (a) *prop = a->prop;
    pthread_mutex_unlock(&g_vmm_lock);
    return a ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* Any address inside a mapping gives its allocation's handle, with a new reference. */
CU_API CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
    CU_ENTER();
    cu_alloc_t m;
    if (!handle) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_vmm_lock);
    CUresult r = cu_reg_find((uintptr_t)addr, &m) == 0 && m.kind == MEM_VMM ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (!r) {
        vmm_alloc_t *a = m.owner;
        a->handle_refs++;
        *handle = (CUmemGenericAllocationHandle)(uintptr_t)a;
    }
    pthread_mutex_unlock(&g_vmm_lock);
    return r;
}

const cu_sym_t cu_syms_vmm[] = {
    CU_SYM("cuMemAddressReserve", 10020, cuMemAddressReserve),
    CU_SYM("cuMemAddressFree", 10020, cuMemAddressFree),
    CU_SYM("cuMemCreate", 10020, cuMemCreate),
    CU_SYM("cuMemRelease", 10020, cuMemRelease),
    CU_SYM("cuMemMap", 10020, cuMemMap),
    CU_SYM("cuMemUnmap", 10020, cuMemUnmap),
    CU_SYM("cuMemSetAccess", 10020, cuMemSetAccess),
    CU_SYM("cuMemGetAccess", 10020, cuMemGetAccess),
    CU_SYM("cuMemGetAllocationGranularity", 10020, cuMemGetAllocationGranularity),
    CU_SYM("cuMemGetAllocationPropertiesFromHandle", 10020, cuMemGetAllocationPropertiesFromHandle),
    CU_SYM("cuMemRetainAllocationHandle", 11000, cuMemRetainAllocationHandle),
};
const size_t cu_syms_vmm_n = sizeof cu_syms_vmm / sizeof cu_syms_vmm[0];
