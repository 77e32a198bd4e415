/*
 * simgpu fake libcuda.so.1 — streams, events and context synchronize (the fake
 * module and kernel launches are cuda_launch.c).
 *
 * Time model: work runs on the host when it is submitted (kernels write real
 * bytes at once), but each kernel also takes simulated time on the GPU, placed by
 * the node's compute model (simstate.h sim_sched_*: contexts time-slice the GPU,
 * a context's kernels share its SMs). A stream's done_ctx is the context time at
 * which its last work completes; synchronize waits for the context to reach it,
 * query and events compare against it, and every launch counts in the process's
 * node-state slot (launches, last_launch_ns; the model keeps busy_ns_total and
 * busy_until_ns) so NVML shows utilisation.
 */
#include <stdlib.h>
#include <time.h>

#include "cuda_internal.h"

void cu_sleep_until(uint64_t t_ns) {
    for (uint64_t now = sim_now_ns(); now < t_ns; now = sim_now_ns()) {
        uint64_t d = t_ns - now;
        struct timespec ts = {(time_t)(d / 1000000000u), (long)(d % 1000000000u)};
        nanosleep(&ts, NULL);
    }
}

static void atomic_max(_Atomic uint64_t *a, uint64_t v) {
    uint64_t cur = atomic_load(a);
    while (cur < v && !atomic_compare_exchange_weak(a, &cur, v)) {
    }
}

/* ------------------------------------------------------------------ streams */

CUresult cu_stream_get(CUstream h, struct CUctx_st **ctx, struct CUstream_st **s) {
    if (h == NULL || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) {
        CUresult r = cu_need_ctx(ctx);
        if (r) return r;
        *s = &(*ctx)->null_stream;
        return CUDA_SUCCESS;
    }
    if (!cu_obj_ok(h, OBJ_STREAM)) return CUDA_ERROR_INVALID_HANDLE;
    *s = h;
    *ctx = h->hdr.ctx;
    return CUDA_SUCCESS;
}

void cu_stream_kernel(struct CUctx_st *ctx, struct CUstream_st *s, uint64_t dur_ns, uint64_t blocks) {
    simgpu_node_t *n = cu_node();
    simgpu_proc_t *slot = cu_slot(ctx->gpu);
    if (!slot) return; /* the node's process table is full: the kernel takes no GPU time */
    uint64_t now = sim_sched_enter(n, ctx->gpu);
    uint64_t end = sim_sched_kernel(n, ctx->gpu, slot, atomic_load(&s->done_ctx), dur_ns, blocks);
    sim_sched_leave(n, ctx->gpu);
    atomic_max(&s->done_ctx, end);
    atomic_max(&ctx->done_ctx, end);
    atomic_fetch_add(&slot->launches, 1);
    atomic_store(&slot->last_launch_ns, now);
}

int cu_ctx_reached(struct CUctx_st *ctx, uint64_t target) {
    simgpu_proc_t *slot = target ? cu_slot(ctx->gpu) : NULL;
    return !slot || sim_sched_reached(cu_node(), ctx->gpu, slot, target);
}

void cu_ctx_wait(struct CUctx_st *ctx, uint64_t target) {
    simgpu_proc_t *slot = target ? cu_slot(ctx->gpu) : NULL;
    if (slot) sim_sched_wait(cu_node(), ctx->gpu, slot, target);
}

static _Atomic uint64_t g_stream_ids = 2; /* 0-2 read as the implicit streams */

static CUresult stream_create(CUstream *ph, unsigned int flags, int priority) {
    struct CUctx_st *c;
    CUresult r = cu_need_ctx(&c);
    if (r) return r;
    if (!ph || (flags & ~1u)) return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *s = calloc(1, sizeof *s);
    if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
    s->flags = flags;
    s->priority = priority < -5 ? -5 : priority > 0 ? 0 : priority;
    s->id = atomic_fetch_add(&g_stream_ids, 1) + 1;
    cu_obj_add(s, OBJ_STREAM, c);
    *ph = s;
    return CUDA_SUCCESS;
}

CU_API CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags) {
    CU_ENTER();
    return stream_create(phStream, Flags, 0);
}

CU_API CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority) {
    CU_ENTER();
    return stream_create(phStream, flags, priority);
}

CU_API CUresult cuStreamDestroy_v2(CUstream hStream) {
    CU_ENTER();
    if (!cu_obj_del(hStream, OBJ_STREAM)) return CUDA_ERROR_INVALID_HANDLE;
    free(hStream); /* pending work "completes" in the background, as on a GPU */
    return CUDA_SUCCESS;
}
CU_API CUresult cuStreamDestroy(CUstream hStream) { return cuStreamDestroy_v2(hStream); }

CU_API CUresult cuStreamSynchronize(CUstream hStream) {
    CU_ENTER();
    CU_STREAM(hStream, c, s);
    if (s->capture) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    cu_ctx_wait(c, atomic_load(&s->done_ctx));
    cu_pools_release();
    return c->sticky;
}

CU_API CUresult cuStreamQuery(CUstream hStream) {
    CU_ENTER();
    CU_STREAM(hStream, c, s);
    if (s->capture) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    if (c->sticky) return c->sticky;
    return cu_ctx_reached(c, atomic_load(&s->done_ctx)) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CU_API CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags) {
    CU_ENTER();
    CU_STREAM(hStream, c, s);
    if (!cu_obj_ok(hEvent, OBJ_EVENT)) return CUDA_ERROR_INVALID_HANDLE;
    if (Flags & ~1u) return CUDA_ERROR_INVALID_VALUE;
    /* Another GPU's event orders nothing here: each GPU keeps its own context time (a simplification). */
    if (hEvent->recorded && hEvent->gpu == c->gpu) atomic_max(&s->done_ctx, hEvent->at_ctx);
    return CUDA_SUCCESS;
}

CU_API CUresult cuStreamGetFlags(CUstream hStream, unsigned int *flags) {
    CU_ENTER();
    CU_STREAM(hStream, c, s);
    if (!flags) return CUDA_ERROR_INVALID_VALUE;
    *flags = s->flags;
    return CUDA_SUCCESS;
}

CU_API CUresult cuStreamGetPriority(CUstream hStream, int *priority) {
    CU_ENTER();
    CU_STREAM(hStream, c, s);
    if (!priority) return CUDA_ERROR_INVALID_VALUE;
    *priority = s->priority;
    return CUDA_SUCCESS;
}

CU_API CUresult cuStreamGetCtx(CUstream hStream, CUcontext *pctx) {
    CU_ENTER();
    struct CUstream_st *s;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    return cu_stream_get(hStream, pctx, &s);
}

CU_API CUresult cuStreamGetId(CUstream hStream, unsigned long long *streamId) {
    CU_ENTER();
    CU_STREAM(hStream, c, s);
    if (!streamId) return CUDA_ERROR_INVALID_VALUE;
    *streamId = s == &c->null_stream ? (hStream == CU_STREAM_PER_THREAD ? 2 : 1) : s->id;
    return CUDA_SUCCESS;
}

void cu_ctx_streams_destroy(struct CUctx_st *ctx) {
    void *objs[256];
    size_t n;
    while ((n = cu_obj_owned(OBJ_STREAM, ctx, objs, 256)) > 0)
        for (size_t i = 0; i < n; i++)
            if (cu_obj_del(objs[i], OBJ_STREAM)) free(objs[i]);
    while ((n = cu_obj_owned(OBJ_EVENT, ctx, objs, 256)) > 0)
        for (size_t i = 0; i < n; i++)
            if (cu_obj_del(objs[i], OBJ_EVENT)) free(objs[i]);
    while ((n = cu_obj_owned(OBJ_MODULE, ctx, objs, 256)) > 0)
        for (size_t i = 0; i < n; i++) {
            struct CUmod_st *m = objs[i];
            for (int k = 0; k < 3; k++) cu_obj_del(&m->funcs[k], OBJ_FUNC);
            if (cu_obj_del(m, OBJ_MODULE)) {
                cu_uncharge(m->gpu, m->charged);
                free(m);
            }
        }
}

/* ------------------------------------------------------------------ events */

#define CU_EVENT_DISABLE_TIMING 0x2

/* When the work an event was recorded after completed (wall time), found once it has;
 * 1 for an event never recorded (complete); 0 while its work is still to run. */
static uint64_t event_wall(struct CUevent_st *e) {
    if (!e->recorded) return 1;
    uint64_t w = atomic_load(&e->at_wall);
    if (w) return w;
    simgpu_proc_t *slot = cu_slot(e->gpu);
    w = slot ? sim_sched_wall_at(cu_node(), e->gpu, slot, e->at_ctx) : sim_now_ns();
    if (w) atomic_store(&e->at_wall, w);
    return w;
}

CU_API CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags) {
    CU_ENTER();
    struct CUctx_st *c;
    CUresult r = cu_need_ctx(&c);
    if (r) return r;
    if (!phEvent || (Flags & ~0x7u)) return CUDA_ERROR_INVALID_VALUE;
    struct CUevent_st *e = calloc(1, sizeof *e);
    if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
    e->flags = Flags;
    cu_obj_add(e, OBJ_EVENT, c);
    *phEvent = e;
    return CUDA_SUCCESS;
}

CU_API CUresult cuEventRecordWithFlags(CUevent hEvent, CUstream hStream, unsigned int flags) {
    CU_ENTER();
    CU_STREAM(hStream, c, s);
    if (!cu_obj_ok(hEvent, OBJ_EVENT) || hEvent->hdr.ctx != c) return CUDA_ERROR_INVALID_HANDLE;
    if (flags & ~1u) return CUDA_ERROR_INVALID_VALUE;
    /* Recorded behind work still to run: it completes when that does; else now. */
    uint64_t done = atomic_load(&s->done_ctx);
    hEvent->gpu = c->gpu;
    hEvent->at_ctx = done;
    atomic_store(&hEvent->at_wall, cu_ctx_reached(c, done) ? sim_now_ns() : 0);
    hEvent->recorded = 1;
    return CUDA_SUCCESS;
}

CU_API CUresult cuEventRecord(CUevent hEvent, CUstream hStream) { return cuEventRecordWithFlags(hEvent, hStream, 0); }

CU_API CUresult cuEventQuery(CUevent hEvent) {
    CU_ENTER();
    if (!cu_obj_ok(hEvent, OBJ_EVENT)) return CUDA_ERROR_INVALID_HANDLE;
    return event_wall(hEvent) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CU_API CUresult cuEventSynchronize(CUevent hEvent) {
    CU_ENTER();
    if (!cu_obj_ok(hEvent, OBJ_EVENT)) return CUDA_ERROR_INVALID_HANDLE;
    if (hEvent->recorded && !atomic_load(&hEvent->at_wall)) cu_ctx_wait(hEvent->hdr.ctx, hEvent->at_ctx);
    cu_pools_release();
    return hEvent->hdr.ctx->sticky;
}

CU_API CUresult cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd) {
    CU_ENTER();
    if (!pMilliseconds) return CUDA_ERROR_INVALID_VALUE;
    if (!cu_obj_ok(hStart, OBJ_EVENT) || !cu_obj_ok(hEnd, OBJ_EVENT)) return CUDA_ERROR_INVALID_HANDLE;
    if ((hStart->flags | hEnd->flags) & CU_EVENT_DISABLE_TIMING) return CUDA_ERROR_INVALID_HANDLE;
    if (!hStart->recorded || !hEnd->recorded) return CUDA_ERROR_INVALID_HANDLE;
    uint64_t t0 = event_wall(hStart), t1 = event_wall(hEnd);
    if (!t0 || !t1) return CUDA_ERROR_NOT_READY;
    *pMilliseconds = (float)(((double)t1 - (double)t0) / 1e6);
    return CUDA_SUCCESS;
}
CU_API CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd) {
    return cuEventElapsedTime_v2(pMilliseconds, hStart, hEnd);
}

CU_API CUresult cuEventDestroy_v2(CUevent hEvent) {
    CU_ENTER();
    if (!cu_obj_del(hEvent, OBJ_EVENT)) return CUDA_ERROR_INVALID_HANDLE;
    free(hEvent);
    return CUDA_SUCCESS;
}
CU_API CUresult cuEventDestroy(CUevent hEvent) { return cuEventDestroy_v2(hEvent); }

static CUresult ctx_sync(struct CUctx_st *c) {
    cu_ctx_wait(c, atomic_load(&c->done_ctx));
    cu_pools_release();
    return c->sticky;
}

CU_API CUresult cuCtxSynchronize(void) {
    CU_ENTER();
    struct CUctx_st *c;
    CUresult r = cu_need_ctx(&c);
    return r ? r : ctx_sync(c);
}

/* CUDA 13.0: the context to wait for is named; NULL means the current one. */
CU_API CUresult cuCtxSynchronize_v2(CUcontext ctx) {
    CU_ENTER();
    struct CUctx_st *c = ctx;
    if (!c) {
        CUresult r = cu_need_ctx(&c);
        if (r) return r;
    } else if (!cu_obj_ok(c, OBJ_CTX) || (c->primary && c->refs == 0)) {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    return ctx_sync(c);
}

/* Per-thread default stream twins (see CU_TWIN). */
CU_TWIN(cuStreamSynchronize_ptsz, cuStreamSynchronize, (CUstream h), (h))
CU_TWIN(cuStreamQuery_ptsz, cuStreamQuery, (CUstream h), (h))
CU_TWIN(cuStreamWaitEvent_ptsz, cuStreamWaitEvent, (CUstream h, CUevent e, unsigned int f), (h, e, f))
CU_TWIN(cuStreamGetFlags_ptsz, cuStreamGetFlags, (CUstream h, unsigned int *f), (h, f))
CU_TWIN(cuStreamGetPriority_ptsz, cuStreamGetPriority, (CUstream h, int *p), (h, p))
CU_TWIN(cuStreamGetCtx_ptsz, cuStreamGetCtx, (CUstream h, CUcontext *c), (h, c))
CU_TWIN(cuStreamGetId_ptsz, cuStreamGetId, (CUstream h, unsigned long long *i), (h, i))
CU_TWIN(cuEventRecord_ptsz, cuEventRecord, (CUevent e, CUstream h), (e, h))
CU_TWIN(cuEventRecordWithFlags_ptsz, cuEventRecordWithFlags, (CUevent e, CUstream h, unsigned int f), (e, h, f))

const cu_sym_t cu_syms_exec[] = {
    CU_SYM("cuStreamCreate", 2000, cuStreamCreate),
    CU_SYM("cuStreamCreateWithPriority", 5050, cuStreamCreateWithPriority),
    CU_SYM("cuStreamDestroy", 2000, cuStreamDestroy),
    CU_SYM("cuStreamDestroy", 4000, cuStreamDestroy_v2),
    CU_SYM("cuStreamSynchronize", 2000, cuStreamSynchronize),
    CU_SYM_PT("cuStreamSynchronize", 2000, cuStreamSynchronize_ptsz),
    CU_SYM("cuStreamQuery", 2000, cuStreamQuery),
    CU_SYM_PT("cuStreamQuery", 2000, cuStreamQuery_ptsz),
    CU_SYM("cuStreamWaitEvent", 3020, cuStreamWaitEvent),
    CU_SYM_PT("cuStreamWaitEvent", 3020, cuStreamWaitEvent_ptsz),
    CU_SYM("cuStreamGetFlags", 5050, cuStreamGetFlags),
    CU_SYM_PT("cuStreamGetFlags", 5050, cuStreamGetFlags_ptsz),
    CU_SYM("cuStreamGetPriority", 5050, cuStreamGetPriority),
    CU_SYM_PT("cuStreamGetPriority", 5050, cuStreamGetPriority_ptsz),
    CU_SYM("cuStreamGetCtx", 9020, cuStreamGetCtx),
    CU_SYM_PT("cuStreamGetCtx", 9020, cuStreamGetCtx_ptsz),
    CU_SYM("cuStreamGetId", 12000, cuStreamGetId),
    CU_SYM_PT("cuStreamGetId", 12000, cuStreamGetId_ptsz),
    CU_SYM("cuEventCreate", 2000, cuEventCreate),
    CU_SYM("cuEventRecord", 2000, cuEventRecord),
    CU_SYM_PT("cuEventRecord", 2000, cuEventRecord_ptsz),
    CU_SYM("cuEventRecordWithFlags", 11010, cuEventRecordWithFlags),
    CU_SYM_PT("cuEventRecordWithFlags", 11010, cuEventRecordWithFlags_ptsz),
    CU_SYM("cuEventQuery", 2000, cuEventQuery),
    CU_SYM("cuEventSynchronize", 2000, cuEventSynchronize),
    CU_SYM("cuEventElapsedTime", 2000, cuEventElapsedTime),
    CU_SYM("cuEventElapsedTime", 12080, cuEventElapsedTime_v2),
    CU_SYM("cuEventDestroy", 2000, cuEventDestroy),
    CU_SYM("cuEventDestroy", 4000, cuEventDestroy_v2),
    CU_SYM("cuCtxSynchronize", 2000, cuCtxSynchronize),
    CU_SYM("cuCtxSynchronize", 13000, cuCtxSynchronize_v2),
};
const size_t cu_syms_exec_n = sizeof cu_syms_exec / sizeof cu_syms_exec[0];
