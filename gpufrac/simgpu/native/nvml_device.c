/*
 * simgpu fake libnvidia-ml.so.1: a device's memory, PCI identity, NUMA and CPU
 * affinity, PCIe topology and NVLink.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "nvml_internal.h"

/* ------------------------------------------------------------------ memory */

static uint64_t used_of(simgpu_gpu_t *g) {
    /* A real driver frees a process's memory as the process dies; the simulation has no
     * one to do that at death, so the readers do it: dead processes' memory is given
     * back before any memory reading. */
    simgpu_node_t *n = sim_node();
    if (n) sim_reap_dead(n);
    uint64_t used = atomic_load(&g->used_bytes);
    uint64_t cap = g->total_bytes > g->reserved_bytes ? g->total_bytes - g->reserved_bytes : 0;
    return used > cap ? cap : used;
}

/* v1 counts the driver's reservation as used (as real NVML does since r510). */
NVML_API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    DEV(device, g, idx);
    (void)idx;
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t used = used_of(g) + g->reserved_bytes;
    if (used > g->total_bytes) used = g->total_bytes;
    memory->total = g->total_bytes;
    memory->used = used;
    memory->free = g->total_bytes - used;
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    DEV(device, g, idx);
    (void)idx;
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != nvmlMemory_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    uint64_t used = used_of(g);
    memory->total = g->total_bytes;
    memory->reserved = g->reserved_bytes;
    memory->used = used;
    memory->free = g->total_bytes - g->reserved_bytes - used;
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------ PCI */

static void fill_pci(const simgpu_gpu_t *g, nvmlPciInfo_t *pci) {
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.0", g->pci_domain & 0xFFFFu,
             g->pci_bus & 0xFFu, g->pci_device & 0xFFu);
    snprintf(pci->busId, sizeof pci->busId, "%s", g->pci_bus_id);
    pci->domain = g->pci_domain;
    pci->bus = g->pci_bus;
    pci->device = g->pci_device;
    pci->pciDeviceId = g->pci_device_id;
    pci->pciSubSystemId = g->pci_subsystem_id;
}

NVML_API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    DEV(device, g, idx);
    (void)idx;
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    fill_pci(g, pci);
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    return nvmlDeviceGetPciInfo_v3(device, pci);
}

NVML_API nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_v1_t *pci) {
    DEV(device, g, idx);
    (void)idx;
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlPciInfo_t full;
    fill_pci(g, &full);
    memset(pci, 0, sizeof *pci);
    memcpy(pci->busId, full.busIdLegacy, sizeof pci->busId);
    pci->domain = full.domain;
    pci->bus = full.bus;
    pci->device = full.device;
    pci->pciDeviceId = full.pciDeviceId;
    pci->pciSubSystemId = full.pciSubSystemId;
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlDeviceGetPciInfoExt(nvmlDevice_t device, nvmlPciInfoExt_v1_t *pci) {
    DEV(device, g, idx);
    (void)idx;
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    if (pci->version != nvmlPciInfoExt_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    nvmlPciInfo_t full;
    fill_pci(g, &full);
    pci->domain = full.domain;
    pci->bus = full.bus;
    pci->device = full.device;
    pci->pciDeviceId = full.pciDeviceId;
    pci->pciSubSystemId = full.pciSubSystemId;
    pci->baseClass = 0x03; /* display controller */
    pci->subClass = 0x02;  /* 3D controller, as datacenter GPUs report */
    memcpy(pci->busId, full.busId, sizeof pci->busId);
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------ NUMA / CPU affinity */

NVML_API nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node) {
    DEV(device, g, idx);
    (void)idx;
    if (!node) return NVML_ERROR_INVALID_ARGUMENT;
    if (g->numa_node < 0) return NVML_ERROR_NOT_SUPPORTED;
    *node = (unsigned int)g->numa_node;
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlDeviceGetCpuAffinityWithinScope(nvmlDevice_t device, unsigned int cpuSetSize,
                                                          unsigned long *cpuSet, nvmlAffinityScope_t scope) {
    DEV(device, g, idx);
    (void)idx;
    /* Node and socket scope coincide on the simulated nodes (one NUMA node per socket). */
    if (!cpuSet || cpuSetSize == 0 || scope > 1) return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < cpuSetSize; i++)
        cpuSet[i] = i < SIMGPU_CPU_WORDS ? (unsigned long)g->cpu_affinity[i] : 0;
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlDeviceGetCpuAffinity(nvmlDevice_t device, unsigned int cpuSetSize,
                                               unsigned long *cpuSet) {
    return nvmlDeviceGetCpuAffinityWithinScope(device, cpuSetSize, cpuSet, 0);
}

/* The NUMA nodes close to the GPU: how a real x86 node reports GPU locality. */
NVML_API nvmlReturn_t nvmlDeviceGetMemoryAffinity(nvmlDevice_t device, unsigned int nodeSetSize,
                                                  unsigned long *nodeSet, nvmlAffinityScope_t scope) {
    DEV(device, g, idx);
    (void)idx;
    if (!nodeSet || nodeSetSize == 0 || scope > 1) return NVML_ERROR_INVALID_ARGUMENT;
    memset(nodeSet, 0, sizeof(unsigned long) * nodeSetSize);
    if (g->numa_node >= 0 && (unsigned)g->numa_node / 64 < nodeSetSize)
        nodeSet[g->numa_node / 64] = 1UL << (g->numa_node % 64);
    return NVML_SUCCESS;
}

static int cpu_in(const simgpu_gpu_t *g, unsigned int cpu) {
    return cpu < SIMGPU_CPU_WORDS * 64 && (g->cpu_affinity[cpu / 64] >> (cpu % 64)) & 1;
}

/* The count/array protocol of the topology queries: *count == 0 asks for the
 * size; otherwise up to *count handles are written and *count is set. */
static nvmlReturn_t fill_devices(const uint32_t *phys, unsigned int found, unsigned int *count,
                                 nvmlDevice_t *deviceArray) {
    if (*count == 0) {
        *count = found;
        return NVML_SUCCESS;
    }
    if (!deviceArray) return NVML_ERROR_INVALID_ARGUMENT;
    if (*count < found) found = *count;
    for (unsigned int i = 0; i < found; i++) deviceArray[i] = &nv_dev[phys[i]];
    *count = found;
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlSystemGetTopologyGpuSet(unsigned int cpuNumber, unsigned int *count,
                                                  nvmlDevice_t *deviceArray) {
    simgpu_node_t *n = nv_node_if_init();
    if (!n) return NVML_ERROR_UNINITIALIZED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    uint32_t phys[SIMGPU_MAX_GPUS];
    unsigned int found = 0;
    int vc = atomic_load(&nv_visible_count);
    for (int i = 0; i < vc; i++)
        if (cpu_in(&n->gpus[nv_visible[i]], cpuNumber)) phys[found++] = nv_visible[i];
    return fill_devices(phys, found, count, deviceArray);
}

/* ------------------------------------------------------------------ topology / NVLink */

NVML_API nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1, nvmlDevice_t device2,
                                                          nvmlGpuTopologyLevel_t *pathInfo) {
    DEV(device1, g1, i1);
    DEV(device2, g2, i2);
    (void)i1;
    (void)g2;
    if (!pathInfo) return NVML_ERROR_INVALID_ARGUMENT;
    *pathInfo = g1->topo_level[i2];
    return NVML_SUCCESS;
}

/* GPUs (other than `device`) whose path to it is at `level` or closer. */
NVML_API nvmlReturn_t nvmlDeviceGetTopologyNearestGpus(nvmlDevice_t device, nvmlGpuTopologyLevel_t level,
                                                       unsigned int *count, nvmlDevice_t *deviceArray) {
    DEV(device, g, idx);
    if (!count || level > SIMGPU_TOPO_SYSTEM) return NVML_ERROR_INVALID_ARGUMENT;
    uint32_t phys[SIMGPU_MAX_GPUS];
    unsigned int found = 0;
    int vc = atomic_load(&nv_visible_count);
    for (int i = 0; i < vc; i++)
        if (nv_visible[i] != idx && g->topo_level[nv_visible[i]] <= level) phys[found++] = nv_visible[i];
    return fill_devices(phys, found, count, deviceArray);
}

/* Number of NVLink links usable between two GPUs: direct, or via the NVSwitch fabric. */
static unsigned nvlinks_between(const simgpu_gpu_t *a, uint32_t b_idx, const simgpu_gpu_t *b) {
    unsigned direct = 0, fa = 0, fb = 0;
    for (uint32_t l = 0; l < a->nvlink_count && l < SIMGPU_MAX_NVLINKS; l++) {
        if (a->nvlink_peer[l] == (int32_t)b_idx) direct++;
        if (a->nvlink_peer[l] == SIMGPU_NVLINK_NVSWITCH) fa++;
    }
    for (uint32_t l = 0; l < b->nvlink_count && l < SIMGPU_MAX_NVLINKS; l++)
        if (b->nvlink_peer[l] == SIMGPU_NVLINK_NVSWITCH) fb++;
    return direct + (fa < fb ? fa : fb);
}

/* A GPU without NVLink does not support the link queries; a link index past
 * the GPU's links is invalid. */
static nvmlReturn_t link_check(const simgpu_gpu_t *g, unsigned int link) {
    if (g->nvlink_count == 0) return NVML_ERROR_NOT_SUPPORTED;
    if (link >= g->nvlink_count || link >= SIMGPU_MAX_NVLINKS) return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

#define LINK(g, link)                                     \
    do {                                                  \
        nvmlReturn_t _r = link_check((g), (link));        \
        if (_r != NVML_SUCCESS) return _r;                \
    } while (0)

NVML_API nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link,
                                               nvmlEnableState_t *isActive) {
    DEV(device, g, idx);
    (void)idx;
    LINK(g, link);
    if (!isActive) return NVML_ERROR_INVALID_ARGUMENT;
    *isActive = g->nvlink_peer[link] != -1;
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlDeviceGetNvLinkVersion(nvmlDevice_t device, unsigned int link, unsigned int *version) {
    DEV(device, g, idx);
    (void)idx;
    LINK(g, link);
    if (!version) return NVML_ERROR_INVALID_ARGUMENT;
    /* NVLink generation by architecture: Volta 2, Ampere 3, Hopper 4, Blackwell 5. */
    *version = g->cc_major >= 10 ? 5 : g->cc_major == 9 ? 4 : g->cc_major == 8 ? 3 : 2;
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlDeviceGetNvLinkCapability(nvmlDevice_t device, unsigned int link,
                                                    nvmlNvLinkCapability_t capability, unsigned int *capResult) {
    DEV(device, g, idx);
    (void)idx;
    LINK(g, link);
    if (!capResult || capability >= NVML_NVLINK_CAP_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    int up = g->nvlink_peer[link] != -1;
    switch (capability) {
    case NVML_NVLINK_CAP_P2P_SUPPORTED:
    case NVML_NVLINK_CAP_P2P_ATOMICS:
    case NVML_NVLINK_CAP_VALID: *capResult = (unsigned)up; break;
    default: *capResult = 0; /* x86 hosts: no NVLink to system memory, no SLI */
    }
    return NVML_SUCCESS;
}

/* NVSwitches of the fabric get PCI ids of their own; link l lands on switch l*4/18
 * (4 switches, as on DGX/HGX H100). */
static void nvswitch_pci(unsigned int link, nvmlPciInfo_t *pci) {
    unsigned bus = (0xC1u + link * 4 / SIMGPU_MAX_NVLINKS) & 0xFFu;
    memset(pci, 0, sizeof *pci);
    pci->bus = bus;
    pci->pciDeviceId = 0x22A310DEu; /* NVSwitch (Hopper generation) */
    pci->pciSubSystemId = 0x179610DEu;
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "0000:%02X:00.0", bus);
    snprintf(pci->busId, sizeof pci->busId, "00000000:%02X:00.0", bus);
}

NVML_API nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link,
                                                          nvmlPciInfo_t *pci) {
    DEV(device, g, idx);
    (void)idx;
    LINK(g, link);
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    int32_t peer = g->nvlink_peer[link];
    if (peer == SIMGPU_NVLINK_NVSWITCH) {
        nvswitch_pci(link, pci);
        return NVML_SUCCESS;
    }
    simgpu_node_t *n = nv_node_if_init();
    if (peer < 0 || (uint32_t)peer >= n->gpu_count) return NVML_ERROR_NOT_SUPPORTED;
    fill_pci(&n->gpus[peer], pci);
    return NVML_SUCCESS;
}

NVML_API nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link,
                                                          nvmlIntNvLinkDeviceType_t *pNvLinkDeviceType) {
    DEV(device, g, idx);
    (void)idx;
    LINK(g, link);
    if (!pNvLinkDeviceType) return NVML_ERROR_INVALID_ARGUMENT;
    int32_t peer = g->nvlink_peer[link];
    if (peer == -1) return NVML_ERROR_NOT_SUPPORTED;
    *pNvLinkDeviceType = peer == SIMGPU_NVLINK_NVSWITCH ? NVML_NVLINK_DEVICE_TYPE_SWITCH
                                                        : NVML_NVLINK_DEVICE_TYPE_GPU;
    return NVML_SUCCESS;
}

/* P2P: always over NVLink where the pair has links; over PCIe only below one host
 * bridge (across root complexes or sockets the chipset does not route it). */
NVML_API nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t device1, nvmlDevice_t device2,
                                             nvmlGpuP2PCapsIndex_t p2pIndex, nvmlGpuP2PStatus_t *p2pStatus) {
    DEV(device1, g1, i1);
    DEV(device2, g2, i2);
    (void)i1;
    if (!p2pStatus || p2pIndex >= NVML_P2P_CAPS_INDEX_UNKNOWN) return NVML_ERROR_INVALID_ARGUMENT;
    if (g1 == g2) return NVML_ERROR_INVALID_ARGUMENT;
    int nvl = nvlinks_between(g1, i2, g2) > 0;
    int pcie_ok = g1->topo_level[i2] <= SIMGPU_TOPO_HOSTBRIDGE;
    switch (p2pIndex) {
    case NVML_P2P_CAPS_INDEX_NVLINK: *p2pStatus = nvl ? NVML_P2P_STATUS_OK : NVML_P2P_STATUS_NOT_SUPPORTED; break;
    case NVML_P2P_CAPS_INDEX_PCI:
        *p2pStatus = pcie_ok ? NVML_P2P_STATUS_OK : NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED;
        break;
    default:
        *p2pStatus = (nvl || pcie_ok) ? NVML_P2P_STATUS_OK : NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED;
    }
    return NVML_SUCCESS;
}
