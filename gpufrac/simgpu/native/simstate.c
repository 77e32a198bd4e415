/* Helpers over the node-state file; see simstate.h and nodestate.h. */
#include "simstate.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <sched.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static simgpu_node_t *_Atomic g_node;
static char g_path[4096];
static pthread_mutex_t g_map_lock = PTHREAD_MUTEX_INITIALIZER;

/* Map $SIMGPU_STATE unless it is the file already mapped. Old mappings are kept
 * (never unmapped) so a pointer another thread still holds stays valid. */
static void map_node(void) {
    const char *path = getenv("SIMGPU_STATE");
    if (!path || !*path) {
        fprintf(stderr, "simgpu: SIMGPU_STATE is not set: no simulated GPUs\n");
        atomic_store(&g_node, NULL);
        return;
    }
    if (atomic_load(&g_node) && strcmp(path, g_path) == 0) return;
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        fprintf(stderr, "simgpu: cannot open SIMGPU_STATE=%s: %s\n", path, strerror(errno));
        return;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || (size_t)st.st_size < sizeof(simgpu_node_t)) {
        fprintf(stderr, "simgpu: %s is not a node-state file (size %lld, want %zu)\n", path,
                (long long)st.st_size, sizeof(simgpu_node_t));
        close(fd);
        return;
    }
    void *p = mmap(NULL, sizeof(simgpu_node_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        fprintf(stderr, "simgpu: mmap %s: %s\n", path, strerror(errno));
        return;
    }
    simgpu_node_t *n = p;
    if (n->magic != SIMGPU_MAGIC || n->abi_version != SIMGPU_ABI_VERSION ||
        n->file_size != sizeof(simgpu_node_t) || n->gpu_count > SIMGPU_MAX_GPUS) {
        fprintf(stderr, "simgpu: %s: bad magic/version/size (abi %u, want %u)\n", path,
                n->abi_version, SIMGPU_ABI_VERSION);
        munmap(p, sizeof(simgpu_node_t));
        atomic_store(&g_node, NULL);
        return;
    }
    snprintf(g_path, sizeof g_path, "%s", path);
    atomic_store(&g_node, n);
}

simgpu_node_t *sim_node(void) {
    simgpu_node_t *n = atomic_load(&g_node);
    if (n) return n;
    return sim_node_reload();
}

simgpu_node_t *sim_node_reload(void) {
    pthread_mutex_lock(&g_map_lock);
    map_node();
    pthread_mutex_unlock(&g_map_lock);
    return atomic_load(&g_node);
}

uint64_t sim_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The host's /proc: $SIMGPU_HOST_PROC (a pod with a pid namespace of its own, whose /proc
 * shows only its own processes), or NULL where /proc is it. */
static const char *host_proc(void) {
    const char *p = getenv("SIMGPU_HOST_PROC");
    return p && *p ? p : NULL;
}

static _Atomic int32_t g_self_for, g_self_host; /* getpid() -> its host pid, found once per process */

int32_t sim_self_pid(void) {
    int32_t me = (int32_t)getpid();
    if (atomic_load_explicit(&g_self_for, memory_order_acquire) == me)
        return atomic_load_explicit(&g_self_host, memory_order_relaxed);
    int32_t host = me;
    const char *hp = host_proc();
    if (hp) { /* the host's procfs names this process by its host pid in its "self" link */
        char path[PATH_MAX], buf[32];
        snprintf(path, sizeof path, "%s/self", hp);
        ssize_t n = readlink(path, buf, sizeof buf - 1);
        if (n > 0) {
            buf[n] = 0;
            host = (int32_t)strtol(buf, NULL, 10);
        }
    }
    atomic_store_explicit(&g_self_host, host, memory_order_relaxed);
    atomic_store_explicit(&g_self_for, me, memory_order_release);
    return host;
}

int sim_pid_exists(int32_t pid) {
    const char *hp = host_proc();
    if (!hp) return kill(pid, 0) == 0 || errno == EPERM; /* kill() in a pid namespace names another */
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/%d", hp, (int)pid);
    return access(path, F_OK) == 0;
}

/* /proc/<pid>/stat's state letter and starttime (ticks since boot), <pid> a host pid;
 * 0 / 0 if unreadable. */
static uint64_t proc_stat(pid_t pid, char *state) {
    char path[PATH_MAX], buf[1024];
    *state = 0;
    const char *hp = host_proc();
    snprintf(path, sizeof path, "%s/%d/stat", hp ? hp : "/proc", (int)pid);
    FILE *f = fopen(path, "re");
    if (!f) return 0;
    size_t len = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[len] = 0;
    /* comm may hold spaces and parentheses: fields resume after the last ')'. */
    char *p = strrchr(buf, ')');
    if (!p || p[1] != ' ') return 0;
    *state = p[2];
    unsigned long long st = 0;
    /* after ") ": state(3) ... starttime is field 22, i.e. 20 fields on. */
    int field = 2;
    for (p++; *p && field < 22; p++)
        if (*p == ' ') field++;
    if (field == 22) sscanf(p, "%llu", &st);
    return st;
}

static uint64_t proc_start_time(pid_t pid) {
    char state;
    return proc_stat(pid, &state);
}

/* Liveness locks. The driver frees what a process holds as its files close at exit, before
 * it is a zombie and whether or not it was killed. Each process holds an open-file-description
 * lock on one byte per slot it owns, past the end of the node-state file; the kernel drops it
 * as the process's files close at exit, so a slot whose lock another process holds belongs to
 * a live process (one fcntl), and only a slot whose lock is gone is looked up in /proc (a
 * process that exited, a zombie, a reused pid; or a slot nobody locked: a test's own). */
#define SIM_LOCK_BASE (1ll << 40)
static pthread_mutex_t g_lock_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_lock_fd = -1;
static pid_t g_lock_pid;             /* the process that opened g_lock_fd (a forked child has its own) */
static simgpu_node_t *g_lock_node;   /* the node it locks slots of */

/* This process's own descriptor of node `n`'s file, for its slot locks; -1 if none. */
static int lock_fd(simgpu_node_t *n) {
    pthread_mutex_lock(&g_lock_mu);
    if (g_lock_fd >= 0 && (g_lock_pid != getpid() || g_lock_node != n)) {
        close(g_lock_fd); /* a parent's description (its locks stay its own) or another node's */
        g_lock_fd = -1;
    }
    if (g_lock_fd < 0 && n == atomic_load(&g_node) && g_path[0]) {
        g_lock_fd = open(g_path, O_RDWR | O_CLOEXEC);
        g_lock_pid = getpid();
        g_lock_node = n;
    }
    int fd = g_lock_fd;
    pthread_mutex_unlock(&g_lock_mu);
    return fd;
}

static int slot_lock(simgpu_node_t *n, const simgpu_proc_t *s, int cmd, short type) {
    int fd = lock_fd(n);
    if (fd < 0) return -1;
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = SIM_LOCK_BASE + (s - n->procs), .l_len = 1};
    if (fcntl(fd, cmd, &fl) != 0) return -1;
    return cmd == F_OFD_GETLK ? fl.l_type != F_UNLCK : 0;
}

void sim_slot_unlock(simgpu_node_t *n, const simgpu_proc_t *s) { slot_lock(n, s, F_OFD_SETLK, F_UNLCK); }

static __thread pid_t t_pid;
static __thread simgpu_proc_t *t_slot[SIMGPU_MAX_GPUS];

simgpu_proc_t *sim_my_slot(simgpu_node_t *n, uint32_t gpu) {
    pid_t pid = sim_self_pid();
    if (t_pid != pid) { /* first call in this thread, or after fork */
        memset(t_slot, 0, sizeof t_slot);
        t_pid = pid;
    }
    if (gpu >= SIMGPU_MAX_GPUS) return NULL;
    simgpu_proc_t *s = t_slot[gpu];
    /* The cached slot must belong to this node: a process may switch nodes (cuInit re-reads $SIMGPU_STATE). */
    int in_node = s >= &n->procs[0] && s < &n->procs[SIMGPU_MAX_PROCS];
    if (s && in_node && atomic_load(&s->pid) == pid && s->gpu == gpu) return s;
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++) {
        s = &n->procs[i];
        if (atomic_load(&s->pid) == pid && s->gpu == gpu) return t_slot[gpu] = s;
    }
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < SIMGPU_MAX_PROCS; i++) {
            s = &n->procs[i];
            int32_t expect = SIMGPU_PID_FREE;
            if (atomic_compare_exchange_strong(&s->pid, &expect, SIMGPU_PID_REAPING)) {
                s->gpu = gpu;
                s->start_time = proc_start_time(pid);
                atomic_store(&s->used_bytes, 0);
                atomic_store(&s->swapped_bytes, 0);
                atomic_store(&s->launches, 0);
                atomic_store(&s->last_launch_ns, 0);
                atomic_store(&s->busy_until_ns, 0);
                atomic_store(&s->busy_ns_total, 0);
                atomic_store(&s->ckpt_state, SIMGPU_CKPT_RUNNING);
                /* The schedule skips a slot whose pid is not a live one: safe to reset unlocked. */
                s->ctx_ns = s->work_end_ns = s->sm_end_ns = s->seg_count = 0;
                atomic_store(&s->pid, pid);
                slot_lock(n, s, F_OFD_SETLK, F_WRLCK); /* none taken: /proc tells, as before */
                return t_slot[gpu] = s;
            }
        }
        sim_reap_dead(n); /* table full: make room and try once more */
    }
    return NULL;
}

static int pid_gone(simgpu_node_t *n, const simgpu_proc_t *s, int32_t pid) {
    if (slot_lock(n, s, F_OFD_GETLK, F_WRLCK) == 1) return 0; /* its owner lives and holds its lock */
    if (sim_pid_exists(pid)) {
        /* A zombie's GPU memory is already gone on a real driver (freed as the process
         * exits, before its parent reaps it); a reused pid belongs to someone else. */
        char state;
        uint64_t st = proc_stat(pid, &state);
        if (state == 'Z' || state == 'X') return 1;
        return st != 0 && s->start_time != 0 && st != s->start_time;
    }
    return host_proc() || errno == ESRCH;
}

uint64_t sim_reap_dead(simgpu_node_t *n) {
    uint64_t freed = 0;
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++) {
        simgpu_proc_t *s = &n->procs[i];
        int32_t pid = atomic_load(&s->pid);
        if (pid <= 0 || !pid_gone(n, s, pid)) continue;
        if (!atomic_compare_exchange_strong(&s->pid, &pid, SIMGPU_PID_REAPING)) continue;
        uint64_t used = atomic_exchange(&s->used_bytes, 0);
        if (s->gpu < n->gpu_count && used) sim_mem_give(n, s->gpu, used);
        atomic_store(&s->swapped_bytes, 0);
        freed += used;
        atomic_store(&s->pid, SIMGPU_PID_FREE);
    }
    return freed;
}

int sim_mem_take(simgpu_node_t *n, uint32_t gpu, uint64_t bytes) {
    simgpu_gpu_t *g = &n->gpus[gpu];
    uint64_t cap = g->total_bytes > g->reserved_bytes ? g->total_bytes - g->reserved_bytes : 0;
    for (int attempt = 0; attempt < 2; attempt++) {
        uint64_t cur = atomic_load(&g->used_bytes);
        while (cur <= cap && bytes <= cap - cur) {
            if (atomic_compare_exchange_weak(&g->used_bytes, &cur, cur + bytes)) return 0;
        }
        if (attempt == 0 && sim_reap_dead(n) == 0) break;
    }
    return -1;
}

void sim_mem_give(simgpu_node_t *n, uint32_t gpu, uint64_t bytes) {
    simgpu_gpu_t *g = &n->gpus[gpu];
    uint64_t cur = atomic_load(&g->used_bytes);
    /* Saturate at zero: a bookkeeping slip must never read as "17 TB used". */
    while (!atomic_compare_exchange_weak(&g->used_bytes, &cur, cur >= bytes ? cur - bytes : 0)) {
    }
}

void sim_post_event(simgpu_node_t *n, uint32_t gpu, uint64_t type, uint64_t data) {
    simgpu_gpu_t *g = &n->gpus[gpu];
    uint64_t seq = atomic_fetch_add(&g->event_seq, 1) + 1;
    simgpu_event_t *e = &g->events[(seq - 1) % SIMGPU_EVENT_RING];
    e->type = type;
    e->data = data;
    e->time_us = sim_now_ns() / 1000;
    __atomic_store_n(&e->seq, seq, __ATOMIC_RELEASE);
    /* After the event is readable: a waiter that loaded the old word rescans and finds it. */
    atomic_fetch_add(&n->event_wake, 1);
    syscall(SYS_futex, (uint32_t *)&n->event_wake, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

void sim_event_sleep(simgpu_node_t *n, uint32_t seen, uint64_t timeout_ns) {
    struct timespec ts = {(time_t)(timeout_ns / 1000000000ull), (long)(timeout_ns % 1000000000ull)};
    /* Not FUTEX_PRIVATE: the word lives in a file mapping shared between processes. */
    syscall(SYS_futex, (uint32_t *)&n->event_wake, FUTEX_WAIT, seen, &ts, NULL, 0);
}

static int parse_list(simgpu_node_t *n, const char *spec, const uint32_t *in, int in_count,
                      uint32_t out[SIMGPU_MAX_GPUS]) {
    /* Unset or "all": every GPU. Set but empty hides every GPU, as CUDA does. */
    if (!spec || strcmp(spec, "all") == 0) {
        memcpy(out, in, sizeof(uint32_t) * (size_t)in_count);
        return in_count;
    }
    if (!*spec || strcmp(spec, "none") == 0 || strcmp(spec, "void") == 0) return 0;
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", spec);
    int count = 0;
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok && count < SIMGPU_MAX_GPUS;
         tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ') tok++;
        int found = -1;
        if (strncmp(tok, "GPU-", 4) == 0) {
            for (int i = 0; i < in_count; i++)
                if (strcmp(n->gpus[in[i]].uuid, tok) == 0) found = i;
        } else {
            char *end;
            long idx = strtol(tok, &end, 10);
            if (*end == 0 && idx >= 0 && idx < in_count) found = (int)idx;
        }
        if (found < 0) break; /* like CUDA: an invalid entry ends the list */
        out[count++] = in[found];
    }
    return count;
}

int sim_visible_gpus(simgpu_node_t *n, int cuda, uint32_t out[SIMGPU_MAX_GPUS]) {
    uint32_t all[SIMGPU_MAX_GPUS], runtime[SIMGPU_MAX_GPUS];
    for (uint32_t i = 0; i < n->gpu_count; i++) all[i] = i;
    int count = parse_list(n, getenv("NVIDIA_VISIBLE_DEVICES"), all, (int)n->gpu_count, runtime);
    if (!cuda) {
        memcpy(out, runtime, sizeof(uint32_t) * (size_t)count);
        return count;
    }
    return parse_list(n, getenv("CUDA_VISIBLE_DEVICES"), runtime, count, out);
}

/* ------------------------------------------------------------------ the compute model */

#define SLICE_MIN_NS 1000ull            /* a slice shorter than 1 us would only spin the player */
#define WAIT_RECHECK_NS 5000000ull      /* a waiter looks again at least this often */
#define CLOCK_BACK_NS 1000000000ull     /* the wall clock stepped back this far: start the schedule afresh */

static pthread_mutex_t *sched_mutex(simgpu_gpu_t *g) {
    _Static_assert(sizeof(pthread_mutex_t) <= SIMGPU_SCHED_LOCK_BYTES, "sched_lock too small");
    _Static_assert(offsetof(simgpu_gpu_t, sched_lock) % 8 == 0, "sched_lock misaligned");
    pthread_mutex_t *m = (pthread_mutex_t *)(void *)g->sched_lock;
    uint32_t st = atomic_load(&g->sched_init);
    while (st != SIMGPU_SCHED_READY) {
        if (st == 0) {
            uint32_t me = (uint32_t)getpid();
            if (!atomic_compare_exchange_strong(&g->sched_init, &st, me)) continue;
            /* Robust: the kernel hands the lock on when its holder dies. Process-shared: it
             * lives in the node-state file every simulated process maps. */
            pthread_mutexattr_t a;
            pthread_mutexattr_init(&a);
            pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
            pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
            pthread_mutex_init(m, &a);
            pthread_mutexattr_destroy(&a);
            atomic_store(&g->sched_init, SIMGPU_SCHED_READY);
            return m;
        }
        /* Another process is making it; if it died doing so, start over. */
        if (kill((pid_t)st, 0) != 0 && errno == ESRCH) {
            atomic_compare_exchange_strong(&g->sched_init, &st, 0);
        } else {
            sched_yield();
        }
        st = atomic_load(&g->sched_init);
    }
    return m;
}

static simgpu_proc_t *slot_of(simgpu_node_t *n, uint32_t gpu, uint32_t holder) {
    if (holder == 0 || holder > SIMGPU_MAX_PROCS) return NULL;
    simgpu_proc_t *s = &n->procs[holder - 1];
    return atomic_load(&s->pid) > 0 && s->gpu == gpu ? s : NULL;
}

static uint64_t pending(const simgpu_proc_t *s) { return s->work_end_ns > s->ctx_ns ? s->work_end_ns - s->ctx_ns : 0; }

/* A context whose process is gone has no GPU work: its context is destroyed with it. */
static void drop_work(simgpu_proc_t *s) { s->work_end_ns = s->sm_end_ns = s->ctx_ns; }

/* The next context to hold the GPU at wall time t: round robin from the one after the
 * holder, the holder itself last. NULL if no context has work. */
static simgpu_proc_t *next_holder(simgpu_node_t *n, uint32_t gpu, simgpu_gpu_t *g, uint64_t t) {
    uint32_t from = g->holder; /* 1-based; 0 starts at slot 0 */
    for (uint32_t k = 1; k <= SIMGPU_MAX_PROCS; k++) {
        uint32_t i = (from + k - 1) % SIMGPU_MAX_PROCS; /* slot index after the holder's */
        simgpu_proc_t *s = &n->procs[i];
        int32_t pid = atomic_load(&s->pid);
        if (pid <= 0 || s->gpu != gpu || pending(s) == 0) continue;
        if (i + 1 != g->holder && kill(pid, 0) != 0 && errno == ESRCH) {
            drop_work(s);
            continue;
        }
        if (i + 1 != g->holder) atomic_fetch_add(&g->switches, 1);
        g->holder = i + 1;
        uint64_t slice = (uint64_t)(g->timeslice_us ? g->timeslice_us : SIMGPU_TIMESLICE_US) * 1000ull;
        g->slice_end_ns = t + (slice < SLICE_MIN_NS ? SLICE_MIN_NS : slice);
        return s;
    }
    g->holder = 0;
    return NULL;
}

/* The holder's work ran for wall time [t, t + run). */
static void ran(simgpu_gpu_t *g, simgpu_proc_t *s, uint64_t t, uint64_t run) {
    uint64_t c0 = s->ctx_ns;
    simgpu_seg_t *last = s->seg_count ? &s->segs[(s->seg_count - 1) % SIMGPU_SEG_RING] : NULL;
    if (last && last->wall_ns + last->len_ns == t && last->ctx_ns + last->len_ns == c0) {
        last->len_ns += run;
    } else {
        s->segs[s->seg_count % SIMGPU_SEG_RING] = (simgpu_seg_t){t, c0, run};
        s->seg_count++;
    }
    s->ctx_ns = c0 + run;
    atomic_fetch_add(&s->busy_ns_total, run);
    atomic_store(&s->busy_until_ns, t + run);
    atomic_fetch_add(&g->busy_ns_total, run);
}

/* Play the GPU's schedule from where it was left up to `now`. Under the lock. */
static void play(simgpu_node_t *n, uint32_t gpu, uint64_t now) {
    simgpu_gpu_t *g = &n->gpus[gpu];
    uint64_t t = g->sched_now_ns;
    if (t == 0 || t > now + CLOCK_BACK_NS) { /* first look, or the wall clock stepped back */
        g->sched_now_ns = now;
        simgpu_proc_t *h = slot_of(n, gpu, g->holder);
        if (!h || pending(h) == 0) next_holder(n, gpu, g, now);
        return;
    }
    while (t < now) {
        simgpu_proc_t *h = slot_of(n, gpu, g->holder);
        if (!h || pending(h) == 0 || t >= g->slice_end_ns) h = next_holder(n, gpu, g, t);
        if (!h) {
            t = now; /* nothing to run: the GPU idles */
            break;
        }
        uint64_t run = pending(h);
        if (g->slice_end_ns - t < run) run = g->slice_end_ns - t;
        if (now - t < run) run = now - t;
        ran(g, h, t, run);
        t += run;
    }
    g->sched_now_ns = t;
}

uint64_t sim_sched_enter(simgpu_node_t *n, uint32_t gpu) {
    pthread_mutex_t *m = sched_mutex(&n->gpus[gpu]);
    if (pthread_mutex_lock(m) == EOWNERDEAD) pthread_mutex_consistent(m); /* a holder died: its play is redone */
    uint64_t now = sim_now_ns();
    play(n, gpu, now);
    return now;
}

void sim_sched_leave(simgpu_node_t *n, uint32_t gpu) { pthread_mutex_unlock(sched_mutex(&n->gpus[gpu])); }

uint64_t sim_sched_kernel(simgpu_node_t *n, uint32_t gpu, simgpu_proc_t *s, uint64_t ready, uint64_t dur_ns,
                          uint64_t blocks) {
    uint64_t now = s->ctx_ns, start = ready > now ? ready : now;
    /* Kernels of one context share its SMs: its SM work queues behind what is there, and
     * a kernel ends no sooner than its own duration allows. */
    uint64_t sms = n->gpus[gpu].sm_count ? n->gpus[gpu].sm_count : 1;
    uint64_t share = blocks >= sms ? dur_ns : (uint64_t)((double)dur_ns * (double)blocks / (double)sms);
    uint64_t sm = (s->sm_end_ns > now ? s->sm_end_ns : now) + share;
    s->sm_end_ns = sm;
    uint64_t end = start + dur_ns > sm ? start + dur_ns : sm;
    if (end > s->work_end_ns) s->work_end_ns = end;
    return end;
}

/* Whether a wait on `s` is over: reached, its work dropped, or the slot no longer ours. */
static int wait_over(simgpu_proc_t *s, uint64_t target) {
    return atomic_load(&s->pid) != (int32_t)getpid() || s->ctx_ns >= target || s->work_end_ns < target;
}

int sim_sched_reached(simgpu_node_t *n, uint32_t gpu, simgpu_proc_t *s, uint64_t target) {
    sim_sched_enter(n, gpu);
    int r = wait_over(s, target);
    sim_sched_leave(n, gpu);
    return r;
}

int sim_sched_running(simgpu_node_t *n, uint32_t gpu, const simgpu_proc_t *s, uint64_t now) {
    simgpu_gpu_t *g = &n->gpus[gpu];
    const simgpu_proc_t *h = slot_of(n, gpu, g->holder);
    if (h && pending(h) > 0 && (!s || s == h)) return 1;
    if (s) return atomic_load(&s->busy_until_ns) >= now;
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++) {
        const simgpu_proc_t *p = &n->procs[i];
        if (atomic_load(&p->pid) > 0 && p->gpu == gpu && atomic_load(&p->busy_until_ns) >= now) return 1;
    }
    return 0;
}

int sim_sched_idle(simgpu_node_t *n, uint32_t gpu, simgpu_proc_t *s) {
    sim_sched_enter(n, gpu);
    int r = atomic_load(&s->pid) <= 0 || pending(s) == 0;
    sim_sched_leave(n, gpu);
    return r;
}

void sim_sched_wait(simgpu_node_t *n, uint32_t gpu, simgpu_proc_t *s, uint64_t target) {
    for (;;) {
        uint64_t now = sim_sched_enter(n, gpu);
        if (target == 0) target = s->work_end_ns;
        if (wait_over(s, target)) {
            sim_sched_leave(n, gpu);
            return;
        }
        /* The soonest it can be done: at once if it holds the GPU, else after the holder's run. */
        simgpu_gpu_t *g = &n->gpus[gpu];
        uint64_t need = target - s->ctx_ns, wake = now;
        simgpu_proc_t *h = slot_of(n, gpu, g->holder);
        if (h && h != s) {
            uint64_t left = g->slice_end_ns > now ? g->slice_end_ns - now : 0;
            wake += pending(h) < left ? pending(h) : left;
        }
        wake += need;
        sim_sched_leave(n, gpu);
        if (wake > now + WAIT_RECHECK_NS) wake = now + WAIT_RECHECK_NS;
        struct timespec ts = {(time_t)((wake - now) / 1000000000ull), (long)((wake - now) % 1000000000ull)};
        nanosleep(&ts, NULL);
    }
}

uint64_t sim_sched_wall_at(simgpu_node_t *n, uint32_t gpu, simgpu_proc_t *s, uint64_t target) {
    sim_sched_enter(n, gpu);
    uint64_t wall = 0;
    if (s->ctx_ns >= target && s->seg_count) {
        uint64_t kept = s->seg_count < SIMGPU_SEG_RING ? s->seg_count : SIMGPU_SEG_RING;
        for (uint64_t k = 0; k < kept; k++) { /* newest first */
            const simgpu_seg_t *seg = &s->segs[(s->seg_count - 1 - k) % SIMGPU_SEG_RING];
            wall = seg->wall_ns; /* older than every kept run: the oldest one's start */
            if (target >= seg->ctx_ns) {
                uint64_t into = target - seg->ctx_ns;
                wall = seg->wall_ns + (into < seg->len_ns ? into : seg->len_ns);
                break;
            }
        }
    }
    sim_sched_leave(n, gpu);
    return wall;
}
