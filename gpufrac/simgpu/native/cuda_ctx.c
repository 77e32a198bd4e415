/*
 * simgpu fake libcuda.so.1 — contexts: primary contexts (retain/release/flags/
 * state/reset), regular contexts (create/destroy), the per-thread context stack.
 * A context's memory, streams, events and modules go with it.
 */
#include <stdlib.h>

#include "cuda_internal.h"

/* ------------------------------------------------------------------ contexts */

#define CTX_STACK 64
static __thread struct CUctx_st *t_stack[CTX_STACK];
static __thread int t_depth;
static struct CUctx_st *g_primary[SIMGPU_MAX_GPUS];
static unsigned int g_primary_flags[SIMGPU_MAX_GPUS];
static pthread_mutex_t g_ctx_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic uint64_t g_ctx_ids;

struct CUctx_st *cu_current_ctx(void) { return t_depth ? t_stack[t_depth - 1] : NULL; }

static int ctx_live(struct CUctx_st *c) { return cu_obj_ok(c, OBJ_CTX) && (!c->primary || c->refs > 0); }

CUresult cu_need_ctx(struct CUctx_st **out) {
    struct CUctx_st *c = cu_current_ctx();
    if (!c || !ctx_live(c)) return CUDA_ERROR_INVALID_CONTEXT;
    *out = c;
    return CUDA_SUCCESS;
}

simgpu_proc_t *cu_slot(uint32_t gpu) {
    simgpu_proc_t *s = sim_my_slot(cu_node(), gpu);
    simgpu_proc_t *none = NULL;
    if (s) atomic_compare_exchange_strong(&cu_g_gate_slot, &none, s);
    return s;
}

/* Defaults of the limits (CUlimit 0..10); stack, printf FIFO and malloc heap take
 * device memory, included in the context's base cost at their defaults. */
static const size_t k_limit_default[CU_NLIMITS] = {1024, 1048576, 8388608, 2, 2048, 64, 0, 0, 0, 0, 0};
#define THREADS_PER_SM 2048 /* resident threads per SM (sm_80, sm_90): each gets its stack */

/* A context's own device memory: the node's ctx_mib, an estimate of what a real
 * GPU's context takes (docs/simgpu.md). Charged like an allocation, so a full
 * GPU refuses a new context with CUDA_ERROR_OUT_OF_MEMORY. */
static CUresult ctx_charge(struct CUctx_st *c) {
    for (int i = 0; i < CU_NLIMITS; i++) c->limits[i] = k_limit_default[i], c->limit_charged[i] = 0;
    uint64_t bytes = (uint64_t)cu_node()->gpus[c->gpu].ctx_mib << 20;
    if (bytes && cu_charge(c->gpu, bytes)) return CUDA_ERROR_OUT_OF_MEMORY;
    c->charged = bytes;
    /* Setting a context up takes time on a GPU (hundreds of ms on real hardware); a
     * node whose contexts take memory also makes them take 20 ms, so what else
     * happens on the GPU meanwhile is part of the picture, as there. */
    if (bytes) cu_sleep_until(sim_now_ns() + 20 * 1000 * 1000);
    return CUDA_SUCCESS;
}

static void ctx_uncharge(struct CUctx_st *c) {
    uint64_t bytes = c->charged;
    for (int i = 0; i < CU_NLIMITS; i++) bytes += c->limit_charged[i], c->limit_charged[i] = 0;
    c->charged = 0;
    cu_uncharge(c->gpu, bytes);
}

static struct CUctx_st *ctx_new(CUdevice dev, unsigned int flags, int primary) {
    struct CUctx_st *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->dev = dev;
    c->gpu = cu_g_devs[dev];
    c->flags = flags;
    c->primary = primary;
    c->id = atomic_fetch_add(&g_ctx_ids, 1) + 1;
    c->null_stream.hdr = (cu_obj_t){OBJ_STREAM, 0, c};
    cu_slot(c->gpu); /* a process with a context shows up on the GPU, as in nvidia-smi */
    cu_obj_add(c, OBJ_CTX, NULL);
    return c;
}

/* What a context owns goes with it: memory, streams, events, modules, its own memory. */
static void ctx_release_resources(struct CUctx_st *c) {
    cu_mem_free_ctx(c);
    cu_ctx_streams_destroy(c);
    ctx_uncharge(c);
    c->sticky = CUDA_SUCCESS;
}

static void stack_remove(struct CUctx_st *c) {
    int j = 0;
    for (int i = 0; i < t_depth; i++)
        if (t_stack[i] != c) t_stack[j++] = t_stack[i];
    t_depth = j;
}

#define VALID_CTX_FLAGS 0xffu

CU_API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    CU_ENTER();
    CUresult r = cu_check_dev(dev);
    if (r) return r;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_ctx_lock);
    if (!g_primary[dev]) g_primary[dev] = ctx_new(dev, g_primary_flags[dev], 1);
    struct CUctx_st *c = g_primary[dev];
    if (c && c->refs == 0) { /* activated: it takes its memory now */
        c->flags = g_primary_flags[dev];
        if (ctx_charge(c)) c = NULL;
    }
    if (c) c->refs++;
    pthread_mutex_unlock(&g_ctx_lock);
    if (!c) return CUDA_ERROR_OUT_OF_MEMORY;
    *pctx = c;
    return CUDA_SUCCESS;
}

CU_API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    CU_ENTER();
    CUresult r = cu_check_dev(dev);
    if (r) return r;
    pthread_mutex_lock(&g_ctx_lock);
    struct CUctx_st *c = g_primary[dev];
    if (!c || c->refs == 0) r = CUDA_ERROR_INVALID_CONTEXT;
    else if (--c->refs == 0) ctx_release_resources(c);
    pthread_mutex_unlock(&g_ctx_lock);
    return r;
}

CU_API CUresult cuDevicePrimaryCtxRelease(CUdevice dev) { return cuDevicePrimaryCtxRelease_v2(dev); }

CU_API CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags) {
    CU_ENTER();
    CUresult r = cu_check_dev(dev);
    if (r) return r;
    if (flags & ~VALID_CTX_FLAGS) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_ctx_lock);
    g_primary_flags[dev] = flags;
    if (g_primary[dev]) g_primary[dev]->flags = flags;
    pthread_mutex_unlock(&g_ctx_lock);
    return CUDA_SUCCESS;
}

CU_API CUresult cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned int flags) {
    return cuDevicePrimaryCtxSetFlags_v2(dev, flags);
}

CU_API CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
    CU_ENTER();
    CUresult r = cu_check_dev(dev);
    if (r) return r;
    if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_ctx_lock);
    *flags = g_primary_flags[dev];
    *active = g_primary[dev] && g_primary[dev]->refs > 0;
    pthread_mutex_unlock(&g_ctx_lock);
    return CUDA_SUCCESS;
}

CU_API CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
    CU_ENTER();
    CUresult r = cu_check_dev(dev);
    if (r) return r;
    pthread_mutex_lock(&g_ctx_lock);
    struct CUctx_st *c = g_primary[dev];
    if (c && c->refs > 0) {
        c->refs = 0;
        ctx_release_resources(c);
    }
    g_primary_flags[dev] = 0;
    pthread_mutex_unlock(&g_ctx_lock);
    return CUDA_SUCCESS;
}

CU_API CUresult cuDevicePrimaryCtxReset(CUdevice dev) { return cuDevicePrimaryCtxReset_v2(dev); }

static CUresult ctx_create(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    CU_ENTER();
    CUresult r = cu_check_dev(dev);
    if (r) return r;
    if (!pctx || (flags & ~VALID_CTX_FLAGS)) return CUDA_ERROR_INVALID_VALUE;
    if (t_depth >= CTX_STACK) return CUDA_ERROR_OUT_OF_MEMORY;
    struct CUctx_st *c = ctx_new(dev, flags, 0);
    if (!c) return CUDA_ERROR_OUT_OF_MEMORY;
    if (ctx_charge(c)) {
        cu_obj_del(c, OBJ_CTX);
        free(c);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    t_stack[t_depth++] = c;
    *pctx = c;
    return CUDA_SUCCESS;
}

CU_API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    return ctx_create(pctx, flags, dev);
}
CU_API CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev) { return ctx_create(pctx, flags, dev); }
/* Execution-affinity parameters (v3) and create params (v4) have no effect on a simulated GPU. */
CU_API CUresult cuCtxCreate_v3(CUcontext *pctx, void *paramsArray, int numParams, unsigned int flags, CUdevice dev) {
    if (numParams < 0 || (numParams > 0 && !paramsArray)) return CUDA_ERROR_INVALID_VALUE;
    return ctx_create(pctx, flags, dev);
}
CU_API CUresult cuCtxCreate_v4(CUcontext *pctx, void *ctxCreateParams, unsigned int flags, CUdevice dev) {
    (void)ctxCreateParams;
    return ctx_create(pctx, flags, dev);
}

CU_API CUresult cuCtxDestroy_v2(CUcontext ctx) {
    CU_ENTER();
    if (!ctx || !cu_obj_ok(ctx, OBJ_CTX) || ctx->primary) return CUDA_ERROR_INVALID_CONTEXT;
    ctx_release_resources(ctx);
    stack_remove(ctx);
    cu_obj_del(ctx, OBJ_CTX);
    free(ctx);
    return CUDA_SUCCESS;
}
CU_API CUresult cuCtxDestroy(CUcontext ctx) { return cuCtxDestroy_v2(ctx); }

CU_API CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
    CU_ENTER();
    if (!ctx || !ctx_live(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    if (t_depth >= CTX_STACK) return CUDA_ERROR_OUT_OF_MEMORY;
    t_stack[t_depth++] = ctx;
    return CUDA_SUCCESS;
}
CU_API CUresult cuCtxPushCurrent(CUcontext ctx) { return cuCtxPushCurrent_v2(ctx); }

CU_API CUresult cuCtxPopCurrent_v2(CUcontext *pctx) {
    CU_ENTER();
    if (!t_depth) return CUDA_ERROR_INVALID_CONTEXT;
    struct CUctx_st *c = t_stack[--t_depth];
    if (pctx) *pctx = c;
    return CUDA_SUCCESS;
}
CU_API CUresult cuCtxPopCurrent(CUcontext *pctx) { return cuCtxPopCurrent_v2(pctx); }

CU_API CUresult cuCtxSetCurrent(CUcontext ctx) {
    CU_ENTER();
    if (!ctx) {
        if (t_depth) t_depth--;
        return CUDA_SUCCESS;
    }
    if (!ctx_live(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    if (t_depth) t_stack[t_depth - 1] = ctx;
    else t_stack[t_depth++] = ctx;
    return CUDA_SUCCESS;
}

CU_API CUresult cuCtxGetCurrent(CUcontext *pctx) {
    CU_ENTER();
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = cu_current_ctx();
    return CUDA_SUCCESS;
}

CU_API CUresult cuCtxGetDevice(CUdevice *device) {
    CU_ENTER();
    struct CUctx_st *c;
    CUresult r = cu_need_ctx(&c);
    if (r) return r;
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    *device = c->dev;
    return CUDA_SUCCESS;
}

CU_API CUresult cuCtxGetFlags(unsigned int *flags) {
    CU_ENTER();
    struct CUctx_st *c;
    CUresult r = cu_need_ctx(&c);
    if (r) return r;
    if (!flags) return CUDA_ERROR_INVALID_VALUE;
    *flags = c->flags;
    return CUDA_SUCCESS;
}

CU_API CUresult cuCtxGetId(CUcontext ctx, unsigned long long *ctxId) {
    CU_ENTER();
    if (!ctx) ctx = cu_current_ctx();
    if (!ctx || !ctx_live(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    if (!ctxId) return CUDA_ERROR_INVALID_VALUE;
    *ctxId = ctx->id;
    return CUDA_SUCCESS;
}

CU_API CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned int *version) {
    CU_ENTER();
    if (!ctx) ctx = cu_current_ctx();
    if (!ctx || !ctx_live(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = 3020;
    return CUDA_SUCCESS;
}

CU_API CUresult cuCtxGetStreamPriorityRange(int *leastPriority, int *greatestPriority) {
    CU_ENTER();
    if (leastPriority) *leastPriority = 0;
    if (greatestPriority) *greatestPriority = -5;
    return CUDA_SUCCESS;
}

/* Device memory a limit's value takes beyond its default: the stack of every
 * resident thread (CU_LIMIT_STACK_SIZE 0), the printf FIFO (1), the device
 * malloc heap (2). A limit that does not fit fails with OUT_OF_MEMORY and stays. */
static uint64_t limit_bytes(const struct CUctx_st *c, int limit, size_t value) {
    if (value <= k_limit_default[limit]) return 0;
    uint64_t extra = value - k_limit_default[limit];
    if (limit == 0) {
        uint64_t threads = (uint64_t)cu_node()->gpus[c->gpu].sm_count * THREADS_PER_SM;
        return extra > UINT64_MAX / (threads ? threads : 1) ? UINT64_MAX : extra * threads;
    }
    return limit == 1 || limit == 2 ? extra : 0;
}

CU_API CUresult cuCtxSetLimit(int limit, size_t value) {
    CU_ENTER();
    struct CUctx_st *c;
    CUresult r = cu_need_ctx(&c);
    if (r) return r;
    if (limit < 0 || limit >= CU_NLIMITS) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_ctx_lock);
    uint64_t want = limit_bytes(c, limit, value), have = c->limit_charged[limit];
    if (want > have && cu_charge(c->gpu, want - have)) r = CUDA_ERROR_OUT_OF_MEMORY;
    else if (want < have) cu_uncharge(c->gpu, have - want);
    if (!r) c->limits[limit] = value, c->limit_charged[limit] = want;
    pthread_mutex_unlock(&g_ctx_lock);
    return r;
}
CU_API CUresult cuCtxGetLimit(size_t *pvalue, int limit) {
    CU_ENTER();
    struct CUctx_st *c;
    CUresult r = cu_need_ctx(&c);
    if (r) return r;
    if (!pvalue || limit < 0 || limit >= CU_NLIMITS) return CUDA_ERROR_INVALID_VALUE;
    *pvalue = c->limits[limit];
    return CUDA_SUCCESS;
}

const cu_sym_t cu_syms_ctx[] = {
    CU_SYM("cuDevicePrimaryCtxRetain", 7000, cuDevicePrimaryCtxRetain),
    CU_SYM("cuDevicePrimaryCtxRelease", 7000, cuDevicePrimaryCtxRelease),
    CU_SYM("cuDevicePrimaryCtxRelease", 11000, cuDevicePrimaryCtxRelease_v2),
    CU_SYM("cuDevicePrimaryCtxSetFlags", 7000, cuDevicePrimaryCtxSetFlags),
    CU_SYM("cuDevicePrimaryCtxSetFlags", 11000, cuDevicePrimaryCtxSetFlags_v2),
    CU_SYM("cuDevicePrimaryCtxGetState", 7000, cuDevicePrimaryCtxGetState),
    CU_SYM("cuDevicePrimaryCtxReset", 7000, cuDevicePrimaryCtxReset),
    CU_SYM("cuDevicePrimaryCtxReset", 11000, cuDevicePrimaryCtxReset_v2),
    CU_SYM("cuCtxCreate", 2000, cuCtxCreate),
    CU_SYM("cuCtxCreate", 3020, cuCtxCreate_v2),
    CU_SYM("cuCtxCreate", 11040, cuCtxCreate_v3),
    CU_SYM("cuCtxCreate", 12050, cuCtxCreate_v4),
    CU_SYM("cuCtxDestroy", 2000, cuCtxDestroy),
    CU_SYM("cuCtxDestroy", 4000, cuCtxDestroy_v2),
    CU_SYM("cuCtxPushCurrent", 2000, cuCtxPushCurrent),
    CU_SYM("cuCtxPushCurrent", 4000, cuCtxPushCurrent_v2),
    CU_SYM("cuCtxPopCurrent", 2000, cuCtxPopCurrent),
    CU_SYM("cuCtxPopCurrent", 4000, cuCtxPopCurrent_v2),
    CU_SYM("cuCtxSetCurrent", 4000, cuCtxSetCurrent),
    CU_SYM("cuCtxGetCurrent", 4000, cuCtxGetCurrent),
    CU_SYM("cuCtxGetDevice", 2000, cuCtxGetDevice),
    CU_SYM("cuCtxGetFlags", 7000, cuCtxGetFlags),
    CU_SYM("cuCtxGetId", 12000, cuCtxGetId),
    CU_SYM("cuCtxGetApiVersion", 3020, cuCtxGetApiVersion),
    CU_SYM("cuCtxGetStreamPriorityRange", 5050, cuCtxGetStreamPriorityRange),
    CU_SYM("cuCtxSetLimit", 3010, cuCtxSetLimit),
    CU_SYM("cuCtxGetLimit", 3010, cuCtxGetLimit),
};
const size_t cu_syms_ctx_n = sizeof cu_syms_ctx / sizeof cu_syms_ctx[0];
