/*
 * simgpu fake libnvidia-ml.so.1: event sets (nvmlEventSet*, delivered from
 * each GPU's event ring in the node-state file) and the fault-injection hook.
 */
#include <stdatomic.h>
#include <stdlib.h>

#include "nvml_internal.h"

/* ------------------------------------------------------------------ events */

/* Registration of one GPU in an event set. */
typedef struct {
    uint32_t gpu;
    unsigned long long mask;
    uint64_t seen;      /* last event sequence number delivered (or skipped) */
    int lost_reported;  /* GPU_IS_LOST returned once for the current loss */
} sim_reg_t;

struct nvmlEventSet_st {
    uint32_t magic;
    int nregs;
    sim_reg_t regs[SIMGPU_MAX_GPUS];
};
#define EVENT_SET_MAGIC 0x45564e54u

static nvmlReturn_t set_check(nvmlEventSet_t set) {
    if (!nv_node_if_init()) return NVML_ERROR_UNINITIALIZED;
    if (!set || set->magic != EVENT_SET_MAGIC) return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    if (!nv_node_if_init()) return NVML_ERROR_UNINITIALIZED;
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    struct nvmlEventSet_st *s = calloc(1, sizeof *s);
    if (!s) return NVML_ERROR_MEMORY;
    s->magic = EVENT_SET_MAGIC;
    *set = s;
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    nvmlReturn_t r = set_check(set);
    if (r != NVML_SUCCESS) return r;
    set->magic = 0;
    free(set);
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes) {
    DEV(device, g, idx);
    (void)g;
    (void)idx;
    if (!eventTypes) return NVML_ERROR_INVALID_ARGUMENT;
    *eventTypes = SIM_SUPPORTED_EVENTS;
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                               nvmlEventSet_t set) {
    DEV(device, g, idx);
    nvmlReturn_t r = set_check(set);
    if (r != NVML_SUCCESS) return r;
    if (eventTypes & ~SIM_SUPPORTED_EVENTS) return NVML_ERROR_NOT_SUPPORTED;
    sim_reg_t *reg = NULL;
    for (int i = 0; i < set->nregs; i++)
        if (set->regs[i].gpu == idx) reg = &set->regs[i];
    if (!reg) {
        reg = &set->regs[set->nregs++];
        reg->gpu = idx;
        reg->seen = atomic_load(&g->event_seq); /* only events from now on */
        reg->lost_reported = 0;
    }
    reg->mask |= eventTypes;
    return NVML_SUCCESS;
}

/* Next pending event of a registration that matches its mask; 1 if one was found. */
static int next_event(simgpu_gpu_t *g, sim_reg_t *reg, simgpu_event_t *out) {
    for (;;) {
        uint64_t last = atomic_load(&g->event_seq);
        if (reg->seen >= last) return 0;
        if (last - reg->seen > SIMGPU_EVENT_RING) reg->seen = last - SIMGPU_EVENT_RING; /* overrun: skip lost */
        uint64_t want = reg->seen + 1;
        simgpu_event_t *e = &g->events[(want - 1) % SIMGPU_EVENT_RING];
        if (__atomic_load_n(&e->seq, __ATOMIC_ACQUIRE) != want) return 0; /* writer not done yet */
        simgpu_event_t copy = {want, e->type, e->data, e->time_us};
        if (__atomic_load_n(&e->seq, __ATOMIC_ACQUIRE) != want) continue; /* overwritten meanwhile */
        reg->seen = want;
        if (copy.type & reg->mask) {
            *out = copy;
            return 1;
        }
    }
}

NVML_API nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    nvmlReturn_t r = set_check(set);
    if (r != NVML_SUCCESS) return r;
    if (!data) return NVML_ERROR_INVALID_ARGUMENT;
    simgpu_node_t *n = nv_node_if_init();
    uint64_t deadline = sim_now_ns() + (uint64_t)timeoutms * 1000000ull;
    for (;;) {
        /* Loaded before the scan: an event posted after it changes the word, so the
         * futex wait below returns at once instead of sleeping through it. */
        uint32_t seen = atomic_load(&n->event_wake);
        for (int i = 0; i < set->nregs; i++) {
            sim_reg_t *reg = &set->regs[i];
            simgpu_gpu_t *g = &n->gpus[reg->gpu];
            simgpu_event_t e;
            if (next_event(g, reg, &e)) {
                data->device = &nv_dev[reg->gpu];
                data->eventType = e.type;
                data->eventData = e.data;
                data->gpuInstanceId = data->computeInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT;
                return NVML_SUCCESS;
            }
            /* After its events, a GPU that fell off the bus says so once per loss. */
            if (atomic_load(&g->lost)) {
                if (!reg->lost_reported) {
                    reg->lost_reported = 1;
                    return NVML_ERROR_GPU_IS_LOST;
                }
            } else {
                reg->lost_reported = 0;
            }
        }
        uint64_t now = sim_now_ns();
        if (now >= deadline) return NVML_ERROR_TIMEOUT;
        /* Block like the real driver does. Loss is a plain flag nobody wakes us for,
         * and a poster killed between its event and its wake leaves the word as is:
         * look again at least every 50 ms for those. */
        uint64_t left = deadline - now;
        sim_event_sleep(n, seen, left < 50000000ull ? left : 50000000ull);
    }
}

NVML_API nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    return nvmlEventSetWait_v2(set, data, timeoutms);
}

/* ------------------------------------------------------------------ test hooks */

/* Fault injection from the test side (gpufrac/simgpu/faults.py): post an event to
 * a GPU's ring of a node-state file the caller has mapped. Goes through the same
 * atomic sequence as the fake drivers so concurrent posters never collide. Not
 * part of NVML (no nvml prefix). */
NVML_API int simgpu_post_event(void *node, unsigned int gpu, unsigned long long type, unsigned long long data) {
    simgpu_node_t *n = node;
    if (!n || n->magic != SIMGPU_MAGIC || gpu >= n->gpu_count) return -1;
    sim_post_event(n, gpu, type, data);
    return 0;
}
