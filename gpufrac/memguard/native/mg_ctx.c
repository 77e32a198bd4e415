/*
 * memguard: the device memory a process holds besides its allocations — CUDA
 * contexts (primary, regular, green), loaded modules and libraries, and what
 * cuCtxSetLimit takes (the stack of every resident thread, the printf FIFO, the
 * device malloc heap; cudaDeviceSetLimit calls it). A context alone is hundreds
 * of MiB on an H100, per process, so a container of several processes is
 * charged for each of them, as NVML counts them.
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
 * call. NVML names it when its pids are this pid namespace's (mg_nvml_self_pid),
 * or once it is learnt: NVML's pids are the host's (a container), but a process
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
 * Device-wide, bounded. Otherwise the reading is the device's used memory, and
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
 *
 * Only a limited container (the shim ON) measures; otherwise these calls pass
 * straight through (a broken config refuses allocations, not contexts).
 *
 * Over the limit: the object is counted at once and must pass mg_admit (the
 * arbiter is asked as for any burst); if the container may not hold it, the call
 * is undone (context destroyed, primary released, module or library unloaded,
 * old limit restored) and fails with CUDA_ERROR_OUT_OF_MEMORY, as a full GPU
 * fails it. Memory the driver only takes later (lazy module loading, CUDA 12.2+
 * default, loads kernels at first launch) is not seen here.
 */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>

#include "mg_internal.h"

typedef CUresult (*cu_getinfo_fn)(size_t *, size_t *);
typedef CUresult (*cu_busid_fn)(char *, int, CUdevice);
typedef CUresult (*cu_ctxdev_fn)(CUdevice *);
typedef CUresult (*cu_ctxcur_fn)(CUcontext *);
typedef CUresult (*cu_getlimit_fn)(size_t *, int);
typedef nvmlReturn_t (*nvml_init_fn)(void);
typedef nvmlReturn_t (*nvml_bybus_fn)(const char *, nvmlDevice_t *);
typedef nvmlReturn_t (*nvml_meminfo_fn)(nvmlDevice_t, nvmlMemory_t *);
typedef nvmlReturn_t (*nvml_procs_fn)(nvmlDevice_t, unsigned int *, nvmlProcessInfo_t *); /* the _v2 and _v3 lists */
typedef CUresult (*cu_devattr_fn)(int *, int, CUdevice);

#define NVML_VALUE_NOT_AVAILABLE (~0ull)
#define MG_CTX_MAX (1ull << 30)
#define MG_GRANULE (2ll << 20)

#define MG_MAX_DEVS 64

static pthread_mutex_t g_ov_mu = PTHREAD_MUTEX_INITIALIZER;
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

typedef struct {
    CUdevice dev;
    uint64_t used0, free0, total0;
    uint64_t own0, mine0; /* NVML's figure for this process, this process's counted bytes */
    int ok, own_ok, turn;
    int64_t lo, hi; /* the device-wide reading's bounds for this kind of object */
    nvmlProcessInfo_t *l0; /* learning: NVML's processes before (none of them this one) */
    int n0;
} mg_meas_t;

/* Callers hold g_ov_mu from meas_begin to meas_release, which must follow every
 * meas_begin, after the measured bytes are charged (or the call undone): a sibling
 * measuring next must see them in the container's total before its window. */
static void meas_begin(mg_meas_t *m, CUdevice dev) {
    m->dev = dev;
    m->turn = turn_take(dev);
    m->lo = INT64_MIN, m->hi = INT64_MAX;
    m->l0 = NULL, m->n0 = 0;
    m->mine0 = mg_process_counted();
    m->own_ok = mg_own_mem(dev, &m->own0) >= 0;
    m->total0 = mg_container_total();
    m->ok = mg_dev_mem(dev, &m->used0, &m->free0) == 0;
}

static void meas_release(mg_meas_t *m) {
    if (m->turn) turn_lock(m->dev, F_UNLCK);
    m->turn = 0;
    free(m->l0);
    m->l0 = NULL;
}

static int holds_context(void); /* with the records, below */

/* Before a context creation whose process's NVML pid is not known: while it
 * holds no context NVML does not list it, so every process listed now is
 * another; keep that list (see top, learning). Call right after meas_begin. */
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

static void meas_learn_begin(mg_meas_t *m) {
    if (self_pid() || !mg_nvml_pids_foreign() || holds_context()) return;
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
static int64_t meas_end(mg_meas_t *m, CUresult rc) {
    uint64_t used1 = 0, free1, own1 = 0;
    if (rc != CUDA_SUCCESS) return 0;
    /* Per process: exact (see top). */
    if (m->own_ok && mg_own_mem(m->dev, &own1) > 0) {
        uint64_t mine1 = mg_process_counted();
        return (int64_t)(own1 - m->own0) - (int64_t)(mine1 - m->mine0);
    }
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
static void meas_bound_ctx(mg_meas_t *m) { m->lo = 0, m->hi = (int64_t)MG_CTX_MAX; }

/* |new - old| times `per`, plus a granule, saturated. */
static int64_t limit_span(size_t old, size_t value, uint64_t per) {
    uint64_t diff = value > old ? value - old : old - value;
    if (per && diff > (uint64_t)(INT64_MAX - MG_GRANULE) / per) return INT64_MAX;
    return (int64_t)(diff * per) + MG_GRANULE;
}

/* The bounds of a device-wide reading for a limit going from `old` to `value`:
 * what they imply (see top); unbounded for limits whose cost the shim cannot tell. */
static void meas_bound_limit(mg_meas_t *m, int limit, size_t old, size_t value, CUdevice dev) {
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

/* The current context's device (or 0), for calls that act on the current context. */
static CUdevice mg_cur_dev(void) {
    cu_ctxdev_fn ctxdev = (cu_ctxdev_fn)cu_fn("cuCtxGetDevice");
    CUdevice d = 0;
    if (!ctxdev || ctxdev(&d) != CUDA_SUCCESS) d = 0;
    return d;
}

static CUcontext mg_cur_ctx(void) {
    cu_ctxcur_fn cur = (cu_ctxcur_fn)cu_fn("cuCtxGetCurrent");
    CUcontext c = NULL;
    if (!cur || cur(&c) != CUDA_SUCCESS) c = NULL;
    return c;
}

/* ------------------------------------------------------------------------ */
/* What is counted per object (process-local, under g_ov_mu).               */

enum { OV_CTX = 1, OV_PRIMARY, OV_GREEN, OV_MODULE, OV_LIBRARY, OV_LIMIT };

typedef struct {
    int kind;
    int sub;       /* OV_PRIMARY: device; OV_LIMIT: the CUlimit */
    uint64_t key;  /* the handle (OV_LIMIT: its context) */
    uint64_t ctx;  /* OV_MODULE: the context it was loaded into */
    uint64_t bytes;
    int refs;      /* OV_PRIMARY: retains */
} mg_ov_t;

static mg_ov_t *g_ov;
static size_t g_ov_n, g_ov_cap;

static mg_ov_t *ov_find(int kind, uint64_t key, int sub) {
    for (size_t i = 0; i < g_ov_n; i++)
        if (g_ov[i].kind == kind && g_ov[i].key == key && (kind != OV_PRIMARY && kind != OV_LIMIT ? 1 : g_ov[i].sub == sub))
            return &g_ov[i];
    return NULL;
}

/* Does this process hold a context (so NVML may list it already)? */
static int holds_context(void) {
    for (size_t i = 0; i < g_ov_n; i++)
        if (g_ov[i].kind == OV_CTX || g_ov[i].kind == OV_GREEN || (g_ov[i].kind == OV_PRIMARY && g_ov[i].refs > 0))
            return 1;
    return 0;
}

static mg_ov_t *ov_add(int kind, uint64_t key, int sub, uint64_t ctx) {
    if (g_ov_n == g_ov_cap) {
        size_t cap = g_ov_cap ? g_ov_cap * 2 : 64;
        mg_ov_t *v = realloc(g_ov, cap * sizeof *v);
        if (!v) return NULL;
        g_ov = v, g_ov_cap = cap;
    }
    g_ov[g_ov_n] = (mg_ov_t){.kind = kind, .sub = sub, .key = key, .ctx = ctx};
    return &g_ov[g_ov_n++];
}

/* Remove record `o`; returns the bytes it held. */
static uint64_t ov_drop(mg_ov_t *o) {
    uint64_t b = o->bytes;
    *o = g_ov[--g_ov_n];
    return b;
}

/* A context went: its own record and everything loaded or set in it. */
static uint64_t ov_drop_ctx(uint64_t ctx) {
    uint64_t freed = 0;
    for (size_t i = 0; i < g_ov_n;) {
        mg_ov_t *o = &g_ov[i];
        if ((o->kind == OV_CTX && o->key == ctx) || (o->kind == OV_LIMIT && o->key == ctx) ||
            (o->kind == OV_MODULE && o->ctx == ctx))
            freed += ov_drop(o); /* the last record moved here: look at index i again */
        else
            i++;
    }
    return freed;
}

static void ov_freed(uint64_t bytes) {
    if (!bytes) return;
    mg_uncharge(bytes);
    mg_maybe_return_grant();
}

/* Count `d` measured bytes for record `o` (created by the caller). 0: the
 * container may hold them; -1: it may not (nothing stays counted; undo the call). */
static int ov_charge(mg_ov_t *o, int64_t d) {
    if (d <= 0) return 0;
    mg_force_charge((uint64_t)d);
    if (!mg_admit((uint64_t)d)) {
        mg_uncharge((uint64_t)d);
        return -1;
    }
    if (o) o->bytes += (uint64_t)d;
    return 0;
}

static void ov_warn_full(void) { mg_log("too many contexts and modules to record: some stay counted after they go"); }

/* ------------------------------------------------------------------------ */
/* Contexts.                                                                 */

CUresult mg_h_cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    if (!mg_on()) return CALL_REAL(cuDevicePrimaryCtxRetain, pctx, dev);
    pthread_mutex_lock(&g_ov_mu);
    mg_ov_t *o = ov_find(OV_PRIMARY, 0, dev);
    mg_meas_t m;
    int measure = !o || o->refs == 0;
    if (measure) meas_begin(&m, dev), meas_bound_ctx(&m), meas_learn_begin(&m);
    CUresult rc = CALL_REAL(cuDevicePrimaryCtxRetain, pctx, dev);
    int64_t d = measure ? meas_end(&m, rc) : 0;
    if (rc == CUDA_SUCCESS && !measure) {
        o->refs++;
    } else if (rc == CUDA_SUCCESS) { /* it became active now: it took its memory */
        if (!o) o = ov_add(OV_PRIMARY, 0, dev, 0);
        if (o) o->key = 0, o->ctx = (uint64_t)(uintptr_t)*pctx, o->refs = 1;
        else ov_warn_full();
        if (ov_charge(o, d) != 0) {
            if (o) ov_drop(o);
            CALL_REAL(cuDevicePrimaryCtxRelease_v2, dev);
            *pctx = NULL;
            rc = mg_x_refuse();
        }
    }
    if (measure) meas_release(&m);
    pthread_mutex_unlock(&g_ov_mu);
    return rc;
}

static CUresult primary_release(CUdevice dev, int v2, int reset) {
    if (!mg_on()) {
        if (reset) return v2 ? CALL_REAL(cuDevicePrimaryCtxReset_v2, dev) : CALL_REAL(cuDevicePrimaryCtxReset, dev);
        return v2 ? CALL_REAL(cuDevicePrimaryCtxRelease_v2, dev) : CALL_REAL(cuDevicePrimaryCtxRelease, dev);
    }
    pthread_mutex_lock(&g_ov_mu);
    CUresult rc;
    if (reset) rc = v2 ? CALL_REAL(cuDevicePrimaryCtxReset_v2, dev) : CALL_REAL(cuDevicePrimaryCtxReset, dev);
    else rc = v2 ? CALL_REAL(cuDevicePrimaryCtxRelease_v2, dev) : CALL_REAL(cuDevicePrimaryCtxRelease, dev);
    uint64_t freed = 0;
    mg_ov_t *o = rc == CUDA_SUCCESS ? ov_find(OV_PRIMARY, 0, dev) : NULL;
    if (o && o->refs > 0 && (reset || --o->refs == 0)) { /* inactive: the driver freed it and what it held */
        uint64_t ctx = o->ctx;
        o->refs = 0;
        freed = o->bytes;
        o->bytes = 0;
        freed += ov_drop_ctx(ctx);
    }
    pthread_mutex_unlock(&g_ov_mu);
    ov_freed(freed);
    return rc;
}

CUresult mg_h_cuDevicePrimaryCtxRelease(CUdevice dev) { return primary_release(dev, 0, 0); }
CUresult mg_h_cuDevicePrimaryCtxRelease_v2(CUdevice dev) { return primary_release(dev, 1, 0); }
CUresult mg_h_cuDevicePrimaryCtxReset(CUdevice dev) { return primary_release(dev, 0, 1); }
CUresult mg_h_cuDevicePrimaryCtxReset_v2(CUdevice dev) { return primary_release(dev, 1, 1); }

/* After a call (result `rc`) that made an object at *handle_ptr and took `d` bytes:
 * they are counted for the object, which goes with context `owner_ctx` (0: none);
 * past the limit it is undone (`undo`) and the call refused. Under g_ov_mu. */
#define CHARGE_NEW(kind, handle_ptr, owner_ctx, rc, d, undo)                   \
    do {                                                                       \
        if ((rc) == CUDA_SUCCESS && (handle_ptr)) {                            \
            mg_ov_t *o_ = ov_add((kind), (uint64_t)(uintptr_t)*(handle_ptr), 0, (owner_ctx)); \
            if (!o_) ov_warn_full();                                           \
            if (ov_charge(o_, (d)) != 0) {                                     \
                if (o_) ov_drop(o_);                                           \
                undo;                                                          \
                *(handle_ptr) = NULL;                                          \
                (rc) = mg_x_refuse();                                          \
            }                                                                  \
        }                                                                      \
    } while (0)

/* A new context (regular or green) of `dev`, made by `rc_expr`; `undo` destroys it. */
#define CREATE_MEASURED(kind, dev, handle_ptr, rc_expr, undo)                  \
    do {                                                                       \
        if (!mg_on()) return (rc_expr); \
        pthread_mutex_lock(&g_ov_mu);                                          \
        mg_meas_t m_;                                                          \
        meas_begin(&m_, (dev));                                                \
        meas_bound_ctx(&m_);                                                   \
        meas_learn_begin(&m_);                                                 \
        CUresult rc_ = (rc_expr);                                              \
        int64_t d_ = meas_end(&m_, rc_);                                       \
        CHARGE_NEW((kind), (handle_ptr), 0, rc_, d_, undo);                    \
        meas_release(&m_);                                                     \
        pthread_mutex_unlock(&g_ov_mu);                                        \
        return rc_;                                                            \
    } while (0)

CUresult mg_h_cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    CREATE_MEASURED(OV_CTX, dev, pctx, CALL_REAL(cuCtxCreate, pctx, flags, dev), CALL_REAL(cuCtxDestroy_v2, *pctx));
}
CUresult mg_h_cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    CREATE_MEASURED(OV_CTX, dev, pctx, CALL_REAL(cuCtxCreate_v2, pctx, flags, dev), CALL_REAL(cuCtxDestroy_v2, *pctx));
}
CUresult mg_h_cuCtxCreate_v3(CUcontext *pctx, void *paramsArray, int numParams, unsigned int flags, CUdevice dev) {
    CREATE_MEASURED(OV_CTX, dev, pctx, CALL_REAL(cuCtxCreate_v3, pctx, paramsArray, numParams, flags, dev),
                    CALL_REAL(cuCtxDestroy_v2, *pctx));
}
CUresult mg_h_cuCtxCreate_v4(CUcontext *pctx, void *ctxCreateParams, unsigned int flags, CUdevice dev) {
    CREATE_MEASURED(OV_CTX, dev, pctx, CALL_REAL(cuCtxCreate_v4, pctx, ctxCreateParams, flags, dev),
                    CALL_REAL(cuCtxDestroy_v2, *pctx));
}
CUresult mg_h_cuGreenCtxCreate(CUgreenCtx *phCtx, CUdevResourceDesc desc, CUdevice dev, unsigned int flags) {
    CREATE_MEASURED(OV_GREEN, dev, phCtx, CALL_REAL(cuGreenCtxCreate, phCtx, desc, dev, flags),
                    CALL_REAL(cuGreenCtxDestroy, *phCtx));
}

static CUresult ctx_destroy(CUcontext ctx, int v2) {
    if (!mg_on()) return v2 ? CALL_REAL(cuCtxDestroy_v2, ctx) : CALL_REAL(cuCtxDestroy, ctx);
    pthread_mutex_lock(&g_ov_mu);
    CUresult rc = v2 ? CALL_REAL(cuCtxDestroy_v2, ctx) : CALL_REAL(cuCtxDestroy, ctx);
    uint64_t freed = rc == CUDA_SUCCESS ? ov_drop_ctx((uint64_t)(uintptr_t)ctx) : 0;
    pthread_mutex_unlock(&g_ov_mu);
    ov_freed(freed);
    return rc;
}

CUresult mg_h_cuCtxDestroy(CUcontext ctx) { return ctx_destroy(ctx, 0); }
CUresult mg_h_cuCtxDestroy_v2(CUcontext ctx) { return ctx_destroy(ctx, 1); }

CUresult mg_h_cuGreenCtxDestroy(CUgreenCtx hCtx) {
    if (!mg_on()) return CALL_REAL(cuGreenCtxDestroy, hCtx);
    pthread_mutex_lock(&g_ov_mu);
    CUresult rc = CALL_REAL(cuGreenCtxDestroy, hCtx);
    mg_ov_t *o = rc == CUDA_SUCCESS ? ov_find(OV_GREEN, (uint64_t)(uintptr_t)hCtx, 0) : NULL;
    uint64_t freed = o ? ov_drop(o) : 0;
    pthread_mutex_unlock(&g_ov_mu);
    ov_freed(freed);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Limits: the value's memory, above what the context already took.         */

CUresult mg_h_cuCtxSetLimit(int limit, size_t value) {
    if (!mg_on()) return CALL_REAL(cuCtxSetLimit, limit, value);
    pthread_mutex_lock(&g_ov_mu);
    cu_getlimit_fn getlimit = (cu_getlimit_fn)cu_fn("cuCtxGetLimit");
    size_t old = 0;
    int have_old = getlimit && getlimit(&old, limit) == CUDA_SUCCESS;
    uint64_t ctx = (uint64_t)(uintptr_t)mg_cur_ctx();
    mg_meas_t m;
    CUdevice dev = mg_cur_dev();
    meas_begin(&m, dev);
    if (have_old) meas_bound_limit(&m, limit, old, value, dev);
    CUresult rc = CALL_REAL(cuCtxSetLimit, limit, value);
    int64_t d = meas_end(&m, rc);
    uint64_t freed = 0;
    if (rc == CUDA_SUCCESS) {
        mg_ov_t *o = ov_find(OV_LIMIT, ctx, limit);
        if (d < 0 && o) { /* lowered: give back what it gave back, at most what was counted for it */
            freed = (uint64_t)-d < o->bytes ? (uint64_t)-d : o->bytes;
            o->bytes -= freed;
            if (!o->bytes) ov_drop(o);
        } else if (d > 0) {
            if (!o && !(o = ov_add(OV_LIMIT, ctx, limit, ctx))) ov_warn_full();
            if (ov_charge(o, d) != 0) {
                if (o && !o->bytes) ov_drop(o);
                if (have_old) CALL_REAL(cuCtxSetLimit, limit, old);
                rc = mg_x_refuse();
            }
        }
    }
    meas_release(&m);
    pthread_mutex_unlock(&g_ov_mu);
    ov_freed(freed);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Modules and libraries.                                                    */

#define LOAD_MEASURED(kind, handle_ptr, rc_expr, undo)                         \
    do {                                                                       \
        if (!mg_on()) return (rc_expr); \
        pthread_mutex_lock(&g_ov_mu);                                          \
        uint64_t ctx_ = (uint64_t)(uintptr_t)mg_cur_ctx();                     \
        mg_meas_t m_;                                                          \
        meas_begin(&m_, mg_cur_dev());                                         \
        CUresult rc_ = (rc_expr);                                              \
        int64_t d_ = meas_end(&m_, rc_);                                       \
        CHARGE_NEW((kind), (handle_ptr), (kind) == OV_MODULE ? ctx_ : 0, rc_, d_, undo); \
        meas_release(&m_);                                                     \
        pthread_mutex_unlock(&g_ov_mu);                                        \
        return rc_;                                                            \
    } while (0)

CUresult mg_h_cuModuleLoad(CUmodule *module, const char *fname) {
    LOAD_MEASURED(OV_MODULE, module, CALL_REAL(cuModuleLoad, module, fname), CALL_REAL(cuModuleUnload, *module));
}
CUresult mg_h_cuModuleLoadData(CUmodule *module, const void *image) {
    LOAD_MEASURED(OV_MODULE, module, CALL_REAL(cuModuleLoadData, module, image), CALL_REAL(cuModuleUnload, *module));
}
CUresult mg_h_cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions, void *options,
                                 void **optionValues) {
    LOAD_MEASURED(OV_MODULE, module, CALL_REAL(cuModuleLoadDataEx, module, image, numOptions, options, optionValues),
                  CALL_REAL(cuModuleUnload, *module));
}
CUresult mg_h_cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin) {
    LOAD_MEASURED(OV_MODULE, module, CALL_REAL(cuModuleLoadFatBinary, module, fatCubin), CALL_REAL(cuModuleUnload, *module));
}
CUresult mg_h_cuLibraryLoadData(CUlibrary *library, const void *code, void *jitOptions, void **jitOptionsValues,
                                unsigned int numJitOptions, void *libraryOptions, void **libraryOptionValues,
                                unsigned int numLibraryOptions) {
    LOAD_MEASURED(OV_LIBRARY, library,
                  CALL_REAL(cuLibraryLoadData, library, code, jitOptions, jitOptionsValues, numJitOptions, libraryOptions,
                        libraryOptionValues, numLibraryOptions),
                  CALL_REAL(cuLibraryUnload, *library));
}
CUresult mg_h_cuLibraryLoadFromFile(CUlibrary *library, const char *fileName, void *jitOptions,
                                    void **jitOptionsValues, unsigned int numJitOptions, void *libraryOptions,
                                    void **libraryOptionValues, unsigned int numLibraryOptions) {
    LOAD_MEASURED(OV_LIBRARY, library,
                  CALL_REAL(cuLibraryLoadFromFile, library, fileName, jitOptions, jitOptionsValues, numJitOptions,
                        libraryOptions, libraryOptionValues, numLibraryOptions),
                  CALL_REAL(cuLibraryUnload, *library));
}

static CUresult unload(int kind, uint64_t key, CUresult rc) {
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&g_ov_mu);
    mg_ov_t *o = ov_find(kind, key, 0);
    uint64_t freed = o ? ov_drop(o) : 0;
    pthread_mutex_unlock(&g_ov_mu);
    ov_freed(freed);
    return rc;
}

CUresult mg_h_cuModuleUnload(CUmodule hmod) {
    CUresult rc = CALL_REAL(cuModuleUnload, hmod);
    return mg_on() ? unload(OV_MODULE, (uint64_t)(uintptr_t)hmod, rc) : rc;
}

CUresult mg_h_cuLibraryUnload(CUlibrary library) {
    CUresult rc = CALL_REAL(cuLibraryUnload, library);
    return mg_on() ? unload(OV_LIBRARY, (uint64_t)(uintptr_t)library, rc) : rc;
}

/* A forked child has none of the parent's contexts (CUDA does not survive fork). */
static void mg_ctx_atfork_child(void) {
    pthread_mutex_init(&g_ov_mu, NULL);
    g_ov_n = 0;
    g_self_learnt = 0; /* a new process: its own pid */
    if (g_ov_fd >= 0) close(g_ov_fd); /* its own open file: the turn locks are per open file */
    g_ov_fd = -1;
}

__attribute__((constructor)) static void mg_ctx_init(void) { pthread_atfork(NULL, NULL, mg_ctx_atfork_child); }

MG_SYMBOLS_CTX(MG_XALIAS)
