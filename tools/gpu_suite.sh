#!/usr/bin/env bash
# GPU suite and benchmarks in one call, for a GPU node with Open MPI's mpirun:
#   bash tools/gpu_suite.sh [stage ...]     stages: info compile tests-layout tests-misc tests-intranode tests-ep
#       tests-low-latency tests-hooks tests-graphs tests-frameworks tests-pressure tests-internode startup host bench
#       deepep host-compare   (tests-hooks: the hook-mode files of tests-low-latency alone; host-compare:
#       the host bench here and in BASE_DIR, alternated REPEAT times, medians side by side)
# Wheels missing on the node (e.g. nvshmem4py) may be placed in .whl/ and are installed first.
# Logs go to $OUT (default ./gpu-logs); a summary table is printed last.
# MPS_PCT=<p>: run the NGPU ranks on one GPU under MPS, each rank limited to p% of its SMs. A low-latency
# launch needs all of its blocks resident at once, so the ranks' grids must fit side by side: before any
# stage, tools/mps_residency.py checks that they do and the summary says so (on one H100: 2 ranks at 40%
# and 4 at 10% pass, 4 at 20% does not; but 4 at 10% leave 12 SMs a rank, fewer than the intranode
# kernels' default 20). Correctness only: the ranks share one GPU's memory and SMs, so timings are not
# those of separate GPUs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-logs}; mkdir -p "$OUT"
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export DEEPEP_CUPY_CACHE_DIR=${DEEPEP_CUPY_CACHE_DIR:-/tmp/deepep-cupy-cache} DEEPEP_CUPY_TIMEOUT_S=${DEEPEP_CUPY_TIMEOUT_S:-60}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
MPIRUN=(mpirun --allow-run-as-root --oversubscribe -np "$NGPU" --bind-to none
        -x PYTHONPATH -x NVSHMEM_DISABLE_NVLS -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST
        -x PYTHONUNBUFFERED)
for var in $(compgen -e | grep '^DEEPEP_CUPY_'); do MPIRUN+=(-x "$var"); done  # the library's settings, as given
if [ -n "${MPS_PCT:-}" ]; then
    nvidia-cuda-mps-control -d && trap 'echo quit | nvidia-cuda-mps-control' EXIT
    export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$MPS_PCT
    MPIRUN+=(-x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)
fi
STAGES=${*:-info compile tests-layout tests-misc tests-intranode tests-ep tests-low-latency tests-graphs tests-frameworks tests-pressure tests-internode startup bench}
SUMMARY=()
if [ -n "${MPS_PCT:-}" ]; then
    timeout 120 "${MPIRUN[@]}" python3 tools/mps_residency.py > "$OUT/mps_residency.log" 2>&1
    rc=$?
    grep -h MPS_RESIDENCY "$OUT/mps_residency.log"
    if [ $rc -eq 0 ]; then
        SUMMARY+=("mps residency: every rank's grid started whole at ${MPS_PCT}% each")
    elif [ $rc -ne 3 ]; then  # 3: some grid started in part; 124: the 120 s limit above; else the probe failed
        SUMMARY+=("mps residency: the probe did not finish (rc $rc, $OUT/mps_residency.log)")
    else  # reported, not fatal: the intranode suites need more SMs than a share that passes gives at 4 ranks
        SUMMARY+=("mps residency FAILED (rc $rc): at ${MPS_PCT}% each a rank's grid can start in part, so low-latency\
 waits may time out here because of MPS, not the kernels ($OUT/mps_residency.log)")
    fi
fi

stage_info() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpus.txt" 2>&1
    nvidia-smi topo -m >> "$OUT/gpus.txt" 2>&1
    python3 -c "import cupy, cuda.bindings, numpy, torch, mpi4py; print('cupy', cupy.__version__, 'torch', torch.__version__)" \
        >> "$OUT/gpus.txt" 2>&1
    SUMMARY+=("info: $(head -2 "$OUT/gpus.txt" | tail -1)")
}

stage_compile() {
    # Every shipped kernel into the cache, in parallel (cold on a fresh node), then a verifying pass.
    timeout 600 python3 -m deepep_cupy.jit precompile > "$OUT/compile.log" 2>&1
    local rc=$?
    timeout 120 python3 -m deepep_cupy.jit precompile >> "$OUT/compile.log" 2>&1
    SUMMARY+=("compile (rc $rc): $(grep -h '^precompile: .* compiled' "$OUT/compile.log" | tr '\n' ';')")
}

run_tests() {  # name, test path, timeout
    local name=$1 path=$2 limit=$3
    timeout "$limit" "${MPIRUN[@]}" bash -c "python3 -m pytest $path -q -p no:cacheprovider ${PYTEST_ARGS:--x} --timeout=$limit \
        > $OUT/$name.rank\$OMPI_COMM_WORLD_RANK.log 2>&1"
    local rc=$?
    SUMMARY+=("$name (rc $rc): $(for f in "$OUT"/$name.rank*.log; do tail -1 "$f"; done | tr '\n' ';')")
}

stage_tests-layout() { run_tests tests-layout tests/gpu/test_layout.py 300; }
stage_tests-intranode() { run_tests tests-intranode tests/gpu/test_intranode.py 300; }
stage_tests-ep() { run_tests tests-ep tests/gpu/test_ep.py ${EP_TIMEOUT:-300}; }  # DeepEP V2's API (ElasticBuffer, EPBuffer)
# Hook mode: late peers, two micro-batches in flight, faults.
HOOK_TESTS="tests/gpu/test_low_latency_hooks.py tests/gpu/test_low_latency_overlap.py tests/gpu/test_low_latency_faults.py"
stage_tests-low-latency() { run_tests tests-low-latency "tests/gpu/test_low_latency.py $HOOK_TESTS" ${LL_TIMEOUT:-420}; }
stage_tests-hooks() { run_tests tests-hooks "$HOOK_TESTS" ${LL_TIMEOUT:-420}; }
stage_tests-graphs() { run_tests tests-graphs "tests/gpu/test_torch_graphs.py tests/gpu/test_torch_graphs_intranode.py" 300; }
stage_tests-internode() {  # every GPU its own domain: all traffic crosses NVSHMEM
    export DEEPEP_CUPY_NVL_RANKS=${NVL_RANKS:-1}
    local saved=("${MPIRUN[@]}"); MPIRUN+=(-x DEEPEP_CUPY_NVL_RANKS)
    run_tests tests-internode tests/gpu/test_internode.py ${IN_TIMEOUT:-240}
    MPIRUN=("${saved[@]}"); unset DEEPEP_CUPY_NVL_RANKS
}
stage_tests-pressure() { run_tests tests-pressure tests/gpu/test_pressure.py 300; }

stage_startup() {
    local cold; cold=$(mktemp -d)
    DEEPEP_CUPY_CACHE_DIR=$cold timeout 200 "${MPIRUN[@]}" python3 tools/startup_times.py cold > "$OUT/startup.log" 2>&1
    DEEPEP_CUPY_CACHE_DIR=$cold timeout 120 "${MPIRUN[@]}" python3 tools/startup_times.py warm >> "$OUT/startup.log" 2>&1
    SUMMARY+=("$(grep -h STARTUP "$OUT/startup.log" | tr '\n' ';')")
}

stage_host() {  # each op's host time with its profile and the floors, then the host bench (host vs GPU, decode step)
    timeout 240 "${MPIRUN[@]}" python3 tools/host_profile.py ${HOST_PROFILE_ARGS:-} --out "$OUT/host_profile.txt" > "$OUT/host.log" 2>&1
    timeout 240 "${MPIRUN[@]}" python3 -m deepep_cupy.bench host > "$OUT/bench_host.log" 2>&1
    SUMMARY+=("host: $(grep -hE '^(HOST|FLOOR) ' "$OUT/host_profile.txt" 2>/dev/null | tr -s ' ' | tr '\n' ';')")
}

stage_host-compare() {  # the host bench of this tree and of BASE_DIR (another checkout), alternated REPEAT times
    local base=${BASE_DIR:?set BASE_DIR to the checkout to compare with} i out
    out=$(cd "$OUT" && pwd)  # the base's runs write here from inside $base
    for i in $(seq "${REPEAT:-3}"); do
        timeout 240 "${MPIRUN[@]}" python3 -m deepep_cupy.bench host --json "$out/host-after-$i.json" \
            > "$out/host-after-$i.log" 2>&1
        (cd "$base" && PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 240 "${MPIRUN[@]}" -x PYTHONPATH \
            python3 -m deepep_cupy.bench host --json "$out/host-before-$i.json") > "$out/host-before-$i.log" 2>&1
    done
    python3 -m deepep_cupy.bench.compare --before "$out"/host-before-*.json --after "$out"/host-after-*.json \
        > "$out/host_compare.txt" 2>&1
    SUMMARY+=("host-compare: $OUT/host_compare.txt (medians of ${REPEAT:-3} alternated runs, $base before)")
}

stage_tests-misc() {
    run_tests tests-misc "tests/gpu/test_buffer_misc.py tests/gpu/test_mixed_modes.py tests/gpu/test_handle_values.py" 240
}
stage_tests-frameworks() {
    run_tests tests-frameworks "tests/gpu/test_frameworks.py tests/gpu/test_torch_compile.py" ${FW_TIMEOUT:-300}
}
stage_deepep() {  # DeepEP's own test scripts through the alias (and DeepEP itself when built): DEEPEP_DIR=...
    OUT=$OUT bash tools/deepep_tests.sh "${DEEPEP_DIR:?set DEEPEP_DIR to a DeepEP checkout}" \
        ${DEEPEP_TESTS:-low_latency low_latency_logfmt intranode} > "$OUT/deepep.log" 2>&1
    SUMMARY+=("deepep: $(grep -c '^== ' "$OUT/deepep.log") runs, see below")
}

stage_bench() {
    timeout 420 "${MPIRUN[@]}" python3 -m deepep_cupy.bench ${BENCH_SUITE:-all} ${BENCH_ARGS:-} --suite-timeout ${SUITE_TIMEOUT:-180} --num-sms 24 --json "$OUT/bench.json" \
        --plot "$OUT/bench.png" > "$OUT/bench.log" 2>&1
    SUMMARY+=("bench (rc $?): see table below")
}

for s in $STAGES; do
    echo "== $s ($(date +%T))"
    "stage_$s"
done
{
    echo
    echo "================ summary ($NGPU ranks)"
    printf '%s\n' "${SUMMARY[@]}"
    if [ -f "$OUT/bench.log" ]; then sed -n '/ranks, /,$p' "$OUT/bench.log"; fi
    if [ -f "$OUT/deepep.log" ]; then cat "$OUT/deepep.log"; fi
    if [ -f "$OUT/host_compare.txt" ]; then cat "$OUT/host_compare.txt"; fi
} | tee "$OUT/summary.txt"
if [ -n "${PACK:-}" ]; then
    # Few files come back from a remote run: keep the summary, table and plot, pack the logs.
    (cd "$OUT" && tar czf "logs-$NGPU.tgz" --exclude='*.tgz' --exclude=summary.txt --exclude='bench*.png' \
        --exclude='bench*.json' ./*.log ./*.txt 2>/dev/null && rm -f ./*.log)
fi
