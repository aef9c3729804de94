#!/usr/bin/env bash
# Run a command on the CPUs of the NUMA node of this rank's GPU (local rank r uses GPU r), so that host-side
# timings on a host with several NUMA nodes do not depend on where the scheduler put the process:
#   mpirun -np 2 tools/gpu_affine.sh python3 tools/deepep_compare.py
# Where the host does not say (a VM reports node -1), the command runs as it is.
r=${OMPI_COMM_WORLD_LOCAL_RANK:-${LOCAL_RANK:-0}}
bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader -i "$r" 2>/dev/null | tr 'A-F' 'a-f')
node=$(cat "/sys/bus/pci/devices/${bus#0000}/numa_node" 2>/dev/null || echo -1)
if [ "${node:--1}" -ge 0 ] && [ -r "/sys/devices/system/node/node$node/cpulist" ]; then
    exec taskset -c "$(cat "/sys/devices/system/node/node$node/cpulist")" "$@"
fi
exec "$@"
