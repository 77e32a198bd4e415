/*
 * memguard: the rows of the one hook table, listed by the source that hooks
 * them, and the hooks' prototypes (included by mg_internal.h only).
 *
 * X(exported name, base name for cuGetProcAddress, cudaVersion the driver maps
 *   base to this variant from, library, per-thread default stream variant).
 * A source adds an entry point with a row in its list and the hook's prototype
 * below, and exports its hooks with MG_SYMBOLS_<its list>(MG_XALIAS).
 */
#ifndef GPUFRAC_MEMGUARD_SYMBOLS_H
#define GPUFRAC_MEMGUARD_SYMBOLS_H

/* mg_ctx.c */
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

/* mg_graph.c */
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

/* mg_symbols.c */
#define MG_SYMBOLS_PROC(X)                                          \
    X(cuGetProcAddress, "cuGetProcAddress", 11030, LIB_CUDA, 0)     \
    X(cuGetProcAddress_v2, "cuGetProcAddress", 12000, LIB_CUDA, 0)

/* mg_alloc.c */
#define MG_SYMBOLS_ALLOC(X)                                       \
    X(cuMemAlloc, "cuMemAlloc", 2000, LIB_CUDA, 0)                \
    X(cuMemAlloc_v2, "cuMemAlloc", 3020, LIB_CUDA, 0)             \
    X(cuMemAllocPitch, "cuMemAllocPitch", 2000, LIB_CUDA, 0)      \
    X(cuMemAllocPitch_v2, "cuMemAllocPitch", 3020, LIB_CUDA, 0)   \
    X(cuMemAllocManaged, "cuMemAllocManaged", 6000, LIB_CUDA, 0)  \
    X(cuMemFree, "cuMemFree", 2000, LIB_CUDA, 0)                  \
    X(cuMemFree_v2, "cuMemFree", 3020, LIB_CUDA, 0)               \
    X(cuMemFreeAsync, "cuMemFreeAsync", 11020, LIB_CUDA, 0)       \
    X(cuMemFreeAsync_ptsz, "cuMemFreeAsync", 11020, LIB_CUDA, 1)

/* mg_pool.c */
#define MG_SYMBOLS_POOL(X)                                                          \
    X(cuMemAllocAsync, "cuMemAllocAsync", 11020, LIB_CUDA, 0)                       \
    X(cuMemAllocAsync_ptsz, "cuMemAllocAsync", 11020, LIB_CUDA, 1)                  \
    X(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", 11020, LIB_CUDA, 0)       \
    X(cuMemAllocFromPoolAsync_ptsz, "cuMemAllocFromPoolAsync", 11020, LIB_CUDA, 1)  \
    X(cuMemPoolTrimTo, "cuMemPoolTrimTo", 11020, LIB_CUDA, 0)                       \
    X(cuMemPoolDestroy, "cuMemPoolDestroy", 11020, LIB_CUDA, 0)                     \
    X(cuStreamSynchronize, "cuStreamSynchronize", 2000, LIB_CUDA, 0)                \
    X(cuStreamSynchronize_ptsz, "cuStreamSynchronize", 7000, LIB_CUDA, 1)           \
    X(cuEventSynchronize, "cuEventSynchronize", 2000, LIB_CUDA, 0)                  \
    X(cuCtxSynchronize, "cuCtxSynchronize", 2000, LIB_CUDA, 0)                      \
    X(cuCtxSynchronize_v2, "cuCtxSynchronize", 13000, LIB_CUDA, 0)                  \
    X(cuMemPoolCreate, "cuMemPoolCreate", 11020, LIB_CUDA, 0)

/* mg_vmm.c */
#define MG_SYMBOLS_VMM(X)                                                              \
    X(cuMemCreate, "cuMemCreate", 10020, LIB_CUDA, 0)                                  \
    X(cuMemRelease, "cuMemRelease", 10020, LIB_CUDA, 0)                                \
    X(cuMemMap, "cuMemMap", 10020, LIB_CUDA, 0)                                        \
    X(cuMemUnmap, "cuMemUnmap", 10020, LIB_CUDA, 0)                                    \
    X(cuMemRetainAllocationHandle, "cuMemRetainAllocationHandle", 11000, LIB_CUDA, 0)

/* mg_array.c */
#define MG_SYMBOLS_ARRAY(X)                                                   \
    X(cuArrayCreate_v2, "cuArrayCreate", 3020, LIB_CUDA, 0)                   \
    X(cuArray3DCreate_v2, "cuArray3DCreate", 3020, LIB_CUDA, 0)               \
    X(cuArrayDestroy, "cuArrayDestroy", 2000, LIB_CUDA, 0)                    \
    X(cuMipmappedArrayCreate, "cuMipmappedArrayCreate", 5000, LIB_CUDA, 0)    \
    X(cuMipmappedArrayDestroy, "cuMipmappedArrayDestroy", 5000, LIB_CUDA, 0)

/* mg_view.c */
#define MG_SYMBOLS_VIEW(X)                                                       \
    X(cuMemGetInfo, "cuMemGetInfo", 2000, LIB_CUDA, 0)                           \
    X(cuMemGetInfo_v2, "cuMemGetInfo", 3020, LIB_CUDA, 0)                        \
    X(cuDeviceTotalMem, "cuDeviceTotalMem", 2000, LIB_CUDA, 0)                   \
    X(cuDeviceTotalMem_v2, "cuDeviceTotalMem", 3020, LIB_CUDA, 0)                \
    X(nvmlDeviceGetMemoryInfo, "nvmlDeviceGetMemoryInfo", 0, LIB_NVML, 0)        \
    X(nvmlDeviceGetMemoryInfo_v2, "nvmlDeviceGetMemoryInfo_v2", 0, LIB_NVML, 0)

/* mg_launch.c */
#define MG_SYMBOLS_LAUNCH(X)                                                           \
    X(cuLaunchKernel, "cuLaunchKernel", 4000, LIB_CUDA, 0)                             \
    X(cuLaunchKernel_ptsz, "cuLaunchKernel", 7000, LIB_CUDA, 1)                        \
    X(cuLaunchKernelEx, "cuLaunchKernelEx", 11060, LIB_CUDA, 0)                        \
    X(cuLaunchKernelEx_ptsz, "cuLaunchKernelEx", 11060, LIB_CUDA, 1)                   \
    X(cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel", 9000, LIB_CUDA, 0)       \
    X(cuLaunchCooperativeKernel_ptsz, "cuLaunchCooperativeKernel", 9000, LIB_CUDA, 1)  \
    X(cuGraphLaunch, "cuGraphLaunch", 10000, LIB_CUDA, 0)                              \
    X(cuGraphLaunch_ptsz, "cuGraphLaunch", 10000, LIB_CUDA, 1)

/* mg_copy.c: entry points that only gate, one list giving both their rows and their
 * hooks: G(X, exported name, base name, cudaVersion, ptds, parameters, arguments). */
#define MG_GATES(G, X)                                                                                       \
    G(X, cuMemcpy, "cuMemcpy", 4000, 0, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n))                  \
    G(X, cuMemcpy_ptds, "cuMemcpy", 7000, 1, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n))             \
    G(X, cuMemcpyPeer, "cuMemcpyPeer", 4000, 0,                                                               \
      (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n), (d, dc, s, sc, n))                \
    G(X, cuMemcpyPeer_ptds, "cuMemcpyPeer", 7000, 1,                                                          \
      (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n), (d, dc, s, sc, n))                \
    G(X, cuMemcpyHtoD_v2, "cuMemcpyHtoD", 3020, 0, (CUdeviceptr d, const void *s, size_t n), (d, s, n))       \
    G(X, cuMemcpyHtoD_v2_ptds, "cuMemcpyHtoD", 7000, 1, (CUdeviceptr d, const void *s, size_t n), (d, s, n))  \
    G(X, cuMemcpyDtoH_v2, "cuMemcpyDtoH", 3020, 0, (void *d, CUdeviceptr s, size_t n), (d, s, n))             \
    G(X, cuMemcpyDtoH_v2_ptds, "cuMemcpyDtoH", 7000, 1, (void *d, CUdeviceptr s, size_t n), (d, s, n))        \
    G(X, cuMemcpyDtoD_v2, "cuMemcpyDtoD", 3020, 0, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n))       \
    G(X, cuMemcpyDtoD_v2_ptds, "cuMemcpyDtoD", 7000, 1, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n))  \
    G(X, cuMemcpyDtoA_v2, "cuMemcpyDtoA", 3020, 0, (CUarray d, size_t o, CUdeviceptr s, size_t n), (d, o, s, n)) \
    G(X, cuMemcpyDtoA_v2_ptds, "cuMemcpyDtoA", 7000, 1, (CUarray d, size_t o, CUdeviceptr s, size_t n),      \
      (d, o, s, n))                                                                                           \
    G(X, cuMemcpyAtoD_v2, "cuMemcpyAtoD", 3020, 0, (CUdeviceptr d, CUarray s, size_t o, size_t n), (d, s, o, n)) \
    G(X, cuMemcpyAtoD_v2_ptds, "cuMemcpyAtoD", 7000, 1, (CUdeviceptr d, CUarray s, size_t o, size_t n),      \
      (d, s, o, n))                                                                                           \
    G(X, cuMemcpyHtoA_v2, "cuMemcpyHtoA", 3020, 0, (CUarray d, size_t o, const void *s, size_t n), (d, o, s, n)) \
    G(X, cuMemcpyHtoA_v2_ptds, "cuMemcpyHtoA", 7000, 1, (CUarray d, size_t o, const void *s, size_t n),      \
      (d, o, s, n))                                                                                           \
    G(X, cuMemcpyAtoH_v2, "cuMemcpyAtoH", 3020, 0, (void *d, CUarray s, size_t o, size_t n), (d, s, o, n))    \
    G(X, cuMemcpyAtoH_v2_ptds, "cuMemcpyAtoH", 7000, 1, (void *d, CUarray s, size_t o, size_t n), (d, s, o, n)) \
    G(X, cuMemcpyAtoA_v2, "cuMemcpyAtoA", 3020, 0, (CUarray d, size_t dox, CUarray s, size_t so, size_t n),   \
      (d, dox, s, so, n))                                                                                     \
    G(X, cuMemcpyAtoA_v2_ptds, "cuMemcpyAtoA", 7000, 1, (CUarray d, size_t dox, CUarray s, size_t so, size_t n), \
      (d, dox, s, so, n))                                                                                     \
    G(X, cuMemcpy2D_v2, "cuMemcpy2D", 3020, 0, (const void *p), (p))                                          \
    G(X, cuMemcpy2D_v2_ptds, "cuMemcpy2D", 7000, 1, (const void *p), (p))                                     \
    G(X, cuMemcpy2DUnaligned_v2, "cuMemcpy2DUnaligned", 3020, 0, (const void *p), (p))                        \
    G(X, cuMemcpy2DUnaligned_v2_ptds, "cuMemcpy2DUnaligned", 7000, 1, (const void *p), (p))                   \
    G(X, cuMemcpy3D_v2, "cuMemcpy3D", 3020, 0, (const void *p), (p))                                          \
    G(X, cuMemcpy3D_v2_ptds, "cuMemcpy3D", 7000, 1, (const void *p), (p))                                     \
    G(X, cuMemcpy3DPeer, "cuMemcpy3DPeer", 4000, 0, (const void *p), (p))                                     \
    G(X, cuMemcpy3DPeer_ptds, "cuMemcpy3DPeer", 7000, 1, (const void *p), (p))                                \
    G(X, cuMemcpyAsync, "cuMemcpyAsync", 4000, 0, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream h), (d, s, n, h)) \
    G(X, cuMemcpyAsync_ptsz, "cuMemcpyAsync", 7000, 1, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream h),  \
      (d, s, n, h))                                                                                           \
    G(X, cuMemcpyPeerAsync, "cuMemcpyPeerAsync", 4000, 0,                                                     \
      (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n, CUstream h), (d, dc, s, sc, n, h)) \
    G(X, cuMemcpyPeerAsync_ptsz, "cuMemcpyPeerAsync", 7000, 1,                                                \
      (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n, CUstream h), (d, dc, s, sc, n, h)) \
    G(X, cuMemcpyHtoDAsync_v2, "cuMemcpyHtoDAsync", 3020, 0, (CUdeviceptr d, const void *s, size_t n, CUstream h), \
      (d, s, n, h))                                                                                           \
    G(X, cuMemcpyHtoDAsync_v2_ptsz, "cuMemcpyHtoDAsync", 7000, 1,                                             \
      (CUdeviceptr d, const void *s, size_t n, CUstream h), (d, s, n, h))                                     \
    G(X, cuMemcpyDtoHAsync_v2, "cuMemcpyDtoHAsync", 3020, 0, (void *d, CUdeviceptr s, size_t n, CUstream h),  \
      (d, s, n, h))                                                                                           \
    G(X, cuMemcpyDtoHAsync_v2_ptsz, "cuMemcpyDtoHAsync", 7000, 1, (void *d, CUdeviceptr s, size_t n, CUstream h), \
      (d, s, n, h))                                                                                           \
    G(X, cuMemcpyDtoDAsync_v2, "cuMemcpyDtoDAsync", 3020, 0, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream h), \
      (d, s, n, h))                                                                                           \
    G(X, cuMemcpyDtoDAsync_v2_ptsz, "cuMemcpyDtoDAsync", 7000, 1,                                             \
      (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream h), (d, s, n, h))                                     \
    G(X, cuMemcpyHtoAAsync_v2, "cuMemcpyHtoAAsync", 3020, 0,                                                  \
      (CUarray d, size_t o, const void *s, size_t n, CUstream h), (d, o, s, n, h))                            \
    G(X, cuMemcpyHtoAAsync_v2_ptsz, "cuMemcpyHtoAAsync", 7000, 1,                                             \
      (CUarray d, size_t o, const void *s, size_t n, CUstream h), (d, o, s, n, h))                            \
    G(X, cuMemcpyAtoHAsync_v2, "cuMemcpyAtoHAsync", 3020, 0, (void *d, CUarray s, size_t o, size_t n, CUstream h), \
      (d, s, o, n, h))                                                                                        \
    G(X, cuMemcpyAtoHAsync_v2_ptsz, "cuMemcpyAtoHAsync", 7000, 1,                                             \
      (void *d, CUarray s, size_t o, size_t n, CUstream h), (d, s, o, n, h))                                  \
    G(X, cuMemcpy2DAsync_v2, "cuMemcpy2DAsync", 3020, 0, (const void *p, CUstream h), (p, h))                 \
    G(X, cuMemcpy2DAsync_v2_ptsz, "cuMemcpy2DAsync", 7000, 1, (const void *p, CUstream h), (p, h))            \
    G(X, cuMemcpy3DAsync_v2, "cuMemcpy3DAsync", 3020, 0, (const void *p, CUstream h), (p, h))                 \
    G(X, cuMemcpy3DAsync_v2_ptsz, "cuMemcpy3DAsync", 7000, 1, (const void *p, CUstream h), (p, h))            \
    G(X, cuMemcpy3DPeerAsync, "cuMemcpy3DPeerAsync", 4000, 0, (const void *p, CUstream h), (p, h))            \
    G(X, cuMemcpy3DPeerAsync_ptsz, "cuMemcpy3DPeerAsync", 7000, 1, (const void *p, CUstream h), (p, h))       \
    G(X, cuMemsetD8_v2, "cuMemsetD8", 3020, 0, (CUdeviceptr d, unsigned char v, size_t n), (d, v, n))         \
    G(X, cuMemsetD8_v2_ptds, "cuMemsetD8", 7000, 1, (CUdeviceptr d, unsigned char v, size_t n), (d, v, n))    \
    G(X, cuMemsetD16_v2, "cuMemsetD16", 3020, 0, (CUdeviceptr d, unsigned short v, size_t n), (d, v, n))      \
    G(X, cuMemsetD16_v2_ptds, "cuMemsetD16", 7000, 1, (CUdeviceptr d, unsigned short v, size_t n), (d, v, n)) \
    G(X, cuMemsetD32_v2, "cuMemsetD32", 3020, 0, (CUdeviceptr d, unsigned int v, size_t n), (d, v, n))        \
    G(X, cuMemsetD32_v2_ptds, "cuMemsetD32", 7000, 1, (CUdeviceptr d, unsigned int v, size_t n), (d, v, n))   \
    G(X, cuMemsetD2D8_v2, "cuMemsetD2D8", 3020, 0,                                                            \
      (CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t hgt), (d, p, v, w, hgt))                    \
    G(X, cuMemsetD2D8_v2_ptds, "cuMemsetD2D8", 7000, 1,                                                       \
      (CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t hgt), (d, p, v, w, hgt))                    \
    G(X, cuMemsetD2D16_v2, "cuMemsetD2D16", 3020, 0,                                                          \
      (CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t hgt), (d, p, v, w, hgt))                   \
    G(X, cuMemsetD2D16_v2_ptds, "cuMemsetD2D16", 7000, 1,                                                     \
      (CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t hgt), (d, p, v, w, hgt))                   \
    G(X, cuMemsetD2D32_v2, "cuMemsetD2D32", 3020, 0,                                                          \
      (CUdeviceptr d, size_t p, unsigned int v, size_t w, size_t hgt), (d, p, v, w, hgt))                     \
    G(X, cuMemsetD2D32_v2_ptds, "cuMemsetD2D32", 7000, 1,                                                     \
      (CUdeviceptr d, size_t p, unsigned int v, size_t w, size_t hgt), (d, p, v, w, hgt))                     \
    G(X, cuMemsetD8Async, "cuMemsetD8Async", 3020, 0, (CUdeviceptr d, unsigned char v, size_t n, CUstream h), \
      (d, v, n, h))                                                                                           \
    G(X, cuMemsetD8Async_ptsz, "cuMemsetD8Async", 7000, 1,                                                    \
      (CUdeviceptr d, unsigned char v, size_t n, CUstream h), (d, v, n, h))                                   \
    G(X, cuMemsetD16Async, "cuMemsetD16Async", 3020, 0, (CUdeviceptr d, unsigned short v, size_t n, CUstream h), \
      (d, v, n, h))                                                                                           \
    G(X, cuMemsetD16Async_ptsz, "cuMemsetD16Async", 7000, 1,                                                  \
      (CUdeviceptr d, unsigned short v, size_t n, CUstream h), (d, v, n, h))                                  \
    G(X, cuMemsetD32Async, "cuMemsetD32Async", 3020, 0, (CUdeviceptr d, unsigned int v, size_t n, CUstream h), \
      (d, v, n, h))                                                                                           \
    G(X, cuMemsetD32Async_ptsz, "cuMemsetD32Async", 7000, 1,                                                  \
      (CUdeviceptr d, unsigned int v, size_t n, CUstream h), (d, v, n, h))                                    \
    G(X, cuMemsetD2D8Async, "cuMemsetD2D8Async", 3020, 0,                                                     \
      (CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t hgt, CUstream h), (d, p, v, w, hgt, h))     \
    G(X, cuMemsetD2D8Async_ptsz, "cuMemsetD2D8Async", 7000, 1,                                                \
      (CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t hgt, CUstream h), (d, p, v, w, hgt, h))     \
    G(X, cuMemsetD2D16Async, "cuMemsetD2D16Async", 3020, 0,                                                   \
      (CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t hgt, CUstream h), (d, p, v, w, hgt, h))    \
    G(X, cuMemsetD2D16Async_ptsz, "cuMemsetD2D16Async", 7000, 1,                                              \
      (CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t hgt, CUstream h), (d, p, v, w, hgt, h))    \
    G(X, cuMemsetD2D32Async, "cuMemsetD2D32Async", 3020, 0,                                                   \
      (CUdeviceptr d, size_t p, unsigned int v, size_t w, size_t hgt, CUstream h), (d, p, v, w, hgt, h))      \
    G(X, cuMemsetD2D32Async_ptsz, "cuMemsetD2D32Async", 7000, 1,                                              \
      (CUdeviceptr d, size_t p, unsigned int v, size_t w, size_t hgt, CUstream h), (d, p, v, w, hgt, h))      \
    G(X, cuStreamQuery, "cuStreamQuery", 2000, 0, (CUstream h), (h))                                          \
    G(X, cuStreamQuery_ptsz, "cuStreamQuery", 7000, 1, (CUstream h), (h))                                     \
    G(X, cuStreamWaitEvent, "cuStreamWaitEvent", 3020, 0, (CUstream h, CUevent e, unsigned int f), (h, e, f)) \
    G(X, cuStreamWaitEvent_ptsz, "cuStreamWaitEvent", 7000, 1, (CUstream h, CUevent e, unsigned int f), (h, e, f)) \
    G(X, cuEventQuery, "cuEventQuery", 2000, 0, (CUevent e), (e))                                             \
    G(X, cuEventRecord, "cuEventRecord", 2000, 0, (CUevent e, CUstream h), (e, h))                            \
    G(X, cuEventRecord_ptsz, "cuEventRecord", 7000, 1, (CUevent e, CUstream h), (e, h))                       \
    G(X, cuEventRecordWithFlags, "cuEventRecordWithFlags", 11010, 0, (CUevent e, CUstream h, unsigned int f), \
      (e, h, f))                                                                                              \
    G(X, cuEventRecordWithFlags_ptsz, "cuEventRecordWithFlags", 11010, 1, (CUevent e, CUstream h, unsigned int f), \
      (e, h, f))
#define MG_GATE_ROW(X, sym, base, ver, ptds, params, args) X(sym, base, ver, LIB_CUDA, ptds)
#define MG_SYMBOLS_COPY(X) MG_GATES(MG_GATE_ROW, X)

/* mg_nvml.c */
#define MG_SYMBOLS_NVML(X)                                             \
    X(nvmlDeviceGetComputeRunningProcesses, "", 0, LIB_NVML, 0)        \
    X(nvmlDeviceGetComputeRunningProcesses_v2, "", 0, LIB_NVML, 0)     \
    X(nvmlDeviceGetComputeRunningProcesses_v3, "", 0, LIB_NVML, 0)     \
    X(nvmlDeviceGetGraphicsRunningProcesses, "", 0, LIB_NVML, 0)       \
    X(nvmlDeviceGetGraphicsRunningProcesses_v2, "", 0, LIB_NVML, 0)    \
    X(nvmlDeviceGetGraphicsRunningProcesses_v3, "", 0, LIB_NVML, 0)    \
    X(nvmlDeviceGetMPSComputeRunningProcesses, "", 0, LIB_NVML, 0)     \
    X(nvmlDeviceGetMPSComputeRunningProcesses_v2, "", 0, LIB_NVML, 0)  \
    X(nvmlDeviceGetMPSComputeRunningProcesses_v3, "", 0, LIB_NVML, 0)  \
    X(nvmlDeviceGetRunningProcessDetailList, "", 0, LIB_NVML, 0)       \
    X(nvmlDeviceGetProcessUtilization, "", 0, LIB_NVML, 0)             \
    X(nvmlDeviceGetProcessesUtilizationInfo, "", 0, LIB_NVML, 0)       \
    X(nvmlDeviceGetBAR1MemoryInfo, "", 0, LIB_NVML, 0)

/* The whole table, in this order: the variants of one base name sit in one list,
 * in the order cuGetProcAddress's match relies on (mg_proc_hook). */
#define MG_SYMBOLS_ALL(X)                                                                          \
    MG_SYMBOLS_CTX(X) MG_SYMBOLS_GRAPH(X) MG_SYMBOLS_PROC(X) MG_SYMBOLS_ALLOC(X) MG_SYMBOLS_POOL(X) \
    MG_SYMBOLS_VMM(X) MG_SYMBOLS_ARRAY(X) MG_SYMBOLS_VIEW(X) MG_SYMBOLS_LAUNCH(X) MG_SYMBOLS_COPY(X)   \
    MG_SYMBOLS_NVML(X)

/* ------------------------------------------------------------------------ */
/* The hooks.                                                                */

/* mg_ctx.c */
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

/* mg_graph.c */
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

/* mg_symbols.c */
MG_HIDDEN CUresult mg_h_cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
MG_HIDDEN CUresult mg_h_cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                            CUdriverProcAddressQueryResult *symbolStatus);

/* mg_alloc.c */
MG_HIDDEN CUresult mg_h_cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize);
MG_HIDDEN CUresult mg_h_cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
MG_HIDDEN CUresult mg_h_cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pPitch, unsigned int WidthInBytes,
                                        unsigned int Height, unsigned int ElementSizeBytes);
MG_HIDDEN CUresult mg_h_cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                           unsigned int ElementSizeBytes);
MG_HIDDEN CUresult mg_h_cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags);
MG_HIDDEN CUresult mg_h_cuMemFree(CUdeviceptr_v1 dptr);
MG_HIDDEN CUresult mg_h_cuMemFree_v2(CUdeviceptr dptr);
MG_HIDDEN CUresult mg_h_cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream);
MG_HIDDEN CUresult mg_h_cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream);

/* mg_pool.c */
MG_HIDDEN CUresult mg_h_cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
MG_HIDDEN CUresult mg_h_cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
MG_HIDDEN CUresult mg_h_cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                                CUstream hStream);
MG_HIDDEN CUresult mg_h_cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                                     CUstream hStream);
MG_HIDDEN CUresult mg_h_cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep);
MG_HIDDEN CUresult mg_h_cuMemPoolDestroy(CUmemoryPool pool);
MG_HIDDEN CUresult mg_h_cuStreamSynchronize(CUstream hStream);
MG_HIDDEN CUresult mg_h_cuStreamSynchronize_ptsz(CUstream hStream);
MG_HIDDEN CUresult mg_h_cuEventSynchronize(CUevent hEvent);
MG_HIDDEN CUresult mg_h_cuCtxSynchronize(void);
MG_HIDDEN CUresult mg_h_cuCtxSynchronize_v2(CUcontext ctx);
MG_HIDDEN CUresult mg_h_cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props);

/* mg_vmm.c */
MG_HIDDEN CUresult mg_h_cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                                    const CUmemAllocationProp *prop, unsigned long long flags);
MG_HIDDEN CUresult mg_h_cuMemRelease(CUmemGenericAllocationHandle handle);
MG_HIDDEN CUresult mg_h_cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                                 unsigned long long flags);
MG_HIDDEN CUresult mg_h_cuMemUnmap(CUdeviceptr ptr, size_t size);
MG_HIDDEN CUresult mg_h_cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr);

/* mg_array.c */
MG_HIDDEN CUresult mg_h_cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *d);
MG_HIDDEN CUresult mg_h_cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d);
MG_HIDDEN CUresult mg_h_cuArrayDestroy(CUarray hArray);
MG_HIDDEN CUresult mg_h_cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                               unsigned int numMipmapLevels);
MG_HIDDEN CUresult mg_h_cuMipmappedArrayDestroy(CUmipmappedArray hArray);

/* mg_view.c */
MG_HIDDEN CUresult mg_h_cuMemGetInfo(unsigned int *free_, unsigned int *total);
MG_HIDDEN CUresult mg_h_cuMemGetInfo_v2(size_t *free_, size_t *total);
MG_HIDDEN CUresult mg_h_cuDeviceTotalMem(unsigned int *bytes, CUdevice dev);
MG_HIDDEN CUresult mg_h_cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev);
MG_HIDDEN nvmlReturn_t mg_h_nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory);
MG_HIDDEN nvmlReturn_t mg_h_nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory);

/* mg_launch.c */
#define MG_LAUNCH_PARAMS                                                                                  \
    (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ, unsigned int blockDimX, \
     unsigned int blockDimY, unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,          \
     void **kernelParams, void **extra)
#define MG_COOP_PARAMS                                                                                    \
    (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ, unsigned int blockDimX, \
     unsigned int blockDimY, unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,          \
     void **kernelParams)
MG_HIDDEN CUresult mg_h_cuLaunchKernel MG_LAUNCH_PARAMS;
MG_HIDDEN CUresult mg_h_cuLaunchKernel_ptsz MG_LAUNCH_PARAMS;
MG_HIDDEN CUresult mg_h_cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra);
MG_HIDDEN CUresult mg_h_cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                              void **extra);
MG_HIDDEN CUresult mg_h_cuLaunchCooperativeKernel MG_COOP_PARAMS;
MG_HIDDEN CUresult mg_h_cuLaunchCooperativeKernel_ptsz MG_COOP_PARAMS;
MG_HIDDEN CUresult mg_h_cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream);
MG_HIDDEN CUresult mg_h_cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream);

/* mg_copy.c */
#define MG_GATE_PROTO(X, sym, base, ver, ptds, params, args) MG_HIDDEN CUresult mg_h_##sym params;
MG_GATES(MG_GATE_PROTO, _)
#undef MG_GATE_PROTO

/* mg_nvml.c */
MG_HIDDEN nvmlReturn_t mg_h_nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                                 nvmlProcessInfo_v1_t *infos);
MG_HIDDEN nvmlReturn_t mg_h_nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                                    nvmlProcessInfo_t *infos);
MG_HIDDEN nvmlReturn_t mg_h_nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                                    nvmlProcessInfo_t *infos);
MG_HIDDEN nvmlReturn_t mg_h_nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                                  nvmlProcessInfo_v1_t *infos);
MG_HIDDEN nvmlReturn_t mg_h_nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                                     nvmlProcessInfo_t *infos);
MG_HIDDEN nvmlReturn_t mg_h_nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                                     nvmlProcessInfo_t *infos);
MG_HIDDEN nvmlReturn_t mg_h_nvmlDeviceGetMPSComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                                    nvmlProcessInfo_v1_t *infos);
MG_HIDDEN nvmlReturn_t mg_h_nvmlDeviceGetMPSComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                                       nvmlProcessInfo_t *infos);
MG_HIDDEN nvmlReturn_t mg_h_nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                                       nvmlProcessInfo_t *infos);
MG_HIDDEN nvmlReturn_t mg_h_nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t device, nvmlProcessDetailList_t *plist);
MG_HIDDEN nvmlReturn_t mg_h_nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
                                                            nvmlProcessUtilizationSample_t *utilization,
                                                            unsigned int *processSamplesCount,
                                                            unsigned long long lastSeenTimeStamp);
MG_HIDDEN nvmlReturn_t mg_h_nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t device,
                                                                  nvmlProcessesUtilizationInfo_t *procesesUtilInfo);
MG_HIDDEN nvmlReturn_t mg_h_nvmlDeviceGetBAR1MemoryInfo(nvmlDevice_t device, nvmlBAR1Memory_t *bar1Memory);

#endif
