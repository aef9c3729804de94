#!/usr/bin/env bash
# The test suite: the CPU tests, then the multi-rank tests under MPI with 2 and 4 ranks.
# On a GPU node, add the GPU suite with `tools/gpu_suite.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
MPIEXEC=${MPIEXEC:-mpiexec}
# Open MPI refuses to run as root without these; MPICH ignores unknown variables.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

python -m pytest tests/unit -q -p no:cacheprovider "$@"
for n in 2 4; do
    echo "== tests/mpi with $n ranks"
    "$MPIEXEC" -n "$n" python -m pytest tests/mpi -q -p no:cacheprovider -x
done
echo "== examples/quickstart.py with 4 ranks"
"$MPIEXEC" -n 4 python examples/quickstart.py
