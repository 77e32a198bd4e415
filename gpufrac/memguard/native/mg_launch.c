/*
 * memguard: kernel and graph launches: activity for the idle detector, the
 * swap-in gate, the compute share's pace (mg_compute.c), and a graph's memory
 * checked before its first launch. Every launch entry point the driver has
 * (cuLaunchKernel, ...Ex, cooperative, cuGraphLaunch, and their _ptsz twins, which
 * the CUDA runtime resolves through cuGetProcAddress) passes here.
 */
#include "mg_internal.h"

static inline void mg_activity(void) {
    if (!mg_on()) return;
    mg_proc_slot_t *s = mg_slot();
    if (MG_UNLIKELY(!s)) return;
    /* Only this process's threads write its slot; a lost increment between
     * two of its threads is harmless, a locked add on every launch is not. */
    atomic_store_explicit(&s->launches, atomic_load_explicit(&s->launches, memory_order_relaxed) + 1,
                          memory_order_relaxed);
    atomic_store_explicit(&s->last_activity_ns, mg_coarse_now_ns(), memory_order_relaxed);
    if (MG_UNLIKELY(atomic_load_explicit(&s->swapped, memory_order_acquire))) mg_swap_in(s);
    /* The compute share: one atomic load while the container is not paced. */
    uint32_t pace = atomic_load_explicit(&g_cfg->compute_pace_ns, memory_order_relaxed);
    if (MG_UNLIKELY(pace != 0)) mg_pace_launch(pace, 1);
}

#define LAUNCH_ARGS \
    f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams, extra
#define COOP_ARGS f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams

#define LAUNCH_HOOK(sym, params, ...)             \
    HOOK CUresult mg_h_##sym params {              \
        mg_activity();                             \
        return CALL_REAL(sym, __VA_ARGS__);        \
    }

LAUNCH_HOOK(cuLaunchKernel, MG_LAUNCH_PARAMS, LAUNCH_ARGS)
LAUNCH_HOOK(cuLaunchKernel_ptsz, MG_LAUNCH_PARAMS, LAUNCH_ARGS)
LAUNCH_HOOK(cuLaunchCooperativeKernel, MG_COOP_PARAMS, COOP_ARGS)
LAUNCH_HOOK(cuLaunchCooperativeKernel_ptsz, MG_COOP_PARAMS, COOP_ARGS)
LAUNCH_HOOK(cuLaunchKernelEx, (const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra),
            config, f, kernelParams, extra)
LAUNCH_HOOK(cuLaunchKernelEx_ptsz, (const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra),
            config, f, kernelParams, extra)
/* A graph launch: while some executable graph's memory is not counted yet, the
 * launch goes through mg_graph_launch (limit check first); else one atomic load. */
#define GRAPH_LAUNCH_HOOK(sym)                                                                    \
    HOOK CUresult mg_h_##sym(CUgraphExec hGraphExec, CUstream hStream) {                          \
        mg_activity();                                                                            \
        if (MG_UNLIKELY(atomic_load_explicit(&mg_graph_unmapped, memory_order_relaxed)) && mg_on()) \
            return mg_graph_launch(mg_real(S_##sym), hGraphExec, hStream);                        \
        return CALL_REAL(sym, hGraphExec, hStream);                                               \
    }
GRAPH_LAUNCH_HOOK(cuGraphLaunch)
GRAPH_LAUNCH_HOOK(cuGraphLaunch_ptsz)

MG_SYMBOLS_LAUNCH(MG_XALIAS)
