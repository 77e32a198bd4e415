/*
 * simgpu fake libnvidia-ml.so.1: utilisation sampling and the per-process queries
 * (running processes, their memory, BAR1).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "nvml_internal.h"

/* ------------------------------------------------------------------ utilisation */

/* Utilisation is measured like NVML's sampler: busy time between two queries from
 * this process, from the compute model (simstate.h sim_sched_*), played up to now
 * first. A slot's busy time up to now is its total minus any part a test wrote as
 * lying in the future. */
static uint64_t busy_to_now(simgpu_proc_t *s, uint64_t now) {
    uint64_t total = atomic_load(&s->busy_ns_total), until = atomic_load(&s->busy_until_ns);
    uint64_t ahead = until > now ? until - now : 0;
    return total > ahead ? total - ahead : 0;
}

typedef struct {
    simgpu_node_t *node;
    int32_t pid;
    uint64_t start_time, busy, at;
} sample_t;
static sample_t g_proc_sample[SIMGPU_MAX_PROCS];
static sample_t g_gpu_sample[SIMGPU_MAX_GPUS];
static pthread_mutex_t g_sample_lock = PTHREAD_MUTEX_INITIALIZER;

/* Percent busy since this process's previous sample of the same key (`prev`); on the
 * first sample, whether it is busy right now. The new sample goes to `next`. */
static unsigned int percent_since(const sample_t *prev, sample_t *next, simgpu_node_t *n, int32_t pid, uint64_t st,
                                  uint64_t busy, uint64_t now, int busy_now) {
    unsigned int pct;
    if (prev->node == n && prev->pid == pid && prev->start_time == st && now > prev->at) {
        uint64_t d = busy > prev->busy ? busy - prev->busy : 0;
        uint64_t span = now - prev->at;
        pct = d >= span ? 100 : (unsigned int)((d * 100 + span / 2) / span); /* to the nearest percent */
    } else {
        pct = busy_now ? 100 : 0;
    }
    *next = (sample_t){n, pid, st, busy, now};
    return pct;
}

static int slot_on(simgpu_proc_t *s, uint32_t gpu, int32_t *pid_out) {
    int32_t pid = atomic_load(&s->pid);
    if (pid <= 0 || s->gpu != gpu) return 0;
    *pid_out = pid;
    return 1;
}

NVML_API nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    DEV(device, g, idx);
    if (!utilization) return NVML_ERROR_INVALID_ARGUMENT;
    simgpu_node_t *n = nv_node_if_init();
    /* The device is busy while any context's work runs: its own busy clock, which a
     * process leaving the node does not take back. */
    uint64_t now = sim_sched_enter(n, idx);
    uint64_t busy = atomic_load(&g->busy_ns_total);
    int busy_now = sim_sched_running(n, idx, NULL, now);
    sim_sched_leave(n, idx);
    pthread_mutex_lock(&g_sample_lock);
    unsigned int pct = percent_since(&g_gpu_sample[idx], &g_gpu_sample[idx], n, 0, 0, busy, now, busy_now);
    pthread_mutex_unlock(&g_sample_lock);
    uint32_t og = atomic_load(&g->util_gpu_override), om = atomic_load(&g->util_mem_override);
    /* 0 = derive from kernel activity; otherwise the test's value + 1. Memory
     * bandwidth is modelled as half the SM activity. */
    utilization->gpu = og ? og - 1 : pct;
    utilization->memory = om ? om - 1 : utilization->gpu / 2;
    return NVML_SUCCESS;
}

typedef struct {
    unsigned int pid, sm, mem;
    unsigned long long ts;
} proc_util_t;

/* Per-process samples newer than lastSeen (microseconds); returns the count. The new
 * sample windows are only staged: process_samples keeps them when the caller's array
 * took the samples, so a query that only asks how many uses nothing up (as NVML's
 * buffered samples are not used up by it). Callers hold process_samples' lock. */
static sample_t g_staged[SIMGPU_MAX_PROCS];
static unsigned char g_is_staged[SIMGPU_MAX_PROCS];
static unsigned int collect_proc_util(simgpu_node_t *n, uint32_t gpu, unsigned long long lastSeen,
                                      proc_util_t out[SIMGPU_MAX_PROCS]) {
    sim_reap_dead(n);
    uint64_t now = sim_sched_enter(n, gpu);
    /* Whether each slot's work is on the GPU now, read under the schedule's lock. */
    static unsigned char running[SIMGPU_MAX_PROCS];
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++) running[i] = (unsigned char)sim_sched_running(n, gpu, &n->procs[i], now);
    sim_sched_leave(n, gpu);
    unsigned int count = 0;
    memset(g_is_staged, 0, sizeof g_is_staged);
    pthread_mutex_lock(&g_sample_lock);
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++) {
        simgpu_proc_t *s = &n->procs[i];
        int32_t pid;
        if (!slot_on(s, gpu, &pid)) continue;
        uint64_t last = atomic_load(&s->last_launch_ns), until = atomic_load(&s->busy_until_ns);
        if (last == 0) continue; /* never ran a kernel: no sample */
        uint64_t active = until > now ? now : (until > last ? until : last);
        unsigned long long ts = active / 1000;
        unsigned int pct = percent_since(&g_proc_sample[i], &g_staged[i], n, pid, s->start_time, busy_to_now(s, now),
                                         now, running[i]);
        g_is_staged[i] = 1;
        if (ts <= lastSeen) continue;
        out[count++] = (proc_util_t){(unsigned)pid, pct, pct / 2, ts};
    }
    pthread_mutex_unlock(&g_sample_lock);
    return count;
}

/* The per-process samples of `gpu` newer than last_seen, written into `array`
 * by `put`, with NVML's rules: none -> NOT_FOUND; no array or too small ->
 * INSUFFICIENT_SIZE and the count needed. */
static nvmlReturn_t process_samples(uint32_t gpu, unsigned long long last_seen, unsigned int *count, void *array,
                                    void (*put)(void *array, unsigned int i, const proc_util_t *u)) {
    static proc_util_t buf[SIMGPU_MAX_PROCS]; /* 24 KiB: off the caller's stack */
    static pthread_mutex_t buf_lock = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&buf_lock);
    unsigned int found = collect_proc_util(nv_node_if_init(), gpu, last_seen, buf);
    nvmlReturn_t r = NVML_SUCCESS;
    if (found == 0) {
        r = NVML_ERROR_NOT_FOUND;
    } else if (!array || *count < found) {
        *count = found;
        r = NVML_ERROR_INSUFFICIENT_SIZE;
    } else {
        for (unsigned int i = 0; i < found; i++) put(array, i, &buf[i]);
        *count = found;
    }
    if (r != NVML_ERROR_INSUFFICIENT_SIZE) { /* the samples were taken (or there were none): keep the windows */
        pthread_mutex_lock(&g_sample_lock);
        for (int i = 0; i < SIMGPU_MAX_PROCS; i++)
            if (g_is_staged[i]) g_proc_sample[i] = g_staged[i];
        pthread_mutex_unlock(&g_sample_lock);
    }
    pthread_mutex_unlock(&buf_lock);
    return r;
}

static void put_sample(void *array, unsigned int i, const proc_util_t *u) {
    ((nvmlProcessUtilizationSample_t *)array)[i] = (nvmlProcessUtilizationSample_t){u->pid, u->ts, u->sm, u->mem, 0, 0};
}

static void put_info(void *array, unsigned int i, const proc_util_t *u) {
    ((nvmlProcessUtilizationInfo_v1_t *)array)[i] =
        (nvmlProcessUtilizationInfo_v1_t){u->ts, u->pid, u->sm, u->mem, 0, 0, 0, 0};
}

NVML_API nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                                      unsigned int *processSamplesCount,
                                                      unsigned long long lastSeenTimeStamp) {
    DEV(device, g, idx);
    (void)g;
    if (!processSamplesCount) return NVML_ERROR_INVALID_ARGUMENT;
    return process_samples(idx, lastSeenTimeStamp, processSamplesCount, utilization, put_sample);
}

NVML_API nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t device,
                                                            nvmlProcessesUtilizationInfo_v1_t *procesesUtilInfo) {
    DEV(device, g, idx);
    (void)g;
    nvmlProcessesUtilizationInfo_v1_t *p = procesesUtilInfo;
    if (!p) return NVML_ERROR_INVALID_ARGUMENT;
    if (p->version != nvmlProcessesUtilizationInfo_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    return process_samples(idx, p->lastSeenTimeStamp, &p->processSamplesCount, p->procUtilArray, put_info);
}

/* ------------------------------------------------------------------ processes */

typedef struct {
    unsigned int pid;
    unsigned long long used;
} proc_mem_t;

/* Live compute processes on a GPU and their memory, one entry per pid. A process
 * whose memory is checkpointed to the host has no GPU context, so it is absent. */
static unsigned int collect_procs(simgpu_node_t *n, uint32_t gpu, proc_mem_t out[SIMGPU_MAX_PROCS]) {
    sim_reap_dead(n);
    unsigned int count = 0;
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++) {
        simgpu_proc_t *s = &n->procs[i];
        int32_t pid;
        if (!slot_on(s, gpu, &pid) || atomic_load(&s->ckpt_state) == SIMGPU_CKPT_CHECKPOINTED) continue;
        out[count++] = (proc_mem_t){(unsigned)pid, atomic_load(&s->used_bytes)};
    }
    return count;
}

/* NVML's buffer rule: too small (or NULL with a zero count) -> INSUFFICIENT_SIZE
 * and the needed count; no processes -> SUCCESS with 0. */
#define RUNNING_PROCESSES(device, infoCount, infos, FILL)                     \
    do {                                                                      \
        DEV(device, g, idx);                                                  \
        (void)g;                                                              \
        if (!infoCount) return NVML_ERROR_INVALID_ARGUMENT;                   \
        static proc_mem_t buf[SIMGPU_MAX_PROCS];                              \
        static pthread_mutex_t buf_lock = PTHREAD_MUTEX_INITIALIZER;          \
        pthread_mutex_lock(&buf_lock);                                        \
        unsigned int found = collect_procs(nv_node_if_init(), idx, buf);         \
        nvmlReturn_t r = NVML_SUCCESS;                                        \
        if (*infoCount < found || (found && !infos)) {                        \
            r = NVML_ERROR_INSUFFICIENT_SIZE;                                 \
        } else {                                                              \
            for (unsigned int i = 0; i < found; i++) FILL;                    \
        }                                                                     \
        *infoCount = found;                                                   \
        pthread_mutex_unlock(&buf_lock);                                      \
        return r;                                                             \
    } while (0)

NVML_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                              nvmlProcessInfo_t *infos) {
    RUNNING_PROCESSES(device, infoCount, infos,
                      (infos[i] = (nvmlProcessInfo_t){buf[i].pid, buf[i].used, NVML_VALUE_NOT_AVAILABLE_UINT,
                                                      NVML_VALUE_NOT_AVAILABLE_UINT}));
}

NVML_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                              nvmlProcessInfo_t *infos) {
    return nvmlDeviceGetComputeRunningProcesses_v3(device, infoCount, infos);
}

NVML_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                           nvmlProcessInfo_v1_t *infos) {
    RUNNING_PROCESSES(device, infoCount, infos, (infos[i] = (nvmlProcessInfo_v1_t){buf[i].pid, buf[i].used}));
}

/* No graphics or MPS clients on a simulated compute node: every version answers
 * an empty list (SUCCESS, count 0) with NVML's argument checks. */
static nvmlReturn_t no_processes(nvmlDevice_t device, unsigned int *infoCount) {
    DEV(device, g, idx);
    (void)g;
    (void)idx;
    if (!infoCount) return NVML_ERROR_INVALID_ARGUMENT;
    *infoCount = 0;
    return NVML_SUCCESS;
}

#define NO_PROCESSES(sym, info_t)                                                                 \
    NVML_API nvmlReturn_t sym(nvmlDevice_t device, unsigned int *infoCount, info_t *infos) {      \
        (void)infos;                                                                              \
        return no_processes(device, infoCount);                                                   \
    }
NO_PROCESSES(nvmlDeviceGetGraphicsRunningProcesses, nvmlProcessInfo_v1_t)
NO_PROCESSES(nvmlDeviceGetGraphicsRunningProcesses_v2, nvmlProcessInfo_t)
NO_PROCESSES(nvmlDeviceGetGraphicsRunningProcesses_v3, nvmlProcessInfo_t)
NO_PROCESSES(nvmlDeviceGetMPSComputeRunningProcesses, nvmlProcessInfo_v1_t)
NO_PROCESSES(nvmlDeviceGetMPSComputeRunningProcesses_v2, nvmlProcessInfo_t)
NO_PROCESSES(nvmlDeviceGetMPSComputeRunningProcesses_v3, nvmlProcessInfo_t)

/* All processes of one kind (mode) in one versioned struct; compute processes are
 * the only kind here. The count rules are those of the list calls above. */
NVML_API nvmlReturn_t nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t device, nvmlProcessDetailList_v1_t *plist) {
    DEV(device, g, idx);
    (void)g;
    if (!plist) return NVML_ERROR_INVALID_ARGUMENT;
    if (plist->version != nvmlProcessDetailList_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (plist->mode > NVML_PROCESS_MODE_ALL) return NVML_ERROR_INVALID_ARGUMENT;
    static proc_mem_t buf[SIMGPU_MAX_PROCS];
    static pthread_mutex_t buf_lock = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&buf_lock);
    unsigned int found = 0;
    if (plist->mode == NVML_PROCESS_MODE_COMPUTE || plist->mode == NVML_PROCESS_MODE_ALL)
        found = collect_procs(nv_node_if_init(), idx, buf);
    nvmlReturn_t r = NVML_SUCCESS;
    if (plist->numProcArrayEntries < found || (found && !plist->procArray)) {
        r = NVML_ERROR_INSUFFICIENT_SIZE;
    } else {
        for (unsigned int i = 0; i < found; i++)
            plist->procArray[i] = (nvmlProcessDetail_v1_t){buf[i].pid, buf[i].used, NVML_VALUE_NOT_AVAILABLE_UINT,
                                                            NVML_VALUE_NOT_AVAILABLE_UINT, 0};
    }
    plist->numProcArrayEntries = found;
    pthread_mutex_unlock(&buf_lock);
    return r;
}

/* BAR1, the PCIe aperture through which the host maps device memory. Data-center
 * parts size it at the power of two at or above their memory (H100 80 GB and
 * A100 80 GB: 128 GiB, A100 40 GB: 64 GiB, L4: 32 GiB). Used: an estimate of what
 * the driver maps, 1 MiB for the device plus 2 MiB per process with a context on it. */
#define SIM_BAR1_BASE (1ull << 20)
#define SIM_BAR1_PER_PROC (2ull << 20)
NVML_API nvmlReturn_t nvmlDeviceGetBAR1MemoryInfo(nvmlDevice_t device, nvmlBAR1Memory_t *bar1Memory) {
    DEV(device, g, idx);
    if (!bar1Memory) return NVML_ERROR_INVALID_ARGUMENT;
    simgpu_node_t *n = nv_node_if_init();
    sim_reap_dead(n);
    uint64_t total = 1;
    while (total < g->total_bytes && total < (1ull << 62)) total <<= 1;
    uint64_t used = SIM_BAR1_BASE;
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++) {
        int32_t pid;
        if (slot_on(&n->procs[i], idx, &pid)) used += SIM_BAR1_PER_PROC;
    }
    if (used > total) used = total;
    *bar1Memory = (nvmlBAR1Memory_t){total, total - used, used};
    return NVML_SUCCESS;
}
