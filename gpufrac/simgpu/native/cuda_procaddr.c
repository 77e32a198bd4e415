/*
 * simgpu fake libcuda.so.1 — cuGetProcAddress: the one symbol table built from
 * every area's section (cu_syms_*), the driver's version and per-thread-stream
 * rules for picking an entry, and the $SIMGPU_PROC_LOG / $SIMGPU_PROC_STUB test aids.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_internal.h"

/* ------------------------------------------------------------------ cuGetProcAddress */

#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM 2ull
enum { PROC_SUCCESS = 0, PROC_SYMBOL_NOT_FOUND = 1, PROC_VERSION_NOT_SUFFICIENT = 2 };

CU_API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                    int *symbolStatus);
CU_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);


/* The one table: every area's section, sorted by name then version. */
static const cu_sym_t **g_table;
static size_t g_table_n;
static pthread_once_t g_table_once = PTHREAD_ONCE_INIT;

static int sym_cmp(const void *a, const void *b) {
    const cu_sym_t *x = *(const cu_sym_t *const *)a, *y = *(const cu_sym_t *const *)b;
    int c = strcmp(x->name, y->name);
    return c ? c : x->version != y->version ? (x->version < y->version ? -1 : 1) : x->ptds - y->ptds;
}

static void build_table(void) {
    const struct {
        const cu_sym_t *s;
        size_t n;
    } sec[] = {
        {cu_syms_core, cu_syms_core_n},
        {cu_syms_ctx, cu_syms_ctx_n},
        {cu_syms_mem, cu_syms_mem_n},
        {cu_syms_array, cu_syms_array_n},
        {cu_syms_copy, cu_syms_copy_n},
        {cu_syms_pool, cu_syms_pool_n},
        {cu_syms_vmm, cu_syms_vmm_n},
        {cu_syms_exec, cu_syms_exec_n},
        {cu_syms_launch, cu_syms_launch_n},
        {cu_syms_graph, cu_syms_graph_n},
        {cu_syms_graph_exec, cu_syms_graph_exec_n},
        {cu_syms_ckpt, cu_syms_ckpt_n},
    };
    size_t total = 0;
    for (size_t i = 0; i < sizeof sec / sizeof sec[0]; i++) total += sec[i].n;
    g_table = malloc(total * sizeof *g_table);
    if (!g_table) return;
    for (size_t i = 0; i < sizeof sec / sizeof sec[0]; i++)
        for (size_t j = 0; j < sec[i].n; j++) g_table[g_table_n++] = &sec[i].s[j];
    qsort(g_table, g_table_n, sizeof *g_table, sym_cmp);
}

/* $SIMGPU_PROC_LOG: every lookup is appended there as one line, "symbol version
 * flags result status exported-symbol|-", so a test can see what a library (the
 * real cudart) asked for and what it was answered. Opened once. */
static int g_proc_log = -1;
static pthread_once_t g_proc_log_once = PTHREAD_ONCE_INIT;

static void proc_log_open(void) {
    const char *path = getenv("SIMGPU_PROC_LOG");
    if (path && *path) g_proc_log = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
}

static void proc_log(const char *symbol, int version, cuuint64_t flags, CUresult rc, int status, const cu_sym_t *e) {
    pthread_once(&g_proc_log_once, proc_log_open);
    if (g_proc_log < 0) return;
    char line[512];
    int n = snprintf(line, sizeof line, "%.300s %d %llu %d %d %s\n", symbol ? symbol : "(null)", version,
                     (unsigned long long)flags, (int)rc, status, e ? e->symbol : "-");
    if (n > 0 && (size_t)n < sizeof line) {
        ssize_t w = write(g_proc_log, line, (size_t)n); /* one write: O_APPEND keeps lines whole */
        (void)w;
    }
}

/* Real driver rules: the newest variant introduced at or before cudaVersion; with
 * CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM its _ptds/_ptsz twin if it has one;
 * DEFAULT and LEGACY_STREAM give the legacy-stream variant. */
static CUresult proc_find(const char *symbol, void **pfn, int version, cuuint64_t flags, int *status,
                          const cu_sym_t **found) {
    *found = NULL;
    if (status) *status = PROC_SYMBOL_NOT_FOUND;
    if (!symbol || !pfn || (flags & ~3ull)) return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    pthread_once(&g_table_once, build_table);
    size_t lo = 0, hi = g_table_n;
    while (lo < hi) { /* first entry with name >= symbol */
        size_t mid = (lo + hi) / 2;
        if (strcmp(g_table[mid]->name, symbol) < 0) lo = mid + 1;
        else hi = mid;
    }
    if (lo == g_table_n || strcmp(g_table[lo]->name, symbol) != 0) return CUDA_ERROR_NOT_FOUND;
    int want_pt = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    size_t end = lo;
    int best_ver = -1;
    for (; end < g_table_n && strcmp(g_table[end]->name, symbol) == 0; end++)
        if (g_table[end]->version <= version && g_table[end]->version > best_ver) best_ver = g_table[end]->version;
    const cu_sym_t *best = NULL;
    for (size_t i = lo; i < end; i++) {
        const cu_sym_t *e = g_table[i];
        if (e->version != best_ver) continue;
        if (e->ptds == want_pt) best = e;
        else if (!e->ptds && !best) best = e;
    }
    if (!best) {
        if (status) *status = PROC_VERSION_NOT_SUFFICIENT;
        return CUDA_ERROR_NOT_FOUND;
    }
    *pfn = best->fn;
    *found = best;
    if (status) *status = PROC_SUCCESS;
    return CUDA_SUCCESS;
}

/* $SIMGPU_PROC_STUB=1 (tests of a real CUDA runtime only): a name the fake does
 * not simulate is answered, at any version, with a function that returns
 * CUDA_ERROR_NOT_SUPPORTED, standing in for the real driver's complete table;
 * the real cudart resolves every entry point at start-up and refuses a driver
 * that lacks one. Never a name it does simulate, and never by dlsym. */
static CUresult cu_not_simulated(void) { return CUDA_ERROR_NOT_SUPPORTED; }
static const cu_sym_t g_stub = {"-", 0, 0, (void *)cu_not_simulated, "stub"};
static int g_proc_stub = -1;

static CUresult proc_lookup(const char *symbol, void **pfn, int version, cuuint64_t flags, int *status) {
    const cu_sym_t *e;
    int st = PROC_SYMBOL_NOT_FOUND;
    CUresult rc = proc_find(symbol, pfn, version, flags, &st, &e);
    if (g_proc_stub < 0) {
        const char *v = getenv("SIMGPU_PROC_STUB");
        g_proc_stub = v && strcmp(v, "1") == 0;
    }
    if (rc == CUDA_ERROR_NOT_FOUND && st == PROC_SYMBOL_NOT_FOUND && g_proc_stub && symbol && *symbol) {
        *pfn = g_stub.fn;
        st = PROC_SUCCESS;
        rc = CUDA_SUCCESS;
        e = &g_stub;
    }
    if (status) *status = st;
    proc_log(symbol, version, flags, rc, st, e);
    return rc;
}

CU_API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                    int *symbolStatus) {
    return proc_lookup(symbol, pfn, cudaVersion, flags, symbolStatus);
}

CU_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    return proc_lookup(symbol, pfn, cudaVersion, flags, NULL);
}
