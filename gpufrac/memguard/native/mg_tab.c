/*
 * memguard: lock-free pointer -> counted size tables, one per kind of handle
 * (device pointers, arrays, VMM handles, VMM mappings, host-located pools).
 *
 * Per process, device pointers / array handles / VMM handles map to their
 * counted size in lock-free open-addressing tables (no per-call scans): an
 * insert or a removal is a CAS on the key, so the fast path takes no lock.
 */
#include <sys/mman.h>

#include "mg_internal.h"

#define MAX_PROBE 256

mg_tab_t g_ptrs, g_arrays, g_handles, g_maps;
mg_tab_t g_hostpools;

int mg_tab_init(mg_tab_t *t, unsigned bits) {
    size_t bytes = sizeof(mg_ent_t) << bits;
    /* Untouched pages cost nothing: only slots that are used get memory. */
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return -1;
    t->mask = (1ull << bits) - 1;
    t->shift = 64 - bits;
    atomic_store_explicit(&t->ents, (mg_ent_t *)p, memory_order_release);
    return 0;
}

static inline uint64_t mg_hash(const mg_tab_t *t, uint64_t key) {
    return (key * 0x9E3779B97F4A7C15ull) >> t->shift;
}

/* Returns 0, or -1 if the key cannot be stored (then it stays counted). */
int mg_tab_put_slop(mg_tab_t *t, uint64_t key, uint64_t size, uint64_t aux, uint64_t slop) {
    mg_ent_t *e = atomic_load_explicit(&t->ents, memory_order_acquire);
    if (!e || key == KEY_EMPTY || key == KEY_TOMB) return -1;
    uint64_t h = mg_hash(t, key);
    for (unsigned n = 0; n < MAX_PROBE; n++, h = (h + 1) & t->mask) {
        uint64_t k = atomic_load_explicit(&e[h].key, memory_order_relaxed);
        if (k != KEY_EMPTY && k != KEY_TOMB) continue;
        if (atomic_compare_exchange_strong_explicit(&e[h].key, &k, key, memory_order_acq_rel, memory_order_relaxed)) {
            atomic_store_explicit(&e[h].size, size, memory_order_release);
            atomic_store_explicit(&e[h].aux, aux, memory_order_release);
            atomic_store_explicit(&e[h].slop, slop, memory_order_release);
            return 0;
        }
    }
    return -1;
}

int mg_tab_put(mg_tab_t *t, uint64_t key, uint64_t size, uint64_t aux) {
    return mg_tab_put_slop(t, key, size, aux, 0);
}

/* Removes `key`; returns 1 and its size (and aux, slop, if asked) if it was there. */
int mg_tab_take_slop(mg_tab_t *t, uint64_t key, uint64_t *size, uint64_t *aux, uint64_t *slop) {
    mg_ent_t *e = atomic_load_explicit(&t->ents, memory_order_acquire);
    if (!e || key == KEY_EMPTY || key == KEY_TOMB) return 0;
    uint64_t h = mg_hash(t, key);
    for (unsigned n = 0; n < MAX_PROBE; n++, h = (h + 1) & t->mask) {
        uint64_t k = atomic_load_explicit(&e[h].key, memory_order_acquire);
        if (k == KEY_EMPTY) return 0;
        if (k != key) continue;
        uint64_t sz = atomic_load_explicit(&e[h].size, memory_order_acquire);
        uint64_t ax = atomic_load_explicit(&e[h].aux, memory_order_acquire);
        uint64_t sl = atomic_load_explicit(&e[h].slop, memory_order_acquire);
        if (atomic_compare_exchange_strong_explicit(&e[h].key, &k, KEY_TOMB, memory_order_acq_rel,
                                                    memory_order_relaxed)) {
            *size = sz;
            if (aux) *aux = ax;
            if (slop) *slop = sl;
            return 1;
        }
        return 0; /* another thread freed the same pointer first */
    }
    return 0;
}

int mg_tab_take(mg_tab_t *t, uint64_t key, uint64_t *size, uint64_t *aux) {
    return mg_tab_take_slop(t, key, size, aux, NULL);
}

/* The live entry of `key`, or NULL. */
mg_ent_t *mg_tab_find(mg_tab_t *t, uint64_t key) {
    mg_ent_t *e = atomic_load_explicit(&t->ents, memory_order_acquire);
    if (!e || key == KEY_EMPTY || key == KEY_TOMB) return NULL;
    uint64_t h = mg_hash(t, key);
    for (unsigned n = 0; n < MAX_PROBE; n++, h = (h + 1) & t->mask) {
        uint64_t k = atomic_load_explicit(&e[h].key, memory_order_acquire);
        if (k == KEY_EMPTY) return NULL;
        if (k == key) return &e[h];
    }
    return NULL;
}

void mg_tab_reset(mg_tab_t *t) {
    mg_ent_t *e = atomic_exchange_explicit(&t->ents, NULL, memory_order_acq_rel);
    if (e) munmap(e, sizeof(mg_ent_t) * (t->mask + 1));
    mg_tab_init(t, 64 - t->shift);
}
