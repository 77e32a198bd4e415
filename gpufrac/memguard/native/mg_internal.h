/*
 * memguard: what memguard.c shares with the other sources of libmemguard.so
 * (mg_ctx.c: context, module and limit memory; mg_graph.c: graph memory).
 *
 * Their hooks join the one table of memguard.c: each source lists its entry
 * points in an X-macro below (same columns as MG_SYMBOLS), and these come first
 * in the table's enum, so their indices are known here. Every function declared
 * here is hidden: only the hooks are exported.
 */
#ifndef GPUFRAC_MEMGUARD_INTERNAL_H
#define GPUFRAC_MEMGUARD_INTERNAL_H

#include <stdatomic.h>
#include <stdint.h>

#define MG_HIDDEN __attribute__((visibility("hidden")))

/* The driver ABI the extra hooks need (identical redefinitions of memguard.c's). */
typedef int CUresult;
#define CUDA_SUCCESS 0
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_FOUND 500
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long cuuint64_t;
typedef struct CUstream_st *CUstream;
typedef struct CUctx_st *CUcontext;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct CUmod_st *CUmodule;
typedef struct CUlib_st *CUlibrary;
typedef struct CUgreenCtx_st *CUgreenCtx;
typedef struct CUdevResourceDesc_st *CUdevResourceDesc;
typedef struct CUDA_GRAPH_INSTANTIATE_PARAMS_st CUDA_GRAPH_INSTANTIATE_PARAMS; /* only passed through */

enum { LIB_CUDA, LIB_NVML };

/* X(exported name, base name for cuGetProcAddress, cudaVersion, library, per-thread variant) */
#define MG_SYMBOLS_CTX(X)                                                          \
    X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 7000, LIB_CUDA, 0)     \
    X(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease", 7000, LIB_CUDA, 0)   \
    X(cuDevicePrimaryCtxRelease_v2, "cuDevicePrimaryCtxRelease", 11000, LIB_CUDA, 0) \
    X(cuDevicePrimaryCtxReset, "cuDevicePrimaryCtxReset", 7000, LIB_CUDA, 0)       \
    X(cuDevicePrimaryCtxReset_v2, "cuDevicePrimaryCtxReset", 11000, LIB_CUDA, 0)   \
    X(cuCtxCreate, "cuCtxCreate", 2000, LIB_CUDA, 0)                               \
    X(cuCtxCreate_v2, "cuCtxCreate", 3020, LIB_CUDA, 0)                            \
    X(cuCtxCreate_v3, "cuCtxCreate", 11040, LIB_CUDA, 0)                           \
    X(cuCtxCreate_v4, "cuCtxCreate", 12050, LIB_CUDA, 0)                           \
    X(cuCtxDestroy, "cuCtxDestroy", 2000, LIB_CUDA, 0)                             \
    X(cuCtxDestroy_v2, "cuCtxDestroy", 4000, LIB_CUDA, 0)                          \
    X(cuGreenCtxCreate, "cuGreenCtxCreate", 12040, LIB_CUDA, 0)                    \
    X(cuGreenCtxDestroy, "cuGreenCtxDestroy", 12040, LIB_CUDA, 0)                  \
    X(cuCtxSetLimit, "cuCtxSetLimit", 3010, LIB_CUDA, 0)                           \
    X(cuModuleLoad, "cuModuleLoad", 2000, LIB_CUDA, 0)                             \
    X(cuModuleLoadData, "cuModuleLoadData", 2000, LIB_CUDA, 0)                     \
    X(cuModuleLoadDataEx, "cuModuleLoadDataEx", 2010, LIB_CUDA, 0)                 \
    X(cuModuleLoadFatBinary, "cuModuleLoadFatBinary", 2000, LIB_CUDA, 0)           \
    X(cuModuleUnload, "cuModuleUnload", 2000, LIB_CUDA, 0)                         \
    X(cuLibraryLoadData, "cuLibraryLoadData", 12000, LIB_CUDA, 0)                  \
    X(cuLibraryLoadFromFile, "cuLibraryLoadFromFile", 12000, LIB_CUDA, 0)          \
    X(cuLibraryUnload, "cuLibraryUnload", 12000, LIB_CUDA, 0)

#define MG_SYMBOLS_GRAPH(X)                                                                \
    X(cuGraphInstantiate, "cuGraphInstantiate", 10000, LIB_CUDA, 0)                        \
    X(cuGraphInstantiate_v2, "cuGraphInstantiate", 11000, LIB_CUDA, 0)                     \
    X(cuGraphInstantiateWithFlags, "cuGraphInstantiate", 11040, LIB_CUDA, 0)               \
    X(cuGraphInstantiateWithParams, "cuGraphInstantiateWithParams", 12000, LIB_CUDA, 0)    \
    X(cuGraphInstantiateWithParams_ptsz, "cuGraphInstantiateWithParams", 12000, LIB_CUDA, 1) \
    X(cuGraphExecDestroy, "cuGraphExecDestroy", 10000, LIB_CUDA, 0)                        \
    X(cuGraphUpload, "cuGraphUpload", 11010, LIB_CUDA, 0)                                  \
    X(cuGraphUpload_ptsz, "cuGraphUpload", 11010, LIB_CUDA, 1)                             \
    X(cuDeviceGraphMemTrim, "cuDeviceGraphMemTrim", 11040, LIB_CUDA, 0)                    \
    X(cuStreamBeginCapture, "cuStreamBeginCapture", 10000, LIB_CUDA, 0)                    \
    X(cuStreamBeginCapture_v2, "cuStreamBeginCapture", 10010, LIB_CUDA, 0)                 \
    X(cuStreamBeginCapture_v2_ptsz, "cuStreamBeginCapture", 10010, LIB_CUDA, 1)            \
    X(cuStreamBeginCaptureToGraph, "cuStreamBeginCaptureToGraph", 12030, LIB_CUDA, 0)      \
    X(cuStreamBeginCaptureToGraph_ptsz, "cuStreamBeginCaptureToGraph", 12030, LIB_CUDA, 1) \
    X(cuStreamEndCapture, "cuStreamEndCapture", 10000, LIB_CUDA, 0)                        \
    X(cuStreamEndCapture_ptsz, "cuStreamEndCapture", 10000, LIB_CUDA, 1)

#define MG_SYMBOLS_EXTRA(X) MG_SYMBOLS_CTX(X) MG_SYMBOLS_GRAPH(X)

enum {
#define MG_XENUM(sym, base, ver, lib, ptds) S_##sym,
    MG_SYMBOLS_EXTRA(MG_XENUM)
#undef MG_XENUM
    S_EXTRA_COUNT
};

/* The hooks of mg_ctx.c and mg_graph.c. */
MG_HIDDEN CUresult mg_h_cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
MG_HIDDEN CUresult mg_h_cuDevicePrimaryCtxRelease(CUdevice dev);
MG_HIDDEN CUresult mg_h_cuDevicePrimaryCtxRelease_v2(CUdevice dev);
MG_HIDDEN CUresult mg_h_cuDevicePrimaryCtxReset(CUdevice dev);
MG_HIDDEN CUresult mg_h_cuDevicePrimaryCtxReset_v2(CUdevice dev);
MG_HIDDEN CUresult mg_h_cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev);
MG_HIDDEN CUresult mg_h_cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev);
MG_HIDDEN CUresult mg_h_cuCtxCreate_v3(CUcontext *pctx, void *paramsArray, int numParams, unsigned int flags,
                                       CUdevice dev);
MG_HIDDEN CUresult mg_h_cuCtxCreate_v4(CUcontext *pctx, void *ctxCreateParams, unsigned int flags, CUdevice dev);
MG_HIDDEN CUresult mg_h_cuCtxDestroy(CUcontext ctx);
MG_HIDDEN CUresult mg_h_cuCtxDestroy_v2(CUcontext ctx);
MG_HIDDEN CUresult mg_h_cuGreenCtxCreate(CUgreenCtx *phCtx, CUdevResourceDesc desc, CUdevice dev, unsigned int flags);
MG_HIDDEN CUresult mg_h_cuGreenCtxDestroy(CUgreenCtx hCtx);
MG_HIDDEN CUresult mg_h_cuCtxSetLimit(int limit, size_t value);
MG_HIDDEN CUresult mg_h_cuModuleLoad(CUmodule *module, const char *fname);
MG_HIDDEN CUresult mg_h_cuModuleLoadData(CUmodule *module, const void *image);
MG_HIDDEN CUresult mg_h_cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                                           void *options, void **optionValues);
MG_HIDDEN CUresult mg_h_cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin);
MG_HIDDEN CUresult mg_h_cuModuleUnload(CUmodule hmod);
MG_HIDDEN CUresult mg_h_cuLibraryLoadData(CUlibrary *library, const void *code, void *jitOptions,
                                          void **jitOptionsValues, unsigned int numJitOptions, void *libraryOptions,
                                          void **libraryOptionValues, unsigned int numLibraryOptions);
MG_HIDDEN CUresult mg_h_cuLibraryLoadFromFile(CUlibrary *library, const char *fileName, void *jitOptions,
                                              void **jitOptionsValues, unsigned int numJitOptions,
                                              void *libraryOptions, void **libraryOptionValues,
                                              unsigned int numLibraryOptions);
MG_HIDDEN CUresult mg_h_cuLibraryUnload(CUlibrary library);

MG_HIDDEN CUresult mg_h_cuGraphInstantiate(CUgraphExec *e, CUgraph g, CUgraphNode *errNode, char *log, size_t n);
MG_HIDDEN CUresult mg_h_cuGraphInstantiate_v2(CUgraphExec *e, CUgraph g, CUgraphNode *errNode, char *log, size_t n);
MG_HIDDEN CUresult mg_h_cuGraphInstantiateWithFlags(CUgraphExec *e, CUgraph g, unsigned long long flags);
MG_HIDDEN CUresult mg_h_cuGraphInstantiateWithParams(CUgraphExec *e, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p);
MG_HIDDEN CUresult mg_h_cuGraphInstantiateWithParams_ptsz(CUgraphExec *e, CUgraph g,
                                                          CUDA_GRAPH_INSTANTIATE_PARAMS *p);
MG_HIDDEN CUresult mg_h_cuGraphExecDestroy(CUgraphExec e);
MG_HIDDEN CUresult mg_h_cuGraphUpload(CUgraphExec e, CUstream s);
MG_HIDDEN CUresult mg_h_cuGraphUpload_ptsz(CUgraphExec e, CUstream s);
MG_HIDDEN CUresult mg_h_cuDeviceGraphMemTrim(CUdevice dev);
MG_HIDDEN CUresult mg_h_cuStreamBeginCapture(CUstream s);
MG_HIDDEN CUresult mg_h_cuStreamBeginCapture_v2(CUstream s, int mode);
MG_HIDDEN CUresult mg_h_cuStreamBeginCapture_v2_ptsz(CUstream s, int mode);
MG_HIDDEN CUresult mg_h_cuStreamBeginCaptureToGraph(CUstream s, CUgraph g, const CUgraphNode *deps,
                                                    const void *edgeData, size_t n, int mode);
MG_HIDDEN CUresult mg_h_cuStreamBeginCaptureToGraph_ptsz(CUstream s, CUgraph g, const CUgraphNode *deps,
                                                         const void *edgeData, size_t n, int mode);
MG_HIDDEN CUresult mg_h_cuStreamEndCapture(CUstream s, CUgraph *g);
MG_HIDDEN CUresult mg_h_cuStreamEndCapture_ptsz(CUstream s, CUgraph *g);

/* --- memguard.c's services --- */

/* The driver's function behind table entry `i` (NULL if the driver lacks it). */
MG_HIDDEN void *mg_real_fn(int i);
/* A driver function the shim calls for itself, by name (NULL if absent). */
MG_HIDDEN void *mg_driver_fn(int lib, const char *name);
MG_HIDDEN int mg_x_on(void);       /* the container is limited (MODE_ON) */
MG_HIDDEN int mg_x_refusing(void); /* the files are broken: refuse */
MG_HIDDEN CUresult mg_charge(uint64_t bytes);
MG_HIDDEN void mg_force_charge(uint64_t bytes);
MG_HIDDEN int mg_admit(uint64_t bytes);
MG_HIDDEN void mg_uncharge(uint64_t bytes);
MG_HIDDEN void mg_maybe_return_grant(void);
MG_HIDDEN uint64_t mg_container_total(void);
MG_HIDDEN uint64_t mg_process_counted(void); /* this process's slot: bytes counted for it */
MG_HIDDEN unsigned mg_nvml_self_pid(void);   /* this process's pid as NVML reports it, or 0 if unknown */
MG_HIDDEN int mg_nvml_pids_foreign(void);    /* NVML's pids are the host's: this process's may be learnt */
MG_HIDDEN const char *mg_container_dir(void); /* $GPUFRAC_CONTAINER_DIR as the shim uses it */
MG_HIDDEN void mg_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
MG_HIDDEN CUresult mg_x_refuse(void); /* count a refusal; CUDA_ERROR_OUT_OF_MEMORY */

/* mg_graph.c: executable graphs whose memory is not yet counted (graph launches
 * look further only while this is non-zero), streams capturing now (stream-ordered
 * allocations look further only then), and the checks behind them. */
extern MG_HIDDEN _Atomic unsigned mg_graph_unmapped;
extern MG_HIDDEN _Atomic unsigned mg_capturing;
MG_HIDDEN CUresult mg_graph_launch(void *real_launch, CUgraphExec e, CUstream s);
MG_HIDDEN int mg_stream_capturing(CUstream s);

#define XREAL(sym) ((__typeof__(&mg_h_##sym))mg_real_fn(S_##sym))
#define XCALL(sym, ...)                                  \
    __extension__({                                      \
        __typeof__(&mg_h_##sym) f_ = XREAL(sym);         \
        f_ ? f_(__VA_ARGS__) : CUDA_ERROR_NOT_FOUND;     \
    })
#define MG_XALIAS(sym, base, ver, lib, ptds) \
    extern __typeof__(mg_h_##sym) sym __attribute__((alias("mg_h_" #sym), visibility("default")));

#endif
