/*
 * Tight loops for bench/shim.py, linked directly against libcuda.so.1 so the
 * numbers are the driver call plus (under LD_PRELOAD) the memguard hook, with
 * no interpreter in between.
 *
 *   shim_bench allocfree ROUNDS N BYTES  -> min over rounds of ns per alloc+free pair
 *   shim_bench asyncfree ROUNDS N BYTES  -> the same through the stream-ordered pool (a cheap
 *                                           driver path, so the shim's share shows)
 *   shim_bench launch ROUNDS N           -> ns per cuLaunchKernel
 *   shim_bench getinfo ROUNDS N          -> ns per cuMemGetInfo_v2
 *   shim_bench abfree ROUNDS N BYTES     -> allocfree, alternating by round between the calls as
 *   shim_bench abasync ROUNDS N BYTES       linked (under LD_PRELOAD: the shim's hooks) and the
 *                                           driver's own functions (libc's dlsym on its handle,
 *                                           past the shim's), in one process: the
 *                                           shim's cost without the driver's process-to-process
 *                                           noise (mmap placement, a shared machine). Prints
 *                                           "<op> hook_ns=<min> real_ns=<min> diff_ns=<median of
 *                                           per-round differences>"; without the shim both sides
 *                                           are the driver (the noise floor).
 *   shim_bench abgate ROUNDS N           -> the same alternation for a function the shim does not
 *                                           hook (cuCtxGetDevice): as linked, under LD_PRELOAD the
 *                                           shim's gate trampoline, vs the driver's own; prints
 *                                           "abgate hook_ns=.. real_ns=.. diff_ns=.." per call
 *   shim_bench start [check]             -> init, one alloc+free, exit (start-up cost); with
 *                                           `check`, also print "start counted=<bytes> nvml=<bytes>":
 *                                           what the container's usage slot of this process counts
 *                                           after the context, and NVML's figure for this process
 *   shim_bench ablaunch ROUNDS N         -> the same alternation for cuLaunchKernel of busy_us(0)
 *                                           (the compute share's pace is read on this path)
 *   shim_bench ablaunchx ROUNDS N        -> the same with a function handle the driver refuses
 *                                           at once (CUDA_ERROR_INVALID_HANDLE, no simulated
 *                                           GPU work): the hook's own cost, without the fake
 *                                           driver's microsecond of scheduling around it
 *   shim_bench start                     -> init, one alloc+free, exit (start-up cost)
 *   shim_bench burst 1 N BYTES [PAUSE_MS] -> N allocations of BYTES past the container's request
 *                                           (each a burst request to the agent's arbiter), each
 *                                           freed and followed by a pause (default 5 ms) in which
 *                                           the shim's release is served (the agent lowers a young
 *                                           grant only once it has settled: the caller passes a
 *                                           pause past that); one "burst_ns=<ns>" line per alloc
 *
 * Output: one line "<op> wall_ns=<min wall ns/op> cpu_ns=<min thread-CPU ns/op>".
 * The minimum over rounds filters out preemption on a shared machine; CPU time
 * is what contention (cache-line ping-pong on the shared counter) costs.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "memguard_abi.h" /* the usage file's layout */

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;

CUresult cuInit(unsigned int);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                        void **, void **);
CUresult cuCtxGetDevice(CUdevice *);

static uint64_t now(clockid_t c) {
    struct timespec ts;
    clock_gettime(c, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void die(const char *what, CUresult rc) {
    fprintf(stderr, "shim_bench: %s failed: %d\n", what, rc);
    exit(2);
}

typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*free_fn)(CUdeviceptr);
typedef CUresult (*aalloc_fn)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*afree_fn)(CUdeviceptr, CUstream);

/* The driver's own function, through libc's dlsym itself (reached by dlvsym,
 * as the shim reaches it): the shim's dlsym would hand out its hook. */
static void *driver_fn(const char *name) {
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17"};
    void *(*real_dlsym)(void *, const char *) = NULL;
    for (size_t i = 0; !real_dlsym && i < sizeof versions / sizeof versions[0]; i++) {
        void *p = dlvsym(RTLD_NEXT, "dlsym", versions[i]);
        memcpy(&real_dlsym, &p, sizeof p);
    }
    void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    void *p = h && real_dlsym ? real_dlsym(h, name) : NULL;
    if (!p) {
        fprintf(stderr, "shim_bench: no driver function %s\n", name);
        exit(2);
    }
    return p;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* One round of n alloc+free pairs through the given functions; ns per pair. */
static double ab_round(int async, unsigned long n, size_t bytes, alloc_fn a, free_fn f, aalloc_fn aa, afree_fn af) {
    CUdeviceptr d;
    CUresult rc;
    uint64_t t0 = now(CLOCK_MONOTONIC);
    for (unsigned long i = 0; i < n; i++) {
        if (async) {
            if ((rc = aa(&d, bytes, NULL)) != 0) die("cuMemAllocAsync", rc);
            if ((rc = af(d, NULL)) != 0) die("cuMemFreeAsync", rc);
        } else {
            if ((rc = a(&d, bytes)) != 0) die("cuMemAlloc_v2", rc);
            if ((rc = f(d)) != 0) die("cuMemFree_v2", rc);
        }
    }
    return (double)(now(CLOCK_MONOTONIC) - t0) / (double)n;
}

static int ab(const char *op, unsigned long rounds, unsigned long n, size_t bytes) {
    int async = !strcmp(op, "abasync");
    alloc_fn ra = (alloc_fn)driver_fn("cuMemAlloc_v2");
    free_fn rf = (free_fn)driver_fn("cuMemFree_v2");
    aalloc_fn raa = (aalloc_fn)driver_fn("cuMemAllocAsync");
    afree_fn raf = (afree_fn)driver_fn("cuMemFreeAsync");
    double best_hook = 1e300, best_real = 1e300, *diff = calloc(rounds ? rounds : 1, sizeof *diff);
    if (!diff) return 2;
    ab_round(async, n, bytes, cuMemAlloc_v2, cuMemFree_v2, cuMemAllocAsync, cuMemFreeAsync); /* warm both */
    ab_round(async, n, bytes, ra, rf, raa, raf);
    for (unsigned long r = 0; r < rounds; r++) {
        /* Which goes first alternates, so a drift within a pair cancels out over rounds. */
        double h, x;
        if (r & 1) {
            x = ab_round(async, n, bytes, ra, rf, raa, raf);
            h = ab_round(async, n, bytes, cuMemAlloc_v2, cuMemFree_v2, cuMemAllocAsync, cuMemFreeAsync);
        } else {
            h = ab_round(async, n, bytes, cuMemAlloc_v2, cuMemFree_v2, cuMemAllocAsync, cuMemFreeAsync);
            x = ab_round(async, n, bytes, ra, rf, raa, raf);
        }
        if (h < best_hook) best_hook = h;
        if (x < best_real) best_real = x;
        diff[r] = h - x;
    }
    qsort(diff, rounds, sizeof *diff, cmp_double);
    double med = rounds ? (rounds & 1 ? diff[rounds / 2] : (diff[rounds / 2 - 1] + diff[rounds / 2]) / 2) : 0;
    printf("%s hook_ns=%.2f real_ns=%.2f diff_ns=%.2f\n", op, best_hook, best_real, med);
    free(diff);
    return 0;
}

typedef CUresult (*ctxdev_fn)(CUdevice *);

/* One round of n calls of a function the shim does not hook; ns per call. */
static double gate_round(unsigned long n, ctxdev_fn f) {
    CUdevice d;
    CUresult rc;
    uint64_t t0 = now(CLOCK_MONOTONIC);
    for (unsigned long i = 0; i < n; i++)
        if ((rc = f(&d)) != 0) die("cuCtxGetDevice", rc);
    return (double)(now(CLOCK_MONOTONIC) - t0) / (double)n;
}

static int abgate(unsigned long rounds, unsigned long n) {
    ctxdev_fn real = (ctxdev_fn)driver_fn("cuCtxGetDevice");
    double best_hook = 1e300, best_real = 1e300, *diff = calloc(rounds ? rounds : 1, sizeof *diff);
    if (!diff) return 2;
    gate_round(n, cuCtxGetDevice); /* warm both */
    gate_round(n, real);
    for (unsigned long r = 0; r < rounds; r++) {
        double h, x;
        if (r & 1) {
            x = gate_round(n, real);
            h = gate_round(n, cuCtxGetDevice);
        } else {
            h = gate_round(n, cuCtxGetDevice);
            x = gate_round(n, real);
typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              CUstream, void **, void **);

static double launch_round(unsigned long n, launch_fn fn, CUfunction f) {
    unsigned long long us = 0; /* busy_us(0): no simulated work */
    void *params[] = {&us};
    CUresult rc;
    uint64_t t0 = now(CLOCK_MONOTONIC);
    for (unsigned long i = 0; i < n; i++)
        if ((rc = fn(f, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL)) != 0 && rc != 400 /* INVALID_HANDLE */)
            die("cuLaunchKernel", rc);
    return (double)(now(CLOCK_MONOTONIC) - t0) / (double)n;
}

static int ablaunch(unsigned long rounds, unsigned long n, CUfunction f) {
    launch_fn real = (launch_fn)driver_fn("cuLaunchKernel");
    double best_hook = 1e300, best_real = 1e300, *diff = calloc(rounds ? rounds : 1, sizeof *diff);
    if (!diff) return 2;
    launch_round(n, cuLaunchKernel, f); /* warm both */
    launch_round(n, real, f);
    for (unsigned long r = 0; r < rounds; r++) {
        double h, x;
        if (r & 1) {
            x = launch_round(n, real, f);
            h = launch_round(n, cuLaunchKernel, f);
        } else {
            h = launch_round(n, cuLaunchKernel, f);
            x = launch_round(n, real, f);
        }
        if (h < best_hook) best_hook = h;
        if (x < best_real) best_real = x;
        diff[r] = h - x;
    }
    qsort(diff, rounds, sizeof *diff, cmp_double);
    double med = rounds ? (rounds & 1 ? diff[rounds / 2] : (diff[rounds / 2 - 1] + diff[rounds / 2]) / 2) : 0;
    printf("abgate hook_ns=%.2f real_ns=%.2f diff_ns=%.2f\n", best_hook, best_real, med);
    printf("ablaunch hook_ns=%.2f real_ns=%.2f diff_ns=%.2f\n", best_hook, best_real, med);
    free(diff);
    return 0;
}

/* What the container's usage file counts for this process (its slot), or -1. */
static long long counted_here(void) {
    const char *dir = getenv("GPUFRAC_CONTAINER_DIR");
    char path[4096];
    if (!dir) return -1;
    snprintf(path, sizeof path, "%s/usage", dir);
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    static mg_usage_t u;
    size_t got = fread(&u, 1, sizeof u, f);
    fclose(f);
    if (got != sizeof u) return -1;
    for (int i = 0; i < MG_MAX_PROCS; i++)
        if (u.slots[i].pid == (int32_t)getpid()) return (long long)u.slots[i].used_bytes;
    return 0;
}

/* NVML's figure for this process on device 0 (a process in the host's pid namespace), or -1. */
static long long nvml_here(void) {
    typedef struct {
        unsigned int pid;
        unsigned long long used;
        unsigned int gi, ci;
    } info_t;
    void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!h) return -1;
    int (*init)(void) = (int (*)(void))dlsym(h, "nvmlInit_v2");
    int (*byidx)(unsigned, void **) = (int (*)(unsigned, void **))dlsym(h, "nvmlDeviceGetHandleByIndex_v2");
    int (*procs)(void *, unsigned *, info_t *) =
        (int (*)(void *, unsigned *, info_t *))dlsym(h, "nvmlDeviceGetComputeRunningProcesses_v3");
    void *dev = NULL;
    info_t v[512];
    unsigned n = 512;
    if (!init || !byidx || !procs || init() != 0 || byidx(0, &dev) != 0 || procs(dev, &n, v) != 0) return -1;
    for (unsigned i = 0; i < n; i++)
        if (v[i].pid == (unsigned)getpid()) return (long long)v[i].used;
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    const char *op = argv[1];
    unsigned long rounds = argc > 2 ? strtoul(argv[2], NULL, 0) : 1;
    unsigned long n = argc > 3 ? strtoul(argv[3], NULL, 0) : 1;
    size_t bytes = argc > 4 ? strtoull(argv[4], NULL, 0) : 4096;
    CUdevice dev;
    CUcontext ctx;
    CUresult rc = cuInit(0);
    if (!rc) rc = cuDeviceGet(&dev, 0);
    if (!rc) rc = cuDevicePrimaryCtxRetain(&ctx, dev);
    if (!rc) rc = cuCtxSetCurrent(ctx);
    if (rc) die("init", rc);
    CUdeviceptr d;
    if (!strcmp(op, "start")) {
        if (argc > 2 && !strcmp(argv[2], "check")) printf("start counted=%lld nvml=%lld\n", counted_here(), nvml_here());
        if ((rc = cuMemAlloc_v2(&d, 4096)) != 0) die("cuMemAlloc_v2", rc);
        if ((rc = cuMemFree_v2(d)) != 0) die("cuMemFree_v2", rc);
        return 0;
    }
    if (!strcmp(op, "abfree") || !strcmp(op, "abasync")) return ab(op, rounds, n, bytes);
    if (!strcmp(op, "abgate")) return abgate(rounds, n);
    if (!strcmp(op, "ablaunch") || !strcmp(op, "ablaunchx")) {
        CUmodule m;
        CUfunction f;
        if ((rc = cuModuleLoadData(&m, "SIMGPU-MODULE")) != 0) die("cuModuleLoadData", rc);
        if ((rc = cuModuleGetFunction(&f, m, "busy_us")) != 0) die("cuModuleGetFunction", rc);
        if (op[8] == 'x') f = (CUfunction)(uintptr_t)0x10; /* no live function: refused at once */
        return ablaunch(rounds, n, f);
    }
    if (!strcmp(op, "burst")) {
        unsigned long pause_ms = argc > 5 ? strtoul(argv[5], NULL, 0) : 5;
        struct timespec pause = {(time_t)(pause_ms / 1000), (long)(pause_ms % 1000) * 1000000L};
        for (unsigned long i = 0; i < n; i++) {
            uint64_t t0 = now(CLOCK_MONOTONIC);
            if ((rc = cuMemAlloc_v2(&d, bytes)) != 0) die("cuMemAlloc_v2 (burst)", rc);
            uint64_t t1 = now(CLOCK_MONOTONIC);
            if ((rc = cuMemFree_v2(d)) != 0) die("cuMemFree_v2", rc);
            printf("burst_ns=%llu\n", (unsigned long long)(t1 - t0));
            nanosleep(&pause, NULL);
        }
        return 0;
    }
    /* Decided once, outside the timed loops (a string compare per call would be
     * counted in both runs and blur the shim's share). */
    enum { ALLOCFREE, ASYNCFREE, LAUNCH, GETINFO } kind;
    if (!strcmp(op, "allocfree")) kind = ALLOCFREE;
    else if (!strcmp(op, "asyncfree")) kind = ASYNCFREE;
    else if (!strcmp(op, "launch")) kind = LAUNCH;
    else if (!strcmp(op, "getinfo")) kind = GETINFO;
    else {
        fprintf(stderr, "shim_bench: unknown op %s\n", op);
        return 2;
    }
    CUfunction f = NULL;
    unsigned long long us = 0; /* busy_us(uint64 microseconds): no simulated work */
    void *params[] = {&us};
    if (kind == LAUNCH) {
        CUmodule m;
        if ((rc = cuModuleLoadData(&m, "SIMGPU-MODULE")) != 0) die("cuModuleLoadData", rc);
        if ((rc = cuModuleGetFunction(&f, m, "busy_us")) != 0) die("cuModuleGetFunction", rc);
    }
    double best_wall = 1e300, best_cpu = 1e300;
    for (unsigned long r = 0; r < rounds; r++) {
        uint64_t w0 = now(CLOCK_MONOTONIC), c0 = now(CLOCK_THREAD_CPUTIME_ID);
        for (unsigned long i = 0; i < n; i++) {
            size_t fr, t;
            switch (kind) {
            case ALLOCFREE:
                if ((rc = cuMemAlloc_v2(&d, bytes)) != 0) die("cuMemAlloc_v2", rc);
                if ((rc = cuMemFree_v2(d)) != 0) die("cuMemFree_v2", rc);
                break;
            case ASYNCFREE:
                if ((rc = cuMemAllocAsync(&d, bytes, NULL)) != 0) die("cuMemAllocAsync", rc);
                if ((rc = cuMemFreeAsync(d, NULL)) != 0) die("cuMemFreeAsync", rc);
                break;
            case LAUNCH:
                if ((rc = cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL)) != 0) die("cuLaunchKernel", rc);
                break;
            case GETINFO:
                if ((rc = cuMemGetInfo_v2(&fr, &t)) != 0) die("cuMemGetInfo_v2", rc);
                break;
            }
        }
        double w = (double)(now(CLOCK_MONOTONIC) - w0) / (double)n;
        double c = (double)(now(CLOCK_THREAD_CPUTIME_ID) - c0) / (double)n;
        if (w < best_wall) best_wall = w;
        if (c < best_cpu) best_cpu = c;
    }
    printf("%s wall_ns=%.2f cpu_ns=%.2f\n", op, best_wall, best_cpu);
    return 0;
}
