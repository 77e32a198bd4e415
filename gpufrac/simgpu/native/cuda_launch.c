/*
 * simgpu fake libcuda.so.1 — the built-in fake module and kernel launches
 * (cuLaunchKernel, ...Ex, cooperative). A launch runs its kernel on the host at
 * once and hands its simulated duration and grid to the compute model
 * (cu_stream_kernel in cuda_exec.c; simstate.h sim_sched_*), which decides when on
 * the GPU it runs.
 *
 * The fake module: any image starting with "SIMGPU-MODULE". Its kernels and
 * their parameters are documented in docs/simgpu.md.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_internal.h"

#define MODULE_MAGIC "SIMGPU-MODULE"

/* ------------------------------------------------------------------ the fake module */

static const struct {
    const char *name;
    int kernel;
    int nparams;
    unsigned char size[4]; /* bytes per parameter; packed at 8-byte-aligned offsets */
} k_kernels[3] = {
    {"fill_u32", KERN_FILL_U32, 3, {8, 8, 4, 0}},
    {"check_u32", KERN_CHECK_U32, 4, {8, 8, 4, 8}},
    {"busy_us", KERN_BUSY_US, 1, {8, 0, 0, 0}},
};

/* The device memory a module image declares: "SIMGPU-MODULE:<bytes>" (decimal),
 * rounded up to the 2 MiB granule code and data are placed in; the bare magic
 * declares none. A real driver sizes it from the ELF sections. */
static uint64_t module_size(const char *image) {
    const char *p = image + sizeof MODULE_MAGIC - 1;
    if (*p != ':') return 0;
    uint64_t v = 0;
    for (p++; *p >= '0' && *p <= '9'; p++) {
        if (v > (UINT64_MAX - 9) / 10) return UINT64_MAX;
        v = v * 10 + (uint64_t)(*p - '0');
    }
    return v ? cu_round_up(v, CU_GRANULARITY) : 0;
}

static CUresult module_load(CUmodule *module, const void *image) {
    struct CUctx_st *c;
    CUresult r = cu_need_ctx(&c);
    if (r) return r;
    if (!module || !image) return CUDA_ERROR_INVALID_VALUE;
    if (memcmp(image, MODULE_MAGIC, sizeof MODULE_MAGIC - 1) != 0) return CUDA_ERROR_INVALID_IMAGE;
    uint64_t size = module_size(image);
    if (size == UINT64_MAX) return CUDA_ERROR_INVALID_IMAGE;
    struct CUmod_st *m = calloc(1, sizeof *m);
    if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
    if (size && cu_charge(c->gpu, size)) {
        free(m);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    m->charged = size, m->gpu = c->gpu;
    for (int k = 0; k < 3; k++) {
        m->funcs[k].kernel = k_kernels[k].kernel;
        m->funcs[k].name = k_kernels[k].name;
        m->funcs[k].mod = m;
        cu_obj_add(&m->funcs[k], OBJ_FUNC, c);
    }
    cu_obj_add(m, OBJ_MODULE, c);
    *module = m;
    return CUDA_SUCCESS;
}

CU_API CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    CU_ENTER();
    return module_load(module, image);
}

CU_API CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions, void *options,
                                   void **optionValues) {
    CU_ENTER();
    if (numOptions && (!options || !optionValues)) return CUDA_ERROR_INVALID_VALUE;
    return module_load(module, image);
}

CU_API CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin) {
    CU_ENTER();
    return module_load(module, fatCubin);
}

CU_API CUresult cuModuleLoad(CUmodule *module, const char *fname) {
    CU_ENTER();
    char head[64] = {0}; /* the magic and an optional ":<bytes>" */
    if (!fname) return CUDA_ERROR_INVALID_VALUE;
    int fd = open(fname, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT ? CUDA_ERROR_FILE_NOT_FOUND : CUDA_ERROR_INVALID_VALUE;
    ssize_t got = read(fd, head, sizeof head - 1);
    close(fd);
    if (got < (ssize_t)(sizeof MODULE_MAGIC - 1)) return CUDA_ERROR_INVALID_IMAGE;
    return module_load(module, head);
}

CU_API CUresult cuModuleUnload(CUmodule hmod) {
    CU_ENTER();
    if (!cu_obj_ok(hmod, OBJ_MODULE)) return CUDA_ERROR_INVALID_HANDLE;
    for (int k = 0; k < 3; k++) cu_obj_del(&hmod->funcs[k], OBJ_FUNC);
    if (cu_obj_del(hmod, OBJ_MODULE)) {
        cu_uncharge(hmod->gpu, hmod->charged);
        free(hmod);
    }
    return CUDA_SUCCESS;
}

CU_API CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
    CU_ENTER();
    if (!hfunc || !name) return CUDA_ERROR_INVALID_VALUE;
    if (!cu_obj_ok(hmod, OBJ_MODULE)) return CUDA_ERROR_INVALID_HANDLE;
    for (int k = 0; k < 3; k++)
        if (strcmp(hmod->funcs[k].name, name) == 0) {
            *hfunc = &hmod->funcs[k];
            return CUDA_SUCCESS;
        }
    return CUDA_ERROR_NOT_FOUND;
}

CU_API CUresult cuFuncGetName(const char **name, CUfunction hfunc) {
    CU_ENTER();
    if (!name) return CUDA_ERROR_INVALID_VALUE;
    if (!cu_obj_ok(hfunc, OBJ_FUNC)) return CUDA_ERROR_INVALID_HANDLE;
    *name = hfunc->name;
    return CUDA_SUCCESS;
}

CU_API CUresult cuFuncGetAttribute(int *pi, int attrib, CUfunction hfunc) {
    CU_ENTER();
    if (!pi) return CUDA_ERROR_INVALID_VALUE;
    if (!cu_obj_ok(hfunc, OBJ_FUNC)) return CUDA_ERROR_INVALID_HANDLE;
    static const int vals[] = {1024, 0, 0, 0, 16, 80, 80, 0, 49152, -1};
    if (attrib < 0 || attrib > 17) return CUDA_ERROR_INVALID_VALUE;
    *pi = attrib < 10 ? vals[attrib] : 0;
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ kernels and launches */

static int kernel_index(int kernel) { return kernel - KERN_FILL_U32; }

CUresult cu_kernel_pack(const struct CUfunc_st *f, void **params, void **extra,
                        unsigned char buf[KERN_MAX_PARAM_BYTES]) {
    int k = kernel_index(f->kernel), n = k_kernels[k].nparams;
    size_t need = (size_t)(n - 1) * 8 + k_kernels[k].size[n - 1];
    memset(buf, 0, KERN_MAX_PARAM_BYTES);
    if (params) {
        for (int i = 0; i < n; i++) {
            if (!params[i]) return CUDA_ERROR_INVALID_VALUE;
            memcpy(buf + 8 * i, params[i], k_kernels[k].size[i]);
        }
        return CUDA_SUCCESS;
    }
    const void *packed = NULL;
    size_t packed_size = 0;
    for (int i = 0; extra && extra[i] != CU_LAUNCH_PARAM_END && i < 16; i += 2) {
        if (extra[i] == CU_LAUNCH_PARAM_BUFFER_POINTER) packed = extra[i + 1];
        else if (extra[i] == CU_LAUNCH_PARAM_BUFFER_SIZE && extra[i + 1]) packed_size = *(size_t *)extra[i + 1];
        else return CUDA_ERROR_INVALID_VALUE;
    }
    if (!packed || packed_size < need) return CUDA_ERROR_INVALID_VALUE;
    memcpy(buf, packed, need);
    return CUDA_SUCCESS;
}

void cu_kernel_exec(struct CUctx_st *ctx, struct CUstream_st *s, int kernel, uint64_t blocks,
                    const unsigned char *buf) {
    uint64_t ptr, count, result, us;
    uint32_t value;
    uint64_t dur = 3000; /* launch latency */
    memcpy(&ptr, buf, 8), memcpy(&count, buf + 8, 8), memcpy(&value, buf + 16, 4), memcpy(&result, buf + 24, 8);
    if (kernel == KERN_BUSY_US) {
        memcpy(&us, buf, 8);
        dur = us > UINT64_MAX / 1000 ? UINT64_MAX / 2 : us * 1000;
    } else if (count > SIZE_MAX / 4 || !cu_dev_range_ok((uintptr_t)ptr, count * 4, kernel == KERN_FILL_U32) ||
               (kernel == KERN_CHECK_U32 && !cu_dev_range_ok((uintptr_t)result, 8, 1))) {
        ctx->sticky = CUDA_ERROR_ILLEGAL_ADDRESS; /* a fault poisons the context, as on a GPU */
    } else {
        uint32_t *p = (uint32_t *)(uintptr_t)ptr;
        if (kernel == KERN_FILL_U32) {
            for (uint64_t i = 0; i < count; i++) p[i] = value;
        } else {
            uint64_t bad = 0;
            for (uint64_t i = 0; i < count; i++) bad += p[i] != value;
            memcpy((void *)(uintptr_t)result, &bad, 8);
        }
        dur += count * 4 / 2000; /* ~2 TB/s */
    }
    cu_stream_kernel(ctx, s, dur, blocks);
}

static CUresult launch(CUfunction f, const unsigned int dims[6], CUstream h, void **params, void **extra,
                       int cooperative) {
    struct CUctx_st *c;
    struct CUstream_st *s;
    unsigned char buf[KERN_MAX_PARAM_BYTES];
    if (!cu_obj_ok(f, OBJ_FUNC)) return CUDA_ERROR_INVALID_HANDLE;
    CUresult r = cu_stream_get(h, &c, &s);
    if (r) return r;
    if (f->hdr.ctx != c) return CUDA_ERROR_INVALID_HANDLE;
    if (c->sticky) return c->sticky;
    for (int i = 0; i < 6; i++)
        if (dims[i] == 0) return CUDA_ERROR_INVALID_VALUE;
    if ((uint64_t)dims[3] * dims[4] * dims[5] > 1024 || dims[5] > 64) return CUDA_ERROR_INVALID_VALUE;
    if (cooperative && (uint64_t)dims[0] * dims[1] * dims[2] > (uint64_t)cu_node()->gpus[c->gpu].sm_count * 32)
        return CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE;
    if (params && extra) return CUDA_ERROR_INVALID_VALUE;
    if ((r = cu_kernel_pack(f, params, extra, buf))) return r;
    uint64_t blocks = (uint64_t)dims[0] * dims[1] * dims[2];
    if (s->capture) return cu_graph_capture_kernel(s->capture, f, blocks, buf);
    cu_kernel_exec(c, s, f->kernel, blocks, buf);
    return CUDA_SUCCESS;
}

CU_API CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                               unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                               unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra) {
    CU_ENTER();
    (void)sharedMemBytes;
    const unsigned int dims[6] = {gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ};
    return launch(f, dims, hStream, kernelParams, extra, 0);
}

CU_API CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra) {
    CU_ENTER();
    if (!config || (config->numAttrs && !config->attrs)) return CUDA_ERROR_INVALID_VALUE;
    const unsigned int dims[6] = {config->gridDimX,  config->gridDimY,  config->gridDimZ,
                                  config->blockDimX, config->blockDimY, config->blockDimZ};
    return launch(f, dims, config->hStream, kernelParams, extra, 0);
}

CU_API CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                          unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                          unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                          void **kernelParams) {
    CU_ENTER();
    (void)sharedMemBytes;
    const unsigned int dims[6] = {gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ};
    return launch(f, dims, hStream, kernelParams, NULL, 1);
}

/* Per-thread default stream twins (see CU_TWIN). */
CU_TWIN(cuLaunchKernel_ptsz, cuLaunchKernel,
        (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,
         unsigned int bz, unsigned int sm, CUstream h, void **p, void **e),
        (f, gx, gy, gz, bx, by, bz, sm, h, p, e))
CU_TWIN(cuLaunchKernelEx_ptsz, cuLaunchKernelEx, (const CUlaunchConfig *c, CUfunction f, void **p, void **e),
        (c, f, p, e))
CU_TWIN(cuLaunchCooperativeKernel_ptsz, cuLaunchCooperativeKernel,
        (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,
         unsigned int bz, unsigned int sm, CUstream h, void **p),
        (f, gx, gy, gz, bx, by, bz, sm, h, p))

const cu_sym_t cu_syms_launch[] = {
    CU_SYM("cuModuleLoad", 2000, cuModuleLoad),
    CU_SYM("cuModuleLoadData", 2000, cuModuleLoadData),
    CU_SYM("cuModuleLoadDataEx", 2010, cuModuleLoadDataEx),
    CU_SYM("cuModuleLoadFatBinary", 2000, cuModuleLoadFatBinary),
    CU_SYM("cuModuleUnload", 2000, cuModuleUnload),
    CU_SYM("cuModuleGetFunction", 2000, cuModuleGetFunction),
    CU_SYM("cuFuncGetName", 12030, cuFuncGetName),
    CU_SYM("cuFuncGetAttribute", 2020, cuFuncGetAttribute),
    CU_SYM("cuLaunchKernel", 4000, cuLaunchKernel),
    CU_SYM_PT("cuLaunchKernel", 4000, cuLaunchKernel_ptsz),
    CU_SYM("cuLaunchKernelEx", 11060, cuLaunchKernelEx),
    CU_SYM_PT("cuLaunchKernelEx", 11060, cuLaunchKernelEx_ptsz),
    CU_SYM("cuLaunchCooperativeKernel", 9000, cuLaunchCooperativeKernel),
    CU_SYM_PT("cuLaunchCooperativeKernel", 9000, cuLaunchCooperativeKernel_ptsz),
};
const size_t cu_syms_launch_n = sizeof cu_syms_launch / sizeof cu_syms_launch[0];
