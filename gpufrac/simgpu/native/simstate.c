/* Helpers over the node-state file; see simstate.h and nodestate.h. */
#include "simstate.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
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
