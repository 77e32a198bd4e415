/*
 * simgpu fake libcuda.so.1 — executable graphs: instantiate, upload, launch and
 * destroy, and the device graph memory pool (cuDevice{Get,Set}GraphMemAttribute,
 * cuDeviceGraphMemTrim). cuda_graph.c says how graph memory behaves.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "cuda_graph.h"

typedef struct {
    int kernel;
    uint64_t blocks;
    unsigned char buf[KERN_MAX_PARAM_BYTES];
} exec_kernel_t;

struct CUgraphExec_st {
    cu_obj_t hdr;
    size_t n;
    exec_kernel_t *k;
    gmem_t **mem; /* its alloc nodes' ranges */
    size_t nmem;
    uint64_t need; /* bytes of graph memory it holds while mapped */
    int dev;
    int mapped;
    uint64_t done_ctx; /* context time its last launch's work completes at (under cu_graph_lock) */
    struct CUctx_st *ran_in; /* the context of its last launch (NULL: never launched) */
    struct CUgraph_st *graph;
};

/* Per device (ordinal): the process's graph memory pool (CUgraphMem_attribute). */
typedef struct {
    uint64_t used, used_high, reserved, reserved_high;
} gpool_t;
static gpool_t g_gpool[SIMGPU_MAX_GPUS];

static CUresult instantiate(CUgraphExec *phGraphExec, CUgraph hGraph) {
    if (!phGraphExec) return CUDA_ERROR_INVALID_VALUE;
    if (!cu_obj_ok(hGraph, OBJ_GRAPH)) return CUDA_ERROR_INVALID_VALUE;
    struct CUgraphExec_st *e = calloc(1, sizeof *e);
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&cu_graph_lock);
    size_t nk = 0, nm = 0;
    for (size_t i = 0; i < hGraph->n; i++) {
        nk += hGraph->nodes[i]->type == CU_GRAPH_NODE_TYPE_KERNEL;
        nm += hGraph->nodes[i]->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC;
    }
    /* A graph with memory nodes has one executable graph at a time (its addresses are fixed). */
    if (nm && hGraph->mem_execs) r = CUDA_ERROR_NOT_SUPPORTED;
    if (e && !r && ((nk && !(e->k = calloc(nk, sizeof *e->k))) || (nm && !(e->mem = calloc(nm, sizeof *e->mem))))) {
        free(e->k);
        free(e);
        e = NULL;
    }
    if (e && !r) {
        for (size_t i = 0; i < hGraph->n; i++) {
            struct CUgraphNode_st *nd = hGraph->nodes[i];
            if (nd->type == CU_GRAPH_NODE_TYPE_KERNEL) {
                e->k[e->n].kernel = nd->kernel;
                e->k[e->n].blocks = nd->blocks;
                memcpy(e->k[e->n++].buf, nd->buf, KERN_MAX_PARAM_BYTES);
            } else if (nd->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC) {
                nd->mem->refs++;
                e->mem[e->nmem++] = nd->mem;
                e->need += nd->mem->size;
                e->dev = nd->dev;
            }
        }
        if (nm) hGraph->mem_execs++, e->graph = hGraph;
    }
    pthread_mutex_unlock(&cu_graph_lock);
    if (r) {
        free(e);
        return r;
    }
    if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
    cu_obj_add(e, OBJ_GRAPH_EXEC, NULL);
    *phGraphExec = e;
    return CUDA_SUCCESS;
}

/* Give the executable graph its memory from the device's graph pool (caller holds
 * cu_graph_lock): idle pool memory first, the rest charged to the GPU. */
static CUresult exec_map(struct CUgraphExec_st *e) {
    if (e->mapped || !e->nmem) return CUDA_SUCCESS;
    struct CUctx_st *c = cu_current_ctx();
    uint32_t gpu = cu_g_devs[e->dev];
    gpool_t *p = &g_gpool[e->dev];
    uint64_t idle = p->reserved - p->used;
    if (e->need > idle) {
        if (cu_charge(gpu, e->need - idle)) return CUDA_ERROR_OUT_OF_MEMORY;
        p->reserved += e->need - idle;
        if (p->reserved > p->reserved_high) p->reserved_high = p->reserved;
    }
    p->used += e->need;
    if (p->used > p->used_high) p->used_high = p->used;
    for (size_t i = 0; i < e->nmem; i++) {
        gmem_t *m = e->mem[i];
        mprotect((void *)m->base, m->size, PROT_READ | PROT_WRITE);
        cu_alloc_t a = {.base = m->base, .size = m->size, .gpu = gpu, .kind = MEM_GRAPH, .ctx = c};
        cu_reg_insert(&a);
    }
    e->mapped = 1;
    return CUDA_SUCCESS;
}

static void exec_unmap(struct CUgraphExec_st *e) {
    if (!e->mapped) return;
    for (size_t i = 0; i < e->nmem; i++) {
        cu_reg_remove(e->mem[i]->base, NULL);
        mprotect((void *)e->mem[i]->base, e->mem[i]->size, PROT_NONE);
    }
    gpool_t *p = &g_gpool[e->dev];
    p->used = p->used >= e->need ? p->used - e->need : 0; /* stays reserved in the pool until a trim */
    e->mapped = 0;
}

CU_API CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags) {
    CU_ENTER();
    if (flags & ~0xfull) return CUDA_ERROR_INVALID_VALUE;
    return instantiate(phGraphExec, hGraph);
}

CU_API CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                      char *logBuffer, size_t bufferSize) {
    CU_ENTER();
    if (phErrorNode) *phErrorNode = NULL;
    if (logBuffer && bufferSize) logBuffer[0] = 0;
    return instantiate(phGraphExec, hGraph);
}

CU_API CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                   char *logBuffer, size_t bufferSize) {
    return cuGraphInstantiate_v2(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize);
}

CU_API CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream) {
    CU_ENTER();
    struct CUctx_st *c;
    struct CUstream_st *s;
    if (!cu_obj_ok(hGraphExec, OBJ_GRAPH_EXEC)) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = cu_stream_get(hStream, &c, &s);
    if (r) return r;
    if (s->capture) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    if (c->sticky) return c->sticky;
    pthread_mutex_lock(&cu_graph_lock);
    r = exec_map(hGraphExec);
    pthread_mutex_unlock(&cu_graph_lock);
    if (r) return r; /* its memory does not fit: nothing runs */
    /* Its kernel nodes in order, on the stream (each a launch); a graph's own dependencies
     * are not simulated, so they run one after another. */
    for (size_t i = 0; i < hGraphExec->n; i++)
        cu_kernel_exec(c, s, hGraphExec->k[i].kernel, hGraphExec->k[i].blocks, hGraphExec->k[i].buf);
    pthread_mutex_lock(&cu_graph_lock);
    hGraphExec->done_ctx = atomic_load(&s->done_ctx);
    hGraphExec->ran_in = c;
    pthread_mutex_unlock(&cu_graph_lock);
    return CUDA_SUCCESS;
}

/* Upload: the executable graph takes its memory now, so a launch cannot fail for it. */
CU_API CUresult cuGraphUpload(CUgraphExec hGraphExec, CUstream hStream) {
    CU_ENTER();
    struct CUctx_st *c;
    struct CUstream_st *s;
    if (!cu_obj_ok(hGraphExec, OBJ_GRAPH_EXEC)) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = cu_stream_get(hStream, &c, &s);
    if (r) return r;
    pthread_mutex_lock(&cu_graph_lock);
    r = exec_map(hGraphExec);
    pthread_mutex_unlock(&cu_graph_lock);
    return r;
}

/* CUgraphMem_attribute: USED_MEM_CURRENT 0, USED_MEM_HIGH 1, RESERVED_MEM_CURRENT 2,
 * RESERVED_MEM_HIGH 3 (cuuint64_t); the watermarks may only be reset (set to 0). */
CU_API CUresult cuDeviceGetGraphMemAttribute(CUdevice device, int attr, void *value) {
    CU_ENTER();
    CUresult r = cu_check_dev(device);
    if (r) return r;
    if (!value || attr < 0 || attr > 3) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&cu_graph_lock);
    gpool_t *p = &g_gpool[device];
    const uint64_t v[4] = {p->used, p->used_high, p->reserved, p->reserved_high};
    *(cuuint64_t *)value = v[attr];
    pthread_mutex_unlock(&cu_graph_lock);
    return CUDA_SUCCESS;
}

CU_API CUresult cuDeviceSetGraphMemAttribute(CUdevice device, int attr, void *value) {
    CU_ENTER();
    CUresult r = cu_check_dev(device);
    if (r) return r;
    if (!value || (attr != 1 && attr != 3) || *(cuuint64_t *)value != 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&cu_graph_lock);
    gpool_t *p = &g_gpool[device];
    if (attr == 1) p->used_high = p->used;
    else p->reserved_high = p->reserved;
    pthread_mutex_unlock(&cu_graph_lock);
    return CUDA_SUCCESS;
}

/* Give the pool's memory that no graph running or queued uses back to the GPU:
 * idle executable graphs lose theirs (taken again at their next upload or launch). */
CU_API CUresult cuDeviceGraphMemTrim(CUdevice device) {
    CU_ENTER();
    CUresult r = cu_check_dev(device);
    if (r) return r;
    void *execs[256];
    size_t n = cu_obj_owned(OBJ_GRAPH_EXEC, NULL, execs, 256);
    pthread_mutex_lock(&cu_graph_lock);
    for (size_t i = 0; i < n; i++) {
        struct CUgraphExec_st *e = execs[i];
        if (cu_obj_ok(e, OBJ_GRAPH_EXEC) && e->dev == device && e->mapped &&
            (!e->ran_in || !cu_obj_ok(e->ran_in, OBJ_CTX) || cu_ctx_reached(e->ran_in, e->done_ctx)))
            exec_unmap(e);
    }
    gpool_t *p = &g_gpool[device];
    if (p->reserved > p->used) {
        cu_uncharge(cu_g_devs[device], p->reserved - p->used);
        p->reserved = p->used;
    }
    pthread_mutex_unlock(&cu_graph_lock);
    return CUDA_SUCCESS;
}

CU_API CUresult cuGraphExecDestroy(CUgraphExec hGraphExec) {
    CU_ENTER();
    if (!cu_obj_del(hGraphExec, OBJ_GRAPH_EXEC)) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&cu_graph_lock);
    exec_unmap(hGraphExec);
    if (hGraphExec->graph && cu_obj_ok(hGraphExec->graph, OBJ_GRAPH)) hGraphExec->graph->mem_execs--;
    for (size_t i = 0; i < hGraphExec->nmem; i++) cu_gmem_unref(hGraphExec->mem[i]);
    pthread_mutex_unlock(&cu_graph_lock);
    free(hGraphExec->mem);
    free(hGraphExec->k);
    free(hGraphExec);
    return CUDA_SUCCESS;
}

/* Per-thread default stream twins (see CU_TWIN). */
CU_TWIN(cuGraphLaunch_ptsz, cuGraphLaunch, (CUgraphExec e, CUstream h), (e, h))
CU_TWIN(cuGraphUpload_ptsz, cuGraphUpload, (CUgraphExec e, CUstream h), (e, h))

const cu_sym_t cu_syms_graph_exec[] = {
    CU_SYM("cuGraphUpload", 11010, cuGraphUpload),
    CU_SYM_PT("cuGraphUpload", 11010, cuGraphUpload_ptsz),
    CU_SYM("cuDeviceGetGraphMemAttribute", 11040, cuDeviceGetGraphMemAttribute),
    CU_SYM("cuDeviceSetGraphMemAttribute", 11040, cuDeviceSetGraphMemAttribute),
    CU_SYM("cuDeviceGraphMemTrim", 11040, cuDeviceGraphMemTrim),
    CU_SYM("cuGraphInstantiate", 10000, cuGraphInstantiate),
    CU_SYM("cuGraphInstantiate", 11000, cuGraphInstantiate_v2),
    CU_SYM("cuGraphInstantiate", 11040, cuGraphInstantiateWithFlags),
    CU_SYM("cuGraphInstantiateWithFlags", 11040, cuGraphInstantiateWithFlags),
    CU_SYM("cuGraphLaunch", 10000, cuGraphLaunch),
    CU_SYM_PT("cuGraphLaunch", 10000, cuGraphLaunch_ptsz),
    CU_SYM("cuGraphExecDestroy", 10000, cuGraphExecDestroy),
};
const size_t cu_syms_graph_exec_n = sizeof cu_syms_graph_exec / sizeof cu_syms_graph_exec[0];
