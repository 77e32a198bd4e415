/*
 * mg_ctest: a small program linked directly against libcuda.so.1, so the
 * memguard hooks are reached the way a compiled CUDA application reaches them
 * (direct symbol binding, LD_PRELOAD first). Tests drive it with a script of
 * commands on the command line; each command prints one line:
 *     <command> <CUresult> [key=value ...]
 *
 *   alloc N | managed N | pitch W H | async N | asyncptsz N
 *   pool N | poolptsz N                     -> push a device pointer
 *   free | freeasync | freeasyncptsz -> pop and free the last pointer
 *   refree                                   -> free the last freed pointer again
 *   freeptr HEX                              -> free a pointer nobody allocated
 *   create N | release                       -> cuMemCreate / cuMemRelease
 *   vmm N | unvmm                            -> reserve+create+map+access / undo
 *   unmaponly | releasevmm                   -> the vmm mapping's cuMemUnmap / its handle's cuMemRelease
 *   retain                                   -> cuMemRetainAllocationHandle on the vmm mapping
 *                                               (the handle is pushed for `release`)
 *   mapped N | unmapall                      -> reserve+create+map+access, then release the handle
 *                                               at once (vectorAddMMAP) / unmap and free them all
 *   reserve N | unreserve                    -> cuMemAddressReserve alone / free
 *   array W H | array3d W H D | destroy      -> CUDA arrays (FLOAT, 1 channel)
 *   info | info1 | total | total1            -> memory queries
 *   launch | launchptsz | launchex | launchexptsz | coop | coopptsz
 *   graph | graphptsz                        -> launches (fake kernel "busy_us")
 *   hold                                     -> print "hold" and wait for stdin
 *   exec                                     -> exec this program with the rest of the script
 *                                               (a new image: same pid, no destructors)
 *   lstress KIND THREADS N US                -> THREADS threads each making N launches of busy_us(US)
 *                                               by KIND (launch, launchex, coop, graph); prints
 *                                               ok=<launches that succeeded> ms=<wall time>
 *   forklaunch N                             -> fork while a thread launches: the child (as a CUDA
 *                                               program must: a forked child cannot use its
 *                                               parent's CUDA) execs this program to make N
 *                                               launches; prints child=<its exit status>
 *   stress THREADS ITERS MAXBYTES SEED       -> threads allocating/freeing at random
 *   loop N BYTES                             -> N alloc+free pairs (kill target)
 *   pstress THREADS ITERS MAXBYTES SEED      -> threads allocating/freeing from two new pools
 *                                               (threshold UINT64_MAX and 0) and the default
 *                                               pool, synchronizing and trimming at random; then
 *                                               counted (usage total) vs truth (the pools'
 *                                               reserved - used), then trims and destroys them
 *   getproc NAME VER FLAGS WANT | getproc1 ... -> cuGetProcAddress_v2 / legacy: is the
 *                                               answer the export WANT, and memguard's?
 *   dlsym NAME                               -> dlsym on a libcuda handle: memguard's?
 *   global NAME                              -> dlsym(RTLD_DEFAULT) (the scope this program binds
 *                                               in): found, and memguard's?
 *   defpool | mkpool THRESHOLD               -> push the device's default pool / a new pool
 *                                               (cuMemPoolCreate) with that release threshold
 *   thresh T                                 -> set the top pool's release threshold
 *   palloc N                                 -> cuMemAllocFromPoolAsync from the top pool
 *   afree                                    -> pop and cuMemFreeAsync the last pointer, no sync
 *   trim N | rmpool                          -> cuMemPoolTrimTo / cuMemPoolDestroy (pops) the top pool
 *   poolinfo                                 -> the top pool's reserved and used bytes
 *   ssync | esync                            -> cuStreamSynchronize / cuEventSynchronize (NULL stream)
 *   used                                     -> the container's usage file: total, this
 *                                               process's bytes and launches
 *   maps                                     -> which builds this process runs: the paths of
 *                                               its executable, the shim and libcuda, and
 *                                               whether the ASan runtime is mapped
 *
 * Types from simgpu's cuda_abi.h (cuda.h's ABI); functions declared below as an
 * application would, for the calls it makes. No CUDA toolkit needed.
 *
 * One file though over 500 lines: one test program, whose commands share the
 * stacks of what it allocated.
 */
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cuda_abi.h" /* simgpu's declaration of the driver ABI */
#include "memguard_abi.h"

CUresult cuInit(unsigned int);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxSynchronize(void);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemAllocManaged(CUdeviceptr *, size_t, unsigned int);
CUresult cuMemAllocPitch_v2(CUdeviceptr *, size_t *, size_t, size_t, unsigned int);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *, size_t, CUstream);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *, CUdevice);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuMemFreeAsync_ptsz(CUdeviceptr, CUstream);
CUresult cuStreamSynchronize(CUstream);
CUresult cuEventCreate(CUevent *, unsigned int);
CUresult cuEventRecord(CUevent, CUstream);
CUresult cuEventSynchronize(CUevent);
CUresult cuMemPoolCreate(CUmemoryPool *, const CUmemPoolProps *);
CUresult cuMemPoolDestroy(CUmemoryPool);
CUresult cuMemPoolTrimTo(CUmemoryPool, size_t);
CUresult cuMemPoolSetAttribute(CUmemoryPool, int, void *);
CUresult cuMemPoolGetAttribute(CUmemoryPool, int, void *);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuMemAddressFree(CUdeviceptr, size_t);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
CUresult cuMemUnmap(CUdeviceptr, size_t);
CUresult cuMemSetAccess(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *, void *);
CUresult cuArrayCreate_v2(CUarray *, const CUDA_ARRAY_DESCRIPTOR *);
CUresult cuArray3DCreate_v2(CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *);
CUresult cuArrayDestroy(CUarray);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuMemGetInfo(unsigned int *, unsigned int *);
CUresult cuDeviceTotalMem_v2(size_t *, CUdevice);
CUresult cuDeviceTotalMem(unsigned int *, CUdevice);
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                        void **, void **);
CUresult cuLaunchKernel_ptsz(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void **, void **);
CUresult cuLaunchKernelEx(const CUlaunchConfig *, CUfunction, void **, void **);
CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *, CUfunction, void **, void **);
CUresult cuLaunchCooperativeKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                   CUstream, void **);
CUresult cuLaunchCooperativeKernel_ptsz(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                        unsigned, CUstream, void **);
CUresult cuGraphCreate(CUgraph *, unsigned int);
CUresult cuGraphAddKernelNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t,
                              const CUDA_KERNEL_NODE_PARAMS_v1 *);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *, CUgraph, unsigned long long);
CUresult cuGraphLaunch(CUgraphExec, CUstream);
CUresult cuGraphLaunch_ptsz(CUgraphExec, CUstream);
CUresult cuGetProcAddress_v2(const char *, void **, int, unsigned long long, int *);
CUresult cuGetProcAddress(const char *, void **, int, unsigned long long);

#define MAXP 4096
static CUdeviceptr ptrs[MAXP];
static int nptrs;
static CUdeviceptr last_freed;
static CUmemGenericAllocationHandle handles[MAXP];
static int nhandles;
static CUarray arrays[MAXP];
static int narrays;
static CUdevice dev;
static CUcontext ctx;
static CUdeviceptr vmm_va, reserve_va;
static size_t vmm_size, reserve_size;
static CUmemGenericAllocationHandle vmm_handle;
static CUdeviceptr mapped_va[MAXP];
static size_t mapped_size[MAXP];
static int nmapped;

static CUmemoryPool pools[MAXP];
static int npools;

static unsigned long long num(const char *s) { return strtoull(s, NULL, 0); }

static CUmemoryPool top_pool(void) { return npools ? pools[npools - 1] : NULL; }

/* CU_MEMPOOL_ATTR_RELEASE_THRESHOLD of the top pool. */
static CUresult set_threshold(unsigned long long t) {
    cuuint64_t v = t;
    return cuMemPoolSetAttribute(top_pool(), 4 /* RELEASE_THRESHOLD */, &v);
}

/* The usage file as the shim keeps it (read-only here). */
static void print_usage(void) {
    static const mg_usage_t *u;
    if (!u) {
        const char *dir = getenv("GPUFRAC_CONTAINER_DIR");
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir ? dir : MG_DEFAULT_DIR, MG_USAGE_FILE);
        int fd = open(path, O_RDONLY);
        void *p = fd < 0 ? MAP_FAILED : mmap(NULL, sizeof *u, PROT_READ, MAP_SHARED, fd, 0);
        if (fd >= 0) close(fd);
        if (p == MAP_FAILED) {
            printf("used 1\n");
            return;
        }
        u = p;
    }
    unsigned long long mine = 0, launches = 0, refusals = 0;
    for (int i = 0; i < MG_MAX_PROCS; i++) {
        if (atomic_load(&u->slots[i].pid) == (int32_t)getpid()) {
            mine = atomic_load(&u->slots[i].used_bytes);
            launches = atomic_load(&u->slots[i].launches);
            refusals = atomic_load(&u->slots[i].oom_refusals);
        }
    }
    printf("used 0 total=%llu mine=%llu launches=%llu refusals=%llu\n",
           (unsigned long long)atomic_load(&u->total_used), mine, launches, refusals);
}

/* The paths this process has mapped whose name contains each of `names`. */
static void print_maps(void) {
    static const char *const names[] = {"libmemguard", "libcuda.so", "libasan"};
    char found[3][1024] = {{0}}, exe[1024] = {0}, line[2048];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) exe[n] = 0;
    FILE *f = fopen("/proc/self/maps", "re");
    while (f && fgets(line, sizeof line, f)) {
        char *path = strchr(line, '/');
        if (!path) continue;
        path[strcspn(path, "\n")] = 0;
        for (int i = 0; i < 3; i++)
            if (!found[i][0] && strstr(path, names[i])) snprintf(found[i], sizeof found[i], "%s", path);
    }
    int rc = f ? 0 : 1;
    if (f) fclose(f);
    printf("maps %d exe=%s shim=%s cuda=%s asan=%d\n", rc, exe, found[0], found[1], found[2][0] != 0);
}

/* 1 if p lies in the memguard shim. */
static int in_shim(void *p) {
    Dl_info info;
    return p && dladdr(p, &info) && info.dli_fname && strstr(info.dli_fname, "libmemguard") != NULL;
}

/* Callers store the result first: argument evaluation order is unspecified. */
static void push(CUresult rc, CUdeviceptr p, const char *cmd) {
    if (rc == 0 && nptrs < MAXP) ptrs[nptrs++] = p;
    printf("%s %d ptr=0x%llx\n", cmd, rc, rc == 0 ? p : 0ull);
}

static CUdeviceptr pop(void) { return nptrs ? ptrs[--nptrs] : 0; }

static CUfunction kernel(void) {
    static CUfunction f;
    if (!f) {
        CUmodule m;
        /* simgpu's built-in kernels come from a module image naming them. */
        if (cuModuleLoadData(&m, "SIMGPU-MODULE") != 0 || cuModuleGetFunction(&f, m, "busy_us") != 0) {
            fprintf(stderr, "mg_ctest: cannot load the busy_us kernel\n");
            exit(3);
        }
    }
    return f;
}

/* Pinned device memory on our device, for cuMemCreate. */
static CUmemAllocationProp device_prop(void) {
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = 1;          /* CU_MEM_ALLOCATION_TYPE_PINNED */
    prop.location.type = 1; /* CU_MEM_LOCATION_TYPE_DEVICE */
    prop.location.id = dev;
    return prop;
}

static CUresult do_graph(int ptsz) {
    unsigned long long us = 1;
    void *params[] = {&us};
    CUDA_KERNEL_NODE_PARAMS_v1 p = {kernel(), 1, 1, 1, 1, 1, 1, 0, params, NULL};
    CUgraph g;
    CUgraphNode n;
    CUgraphExec e;
    CUresult rc = cuGraphCreate(&g, 0);
    if (!rc) rc = cuGraphAddKernelNode(&n, g, NULL, 0, &p);
    if (!rc) rc = cuGraphInstantiateWithFlags(&e, g, 0);
    if (!rc) rc = ptsz ? cuGraphLaunch_ptsz(e, NULL) : cuGraphLaunch(e, NULL);
    return rc;
}

/* One launch of busy_us(us) by entry point `kind`: launch, launchex, coop, graph. */
static CUresult launch_kind(const char *kind, unsigned long long us) {
    void *params[] = {&us};
    CUlaunchConfig cfg = {1, 1, 1, 1, 1, 1, 0, NULL, NULL, 0};
    if (!strcmp(kind, "launchex")) return cuLaunchKernelEx(&cfg, kernel(), params, NULL);
    if (!strcmp(kind, "coop")) return cuLaunchCooperativeKernel(kernel(), 1, 1, 1, 1, 1, 1, 0, NULL, params);
    if (!strcmp(kind, "graph")) {
        static __thread CUgraphExec e;
        if (!e) {
            CUDA_KERNEL_NODE_PARAMS_v1 p = {kernel(), 1, 1, 1, 1, 1, 1, 0, params, NULL};
            CUgraph g;
            CUgraphNode n;
            CUresult rc = cuGraphCreate(&g, 0);
            if (!rc) rc = cuGraphAddKernelNode(&n, g, NULL, 0, &p);
            if (!rc) rc = cuGraphInstantiateWithFlags(&e, g, 0);
            if (rc) return rc;
        }
        return cuGraphLaunch(e, NULL);
    }
    return cuLaunchKernel(kernel(), 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL);
}

typedef struct {
    const char *kind;
    unsigned n;
    unsigned long long us;
    unsigned long ok;
} lstress_arg_t;

static void *lstress_thread(void *p) {
    lstress_arg_t *a = p;
    cuCtxSetCurrent(ctx); /* the current context is per thread */
    for (unsigned i = 0; i < a->n; i++) a->ok += launch_kind(a->kind, a->us) == 0;
    return NULL;
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

typedef struct {
    unsigned iters, seed;
    unsigned long long maxbytes;
    unsigned long ok, oom, other;
} stress_arg_t;

static void *stress_thread(void *p) {
    stress_arg_t *a = p;
    CUdeviceptr mine[64];
    int n = 0;
    unsigned s = a->seed;
    cuCtxSetCurrent(ctx); /* the current context is per thread */
    for (unsigned i = 0; i < a->iters; i++) {
        s = s * 1103515245u + 12345u;
        if (n == 64 || (n > 0 && (s >> 16) % 2)) {
            int k = (int)((s >> 8) % (unsigned)n);
            cuMemFree_v2(mine[k]);
            mine[k] = mine[--n];
            continue;
        }
        size_t bytes = 1 + (size_t)((((unsigned long long)s << 16) ^ (s >> 3)) % a->maxbytes);
        CUdeviceptr d;
        CUresult rc = cuMemAlloc_v2(&d, bytes);
        if (rc == 0) {
            mine[n++] = d;
            a->ok++;
        } else if (rc == 2) {
            a->oom++;
        } else {
            a->other++;
        }
    }
    while (n) cuMemFree_v2(mine[--n]);
    return NULL;
}

typedef struct {
    unsigned iters, seed;
    unsigned long long maxbytes;
    CUmemoryPool pools[3];
    unsigned long ok, oom, other;
} pstress_arg_t;

static void *pstress_thread(void *p) {
    pstress_arg_t *a = p;
    CUdeviceptr mine[32];
    int n = 0;
    unsigned s = a->seed;
    unsigned long long gran = 2ull << 20, units = a->maxbytes / gran ? a->maxbytes / gran : 1;
    cuCtxSetCurrent(ctx);
    for (unsigned i = 0; i < a->iters; i++) {
        s = s * 1103515245u + 12345u;
        unsigned r = s >> 8;
        CUresult rc = 0;
        if (r % 16 == 0) rc = cuStreamSynchronize(NULL);
        else if (r % 32 == 1) rc = cuCtxSynchronize();
        else if (r % 64 == 2) rc = cuMemPoolTrimTo(a->pools[r % 2], 0);
        if (rc) a->other++;
        if (n == 32 || (n > 0 && (r >> 6) % 2)) {
            int k = (int)((r >> 7) % (unsigned)n);
            rc = (r >> 12) % 4 ? cuMemFreeAsync(mine[k], NULL) : cuMemFree_v2(mine[k]);
            if (rc) a->other++;
            mine[k] = mine[--n];
            continue;
        }
        size_t bytes = (size_t)(gran * (1 + (r >> 9) % units)); /* whole granules: no rounding slop */
        CUdeviceptr d;
        unsigned which = (r >> 13) % 3;
        rc = which == 2 ? cuMemAllocAsync(&d, bytes, NULL) : cuMemAllocFromPoolAsync(&d, bytes, a->pools[which], NULL);
        if (rc == 0) {
            mine[n++] = d;
            a->ok++;
        } else if (rc == 2) {
            a->oom++;
        } else {
            a->other++;
        }
    }
    while (n) cuMemFreeAsync(mine[--n], NULL);
    return NULL;
}

static unsigned long long usage_total(void) {
    const char *dir = getenv("GPUFRAC_CONTAINER_DIR");
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir ? dir : MG_DEFAULT_DIR, MG_USAGE_FILE);
    int fd = open(path, O_RDONLY);
    void *p = fd < 0 ? MAP_FAILED : mmap(NULL, sizeof(mg_usage_t), PROT_READ, MAP_SHARED, fd, 0);
    if (fd >= 0) close(fd);
    if (p == MAP_FAILED) return ~0ull;
    unsigned long long t = atomic_load(&((mg_usage_t *)p)->total_used);
    munmap(p, sizeof(mg_usage_t));
    return t;
}

static void pstress(unsigned nt, unsigned iters, unsigned long long maxbytes, unsigned seed) {
    pstress_arg_t args[64];
    pthread_t th[64];
    CUmemoryPool created[2] = {NULL, NULL}, def = NULL;
    CUmemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = 1, props.location.type = 1, props.location.id = dev;
    CUresult rc = cuMemPoolCreate(&created[0], &props);
    if (!rc) rc = cuMemPoolCreate(&created[1], &props);
    if (!rc) rc = cuDeviceGetDefaultMemPool(&def, dev);
    cuuint64_t keep = ~0ull;
    if (!rc) rc = cuMemPoolSetAttribute(created[0], 4, &keep);
    if (rc) {
        printf("pstress %d\n", rc);
        return;
    }
    if (nt < 1) nt = 1;
    if (nt > 64) nt = 64;
    for (unsigned t = 0; t < nt; t++) {
        args[t] = (pstress_arg_t){iters, seed * 977u + t, maxbytes, {created[0], created[1], def}, 0, 0, 0};
        pthread_create(&th[t], NULL, pstress_thread, &args[t]);
    }
    unsigned long ok = 0, oom = 0, other = 0;
    for (unsigned t = 0; t < nt; t++) {
        pthread_join(th[t], NULL);
        ok += args[t].ok, oom += args[t].oom, other += args[t].other;
    }
    CUmemoryPool all[3] = {created[0], created[1], def};
    unsigned long long truth = 0;
    for (int k = 0; k < 3; k++) {
        cuuint64_t reserved = 0, inuse = 0;
        if (cuMemPoolGetAttribute(all[k], 5, &reserved) || cuMemPoolGetAttribute(all[k], 7, &inuse)) other++;
        truth += reserved - inuse;
    }
    unsigned long long counted = usage_total();
    for (int k = 0; k < 3; k++)
        if (cuMemPoolTrimTo(all[k], 0)) other++;
    if (cuCtxSynchronize() || cuMemPoolDestroy(created[0]) || cuMemPoolDestroy(created[1])) other++;
    printf("pstress 0 ok=%lu oom=%lu other=%lu counted=%llu truth=%llu\n", ok, oom, other, counted, truth);
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    CUresult rc = cuInit(0);
    if (!rc) rc = cuDeviceGet(&dev, 0);
    if (!rc) rc = cuDevicePrimaryCtxRetain(&ctx, dev);
    if (!rc) rc = cuCtxSetCurrent(ctx);
    printf("init %d\n", rc);
    if (rc) return 2;
    for (int i = 1; i < argc; i++) {
        const char *c = argv[i];
        const char *a1 = i + 1 < argc ? argv[i + 1] : "0";
        const char *a2 = i + 2 < argc ? argv[i + 2] : "0";
        const char *a3 = i + 3 < argc ? argv[i + 3] : "0";
        const char *a4 = i + 4 < argc ? argv[i + 4] : "0";
        CUdeviceptr d = 0;
        if (!strcmp(c, "alloc")) {
            rc = cuMemAlloc_v2(&d, num(a1));
            push(rc, d, c), i++;
        } else if (!strcmp(c, "managed")) {
            rc = cuMemAllocManaged(&d, num(a1), 1);
            push(rc, d, c), i++;
        } else if (!strcmp(c, "pitch")) {
            size_t pitch = 0;
            rc = cuMemAllocPitch_v2(&d, &pitch, num(a1), num(a2), 4);
            if (rc == 0 && nptrs < MAXP) ptrs[nptrs++] = d;
            printf("pitch %d ptr=0x%llx pitch=%zu\n", rc, d, pitch);
            i += 2;
        } else if (!strcmp(c, "async") || !strcmp(c, "asyncptsz")) {
            rc = c[5] ? cuMemAllocAsync_ptsz(&d, num(a1), NULL) : cuMemAllocAsync(&d, num(a1), NULL);
            push(rc, d, c), i++;
        } else if (!strcmp(c, "pool") || !strcmp(c, "poolptsz")) {
            CUmemoryPool pool;
            rc = cuDeviceGetDefaultMemPool(&pool, dev);
            if (!rc)
                rc = c[4] ? cuMemAllocFromPoolAsync_ptsz(&d, num(a1), pool, NULL)
                          : cuMemAllocFromPoolAsync(&d, num(a1), pool, NULL);
            push(rc, d, c), i++;
        } else if (!strcmp(c, "defpool")) {
            CUmemoryPool pool = NULL;
            rc = cuDeviceGetDefaultMemPool(&pool, dev);
            if (rc == 0 && npools < MAXP) pools[npools++] = pool;
            printf("defpool %d\n", rc);
        } else if (!strcmp(c, "mkpool")) {
            CUmemPoolProps props;
            CUmemoryPool pool = NULL;
            memset(&props, 0, sizeof props);
            props.allocType = 1;     /* CU_MEM_ALLOCATION_TYPE_PINNED */
            props.location.type = 1; /* CU_MEM_LOCATION_TYPE_DEVICE */
            props.location.id = dev;
            rc = cuMemPoolCreate(&pool, &props);
            if (rc == 0 && npools < MAXP) pools[npools++] = pool;
            if (rc == 0) rc = set_threshold(num(a1));
            printf("mkpool %d\n", rc), i++;
        } else if (!strcmp(c, "thresh")) {
            printf("thresh %d\n", set_threshold(num(a1))), i++;
        } else if (!strcmp(c, "palloc")) {
            rc = cuMemAllocFromPoolAsync(&d, num(a1), top_pool(), NULL);
            push(rc, d, c), i++;
        } else if (!strcmp(c, "afree")) {
            last_freed = pop();
            printf("afree %d\n", cuMemFreeAsync(last_freed, NULL));
        } else if (!strcmp(c, "trim")) {
            printf("trim %d\n", cuMemPoolTrimTo(top_pool(), num(a1))), i++;
        } else if (!strcmp(c, "rmpool")) {
            rc = cuMemPoolDestroy(top_pool());
            if (rc == 0) npools--;
            printf("rmpool %d\n", rc);
        } else if (!strcmp(c, "poolinfo")) {
            cuuint64_t reserved = 0, inuse = 0;
            rc = cuMemPoolGetAttribute(top_pool(), 5 /* RESERVED_MEM_CURRENT */, &reserved);
            if (rc == 0) rc = cuMemPoolGetAttribute(top_pool(), 7 /* USED_MEM_CURRENT */, &inuse);
            printf("poolinfo %d reserved=%llu used=%llu\n", rc, (unsigned long long)reserved,
                   (unsigned long long)inuse);
        } else if (!strcmp(c, "ssync")) {
            printf("ssync %d\n", cuStreamSynchronize(NULL));
        } else if (!strcmp(c, "esync")) {
            CUevent ev = NULL;
            rc = cuEventCreate(&ev, 0);
            if (rc == 0) rc = cuEventRecord(ev, NULL);
            if (rc == 0) rc = cuEventSynchronize(ev);
            printf("esync %d\n", rc);
        } else if (!strcmp(c, "free")) {
            last_freed = pop();
            printf("free %d\n", cuMemFree_v2(last_freed));
        } else if (!strcmp(c, "freeasync") || !strcmp(c, "freeasyncptsz")) {
            last_freed = pop();
            rc = c[9] ? cuMemFreeAsync_ptsz(last_freed, NULL) : cuMemFreeAsync(last_freed, NULL);
            if (!rc) rc = cuStreamSynchronize(NULL);
            printf("%s %d\n", c, rc);
        } else if (!strcmp(c, "refree")) {
            printf("refree %d\n", cuMemFree_v2(last_freed));
        } else if (!strcmp(c, "freeptr")) {
            printf("freeptr %d\n", cuMemFree_v2(num(a1))), i++;
        } else if (!strcmp(c, "create")) {
            CUmemAllocationProp prop = device_prop();
            CUmemGenericAllocationHandle h = 0;
            rc = cuMemCreate(&h, num(a1), &prop, 0);
            if (rc == 0 && nhandles < MAXP) handles[nhandles++] = h;
            printf("create %d\n", rc), i++;
        } else if (!strcmp(c, "release")) {
            printf("release %d\n", cuMemRelease(nhandles ? handles[--nhandles] : 0));
        } else if (!strcmp(c, "reserve")) {
            reserve_size = num(a1);
            printf("reserve %d\n", cuMemAddressReserve(&reserve_va, reserve_size, 0, 0, 0)), i++;
        } else if (!strcmp(c, "unreserve")) {
            printf("unreserve %d\n", cuMemAddressFree(reserve_va, reserve_size));
        } else if (!strcmp(c, "vmm")) {
            CUmemAllocationProp prop = device_prop();
            CUmemAccessDesc acc = {{1, dev}, 3};
            vmm_size = num(a1);
            rc = cuMemAddressReserve(&vmm_va, vmm_size, 0, 0, 0);
            printf("vmm.reserve %d\n", rc);
            if (!rc) rc = cuMemCreate(&vmm_handle, vmm_size, &prop, 0);
            printf("vmm.create %d\n", rc);
            if (!rc) rc = cuMemMap(vmm_va, vmm_size, 0, vmm_handle, 0);
            if (!rc) rc = cuMemSetAccess(vmm_va, vmm_size, &acc, 1);
            printf("vmm %d\n", rc), i++;
        } else if (!strcmp(c, "unvmm")) {
            rc = cuMemUnmap(vmm_va, vmm_size);
            if (!rc) rc = cuMemRelease(vmm_handle);
            printf("unvmm.release %d\n", rc);
            if (!rc) rc = cuMemAddressFree(vmm_va, vmm_size);
            printf("unvmm %d\n", rc);
        } else if (!strcmp(c, "unmaponly")) {
            printf("unmaponly %d\n", cuMemUnmap(vmm_va, vmm_size));
        } else if (!strcmp(c, "releasevmm")) {
            printf("releasevmm %d\n", cuMemRelease(vmm_handle));
        } else if (!strcmp(c, "retain")) {
            CUmemGenericAllocationHandle h = 0;
            rc = cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)vmm_va);
            if (rc == 0 && nhandles < MAXP) handles[nhandles++] = h;
            printf("retain %d same=%d\n", rc, h == vmm_handle);
        } else if (!strcmp(c, "mapped")) {
            CUmemAllocationProp prop = device_prop();
            CUmemAccessDesc acc = {{1, dev}, 3};
            CUmemGenericAllocationHandle h = 0;
            CUdeviceptr va = 0;
            size_t n = num(a1);
            rc = cuMemAddressReserve(&va, n, 0, 0, 0);
            CUresult create = rc ? rc : cuMemCreate(&h, n, &prop, 0);
            if (!rc) rc = create;
            if (!rc) rc = cuMemMap(va, n, 0, h, 0);
            if (!rc) rc = cuMemSetAccess(va, n, &acc, 1);
            if (!create) {
                CUresult r2 = cuMemRelease(h); /* the mapping keeps the memory */
                if (!rc) rc = r2;
            }
            if (!rc && nmapped < MAXP) {
                mapped_va[nmapped] = va;
                mapped_size[nmapped++] = n;
            } else if (va) {
                cuMemAddressFree(va, n);
            }
            printf("mapped %d\n", rc), i++;
        } else if (!strcmp(c, "unmapall")) {
            rc = 0;
            while (nmapped) {
                nmapped--;
                CUresult r = cuMemUnmap(mapped_va[nmapped], mapped_size[nmapped]);
                if (!r) r = cuMemAddressFree(mapped_va[nmapped], mapped_size[nmapped]);
                if (!rc) rc = r;
            }
            printf("unmapall %d\n", rc);
        } else if (!strcmp(c, "array") || !strcmp(c, "array3d")) {
            CUarray arr = NULL;
            if (c[5]) {
                CUDA_ARRAY3D_DESCRIPTOR desc = {num(a1), num(a2), num(a3), 0x20, 1, 0};
                rc = cuArray3DCreate_v2(&arr, &desc);
                i += 3;
            } else {
                CUDA_ARRAY_DESCRIPTOR desc = {num(a1), num(a2), 0x20, 1};
                rc = cuArrayCreate_v2(&arr, &desc);
                i += 2;
            }
            if (rc == 0 && narrays < MAXP) arrays[narrays++] = arr;
            printf("%s %d\n", c, rc);
        } else if (!strcmp(c, "destroy")) {
            printf("destroy %d\n", cuArrayDestroy(narrays ? arrays[--narrays] : NULL));
        } else if (!strcmp(c, "info")) {
            size_t f = 0, t = 0;
            rc = cuMemGetInfo_v2(&f, &t);
            printf("info %d free=%zu total=%zu\n", rc, f, t);
        } else if (!strcmp(c, "info1")) {
            unsigned f = 0, t = 0;
            rc = cuMemGetInfo(&f, &t);
            printf("info1 %d free=%u total=%u\n", rc, f, t);
        } else if (!strcmp(c, "total")) {
            size_t t = 0;
            rc = cuDeviceTotalMem_v2(&t, dev);
            printf("total %d total=%zu\n", rc, t);
        } else if (!strcmp(c, "total1")) {
            unsigned t = 0;
            rc = cuDeviceTotalMem(&t, dev);
            printf("total1 %d total=%u\n", rc, t);
        } else if (!strncmp(c, "launch", 6) || !strncmp(c, "coop", 4)) {
            unsigned long long us = 1; /* busy_us(uint64 microseconds) */
            void *params[] = {&us};
            CUlaunchConfig cfg = {1, 1, 1, 1, 1, 1, 0, NULL, NULL, 0};
            if (!strcmp(c, "launch"))
                rc = cuLaunchKernel(kernel(), 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL);
            else if (!strcmp(c, "launchptsz"))
                rc = cuLaunchKernel_ptsz(kernel(), 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL);
            else if (!strcmp(c, "launchex"))
                rc = cuLaunchKernelEx(&cfg, kernel(), params, NULL);
            else if (!strcmp(c, "launchexptsz"))
                rc = cuLaunchKernelEx_ptsz(&cfg, kernel(), params, NULL);
            else if (!strcmp(c, "coop"))
                rc = cuLaunchCooperativeKernel(kernel(), 1, 1, 1, 1, 1, 1, 0, NULL, params);
            else
                rc = cuLaunchCooperativeKernel_ptsz(kernel(), 1, 1, 1, 1, 1, 1, 0, NULL, params);
            printf("%s %d\n", c, rc);
        } else if (!strcmp(c, "graph") || !strcmp(c, "graphptsz")) {
            printf("%s %d\n", c, do_graph(c[5] != 0));
        } else if (!strcmp(c, "getproc") || !strcmp(c, "getproc1")) {
            void *p = NULL;
            int status = -1;
            rc = c[7] ? cuGetProcAddress(a1, &p, (int)num(a2), num(a3))
                      : cuGetProcAddress_v2(a1, &p, (int)num(a2), num(a3), &status);
            void *want = dlsym(RTLD_DEFAULT, a4);
            printf("%s %d match=%d shim=%d\n", c, rc, p != NULL && p == want, in_shim(p));
            i += 4;
        } else if (!strcmp(c, "dlsym")) {
            void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
            void *p = h ? dlsym(h, a1) : NULL;
            printf("dlsym %d found=%d shim=%d\n", h ? 0 : 1, p != NULL, in_shim(p));
            i++;
        } else if (!strcmp(c, "global")) {
            void *p = dlsym(RTLD_DEFAULT, a1);
            printf("global 0 found=%d shim=%d\n", p != NULL, in_shim(p));
            i++;
        } else if (!strcmp(c, "exec")) {
            /* The rest of the script runs in a new image of this same process
             * (same pid and start time; exec runs no destructor). */
            char **rest = &argv[i];
            rest[0] = argv[0];
            printf("exec 0\n");
            execv("/proc/self/exe", rest);
            printf("exec 1\n");
            return 2;
        } else if (!strcmp(c, "used")) {
            print_usage();
        } else if (!strcmp(c, "maps")) {
            print_maps();
        } else if (!strcmp(c, "sync")) {
            printf("sync %d\n", cuCtxSynchronize());
        } else if (!strcmp(c, "hold")) {
            char line[16];
            printf("hold 0\n");
            if (!fgets(line, sizeof line, stdin)) line[0] = 0;
        } else if (!strcmp(c, "loop")) {
            unsigned long n = num(a1), ok = 0;
            for (unsigned long k = 0; k < n; k++)
                if (cuMemAlloc_v2(&d, num(a2)) == 0 && cuMemFree_v2(d) == 0) ok++;
            printf("loop 0 ok=%lu\n", ok);
            i += 2;
        } else if (!strcmp(c, "pstress")) {
            pstress((unsigned)num(a1), (unsigned)num(a2), num(a3), (unsigned)num(a4));
            i += 4;
        } else if (!strcmp(c, "lstress")) {
            unsigned nt = (unsigned)num(a2);
            if (nt < 1) nt = 1;
            if (nt > 64) nt = 64;
            pthread_t th[64];
            lstress_arg_t args[64];
            double t0 = now_ms();
            unsigned long ok = 0;
            for (unsigned t = 0; t < nt; t++) {
                args[t] = (lstress_arg_t){a1, (unsigned)num(a3), num(a4), 0};
                pthread_create(&th[t], NULL, lstress_thread, &args[t]);
            }
            for (unsigned t = 0; t < nt; t++) {
                pthread_join(th[t], NULL);
                ok += args[t].ok;
            }
            printf("lstress 0 ok=%lu ms=%.3f\n", ok, now_ms() - t0);
            fflush(stdout);
            i += 4;
        } else if (!strcmp(c, "forklaunch")) {
            /* A thread keeps launching (paced) while the main thread forks: the child inherits
             * nothing held, and its new image launches through the same hooks and clock. */
            lstress_arg_t bg = {"launch", 4, 1, 0};
            pthread_t th;
            pthread_create(&th, NULL, lstress_thread, &bg);
            fflush(stdout);
            pid_t pid = fork();
            if (pid == 0) {
                char *args[] = {argv[0], "lstress", "launch", "1", (char *)a1, "1", NULL};
                execv("/proc/self/exe", args);
                _exit(127);
            }
            int status = -1;
            if (pid > 0) waitpid(pid, &status, 0);
            pthread_join(th, NULL);
            printf("forklaunch %d child=%d\n", pid > 0 ? 0 : 1,
                   pid > 0 && WIFEXITED(status) ? WEXITSTATUS(status) : -1);
            fflush(stdout);
            i += 1;
        } else if (!strcmp(c, "stress")) {
            unsigned nt = (unsigned)num(a1);
            if (nt < 1) nt = 1;
            if (nt > 64) nt = 64;
            pthread_t th[64];
            stress_arg_t args[64];
            unsigned long ok = 0, oom = 0, other = 0;
            for (unsigned t = 0; t < nt; t++) {
                args[t] = (stress_arg_t){(unsigned)num(a2), (unsigned)num(a4) * 977u + t, num(a3), 0, 0, 0};
                if (args[t].maxbytes == 0) args[t].maxbytes = 1;
                pthread_create(&th[t], NULL, stress_thread, &args[t]);
            }
            for (unsigned t = 0; t < nt; t++) {
                pthread_join(th[t], NULL);
                ok += args[t].ok, oom += args[t].oom, other += args[t].other;
            }
            printf("stress 0 ok=%lu oom=%lu other=%lu\n", ok, oom, other);
            i += 4;
        } else {
            fprintf(stderr, "mg_ctest: unknown command %s\n", c);
            return 2;
        }
    }
    return 0;
}
