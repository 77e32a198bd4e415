/*
 * memguard: memory pools (stream-ordered allocation: cuMemAllocAsync & co.)
 * and the synchronize points where pools give memory back.
 *
 * A pool reserves physical memory and hands allocations out of it. After
 * cuMemFreeAsync the block stays reserved in the pool (NVML shows it used) until
 * the pool gives it back: at a stream/event/context synchronize, down to its
 * CU_MEMPOOL_ATTR_RELEASE_THRESHOLD (default 0; PyTorch's cudaMallocAsync
 * backend sets UINT64_MAX, i.e. never), at cuMemPoolTrimTo, or when the pool is
 * destroyed (with its last outstanding allocation). So per pool the container is
 * charged for
 *     its live allocations (per pointer, at their size, as for cuMemAlloc)
 *   + its idle reservation = RESERVED_MEM_CURRENT - USED_MEM_CURRENT,
 * the latter read from the driver after every call that can change it (alloc,
 * free, trim, synchronize, destroy) and charged or uncharged by the difference
 * from what was last counted (g_pool[], process-local: pools are per process).
 *
 * The limit is checked BEFORE a pool grows: an allocation first takes what the
 * pool holds idle (already counted: no new charge), and charges only the rest
 * through mg_charge (fast path, arbiter, or CUDA_ERROR_OUT_OF_MEMORY). If the
 * pool could not serve it from the idle memory after all (fragmentation, or
 * another pool than expected), the pool grew by more than was charged: the
 * extra is counted at once (never under) and must pass mg_admit; if it does
 * not, the allocation is freed, the pool trimmed back and the caller gets
 * CUDA_ERROR_OUT_OF_MEMORY.
 *
 * Order, so a count is never below what the driver holds: idle is charged
 * before a freed block's live bytes are uncharged. Races between threads can
 * only over-count for a moment (until the next reconcile of that pool). Not
 * counted: the rounding of each live allocation up to the pool's granularity
 * (USED_MEM - sizes), as for every other allocation kind.
 *
 * g_pool_mu is a process-local mutex (a dead process takes it with it); it is
 * held across the driver's pool calls (non-blocking) but never across a
 * synchronize, an arbiter request or mg_charge.
 *
 * One file though over 500 lines: the pool records, g_pool_mu and the hooks
 * that change them are one state; split, that state would be shared across
 * sources.
 */
#include <pthread.h>
#include <string.h>

#include "mg_internal.h"

#define MG_POOL_SLOTS 512 /* pools one process may have counted at once (power of two) */
#define CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT 5
#define CU_MEMPOOL_ATTR_USED_MEM_CURRENT 7
#define CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE 17

typedef struct {
    uint64_t key;  /* the CUmemoryPool; KEY_EMPTY, KEY_TOMB */
    uint64_t idle; /* bytes counted for its idle reservation */
    uint64_t live; /* this process's counted allocations from it */
    uint64_t res;  /* RESERVED_MEM_CURRENT as last read (valid if known; can only be high) */
    uint64_t used; /* USED_MEM_CURRENT as last read, followed through frees (valid if known) */
    int known;     /* res/used were read; each later change went through a hook under g_pool_mu */
    int destroyed; /* cuMemPoolDestroy returned while allocations were live */
    unsigned pos;  /* 1 + index in g_pool_active while on it, else 0 */
    /* The block freed into it last (stream-ordered, footprint known), until the
     * next allocation from it or a reading of it: see mg_pool_alloc. */
    uint64_t lf_ptr, lf_size, lf_foot;
} mg_pool_t;

/* Pool frees whose real call runs without g_pool_mu (cuMemFree on a pool
 * pointer, which may block; mg_pool_undo): while any is in flight, USED may
 * drop under an allocation's feet, so no footprint is derived from it. */
static _Atomic unsigned g_pool_unlocked;
/* Synchronizes and trims in flight (the real call, then the reconcile): the
 * driver may be releasing pool memory behind the records meanwhile. */
static _Atomic unsigned g_pool_syncing;

static void mg_sync_begin(void) { atomic_fetch_add(&g_pool_syncing, 1); }
static void mg_sync_end(void) { atomic_fetch_sub(&g_pool_syncing, 1); }
#define MG_FOOT_UNKNOWN UINT64_MAX /* an entry's slop: the footprint could not be told */
/* The pool this thread's last cuMemAllocAsync came from: the guess for the next
 * one (checked after the call with cuPointerGetAttribute). */
static _Thread_local uint64_t t_pool_guess __attribute__((tls_model("initial-exec")));

static pthread_mutex_t g_pool_mu = PTHREAD_MUTEX_INITIALIZER;
static mg_pool_t g_pool[MG_POOL_SLOTS];
static uint16_t g_pool_active[MG_POOL_SLOTS]; /* pools with idle > 0 or a last freed block: see mg_pool_activity */
static _Atomic unsigned g_pool_nactive;
static _Atomic int g_warned_pools;

typedef CUresult (*mg_pool_attr_fn)(CUmemoryPool, int, void *);
typedef CUresult (*mg_ptr_attr_fn)(void *, int, CUdeviceptr);
typedef CUresult (*mg_ctx_dev_fn)(CUdevice *);
typedef CUresult (*mg_dev_pool_fn)(CUmemoryPool *, CUdevice);

void mg_pools_reset(void) {
    pthread_mutex_init(&g_pool_mu, NULL);
    memset(g_pool, 0, sizeof g_pool);
    atomic_store(&g_pool_nactive, 0);
    atomic_store(&g_pool_unlocked, 0);
    atomic_store(&g_pool_syncing, 0);
    t_pool_guess = 0;
}

static inline unsigned mg_pool_hash(uint64_t key) {
    return (unsigned)((key * 0x9E3779B97F4A7C15ull) >> 40) & (MG_POOL_SLOTS - 1);
}

/* The pool's record (created if asked), or NULL. Callers hold g_pool_mu. */
static mg_pool_t *mg_pool_find(uint64_t key, int create) {
    if (key == KEY_EMPTY || key == KEY_TOMB) return NULL;
    mg_pool_t *free_slot = NULL;
    unsigned h = mg_pool_hash(key);
    for (unsigned n = 0; n < MG_POOL_SLOTS; n++, h = (h + 1) & (MG_POOL_SLOTS - 1)) {
        mg_pool_t *p = &g_pool[h];
        if (p->key == key) return p;
        if (p->key == KEY_TOMB && !free_slot) free_slot = p;
        if (p->key == KEY_EMPTY) {
            if (!free_slot) free_slot = p;
            break;
        }
    }
    if (!create || !free_slot) return NULL;
    *free_slot = (mg_pool_t){.key = key};
    return free_slot;
}

/* A pool is on the active list while it has idle memory counted or a last
 * freed block recorded: what a synchronize must reconcile. */
static void mg_pool_activity(mg_pool_t *p) {
    unsigned n = atomic_load_explicit(&g_pool_nactive, memory_order_relaxed);
    int active = p->idle || p->lf_ptr;
    if (active && !p->pos) {
        g_pool_active[n] = (uint16_t)(p - g_pool);
        p->pos = ++n;
    } else if (!active && p->pos) {
        unsigned last = g_pool_active[--n];
        g_pool_active[p->pos - 1] = (uint16_t)last;
        g_pool[last].pos = p->pos;
        p->pos = 0;
    }
    atomic_store_explicit(&g_pool_nactive, n, memory_order_release);
}

static void mg_pool_set_idle(mg_pool_t *p, uint64_t idle) {
    p->idle = idle;
    mg_pool_activity(p);
}

/* Record (key != 0) or forget (0) the block freed into the pool last. Callers hold g_pool_mu. */
static void mg_pool_lf(mg_pool_t *p, uint64_t key, uint64_t size, uint64_t foot) {
    int was = p->lf_ptr != 0;
    p->lf_ptr = key, p->lf_size = size, p->lf_foot = foot;
    if (was != (key != 0)) mg_pool_activity(p);
}

/* Drop the record (its idle already uncounted). */
static void mg_pool_remove(mg_pool_t *p) {
    mg_pool_lf(p, 0, 0, 0);
    mg_pool_set_idle(p, 0);
    p->key = KEY_TOMB;
    unsigned i = (unsigned)(p - g_pool);
    if (g_pool[(i + 1) & (MG_POOL_SLOTS - 1)].key != KEY_EMPTY) return;
    while (g_pool[i].key == KEY_TOMB) { /* the end of a probe run: tombstones there are dead weight */
        g_pool[i].key = KEY_EMPTY;
        i = (i - 1) & (MG_POOL_SLOTS - 1);
    }
}

static int mg_pool_read(uint64_t pool, uint64_t *reserved, uint64_t *used) {
    mg_pool_attr_fn get = (mg_pool_attr_fn)mg_plain(P_cuMemPoolGetAttribute);
    cuuint64_t r = 0, u = 0;
    if (!get || get((CUmemoryPool)(uintptr_t)pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &r) != CUDA_SUCCESS ||
        get((CUmemoryPool)(uintptr_t)pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &u) != CUDA_SUCCESS)
        return -1;
    *reserved = r;
    if (used) *used = u;
    return 0;
}

/* Count the pool's idle reservation as the driver reports it now. Returns the
 * bytes charged by force (0 if it shrank or stayed). Callers hold g_pool_mu. */
static uint64_t mg_pool_apply(mg_pool_t *p, uint64_t r, uint64_t u) {
    uint64_t truth = r > u ? r - u : 0, grew = 0;
    if (truth > p->idle)
        mg_force_charge(grew = truth - p->idle);
    else
        mg_uncharge(p->idle - truth);
    mg_pool_set_idle(p, truth);
    p->res = r, p->used = u, p->known = 1;
    mg_pool_lf(p, 0, 0, 0);
    return grew;
}

static uint64_t mg_pool_reconcile(mg_pool_t *p) {
    uint64_t r, u;
    if (p->destroyed || mg_pool_read(p->key, &r, &u) != 0) { /* cannot tell: keep what is counted */
        p->known = 0;
        mg_pool_lf(p, 0, 0, 0);
        return 0;
    }
    /* Nothing released or taken since it was recorded: the last freed block is
     * still the pool's, still reusable without a read. */
    uint64_t lf = p->known && r == p->res && u == p->used ? p->lf_ptr : 0, lsz = p->lf_size, lft = p->lf_foot;
    uint64_t grew = mg_pool_apply(p, r, u);
    if (lf) mg_pool_lf(p, lf, lsz, lft);
    return grew;
}

/* After a synchronize: pools release what they hold above their threshold. */
static void mg_pools_synced(void) {
    if (MG_LIKELY(atomic_load_explicit(&g_pool_nactive, memory_order_acquire) == 0)) return;
    pthread_mutex_lock(&g_pool_mu);
    /* Backwards: a pool leaving the list is replaced by the last one, already seen. */
    for (unsigned i = atomic_load_explicit(&g_pool_nactive, memory_order_relaxed); i-- > 0;)
        if (i < atomic_load_explicit(&g_pool_nactive, memory_order_relaxed))
            mg_pool_reconcile(&g_pool[g_pool_active[i]]);
    pthread_mutex_unlock(&g_pool_mu);
    mg_maybe_return_grant();
}

/* The pool cuMemAllocAsync will use: the current pool of the calling thread's device. */
static uint64_t mg_current_pool(void) {
    mg_ctx_dev_fn ctx_dev = (mg_ctx_dev_fn)mg_plain(P_cuCtxGetDevice);
    mg_dev_pool_fn dev_pool = (mg_dev_pool_fn)mg_plain(P_cuDeviceGetMemPool);
    CUdevice dev;
    CUmemoryPool pool = NULL;
    if (!ctx_dev || !dev_pool || ctx_dev(&dev) != CUDA_SUCCESS || dev_pool(&pool, dev) != CUDA_SUCCESS) return 0;
    return (uint64_t)(uintptr_t)pool;
}

enum { PA_ASYNC, PA_ASYNC_PTSZ, PA_POOL, PA_POOL_PTSZ };

static CUresult mg_pool_real_alloc(int how, CUdeviceptr *d, size_t n, CUmemoryPool pool, CUstream s) {
    switch (how) {
    case PA_ASYNC: return CALL_REAL(cuMemAllocAsync, d, n, s);
    case PA_ASYNC_PTSZ: return CALL_REAL(cuMemAllocAsync_ptsz, d, n, s);
    case PA_POOL: return CALL_REAL(cuMemAllocFromPoolAsync, d, n, pool, s);
    default: return CALL_REAL(cuMemAllocFromPoolAsync_ptsz, d, n, pool, s);
    }
}

/* Give back `take` bytes an allocation borrowed from the pool's idle count. */
static void mg_pool_untake(uint64_t pool, uint64_t take) {
    if (!take) return;
    pthread_mutex_lock(&g_pool_mu);
    mg_pool_t *p = mg_pool_find(pool, 0);
    if (p) {
        mg_pool_set_idle(p, p->idle + take);
        mg_pool_reconcile(p);
    } else {
        mg_uncharge(take);
    }
    pthread_mutex_unlock(&g_pool_mu);
}

/* A counted pool allocation went away (freed, or undone). Callers hold g_pool_mu. */
static void mg_pool_dropped(uint64_t pool) {
    mg_pool_t *p = mg_pool_find(pool, 0);
    if (!p) return;
    if (p->live) p->live--;
    if (!p->destroyed) {
        mg_pool_reconcile(p);
    } else if (p->live == 0) { /* the destroyed pool's last allocation: the driver frees the pool now */
        mg_uncharge(p->idle);
        mg_pool_remove(p);
    }
}

/* The driver granted more than was checked against the limit and the
 * container may not keep it: free the allocation, let the pool release what
 * it grew by (down to `keep`), and refuse. */
static MG_COLD CUresult mg_pool_undo(int how, CUdeviceptr d, CUstream hs, uint64_t pool, uint64_t n, uint64_t keep,
                                     int can_trim) {
    uint64_t bytes = 0, aux = 0, slop = 0;
    int mine = mg_tab_take_slop(&g_ptrs, d, &bytes, &aux, &slop);
    atomic_fetch_add(&g_pool_unlocked, 1); /* the free and synchronize below run without g_pool_mu */
    CUresult rc = how == PA_ASYNC_PTSZ || how == PA_POOL_PTSZ ? CALL_REAL(cuMemFreeAsync_ptsz, d, hs)
                                                              : CALL_REAL(cuMemFreeAsync, d, hs);
    if (rc == CUDA_SUCCESS) { /* the freed block must be seen completed before the pool may release it */
        if (how == PA_ASYNC_PTSZ || how == PA_POOL_PTSZ)
            (void)CALL_REAL(cuStreamSynchronize_ptsz, hs);
        else
            (void)CALL_REAL(cuStreamSynchronize, hs);
    }
    pthread_mutex_lock(&g_pool_mu);
    if (rc == CUDA_SUCCESS && can_trim) (void)CALL_REAL(cuMemPoolTrimTo, (CUmemoryPool)(uintptr_t)pool, keep);
    if (rc == CUDA_SUCCESS && mine) mg_pool_dropped(aux);
    else if (rc == CUDA_SUCCESS) { /* never recorded: still follow what the pool holds now */
        mg_pool_t *p = mg_pool_find(pool, 0);
        if (p) mg_pool_reconcile(p);
    }
    atomic_fetch_sub(&g_pool_unlocked, 1);
    pthread_mutex_unlock(&g_pool_mu);
    if (rc == CUDA_SUCCESS) {
        mg_pools_synced(); /* the synchronize released other pools' memory too */
        mg_uncharge(mine ? bytes : n);
    } else if (mine) {
        mg_tab_put_slop(&g_ptrs, d, bytes, aux, slop); /* still allocated: still counted */
    } /* else: still allocated and never recorded: stays counted (never under) */
    return mg_refuse(atomic_load_explicit(&g_slot, memory_order_acquire));
}

/* Steady state (the pool known, the guess right): g_pool_mu held once across
 * the real call and one RESERVED + USED read after it (none when the block
 * freed last comes back for the same size); no charge at all when the pool
 * served the allocation from idle memory already counted. The reservation before the call
 * is the one last read (the driver only grows a pool inside a hooked call made
 * under g_pool_mu; releases it misses can only make it high, never low). */
static CUresult mg_pool_alloc(int how, CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream hs) {
    /* Before any driver call: one served wholly from idle bytes never reaches mg_charge. */
    mg_swap_gate();
    if (!mg_on()) return mg_refusing() ? CUDA_ERROR_OUT_OF_MEMORY : mg_pool_real_alloc(how, dptr, size, pool, hs);
    if (!dptr || size == 0) return mg_pool_real_alloc(how, dptr, size, pool, hs); /* refused, nothing to count */
    /* Captured into a graph: a memory node, counted when the graph gets its memory (mg_graph.c). */
    if (MG_UNLIKELY(atomic_load_explicit(&mg_capturing, memory_order_relaxed)) && mg_stream_capturing(hs))
        return mg_pool_real_alloc(how, dptr, size, pool, hs);
    /* A host-located pool hands out host RAM: not GPU memory. */
    if (pool && MG_UNLIKELY(mg_tab_find(&g_hostpools, (uint64_t)(uintptr_t)pool) != NULL))
        return mg_pool_real_alloc(how, dptr, size, pool, hs);
    uint64_t n = size;
    int by_stream = how == PA_ASYNC || how == PA_ASYNC_PTSZ;
    uint64_t want_pool = (uint64_t)(uintptr_t)pool;
    if (by_stream) want_pool = t_pool_guess ? t_pool_guess : mg_current_pool();

    /* 1. What the pool holds idle serves first: those bytes are counted already. */
    uint64_t take = 0;
    pthread_mutex_lock(&g_pool_mu);
    mg_pool_t *p = mg_pool_find(want_pool, 0);
    if (p && !p->destroyed && p->idle) {
        take = p->idle < n ? p->idle : n;
        mg_pool_set_idle(p, p->idle - take);
    }

    /* 2. The rest against the limit: fast path, the arbiter, or a refusal. */
    CUresult rc;
    if (take < n) {
        pthread_mutex_unlock(&g_pool_mu);
        rc = mg_charge(n - take);
        if (rc != CUDA_SUCCESS) {
            mg_pool_untake(want_pool, take);
            return rc;
        }
        pthread_mutex_lock(&g_pool_mu);
    }

    /* 3. The driver call; the pool's reservation before it as last read. */
    uint64_t r0 = 0, extra = 0, got = want_pool;
    int have_r0 = 0, reclaimed = 0;
    for (;;) {
        p = mg_pool_find(want_pool, 0);
        if (p && p->known && !p->destroyed)
            r0 = p->res, have_r0 = 1;
        else
            have_r0 = want_pool && mg_pool_read(want_pool, &r0, NULL) == 0;
        rc = mg_pool_real_alloc(how, dptr, size, pool, hs);
        if (rc == CUDA_SUCCESS) break; /* still holding g_pool_mu */
        if (p) mg_pool_lf(p, 0, 0, 0); /* a refused allocation may have made the pool release blocks */
        pthread_mutex_unlock(&g_pool_mu);
        if (rc != CUDA_ERROR_OUT_OF_MEMORY || reclaimed || !mg_reclaim(rc, n)) {
            mg_pool_untake(want_pool, take);
            mg_uncharge(n - take);
            return rc;
        }
        reclaimed = 1;
        pthread_mutex_lock(&g_pool_mu);
    }
    uint64_t d = *dptr, r1 = 0, u1 = 0;
    int have_ru = 0;
    /* The block freed into the pool last came back, for an allocation of the
     * same size: the pool served it from its own reservation (a block it holds
     * is not reserved again), so RESERVED stands, USED grew by that block's
     * footprint, and the pool is the one it was freed into (it keeps the block
     * until a synchronize or trim releases it, and none is in flight): no
     * driver read. Anything else reads the pool, as below. */
    if (p && p->known && !p->destroyed && p->lf_ptr == d && d && p->lf_size == n && p->lf_foot >= n &&
        p->lf_foot != MG_FOOT_UNKNOWN && atomic_load(&g_pool_unlocked) == 0 &&
        atomic_load(&g_pool_syncing) == 0) {
        r1 = p->res, u1 = p->used + p->lf_foot, have_ru = 1;
        if (by_stream) t_pool_guess = got;
    } else if (by_stream) { /* which pool it really came from */
        /* The guessed pool's USED grew: it was that one. Only a hooked
         * allocation, made under g_pool_mu, can make a pool's USED grow (frees
         * made without the mutex only lower it, and none is in flight). */
        if (p && p->known && !p->destroyed && atomic_load(&g_pool_unlocked) == 0 &&
            mg_pool_read(want_pool, &r1, &u1) == 0 && u1 > p->used)
            have_ru = 1;
        else {
            mg_ptr_attr_fn attr = (mg_ptr_attr_fn)mg_plain(P_cuPointerGetAttribute);
            void *h = NULL;
            if (attr && attr(&h, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, d) == CUDA_SUCCESS && h)
                got = (uint64_t)(uintptr_t)h;
        }
        t_pool_guess = got;
    }
    if (got != want_pool) {
        /* Another pool than the one that lent its idle bytes: they go back to
         * it, this allocation is counted in full, and all of it needs admission. */
        mg_pool_t *lender = mg_pool_find(want_pool, 0);
        if (lender && take) mg_pool_set_idle(lender, lender->idle + take);
        else mg_uncharge(take);
        if (lender) mg_pool_reconcile(lender);
        mg_force_charge(take);
        extra = n;
    }
    mg_pool_t *rec = mg_pool_find(got, 1);
    if (rec && rec->destroyed) rec->destroyed = 0, rec->known = 0; /* the handle of a destroyed pool came back */
    uint64_t forced = 0, foot = MG_FOOT_UNKNOWN;
    if (rec && (have_ru || mg_pool_read(got, &r1, &u1) == 0)) {
        if (got == want_pool && have_r0 && r1 > r0 && r1 - r0 > n - take)
            extra = r1 - r0 - (n - take); /* the pool grew by more than was checked */
        /* The footprint (USED grew by it; at least n): what a free will make idle. */
        if (rec->known && u1 >= rec->used && u1 - rec->used >= n && atomic_load(&g_pool_unlocked) == 0)
            foot = u1 - rec->used;
        forced = mg_pool_apply(rec, r1, u1);
    } else if (rec) {
        rec->known = 0;
    }
    int put = rec && mg_tab_put_slop(&g_ptrs, d, n, got, foot == MG_FOOT_UNKNOWN ? foot : foot - n) == 0;
    if (put) rec->live++;
    if (forced > extra) extra = forced;
    pthread_mutex_unlock(&g_pool_mu);
    if (!rec) {
        MG_WARN_ONCE(g_warned_pools, "more than %d memory pools: refusing allocations from more", MG_POOL_SLOTS);
        *dptr = 0;
        return mg_pool_undo(how, d, hs, got, n, 0, 0);
    }
    if (!put)
        MG_WARN_ONCE(g_warned_track,
                     "allocation table full (MEMGUARD_TRACK_BITS): some memory stays counted after free");

    /* 4. Whatever the pool grew by beyond the check must still fit. */
    if (MG_UNLIKELY(extra) && !mg_admit(extra)) {
        *dptr = 0;
        return mg_pool_undo(how, d, hs, got, n, r0, have_r0 && got == want_pool);
    }
    return CUDA_SUCCESS;
}

HOOK CUresult mg_h_cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    return mg_pool_alloc(PA_ASYNC, dptr, bytesize, NULL, hStream);
}
HOOK CUresult mg_h_cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    return mg_pool_alloc(PA_ASYNC_PTSZ, dptr, bytesize, NULL, hStream);
}
HOOK CUresult mg_h_cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream) {
    return mg_pool_alloc(PA_POOL, dptr, bytesize, pool, hStream);
}
HOOK CUresult mg_h_cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                                CUstream hStream) {
    return mg_pool_alloc(PA_POOL_PTSZ, dptr, bytesize, pool, hStream);
}

/* Before the real free of a pool allocation: a stream-ordered free only
 * enqueues (never blocks), so it runs under g_pool_mu and the pool's USED is
 * followed without a read; cuMemFree may block, so it runs unlocked. */
int mg_pool_free_begin(int in_order) {
    if (in_order) {
        pthread_mutex_lock(&g_pool_mu);
        return 1;
    }
    atomic_fetch_add(&g_pool_unlocked, 1);
    return 0;
}

/* A pool allocation was freed (any free entry point). The driver keeps the
 * block reserved (it releases only at a synchronize, a trim or a destroy), so
 * its footprint moves from USED to idle: counted as idle before the live bytes
 * go, with no driver call when the footprint is known and the free was made
 * under g_pool_mu; else the pool is read. */
void mg_pool_freed(CUresult rc, uint64_t key, uint64_t bytes, uint64_t pool, uint64_t slop, int locked) {
    if (!locked) pthread_mutex_lock(&g_pool_mu);
    if (rc != CUDA_SUCCESS) {
        mg_tab_put_slop(&g_ptrs, key, bytes, pool, slop);
    } else {
        uint64_t foot;
        foot = slop == MG_FOOT_UNKNOWN || bytes + slop < bytes ? MG_FOOT_UNKNOWN : bytes + slop;
        mg_pool_t *p = mg_pool_find(pool, 0);
        uint64_t idle_in = 0, gone = bytes;
        if (p) {
            if (p->live) p->live--;
            if (p->destroyed && p->live == 0) { /* its last allocation: the driver frees the pool now */
                gone += p->idle;
                mg_pool_remove(p);
            } else if (p->destroyed) { /* the block stays with the dying pool */
                if (foot != MG_FOOT_UNKNOWN) mg_pool_set_idle(p, p->idle + (idle_in = foot));
            } else if (locked && p->known && foot != MG_FOOT_UNKNOWN && p->used >= foot) {
                p->used -= foot;
                mg_pool_set_idle(p, p->idle + (idle_in = foot));
                mg_pool_lf(p, key, bytes, foot);
            } else {
                mg_pool_reconcile(p);
            }
        }
        if (idle_in >= gone) /* idle counted before the live bytes go: never under */
            mg_force_charge(idle_in - gone);
        else
            mg_uncharge(gone - idle_in);
    }
    if (!locked) atomic_fetch_sub(&g_pool_unlocked, 1);
    pthread_mutex_unlock(&g_pool_mu);
    if (rc == CUDA_SUCCESS) mg_maybe_return_grant();
}

HOOK CUresult mg_h_cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep) {
    mg_swap_gate();
    mg_sync_begin();
    CUresult rc = CALL_REAL(cuMemPoolTrimTo, pool, minBytesToKeep);
    if (rc != CUDA_SUCCESS || !mg_on()) {
        mg_sync_end();
        return rc;
    }
    pthread_mutex_lock(&g_pool_mu);
    mg_pool_t *p = mg_pool_find((uint64_t)(uintptr_t)pool, 0);
    if (p) mg_pool_reconcile(p);
    pthread_mutex_unlock(&g_pool_mu);
    mg_sync_end();
    mg_maybe_return_grant();
    return rc;
}

/* Pools on a host location are remembered so their allocations pass uncounted. */
HOOK CUresult mg_h_cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props) {
    mg_swap_gate();
    CUresult rc = CALL_REAL(cuMemPoolCreate, pool, props);
    if (rc == CUDA_SUCCESS && pool && mg_on() && mg_loc_host(props) &&
        mg_tab_put(&g_hostpools, (uint64_t)(uintptr_t)*pool, 0, 0) != 0)
        MG_WARN_ONCE(g_warned_pools, "too many host memory pools: allocations from more are counted as GPU memory");
    return rc;
}

/* The driver frees a destroyed pool's memory at once if nothing allocated from
 * it is outstanding, else with the last outstanding allocation: its idle stays
 * counted until then (the driver's reservation cannot be read any more). */
HOOK CUresult mg_h_cuMemPoolDestroy(CUmemoryPool pool) {
    mg_swap_gate();
    if (!mg_on()) return CALL_REAL(cuMemPoolDestroy, pool);
    uint64_t none = 0;
    if (mg_tab_take(&g_hostpools, (uint64_t)(uintptr_t)pool, &none, NULL)) {
        CUresult hrc = CALL_REAL(cuMemPoolDestroy, pool);
        if (hrc != CUDA_SUCCESS) mg_tab_put(&g_hostpools, (uint64_t)(uintptr_t)pool, 0, 0);
        return hrc;
    }
    uint64_t freed = 0;
    pthread_mutex_lock(&g_pool_mu);
    CUresult rc = CALL_REAL(cuMemPoolDestroy, pool);
    mg_pool_t *p = rc == CUDA_SUCCESS ? mg_pool_find((uint64_t)(uintptr_t)pool, 0) : NULL;
    if (p && p->live == 0) {
        freed = p->idle;
        mg_pool_remove(p);
    } else if (p) {
        p->destroyed = 1;
    }
    pthread_mutex_unlock(&g_pool_mu);
    if (freed) {
        mg_uncharge(freed);
        mg_maybe_return_grant();
    }
    return rc;
}

/* Synchronize points: where pools release memory above their threshold. */
#define SYNC_HOOK(sym, params, ...)                   \
    HOOK CUresult mg_h_##sym params {                 \
        mg_swap_gate();                               \
        mg_sync_begin();                              \
        CUresult rc = CALL_REAL(sym, __VA_ARGS__);    \
        if (mg_on()) mg_pools_synced();               \
        mg_sync_end();                                \
        return rc;                                    \
    }

SYNC_HOOK(cuStreamSynchronize, (CUstream hStream), hStream)
SYNC_HOOK(cuStreamSynchronize_ptsz, (CUstream hStream), hStream)
SYNC_HOOK(cuEventSynchronize, (CUevent hEvent), hEvent)
HOOK CUresult mg_h_cuCtxSynchronize(void) {
    mg_swap_gate();
    mg_sync_begin();
    CUresult rc = CALL_REAL(cuCtxSynchronize);
    if (mg_on()) mg_pools_synced();
    mg_sync_end();
    return rc;
}
SYNC_HOOK(cuCtxSynchronize_v2, (CUcontext ctx), ctx)

MG_SYMBOLS_POOL(MG_XALIAS)
