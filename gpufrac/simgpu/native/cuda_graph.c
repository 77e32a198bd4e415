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
 * This file: capture and building graphs; cuda_graph_exec.c: executable graphs
 * and the graph memory pool; cuda_graph.h: the structures both use.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "cuda_graph.h"

SIM_HIDDEN pthread_mutex_t cu_graph_lock = PTHREAD_MUTEX_INITIALIZER;

static CUresult add_node_full(struct CUgraph_st *g, struct CUgraphNode_st *proto, CUgraphNode *out) {
    struct CUgraphNode_st *nd = calloc(1, sizeof *nd);
    if (!nd) return CUDA_ERROR_OUT_OF_MEMORY;
    *nd = *proto;
    nd->graph = g;
    pthread_mutex_lock(&cu_graph_lock);
    if (g->n == g->cap) {
        size_t cap = g->cap ? g->cap * 2 : 8;
        struct CUgraphNode_st **v = realloc(g->nodes, cap * sizeof *v);
        if (!v) {
            pthread_mutex_unlock(&cu_graph_lock);
            free(nd);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        g->nodes = v, g->cap = cap;
    }
    g->nodes[g->n++] = nd;
    pthread_mutex_unlock(&cu_graph_lock);
    cu_obj_add(nd, OBJ_GRAPH_NODE, NULL);
    if (out) *out = nd;
    return CUDA_SUCCESS;
}

static CUresult add_node(struct CUgraph_st *g, int kernel, uint64_t blocks, const unsigned char *buf,
                         CUgraphNode *out) {
    struct CUgraphNode_st proto = {.type = CU_GRAPH_NODE_TYPE_KERNEL, .kernel = kernel, .blocks = blocks};
    memcpy(proto.buf, buf, KERN_MAX_PARAM_BYTES);
    return add_node_full(g, &proto, out);
}

void cu_gmem_unref(gmem_t *m) { /* caller holds cu_graph_lock */
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
        pthread_mutex_lock(&cu_graph_lock);
        cu_gmem_unref(m);
        pthread_mutex_unlock(&cu_graph_lock);
        return r;
    }
    *dptr = m->base;
    return CUDA_SUCCESS;
}

/* Is `p` the address of one of g's alloc nodes? */
static int graph_owns(struct CUgraph_st *g, CUdeviceptr p) {
    int hit = 0;
    pthread_mutex_lock(&cu_graph_lock);
    for (size_t i = 0; i < g->n && !hit; i++)
        hit = g->nodes[i]->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC && g->nodes[i]->mem->base == p;
    pthread_mutex_unlock(&cu_graph_lock);
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

CUresult cu_graph_capture_kernel(struct CUgraph_st *g, const struct CUfunc_st *f, uint64_t blocks,
                                 const unsigned char *buf) {
    return add_node(g, f->kernel, blocks, buf, NULL);
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

/* The thread blocks a kernel node's grid asks for (a zero dimension counts as 1). */
#define KERNEL_BLOCKS(p)                                                                              \
    ((uint64_t)((p)->gridDimX ? (p)->gridDimX : 1) * ((p)->gridDimY ? (p)->gridDimY : 1) *          \
     ((p)->gridDimZ ? (p)->gridDimZ : 1))

static CUresult check_deps(CUgraphNode *phNode, CUgraph g, const CUgraphNode *deps, size_t ndeps) {
    if (!phNode || (ndeps && !deps)) return CUDA_ERROR_INVALID_VALUE;
    if (!cu_obj_ok(g, OBJ_GRAPH)) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < ndeps; i++)
        if (!cu_obj_ok(deps[i], OBJ_GRAPH_NODE) || deps[i]->graph != g) return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

static CUresult add_kernel(CUgraphNode *phNode, CUgraph g, const CUgraphNode *deps, size_t ndeps, CUfunction f,
                           uint64_t blocks, void **params, void **extra) {
    unsigned char buf[KERN_MAX_PARAM_BYTES];
    CUresult r0 = check_deps(phNode, g, deps, ndeps);
    if (r0) return r0;
    if (!cu_obj_ok(f, OBJ_FUNC)) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = cu_kernel_pack(f, params, extra, buf);
    return r ? r : add_node(g, f->kernel, blocks ? blocks : 1, buf, phNode);
}

CU_API CUresult cuGraphAddKernelNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                        size_t numDependencies, const CUDA_KERNEL_NODE_PARAMS_v2 *nodeParams) {
    CU_ENTER();
    if (!nodeParams) return CUDA_ERROR_INVALID_VALUE;
    return add_kernel(phGraphNode, hGraph, dependencies, numDependencies, nodeParams->func, KERNEL_BLOCKS(nodeParams),
                      nodeParams->kernelParams, nodeParams->extra);
}

CU_API CUresult cuGraphAddKernelNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                     size_t numDependencies, const CUDA_KERNEL_NODE_PARAMS_v1 *nodeParams) {
    CU_ENTER();
    if (!nodeParams) return CUDA_ERROR_INVALID_VALUE;
    return add_kernel(phGraphNode, hGraph, dependencies, numDependencies, nodeParams->func, KERNEL_BLOCKS(nodeParams),
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
        return add_kernel(ph, g, deps, n, p->u.kernel.func, KERNEL_BLOCKS(&p->u.kernel), p->u.kernel.kernelParams,
                          p->u.kernel.extra);
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
    pthread_mutex_lock(&cu_graph_lock);
    if (nodes) {
        size_t n = *numNodes < hGraph->n ? *numNodes : hGraph->n;
        for (size_t i = 0; i < n; i++) nodes[i] = hGraph->nodes[i];
        *numNodes = n;
    } else {
        *numNodes = hGraph->n;
    }
    pthread_mutex_unlock(&cu_graph_lock);
    return CUDA_SUCCESS;
}

CU_API CUresult cuGraphDestroy(CUgraph hGraph) {
    CU_ENTER();
    if (!cu_obj_del(hGraph, OBJ_GRAPH)) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&cu_graph_lock);
    for (size_t i = 0; i < hGraph->n; i++) {
        cu_obj_del(hGraph->nodes[i], OBJ_GRAPH_NODE);
        cu_gmem_unref(hGraph->nodes[i]->mem);
        free(hGraph->nodes[i]);
    }
    pthread_mutex_unlock(&cu_graph_lock);
    free(hGraph->nodes);
    free(hGraph);
    return CUDA_SUCCESS;
}

/* Per-thread default stream twins (see CU_TWIN). */
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
    CU_SYM("cuGraphGetNodes", 10000, cuGraphGetNodes),
    CU_SYM("cuGraphDestroy", 10000, cuGraphDestroy),
};
const size_t cu_syms_graph_n = sizeof cu_syms_graph / sizeof cu_syms_graph[0];
