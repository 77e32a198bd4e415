/*
 * memguard: the CUDA allocation shim (LD_PRELOAD), libmemguard.so.
 *
 * It holds every process of a container to the container's GPU-memory request
 * and limit, which the agent publishes in $GPUFRAC_CONTAINER_DIR/config
 * (memguard_abi.h). Usage is counted per container in the shared usage file.
 *
 * This header is what the sources of libmemguard.so share: the driver ABI they
 * need (mg_driver.h), the one hook table (its rows, by source), the process
 * state and the functions one source offers the others. Every function
 * declared here is hidden: only the hooks are exported, each by its own source
 * under the driver's name (MG_XALIAS). The sources, one job each:
 *   mg_symbols.c  the hook table, real-symbol resolution, dlsym and cuGetProcAddress
 *   mg_gate.c     the swap-in gate of every entry point the shim does not hook (trampolines)
 *   mg_init.c     process state, the two files, init, fork and exit
 *   mg_slots.c    process slots in the usage file: claim, release, reap the dead
 *   mg_tab.c      lock-free handle -> counted size tables
 *   mg_account.c  the limits (config seqlock) and counting against them
 *   mg_arbiter.c  the arbiter client: bursts, reclaims, grant returns, swap-in
 *   mg_alloc.c    cuMemAlloc* / cuMemAllocPitch* / cuMemFree* hooks
 *   mg_pool.c     memory pools (stream-ordered allocation) and synchronize points
 *   mg_vmm.c      virtual memory management (cuMemCreate, map, unmap, release)
 *   mg_array.c    CUDA arrays and mipmapped arrays
 *   mg_view.c     memory queries: the container's total and free memory
 *   mg_nvml.c     NVML's process lists, utilisation and BAR1, the container's view
 *   mg_launch.c   kernel and graph launches: activity, the swap-in gate, the compute pace
 *   mg_compute.c  the compute share's launch pace: the container's launch clock
 *   mg_copy.c     copies, memsets, stream and event queries: the swap-in gate alone
 *   mg_ctx.c      contexts, modules, libraries and cuCtxSetLimit memory
 *   mg_measure.c  how much memory such a call took, measured around it
 *   mg_graph.c    CUDA graph memory and stream capture
 *
 * Design rules every source keeps: nothing on the fast path (an allocation
 * within request + grant) but the real call and atomics: no syscall, no getenv,
 * no lock, no scan; no lock shared between processes (a process killed at any
 * instruction leaves both files usable). Memory pools (cuMemAllocAsync & co.)
 * also count what a pool keeps reserved after frees (mg_pool.c): those calls
 * take a process-local mutex (never one in a shared file) and read the pool's
 * attributes through the driver. Context and graph calls take process-local
 * mutexes of their own (mg_ctx.c, mg_graph.c); measuring a context device-wide
 * (no per-process figure) also takes turns by a lock the kernel drops when its
 * holder dies (mg_measure.c). The
 * fast path's helpers (mg_mode, mg_slot, mg_real) are inline here so it stays
 * one load each across sources.
 *
 * State one source defines and others use keeps a g_ name and is declared here
 * with the source that defines it; everything else a source keeps is static.
 */
#ifndef GPUFRAC_MEMGUARD_INTERNAL_H
#define GPUFRAC_MEMGUARD_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "memguard_abi.h"
#include "mg_driver.h"

#define MG_HIDDEN __attribute__((visibility("hidden")))
#define MG_LIKELY(x) __builtin_expect(!!(x), 1)
#define MG_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define MG_EXPORT __attribute__((visibility("default")))
#define MG_COLD __attribute__((cold, noinline))
/* A hook: hidden, exported only under the driver's name by MG_XALIAS. */
#define HOOK MG_HIDDEN

/* ------------------------------------------------------------------------ */
/* The hook table: one row per entry point, listed by the source that hooks it. */

enum { LIB_CUDA, LIB_NVML };

#include "mg_symbols.h"

enum {
#define MG_XENUM(sym, base, ver, lib, ptds) S_##sym,
    MG_SYMBOLS_ALL(MG_XENUM)
#undef MG_XENUM
    S_COUNT
};

/* Each entry's library, known when compiling (what a missing function answers). */
enum {
#define MG_XLIB(sym, base, ver, lib, ptds) L_##sym = lib,
    MG_SYMBOLS_ALL(MG_XLIB)
#undef MG_XLIB
};

/* The driver's functions behind the table, resolved once (mg_symbols.c). */
extern MG_HIDDEN void *_Atomic g_real[S_COUNT];
MG_HIDDEN MG_COLD void *mg_resolve(int i);

static inline void *mg_real(int i) {
    void *p = atomic_load_explicit(&g_real[i], memory_order_acquire);
    return MG_LIKELY(p != NULL) ? p : mg_resolve(i);
}

/* The real function of hook `sym`, typed like the hook. */
#define REAL(sym) ((__typeof__(&mg_h_##sym))mg_real(S_##sym))
/* Call it, or report "not found" if the driver lacks it. */
#define CALL_REAL(sym, ...)                                                                          \
    __extension__({                                                                                  \
        __typeof__(&mg_h_##sym) f_ = REAL(sym);                                                      \
        f_ ? f_(__VA_ARGS__) : ((int)L_##sym == LIB_NVML ? NVML_ERROR_FUNCTION_NOT_FOUND : CUDA_ERROR_NOT_FOUND); \
    })

/* Export each hook under the driver's name (each source, for its own rows). The
 * table holds the local address, so another library interposing the same name
 * cannot redirect it. */
#define MG_XALIAS(sym, base, ver, lib, ptds) \
    extern __typeof__(mg_h_##sym) sym __attribute__((alias("mg_h_" #sym), visibility("default")));

/* A driver function the shim calls for itself, by name (NULL if absent). */
MG_HIDDEN void *mg_driver_fn(int lib, const char *name);
/* Driver functions the shim calls for itself and does not hook (memory pools). */
enum { P_cuMemPoolGetAttribute, P_cuPointerGetAttribute, P_cuCtxGetDevice, P_cuDeviceGetMemPool, P_COUNT };
MG_HIDDEN void *mg_plain(int i);
typedef void *(*dlsym_fn)(void *, const char *);
MG_HIDDEN dlsym_fn mg_init_real_dlsym(void); /* the real dlsym, found once */

/* ------------------------------------------------------------------------ */
/* Process state (mg_init.c, mg_slots.c).                                    */

enum { MODE_UNINIT = 0, MODE_INITING, MODE_OFF, MODE_ON, MODE_BROKEN, MODE_DONE };
extern MG_HIDDEN _Atomic int g_mode;
extern MG_HIDDEN const mg_config_t *g_cfg;
extern MG_HIDDEN mg_usage_t *g_usage;
extern MG_HIDDEN mg_proc_slot_t *_Atomic g_slot;
extern MG_HIDDEN char g_dir[];
extern MG_HIDDEN char g_sock_path[];   /* $GPUFRAC_CONTAINER_DIR/arbiter/arbiter.sock */
extern MG_HIDDEN char g_sock_legacy[]; /* $GPUFRAC_CONTAINER_DIR/arbiter.sock (an older agent's mount) */
extern MG_HIDDEN int32_t g_pid;
extern MG_HIDDEN uint64_t g_start; /* this process's /proc starttime, set when it claims a slot */
extern MG_HIDDEN int g_nvml_pids_local; /* NVML's pids are this pid namespace's (see mg_nvml.c) */
extern MG_HIDDEN _Atomic int g_warned_track;

MG_HIDDEN MG_COLD int mg_init_slow(void);

static inline int mg_mode(void) {
    int m = atomic_load_explicit(&g_mode, memory_order_acquire);
    return MG_LIKELY(m >= MODE_OFF) ? m : mg_init_slow();
}
static inline int mg_on(void) { return mg_mode() == MODE_ON; }
static inline int mg_refusing(void) { return mg_mode() == MODE_BROKEN; }

MG_HIDDEN void mg_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#define MG_WARN_ONCE(flag, ...)                                      \
    do {                                                             \
        if (!atomic_exchange_explicit(&(flag), 1, memory_order_relaxed)) \
            mg_log(__VA_ARGS__);                                     \
    } while (0)

/* Saturating atomic subtraction: a counter never wraps to "17 TB used". */
static inline void mg_sat_sub(_Atomic uint64_t *a, uint64_t v) {
    uint64_t cur = atomic_load_explicit(a, memory_order_relaxed);
    uint64_t next;
    do {
        next = cur > v ? cur - v : 0;
    } while (!atomic_compare_exchange_weak_explicit(a, &cur, next, memory_order_acq_rel, memory_order_relaxed));
}

static inline uint64_t mg_coarse_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts); /* vDSO: no system call */
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Process slots (mg_slots.c). */
MG_HIDDEN MG_COLD mg_proc_slot_t *mg_claim_slot(void);

static inline mg_proc_slot_t *mg_slot(void) {
    mg_proc_slot_t *s = atomic_load_explicit(&g_slot, memory_order_acquire);
    return MG_LIKELY(s != NULL) ? s : mg_claim_slot();
}

extern MG_HIDDEN pthread_mutex_t g_claim_mu;
MG_HIDDEN uint64_t mg_proc_start(int32_t pid, char *state);
MG_HIDDEN uint64_t mg_release_slot(mg_proc_slot_t *s, int32_t pid);
MG_HIDDEN MG_COLD int mg_reap(int full);
MG_HIDDEN MG_COLD void mg_reap_at_start(void);

/* ------------------------------------------------------------------------ */
/* Lock-free pointer -> counted size tables (mg_tab.c).                       */

#define KEY_EMPTY 0ull
#define KEY_TOMB UINT64_MAX

typedef struct {
    _Atomic uint64_t key;
    _Atomic uint64_t size;
    _Atomic uint64_t aux; /* g_handles: references; g_maps: the mapped handle */
    _Atomic uint64_t slop; /* g_ptrs, pool allocations: footprint - size (see mg_pool_alloc) */
} mg_ent_t;

typedef struct {
    mg_ent_t *_Atomic ents;
    uint64_t mask;
    unsigned shift;
} mg_tab_t;

extern MG_HIDDEN mg_tab_t g_ptrs, g_arrays, g_handles, g_maps;
extern MG_HIDDEN mg_tab_t g_hostpools; /* pools created with a host location: never counted */

MG_HIDDEN int mg_tab_init(mg_tab_t *t, unsigned bits);
MG_HIDDEN int mg_tab_put_slop(mg_tab_t *t, uint64_t key, uint64_t size, uint64_t aux, uint64_t slop);
MG_HIDDEN int mg_tab_put(mg_tab_t *t, uint64_t key, uint64_t size, uint64_t aux);
MG_HIDDEN int mg_tab_take_slop(mg_tab_t *t, uint64_t key, uint64_t *size, uint64_t *aux, uint64_t *slop);
MG_HIDDEN int mg_tab_take(mg_tab_t *t, uint64_t key, uint64_t *size, uint64_t *aux);
MG_HIDDEN mg_ent_t *mg_tab_find(mg_tab_t *t, uint64_t key);
MG_HIDDEN void mg_tab_reset(mg_tab_t *t);

/* ------------------------------------------------------------------------ */
/* Limits and accounting (mg_account.c).                                     */

typedef struct {
    uint64_t request, limit, grant, generation;
    uint32_t flags, arbiter_timeout_ms, wait_timeout_ms;
} mg_limits_t;

#define LOAD_CFG(field) __atomic_load_n(&g_cfg->field, __ATOMIC_RELAXED)

MG_HIDDEN int mg_read_limits(mg_limits_t *l);
MG_HIDDEN CUresult mg_charge(uint64_t bytes);
MG_HIDDEN void mg_force_charge(uint64_t bytes);
MG_HIDDEN int mg_admit(uint64_t bytes);
MG_HIDDEN void mg_uncharge(uint64_t bytes);
MG_HIDDEN MG_COLD CUresult mg_refuse(mg_proc_slot_t *s);
MG_HIDDEN CUresult mg_x_refuse(void); /* count a refusal; CUDA_ERROR_OUT_OF_MEMORY */
MG_HIDDEN MG_COLD int mg_reclaim(CUresult rc, uint64_t bytes);
MG_HIDDEN void mg_settle(mg_tab_t *t, CUresult rc, uint64_t key, uint64_t bytes);
MG_HIDDEN void mg_freed(mg_tab_t *t, CUresult rc, uint64_t key, int found, uint64_t bytes);
MG_HIDDEN uint64_t mg_container_total(void);
MG_HIDDEN uint64_t mg_process_counted(void); /* this process's slot: bytes counted for it */
MG_HIDDEN unsigned mg_nvml_self_pid(void);   /* this process's pid as NVML reports it, or 0 if unknown */
MG_HIDDEN void mg_nvml_learn_self(void);     /* ask the agent for it where NVML's pids are the host's */
MG_HIDDEN void mg_nvml_unlearn_self(void);   /* NVML does not list it under that pid: forget it */
MG_HIDDEN void mg_nvml_atfork_child(void);
MG_HIDDEN int mg_nvml_pids_foreign(void);    /* NVML's pids are the host's: this process's may be learnt */
MG_HIDDEN const char *mg_container_dir(void); /* $GPUFRAC_CONTAINER_DIR as the shim uses it */

/* The arbiter (mg_arbiter.c). */
MG_HIDDEN MG_COLD int mg_ask_arbiter(uint16_t op, uint64_t bytes, uint64_t total_after, const mg_limits_t *l);
MG_HIDDEN void mg_maybe_return_grant(void);
MG_HIDDEN void mg_exit_return_grant(void);
MG_HIDDEN MG_COLD void mg_swap_in(mg_proc_slot_t *s);
MG_HIDDEN MG_COLD uint32_t mg_ask_host_pid(void);

/* The swap-in gate. While the agent holds this process swapped out (its slot's
 * flag), the driver blocks every CUDA call of it until it is restored, and only the
 * shim can ask for that: so every hook of a driver entry point passes here before
 * its first driver call (the shim's own ones included, such as a pool's attributes).
 * Two loads when not swapped: the slot (none in a process that never counted
 * anything, which nobody swaps; none either while the shim is not ON) and its flag.
 * mg_charge and the launches check the flag themselves: the allocation hooks that
 * charge before any driver call (ALLOC_HOOK, the pitched ones) rely on it; every
 * other hook (frees, pools, VMM map/unmap/release/retain, contexts, modules,
 * graphs, copies, waits, queries, cuGetProcAddress) calls this, and so does every
 * other driver entry point, through mg_gate.c's trampolines. NVML is not the
 * CUDA driver and a locked process's NVML calls go through: not gated. */
static inline void mg_swap_gate(void) {
    mg_proc_slot_t *s = atomic_load_explicit(&g_slot, memory_order_acquire);
    if (MG_UNLIKELY(s != NULL && atomic_load_explicit(&s->swapped, memory_order_acquire))) mg_swap_in(s);
}

/* The gated trampolines of every other driver entry point (mg_gate.c): they test the
 * flag of the slot mg_gate_follow names (none: a zero word), one load past its address. */
MG_HIDDEN void mg_gate_follow(mg_proc_slot_t *s);
MG_HIDDEN void *mg_gate_wrap(const char *name, void *p);   /* a trampoline for the driver's `p` */
MG_HIDDEN int mg_gate_is_stub(const void *p);
MG_HIDDEN void mg_gate_atfork_child(void);
/* The compute share (mg_compute.c): the compute file, mapped at init when it is there,
 * and the paced path of a launch (`weight` launch slots: 1 for a kernel or a graph). */
extern MG_HIDDEN mg_compute_t *g_compute;
MG_HIDDEN void mg_compute_attach(const char *dir);
MG_HIDDEN MG_COLD void mg_pace_launch(uint32_t pace_ns, uint32_t weight);

/* ------------------------------------------------------------------------ */
/* What the hook sources offer each other.                                   */

/* mg_pool.c */
MG_HIDDEN void mg_pools_reset(void);
MG_HIDDEN int mg_pool_free_begin(int in_order);
MG_HIDDEN void mg_pool_freed(CUresult rc, uint64_t key, uint64_t bytes, uint64_t pool, uint64_t slop, int locked);
/* mg_vmm.c: does a cuMemCreate / cuMemPoolCreate allocation live in host RAM? */
MG_HIDDEN int mg_loc_host(const void *props);
/* mg_nvml.c */
MG_HIDDEN int mg_nvml_pids_local(void);

/* mg_measure.c: the memory a driver call took, measured around it (callers
 * hold mg_ctx.c's g_ov_mu from mg_meas_begin to mg_meas_release). */
typedef struct {
    CUdevice dev;
    uint64_t used0, free0, total0;
    uint64_t own0, mine0; /* NVML's figure for this process, this process's counted bytes */
    int ok, own_ok, turn;
    int64_t lo, hi; /* the device-wide reading's bounds for this kind of object */
    nvmlProcessInfo_t *l0; /* learning: NVML's processes before (none of them this one) */
    int n0;
} mg_meas_t;
MG_HIDDEN void mg_meas_begin(mg_meas_t *m, CUdevice dev);
MG_HIDDEN void mg_meas_learn_begin(mg_meas_t *m);
MG_HIDDEN int64_t mg_meas_end(mg_meas_t *m, CUresult rc);
MG_HIDDEN void mg_meas_release(mg_meas_t *m);
MG_HIDDEN void mg_meas_bound_ctx(mg_meas_t *m);
MG_HIDDEN void mg_meas_bound_limit(mg_meas_t *m, int limit, size_t old, size_t value, CUdevice dev);
MG_HIDDEN void mg_meas_atfork_child(void);
/* mg_ctx.c: does this process hold a context (so NVML may list it already)? */
MG_HIDDEN int mg_holds_context(void);

/* mg_graph.c: executable graphs whose memory is not yet counted (graph launches
 * look further only while this is non-zero), streams capturing now (stream-ordered
 * allocations look further only then), and the checks behind them. */
extern MG_HIDDEN _Atomic unsigned mg_graph_unmapped;
extern MG_HIDDEN _Atomic unsigned mg_capturing;
MG_HIDDEN CUresult mg_graph_launch(void *real_launch, CUgraphExec e, CUstream s);
MG_HIDDEN int mg_stream_capturing(CUstream s);

/* Every counted allocation: refuse while the files are broken, pass through
 * when the container is not limited; otherwise charge `bytes` first, call the
 * driver, then remember the handle in `out` under `tab` (or give the bytes
 * back if the driver failed). */
#define ALLOC_HOOK(sym, tab, out, bytes, params, ...)                                                     \
    HOOK CUresult mg_h_##sym params {                                                                      \
        if (!mg_on()) return mg_refusing() ? CUDA_ERROR_OUT_OF_MEMORY : CALL_REAL(sym, __VA_ARGS__);      \
        uint64_t bytes_ = (bytes);                                                                         \
        CUresult rc = mg_charge(bytes_);                                                                   \
        if (rc != CUDA_SUCCESS) return rc;                                                                 \
        rc = CALL_REAL(sym, __VA_ARGS__);                                                                  \
        if (MG_UNLIKELY(rc == CUDA_ERROR_OUT_OF_MEMORY) && mg_reclaim(rc, bytes_)) rc = CALL_REAL(sym, __VA_ARGS__); \
        mg_settle(&(tab), rc, rc == CUDA_SUCCESS && (out) ? (uint64_t)(uintptr_t)(*(out)) : 0, bytes_); \
        return rc;                                                                                         \
    }

/* Take the size out of the table before the real free (another thread's
 * allocation may get the same address right after it); put it back if the
 * driver refuses the free. Pool allocations (any free entry point may free
 * them) leave their block idle in the pool: see mg_pool_freed. */
#define FREE_HOOK(sym, tab, key, in_order, params, ...)                 \
    HOOK CUresult mg_h_##sym params {                                   \
        mg_swap_gate();                                                 \
        if (!mg_on()) return CALL_REAL(sym, __VA_ARGS__);               \
        uint64_t bytes = 0, aux = 0, slop = 0, key_ = (uint64_t)(key);  \
        int found = mg_tab_take_slop(&(tab), key_, &bytes, &aux, &slop); \
        if (found && aux > 1) { /* a pool allocation (aux: its pool) */ \
            int locked_ = mg_pool_free_begin(in_order);                 \
            CUresult rc = CALL_REAL(sym, __VA_ARGS__);                  \
            mg_pool_freed(rc, key_, bytes, aux, slop, locked_);         \
            return rc;                                                  \
        }                                                               \
        CUresult rc = CALL_REAL(sym, __VA_ARGS__);                      \
        mg_freed(&(tab), rc, key_, found, bytes);                       \
        return rc;                                                      \
    }

#endif
