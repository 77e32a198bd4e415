/*
 * simgpu fake libcuda.so.1 — minimal CUDA graphs: enough to capture or build a
 * graph of fake-kernel launches, instantiate it and replay it with cuGraphLaunch.
 *
 * Graphs hold kernel nodes only (memcpy/memset/alloc nodes are not simulated:
 * those operations return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED while capturing).
 * Nodes run in insertion order, which is a valid order for any dependencies,
 * since a node's dependencies must exist before it is added. Each kernel node
 * of a launched graph counts as a launch in the node state.
 */
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"

struct CUgraphNode_st {
    cu_obj_t hdr;
    struct CUgraph_st *graph;
    int kernel;
    unsigned char buf[KERN_MAX_PARAM_BYTES];
};

struct CUgraph_st {
    cu_obj_t hdr;
    struct CUgraphNode_st **nodes;
    size_t n, cap;
};

typedef struct {
    int kernel;
    unsigned char buf[KERN_MAX_PARAM_BYTES];
} exec_kernel_t;

struct CUgraphExec_st {
    cu_obj_t hdr;
    size_t n;
    exec_kernel_t *k;
};

static pthread_mutex_t g_graph_lock = PTHREAD_MUTEX_INITIALIZER;

static CUresult add_node(struct CUgraph_st *g, int kernel, const unsigned char *buf, CUgraphNode *out) {
    struct CUgraphNode_st *nd = calloc(1, sizeof *nd);
    if (!nd) return CUDA_ERROR_OUT_OF_MEMORY;
    nd->graph = g, nd->kernel = kernel;
    memcpy(nd->buf, buf, KERN_MAX_PARAM_BYTES);
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

static CUresult add_kernel(CUgraphNode *phNode, CUgraph g, const CUgraphNode *deps, size_t ndeps, CUfunction f,
                           void **params, void **extra) {
    unsigned char buf[KERN_MAX_PARAM_BYTES];
    if (!phNode || (ndeps && !deps)) return CUDA_ERROR_INVALID_VALUE;
    if (!cu_obj_ok(g, OBJ_GRAPH)) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < ndeps; i++)
        if (!cu_obj_ok(deps[i], OBJ_GRAPH_NODE) || deps[i]->graph != g) return CUDA_ERROR_INVALID_VALUE;
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
    for (size_t i = 0; i < hGraph->n; i++) {
        cu_obj_del(hGraph->nodes[i], OBJ_GRAPH_NODE);
        free(hGraph->nodes[i]);
    }
    free(hGraph->nodes);
    free(hGraph);
    return CUDA_SUCCESS;
}

static CUresult instantiate(CUgraphExec *phGraphExec, CUgraph hGraph) {
    if (!phGraphExec) return CUDA_ERROR_INVALID_VALUE;
    if (!cu_obj_ok(hGraph, OBJ_GRAPH)) return CUDA_ERROR_INVALID_VALUE;
    struct CUgraphExec_st *e = calloc(1, sizeof *e);
    pthread_mutex_lock(&g_graph_lock);
    if (e && hGraph->n && !(e->k = calloc(hGraph->n, sizeof *e->k))) {
        free(e);
        e = NULL;
    }
    if (e) {
        e->n = hGraph->n;
        for (size_t i = 0; i < e->n; i++) {
            e->k[i].kernel = hGraph->nodes[i]->kernel;
            memcpy(e->k[i].buf, hGraph->nodes[i]->buf, KERN_MAX_PARAM_BYTES);
        }
    }
    pthread_mutex_unlock(&g_graph_lock);
    if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
    cu_obj_add(e, OBJ_GRAPH_EXEC, NULL);
    *phGraphExec = e;
    return CUDA_SUCCESS;
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
    for (size_t i = 0; i < hGraphExec->n; i++) cu_kernel_exec(c, s, hGraphExec->k[i].kernel, hGraphExec->k[i].buf);
    return CUDA_SUCCESS;
}

CU_API CUresult cuGraphExecDestroy(CUgraphExec hGraphExec) {
    CU_ENTER();
    if (!cu_obj_del(hGraphExec, OBJ_GRAPH_EXEC)) return CUDA_ERROR_INVALID_VALUE;
    free(hGraphExec->k);
    free(hGraphExec);
    return CUDA_SUCCESS;
}

/* Per-thread default stream twins (see CU_TWIN). */
CU_TWIN(cuGraphLaunch_ptsz, cuGraphLaunch, (CUgraphExec e, CUstream h), (e, h))
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
