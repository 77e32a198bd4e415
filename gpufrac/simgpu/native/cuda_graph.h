/*
 * simgpu fake libcuda.so.1: the graph structures shared by cuda_graph.c (capture,
 * building graphs) and cuda_graph_exec.c (executable graphs, graph memory).
 */
#ifndef GPUFRAC_SIMGPU_CUDA_GRAPH_H
#define GPUFRAC_SIMGPU_CUDA_GRAPH_H

#include "cuda_internal.h"

/* One alloc node's virtual range, shared by the node and the graphs made from it. */
typedef struct {
    uintptr_t base;
    size_t size; /* whole 2 MiB granules */
    int refs;    /* under cu_graph_lock */
} gmem_t;

struct CUgraphNode_st {
    cu_obj_t hdr;
    struct CUgraph_st *graph;
    int type; /* CU_GRAPH_NODE_TYPE_* */
    int kernel;
    uint64_t blocks; /* KERNEL: thread blocks of its grid */
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

/* Guards graphs, their nodes' gmem_t refcounts, executable graphs and the graph memory pool. */
extern SIM_HIDDEN pthread_mutex_t cu_graph_lock;
/* Drop a reference to an alloc node's range; the last one unmaps it. Caller holds cu_graph_lock. */
SIM_HIDDEN void cu_gmem_unref(gmem_t *m);

#endif
