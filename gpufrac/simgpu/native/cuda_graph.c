/*
 * simgpu fake libcuda.so.1 — CUDA graphs: capture or build a graph of fake-kernel
 * launches and memory nodes, instantiate it and replay it with cuGraphLaunch.
 *
 * Graphs hold kernel nodes and memory nodes (alloc / free). Memcpy/memset nodes
 * are not simulated: those operations return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
 * while capturing. Nodes run in insertion order, which is a valid order for any
 * dependencies, since a node's dependencies must exist before it is added. Each
 * kernel node of a launched graph counts as a launch in the node state.
 *
 * Graph memory, as on a real GPU: an alloc node (cuGraphAddMemAllocNode,
 * cuGraphAddNode, or cuMemAllocAsync while capturing) fixes a virtual address
 * when it is added; physical memory comes from the device's graph memory pool
 * when an executable graph is first uploaded or launched, and stays with that
 * executable graph until it is destroyed or a cuDeviceGraphMemTrim finds it idle
 * (neither running nor queued: its memory goes back, and its next upload or
 * launch takes it again). The pool grows (charged to the GPU, so NVML counts it)
 * when it has too little idle memory, and keeps what it holds after graphs go
 * until cuDeviceGraphMemTrim. A launch whose memory does not fit
 * fails with CUDA_ERROR_OUT_OF_MEMORY and runs nothing. Simplifications: every
 * alloc node of a graph has memory of its own (no reuse between an allocation
 * freed inside the graph and a later one), and freeing graph memory outside the
 * graph (cuMemFreeAsync, cuMemFree) leaves it with its executable graph.
 *
 * One file (~600 lines) on purpose: capture, graph building, instantiation and
 * launch all work on the same node, graph and executable-graph structures and the
 * graph memory pool under one lock (g_graph_lock, gmem_t refcounts); split, all of
 * that would move into a header shared by files that each only make sense together.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "cuda_internal.h"

/* One alloc node's virtual range, shared by the node and the graphs made from it. */
typedef struct {
    uintptr_t base;
    size_t size; /* whole 2 MiB granules */
    int refs;    /* under g_graph_lock */
} gmem_t;

struct CUgraphNode_st {
    cu_obj_t hdr;
    struct CUgraph_st *graph;
    int type; /* CU_GRAPH_NODE_TYPE_* */
    int kernel;
    unsigned char buf[KERN_MAX_PARAM_BYTES];
    gmem_t *mem;                      /* MEM_ALLOC */
    int dev;                          /* MEM_ALLOC: device ordinal */
    CUDA_MEM_ALLOC_NODE_PARAMS alloc; /* MEM_ALLOC: as added (dptr filled in) */
    CUdeviceptr free_ptr;             /* MEM_FREE */
};

struct CUgraph_st {
    cu_obj_t hdr;
    struct CUgraphNode_st **nodes;
    size_t n, cap;
    int mem_execs; /* live executable graphs of a graph with memory nodes (at most 1) */
};

typedef struct {
    int kernel;
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
    uint64_t done_ns; /* when its last launch's work completes (under g_graph_lock) */
    struct CUgraph_st *graph;
};

/* Per device (ordinal): the process's graph memory pool (CUgraphMem_attribute). */
typedef struct {
    uint64_t used, used_high, reserved, reserved_high;
} gpool_t;
static gpool_t g_gpool[SIMGPU_MAX_GPUS];

static pthread_mutex_t g_graph_lock = PTHREAD_MUTEX_INITIALIZER;

static CUresult add_node_full(struct CUgraph_st *g, struct CUgraphNode_st *proto, CUgraphNode *out) {
    struct CUgraphNode_st *nd = calloc(1, sizeof *nd);
    if (!nd) return CUDA_ERROR_OUT_OF_MEMORY;
    *nd = *proto;
    nd->graph = g;
    pthread_mutex_lock(&g_graph_lock);
    if (g->n == g->cap) {
        size_t cap = g->cap ? g->cap * 2 : 8;
        struct CUgraphNode_st **v = realloc(g->nodes, cap * sizeof *v);
        if (!v) {
            pthread_mutex_unlock(&g_graph_lock);
            free(nd);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        g->nodes = v, g->cap = cap;
    }
    g->nodes[g->n++] = nd;
    pthread_mutex_unlock(&g_graph_lock);
    cu_obj_add(nd, OBJ_GRAPH_NODE, NULL);
    if (out) *out = nd;
    return CUDA_SUCCESS;
}

static CUresult add_node(struct CUgraph_st *g, int kernel, const unsigned char *buf, CUgraphNode *out) {
    struct CUgraphNode_st proto = {.type = CU_GRAPH_NODE_TYPE_KERNEL, .kernel = kernel};
    memcpy(proto.buf, buf, KERN_MAX_PARAM_BYTES);
    return add_node_full(g, &proto, out);
}

static void gmem_unref(gmem_t *m) { /* caller holds g_graph_lock */
    if (!m || --m->refs > 0) return;
    munmap((void *)m->base, m->size);
    free(m);
}

/* An alloc node: its address now, its memory when a graph made from it runs. */
static CUresult add_alloc(struct CUgraph_st *g, int dev, size_t bytesize, const CUDA_MEM_ALLOC_NODE_PARAMS *p,
                          CUgraphNode *out, CUdeviceptr *dptr) {
    if (!bytesize) return CUDA_ERROR_INVALID_VALUE;
    if (cu_check_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    gmem_t *m = calloc(1, sizeof *m);
    if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
    m->size = cu_round_up(bytesize, CU_GRANULARITY), m->refs = 1;
    void *va = cu_map_anon(m->size, PROT_NONE);
    if (!va) {
        free(m);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    m->base = (uintptr_t)va;
    struct CUgraphNode_st proto = {.type = CU_GRAPH_NODE_TYPE_MEM_ALLOC, .mem = m, .dev = dev};
    if (p) proto.alloc = *p;
    proto.alloc.bytesize = bytesize, proto.alloc.dptr = m->base;
    CUresult r = add_node_full(g, &proto, out);
    if (r) {
        pthread_mutex_lock(&g_graph_lock);
        gmem_unref(m);
        pthread_mutex_unlock(&g_graph_lock);
        return r;
    }
    *dptr = m->base;
    return CUDA_SUCCESS;
}

/* Is `p` the address of one of g's alloc nodes? */
static int graph_owns(struct CUgraph_st *g, CUdeviceptr p) {
    int hit = 0;
    pthread_mutex_lock(&g_graph_lock);
    for (size_t i = 0; i < g->n && !hit; i++)
        hit = g->nodes[i]->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC && g->nodes[i]->mem->base == p;
    pthread_mutex_unlock(&g_graph_lock);
    return hit;
}

static CUresult add_free(struct CUgraph_st *g, CUdeviceptr p, CUgraphNode *out) {
    if (!graph_owns(g, p)) return CUDA_ERROR_INVALID_VALUE;
    struct CUgraphNode_st proto = {.type = CU_GRAPH_NODE_TYPE_MEM_FREE, .free_ptr = p};
    return add_node_full(g, &proto, out);
}

CUresult cu_graph_capture_alloc(struct CUgraph_st *g, int dev, size_t size, CUdeviceptr *dptr) {
    CUDA_MEM_ALLOC_NODE_PARAMS p = {0};
    p.poolProps.allocType = 1, p.poolProps.location.type = 1, p.poolProps.location.id = dev;
    return add_alloc(g, dev, size, &p, NULL, dptr);
}

CUresult cu_graph_capture_free(struct CUgraph_st *g, CUdeviceptr dptr) {
    return graph_owns(g, dptr) ? add_free(g, dptr, NULL) : CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
}

static struct CUgraph_st *graph_new(void) {
    struct CUgraph_st *g = calloc(1, sizeof *g);
    if (g) cu_obj_add(g, OBJ_GRAPH, NULL);
    return g;
}

CUresult cu_graph_capture_kernel(struct CUgraph_st *g, const struct CUfunc_st *f, const unsigned char *buf) {
    return add_node(g, f->kernel, buf, NULL);
}

/* ------------------------------------------------------------------ stream capture */

static CUresult begin_capture(CUstream hStream, int mode) {
    CU_STREAM(hStream, c, s);
    if (mode < 0 || mode > 2) return CUDA_ERROR_INVALID_VALUE;
    if (s == &c->null_stream) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; /* the legacy stream cannot capture */
    if (s->capture) return CUDA_ERROR_ILLEGAL_STATE;
    if (!(s->capture = graph_new())) return CUDA_ERROR_OUT_OF_MEMORY;
    return CUDA_SUCCESS;
}

CU_API CUresult cuStreamBeginCapture_v2(CUstream hStream, int mode) {
    CU_ENTER();
    return begin_capture(hStream, mode);
}

CU_API CUresult cuStreamBeginCapture(CUstream hStream) {
    CU_ENTER();
    return begin_capture(hStream, 0);
}

CU_API CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph) {
    CU_ENTER();
    CU_STREAM(hStream, c, s);
    if (!phGraph) return CUDA_ERROR_INVALID_VALUE;
    if (!s->capture) return CUDA_ERROR_ILLEGAL_STATE;
    *phGraph = s->capture;
    s->capture = NULL;
    return CUDA_SUCCESS;
}

CU_API CUresult cuStreamIsCapturing(CUstream hStream, int *captureStatus) {
    CU_ENTER();
    CU_STREAM(hStream, c, s);
    if (!captureStatus) return CUDA_ERROR_INVALID_VALUE;
    *captureStatus = s->capture != NULL; /* CU_STREAM_CAPTURE_STATUS_NONE / _ACTIVE */
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ graphs */

CU_API CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags) {
    CU_ENTER();
    if (!phGraph || flags) return CUDA_ERROR_INVALID_VALUE;
    return (*phGraph = graph_new()) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

static CUresult check_deps(CUgraphNode *phNode, CUgraph g, const CUgraphNode *deps, size_t ndeps) {
    if (!phNode || (ndeps && !deps)) return CUDA_ERROR_INVALID_VALUE;
    if (!cu_obj_ok(g, OBJ_GRAPH)) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < ndeps; i++)
        if (!cu_obj_ok(deps[i], OBJ_GRAPH_NODE) || deps[i]->graph != g) return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

static CUresult add_kernel(CUgraphNode *phNode, CUgraph g, const CUgraphNode *deps, size_t ndeps, CUfunction f,
                           void **params, void **extra) {
    unsigned char buf[KERN_MAX_PARAM_BYTES];
    CUresult r0 = check_deps(phNode, g, deps, ndeps);
    if (r0) return r0;
    if (!cu_obj_ok(f, OBJ_FUNC)) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = cu_kernel_pack(f, params, extra, buf);
    return r ? r : add_node(g, f->kernel, buf, phNode);
}

CU_API CUresult cuGraphAddKernelNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                        size_t numDependencies, const CUDA_KERNEL_NODE_PARAMS_v2 *nodeParams) {
    CU_ENTER();
    if (!nodeParams) return CUDA_ERROR_INVALID_VALUE;
    return add_kernel(phGraphNode, hGraph, dependencies, numDependencies, nodeParams->func,
                      nodeParams->kernelParams, nodeParams->extra);
}

CU_API CUresult cuGraphAddKernelNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                     size_t numDependencies, const CUDA_KERNEL_NODE_PARAMS_v1 *nodeParams) {
    CU_ENTER();
    if (!nodeParams) return CUDA_ERROR_INVALID_VALUE;
    return add_kernel(phGraphNode, hGraph, dependencies, numDependencies, nodeParams->func,
                      nodeParams->kernelParams, nodeParams->extra);
}

CU_API CUresult cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                       size_t numDependencies, CUDA_MEM_ALLOC_NODE_PARAMS *nodeParams) {
    CU_ENTER();
    CUresult r = check_deps(phGraphNode, hGraph, dependencies, numDependencies);
    if (r) return r;
    if (!nodeParams || nodeParams->poolProps.allocType != 1 || nodeParams->poolProps.location.type != 1)
        return CUDA_ERROR_INVALID_VALUE;
    return add_alloc(hGraph, nodeParams->poolProps.location.id, nodeParams->bytesize, nodeParams, phGraphNode,
                     &nodeParams->dptr);
}

CU_API CUresult cuGraphAddMemFreeNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                      size_t numDependencies, CUdeviceptr dptr) {
    CU_ENTER();
    CUresult r = check_deps(phGraphNode, hGraph, dependencies, numDependencies);
    return r ? r : add_free(hGraph, dptr, phGraphNode);
}

CU_API CUresult cuGraphMemAllocNodeGetParams(CUgraphNode hNode, CUDA_MEM_ALLOC_NODE_PARAMS *params_out) {
    CU_ENTER();
    if (!params_out || !cu_obj_ok(hNode, OBJ_GRAPH_NODE) || hNode->type != CU_GRAPH_NODE_TYPE_MEM_ALLOC)
        return CUDA_ERROR_INVALID_VALUE;
    *params_out = hNode->alloc;
    return CUDA_SUCCESS;
}

CU_API CUresult cuGraphMemFreeNodeGetParams(CUgraphNode hNode, CUdeviceptr *dptr_out) {
    CU_ENTER();
    if (!dptr_out || !cu_obj_ok(hNode, OBJ_GRAPH_NODE) || hNode->type != CU_GRAPH_NODE_TYPE_MEM_FREE)
        return CUDA_ERROR_INVALID_VALUE;
    *dptr_out = hNode->free_ptr;
    return CUDA_SUCCESS;
}

CU_API CUresult cuGraphNodeGetType(CUgraphNode hNode, int *type) {
    CU_ENTER();
    if (!type || !cu_obj_ok(hNode, OBJ_GRAPH_NODE)) return CUDA_ERROR_INVALID_VALUE;
    *type = hNode->type;
    return CUDA_SUCCESS;
}

/* The generic entry point (12.2; _v2 with edge data, 12.3): kernel and memory nodes. */
static CUresult add_generic(CUgraphNode *ph, CUgraph g, const CUgraphNode *deps, size_t n, CUgraphNodeParams *p) {
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    switch (p->type) {
    case CU_GRAPH_NODE_TYPE_KERNEL:
        return add_kernel(ph, g, deps, n, p->u.kernel.func, p->u.kernel.kernelParams, p->u.kernel.extra);
    case CU_GRAPH_NODE_TYPE_MEM_ALLOC: {
        CUresult r = check_deps(ph, g, deps, n);
        if (r) return r;
        CUDA_MEM_ALLOC_NODE_PARAMS *a = &p->u.alloc;
        if (a->poolProps.allocType != 1 || a->poolProps.location.type != 1) return CUDA_ERROR_INVALID_VALUE;
        return add_alloc(g, a->poolProps.location.id, a->bytesize, a, ph, &a->dptr);
    }
    case CU_GRAPH_NODE_TYPE_MEM_FREE: {
        CUresult r = check_deps(ph, g, deps, n);
        return r ? r : add_free(g, p->u.free_dptr, ph);
    }
    default: return CUDA_ERROR_NOT_SUPPORTED;
    }
}

CU_API CUresult cuGraphAddNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                               size_t numDependencies, CUgraphNodeParams *nodeParams) {
    CU_ENTER();
    return add_generic(phGraphNode, hGraph, dependencies, numDependencies, nodeParams);
}

CU_API CUresult cuGraphAddNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                  const void *dependencyData, size_t numDependencies, CUgraphNodeParams *nodeParams) {
    CU_ENTER();
    (void)dependencyData; /* edge data (ports, types): no effect on a simulated GPU */
    return add_generic(phGraphNode, hGraph, dependencies, numDependencies, nodeParams);
}

CU_API CUresult cuGraphGetNodes(CUgraph hGraph, CUgraphNode *nodes, size_t *numNodes) {
    CU_ENTER();
    if (!numNodes) return CUDA_ERROR_INVALID_VALUE;
    if (!cu_obj_ok(hGraph, OBJ_GRAPH)) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_graph_lock);
    if (nodes) {
        size_t n = *numNodes < hGraph->n ? *numNodes : hGraph->n;
        for (size_t i = 0; i < n; i++) nodes[i] = hGraph->nodes[i];
        *numNodes = n;
    } else {
        *numNodes = hGraph->n;
    }
    pthread_mutex_unlock(&g_graph_lock);
    return CUDA_SUCCESS;
}

CU_API CUresult cuGraphDestroy(CUgraph hGraph) {
    CU_ENTER();
    if (!cu_obj_del(hGraph, OBJ_GRAPH)) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_graph_lock);
    for (size_t i = 0; i < hGraph->n; i++) {
        cu_obj_del(hGraph->nodes[i], OBJ_GRAPH_NODE);
        gmem_unref(hGraph->nodes[i]->mem);
        free(hGraph->nodes[i]);
    }
    pthread_mutex_unlock(&g_graph_lock);
    free(hGraph->nodes);
    free(hGraph);
    return CUDA_SUCCESS;
}

static CUresult instantiate(CUgraphExec *phGraphExec, CUgraph hGraph) {
    if (!phGraphExec) return CUDA_ERROR_INVALID_VALUE;
    if (!cu_obj_ok(hGraph, OBJ_GRAPH)) return CUDA_ERROR_INVALID_VALUE;
    struct CUgraphExec_st *e = calloc(1, sizeof *e);
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&g_graph_lock);
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
    pthread_mutex_unlock(&g_graph_lock);
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
 * g_graph_lock): idle pool memory first, the rest charged to the GPU. */
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
    pthread_mutex_lock(&g_graph_lock);
    r = exec_map(hGraphExec);
    pthread_mutex_unlock(&g_graph_lock);
    if (r) return r; /* its memory does not fit: nothing runs */
    for (size_t i = 0; i < hGraphExec->n; i++) cu_kernel_exec(c, s, hGraphExec->k[i].kernel, hGraphExec->k[i].buf);
    uint64_t done = atomic_load(&s->done_ns), now = sim_now_ns();
    pthread_mutex_lock(&g_graph_lock);
    hGraphExec->done_ns = done > now ? done : now;
    pthread_mutex_unlock(&g_graph_lock);
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
    pthread_mutex_lock(&g_graph_lock);
    r = exec_map(hGraphExec);
    pthread_mutex_unlock(&g_graph_lock);
    return r;
}

/* CUgraphMem_attribute: USED_MEM_CURRENT 0, USED_MEM_HIGH 1, RESERVED_MEM_CURRENT 2,
 * RESERVED_MEM_HIGH 3 (cuuint64_t); the watermarks may only be reset (set to 0). */
CU_API CUresult cuDeviceGetGraphMemAttribute(CUdevice device, int attr, void *value) {
    CU_ENTER();
    CUresult r = cu_check_dev(device);
    if (r) return r;
    if (!value || attr < 0 || attr > 3) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_graph_lock);
    gpool_t *p = &g_gpool[device];
    const uint64_t v[4] = {p->used, p->used_high, p->reserved, p->reserved_high};
    *(cuuint64_t *)value = v[attr];
    pthread_mutex_unlock(&g_graph_lock);
    return CUDA_SUCCESS;
}

CU_API CUresult cuDeviceSetGraphMemAttribute(CUdevice device, int attr, void *value) {
    CU_ENTER();
    CUresult r = cu_check_dev(device);
    if (r) return r;
    if (!value || (attr != 1 && attr != 3) || *(cuuint64_t *)value != 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_graph_lock);
    gpool_t *p = &g_gpool[device];
    if (attr == 1) p->used_high = p->used;
    else p->reserved_high = p->reserved;
    pthread_mutex_unlock(&g_graph_lock);
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
    pthread_mutex_lock(&g_graph_lock);
    uint64_t now = sim_now_ns();
    for (size_t i = 0; i < n; i++) {
        struct CUgraphExec_st *e = execs[i];
        if (cu_obj_ok(e, OBJ_GRAPH_EXEC) && e->dev == device && e->mapped && e->done_ns <= now) exec_unmap(e);
    }
    gpool_t *p = &g_gpool[device];
    if (p->reserved > p->used) {
        cu_uncharge(cu_g_devs[device], p->reserved - p->used);
        p->reserved = p->used;
    }
    pthread_mutex_unlock(&g_graph_lock);
    return CUDA_SUCCESS;
}

CU_API CUresult cuGraphExecDestroy(CUgraphExec hGraphExec) {
    CU_ENTER();
    if (!cu_obj_del(hGraphExec, OBJ_GRAPH_EXEC)) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_graph_lock);
    exec_unmap(hGraphExec);
    if (hGraphExec->graph && cu_obj_ok(hGraphExec->graph, OBJ_GRAPH)) hGraphExec->graph->mem_execs--;
    for (size_t i = 0; i < hGraphExec->nmem; i++) gmem_unref(hGraphExec->mem[i]);
    pthread_mutex_unlock(&g_graph_lock);
    free(hGraphExec->mem);
    free(hGraphExec->k);
    free(hGraphExec);
    return CUDA_SUCCESS;
}

/* Per-thread default stream twins (see CU_TWIN). */
CU_TWIN(cuGraphLaunch_ptsz, cuGraphLaunch, (CUgraphExec e, CUstream h), (e, h))
CU_TWIN(cuGraphUpload_ptsz, cuGraphUpload, (CUgraphExec e, CUstream h), (e, h))
CU_TWIN(cuStreamBeginCapture_v2_ptsz, cuStreamBeginCapture_v2, (CUstream h, int mode), (h, mode))
CU_TWIN(cuStreamEndCapture_ptsz, cuStreamEndCapture, (CUstream h, CUgraph * g), (h, g))
CU_TWIN(cuStreamIsCapturing_ptsz, cuStreamIsCapturing, (CUstream h, int *status), (h, status))

const cu_sym_t cu_syms_graph[] = {
    CU_SYM("cuStreamBeginCapture", 10000, cuStreamBeginCapture),
    CU_SYM("cuStreamBeginCapture", 10010, cuStreamBeginCapture_v2),
    CU_SYM_PT("cuStreamBeginCapture", 10010, cuStreamBeginCapture_v2_ptsz),
    CU_SYM("cuStreamEndCapture", 10000, cuStreamEndCapture),
    CU_SYM_PT("cuStreamEndCapture", 10000, cuStreamEndCapture_ptsz),
    CU_SYM("cuStreamIsCapturing", 10000, cuStreamIsCapturing),
    CU_SYM_PT("cuStreamIsCapturing", 10000, cuStreamIsCapturing_ptsz),
    CU_SYM("cuGraphCreate", 10000, cuGraphCreate),
    CU_SYM("cuGraphAddKernelNode", 10000, cuGraphAddKernelNode),
    CU_SYM("cuGraphAddKernelNode", 12000, cuGraphAddKernelNode_v2),
    CU_SYM("cuGraphAddMemAllocNode", 11040, cuGraphAddMemAllocNode),
    CU_SYM("cuGraphAddMemFreeNode", 11040, cuGraphAddMemFreeNode),
    CU_SYM("cuGraphMemAllocNodeGetParams", 11040, cuGraphMemAllocNodeGetParams),
    CU_SYM("cuGraphMemFreeNodeGetParams", 11040, cuGraphMemFreeNodeGetParams),
    CU_SYM("cuGraphNodeGetType", 10000, cuGraphNodeGetType),
    CU_SYM("cuGraphAddNode", 12020, cuGraphAddNode),
    CU_SYM("cuGraphAddNode", 12030, cuGraphAddNode_v2),
    CU_SYM("cuGraphUpload", 11010, cuGraphUpload),
    CU_SYM_PT("cuGraphUpload", 11010, cuGraphUpload_ptsz),
    CU_SYM("cuDeviceGetGraphMemAttribute", 11040, cuDeviceGetGraphMemAttribute),
    CU_SYM("cuDeviceSetGraphMemAttribute", 11040, cuDeviceSetGraphMemAttribute),
    CU_SYM("cuDeviceGraphMemTrim", 11040, cuDeviceGraphMemTrim),
    CU_SYM("cuGraphGetNodes", 10000, cuGraphGetNodes),
    CU_SYM("cuGraphDestroy", 10000, cuGraphDestroy),
    CU_SYM("cuGraphInstantiate", 10000, cuGraphInstantiate),
    CU_SYM("cuGraphInstantiate", 11000, cuGraphInstantiate_v2),
    CU_SYM("cuGraphInstantiate", 11040, cuGraphInstantiateWithFlags),
    CU_SYM("cuGraphInstantiateWithFlags", 11040, cuGraphInstantiateWithFlags),
    CU_SYM("cuGraphLaunch", 10000, cuGraphLaunch),
    CU_SYM_PT("cuGraphLaunch", 10000, cuGraphLaunch_ptsz),
    CU_SYM("cuGraphExecDestroy", 10000, cuGraphExecDestroy),
};
const size_t cu_syms_graph_n = sizeof cu_syms_graph / sizeof cu_syms_graph[0];
