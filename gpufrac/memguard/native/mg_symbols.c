/*
 * memguard: the hook table and how calls reach the hooks (real-symbol
 * resolution, dlsym, cuGetProcAddress).
 *
 * How calls reach the hooks. One table (mg_symbols.h) lists every entry
 * point: exported name, the base name and cudaVersion under which the driver's
 * cuGetProcAddress hands it out, per-thread-stream variant or not, and the
 * hook. It drives all three ways a program finds a driver function:
 *   1. direct symbol: each hook is exported under the driver's name, so a
 *      program linked against libcuda binds to it first (LD_PRELOAD);
 *   2. dlsym(handle, name) on a libcuda / libnvidia-ml handle (ctypes, pynvml,
 *      cudart's bootstrap): dlsym itself is overridden; when the real lookup
 *      returns the driver's own function for a table entry, the hook is
 *      returned instead;
 *   3. cuGetProcAddress / _v2 (CUDA 12 runtimes, cuda-python): the real query
 *      runs first, so the driver keeps deciding which variant (legacy, _v2,
 *      _ptsz) a (name, version, flags) means; the answer is swapped for the
 *      hook of that variant (matched by address, else by the table's versions).
 * Every other driver function reached any of these ways is a gated trampoline
 * (mg_gate.c): an export of the shim under its name, or one bound to the address
 * the driver answered, so a swapped-out process comes back whatever it calls.
 * The real function behind each entry is resolved once, by name, from the
 * already-loaded driver library, and cached in g_real[].
 */
#include <dlfcn.h>
#include <string.h>

#include "mg_internal.h"

/* dlsym is called by the sanitizer runtimes while they start (before ASan is
 * ready), so that path must not be instrumented. */
#define MG_NOSAN __attribute__((no_sanitize("address", "undefined")))
/* Our dlsym must reach the real one by a sibling call (see dlsym below), also
 * at the ASan build's -O1: clang is told at the call, GCC for the function. */
#if defined(__clang__)
#define MG_SIBCALL
#define MG_TAIL __attribute__((musttail))
#else
#define MG_SIBCALL __attribute__((optimize("optimize-sibling-calls")))
#define MG_TAIL
#endif

static const char *const g_lib_names[] = {"libcuda.so.1", "libnvidia-ml.so.1"};

typedef struct {
    const char *name;
    const char *base;
    int version;
    unsigned char lib;
    unsigned char ptds;
    void *hook;
} mg_sym_t;

static const mg_sym_t g_syms[S_COUNT];        /* defined after the hooks */
void *_Atomic g_real[S_COUNT];                 /* the driver's functions, resolved once */
static void *_Atomic g_lib_handle[2];

static dlsym_fn _Atomic g_real_dlsym;

/* ------------------------------------------------------------------------ */
/* Real symbol resolution.                                                   */

MG_NOSAN dlsym_fn mg_init_real_dlsym(void) {
    /* glibc >= 2.34 has dlsym in libc (GLIBC_2.34, plus the GLIBC_2.2.5 /
     * GLIBC_2.17 compat versions); older glibc in libdl. We export dlsym
     * ourselves, so the real one is reached only through dlvsym. */
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.0"};
    dlsym_fn f = atomic_load_explicit(&g_real_dlsym, memory_order_acquire);
    for (size_t i = 0; !f && i < sizeof versions / sizeof versions[0]; i++) {
        void *p = dlvsym(RTLD_NEXT, "dlsym", versions[i]);
        memcpy(&f, &p, sizeof f);
    }
    if (f) atomic_store_explicit(&g_real_dlsym, f, memory_order_release);
    return f;
}

static inline MG_NOSAN dlsym_fn mg_real_dlsym(void) {
    dlsym_fn f = atomic_load_explicit(&g_real_dlsym, memory_order_acquire);
    return MG_LIKELY(f != NULL) ? f : mg_init_real_dlsym();
}

/* The loaded driver library (by soname, as the app itself loads it). */
static void *mg_lib(int lib) {
    void *h = atomic_load_explicit(&g_lib_handle[lib], memory_order_acquire);
    if (h) return h;
    h = dlopen(g_lib_names[lib], RTLD_LAZY); /* the one loaded already, or loaded now (a direct call first) */
    if (!h) return NULL;
    void *expected = NULL;
    if (!atomic_compare_exchange_strong(&g_lib_handle[lib], &expected, h)) dlclose(h);
    return atomic_load_explicit(&g_lib_handle[lib], memory_order_acquire);
}

MG_COLD void *mg_resolve(int i) {
    void *h = mg_lib(g_syms[i].lib);
    dlsym_fn real_dlsym = mg_real_dlsym();
    if (!h || !real_dlsym) return NULL;
    void *p = real_dlsym(h, g_syms[i].name);
    if (!p || p == g_syms[i].hook) return NULL;
    void *expected = NULL;
    atomic_compare_exchange_strong(&g_real[i], &expected, p);
    return atomic_load_explicit(&g_real[i], memory_order_acquire);
}

void *mg_driver_fn(int lib, const char *name) {
    void *h = mg_lib(lib);
    dlsym_fn real_dlsym = mg_real_dlsym();
    return h && real_dlsym ? real_dlsym(h, name) : NULL;
}

/* Driver functions the shim calls for itself and does not hook (memory pools). */
static const char *const g_plain_names[P_COUNT] = {"cuMemPoolGetAttribute", "cuPointerGetAttribute",
                                                   "cuCtxGetDevice", "cuDeviceGetMemPool"};
static void *_Atomic g_plain[P_COUNT];

void *mg_plain(int i) {
    void *p = atomic_load_explicit(&g_plain[i], memory_order_acquire);
    if (MG_LIKELY(p != NULL)) return p;
    void *h = mg_lib(LIB_CUDA);
    dlsym_fn real_dlsym = mg_real_dlsym();
    p = h && real_dlsym ? real_dlsym(h, g_plain_names[i]) : NULL;
    if (p) atomic_store_explicit(&g_plain[i], p, memory_order_release);
    return p;
}

/* --- symbol lookup --- */

static int mg_find(const char *name) {
    /* Not the fast path: runs once per function a program looks up. */
    for (int i = 0; i < S_COUNT; i++)
        if (strcmp(g_syms[i].name, name) == 0) return i;
    return -1;
}

/* The hook to hand out instead of `p`, the driver's answer for cuGetProcAddress(symbol, version, flags). */
static void *mg_proc_hook(const char *symbol, void *p, int version, cuuint64_t flags) {
    int want_ptds = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    int best = -1, best_any = -1;
    for (int i = 0; i < S_COUNT; i++) {
        const mg_sym_t *e = &g_syms[i];
        if (e->lib != LIB_CUDA) continue;
        /* Asked by a variant's own name (cuGraphInstantiateWithFlags): the driver's export. */
        if (strcmp(e->base, symbol) != 0) {
            if (strcmp(e->name, symbol) == 0 && mg_real(i) == p) return e->hook;
            continue;
        }
        if (p == e->hook) return p;
        if (mg_real(i) == p) return e->hook; /* the driver's own choice, matched by address */
        if (e->version > version) continue;
        if (e->ptds == want_ptds && (best < 0 || e->version > g_syms[best].version)) best = i;
        if (!e->ptds && (best_any < 0 || e->version > g_syms[best_any].version)) best_any = i;
    }
    if (best < 0) best = best_any; /* no per-thread variant of this function */
    /* Not hooked, or older than anything hooked (the driver's legacy answer): gated alone. */
    if (best < 0) return mg_gate_wrap(symbol, p);
    /* The driver answered with an address no export has (an internal entry):
     * use it as the real function of the variant the table names. */
    void *expected = NULL;
    atomic_compare_exchange_strong(&g_real[best], &expected, p);
    return g_syms[best].hook;
}

HOOK CUresult mg_h_cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                       CUdriverProcAddressQueryResult *symbolStatus) {
    mg_swap_gate();
    CUresult rc = CALL_REAL(cuGetProcAddress_v2, symbol, pfn, cudaVersion, flags, symbolStatus);
    if (rc == CUDA_SUCCESS && symbol && pfn && *pfn) *pfn = mg_proc_hook(symbol, *pfn, cudaVersion, flags);
    return rc;
}

HOOK CUresult mg_h_cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    mg_swap_gate();
    CUresult rc = CALL_REAL(cuGetProcAddress, symbol, pfn, cudaVersion, flags);
    if (rc == CUDA_SUCCESS && symbol && pfn && *pfn) *pfn = mg_proc_hook(symbol, *pfn, cudaVersion, flags);
    return rc;
}

/* Does `p` lie in the driver library (loaded by now: a lookup found it)? */
static _Atomic uintptr_t g_cuda_base;

static MG_COLD int mg_in_driver(const void *p) {
    uintptr_t base = atomic_load_explicit(&g_cuda_base, memory_order_acquire);
    Dl_info di;
    if (!base) {
        void *h = dlopen(g_lib_names[LIB_CUDA], RTLD_LAZY | RTLD_NOLOAD);
        dlsym_fn real = mg_real_dlsym();
        void *f = h && real ? real(h, "cuInit") : NULL;
        if (f && dladdr(f, &di)) base = (uintptr_t)di.dli_fbase;
        if (h) dlclose(h);
        if (!base) return 0;
        atomic_store_explicit(&g_cuda_base, base, memory_order_release);
    }
    return dladdr(p, &di) && (uintptr_t)di.dli_fbase == base;
}

static MG_COLD void *mg_dlsym_hooked(void *handle, const char *name) {
    dlsym_fn real = mg_real_dlsym();
    void *p = real ? real(handle, name) : NULL;
    if (!p) return p;
    int i = mg_find(name);
    if (i >= 0) {
        if (p == g_syms[i].hook) return p;
        /* Hand out the hook only for the driver library's own function. */
        return mg_real(i) == p ? g_syms[i].hook : p;
    }
    if (name[0] != 'c') return p; /* NVML: not the CUDA driver, not gated */
    if (mg_gate_is_stub(p)) {
        /* The shim's own export, found in the global scope: there only if the driver is
         * (what the lookup would have found past the shim), so a probe for a function
         * the driver lacks still finds nothing. */
        void *q = real(RTLD_NEXT, name);
        return q && mg_in_driver(q) ? p : q;
    }
    /* Any other function of the driver (not of cuBLAS, cudart, ...): gated. */
    return mg_in_driver(p) ? mg_gate_wrap(name, p) : p;
}

/* dlsym itself: the way ctypes, pynvml and cudart's bootstrap find driver
 * functions, which LD_PRELOAD alone does not reach (a handle-scoped lookup
 * never sees the preloaded library). */
MG_EXPORT MG_NOSAN MG_SIBCALL void *dlsym(void *handle, const char *name) {
    if (handle != RTLD_NEXT &&
        ((name[0] == 'c' && name[1] == 'u') || (name[0] == 'n' && name[1] == 'v' && name[2] == 'm')))
        return mg_dlsym_hooked(handle, name);
    /* A sibling call, so glibc still sees the caller's return address and
     * RTLD_NEXT means "after the caller", not "after memguard". */
    MG_TAIL return mg_real_dlsym()(handle, name);
}

/* ------------------------------------------------------------------------ */
/* The table (each source exports its own hooks).                            */

static const mg_sym_t g_syms[S_COUNT] = {
#define MG_ROW(sym, base, ver, lib, ptds) [S_##sym] = {#sym, base, ver, lib, ptds, (void *)mg_h_##sym},
    MG_SYMBOLS_ALL(MG_ROW)
#undef MG_ROW
};

MG_SYMBOLS_PROC(MG_XALIAS)
