/*
 * memguard: process state, the agent's two files, init, fork and exit.
 *
 * At the first call (or the library's constructor) the shim maps the
 * container's config (read-only) and usage file (shared, read-write) from
 * $GPUFRAC_CONTAINER_DIR and settles the process's mode: no config, pass
 * through (MODE_OFF); broken files, refuse allocations (MODE_BROKEN); else
 * limited (MODE_ON). A forked child starts afresh; a clean exit gives its slot
 * back at once.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "mg_internal.h"

_Atomic int g_mode;

const mg_config_t *g_cfg;
mg_usage_t *g_usage;
mg_proc_slot_t *_Atomic g_slot;
char g_dir[PATH_MAX];
char g_sock_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
char g_sock_legacy[sizeof(((struct sockaddr_un *)0)->sun_path)];
int32_t g_pid;
uint64_t g_start; /* this process's /proc starttime, set when it claims a slot */
_Atomic int g_warned_track;
int g_nvml_pids_local; /* NVML's pids are this pid namespace's (see mg_nvml.c) */

void mg_log(const char *fmt, ...) {
    char buf[512];
    int n = snprintf(buf, sizeof buf, "memguard[%d]: ", (int)getpid());
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof buf) n += vsnprintf(buf + n, sizeof buf - (size_t)n, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n >= sizeof buf - 1) n = (int)sizeof buf - 2;
    buf[n++] = '\n';
    ssize_t w = write(STDERR_FILENO, buf, (size_t)n); /* one write: lines from many processes do not interleave */
    (void)w;
}

/* ------------------------------------------------------------------------ */
/* Files and init.                                                           */

static int mg_map_file(const char *path, int writable, size_t want, void **out, char *err, size_t errlen) {
    int fd = open(path, (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
    if (fd < 0) {
        snprintf(err, errlen, "cannot open %s: %s", path, strerror(errno));
        return errno == ENOENT ? -2 : -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || (size_t)st.st_size < want) {
        snprintf(err, errlen, "%s is %lld bytes, want %zu (truncated or foreign file)", path,
                 (long long)st.st_size, want);
        close(fd);
        return -1;
    }
    void *p = mmap(NULL, want, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        snprintf(err, errlen, "cannot map %s: %s", path, strerror(errno));
        return -1;
    }
    *out = p;
    return 0;
}

static int mg_check_header(const void *p, uint64_t magic, size_t size, const char *path, char *err, size_t errlen) {
    const mg_config_t *h = p; /* magic, abi_version and file_size lead both structs */
    if (h->magic != magic || h->abi_version != MG_ABI_VERSION || h->file_size != size) {
        snprintf(err, errlen, "%s: bad magic %#llx, version %u or size %u (want version %u, size %zu)", path,
                 (unsigned long long)h->magic, h->abi_version, h->file_size, MG_ABI_VERSION, size);
        return -1;
    }
    return 0;
}

static unsigned mg_track_bits(void) {
    /* Read once at init: how many live allocations per kind this process may
     * track (power of two). Default 2^18. */
    const char *s = getenv("MEMGUARD_TRACK_BITS");
    long v = s ? strtol(s, NULL, 10) : 18;
    return v < 10 ? 10 : v > 26 ? 26 : (unsigned)v;
}

static void mg_atfork_child(void);

static int mg_do_init(void) {
    char err[PATH_MAX + 200], path[PATH_MAX + 16];
    mg_init_real_dlsym();
    g_pid = (int32_t)getpid();
    const char *dir = getenv("GPUFRAC_CONTAINER_DIR");
    if (!dir || !*dir) dir = MG_DEFAULT_DIR;
    snprintf(g_dir, sizeof g_dir, "%s", dir);
    /* Too long for a unix socket: no arbiter at that path. */
    if ((size_t)snprintf(g_sock_path, sizeof g_sock_path, "%s/%s/%s", g_dir, MG_SOCKET_DIR, MG_SOCKET_FILE) >=
        sizeof g_sock_path)
        g_sock_path[0] = 0;
    if ((size_t)snprintf(g_sock_legacy, sizeof g_sock_legacy, "%s/%s", g_dir, MG_SOCKET_FILE) >= sizeof g_sock_legacy)
        g_sock_legacy[0] = 0;

    void *cfg = NULL, *usage = NULL;
    snprintf(path, sizeof path, "%s/%s", g_dir, MG_CONFIG_FILE);
    int rc = mg_map_file(path, 0, sizeof(mg_config_t), &cfg, err, sizeof err);
    if (rc == -2) {
        mg_log("no config at %s: GPU memory is not limited (pass-through)", path);
        return MODE_OFF;
    }
    if (rc == 0 && mg_check_header(cfg, MG_CONFIG_MAGIC, sizeof(mg_config_t), path, err, sizeof err) != 0) rc = -1;
    if (rc != 0) {
        mg_log("%s; refusing GPU allocations until the agent repairs it", err);
        return MODE_BROKEN;
    }
    g_cfg = cfg;
    snprintf(path, sizeof path, "%s/%s", g_dir, MG_USAGE_FILE);
    rc = mg_map_file(path, 1, sizeof(mg_usage_t), &usage, err, sizeof err);
    if (rc == 0 && mg_check_header(usage, MG_USAGE_MAGIC, sizeof(mg_usage_t), path, err, sizeof err) != 0) rc = -1;
    if (rc != 0) {
        /* Without the shared counter the container's limit cannot be held
         * across its processes: refuse rather than loosen it. */
        mg_log("%s; refusing GPU allocations (container usage cannot be counted)", err);
        return MODE_BROKEN;
    }
    g_usage = usage;
    mg_compute_attach(g_dir);
    unsigned bits = mg_track_bits();
    if (mg_tab_init(&g_ptrs, bits) || mg_tab_init(&g_arrays, bits > 16 ? 16 : bits) ||
        mg_tab_init(&g_handles, bits) || mg_tab_init(&g_maps, bits) || mg_tab_init(&g_hostpools, 10)) {
        mg_log("cannot map allocation tables: %s; refusing GPU allocations", strerror(errno));
        return MODE_BROKEN;
    }
    g_nvml_pids_local = mg_nvml_pids_local();
    pthread_atfork(NULL, NULL, mg_atfork_child);
    mg_reap_at_start();
    return MODE_ON;
}

MG_COLD int mg_init_slow(void) {
    int m = atomic_load_explicit(&g_mode, memory_order_acquire);
    while (m == MODE_UNINIT || m == MODE_INITING) {
        int expected = MODE_UNINIT;
        if (atomic_compare_exchange_strong(&g_mode, &expected, MODE_INITING)) {
            m = mg_do_init();
            atomic_store_explicit(&g_mode, m, memory_order_release);
            return m;
        }
        sched_yield(); /* another thread of this process is initialising */
        m = atomic_load_explicit(&g_mode, memory_order_acquire);
    }
    return m;
}

__attribute__((constructor)) static void mg_constructor(void) { mg_mode(); }

static void mg_atfork_child(void) {
    /* The child owns none of the parent's allocations (CUDA contexts do not
     * survive fork) and is another process: fresh slot, fresh tables. */
    pthread_mutex_init(&g_claim_mu, NULL);
    mg_pools_reset();
    g_pid = (int32_t)getpid();
    g_start = 0;
    atomic_store(&g_slot, NULL);
    mg_gate_atfork_child();
    mg_nvml_atfork_child();
    if (atomic_load(&g_mode) == MODE_ON) {
        mg_tab_reset(&g_ptrs);
        mg_tab_reset(&g_arrays);
        mg_tab_reset(&g_handles);
        mg_tab_reset(&g_maps);
        mg_tab_reset(&g_hostpools);
    }
}

__attribute__((destructor)) static void mg_destructor(void) {
    /* A clean exit gives the slot back at once (the driver frees the memory
     * at exit); a killed process is reaped by the next one to notice. Later
     * calls during teardown pass through uncounted. */
    if (atomic_load(&g_mode) != MODE_ON) return;
    atomic_store(&g_mode, MODE_DONE);
    mg_gate_follow(NULL); /* the slot may go to another process, and its flag with it */
    mg_proc_slot_t *s = atomic_exchange(&g_slot, NULL);
    if (s && (int32_t)getpid() == g_pid && mg_release_slot(s, g_pid) > 1) mg_exit_return_grant();
}
