#!/usr/bin/env bash
# Build DeepEP V1 (commit 567632d) in place on the GPU machine, without network.
#
# Usage:  bash build_deepep.sh DEEPEP_SRC_DIR [CARRY_DIR]
#   DEEPEP_SRC_DIR  an exported DeepEP tree (setup.py, csrc/, deep_ep/, tests/).
#   CARRY_DIR       optional folder carried to the machine, with (only what the machine lacks):
#                     ib-include/infiniband/mlx5dv.h ...  (rdma-core headers; DeepEP's configs.cuh includes
#                                                         <infiniband/mlx5dv.h> whenever NVSHMEM is on)
#                     wheels/ninja-*.whl                   (torch's BuildExtension needs ninja for -dlink)
# Env overrides: PYTHON (python3), CUDA_HOME (/usr/local/cuda), TORCH_CUDA_ARCH_LIST (9.0), MAX_JOBS (16),
#   DISABLE_AGGRESSIVE_PTX_INSTRS (setup.py's default 1 = off; 0 turns the .L1::no_allocate loads on).
# Result: $SRC/deep_ep_cpp.cpython-*.so next to $SRC/deep_ep/. Use with PYTHONPATH=$SRC (see the end).
set -euo pipefail

SRC=$(cd "${1:?usage: build_deepep.sh DEEPEP_SRC_DIR [CARRY_DIR]}" && pwd)
CARRY=${2:-}
if [ -n "$CARRY" ]; then CARRY=$(cd "$CARRY" && pwd); fi
PY=${PYTHON:-python3}
TOOLS=$(mktemp -d /tmp/deepep-build-tools.XXXXXX)

export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH="$CUDA_HOME/bin:$PATH"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-16}
export DISABLE_AGGRESSIVE_PTX_INSTRS=${DISABLE_AGGRESSIVE_PTX_INSTRS:-1}

[ -f "$SRC/setup.py" ] && [ -f "$SRC/csrc/kernels/internode_ll.cu" ] || { echo "not a DeepEP tree: $SRC" >&2; exit 2; }
command -v nvcc >/dev/null || { echo "nvcc not found under CUDA_HOME=$CUDA_HOME" >&2; exit 2; }

# 1. NVSHMEM from the pip wheel. With NVSHMEM_DIR unset, setup.py finds nvidia.nvshmem itself and links
#    -l:libnvshmem_host.so.3 (the wheel's only name) with an rpath to the wheel's lib/. A NVSHMEM_DIR
#    left in the environment would make it ask for an unversioned libnvshmem_host.so instead.
unset NVSHMEM_DIR
NVSHMEM_PKG=$("$PY" -c 'import importlib.util as u; s = u.find_spec("nvidia.nvshmem"); print(list(s.submodule_search_locations)[0])')
ls "$NVSHMEM_PKG"/lib/libnvshmem_host.so.* "$NVSHMEM_PKG/lib/libnvshmem_device.a" "$NVSHMEM_PKG/include/nvshmem.h" >/dev/null \
  || { echo "nvidia-nvshmem wheel incomplete at $NVSHMEM_PKG" >&2; exit 2; }
echo "NVSHMEM wheel: $NVSHMEM_PKG"

# 2. Headers g++ does not find by itself. nvcc 13 adds include/cccl on its own; g++ compiling deep_ep.cpp
#    reaches <cuda/std/...> through nvshmem.h. CPATH is read by g++ and by the host preprocessor nvcc runs.
CPATH_ADD="$CUDA_HOME/include/cccl"
have_ib=0
for d in /usr/include /usr/local/include; do
  if [ -f "$d/infiniband/mlx5dv.h" ]; then have_ib=1; fi
done
if [ $have_ib = 0 ]; then
  if [ -n "$CARRY" ] && [ -f "$CARRY/ib-include/infiniband/mlx5dv.h" ]; then
    CPATH_ADD="$CPATH_ADD:$CARRY/ib-include"
    echo "infiniband headers: $CARRY/ib-include"
  else
    echo "infiniband/mlx5dv.h not found: pass a CARRY_DIR with ib-include/infiniband/ (rdma-core headers)" >&2
    exit 2
  fi
fi
# torch's ATen/cuda/CUDAContextLight.h (included by deep_ep.cpp) needs the cuBLAS/cuSPARSE/cuSOLVER headers:
# a full toolkit has them; otherwise take them from torch's nvidia-* wheels.
if [ ! -f "$CUDA_HOME/include/cusparse.h" ]; then
  WHEEL_INC=$("$PY" - <<'EOF'
import glob, importlib.util, os
seen = []
for root in importlib.util.find_spec("nvidia").submodule_search_locations:
    for h in ("cusparse.h", "cublas_v2.h", "cublasLt.h", "cusolverDn.h"):
        for f in glob.glob(os.path.join(root, "**", "include", h), recursive=True):
            d = os.path.dirname(f)
            if d not in seen:
                seen.append(d)
print(":".join(seen))
EOF
)
  [ -n "$WHEEL_INC" ] || { echo "cusparse.h etc. not in $CUDA_HOME/include nor in nvidia-* wheels" >&2; exit 2; }
  CPATH_ADD="$CPATH_ADD:$WHEEL_INC"
fi
export CPATH="$CPATH_ADD${CPATH:+:$CPATH}"
echo "CPATH=$CPATH"

# 3. ninja (BuildExtension refuses -dlink without it).
if ! command -v ninja >/dev/null; then
  whl=$(ls "${CARRY:-/nonexistent}"/wheels/ninja-*.whl 2>/dev/null | head -1 || true)
  [ -n "$whl" ] || { echo "ninja missing: pass a CARRY_DIR with wheels/ninja-*.whl" >&2; exit 2; }
  "$PY" - "$whl" "$TOOLS/bin" <<'EOF'
import os, sys, zipfile
whl, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith(".data/scripts/ninja"))
    with open(os.path.join(out, "ninja"), "wb") as f:
        f.write(z.read(name))
os.chmod(os.path.join(out, "ninja"), 0o755)
EOF
  export PATH="$TOOLS/bin:$PATH"
fi
ninja --version >/dev/null

# 4. -lcuda: link against the driver library; give the linker an unversioned name if only .so.1 exists.
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so '; then
  for f in $(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF}') \
           /usr/lib/x86_64-linux-gnu/libcuda.so.1 /usr/lib64/libcuda.so.1 "$CUDA_HOME"/lib64/stubs/libcuda.so; do
    if [ -e "$f" ]; then mkdir -p "$TOOLS/lib" && ln -sf "$f" "$TOOLS/lib/libcuda.so"; break; fi
  done
  if [ -e "$TOOLS/lib/libcuda.so" ]; then export LIBRARY_PATH="$TOOLS/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"; fi
fi

# 5. Build in place (no pip, no build isolation, nothing downloaded).
cd "$SRC"
echo "building DeepEP in $SRC (arch $TORCH_CUDA_ARCH_LIST, $MAX_JOBS jobs)"
start=$(date +%s)
set +e
"$PY" setup.py build_ext --inplace >"$SRC/build.log" 2>&1
rc=$?
set -e
grep -A8 "Build summary" "$SRC/build.log" || true
if [ "$rc" != 0 ]; then
  echo "build failed (rc=$rc), see $SRC/build.log; its error lines:" >&2
  grep -n -E "error|Error" "$SRC/build.log" | head -30 >&2 || true
  tail -20 "$SRC/build.log" >&2
  exit "$rc"
fi
echo "built in $(( $(date +%s) - start )) s: $(ls "$SRC"/deep_ep_cpp*.so)"

# 6. Smoke test: the extension loads and reports SM90.
PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}" LD_LIBRARY_PATH="$NVSHMEM_PKG/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  "$PY" -c 'import deep_ep; print("deep_ep ok, sm90:", deep_ep.Buffer.is_sm90_compiled(), "topk_idx_t:", deep_ep.topk_idx_t)'

cat <<EOF
Run DeepEP's own tests (2 GPUs):
  export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
  export PYTHONPATH=$SRC LD_LIBRARY_PATH=$NVSHMEM_PKG/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
  cd $SRC/tests && python3 test_intranode.py --num-processes 2
  cd $SRC/tests && python3 test_low_latency.py --num-processes 2
EOF
