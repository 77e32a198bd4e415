/*
 * memguard: NVML, the container's view of processes, utilisation and BAR1.
 *
 * NVML's process lists and per-process utilisation name every process on the
 * GPU, whichever container it is in. Under the shim a process sees only its
 * own container's: the processes holding a slot in the container's usage file,
 * i.e. those running the shim. A process of the container that does not run
 * the shim is not listed either (nothing tells the shim it belongs here; it is
 * not held to the limit either). Entries of other containers are never shown.
 *
 * Pids: NVML reports pids as the kernel's initial pid namespace sees them; the
 * slots hold pids of the container's namespace. They are the same for a process in
 * the initial pid namespace (hostPID, a simulated node on a host), or where
 * MEMGUARD_NVML_PIDS=local says NVML reports pids of the caller's namespace (simgpu
 * in a container); =none: never matched; =host: NVML's pids are another
 * namespace's even here. Elsewhere (every ordinary pod) each process asks the agent
 * for its own pid as the host sees it (op IDENTIFY: the agent reads it off the
 * connection with SO_PEERCRED, so a process learns only its own) at its first
 * measured call, before its first context, and keeps it in its slot (host_pid): an
 * NVML entry is this container's when a live slot's process has that pid, and it
 * is shown under the slot's pid, the one the container's processes know it by.
 * A process the agent could not tell (away, an older agent) is not listed, and
 * says so once in the log; an entry no slot names is never shown (a container pid
 * can equal a neighbour's host pid).
 *
 * This is a view, not a wall: a process that does not load the shim calls NVML
 * directly and sees what the driver shows (docs/architecture.md, the shim's model).
 *
 * BAR1 (the aperture the host maps device memory through): total is clamped to
 * the container's limit (it can map no more of its own memory than that); free
 * is at most the driver's free BAR1, so a neighbour's use shows only where it
 * cuts into what this container could map.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "mg_internal.h"

#define PROC_NS_INIT_INO "4026531836" /* the initial pid namespace's inode (PROC_PID_INIT_INO) */

int mg_nvml_pids_local(void) {
    const char *e = getenv("MEMGUARD_NVML_PIDS");
    if (e && strcmp(e, "local") == 0) return 1;
    if (e && (strcmp(e, "none") == 0 || strcmp(e, "host") == 0)) return 0;
    char buf[64];
    ssize_t n = readlink("/proc/self/ns/pid", buf, sizeof buf - 1);
    if (n <= 0) return 0;
    buf[n] = 0;
    return strcmp(buf, "pid:[" PROC_NS_INIT_INO "]") == 0;
}

/* This process's pid as the host (and NVML) names it, from the agent; 0 until known. */
static _Atomic uint32_t g_host_pid;
static _Atomic uint64_t g_host_pid_asked_ns; /* when the agent last failed to tell it */
static _Atomic int g_warned_host_pid;
static _Atomic int g_agent_pid_wrong; /* NVML did not list this process under the agent's pid */
#define MG_ASK_AGAIN_NS (10ull * 1000000000ull) /* an agent away is not asked at every context */

/* This process's pid as NVML reports it: getpid() where NVML's pids are this namespace's
 * (see the top of this file), else what the agent told it; 0 if unknown. */
unsigned mg_nvml_self_pid(void) {
    if (g_nvml_pids_local) return g_pid > 0 ? (unsigned)g_pid : 0;
    return atomic_load_explicit(&g_host_pid, memory_order_acquire);
}

/* Before a measured call: where NVML's pids are the host's and this process's is not known,
 * ask the agent (a connection on its socket; one failure waits MG_ASK_AGAIN_NS). Kept in the
 * slot too, for the container's NVML view. */
MG_COLD void mg_nvml_learn_self(void) {
    if (g_nvml_pids_local || atomic_load_explicit(&g_host_pid, memory_order_acquire) || !mg_nvml_pids_foreign() ||
        atomic_load(&g_agent_pid_wrong))
        return;
    uint64_t last = atomic_load_explicit(&g_host_pid_asked_ns, memory_order_relaxed);
    if (last && mg_coarse_now_ns() - last < MG_ASK_AGAIN_NS) return;
    uint32_t p = mg_ask_host_pid();
    if (!p) {
        atomic_store_explicit(&g_host_pid_asked_ns, mg_coarse_now_ns() | 1, memory_order_relaxed);
        MG_WARN_ONCE(g_warned_host_pid, "the agent did not tell this process its host pid: its contexts are "
                                        "measured device-wide, and NVML process lists omit it");
        return;
    }
    atomic_store_explicit(&g_host_pid, p, memory_order_release);
    mg_proc_slot_t *s = atomic_load_explicit(&g_slot, memory_order_acquire);
    if (s) atomic_store_explicit(&s->host_pid, (int32_t)p, memory_order_release);
}

/* NVML does not list this process under the pid the agent told it, though it holds a
 * context: the agent's pids are not NVML's. Forgotten, and not asked again. */
MG_COLD void mg_nvml_unlearn_self(void) {
    if (g_nvml_pids_local || !atomic_exchange(&g_host_pid, 0)) return;
    atomic_store(&g_agent_pid_wrong, 1);
    mg_proc_slot_t *s = atomic_load_explicit(&g_slot, memory_order_acquire);
    if (s) atomic_store_explicit(&s->host_pid, 0, memory_order_release);
    mg_log("NVML does not list this process under the pid the agent names it by (is the agent outside "
           "the host's pid namespace?): contexts are measured device-wide");
}

/* A forked child is another process: its own pid, to be asked for anew. */
void mg_nvml_atfork_child(void) {
    atomic_store(&g_host_pid, 0);
    atomic_store(&g_host_pid_asked_ns, 0);
}

/* NVML's pids are another namespace's (the host's): mg_ctx.c may learn which is
 * this process's; not under MEMGUARD_NVML_PIDS=none (no per-process figures). */
int mg_nvml_pids_foreign(void) {
    const char *e = getenv("MEMGUARD_NVML_PIDS");
    return !g_nvml_pids_local && !(e && strcmp(e, "none") == 0);
}

/* NVML's entry for `nvml_pid`, if it is one of this container's processes: that process's
 * pid here (the slot's), else 0. A slot counts only while its own process lives (the start
 * time recorded in it is its pid's now, read in this namespace's /proc): a slot left by a
 * dead process never names whoever has its pids next. */
static unsigned mg_nvml_ours(unsigned int nvml_pid) {
    if (!g_usage || nvml_pid == 0 || nvml_pid > INT32_MAX) return 0;
    for (int i = 0; i < MG_MAX_PROCS; i++) {
        const mg_proc_slot_t *s = &g_usage->slots[i];
        int32_t pid = atomic_load_explicit(&s->pid, memory_order_acquire);
        if (pid <= 0) continue;
        int32_t host = atomic_load_explicit(&s->host_pid, memory_order_acquire);
        int32_t as_nvml = g_nvml_pids_local ? pid : host; /* how NVML names the slot's process */
        if (as_nvml != (int32_t)nvml_pid) continue;
        uint64_t recorded = __atomic_load_n(&s->start_time, __ATOMIC_ACQUIRE);
        uint64_t now = recorded ? mg_proc_start(pid, NULL) : 0;
        if (!recorded || now == recorded) return (unsigned)pid; /* 0: being claimed right now, by the pid itself */
    }
    return 0;
}

/* Filter NVML's answers? Not for a process the shim does not manage (no
 * config: not a gpufrac container); always once it has a usage file. */
static int mg_nvml_filtering(void) { return mg_mode() != MODE_OFF; }

/* One NVML list call into `buf` holding `*n` records (buf NULL: a size query). */
typedef nvmlReturn_t (*mg_nvml_fill_fn)(const void *ctx, void *buf, unsigned int *n);

/* Answer a per-process NVML list with the container's entries only, under
 * NVML's buffer rules: *count too small for them (or no array while there are
 * some) -> NVML_ERROR_INSUFFICIENT_SIZE and the count needed; else copied.
 * The driver's whole list is read into a buffer of our own first, so neither
 * the count nor the entries of other containers reach the caller. `none_rc` is
 * what the call answers when nothing is left (lists: SUCCESS, samples: NOT_FOUND). */
static MG_COLD nvmlReturn_t mg_nvml_filter(mg_nvml_fill_fn fill, const void *ctx, unsigned int *count, void *out,
                                           size_t esz, size_t pid_off, nvmlReturn_t none_rc) {
    unsigned int cap = 0, n = 0;
    char *buf = NULL;
    nvmlReturn_t rc = NVML_ERROR_INSUFFICIENT_SIZE;
    for (int tries = 0; tries < 8 && rc == NVML_ERROR_INSUFFICIENT_SIZE; tries++) {
        n = cap;
        rc = fill(ctx, buf, &n);
        if (rc != NVML_ERROR_INSUFFICIENT_SIZE) break;
        cap = n + n / 2 + 8; /* room for processes that start meanwhile */
        free(buf);
        buf = calloc(cap, esz);
        if (!buf) return NVML_ERROR_MEMORY;
    }
    if (rc == NVML_ERROR_INSUFFICIENT_SIZE) rc = NVML_ERROR_UNKNOWN; /* the list kept growing */
    if (rc != NVML_SUCCESS && rc != none_rc) {
        free(buf);
        return rc;
    }
    if (rc != NVML_SUCCESS || !buf) n = 0; /* nothing at all */
    unsigned int kept = 0;
    for (unsigned int i = 0; i < n && buf; i++) {
        unsigned int pid;
        memcpy(&pid, buf + (size_t)i * esz + pid_off, sizeof pid);
        unsigned here = mg_nvml_ours(pid);
        if (!here) continue;
        if (kept != i) memmove(buf + (size_t)kept * esz, buf + (size_t)i * esz, esz);
        memcpy(buf + (size_t)kept * esz + pid_off, &here, sizeof here); /* as this container knows it */
        kept++;
    }
    if (kept == 0) {
        rc = none_rc;
        if (rc == NVML_SUCCESS) *count = 0;
    } else if (*count < kept || !out) {
        *count = kept;
        rc = NVML_ERROR_INSUFFICIENT_SIZE;
    } else {
        memcpy(out, buf, (size_t)kept * esz);
        *count = kept;
        rc = NVML_SUCCESS;
    }
    free(buf);
    return rc;
}

typedef nvmlReturn_t (*mg_nvml_list_fn)(nvmlDevice_t, unsigned int *, void *);
typedef struct {
    mg_nvml_list_fn f;
    nvmlDevice_t dev;
} mg_list_ctx_t;

static nvmlReturn_t mg_fill_list(const void *ctx, void *buf, unsigned int *n) {
    const mg_list_ctx_t *c = ctx;
    return c->f(c->dev, n, buf);
}

/* The running-process lists: (device, count, array), one record type per version. */
#define NVML_LIST_HOOK(sym, info_t)                                                                            \
    HOOK nvmlReturn_t mg_h_##sym(nvmlDevice_t device, unsigned int *infoCount, info_t *infos) {               \
        if (!infoCount || !mg_nvml_filtering()) return CALL_REAL(sym, device, infoCount, infos);              \
        mg_list_ctx_t c = {(mg_nvml_list_fn)REAL(sym), device};                                                \
        if (!c.f) return NVML_ERROR_FUNCTION_NOT_FOUND;                                                        \
        return mg_nvml_filter(mg_fill_list, &c, infoCount, infos, sizeof(info_t), offsetof(info_t, pid),      \
                              NVML_SUCCESS);                                                                   \
    }

NVML_LIST_HOOK(nvmlDeviceGetComputeRunningProcesses, nvmlProcessInfo_v1_t)
NVML_LIST_HOOK(nvmlDeviceGetComputeRunningProcesses_v2, nvmlProcessInfo_t)
NVML_LIST_HOOK(nvmlDeviceGetComputeRunningProcesses_v3, nvmlProcessInfo_t)
NVML_LIST_HOOK(nvmlDeviceGetGraphicsRunningProcesses, nvmlProcessInfo_v1_t)
NVML_LIST_HOOK(nvmlDeviceGetGraphicsRunningProcesses_v2, nvmlProcessInfo_t)
NVML_LIST_HOOK(nvmlDeviceGetGraphicsRunningProcesses_v3, nvmlProcessInfo_t)
NVML_LIST_HOOK(nvmlDeviceGetMPSComputeRunningProcesses, nvmlProcessInfo_v1_t)
NVML_LIST_HOOK(nvmlDeviceGetMPSComputeRunningProcesses_v2, nvmlProcessInfo_t)
NVML_LIST_HOOK(nvmlDeviceGetMPSComputeRunningProcesses_v3, nvmlProcessInfo_t)

typedef struct {
    nvmlReturn_t (*f)(nvmlDevice_t, nvmlProcessDetailList_t *);
    nvmlDevice_t dev;
    const nvmlProcessDetailList_t *in;
} mg_detail_ctx_t;

static nvmlReturn_t mg_fill_detail(const void *ctx, void *buf, unsigned int *n) {
    const mg_detail_ctx_t *c = ctx;
    nvmlProcessDetailList_t l = *c->in;
    l.numProcArrayEntries = *n;
    l.procArray = buf;
    nvmlReturn_t rc = c->f(c->dev, &l);
    *n = l.numProcArrayEntries;
    return rc;
}

HOOK nvmlReturn_t mg_h_nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t device, nvmlProcessDetailList_t *plist) {
    if (!plist || !mg_nvml_filtering()) return CALL_REAL(nvmlDeviceGetRunningProcessDetailList, device, plist);
    mg_detail_ctx_t c = {REAL(nvmlDeviceGetRunningProcessDetailList), device, plist};
    if (!c.f) return NVML_ERROR_FUNCTION_NOT_FOUND;
    return mg_nvml_filter(mg_fill_detail, &c, &plist->numProcArrayEntries, plist->procArray,
                          sizeof(nvmlProcessDetail_v1_t), offsetof(nvmlProcessDetail_v1_t, pid), NVML_SUCCESS);
}

typedef struct {
    nvmlReturn_t (*f)(nvmlDevice_t, nvmlProcessUtilizationSample_t *, unsigned int *, unsigned long long);
    nvmlDevice_t dev;
    unsigned long long last_seen;
} mg_usample_ctx_t;

static nvmlReturn_t mg_fill_usample(const void *ctx, void *buf, unsigned int *n) {
    const mg_usample_ctx_t *c = ctx;
    return c->f(c->dev, buf, n, c->last_seen);
}

/* Per-process utilisation: "no sample" is NVML_ERROR_NOT_FOUND. */
HOOK nvmlReturn_t mg_h_nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                                       unsigned int *processSamplesCount,
                                                       unsigned long long lastSeenTimeStamp) {
    if (!processSamplesCount || !mg_nvml_filtering())
        return CALL_REAL(nvmlDeviceGetProcessUtilization, device, utilization, processSamplesCount,
                         lastSeenTimeStamp);
    mg_usample_ctx_t c = {REAL(nvmlDeviceGetProcessUtilization), device, lastSeenTimeStamp};
    if (!c.f) return NVML_ERROR_FUNCTION_NOT_FOUND;
    return mg_nvml_filter(mg_fill_usample, &c, processSamplesCount, utilization,
                          sizeof(nvmlProcessUtilizationSample_t), offsetof(nvmlProcessUtilizationSample_t, pid),
                          NVML_ERROR_NOT_FOUND);
}

typedef struct {
    nvmlReturn_t (*f)(nvmlDevice_t, nvmlProcessesUtilizationInfo_t *);
    nvmlDevice_t dev;
    const nvmlProcessesUtilizationInfo_t *in;
} mg_uinfo_ctx_t;

static nvmlReturn_t mg_fill_uinfo(const void *ctx, void *buf, unsigned int *n) {
    const mg_uinfo_ctx_t *c = ctx;
    nvmlProcessesUtilizationInfo_t u = *c->in;
    u.processSamplesCount = *n;
    u.procUtilArray = buf;
    nvmlReturn_t rc = c->f(c->dev, &u);
    *n = u.processSamplesCount;
    return rc;
}

HOOK nvmlReturn_t mg_h_nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t device,
                                                             nvmlProcessesUtilizationInfo_t *procesesUtilInfo) {
    nvmlProcessesUtilizationInfo_t *p = procesesUtilInfo;
    if (!p || !mg_nvml_filtering()) return CALL_REAL(nvmlDeviceGetProcessesUtilizationInfo, device, p);
    mg_uinfo_ctx_t c = {REAL(nvmlDeviceGetProcessesUtilizationInfo), device, p};
    if (!c.f) return NVML_ERROR_FUNCTION_NOT_FOUND;
    return mg_nvml_filter(mg_fill_uinfo, &c, &p->processSamplesCount, p->procUtilArray,
                          sizeof(nvmlProcessUtilizationInfo_v1_t), offsetof(nvmlProcessUtilizationInfo_v1_t, pid),
                          NVML_ERROR_NOT_FOUND);
}

HOOK nvmlReturn_t mg_h_nvmlDeviceGetBAR1MemoryInfo(nvmlDevice_t device, nvmlBAR1Memory_t *bar1Memory) {
    nvmlReturn_t rc = CALL_REAL(nvmlDeviceGetBAR1MemoryInfo, device, bar1Memory);
    if (rc != NVML_SUCCESS || !bar1Memory) return rc;
    int m = mg_mode();
    mg_limits_t l;
    if (m == MODE_OFF) return rc;
    int known = m == MODE_ON && mg_read_limits(&l) == 0;
    if (known && (l.flags & MG_FLAG_WHOLE_GPU)) return rc;
    uint64_t total = bar1Memory->bar1Total;
    if (known && l.limit < total) total = l.limit;
    uint64_t free_ = bar1Memory->bar1Free < total ? bar1Memory->bar1Free : total;
    if (!known || (l.flags & MG_FLAG_DISABLED)) free_ = 0;
    bar1Memory->bar1Total = total;
    bar1Memory->bar1Free = free_;
    bar1Memory->bar1Used = total - free_;
    return rc;
}

MG_SYMBOLS_NVML(MG_XALIAS)
