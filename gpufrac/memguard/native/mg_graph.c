/*
 * memguard: CUDA graph memory — graph memory nodes (cuGraphAddMemAllocNode,
 * cuGraphAddNode with a MEM_ALLOC node, cuMemAllocAsync while a stream is
 * captured into a graph).
 *
 * The driver gives such memory from the device's graph memory pool, one per
 * device and process: physical memory joins an executable graph when it is
 * uploaded or first launched and stays with it until a cuDeviceGraphMemTrim
 * finds that graph idle (neither running nor queued: its next upload or launch
 * takes memory again, so it is checked again); the pool keeps what it holds
 * after graphs go until cuDeviceGraphMemTrim. So what the container is charged
 * for is the pool's reservation, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT of
 * cuDeviceGetGraphMemAttribute: per process, so no other process's activity
 * can blur it. It is read again after every call that can change it (upload,
 * launch of a graph whose memory is not counted yet, instantiate, exec destroy,
 * trim) and the count moved by the difference.
 *
 * The limit is checked BEFORE the memory is taken: at instantiate the graph's
 * memory nodes are summed (cuGraphGetNodes, cuGraphNodeGetType,
 * cuGraphMemAllocNodeGetParams; child graphs too); the first upload or launch
 * of that executable graph charges what the pool lacks for it (its need less
 * the pool's idle memory) through mg_charge — fast path, the arbiter, or
 * CUDA_ERROR_OUT_OF_MEMORY, in which case nothing is launched. Never silently.
 * Later launches of that graph reuse its memory: they cost the graph launch
 * hook one atomic load (mg_graph_unmapped) while no graph waits for its memory.
 *
 * Allocations made while capturing (cuMemAllocAsync on a capturing stream) are
 * addresses of future memory nodes, not memory: the pool path lets them through
 * uncounted (mg_capturing gates that check) and they are counted with their graph.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "mg_internal.h"

_Atomic unsigned mg_graph_unmapped;
_Atomic unsigned mg_capturing;

#define GRAPH_GRANULE (2ull << 20) /* graph memory is mapped in whole 2 MiB granules */
#define NODE_TYPE_GRAPH 4
#define NODE_TYPE_MEM_ALLOC 10
#define GRAPH_MEM_RESERVED_CURRENT 2
#define GRAPH_MEM_USED_CURRENT 0
#define MG_GR_DEVS 64

typedef struct {
    int allocType, handleTypes;
    struct {
        int type, id;
    } location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
} mg_pool_props_t; /* CUmemPoolProps */

typedef struct {
    mg_pool_props_t poolProps;
    const void *accessDescs;
    size_t accessDescCount;
    size_t bytesize;
    CUdeviceptr dptr;
} mg_alloc_node_t; /* CUDA_MEM_ALLOC_NODE_PARAMS */

typedef CUresult (*graph_nodes_fn)(CUgraph, CUgraphNode *, size_t *);
typedef CUresult (*node_type_fn)(CUgraphNode, int *);
typedef CUresult (*alloc_params_fn)(CUgraphNode, mg_alloc_node_t *);
typedef CUresult (*child_graph_fn)(CUgraphNode, CUgraph *);
typedef CUresult (*graph_mem_attr_fn)(CUdevice, int, void *);
typedef CUresult (*is_capturing_fn)(CUstream, int *);
typedef CUresult (*graph_launch_fn)(CUgraphExec, CUstream);

typedef struct {
    CUgraphExec exec;
    uint64_t need; /* bytes of its memory nodes */
    CUdevice dev;
    int mapped; /* it holds its memory (uploaded or launched once) */
} mg_gexec_t;

/* Process-local; never held across mg_charge or the arbiter. */
static pthread_mutex_t g_gr_mu = PTHREAD_MUTEX_INITIALIZER;
static mg_gexec_t *g_gx;
static size_t g_gx_n, g_gx_cap;
static uint64_t g_gr_counted[MG_GR_DEVS]; /* per device: the pool reservation counted */
static int g_gr_warned;

static void *cu_fn(const char *name) { return mg_driver_fn(LIB_CUDA, name); }

int mg_stream_capturing(CUstream s) {
    is_capturing_fn f = (is_capturing_fn)cu_fn("cuStreamIsCapturing");
    int status = 0;
    return f && f(s, &status) == CUDA_SUCCESS && status != 0;
}

/* Bytes of graph memory a graph's memory nodes take (child graphs included). */
static uint64_t graph_need(CUgraph g, CUdevice *dev, int depth) {
    graph_nodes_fn nodes = (graph_nodes_fn)cu_fn("cuGraphGetNodes");
    node_type_fn type = (node_type_fn)cu_fn("cuGraphNodeGetType");
    alloc_params_fn params = (alloc_params_fn)cu_fn("cuGraphMemAllocNodeGetParams");
    child_graph_fn child = (child_graph_fn)cu_fn("cuGraphChildGraphNodeGetGraph");
    size_t n = 0;
    if (!nodes || !type || nodes(g, NULL, &n) != CUDA_SUCCESS || n == 0) return 0;
    CUgraphNode *v = calloc(n, sizeof *v);
    if (!v || nodes(g, v, &n) != CUDA_SUCCESS) {
        free(v);
        return 0;
    }
    uint64_t need = 0;
    for (size_t i = 0; i < n; i++) {
        int t = -1;
        if (type(v[i], &t) != CUDA_SUCCESS) continue;
        mg_alloc_node_t p;
        CUgraph sub;
        if (t == NODE_TYPE_MEM_ALLOC && params && params(v[i], &p) == CUDA_SUCCESS) {
            uint64_t b = p.bytesize + GRAPH_GRANULE - 1 < p.bytesize ? UINT64_MAX
                                                                      : (p.bytesize + GRAPH_GRANULE - 1) & ~(GRAPH_GRANULE - 1);
            need = need + b < need ? UINT64_MAX : need + b;
            *dev = p.poolProps.location.id;
        } else if (t == NODE_TYPE_GRAPH && depth < 8 && child && child(v[i], &sub) == CUDA_SUCCESS) {
            uint64_t b = graph_need(sub, dev, depth + 1);
            need = need + b < need ? UINT64_MAX : need + b;
        }
    }
    free(v);
    return need;
}

static int pool_read(CUdevice dev, int attr, uint64_t *out) {
    graph_mem_attr_fn f = (graph_mem_attr_fn)cu_fn("cuDeviceGetGraphMemAttribute");
    cuuint64_t v = 0;
    if (!f || f(dev, attr, &v) != CUDA_SUCCESS) return -1;
    *out = v;
    return 0;
}

/* Count the device pool's reservation as the driver reports it. Callers hold
 * g_gr_mu. Returns what it grew by beyond what was counted. */
static uint64_t reconcile(CUdevice dev) {
    uint64_t r;
    if (dev < 0 || dev >= MG_GR_DEVS) return 0;
    if (pool_read(dev, GRAPH_MEM_RESERVED_CURRENT, &r) != 0) {
        if (!g_gr_warned) {
            g_gr_warned = 1;
            mg_log("cuDeviceGetGraphMemAttribute unavailable: graph memory is counted by its nodes only");
        }
        return 0;
    }
    uint64_t c = g_gr_counted[dev], grew = 0;
    if (r > c) mg_force_charge(grew = r - c);
    else if (r < c) mg_uncharge(c - r);
    g_gr_counted[dev] = r;
    return grew;
}

static mg_gexec_t *gx_find(CUgraphExec e) {
    for (size_t i = 0; i < g_gx_n; i++)
        if (g_gx[i].exec == e) return &g_gx[i];
    return NULL;
}

static void gx_drop(mg_gexec_t *x) {
    if (!x->mapped) atomic_fetch_sub(&mg_graph_unmapped, 1);
    *x = g_gx[--g_gx_n];
}

/* After a successful instantiate: remember the executable graph's need. An
 * instantiate that already took memory (upload flag) must fit like a launch. */
static CUresult instantiated(CUresult rc, CUgraphExec *e, CUgraph g) {
    if (rc != CUDA_SUCCESS || !e || !*e || !mg_on()) return rc;
    CUdevice dev = 0;
    uint64_t need = graph_need(g, &dev, 0);
    if (!need) return rc;
    pthread_mutex_lock(&g_gr_mu);
    int ok = 1;
    if (g_gx_n == g_gx_cap) {
        size_t cap = g_gx_cap ? g_gx_cap * 2 : 32;
        mg_gexec_t *v = realloc(g_gx, cap * sizeof *v);
        if (v) g_gx = v, g_gx_cap = cap;
        else ok = 0;
    }
    if (ok) {
        g_gx[g_gx_n++] = (mg_gexec_t){.exec = *e, .need = need, .dev = dev};
        atomic_fetch_add(&mg_graph_unmapped, 1);
    }
    uint64_t grew = reconcile(dev);
    pthread_mutex_unlock(&g_gr_mu);
    if (!ok) mg_log("too many executable graphs to follow: their memory is counted after launch only");
    if (grew && !mg_admit(grew)) {
        CALL_REAL(cuGraphExecDestroy, *e);
        pthread_mutex_lock(&g_gr_mu);
        mg_gexec_t *x = gx_find(*e);
        if (x) gx_drop(x);
        reconcile(dev);
        pthread_mutex_unlock(&g_gr_mu);
        *e = NULL;
        return mg_x_refuse();
    }
    return rc;
}

CUresult mg_h_cuGraphInstantiate(CUgraphExec *e, CUgraph g, CUgraphNode *errNode, char *log, size_t n) {
    mg_swap_gate();
    return instantiated(CALL_REAL(cuGraphInstantiate, e, g, errNode, log, n), e, g);
}
CUresult mg_h_cuGraphInstantiate_v2(CUgraphExec *e, CUgraph g, CUgraphNode *errNode, char *log, size_t n) {
    mg_swap_gate();
    return instantiated(CALL_REAL(cuGraphInstantiate_v2, e, g, errNode, log, n), e, g);
}
CUresult mg_h_cuGraphInstantiateWithFlags(CUgraphExec *e, CUgraph g, unsigned long long flags) {
    mg_swap_gate();
    return instantiated(CALL_REAL(cuGraphInstantiateWithFlags, e, g, flags), e, g);
}
CUresult mg_h_cuGraphInstantiateWithParams(CUgraphExec *e, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p) {
    mg_swap_gate();
    return instantiated(CALL_REAL(cuGraphInstantiateWithParams, e, g, p), e, g);
}
CUresult mg_h_cuGraphInstantiateWithParams_ptsz(CUgraphExec *e, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p) {
    mg_swap_gate();
    return instantiated(CALL_REAL(cuGraphInstantiateWithParams_ptsz, e, g, p), e, g);
}

/* Upload or launch of an executable graph that may not hold its memory yet:
 * what the pool lacks for it is charged first (refused: nothing runs). */
CUresult mg_graph_launch(void *real_launch, CUgraphExec e, CUstream s) {
    graph_launch_fn real = (graph_launch_fn)real_launch;
    if (!real) return CUDA_ERROR_NOT_FOUND;
    pthread_mutex_lock(&g_gr_mu);
    mg_gexec_t *x = gx_find(e);
    if (!x || x->mapped) {
        pthread_mutex_unlock(&g_gr_mu);
        return real(e, s);
    }
    CUdevice dev = x->dev;
    uint64_t need = x->need, used = 0, res = 0, grow = need;
    if (pool_read(dev, GRAPH_MEM_USED_CURRENT, &used) == 0 && pool_read(dev, GRAPH_MEM_RESERVED_CURRENT, &res) == 0) {
        uint64_t idle = res > used ? res - used : 0;
        grow = need > idle ? need - idle : 0;
    }
    pthread_mutex_unlock(&g_gr_mu);
    if (grow && mg_charge(grow) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(e, s);
    pthread_mutex_lock(&g_gr_mu);
    if (dev >= 0 && dev < MG_GR_DEVS) g_gr_counted[dev] += grow; /* the charge stands for pool memory */
    else mg_uncharge(grow);
    x = rc == CUDA_SUCCESS ? gx_find(e) : NULL;
    if (x && !x->mapped) {
        x->mapped = 1;
        atomic_fetch_sub(&mg_graph_unmapped, 1);
    }
    reconcile(dev);
    pthread_mutex_unlock(&g_gr_mu);
    if (rc != CUDA_SUCCESS) mg_maybe_return_grant();
    return rc;
}

CUresult mg_h_cuGraphUpload(CUgraphExec e, CUstream s) {
    mg_swap_gate();
    if (!mg_on()) return CALL_REAL(cuGraphUpload, e, s);
    return mg_graph_launch(mg_real(S_cuGraphUpload), e, s);
}
CUresult mg_h_cuGraphUpload_ptsz(CUgraphExec e, CUstream s) {
    mg_swap_gate();
    if (!mg_on()) return CALL_REAL(cuGraphUpload_ptsz, e, s);
    return mg_graph_launch(mg_real(S_cuGraphUpload_ptsz), e, s);
}

CUresult mg_h_cuGraphExecDestroy(CUgraphExec e) {
    mg_swap_gate();
    CUresult rc = CALL_REAL(cuGraphExecDestroy, e);
    if (rc != CUDA_SUCCESS || !mg_on()) return rc;
    pthread_mutex_lock(&g_gr_mu);
    mg_gexec_t *x = gx_find(e);
    if (x) {
        CUdevice dev = x->dev;
        gx_drop(x);
        reconcile(dev); /* its memory stays in the pool (counted) until a trim */
    }
    pthread_mutex_unlock(&g_gr_mu);
    return rc;
}

/* A trim takes their memory from executable graphs that are neither running nor
 * queued; their next upload or launch takes it again. Which ones it took the
 * driver does not say, so every executable graph of the device is checked again
 * at its next upload or launch (one that kept its memory is charged what the
 * pool lacks for it until the launch's reconcile corrects it: at worst a false
 * OUT_OF_MEMORY for a graph that was running while trimmed at the limit). */
CUresult mg_h_cuDeviceGraphMemTrim(CUdevice dev) {
    mg_swap_gate();
    CUresult rc = CALL_REAL(cuDeviceGraphMemTrim, dev);
    if (rc != CUDA_SUCCESS || !mg_on()) return rc;
    pthread_mutex_lock(&g_gr_mu);
    for (size_t i = 0; i < g_gx_n; i++)
        if (g_gx[i].dev == dev && g_gx[i].mapped) {
            g_gx[i].mapped = 0;
            atomic_fetch_add(&mg_graph_unmapped, 1);
        }
    reconcile(dev);
    pthread_mutex_unlock(&g_gr_mu);
    mg_maybe_return_grant();
    return rc;
}

/* --- stream capture: while any stream captures, stream-ordered allocations
 * check whether theirs does (see mg_pool_alloc in mg_pool.c). --- */

static void capture_began(CUresult rc) {
    if (rc == CUDA_SUCCESS) atomic_fetch_add(&mg_capturing, 1);
}

static CUresult capture_ended(CUresult rc, int was, CUstream s) {
    if (was && !mg_stream_capturing(s)) {
        unsigned cur = atomic_load(&mg_capturing);
        while (cur && !atomic_compare_exchange_weak(&mg_capturing, &cur, cur - 1)) {
        }
    }
    return rc;
}

CUresult mg_h_cuStreamBeginCapture(CUstream s) {
    mg_swap_gate();
    CUresult rc = CALL_REAL(cuStreamBeginCapture, s);
    capture_began(rc);
    return rc;
}
CUresult mg_h_cuStreamBeginCapture_v2(CUstream s, int mode) {
    mg_swap_gate();
    CUresult rc = CALL_REAL(cuStreamBeginCapture_v2, s, mode);
    capture_began(rc);
    return rc;
}
CUresult mg_h_cuStreamBeginCapture_v2_ptsz(CUstream s, int mode) {
    mg_swap_gate();
    CUresult rc = CALL_REAL(cuStreamBeginCapture_v2_ptsz, s, mode);
    capture_began(rc);
    return rc;
}
CUresult mg_h_cuStreamBeginCaptureToGraph(CUstream s, CUgraph g, const CUgraphNode *deps, const void *edgeData,
                                          size_t n, int mode) {
    mg_swap_gate();
    CUresult rc = CALL_REAL(cuStreamBeginCaptureToGraph, s, g, deps, edgeData, n, mode);
    capture_began(rc);
    return rc;
}
CUresult mg_h_cuStreamBeginCaptureToGraph_ptsz(CUstream s, CUgraph g, const CUgraphNode *deps,
                                               const void *edgeData, size_t n, int mode) {
    mg_swap_gate();
    CUresult rc = CALL_REAL(cuStreamBeginCaptureToGraph_ptsz, s, g, deps, edgeData, n, mode);
    capture_began(rc);
    return rc;
}
CUresult mg_h_cuStreamEndCapture(CUstream s, CUgraph *g) {
    mg_swap_gate();
    int was = mg_stream_capturing(s);
    return capture_ended(CALL_REAL(cuStreamEndCapture, s, g), was, s);
}
CUresult mg_h_cuStreamEndCapture_ptsz(CUstream s, CUgraph *g) {
    mg_swap_gate();
    int was = mg_stream_capturing(s);
    return capture_ended(CALL_REAL(cuStreamEndCapture_ptsz, s, g), was, s);
}

/* A forked child has no graphs of its parent's. */
static void mg_graph_atfork_child(void) {
    pthread_mutex_init(&g_gr_mu, NULL);
    g_gx_n = 0;
    memset(g_gr_counted, 0, sizeof g_gr_counted);
    atomic_store(&mg_graph_unmapped, 0);
    atomic_store(&mg_capturing, 0);
}

__attribute__((constructor)) static void mg_graph_init(void) { pthread_atfork(NULL, NULL, mg_graph_atfork_child); }

MG_SYMBOLS_GRAPH(MG_XALIAS)
