/*
 * memguard: the compute share's launch pace (docs/compute.md).
 *
 * The agent measures each container's use of its GPU from the driver and, while the
 * container must give way, publishes a pace in its config: its launches then start at
 * least that many ns apart, all its processes and threads together. The launch hooks
 * (mg_launch.c) read the pace with one atomic load; only a paced launch comes here.
 * Each paced launch takes the next free slot of the container's launch clock (one
 * compare-and-swap on the compute file, shared by the container's processes; without
 * the file, a clock of the process's own) and sleeps until it. No lock: a process
 * killed asleep leaves a slot unused and nothing held; a fork shares the clock.
 * No credit: a slot is never earlier than now, so idle time does not bank launches.
 * The clock is the tenant's to write: one too far ahead is taken as garbage and
 * restarted, so a launch never waits longer than MG_PACE_AHEAD_NS plus one pace.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "mg_internal.h"

#define MG_PACE_AHEAD_NS (8ull * 1000000000ull)

mg_compute_t *g_compute;
static _Atomic uint64_t g_own_clock; /* without the compute file: this process's own clock */

void mg_compute_attach(const char *dir) {
    char path[PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/%s", dir, MG_COMPUTE_FILE);
    int fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return; /* a container admitted by an older agent: each process paces itself */
    struct stat st;
    void *p = MAP_FAILED;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && (size_t)st.st_size >= sizeof(mg_compute_t))
        p = mmap(NULL, sizeof(mg_compute_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    const mg_compute_t *c = p;
    if (p == MAP_FAILED || c->magic != MG_COMPUTE_MAGIC || c->abi_version != MG_ABI_VERSION ||
        c->file_size != sizeof(mg_compute_t)) {
        if (p != MAP_FAILED) munmap(p, sizeof(mg_compute_t));
        mg_log("%s is not a compute file: launches are paced per process", path);
        return;
    }
    g_compute = p;
}

static uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

MG_COLD void mg_pace_launch(uint32_t pace_ns, uint32_t weight) {
    mg_compute_t *c = g_compute;
    _Atomic uint64_t *clock = c ? &c->next_ns : &g_own_clock;
    uint64_t now = mono_ns(), take = (uint64_t)pace_ns * (weight ? weight : 1);
    uint64_t cur = atomic_load_explicit(clock, memory_order_relaxed), slot;
    do {
        slot = cur < now || cur > now + MG_PACE_AHEAD_NS ? now : cur;
    } while (!atomic_compare_exchange_weak_explicit(clock, &cur, slot + take, memory_order_acq_rel,
                                                    memory_order_relaxed));
    if (c) atomic_fetch_add_explicit(&c->paced_launches, 1, memory_order_relaxed);
    if (slot <= now) return;
    struct timespec at = {(time_t)(slot / 1000000000ull), (long)(slot % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &at, NULL) == EINTR) {
    }
    if (c) {
        atomic_fetch_add_explicit(&c->held_ns, slot - now, memory_order_relaxed);
        atomic_fetch_add_explicit(&c->held_launches, 1, memory_order_relaxed);
    }
}
