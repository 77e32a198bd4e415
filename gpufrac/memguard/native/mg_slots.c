/*
 * memguard: process slots in the usage file: claim, release, reap the dead.
 *
 * Each process owns a slot (claimed by CAS on pid) holding its own bytes, so
 * when it dies whoever notices subtracts exactly those bytes once (CAS pid ->
 * -1). No lock is shared between processes: the claim's mutex is this
 * process's own.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "mg_internal.h"

pthread_mutex_t g_claim_mu = PTHREAD_MUTEX_INITIALIZER;
static _Atomic int g_warned_slots;

/* starttime (field 22) and state (field 3) of /proc/<pid>/stat; 0 on failure. */
uint64_t mg_proc_start(int32_t pid, char *state) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* comm may hold spaces and parentheses */
    if (!p || p[1] != ' ') return 0;
    p += 2;
    if (state) *state = *p;
    for (int field = 3; field < 22; field++) {
        p = strchr(p, ' ');
        if (!p) return 0;
        p++;
    }
    return strtoull(p, NULL, 10);
}

/* Is the owner of slot `s` (which showed `pid`) gone? `full` also catches pid
 * reuse (start time differs) and zombies, at the price of reading /proc. */
static int mg_owner_dead(const mg_proc_slot_t *s, int32_t pid, int full) {
    if (kill(pid, 0) != 0 && errno == ESRCH) return 1;
    if (!full) return 0;
    char state = 0;
    uint64_t st = mg_proc_start(pid, &state);
    if (st == 0) return 0; /* unreadable: assume alive (never reclaim a live process's bytes) */
    if (state == 'Z' || state == 'X') return 1;
    uint64_t recorded = __atomic_load_n(&s->start_time, __ATOMIC_ACQUIRE);
    return recorded != 0 && recorded != st;
}

/* Give back the slot's bytes exactly once: only the CAS winner subtracts. */
uint64_t mg_release_slot(mg_proc_slot_t *s, int32_t pid) {
    int32_t expected = pid;
    if (!atomic_compare_exchange_strong(&s->pid, &expected, -1)) return 0;
    uint64_t used = atomic_exchange(&s->used_bytes, 0);
    mg_sat_sub(&g_usage->total_used, used);
    __atomic_store_n(&s->start_time, 0, __ATOMIC_RELAXED);
    atomic_store_explicit(&s->peak_bytes, 0, memory_order_relaxed);
    atomic_store_explicit(&s->launches, 0, memory_order_relaxed);
    atomic_store_explicit(&s->last_activity_ns, 0, memory_order_relaxed);
    atomic_store_explicit(&s->oom_refusals, 0, memory_order_relaxed);
    atomic_store_explicit(&s->swapped, 0, memory_order_relaxed);
    atomic_store_explicit(&s->host_pid, 0, memory_order_relaxed);
    atomic_store_explicit(&s->pid, 0, memory_order_release);
    return used + 1; /* non-zero: a slot was reclaimed even if it held no bytes */
}

/* Reclaim the slots of dead processes; returns how many. */
MG_COLD int mg_reap(int full) {
    int reaped = 0;
    for (int i = 0; i < MG_MAX_PROCS; i++) {
        mg_proc_slot_t *s = &g_usage->slots[i];
        int32_t pid = atomic_load_explicit(&s->pid, memory_order_acquire);
        if (pid <= 0 || s == atomic_load_explicit(&g_slot, memory_order_relaxed)) continue;
        if (pid == g_pid) {
            /* Our pid, not our slot: a previous process with this pid died
             * without giving it back (its start time differs from ours), or an
             * earlier image of this very process (same start time) that called
             * exec, which skips destructors; the driver freed that image's
             * memory at exec. Only this process claims slots under its pid and
             * it claims one (g_slot), so either way the slot is stale. */
            uint64_t st = __atomic_load_n(&s->start_time, __ATOMIC_ACQUIRE);
            if (st != 0 && g_start != 0 && (full || st == g_start) && mg_release_slot(s, pid)) reaped++;
            continue;
        }
        if (mg_owner_dead(s, pid, full) && mg_release_slot(s, pid)) reaped++;
    }
    return reaped;
}

/* At init: give back the slots of processes that are gone, so the first
 * cuMemGetInfo (often a framework's sizing, before any allocation) is exact:
 *   - a predecessor killed by a signal (SIGKILL, the OOM killer) runs no
 *     destructor; the driver freed its memory as it died;
 *   - earlier images of this process (exec keeps the pid and start time but
 *     runs no destructor; the driver freed their memory).
 * The same lock-free reclaim as the allocation path (CAS on the slot's pid),
 * at its cheap level: one kill(pid, 0) per occupied slot, /proc read only if a
 * slot carries our own pid. A killed process not yet waited for (a zombie) is
 * caught by the full reap of the next allocation that does not fit. */
MG_COLD void mg_reap_at_start(void) {
    for (int i = 0; i < MG_MAX_PROCS; i++) {
        if (atomic_load_explicit(&g_usage->slots[i].pid, memory_order_relaxed) != g_pid) continue;
        g_start = mg_proc_start(g_pid, NULL);
        break;
    }
    mg_reap(0);
}

static mg_proc_slot_t *mg_try_claim(uint64_t start) {
    for (int i = 0; i < MG_MAX_PROCS; i++) {
        mg_proc_slot_t *s = &g_usage->slots[i];
        int32_t expected = 0;
        if (atomic_load_explicit(&s->pid, memory_order_relaxed) != 0) continue;
        if (!atomic_compare_exchange_strong(&s->pid, &expected, g_pid)) continue;
        /* Fields were zeroed by whoever freed the slot. start_time goes last:
         * a reaper treats 0 as "being claimed" and then only trusts kill(). */
        atomic_store_explicit(&s->used_bytes, 0, memory_order_relaxed);
        atomic_store_explicit(&s->peak_bytes, 0, memory_order_relaxed);
        atomic_store_explicit(&s->launches, 0, memory_order_relaxed);
        atomic_store_explicit(&s->oom_refusals, 0, memory_order_relaxed);
        atomic_store_explicit(&s->swapped, 0, memory_order_relaxed);
        atomic_store_explicit(&s->host_pid, (int32_t)mg_nvml_self_pid(), memory_order_relaxed);
        atomic_store_explicit(&s->last_activity_ns, mg_coarse_now_ns(), memory_order_relaxed);
        __atomic_store_n(&s->start_time, start, __ATOMIC_RELEASE);
        return s;
    }
    return NULL;
}

MG_COLD mg_proc_slot_t *mg_claim_slot(void) {
    /* Process-local mutex: only this process's threads ever take it. */
    pthread_mutex_lock(&g_claim_mu);
    mg_proc_slot_t *s = atomic_load_explicit(&g_slot, memory_order_acquire);
    if (!s) {
        uint64_t start = mg_proc_start(g_pid, NULL);
        g_start = start;
        mg_reap(0);
        s = mg_try_claim(start);
        if (!s && mg_reap(1) > 0) s = mg_try_claim(start);
        if (s) {
            atomic_store_explicit(&g_slot, s, memory_order_release);
            mg_gate_follow(s);
        } else
            MG_WARN_ONCE(g_warned_slots, "%s/%s: all %d process slots are taken; refusing GPU allocations",
                         g_dir, MG_USAGE_FILE, MG_MAX_PROCS);
    }
    pthread_mutex_unlock(&g_claim_mu);
    return s;
}
