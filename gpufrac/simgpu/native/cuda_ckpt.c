/*
 * simgpu fake libcuda.so.1 — the process checkpoint API (cuCheckpointProcess*),
 * called from another process (the agent's swap resolver) with the target's pid,
 * and the gate every API call of the target passes through.
 *
 * State lives in the target's proc slots in the node-state file (ckpt_state, the
 * same in all its slots). The target's API calls count themselves in the
 * api_inflight word of its gate slot and wait while the state is LOCKED or
 * CHECKPOINTED; Lock waits, up to its timeout, for in-flight calls to drain.
 * Checkpoint moves the target's used_bytes to swapped_bytes and gives the memory
 * back to the GPU (NVML no longer counts it); Restore takes it back, or fails with
 * CUDA_ERROR_OUT_OF_MEMORY and stays CHECKPOINTED. The target's buffers keep their
 * bytes and addresses (they are host memory).
 */
#include <errno.h>
#include <signal.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_internal.h"

simgpu_proc_t *_Atomic cu_g_gate_slot;

static void nap_us(long us) {
    struct timespec ts = {0, us * 1000};
    nanosleep(&ts, NULL);
}

static int blocked(uint32_t state) { return state == SIMGPU_CKPT_LOCKED || state == SIMGPU_CKPT_CHECKPOINTED; }

/* Count in first, then look: with Lock storing the state first and then reading
 * the count (both sequentially consistent), one of the two always sees the other. */
cu_gate_t cu_gate_enter(void) {
    simgpu_proc_t *s = atomic_load_explicit(&cu_g_gate_slot, memory_order_acquire);
    if (!s) return (cu_gate_t){NULL};
    for (;;) {
        atomic_fetch_add(&s->api_inflight, 1);
        if (!blocked(atomic_load(&s->ckpt_state))) return (cu_gate_t){s};
        atomic_fetch_sub(&s->api_inflight, 1);
        while (blocked(atomic_load(&s->ckpt_state))) nap_us(200);
    }
}

/* A forked child is another process: it must not count itself in its parent's slot. */
static void forget_gate(void) { atomic_store(&cu_g_gate_slot, NULL); }
__attribute__((constructor)) static void gate_init(void) { pthread_atfork(NULL, NULL, forget_gate); }

/* A process that exits gives its GPU memory back at once, as the driver does at
 * teardown; one killed outright is reaped by the next process that notices
 * (sim_reap_dead: an allocation that does not fit, an NVML process query). */
__attribute__((destructor)) static void release_slots_at_exit(void) {
    simgpu_node_t *n = cu_node();
    if (!n) return;
    int32_t me = sim_self_pid();
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++) {
        simgpu_proc_t *s = &n->procs[i];
        int32_t pid = me;
        if (!atomic_compare_exchange_strong(&s->pid, &pid, SIMGPU_PID_REAPING)) continue;
        uint64_t used = atomic_exchange(&s->used_bytes, 0);
        if (used && s->gpu < n->gpu_count) sim_mem_give(n, s->gpu, used);
        atomic_store(&s->swapped_bytes, 0);
        sim_slot_unlock(n, s);
        atomic_store(&s->pid, SIMGPU_PID_FREE);
    }
}

/* ------------------------------------------------------------------ agent side */

typedef struct {
    simgpu_node_t *n;
    simgpu_proc_t *slot[SIMGPU_MAX_GPUS];
    int count;
} target_t;

static CUresult target_find(int pid, target_t *t) {
    t->n = cu_node();
    if (!t->n) t->n = sim_node();
    if (!t->n) return CUDA_ERROR_NOT_INITIALIZED;
    if (!t->n->checkpoint_supported) return CUDA_ERROR_NOT_SUPPORTED;
    if (pid <= 0) return CUDA_ERROR_INVALID_VALUE;
    t->count = 0;
    for (int i = 0; i < SIMGPU_MAX_PROCS && t->count < SIMGPU_MAX_GPUS; i++)
        if (atomic_load(&t->n->procs[i].pid) == pid) t->slot[t->count++] = &t->n->procs[i];
    return t->count ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND; /* no CUDA context in that process */
}

static uint32_t target_state(const target_t *t) { return atomic_load(&t->slot[0]->ckpt_state); }

static void target_set(const target_t *t, uint32_t state) {
    for (int i = 0; i < t->count; i++) atomic_store(&t->slot[i]->ckpt_state, state);
}

static int zeroed(const void *p, size_t from, size_t to) {
    const unsigned char *b = p;
    for (size_t i = from; i < to; i++)
        if (b[i]) return 0;
    return 1;
}

CU_API CUresult cuCheckpointProcessGetState(int pid, int *state) {
    target_t t;
    if (!state) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = target_find(pid, &t);
    if (r) return r;
    *state = (int)target_state(&t);
    return CUDA_SUCCESS;
}

CU_API CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid) {
    target_t t;
    if (!tid) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = target_find(pid, &t);
    if (r) return r;
    *tid = pid; /* the simulation has no driver thread of its own: the main thread restores */
    return CUDA_SUCCESS;
}

CU_API CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args) {
    target_t t;
    if (args && !zeroed(args, offsetof(CUcheckpointLockArgs, reserved0), sizeof *args))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = target_find(pid, &t);
    if (r) return r;
    uint32_t expect = SIMGPU_CKPT_RUNNING;
    if (!atomic_compare_exchange_strong(&t.slot[0]->ckpt_state, &expect, SIMGPU_CKPT_LOCKED))
        return CUDA_ERROR_ILLEGAL_STATE;
    target_set(&t, SIMGPU_CKPT_LOCKED);
    uint64_t timeout_ms = args ? args->timeoutMs : 0;
    uint64_t deadline = timeout_ms ? sim_now_ns() + timeout_ms * 1000000u : UINT64_MAX;
    for (;;) { /* wait for the target's API calls in progress to drain */
        uint64_t inflight = 0;
        for (int i = 0; i < t.count; i++) inflight += atomic_load(&t.slot[i]->api_inflight);
        if (inflight == 0) return CUDA_SUCCESS;
        if (!sim_pid_exists(pid)) return CUDA_ERROR_INVALID_VALUE; /* it died meanwhile */
        if (sim_now_ns() >= deadline) {
            target_set(&t, SIMGPU_CKPT_RUNNING); /* on timeout the target stays RUNNING */
            return CUDA_ERROR_TIMEOUT;
        }
        nap_us(100);
    }
}

CU_API CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args) {
    target_t t;
    if (args && !zeroed(args, 0, sizeof *args)) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = target_find(pid, &t);
    if (r) return r;
    if (target_state(&t) != SIMGPU_CKPT_LOCKED) return CUDA_ERROR_ILLEGAL_STATE;
    for (int i = 0; i < t.count; i++) /* submitted work completes first */
        while (!sim_sched_idle(t.n, t.slot[i]->gpu, t.slot[i])) nap_us(100);
    for (int i = 0; i < t.count; i++) {
        simgpu_proc_t *s = t.slot[i];
        uint64_t used = atomic_exchange(&s->used_bytes, 0);
        atomic_fetch_add(&s->swapped_bytes, used);
        if (used) sim_mem_give(t.n, s->gpu, used);
    }
    target_set(&t, SIMGPU_CKPT_CHECKPOINTED);
    return CUDA_SUCCESS;
}

/* Only restoring onto the same GPUs is simulated: remapping pairs must be identities. */
CU_API CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args) {
    target_t t;
    if (args) {
        if (!zeroed(args, offsetof(CUcheckpointRestoreArgs, reserved), sizeof *args)) return CUDA_ERROR_INVALID_VALUE;
        if (args->gpuPairsCount && !args->gpuPairs) return CUDA_ERROR_INVALID_VALUE;
        for (unsigned int i = 0; i < args->gpuPairsCount; i++)
            if (memcmp(&args->gpuPairs[i].oldUuid, &args->gpuPairs[i].newUuid, sizeof(CUuuid)) != 0)
                return CUDA_ERROR_NOT_SUPPORTED;
    }
    CUresult r = target_find(pid, &t);
    if (r) return r;
    if (target_state(&t) != SIMGPU_CKPT_CHECKPOINTED) return CUDA_ERROR_ILLEGAL_STATE;
    int taken = 0;
    for (; taken < t.count; taken++) {
        simgpu_proc_t *s = t.slot[taken];
        uint64_t want = atomic_load(&s->swapped_bytes);
        if (want && sim_mem_take(t.n, s->gpu, want) != 0) break;
    }
    if (taken < t.count) { /* does not fit: give back what was taken, stay CHECKPOINTED */
        for (int i = 0; i < taken; i++) {
            uint64_t got = atomic_load(&t.slot[i]->swapped_bytes);
            if (got) sim_mem_give(t.n, t.slot[i]->gpu, got);
        }
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    for (int i = 0; i < t.count; i++) {
        simgpu_proc_t *s = t.slot[i];
        atomic_fetch_add(&s->used_bytes, atomic_exchange(&s->swapped_bytes, 0));
    }
    target_set(&t, SIMGPU_CKPT_LOCKED);
    return CUDA_SUCCESS;
}

CU_API CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args) {
    target_t t;
    if (args && !zeroed(args, 0, sizeof *args)) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = target_find(pid, &t);
    if (r) return r;
    if (target_state(&t) != SIMGPU_CKPT_LOCKED) return CUDA_ERROR_ILLEGAL_STATE;
    target_set(&t, SIMGPU_CKPT_RUNNING);
    return CUDA_SUCCESS;
}

const cu_sym_t cu_syms_ckpt[] = {
    CU_SYM("cuCheckpointProcessGetRestoreThreadId", 12080, cuCheckpointProcessGetRestoreThreadId),
    CU_SYM("cuCheckpointProcessGetState", 12080, cuCheckpointProcessGetState),
    CU_SYM("cuCheckpointProcessLock", 12080, cuCheckpointProcessLock),
    CU_SYM("cuCheckpointProcessCheckpoint", 12080, cuCheckpointProcessCheckpoint),
    CU_SYM("cuCheckpointProcessRestore", 12080, cuCheckpointProcessRestore),
    CU_SYM("cuCheckpointProcessUnlock", 12080, cuCheckpointProcessUnlock),
};
const size_t cu_syms_ckpt_n = sizeof cu_syms_ckpt / sizeof cu_syms_ckpt[0];
