/*
 * memguard: the device memory a process holds besides its allocations — CUDA
 * contexts (primary, regular, green), loaded modules and libraries, and what
 * cuCtxSetLimit takes (the stack of every resident thread, the printf FIFO, the
 * device malloc heap; cudaDeviceSetLimit calls it). A context alone is hundreds
 * of MiB on an H100, per process, so a container of several processes is
 * charged for each of them, as NVML counts them.
 *
 * How much memory each such call took is measured around it (mg_measure.c).
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
#include <pthread.h>
#include <stdlib.h>

#include "mg_internal.h"

typedef CUresult (*cu_ctxdev_fn)(CUdevice *);
typedef CUresult (*cu_ctxcur_fn)(CUcontext *);
typedef CUresult (*cu_getlimit_fn)(size_t *, int);

static pthread_mutex_t g_ov_mu = PTHREAD_MUTEX_INITIALIZER;

static void *cu_fn(const char *name) { return mg_driver_fn(LIB_CUDA, name); }

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
int mg_holds_context(void) {
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
    mg_swap_gate();
    if (!mg_on()) return CALL_REAL(cuDevicePrimaryCtxRetain, pctx, dev);
    pthread_mutex_lock(&g_ov_mu);
    mg_ov_t *o = ov_find(OV_PRIMARY, 0, dev);
    mg_meas_t m;
    int measure = !o || o->refs == 0;
    if (measure) mg_meas_begin(&m, dev), mg_meas_bound_ctx(&m), mg_meas_learn_begin(&m);
    CUresult rc = CALL_REAL(cuDevicePrimaryCtxRetain, pctx, dev);
    int64_t d = measure ? mg_meas_end(&m, rc) : 0;
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
    if (measure) mg_meas_release(&m);
    pthread_mutex_unlock(&g_ov_mu);
    return rc;
}

static CUresult primary_release(CUdevice dev, int v2, int reset) {
    mg_swap_gate();
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
        mg_swap_gate();                                                        \
        if (!mg_on()) return (rc_expr);                                        \
        pthread_mutex_lock(&g_ov_mu);                                          \
        mg_meas_t m_;                                                          \
        mg_meas_begin(&m_, (dev));                                             \
        mg_meas_bound_ctx(&m_);                                                   \
        mg_meas_learn_begin(&m_);                                                 \
        CUresult rc_ = (rc_expr);                                              \
        int64_t d_ = mg_meas_end(&m_, rc_);                                       \
        CHARGE_NEW((kind), (handle_ptr), 0, rc_, d_, undo);                    \
        mg_meas_release(&m_);                                                     \
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
    mg_swap_gate();
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
    mg_swap_gate();
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
    mg_swap_gate();
    if (!mg_on()) return CALL_REAL(cuCtxSetLimit, limit, value);
    pthread_mutex_lock(&g_ov_mu);
    cu_getlimit_fn getlimit = (cu_getlimit_fn)cu_fn("cuCtxGetLimit");
    size_t old = 0;
    int have_old = getlimit && getlimit(&old, limit) == CUDA_SUCCESS;
    uint64_t ctx = (uint64_t)(uintptr_t)mg_cur_ctx();
    mg_meas_t m;
    CUdevice dev = mg_cur_dev();
    mg_meas_begin(&m, dev);
    if (have_old) mg_meas_bound_limit(&m, limit, old, value, dev);
    CUresult rc = CALL_REAL(cuCtxSetLimit, limit, value);
    int64_t d = mg_meas_end(&m, rc);
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
    mg_meas_release(&m);
    pthread_mutex_unlock(&g_ov_mu);
    ov_freed(freed);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Modules and libraries.                                                    */

#define LOAD_MEASURED(kind, handle_ptr, rc_expr, undo)                         \
    do {                                                                       \
        mg_swap_gate();                                                        \
        if (!mg_on()) return (rc_expr);                                        \
        pthread_mutex_lock(&g_ov_mu);                                          \
        uint64_t ctx_ = (uint64_t)(uintptr_t)mg_cur_ctx();                     \
        mg_meas_t m_;                                                          \
        mg_meas_begin(&m_, mg_cur_dev());                                         \
        CUresult rc_ = (rc_expr);                                              \
        int64_t d_ = mg_meas_end(&m_, rc_);                                       \
        CHARGE_NEW((kind), (handle_ptr), (kind) == OV_MODULE ? ctx_ : 0, rc_, d_, undo); \
        mg_meas_release(&m_);                                                     \
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
    LOAD_MEASURED(OV_MODULE, module, CALL_REAL(cuModuleLoadFatBinary, module, fatCubin),
                  CALL_REAL(cuModuleUnload, *module));
}
CUresult mg_h_cuLibraryLoadData(CUlibrary *library, const void *code, void *jitOptions, void **jitOptionsValues,
                                unsigned int numJitOptions, void *libraryOptions, void **libraryOptionValues,
                                unsigned int numLibraryOptions) {
    LOAD_MEASURED(OV_LIBRARY, library,
                  CALL_REAL(cuLibraryLoadData, library, code, jitOptions, jitOptionsValues, numJitOptions,
                            libraryOptions, libraryOptionValues, numLibraryOptions),
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
    mg_swap_gate();
    CUresult rc = CALL_REAL(cuModuleUnload, hmod);
    return mg_on() ? unload(OV_MODULE, (uint64_t)(uintptr_t)hmod, rc) : rc;
}

CUresult mg_h_cuLibraryUnload(CUlibrary library) {
    mg_swap_gate();
    CUresult rc = CALL_REAL(cuLibraryUnload, library);
    return mg_on() ? unload(OV_LIBRARY, (uint64_t)(uintptr_t)library, rc) : rc;
}

/* A forked child has none of the parent's contexts (CUDA does not survive fork). */
static void mg_ctx_atfork_child(void) {
    pthread_mutex_init(&g_ov_mu, NULL);
    g_ov_n = 0;
    mg_meas_atfork_child();
}

__attribute__((constructor)) static void mg_ctx_init(void) { pthread_atfork(NULL, NULL, mg_ctx_atfork_child); }

MG_SYMBOLS_CTX(MG_XALIAS)
