"""What the GPUs and their driver report, read through NVML.

inventory   the node's GPUs, memory and topology (NVML's helpers, in worker threads)
health      GPU health as NVML reports it; healthsync follows it into the ledger
processes   the processes NVML lists per GPU, mapped to containers
truth       the driver's count of what each container holds, and when a usage file is believed
activity    per-container GPU utilisation and idleness, from NVML's samples
nodelabels  the Node labels that describe the GPUs
dra_devices the DRA ResourceSlice's device for each shareable GPU (attributes, capacity, taints)
dra_slices  the node's ResourceSlice kept as the GPUs and their health are (mode dra)
"""
