"""JIT compile/cache layer: NVRTC builds, cache hits and keys, errors, concurrency, NVSHMEM link. No GPU."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import time
from pathlib import Path

import pytest

from deepep_cupy.jit import BuildSpec, CompileError, build, cache_dir, use_source_root
from deepep_cupy.jit.compiler import toolchain

REPO_SRC = Path(__file__).resolve().parents[2] / "cuda_src"
ELF_MAGIC = b"\x7fELF"

TINY = r"""
#include "common/nvrtc_compat.cuh"
#include "lib/helper.cuh"

template <int kScale>
__global__ void scale_kernel(int* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = helper_value(i) * kScale * SCALE_BASE;
}

extern "C" __global__ void fill_kernel(int* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = helper_value(i);
}
"""

HELPER = '#pragma once\n#include "inner.cuh"\n__device__ __forceinline__ int helper_value(int i) { return i + kInner; }\n'
INNER = "#pragma once\nconstexpr int kInner = 1;\n"

BAD = r"""#include "common/nvrtc_compat.cuh"
extern "C" __global__ void broken(int* out) {
    int x = 1
    out[0] = x;
}
"""

HEADERS_USE = r"""
#include "common/nvrtc_compat.cuh"
#include "common/ptx.cuh"
#include "common/timeout.cuh"

extern "C" __global__ void uses_helpers(int* flag, int4* data, int64_t* wide, deepep_cupy::ErrorRecord* err,
                                        long long timeout_ns, int rank, int peer) {
    deepep_cupy::Deadline deadline(timeout_ns);
    if (deepep_cupy::ld_acquire_sys(flag) == 0 && deadline.expired()) return;
    int4 v = deepep_cupy::ld_nc_v4(data);
    int4 w = deepep_cupy::ld_v4(data + 1);
    v.x += w.x + deepep_cupy::lane_id();
    deepep_cupy::st_v4(data + 2, v);
    deepep_cupy::st_na_v4(data + 3, deepep_cupy::ld_volatile_v4(data + 4));
    deepep_cupy::st_release_sys(flag + 2, deepep_cupy::atomic_add_release_sys(flag + 3, 1));
    deepep_cupy::st_release_gpu(flag + 4, deepep_cupy::atomic_add_release_gpu(flag + 5, deepep_cupy::ld_acquire_gpu(flag + 6)));
    deepep_cupy::st_relaxed_sys(flag + 7, deepep_cupy::ld_relaxed_sys(flag + 8) + deepep_cupy::atomic_add_relaxed_sys(flag + 9, 1));
    deepep_cupy::st_volatile(flag + 10, deepep_cupy::atomic_cas_acq_rel_sys(flag + 11, 0, 1));
    deepep_cupy::st_release_sys(wide, deepep_cupy::ld_acquire_sys(wide + 1) + deepep_cupy::ld_acquire_gpu(wide + 2) +
                                     deepep_cupy::ld_volatile(wide + 3) + (int64_t)deepep_cupy::globaltimer());
    deepep_cupy::fence_acq_rel_sys();
    deepep_cupy::fence_acq_rel_gpu();
    if (deepep_cupy::timeout_reported(err)) return;
    deepep_cupy::report_timeout(err, 3, rank, peer, __LINE__, deadline.elapsed_ns());
}
"""

NVSHMEM_TINY = r"""
#include "common/nvshmem_includes.cuh"

extern "C" __global__ void put_to_next(int* sym) {
    const int peer = (nvshmem_my_pe() + 1) % nvshmem_n_pes();
    nvshmem_int_p(sym, nvshmem_my_pe(), peer);
    nvshmem_quiet();
}
"""


def _tiny_spec(scale: int = 2, base: int = 3) -> BuildSpec:
    return BuildSpec.make("tiny.cu", {"SCALE_BASE": base}, name_expressions=[f"scale_kernel<{scale}>"])


@pytest.fixture
def src_root(tmp_path, monkeypatch):
    """A private source tree: the package's common/ headers plus the small kernels above."""
    root = tmp_path / "src"
    shutil.copytree(REPO_SRC / "common", root / "common")
    (root / "lib").mkdir()
    (root / "tiny.cu").write_text(TINY)
    (root / "lib" / "helper.cuh").write_text(HELPER)
    (root / "lib" / "inner.cuh").write_text(INNER)
    (root / "bad.cu").write_text(BAD)
    (root / "headers_use.cu").write_text(HEADERS_USE)
    (root / "nvshmem_tiny.cu").write_text(NVSHMEM_TINY)
    monkeypatch.setenv("DEEPEP_CUPY_SOURCE_DIR", str(root))
    monkeypatch.setenv("DEEPEP_CUPY_CACHE_DIR", str(tmp_path / "cache"))
    return root


def _entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.glob("??/*") if p.is_dir())


def test_build_spec_make_sorts_and_stringifies():
    spec = BuildSpec.make("x.cu", {"B": 2, "A": True, "C": False}, ["k<1>"])
    assert spec.defines == (("A", "1"), ("B", "2"), ("C", "0"))
    assert spec.name_expressions == ("k<1>",)
    assert spec == BuildSpec.make("x.cu", {"C": False, "A": True, "B": 2}, ("k<1>",))
    with pytest.raises(ValueError):
        BuildSpec.make("x.cu", {"BAD NAME": 1})
    with pytest.raises(ValueError):
        BuildSpec("/abs/path.cu")


def test_session_cache_is_not_the_users():
    # conftest.py (or tools/run_tests.sh) points the caches away from the home directory for the whole run.
    assert os.environ.get("DEEPEP_CUPY_CACHE_DIR")


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DEEPEP_CUPY_CACHE_DIR", str(tmp_path / "a"))
    assert cache_dir() == tmp_path / "a"
    monkeypatch.delenv("DEEPEP_CUPY_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "deepep_cupy"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "deepep_cupy"


def test_tiny_kernel_compiles_then_hits_cache(src_root, capfd):
    spec = _tiny_spec()
    cold = build(spec, "sm_90")
    err = capfd.readouterr().err
    assert "deepep_cupy: compiling tiny.cu for sm_90 (SCALE_BASE=3, scale_kernel<2>) ..." in err
    assert "done in" in err
    assert not cold.from_cache
    assert cold.cubin_path.read_bytes()[:4] == ELF_MAGIC
    assert cold.lowered_names["scale_kernel<2>"].startswith("_Z")
    assert cold.cubin_path.parent.parent.name == cold.key[:2]
    meta = json.loads((cold.cubin_path.parent / "meta.json").read_text())
    assert meta["lowered_names"] == cold.lowered_names and meta["arch"] == "sm_90"

    start = time.perf_counter()
    warm = build(spec, "sm_90")
    elapsed = time.perf_counter() - start
    assert warm.from_cache and warm.key == cold.key and warm.cubin_path == cold.cubin_path
    assert warm.lowered_names == cold.lowered_names
    assert elapsed < 0.1, f"warm build took {elapsed:.3f} s"
    assert capfd.readouterr().err == ""  # the warm path is silent


def test_key_depends_on_headers_defines_and_arch(src_root):
    base = build(_tiny_spec(), "sm_90")
    assert build(_tiny_spec(base=4), "sm_90").key != base.key
    assert build(_tiny_spec(scale=5), "sm_90").key != base.key
    other_arch = build(_tiny_spec(), "sm_80")
    assert other_arch.key != base.key and not other_arch.from_cache

    # A header two levels down (included relative to its includer) changes the key.
    (src_root / "lib" / "inner.cuh").write_text("#pragma once\nconstexpr int kInner = 2;\n")
    changed = build(_tiny_spec(), "sm_90")
    assert changed.key != base.key and not changed.from_cache

    # Restoring it finds the first entry again.
    (src_root / "lib" / "inner.cuh").write_text(INNER)
    again = build(_tiny_spec(), "sm_90")
    assert again.key == base.key and again.from_cache


def test_same_sources_elsewhere_share_the_key(src_root, tmp_path):
    first = build(_tiny_spec(), "sm_90")
    copy = tmp_path / "copy"
    shutil.copytree(src_root, copy)
    with use_source_root(copy):
        second = build(_tiny_spec(), "sm_90")
    assert second.key == first.key and second.from_cache


def test_compile_error_shows_log_and_lines(src_root):
    with pytest.raises(CompileError) as info:
        build(BuildSpec.make("bad.cu"), "sm_90")
    exc = info.value
    assert 'expected a ";"' in exc.log
    text = str(exc)
    assert "bad.cu" in text and "-arch=sm_90" in text
    assert ">     4 |     out[0] = x;" in text
    assert "      3 |     int x = 1" in text
    assert not _entries(Path(cache_dir()))


def test_missing_source_is_a_clear_error(src_root):
    with pytest.raises(FileNotFoundError, match="nope.cu"):
        build(BuildSpec.make("nope.cu"), "sm_90")


def test_bad_arch_rejected(src_root):
    with pytest.raises(ValueError, match="architecture"):
        build(_tiny_spec(), "hopper")


@pytest.mark.filterwarnings("ignore::deepep_cupy.jit.CacheTrustWarning")
def test_corrupt_entry_is_rebuilt(src_root):
    first = build(_tiny_spec(), "sm_90")
    first.cubin_path.write_bytes(first.cubin_path.read_bytes()[:10])
    rebuilt = build(_tiny_spec(), "sm_90")
    assert not rebuilt.from_cache and rebuilt.key == first.key
    assert rebuilt.cubin_path.stat().st_size > 10
    (rebuilt.cubin_path.parent / "meta.json").write_text("{not json")
    assert not build(_tiny_spec(), "sm_90").from_cache
    assert build(_tiny_spec(), "sm_90").from_cache
    assert len(_entries(Path(cache_dir()))) == 1


def test_extern_c_kernel_needs_no_name_expression(src_root):
    compiled = build(BuildSpec.make("tiny.cu", {"SCALE_BASE": 1}), "sm_80")
    assert compiled.lowered_names == {}
    assert compiled.cubin_path.read_bytes()[:4] == ELF_MAGIC


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_common_headers_compile(src_root, arch):
    assert build(BuildSpec.make("headers_use.cu"), arch).cubin_path.stat().st_size > 0


def _build_in_child(_):
    compiled = build(BuildSpec.make("tiny.cu", {"SCALE_BASE": 7}, ["scale_kernel<3>"]), "sm_90")
    return compiled.key, compiled.from_cache, compiled.cubin_path.read_bytes()[:4]


def test_concurrent_builds_leave_one_entry(src_root):
    ctx = mp.get_context("spawn")
    with ctx.Pool(4) as pool:
        results = pool.map(_build_in_child, range(4))
    keys = {key for key, _, _ in results}
    assert len(keys) == 1
    # The entry's lock makes the others wait for the first compile instead of compiling it again.
    assert sorted(hit for _, hit, _ in results) == [False, True, True, True]
    assert all(magic == ELF_MAGIC for _, _, magic in results)
    cache = Path(cache_dir())
    assert len(_entries(cache)) == 1
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]
    assert build(BuildSpec.make("tiny.cu", {"SCALE_BASE": 7}, ["scale_kernel<3>"]), "sm_90").from_cache


def test_held_lock_ends_in_a_named_timeout(src_root, monkeypatch):
    """A lock that is never released (a stuck process) costs the lock bound, then a named error."""
    import fcntl

    from deepep_cupy.errors import DeepEPTimeoutError

    spec = BuildSpec.make("tiny.cu", {"SCALE_BASE": 11}, ["scale_kernel<5>"])
    key = build(spec, "sm_90").key  # learn the key, then start over without the entry
    entry = Path(cache_dir()) / key[:2] / key
    shutil.rmtree(entry)
    monkeypatch.setenv("DEEPEP_CUPY_CACHE_LOCK_TIMEOUT_S", "0.3")
    lock_path = entry.parent / f".lock-{key}"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        start = time.perf_counter()
        with pytest.raises(DeepEPTimeoutError, match=str(lock_path)):
            build(spec, "sm_90")
        assert 0.3 <= time.perf_counter() - start < 5
        assert not entry.exists()
    finally:
        os.close(fd)
    assert not build(spec, "sm_90").from_cache  # released: the next build compiles


def test_arch_none_without_gpu_is_a_clear_error(src_root):
    """Without a GPU, or without CuPy to find one, arch=None says why and names the way round it."""
    try:
        import cupy
    except ImportError:
        cupy = None
    if cupy is not None:
        try:
            has_gpu = cupy.cuda.runtime.getDeviceCount() > 0
        except Exception:
            has_gpu = False
        if has_gpu:
            pytest.skip("a GPU is present: arch=None compiles for it")
    with pytest.raises(RuntimeError, match="arch=") as info:
        build(_tiny_spec())
    if cupy is None:
        assert "CuPy is required" in str(info.value)


def test_nvshmem_link_produces_cubin(src_root):
    tc = toolchain()
    if not tc.nvshmem_include_dir or not tc.nvshmem_device_lib:
        pytest.skip("NVSHMEM headers or libnvshmem_device.a not installed (pip install nvidia-nvshmem-cu13)")
    compiled = build(BuildSpec.make("nvshmem_tiny.cu", nvshmem=True), "sm_90")
    assert not compiled.from_cache
    assert compiled.cubin_path.read_bytes()[:4] == ELF_MAGIC
    meta = json.loads((compiled.cubin_path.parent / "meta.json").read_text())
    assert "-rdc=true" in meta["options"]
    assert build(BuildSpec.make("nvshmem_tiny.cu", nvshmem=True), "sm_90").from_cache


def test_kernel_error_record_message():
    import numpy as np

    from deepep_cupy.device.kernel_errors import RECORD_WORDS, KernelErrorRecord
    from deepep_cupy.errors import DeepEPTimeoutError
    from deepep_cupy.ops.headers import constant

    assert RECORD_WORDS == constant("common/timeout.cuh", "kRecordWords") >= 10  # sizeof(ErrorRecord) / 4
    record = KernelErrorRecord.__new__(KernelErrorRecord)  # host-side logic only: no GPU allocation
    words = np.zeros(RECORD_WORDS, dtype=np.int32)
    record._host = words
    record.check({7: "intranode_dispatch"})  # empty record: nothing raised
    words[:5] = [1, 7, 3, 1, 123]
    words[6:8].view(np.int64)[0] = 2_500_000_000
    with pytest.raises(DeepEPTimeoutError) as info:
        record.check({7: "intranode_dispatch"})
    assert str(info.value) == (
        "intranode_dispatch: rank 3 timed out after 2500.0 ms waiting for peer 1 (kernel line 123)"
    )
    assert not words.any()  # check() clears the record
    words[0] = -1  # a writer is still filling it in: not reported yet
    record.check()



def test_toolkit_elsewhere_with_the_same_versions_shares_the_key(src_root, monkeypatch):
    """A cache filled under one install (a build machine's virtual environment) serves another install of
    the same toolkit versions; another version, or a directory whose version is unknown, does not."""
    from deepep_cupy.jit import cache
    from deepep_cupy.jit.compiler import Toolchain

    versions = {"cudart": "13050", "cccl": "3005000", "nvshmem": "3.8.0", "nvshmem_device_lib_bytes": "6960754"}

    def key(prefix, links_nvshmem=True, **changed):
        tc = Toolchain((f"{prefix}/include", f"{prefix}/include/cccl"), f"{prefix}/nvshmem/include",
                       f"{prefix}/nvshmem/lib/libnvshmem_device.a", {**versions, **changed})
        monkeypatch.setattr(cache, "toolchain", lambda: tc)
        options = ["-arch=sm_90", f"-I{src_root}", *(f"-I{d}" for d in tc.cuda_include_dirs)]
        spec = BuildSpec.make("tiny.cu", {"SCALE_BASE": 3}, name_expressions=["scale_kernel<2>"],
                              nvshmem=links_nvshmem)
        if links_nvshmem:
            options += ["-rdc=true", f"-I{tc.nvshmem_include_dir}"]
        return cache.cache_key(spec, "sm_90", src_root, options)

    here = key("/opt/venv")
    assert key("/usr/lib/python3/dist-packages/nvidia") == here
    assert key("/opt/venv", cudart="13000") != here
    assert key("/opt/venv", nvshmem="3.9.0") != here
    assert key("/opt/venv", nvshmem_device_lib_bytes="1") != here
    assert key("/opt/venv", links_nvshmem=False) == key("/elsewhere", links_nvshmem=False) != here
    # Where a version is unknown the directory is part of the key: moving it changes the key.
    assert key("/a", cccl=None) != key("/b", cccl=None)
    assert key("/a", nvshmem="unknown") != key("/b", nvshmem="unknown")
