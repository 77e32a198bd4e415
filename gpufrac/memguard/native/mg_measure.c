/*
 * memguard: how much device memory a driver call took (a context, a module, a
 * limit), measured around the call; mg_ctx.c charges its objects by it. Callers
 * hold mg_ctx.c's g_ov_mu from mg_meas_begin to mg_meas_release.
 *
 * Measured, not guessed: no driver call says how much a context or a module
 * takes, so each such call is bracketed by two readings of the device's used
 * memory (NVML's device memory info, the real function, not the shim's view;
 * the real cuMemGetInfo_v2 where NVML cannot be loaded), and the difference is
 * charged to this process as the object's size. Releasing the object (context
 * destroyed or its primary released to zero or reset, module or library
 * unloaded, limit lowered) uncounts exactly what was charged for it; a context
 * going also uncounts its modules and limits, which the driver frees with it.
 *
 * Per process first. Where NVML names this process, the figure is NVML's
 * per-process used memory of this process (nvmlDeviceGetComputeRunningProcesses),
 * before and after, less what this process's other threads had counted
 * meanwhile: exact, whatever other processes on the GPU take or free during the
 * call, and with no turns to take. NVML names it when its pids
 * are this pid namespace's (mg_nvml_self_pid), or by the host pid the agent told
 * it (op IDENTIFY, asked at the first measured call: mg_nvml_learn_self), or,
 * with no agent to ask, once it is learnt: NVML's pids are the host's (a container), but a process
 * holding no context is not listed, so at its first context creation every
 * process listed before is another; if exactly one process is listed new after
 * it and its figure accounts for the device's whole change beyond the others'
 * (within MG_LEARN_SLACK, so it cannot be a neighbour starting while this
 * process goes unlisted), that pid is this process's. Each list is read with the
 * device's used memory as of one moment (read again until unchanged). Until then that first
 * creation is still read device-wide less the listed others' change. A call
 * after which NVML does not list this process, or gives no figure, falls back
 * to the device-wide reading below.
 *
 * Device-wide, bounded. Otherwise (no per-process figure at the call's start) the
 * reading is the device's used memory, and
 * memory other processes take or give back during the call would land on this
 * object (a neighbour allocating GiBs during a victim's context creation would
 * give the victim a false OOM). What bounds it:
 *   - measured calls on one device take turns: within the process under a
 *     process-local mutex, across the container's processes by an
 *     open-file-description lock on that device's byte of the usage file (the
 *     kernel drops it when its holder dies, so no dead process can hold it; a
 *     holder that keeps it past MG_MEASURE_WAIT_MS, which only a tenant's own
 *     process could do, is waited out and the call measured anyway) — so two
 *     workers of one container starting together never count each other's
 *     contexts. The price: their context creations on one GPU run one after
 *     the other;
 *   - the container's own counted total (the usage file) is read at both ends
 *     and its change subtracted: explicit allocations of the container's other
 *     processes (and this process's other threads) counted in that window do
 *     not land on this object;
 *   - the result is clamped to what that kind of object can take: a context at
 *     most MG_CTX_MAX (twice the 512 MiB an H100 context takes, docs/simgpu.md);
 *     a limit change to what the old and new values imply (the stack limit for
 *     every resident thread of the device, the printf FIFO and malloc heap by the
 *     difference, plus a 2 MiB granule) and never the other way (a raise charges,
 *     a lowering gives back); anything to the memory that was free before it.
 * What is left is other containers' net change during the call, within those
 * bounds: a neighbour can raise a context's charge to MG_CTX_MAX at most, or
 * lower it (to 0 at worst); a module or a limit of a kind not listed is not
 * bounded beyond free memory. An error never accumulates, because each object
 * gives back exactly what it was charged.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "mg_internal.h"

typedef CUresult (*cu_getinfo_fn)(size_t *, size_t *);
typedef CUresult (*cu_busid_fn)(char *, int, CUdevice);
typedef CUresult (*cu_ctxdev_fn)(CUdevice *);
typedef nvmlReturn_t (*nvml_init_fn)(void);
typedef nvmlReturn_t (*nvml_bybus_fn)(const char *, nvmlDevice_t *);
typedef nvmlReturn_t (*nvml_meminfo_fn)(nvmlDevice_t, nvmlMemory_t *);
typedef nvmlReturn_t (*nvml_procs_fn)(nvmlDevice_t, unsigned int *, nvmlProcessInfo_t *); /* the _v2 and _v3 lists */
typedef CUresult (*cu_devattr_fn)(int *, int, CUdevice);

#define NVML_VALUE_NOT_AVAILABLE (~0ull)
#define MG_CTX_MAX (1ull << 30)
#define MG_GRANULE (2ll << 20)

#define MG_MAX_DEVS 64

static int g_nvml_state; /* 0: not tried, 1: usable, -1: not (under g_ov_mu) */
static nvmlDevice_t g_nvml_dev[MG_MAX_DEVS];
static nvml_meminfo_fn g_nvml_meminfo;
static int g_warned_measure;

static void *cu_fn(const char *name) { return mg_driver_fn(LIB_CUDA, name); }

/* NVML's handle of CUDA device `dev` (matched by PCI bus id), or NULL. */
static nvmlDevice_t mg_nvml_dev(CUdevice dev) {
    if (dev < 0 || dev >= MG_MAX_DEVS) return NULL;
    if (g_nvml_state == 0) {
        nvml_init_fn init = (nvml_init_fn)mg_driver_fn(LIB_NVML, "nvmlInit_v2");
        g_nvml_meminfo = (nvml_meminfo_fn)mg_driver_fn(LIB_NVML, "nvmlDeviceGetMemoryInfo");
        g_nvml_state = init && g_nvml_meminfo && init() == 0 ? 1 : -1;
    }
    if (g_nvml_state != 1) return NULL;
    if (!g_nvml_dev[dev]) {
        cu_busid_fn busid = (cu_busid_fn)cu_fn("cuDeviceGetPCIBusId");
        nvml_bybus_fn bybus = (nvml_bybus_fn)mg_driver_fn(LIB_NVML, "nvmlDeviceGetHandleByPciBusId_v2");
        char id[32];
        nvmlDevice_t h = NULL;
        if (busid && bybus && busid(id, sizeof id, dev) == CUDA_SUCCESS && bybus(id, &h) == 0) g_nvml_dev[dev] = h;
    }
    return g_nvml_dev[dev];
}

/* The device's used and free memory as the driver sees it; 0 if it can be read. */
static int mg_dev_mem(CUdevice dev, uint64_t *used, uint64_t *free_) {
    nvmlDevice_t h = mg_nvml_dev(dev);
    nvmlMemory_t m;
    if (h && g_nvml_meminfo(h, &m) == 0) {
        *used = m.used, *free_ = m.free;
        return 0;
    }
    /* No NVML: the real cuMemGetInfo_v2, which needs a current context on `dev`. */
    cu_getinfo_fn info = (cu_getinfo_fn)cu_fn("cuMemGetInfo_v2");
    cu_ctxdev_fn ctxdev = (cu_ctxdev_fn)cu_fn("cuCtxGetDevice");
    CUdevice cur;
    size_t f, t;
    if (info && ctxdev && ctxdev(&cur) == CUDA_SUCCESS && cur == dev && info(&f, &t) == CUDA_SUCCESS) {
        *used = t - f, *free_ = f;
        return 0;
    }
    return -1;
}

static nvml_procs_fn g_nvml_procs;
static nvmlProcessInfo_t *g_procs_buf; /* under g_ov_mu */
static unsigned g_procs_cap;
static unsigned g_self_learnt; /* this process's NVML pid, learnt at its first context (see top) */

/* NVML's compute processes on `dev` (in g_procs_buf, valid until the next call):
 * their number, or -1 if NVML cannot list them with a figure each. Callers hold g_ov_mu. */
static int nvml_list(CUdevice dev) {
    nvmlDevice_t h = mg_nvml_dev(dev);
    if (!h) return -1;
    if (!g_nvml_procs) g_nvml_procs = (nvml_procs_fn)mg_driver_fn(LIB_NVML, "nvmlDeviceGetComputeRunningProcesses_v3");
    if (!g_nvml_procs) g_nvml_procs = (nvml_procs_fn)mg_driver_fn(LIB_NVML, "nvmlDeviceGetComputeRunningProcesses_v2");
    if (!g_nvml_procs) return -1;
    for (int tries = 0; tries < 4; tries++) {
        unsigned n = g_procs_cap;
        nvmlReturn_t rc = g_nvml_procs(h, &n, g_procs_buf);
        if (rc == NVML_ERROR_INSUFFICIENT_SIZE) {
            unsigned cap = n + n / 2 + 16;
            nvmlProcessInfo_t *v = realloc(g_procs_buf, (size_t)cap * sizeof *v);
            if (!v) return -1;
            g_procs_buf = v, g_procs_cap = cap;
            continue;
        }
        if (rc != 0 || n > g_procs_cap || n > INT32_MAX) return -1;
        for (unsigned i = 0; i < n; i++)
            if (g_procs_buf[i].usedGpuMemory == NVML_VALUE_NOT_AVAILABLE) return -1;
        return (int)n;
    }
    return -1;
}

static unsigned self_pid(void) {
    unsigned p = mg_nvml_self_pid();
    return p ? p : g_self_learnt;
}

/* This process's memory on `dev` by NVML's per-process figure: 1 and *bytes if
 * NVML lists it, 0 if NVML lists the device's processes without it (nothing
 * there yet), -1 if it cannot tell. Callers hold g_ov_mu. */
static int mg_own_mem(CUdevice dev, uint64_t *bytes) {
    unsigned self = self_pid();
    int n = self ? nvml_list(dev) : -1;
    if (n < 0) return -1;
    for (int i = 0; i < n; i++) {
        if (g_procs_buf[i].pid != self) continue;
        *bytes = g_procs_buf[i].usedGpuMemory;
        return 1;
    }
    *bytes = 0;
    return 0;
}

#define MG_MEASURE_WAIT_MS 2000
static int g_ov_fd = -1; /* the usage file, for the turn locks (under g_ov_mu) */

/* An open-file-description lock on byte `dev` of the usage file: one turn per
 * device, so processes on different GPUs of a container never wait for each other. */
static int turn_lock(CUdevice dev, short type) {
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = dev, .l_len = 1};
    return fcntl(g_ov_fd, F_OFD_SETLK, &fl);
}

/* Take the container's measuring turn on `dev` (see the top): 1 if held. */
static int turn_take(CUdevice dev) {
    if (dev < 0) return 0;
    if (g_ov_fd < 0) {
        char path[PATH_MAX + 16];
        snprintf(path, sizeof path, "%s/usage", mg_container_dir());
        g_ov_fd = open(path, O_RDWR | O_CLOEXEC);
        if (g_ov_fd < 0) return 0;
    }
    for (int waited = 0; waited < MG_MEASURE_WAIT_MS; waited++) {
        if (turn_lock(dev, F_WRLCK) == 0) return 1;
        if (errno != EAGAIN && errno != EACCES && errno != EINTR) return 0;
        struct timespec ts = {0, 1000000L};
        nanosleep(&ts, NULL);
    }
    return 0;
}

/* Callers hold g_ov_mu from mg_meas_begin to mg_meas_release, which must follow every
 * mg_meas_begin, after the measured bytes are charged (or the call undone): a sibling
 * measuring next must see them in the container's total before its window. */
void mg_meas_begin(mg_meas_t *m, CUdevice dev) {
    m->dev = dev;
    m->lo = INT64_MIN, m->hi = INT64_MAX;
    m->l0 = NULL, m->n0 = 0;
    mg_nvml_learn_self(); /* its host pid from the agent, in a pid namespace */
    m->mine0 = mg_process_counted();
    /* Read even before a first context: NVML may still count memory under this pid (an
     * earlier image of this process, before an exec the driver has not seen the end of). */
    m->own_ok = mg_own_mem(dev, &m->own0) >= 0;
    /* Exact per process: no turns. Only a device-wide reading needs the container's
     * processes to take turns, so that they do not count each other's contexts. */
    m->turn = m->own_ok ? 0 : turn_take(dev);
    m->total0 = mg_container_total();
    m->ok = mg_dev_mem(dev, &m->used0, &m->free0) == 0;
}

void mg_meas_release(mg_meas_t *m) {
    if (m->turn) turn_lock(m->dev, F_UNLCK);
    m->turn = 0;
    free(m->l0);
    m->l0 = NULL;
}

/* Before a context creation whose process's NVML pid is not known: while it
 * holds no context NVML does not list it, so every process listed now is
 * another; keep that list (see top, learning). Call right after mg_meas_begin. */
/* NVML's process list and the device's used memory read as of one moment: the
 * list read again after the reading until it has not changed (a few tries), so
 * a neighbour allocating between the two reads is not misread. The list is left
 * in a malloc'd copy (*out); -1 if no consistent pair could be read. */
static int snapshot(CUdevice dev, nvmlProcessInfo_t **out, uint64_t *used, uint64_t *free_) {
    *out = NULL;
    for (int tries = 0; tries < 8; tries++) {
        int n = nvml_list(dev);
        if (n < 0) return -1;
        nvmlProcessInfo_t *v = malloc(((size_t)n + 1) * sizeof *v);
        if (!v) return -1;
        memcpy(v, g_procs_buf, (size_t)n * sizeof *v);
        if (mg_dev_mem(dev, used, free_) != 0) {
            free(v);
            return -1;
        }
        int again = nvml_list(dev);
        if (again == n && memcmp(v, g_procs_buf, (size_t)n * sizeof *v) == 0) {
            *out = v;
            return n;
        }
        free(v);
    }
    return -1;
}

void mg_meas_learn_begin(mg_meas_t *m) {
    if (self_pid() || !mg_nvml_pids_foreign() || mg_holds_context()) return;
    uint64_t used, free_;
    int n = snapshot(m->dev, &m->l0, &used, &free_);
    if (n < 0) return;
    m->n0 = n, m->used0 = used, m->free0 = free_, m->ok = 1;
}

#define MG_LEARN_SLACK (16ll << 20)

/* After a successful creation with a list kept: what the processes listed before
 * changed by is theirs, not this one's; a single process new in the list, whose
 * figure accounts for the device's whole change beyond theirs (within
 * MG_LEARN_SLACK: this process cannot be unlisted), is this one. 1 and *d if
 * learnt; else 0 and *others, the change of the processes listed before. */
static int meas_learn_end(mg_meas_t *m, uint64_t *used1, int64_t *d, int64_t *others) {
    nvmlProcessInfo_t *l1;
    uint64_t free1;
    int n = snapshot(m->dev, &l1, used1, &free1);
    if (n < 0) return -1;
    memcpy(g_procs_buf, l1, (size_t)n * sizeof *l1); /* g_procs_cap >= n: nvml_list filled it */
    free(l1);
    int64_t chg = 0;
    for (int j = 0; j < m->n0; j++) {
        uint64_t after = 0;
        for (int i = 0; i < n; i++)
            if (g_procs_buf[i].pid == m->l0[j].pid) after = g_procs_buf[i].usedGpuMemory;
        chg += (int64_t)(after - m->l0[j].usedGpuMemory);
    }
    *others = chg;
    int fresh = 0;
    unsigned pid = 0;
    uint64_t used = 0;
    for (int i = 0; i < n; i++) {
        int seen = 0;
        for (int j = 0; j < m->n0 && !seen; j++) seen = m->l0[j].pid == g_procs_buf[i].pid;
        if (!seen) fresh++, pid = g_procs_buf[i].pid, used = g_procs_buf[i].usedGpuMemory;
    }
    int64_t residual = (int64_t)(*used1 - m->used0) - chg - (int64_t)used;
    if (fresh != 1 || used == 0 || residual > MG_LEARN_SLACK || residual < -MG_LEARN_SLACK) return 0;
    g_self_learnt = pid;
    *d = (int64_t)used - (int64_t)(mg_process_counted() - m->mine0);
    return 1;
}

/* The memory the call took (negative: gave back), corrected and clamped (see top);
 * `rc`: the call's result (a failed call took nothing). */
int64_t mg_meas_end(mg_meas_t *m, CUresult rc) {
    uint64_t used1 = 0, free1, own1 = 0;
    if (rc != CUDA_SUCCESS) return 0;
    /* Per process: exact (see top). */
    int listed_self = m->own_ok ? mg_own_mem(m->dev, &own1) : -1;
    if (listed_self > 0) {
        uint64_t mine1 = mg_process_counted();
        return (int64_t)(own1 - m->own0) - (int64_t)(mine1 - m->mine0);
    }
    /* After a call that succeeded this process holds a context here, so NVML lists it: a
     * pid it does not list is not its own (an agent outside the host's pid namespace). */
    if (listed_self == 0) mg_nvml_unlearn_self();
    int ok = m->ok && mg_dev_mem(m->dev, &used1, &free1) == 0;
    uint64_t total1 = mg_container_total();
    int64_t listed = 0; /* the change of processes known to be others */
    int learnt = -1;
    if (ok && m->l0) {
        int64_t d;
        learnt = meas_learn_end(m, &used1, &d, &listed);
        if (learnt == 1) return d;
    }
    if (!ok) {
        if (!g_warned_measure) {
            g_warned_measure = 1;
            mg_log("cannot read the device's memory (NVML or cuMemGetInfo): context and module memory "
                   "is not counted");
        }
        return 0;
    }
    int64_t d = (int64_t)(used1 - m->used0);
    /* Listed others include the container's processes that allocated (they hold contexts). */
    int64_t others = learnt == 0 ? listed : (int64_t)(total1 - m->total0);
    d -= others;
    if (d > (int64_t)m->free0) d = (int64_t)m->free0;
    if (d > m->hi) d = m->hi;
    if (d < m->lo) d = m->lo;
    return d;
}

/* The bounds of a device-wide reading for a new context: [0, MG_CTX_MAX]. */
void mg_meas_bound_ctx(mg_meas_t *m) { m->lo = 0, m->hi = (int64_t)MG_CTX_MAX; }

/* |new - old| times `per`, plus a granule, saturated. */
static int64_t limit_span(size_t old, size_t value, uint64_t per) {
    uint64_t diff = value > old ? value - old : old - value;
    if (per && diff > (uint64_t)(INT64_MAX - MG_GRANULE) / per) return INT64_MAX;
    return (int64_t)(diff * per) + MG_GRANULE;
}

/* The bounds of a device-wide reading for a limit going from `old` to `value`:
 * what they imply (see top); unbounded for limits whose cost the shim cannot tell. */
void mg_meas_bound_limit(mg_meas_t *m, int limit, size_t old, size_t value, CUdevice dev) {
    int64_t span;
    if (limit == 0) { /* CU_LIMIT_STACK_SIZE: per resident thread */
        cu_devattr_fn attr = (cu_devattr_fn)cu_fn("cuDeviceGetAttribute");
        int sms = 0, tps = 0; /* MULTIPROCESSOR_COUNT 16, MAX_THREADS_PER_MULTIPROCESSOR 39 */
        if (!attr || attr(&sms, 16, dev) != CUDA_SUCCESS || attr(&tps, 39, dev) != CUDA_SUCCESS || sms <= 0 ||
            tps <= 0)
            return;
        span = limit_span(old, value, (uint64_t)sms * (uint64_t)tps);
    } else if (limit == 1 || limit == 2) { /* the printf FIFO, the malloc heap */
        span = limit_span(old, value, 1);
    } else if (limit == 5 || limit == 6) { /* L2 fetch granularity, persisting L2: no memory */
        span = MG_GRANULE;
    } else {
        return;
    }
    m->lo = value >= old ? 0 : -span;
    m->hi = value >= old ? span : 0;
}

/* A forked child is a new process: its own pid, and its own open file (the turn
 * locks are per open file). Called by mg_ctx.c's fork handler. */
void mg_meas_atfork_child(void) {
    g_self_learnt = 0; /* a new process: its own pid */
    if (g_ov_fd >= 0) close(g_ov_fd); /* its own open file: the turn locks are per open file */
    g_ov_fd = -1;
}
