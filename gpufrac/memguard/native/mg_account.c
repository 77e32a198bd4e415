/*
 * memguard: the limits (the config under its seqlock) and counting bytes
 * against them, in the container's total and this process's slot.
 *
 * Accounting. usage->total_used is the container's total: bytes are reserved
 * there by CAS *before* the real allocation (so concurrent processes can never
 * overshoot the limit together) and given back if the driver fails. Each
 * process owns a slot (claimed by CAS on pid) holding its own bytes, so when it
 * dies whoever notices subtracts exactly those bytes once (CAS pid -> -1).
 * Every subtraction saturates at zero. No lock is shared between processes;
 * a process killed at any instruction leaves both files usable.
 *
 * Order of the two counters: a kill landing between the total and the slot
 * update can only leave the container over-counted by that one allocation
 * (never under-counted, which would loosen the limit): on allocation the total
 * is charged before the slot, on free the slot is credited before the total.
 * A kill during the real driver call is exact: both counters hold the bytes.
 *
 * Fast path (within request + grant): atomic loads of the config under its
 * seqlock, one CAS on the total, relaxed atomics on the slot and one table
 * insert: no syscall, no getenv, no lock, no scan.
 */
#include <sched.h>

#include "mg_internal.h"

/* Spin-wait hint while a seqlock writer finishes. */
static inline void mg_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* ------------------------------------------------------------------------ */
/* Limits.                                                                   */

/* An odd seq that never turned even: its writer died mid-update. Later reads
 * fail at once while the seq stays at that value, rather than spin again. */
static _Atomic uint64_t g_stuck_seq;
static _Atomic int g_warned_config;

static MG_COLD int mg_config_stuck(uint64_t seq) {
    if (seq & 1) atomic_store_explicit(&g_stuck_seq, seq, memory_order_relaxed);
    MG_WARN_ONCE(g_warned_config, "%s/%s: an agent update never completed (seqlock stays odd)", g_dir,
                 MG_CONFIG_FILE);
    return -1;
}

/* A consistent snapshot of the config (seqlock reader). */
int mg_read_limits(mg_limits_t *l) {
    for (unsigned spin = 0;; spin++) {
        uint64_t s1 = atomic_load_explicit(&g_cfg->seq, memory_order_acquire);
        if (MG_LIKELY(!(s1 & 1))) {
            l->request = LOAD_CFG(request_bytes);
            l->limit = LOAD_CFG(limit_bytes);
            l->grant = LOAD_CFG(grant_bytes);
            l->generation = LOAD_CFG(generation);
            l->flags = LOAD_CFG(flags);
            l->arbiter_timeout_ms = LOAD_CFG(arbiter_timeout_ms);
            l->wait_timeout_ms = LOAD_CFG(wait_timeout_ms);
            atomic_thread_fence(memory_order_acquire);
            if (atomic_load_explicit(&g_cfg->seq, memory_order_relaxed) == s1) {
                if (l->limit < l->request) l->limit = l->request; /* never a limit below the guarantee */
                return 0;
            }
        } else if (s1 == atomic_load_explicit(&g_stuck_seq, memory_order_relaxed)) {
            return -1;
        }
        /* A writer is mid-update (microseconds) or was descheduled: back off,
         * and give up after about a second rather than hang the app. */
        if (spin < 1000) {
            mg_cpu_relax();
        } else if (spin < 1000 + 100000) {
            sched_yield();
        } else {
            return mg_config_stuck(s1);
        }
    }
}

/* ------------------------------------------------------------------------ */
/* Accounting.                                                               */

MG_COLD CUresult mg_refuse(mg_proc_slot_t *s) {
    if (s) atomic_fetch_add_explicit(&s->oom_refusals, 1, memory_order_relaxed);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult mg_x_refuse(void) { return mg_refuse(atomic_load_explicit(&g_slot, memory_order_acquire)); }

const char *mg_container_dir(void) { return g_dir; }

uint64_t mg_container_total(void) {
    return g_usage ? atomic_load_explicit(&g_usage->total_used, memory_order_acquire) : 0;
}

uint64_t mg_process_counted(void) {
    mg_proc_slot_t *s = atomic_load_explicit(&g_slot, memory_order_acquire);
    return s ? atomic_load_explicit(&s->used_bytes, memory_order_acquire) : 0;
}

/* This process's share of bytes already added to the total (and its peak). */
static void mg_slot_add(mg_proc_slot_t *s, uint64_t bytes) {
    uint64_t mine = atomic_fetch_add_explicit(&s->used_bytes, bytes, memory_order_relaxed) + bytes;
    uint64_t peak = atomic_load_explicit(&s->peak_bytes, memory_order_relaxed);
    while (mine > peak && !atomic_compare_exchange_weak_explicit(&s->peak_bytes, &peak, mine, memory_order_relaxed,
                                                                 memory_order_relaxed)) {
    }
}

/* Count bytes the driver already holds, limit or not (the truth is never
 * left uncounted; a limit check comes before or right after, see mg_admit). */
void mg_force_charge(uint64_t bytes) {
    mg_proc_slot_t *s = mg_slot();
    if (!s || bytes == 0) return; /* no slot: this process has no allocation to count either */
    uint64_t cur = atomic_load_explicit(&g_usage->total_used, memory_order_relaxed), next;
    do {
        next = cur + bytes < cur ? UINT64_MAX : cur + bytes;
    } while (!atomic_compare_exchange_weak_explicit(&g_usage->total_used, &cur, next, memory_order_acq_rel,
                                                    memory_order_relaxed));
    mg_slot_add(s, bytes);
}

/* The bytes the container may hold without asking: request + grant, within the
 * limit (a grant never lifts it past; a sum that wraps is the limit). */
static inline uint64_t mg_fast_ceiling(const mg_limits_t *l) {
    uint64_t fast = l->request + l->grant;
    return fast > l->limit || fast < l->request ? l->limit : fast;
}

/* Where mg_charge and mg_admit stand past the fast ceiling. */
typedef struct {
    int reaped, asked;
} mg_past_t;

/* Past the fast ceiling, `want` bytes in all: first the slots of dead processes
 * are reaped once (they may still count bytes), then the arbiter is asked once.
 * 1: read the limits and look again; 0: refused. */
static MG_COLD int mg_past_ceiling(mg_past_t *p, uint64_t bytes, uint64_t want, mg_limits_t *l) {
    if (!p->reaped) {
        p->reaped = 1;
        if (mg_reap(1) > 0) return 1;
    }
    if (want > l->limit || p->asked) return 0;
    p->asked = 1;
    return mg_ask_arbiter(MG_BURST_OP_BURST, bytes, want, l);
}

/* `bytes` were counted by force (the driver had already reserved them): may
 * the container keep them? Yes within request + grant; past it, the arbiter
 * decides as for any burst (the total already holds them); past the limit, no. */
MG_COLD int mg_admit(uint64_t bytes) {
    mg_proc_slot_t *s = mg_slot();
    if (!s) return 0;
    mg_past_t past = {0, 0};
    for (;;) {
        mg_limits_t l;
        if (mg_read_limits(&l) != 0 || (l.flags & MG_FLAG_DISABLED)) return 0;
        if (l.flags & MG_FLAG_WHOLE_GPU) return 1;
        uint64_t cur = atomic_load_explicit(&g_usage->total_used, memory_order_relaxed);
        if (cur <= mg_fast_ceiling(&l)) return 1;
        if (!mg_past_ceiling(&past, bytes, cur, &l)) return 0;
    }
}

/* Count `bytes` for this process before the real allocation. */
CUresult mg_charge(uint64_t bytes) {
    mg_proc_slot_t *s = mg_slot();
    if (MG_UNLIKELY(!s)) return CUDA_ERROR_OUT_OF_MEMORY;
    if (MG_UNLIKELY(atomic_load_explicit(&s->swapped, memory_order_acquire))) mg_swap_in(s);
    if (bytes == 0) return CUDA_SUCCESS;
    _Atomic uint64_t *total = &g_usage->total_used;
    mg_past_t past = {0, 0};
    for (;;) {
        mg_limits_t l;
        if (MG_UNLIKELY(mg_read_limits(&l) != 0) || MG_UNLIKELY(l.flags & MG_FLAG_DISABLED)) return mg_refuse(s);
        uint64_t fast = mg_fast_ceiling(&l);
        if (l.flags & MG_FLAG_WHOLE_GPU) fast = l.limit = UINT64_MAX; /* count, never limit */
        uint64_t cur = atomic_load_explicit(total, memory_order_relaxed), want;
        for (;;) {
            want = cur + bytes;
            if (want < cur) want = UINT64_MAX; /* overflow: certainly past the limit */
            if (want > fast) break;
            if (atomic_compare_exchange_weak_explicit(total, &cur, want, memory_order_acq_rel, memory_order_relaxed)) {
                mg_slot_add(s, bytes);
                return CUDA_SUCCESS;
            }
        }
        if (!mg_past_ceiling(&past, bytes, want, &l)) return mg_refuse(s);
    }
}

/* Give back `bytes` counted for this process (slot first, then total). */
void mg_uncharge(uint64_t bytes) {
    mg_proc_slot_t *s = atomic_load_explicit(&g_slot, memory_order_acquire);
    if (!s || bytes == 0) return;
    mg_sat_sub(&s->used_bytes, bytes);
    mg_sat_sub(&g_usage->total_used, bytes);
}

/* The real driver refused `bytes` (already counted) for lack of memory. Within the
 * container's request that memory is guaranteed, so others' bursts hold it
 * (lendUnusedRequests, or bursts granted meanwhile): ask the agent to take it back
 * (op RECLAIM, docs/arbiter-protocol.md). 1: it is free again, retry the real
 * allocation once. Past the request (grant-backed) the OOM stands, as before.
 * Only after a driver failure: the fast path never gets here. */
MG_COLD int mg_reclaim(CUresult rc, uint64_t bytes) {
    if (rc != CUDA_ERROR_OUT_OF_MEMORY || bytes == 0 || !g_usage) return 0;
    mg_limits_t l;
    if (mg_read_limits(&l) != 0 || (l.flags & (MG_FLAG_DISABLED | MG_FLAG_WHOLE_GPU))) return 0;
    uint64_t used = atomic_load_explicit(&g_usage->total_used, memory_order_relaxed);
    if (used > l.request) return 0;
    return mg_ask_arbiter(MG_BURST_OP_RECLAIM, bytes, used, &l);
}

/* After the real allocation: remember the size, or give it back on failure. */
void mg_settle(mg_tab_t *t, CUresult rc, uint64_t key, uint64_t bytes) {
    if (rc != CUDA_SUCCESS) {
        mg_uncharge(bytes);
    } else if (bytes && mg_tab_put(t, key, bytes, 1) != 0) {
        MG_WARN_ONCE(g_warned_track,
                     "allocation table full (MEMGUARD_TRACK_BITS): some memory stays counted after free");
    }
}

/* After the real free: uncount, or keep counting if the driver refused. */
void mg_freed(mg_tab_t *t, CUresult rc, uint64_t key, int found, uint64_t bytes) {
    if (!found) return; /* double free or foreign pointer: nothing of ours to give back */
    if (rc == CUDA_SUCCESS) {
        mg_uncharge(bytes);
        mg_maybe_return_grant();
    } else {
        mg_tab_put(t, key, bytes, 1);
    }
}
