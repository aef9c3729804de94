#!/usr/bin/env bash
# The test suite: the CPU tests, then the multi-rank tests under MPI with 2 and 4 ranks.
# On a GPU node, add the GPU suite with `tools/gpu_suite.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
MPIEXEC=${MPIEXEC:-mpiexec}
# Open MPI refuses to run as root without these; MPICH ignores unknown variables.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Caches go to one temporary directory shared by every step (and every rank), removed at the end, not to the
# user's home: the kernels the tests compile, and the directory CuPy makes when imported. A cache directory
# the user chose is used as it is.
if [ -z "${DEEPEP_CUPY_CACHE_DIR:-}" ] || [ -z "${CUPY_CACHE_DIR:-}" ] || [ -z "${MPLCONFIGDIR:-}" ]; then
    TEST_CACHE=$(mktemp -d "${TMPDIR:-/tmp}/deepep_cupy_test_cache.XXXXXX")
    trap 'rm -rf "$TEST_CACHE"' EXIT
    export DEEPEP_CUPY_CACHE_DIR=${DEEPEP_CUPY_CACHE_DIR:-$TEST_CACHE/deepep_cupy}
    export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$TEST_CACHE/cupy}
    export MPLCONFIGDIR=${MPLCONFIGDIR:-$TEST_CACHE/matplotlib}
fi

python -m pytest tests/unit -q -p no:cacheprovider "$@"
for n in 2 4; do
    echo "== tests/mpi with $n ranks"
    "$MPIEXEC" -n "$n" python -m pytest tests/mpi -q -p no:cacheprovider -x
done
echo "== examples/quickstart.py with 4 ranks"
"$MPIEXEC" -n 4 python examples/quickstart.py
