#!/usr/bin/env bash
# DeepEP's own test scripts, unmodified, run against this library and (when built) against DeepEP itself,
# on the GPUs of this machine:
#   bash tools/deepep_tests.sh DEEPEP_DIR [test ...]
# tests: low_latency (default), low_latency_logfmt, low_latency_pressure, intranode. DEEPEP_DIR is a DeepEP
# V1 checkout; DeepEP is run too when DEEPEP_DIR holds its built extension (deep_ep_cpp*.so, see
# tools/build_deepep.sh). This library is loaded as `deep_ep` through DEEPEP_CUPY_AS_DEEP_EP=1.
# Each run's log goes to $OUT (default ./gpu-logs); the lines the tests print their timings on are
# printed at the end, one block per library. NGPU (default: all GPUs) processes; TEST_TIMEOUT (default 300 s)
# bounds each script (--pressure-test never ends by itself); LIBS (default "deepep deepep_cupy") picks the
# libraries.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEEPEP=$(cd "${1:?usage: deepep_tests.sh DEEPEP_DIR [test ...]}" && pwd); shift
OUT=${OUT:-$ROOT/gpu-logs}; mkdir -p "$OUT"
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
LIMIT=${TEST_TIMEOUT:-300}
TESTS=${*:-low_latency}
NVSHMEM_LIB=$(python3 -c 'import importlib.util as u; print(list(u.find_spec("nvidia.nvshmem").submodule_search_locations)[0] + "/lib")' 2>/dev/null)

args_of() {
    case $1 in
        low_latency) echo "test_low_latency.py --num-processes $NGPU" ;;
        low_latency_logfmt) echo "test_low_latency.py --num-processes $NGPU --use-logfmt" ;;
        low_latency_pressure) echo "test_low_latency.py --num-processes $NGPU --pressure-test" ;;
        intranode) echo "test_intranode.py --num-processes $NGPU" ;;
        *) echo "unknown test $1" >&2; return 1 ;;
    esac
}

run_one() {  # library (deepep_cupy | deepep), test
    local lib=$1 test=$2 log="$OUT/deepep-$2-$1.log" rc
    local script; script=$(args_of "$test") || return 1
    if [ "$lib" = deepep ]; then
        (cd "$DEEPEP/tests" && PYTHONPATH="$DEEPEP${PYTHONPATH:+:$PYTHONPATH}" \
            LD_LIBRARY_PATH="$NVSHMEM_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
            timeout "$LIMIT" python3 $script) > "$log" 2>&1
    else
        (cd "$DEEPEP/tests" && PYTHONPATH="$ROOT${ALIAS_PATH:+:$ALIAS_PATH}${PYTHONPATH:+:$PYTHONPATH}" DEEPEP_CUPY_AS_DEEP_EP=1 \
            timeout "$LIMIT" python3 $script) > "$log" 2>&1
    fi
    rc=$?
    echo "== $test through $lib: rc $rc ($log)"
    # The timing lines of DeepEP's scripts, and the last lines when the script failed.
    grep -E "avg_t|Kernel performance|Best|bandwidth|dispatch|combine" "$log" | grep -E "us|GB/s|passed" | tail -12
    if [ $rc -ne 0 ]; then tail -8 "$log"; fi
}

# DEEPEP_CUPY_AS_DEEP_EP acts through deepep_cupy_alias.pth, which a pip install puts into site-packages. Run from
# a source checkout (PYTHONPATH only) it is not there, and DeepEP's scripts, whose spawned workers import deep_ep
# too, would find none: give those runs a folder with the hook and a sitecustomize.py that loads it.
ALIAS_PATH=
if ! DEEPEP_CUPY_AS_DEEP_EP=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
    'import sys; sys.exit(not any(getattr(f, "_deepep_cupy_alias", False) for f in sys.meta_path))' 2>/dev/null; then
    ALIAS_PATH=$(mktemp -d /tmp/deepep-cupy-alias.XXXXXX)
    trap 'rm -rf "$ALIAS_PATH"' EXIT
    cp "$ROOT/deepep_cupy/deepep_cupy_alias.pth" "$ALIAS_PATH/"
    printf 'import site\nsite.addsitedir(%s)\n' "'$ALIAS_PATH'" > "$ALIAS_PATH/sitecustomize.py"
    echo "deepep_cupy's start-up hook is not installed: loading it from $ALIAS_PATH for its runs"
fi

LIBS=${LIBS:-deepep deepep_cupy}
for test in $TESTS; do
    for lib in $LIBS; do
        if [ "$lib" = deepep ] && ! compgen -G "$DEEPEP/deep_ep_cpp*.so" >/dev/null; then continue; fi
        run_one "$lib" "$test"
    done
done
