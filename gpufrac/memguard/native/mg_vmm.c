/*
 * memguard: virtual memory management: physical memory is cuMemCreate's; address
 * reservations (cuMemAddressReserve) are not memory and are not hooked.
 *
 * The driver frees a cuMemCreate allocation only when its handle is released
 * AND every mapping of it is unmapped (cuMemRelease, cuMemUnmap in the driver
 * API reference); cuMemRetainAllocationHandle adds a handle reference. Releasing
 * the handle right after cuMemMap is the documented pattern (vectorAddMMAP), so
 * the bytes stay counted until the last reference goes:
 *   g_handles: handle -> bytes, refs (cuMemCreate's + retains + live mappings);
 *   g_maps:    mapping base -> mapping size, handle.
 * refs only ever rises from a non-zero value (CAS); whoever takes it from 1 to 0
 * removes the entry and uncounts the bytes, exactly once. References are dropped
 * before the real call (the driver may hand the same handle or address out again
 * right after it) and restored if the driver refuses. Handles this process did
 * not count (created before the shim was on, imported) pass through.
 */
#include "mg_internal.h"

ALLOC_HOOK(cuMemCreate, g_handles, handle, mg_loc_host(prop) ? 0 : size,
           (CUmemGenericAllocationHandle * handle, size_t size, const CUmemAllocationProp *prop,
            unsigned long long flags),
           handle, size, prop, flags)

/* One more reference to a counted handle; 0 if it is not counted here. */
static int mg_href_get(uint64_t h) {
    mg_ent_t *e = mg_tab_find(&g_handles, h);
    if (!e) return 0;
    uint64_t r = atomic_load_explicit(&e->aux, memory_order_acquire);
    do {
        if (r == 0) return 0; /* its last reference is going: not ours to revive */
    } while (!atomic_compare_exchange_weak_explicit(&e->aux, &r, r + 1, memory_order_acq_rel, memory_order_acquire));
    return 1;
}

enum { HREF_NONE, HREF_DROPPED, HREF_LAST };

/* Drop one reference. HREF_LAST: it was the last one; the entry is gone and
 * *bytes are to be uncounted once the driver call succeeded. */
static int mg_href_drop(uint64_t h, uint64_t *bytes) {
    mg_ent_t *e = mg_tab_find(&g_handles, h);
    if (!e) return HREF_NONE;
    uint64_t r = atomic_load_explicit(&e->aux, memory_order_acquire);
    do {
        if (r == 0) return HREF_NONE;
    } while (!atomic_compare_exchange_weak_explicit(&e->aux, &r, r - 1, memory_order_acq_rel, memory_order_acquire));
    if (r > 1) return HREF_DROPPED;
    *bytes = atomic_load_explicit(&e->size, memory_order_acquire);
    uint64_t k = h;
    atomic_compare_exchange_strong_explicit(&e->key, &k, KEY_TOMB, memory_order_acq_rel, memory_order_relaxed);
    return HREF_LAST;
}

/* The driver refused the call a reference was dropped for: take it back. */
static void mg_href_undo(uint64_t h, int dropped, uint64_t bytes) {
    if (dropped == HREF_DROPPED) mg_href_get(h);
    else if (dropped == HREF_LAST) mg_tab_put(&g_handles, h, bytes, 1);
}

static void mg_vmm_freed(uint64_t bytes) {
    if (!bytes) return;
    mg_uncharge(bytes);
    mg_maybe_return_grant();
}

HOOK CUresult mg_h_cuMemRelease(CUmemGenericAllocationHandle handle) {
    mg_swap_gate();
    if (!mg_on()) return CALL_REAL(cuMemRelease, handle);
    uint64_t bytes = 0;
    int dropped = mg_href_drop(handle, &bytes);
    CUresult rc = CALL_REAL(cuMemRelease, handle);
    if (rc != CUDA_SUCCESS) mg_href_undo(handle, dropped, bytes);
    else if (dropped == HREF_LAST) mg_vmm_freed(bytes);
    return rc;
}

HOOK CUresult mg_h_cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
    mg_swap_gate();
    CUresult rc = CALL_REAL(cuMemRetainAllocationHandle, handle, addr);
    if (rc == CUDA_SUCCESS && handle && mg_on()) mg_href_get(*handle);
    return rc;
}

HOOK CUresult mg_h_cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                            unsigned long long flags) {
    mg_swap_gate();
    CUresult rc = CALL_REAL(cuMemMap, ptr, size, offset, handle, flags);
    /* The mapping holds the allocation: a reference, dropped at its unmap. One
     * that cannot be recorded is kept (counted until exit, never under). */
    if (rc == CUDA_SUCCESS && mg_on() && mg_href_get(handle) && mg_tab_put(&g_maps, ptr, size, handle) != 0)
        MG_WARN_ONCE(g_warned_track,
                     "allocation table full (MEMGUARD_TRACK_BITS): some memory stays counted after free");
    return rc;
}

/* The range is whole mappings (the driver refuses anything else), usually one. */
#define MG_UNMAP_BATCH 32

HOOK CUresult mg_h_cuMemUnmap(CUdeviceptr ptr, size_t size) {
    mg_swap_gate();
    if (!mg_on()) return CALL_REAL(cuMemUnmap, ptr, size);
    struct {
        uint64_t base, size, handle, bytes;
        int dropped;
    } m[MG_UNMAP_BATCH];
    unsigned n = 0;
    uint64_t cur = ptr, end = ptr + size < ptr ? UINT64_MAX : ptr + size;
    while (cur < end && n < MG_UNMAP_BATCH && mg_tab_take(&g_maps, cur, &m[n].size, &m[n].handle)) {
        m[n].base = cur;
        m[n].bytes = 0;
        m[n].dropped = mg_href_drop(m[n].handle, &m[n].bytes);
        cur = m[n].size && cur + m[n].size > cur ? cur + m[n].size : end;
        n++;
    }
    CUresult rc = CALL_REAL(cuMemUnmap, ptr, size);
    if (rc != CUDA_SUCCESS) {
        while (n--) {
            mg_href_undo(m[n].handle, m[n].dropped, m[n].bytes);
            mg_tab_put(&g_maps, m[n].base, m[n].size, m[n].handle);
        }
        return rc;
    }
    uint64_t freed = 0;
    for (unsigned i = 0; i < n; i++)
        if (m[i].dropped == HREF_LAST) freed += m[i].bytes;
    /* More mappings than one batch: the rest, after the fact. */
    uint64_t msize, h, bytes = 0;
    while (cur < end && mg_tab_take(&g_maps, cur, &msize, &h)) {
        if (mg_href_drop(h, &bytes) == HREF_LAST) freed += bytes;
        cur = msize && cur + msize > cur ? cur + msize : end;
    }
    mg_vmm_freed(freed);
    return rc;
}

/* Where a cuMemCreate / cuMemPoolCreate allocation lives: the head shared by
 * CUmemAllocationProp and CUmemPoolProps (type, handle types, CUmemLocation).
 * CUmemLocationType HOST 2, HOST_NUMA 3, HOST_NUMA_CURRENT 4 are host RAM the
 * GPU reaches over the bus (NCCL's cuMem host buffers): not GPU memory, never
 * counted. Every other type (DEVICE 1, or one this shim does not know) counts.
 * Only for pinned memory (allocation type PINNED 1): for MANAGED (2, CUDA 13
 * managed pools) the location is only preferred, and the memory moves onto the
 * GPU that touches it, so it counts like cuMemAllocManaged's. */
typedef struct {
    int type, handle_types;
    struct {
        int type, id;
    } location;
} mg_loc_head_t;

int mg_loc_host(const void *props) {
    if (!props || ((const mg_loc_head_t *)props)->type != 1) return 0;
    int t = ((const mg_loc_head_t *)props)->location.type;
    return t == 2 || t == 3 || t == 4;
}

MG_SYMBOLS_VMM(MG_XALIAS)
