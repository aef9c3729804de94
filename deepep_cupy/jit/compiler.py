"""NVRTC compile and nvJitLink link of one :class:`BuildSpec` into a cubin. Needs no GPU.

Toolkit pieces (NVRTC, nvJitLink, CUDA/CCCL/NVSHMEM headers, ``libnvshmem_device.a``) are found through
``cuda.pathfinder`` (pip wheels), with ``$CUDA_HOME``/``/usr/local/cuda`` and ``$NVSHMEM_HOME`` as fallbacks.
"""

from __future__ import annotations

import functools
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..device.gpus import current_device_id
from .spec import BuildSpec

__all__ = [
    "CompileError",
    "Toolchain",
    "toolchain",
    "compile_options",
    "compile_cubin",
    "normalize_arch",
    "current_device_arch",
    "first_device_arch",
]

_ARCH_RE = re.compile(r"^sm_(\d{2,3})([af]?)$")
_ERROR_LINE_RE = re.compile(r"^(.*?)\((\d+)\): (?:catastrophic error|fatal error|error)", re.MULTILINE)
_CONTEXT_LINES = 3
_MAX_EXCERPTS = 8


class CompileError(RuntimeError):
    """NVRTC or nvJitLink rejected a kernel.

    Attributes:
        log: the compiler or linker log, verbatim.
        options: the options the compile ran with.
        source: the ``cuda_src``-relative source that failed.
        excerpts: the source lines around each ``file(line): error`` in the log, numbered.
    """

    def __init__(
        self,
        message: str,
        *,
        log: str = "",
        options: tuple[str, ...] = (),
        source: str = "",
        excerpts: str = "",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.log = log
        self.options = tuple(options)
        self.source = source
        self.excerpts = excerpts

    def __str__(self) -> str:
        parts = [self.message]
        if self.options:
            parts.append("options: " + " ".join(self.options))
        if self.log.strip():
            parts.append("log:\n" + self.log.rstrip())
        if self.excerpts:
            parts.append("source:\n" + self.excerpts.rstrip())
        return "\n".join(parts)


# --------------------------------------------------------------------------------------------------------
# Toolkit discovery


def _find_header_dir(name: str) -> str | None:
    try:
        from cuda.pathfinder import find_nvidia_header_directory
    except ImportError:
        return None
    try:
        found = find_nvidia_header_directory(name)
    except Exception:  # pathfinder raises on unknown or unsupported names in some versions
        return None
    return str(found) if found else None


def _cuda_homes() -> list[Path]:
    homes = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            homes.append(Path(os.environ[var]))
    homes.append(Path("/usr/local/cuda"))
    return homes


def _read_define(path: Path, name: str, limit: int = 1 << 15) -> str | None:
    try:
        with open(path, "rb") as f:
            head = f.read(limit).decode("latin-1")
    except OSError:
        return None
    match = re.search(rf"^\s*#\s*define\s+{name}\s+(\S+)", head, re.MULTILINE)
    return match.group(1) if match else None


@dataclass(frozen=True)
class Toolchain:
    """Include directories, NVSHMEM pieces and the versions that go into the cache key."""

    cuda_include_dirs: tuple[str, ...]
    nvshmem_include_dir: str | None
    nvshmem_device_lib: str | None
    versions: dict[str, str] = field(hash=False, compare=False)

    def require_nvshmem(self) -> tuple[str, str]:
        if not self.nvshmem_include_dir or not self.nvshmem_device_lib:
            raise CompileError(
                "deepep_cupy: NVSHMEM headers or libnvshmem_device.a not found "
                f"(include dir: {self.nvshmem_include_dir}, device library: {self.nvshmem_device_lib}); "
                "install nvidia-nvshmem-cu12/cu13 or set $NVSHMEM_HOME"
            )
        return self.nvshmem_include_dir, self.nvshmem_device_lib


@functools.cache
def toolchain() -> Toolchain:
    """Locate the CUDA and NVSHMEM headers once per process."""
    dirs: list[str] = []
    for name in ("cudart", "cccl"):
        found = _find_header_dir(name)
        if found and found not in dirs:
            dirs.append(found)
    if not any(Path(d, "cuda_runtime.h").is_file() for d in dirs):
        for home in _cuda_homes():
            if (home / "include" / "cuda_runtime.h").is_file():
                dirs.append(str(home / "include"))
                if (home / "include" / "cccl").is_dir():
                    dirs.append(str(home / "include" / "cccl"))
                break

    versions: dict[str, str] = {}
    for d in dirs:
        cudart = _read_define(Path(d, "cuda_runtime_api.h"), "CUDART_VERSION", 1 << 16)
        if cudart:
            versions.setdefault("cudart", cudart)
        cccl = _read_define(Path(d, "cuda", "std", "__cccl", "version.h"), "CCCL_VERSION")
        if cccl:
            versions.setdefault("cccl", cccl)

    nvshmem_inc = None
    nvshmem_lib = None
    candidates = []
    if os.environ.get("NVSHMEM_HOME"):
        candidates.append(str(Path(os.environ["NVSHMEM_HOME"], "include")))
    found = _find_header_dir("nvshmem")
    if found:
        candidates.append(found)
    for inc in candidates:
        if Path(inc, "nvshmem.h").is_file():
            nvshmem_inc = inc
            lib = Path(inc).parent / "lib" / "libnvshmem_device.a"
            nvshmem_lib = str(lib) if lib.is_file() else None
            break
    if nvshmem_inc:
        parts = []
        for header in (
            Path(nvshmem_inc, "non_abi", "nvshmem_version.h"),
            Path(nvshmem_inc, "nvshmem_version.h"),
        ):
            for part in ("MAJOR", "MINOR", "PATCH"):
                value = _read_define(header, f"NVSHMEM_VENDOR_{part}_VERSION")
                if value:
                    parts.append(value)
            if parts:
                break
        versions["nvshmem"] = ".".join(parts) or "unknown"
        if nvshmem_lib:
            versions["nvshmem_device_lib_bytes"] = str(os.path.getsize(nvshmem_lib))
    return Toolchain(tuple(dirs), nvshmem_inc, nvshmem_lib, versions)


@functools.cache
def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"deepep_cupy: nvrtcVersion failed: {err}")
    return f"{major}.{minor}"


@functools.cache
def nvjitlink_version() -> str:
    from cuda.bindings import nvjitlink

    major, minor = nvjitlink.version()
    return f"{major}.{minor}"


# --------------------------------------------------------------------------------------------------------
# Architecture


def normalize_arch(arch: str) -> str:
    """Accept ``"sm_90"``, ``"sm_90a"``, ``"90"`` or ``"9.0"``; return the ``sm_XX`` form."""
    text = str(arch).strip()
    if re.fullmatch(r"\d+\.\d+", text):
        major, minor = text.split(".")
        text = f"sm_{major}{minor}"
    elif re.fullmatch(r"\d{2,3}[af]?", text):
        text = f"sm_{text}"
    if not _ARCH_RE.match(text):
        raise ValueError(f"deepep_cupy: bad GPU architecture {arch!r}; expected e.g. 'sm_90'")
    return text


_ARCH_HINT = "pass arch='sm_90' (or another sm_XX) to build() to compile without a GPU"


@functools.cache
def _arch_of_device(device_id: int) -> str:
    from cuda.bindings import driver

    def check(result):
        err = result[0]
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(
                f"deepep_cupy: CUDA driver call failed ({err}) while querying device {device_id}"
            )
        return result[1] if len(result) == 2 else result[1:]

    check(driver.cuInit(0))
    dev = check(driver.cuDeviceGet(device_id))
    attr = driver.CUdevice_attribute
    major = check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
    minor = check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
    return f"sm_{major}{minor}"


def device_for_build() -> int:
    """The caller's current device (``device.gpus.current_device_id``: torch's where torch has initialised
    CUDA, else CuPy's), with the way round a missing CuPy or GPU in the error."""
    try:
        return current_device_id()
    except ImportError as exc:
        raise RuntimeError(
            "deepep_cupy: CuPy is required to find the current GPU (install the cuda12 or cuda13 extra)"
        ) from exc
    except Exception as exc:
        raise RuntimeError(f"deepep_cupy: no CUDA device found; {_ARCH_HINT}") from exc


def current_device_arch() -> str:
    """``sm_XX`` of the current device, read through the driver without creating a context."""
    # Every way of failing here (no CuPy, no device, a driver error) ends with the way round it: an explicit
    # arch compiles on a machine without a GPU or without CuPy.
    try:
        return _arch_of_device(device_for_build())
    except RuntimeError as exc:
        if _ARCH_HINT in str(exc):
            raise
        raise RuntimeError(f"{exc}; {_ARCH_HINT}") from exc


def first_device_arch() -> str | None:
    """``sm_XX`` of the first visible GPU, or None without one (no driver, no device); needs no CuPy."""
    try:
        return _arch_of_device(0)
    except Exception:  # no driver library, no device, or a driver error: all mean "no GPU to ask"
        return None


# --------------------------------------------------------------------------------------------------------
# Compile and link


def compile_options(spec: BuildSpec, arch: str, root: Path, tc: Toolchain | None = None) -> list[str]:
    """NVRTC options for ``spec``. No fast math: results must be bit-exact against the reference."""
    tc = toolchain() if tc is None else tc
    opts = [
        f"-arch={arch}",
        "-std=c++17",
        "-default-device",
        "-lineinfo",
        "-DDEEPEP_CUPY_JIT=1",
        f"-I{root}",
    ]
    opts += [f"-I{d}" for d in tc.cuda_include_dirs]
    if spec.nvshmem:
        inc, _ = tc.require_nvshmem()
        opts += ["-rdc=true", f"-I{inc}"]
    opts += [f"-D{name}={value}" for name, value in spec.defines]
    return opts


def _excerpts(log: str, root: Path, source_path: Path, source_text: str) -> str:
    out: list[str] = []
    seen: set[tuple[str, int]] = set()
    for match in _ERROR_LINE_RE.finditer(log):
        file_name, line_no = match.group(1).strip(), int(match.group(2))
        if (file_name, line_no) in seen:
            continue
        seen.add((file_name, line_no))
        if len(seen) > _MAX_EXCERPTS:
            break
        text = None
        if file_name in (str(source_path), source_path.name):
            text = source_text
        else:
            for candidate in (Path(file_name), root / file_name, source_path.parent / file_name):
                if candidate.is_file():
                    text = candidate.read_text(errors="replace")
                    break
        if text is None:
            continue
        lines = text.splitlines()
        lo, hi = max(1, line_no - _CONTEXT_LINES), min(len(lines), line_no + _CONTEXT_LINES)
        out.append(f"{file_name}:{line_no}")
        for n in range(lo, hi + 1):
            marker = ">" if n == line_no else " "
            out.append(f"{marker}{n:6d} | {lines[n - 1]}")
    return "\n".join(out)


def _nvrtc_log(nvrtc, prog) -> str:
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS or size <= 1:
        return ""
    buf = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return buf.rstrip(b"\x00").decode(errors="replace")


def _link(cubin: bytes, arch: str, library: str, name: str) -> tuple[bytes, str]:
    from cuda.bindings import nvjitlink

    handle = nvjitlink.create(1, [f"-arch={arch}"])

    def log_of(getter_size, getter) -> str:
        try:
            size = getter_size(handle)
            if size <= 1:
                return ""
            buf = bytearray(size)
            getter(handle, buf)
            return bytes(buf).rstrip(b"\x00").decode(errors="replace")
        except Exception:
            return ""

    try:
        try:
            nvjitlink.add_data(handle, nvjitlink.InputType.CUBIN, cubin, len(cubin), name)
            nvjitlink.add_file(handle, nvjitlink.InputType.LIBRARY, library)
            nvjitlink.complete(handle)
        except nvjitlink.nvJitLinkError as exc:
            log = log_of(nvjitlink.get_error_log_size, nvjitlink.get_error_log)
            raise CompileError(
                f"deepep_cupy: nvJitLink failed for {name} ({exc})",
                log=log,
                options=(f"-arch={arch}", library),
                source=name,
            ) from None
        size = nvjitlink.get_linked_cubin_size(handle)
        out = bytearray(size)
        nvjitlink.get_linked_cubin(handle, out)
        info = log_of(nvjitlink.get_info_log_size, nvjitlink.get_info_log)
        return bytes(out), info
    finally:
        nvjitlink.destroy(handle)


@dataclass
class CompileResult:
    cubin: bytes
    lowered_names: dict[str, str]
    log: str
    compile_s: float
    link_s: float


def compile_cubin(spec: BuildSpec, arch: str, root: Path, options: list[str]) -> CompileResult:
    """Compile ``spec`` with NVRTC (and link NVSHMEM with nvJitLink when asked). Raises CompileError."""
    from cuda.bindings import nvrtc

    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS
    source_path = (root / spec.source).resolve()
    source_text = source_path.read_text()
    t0 = time.perf_counter()
    # The program name is the absolute path so that NVRTC resolves quoted includes next to the source and
    # error lines name a file we can show.
    err, prog = nvrtc.nvrtcCreateProgram(source_text.encode(), str(source_path).encode(), 0, [], [])
    if err != ok:
        raise CompileError(f"deepep_cupy: nvrtcCreateProgram failed: {err}", source=spec.source)
    try:
        for expr in spec.name_expressions:
            (err,) = nvrtc.nvrtcAddNameExpression(prog, expr.encode())
            if err != ok:
                raise CompileError(f"deepep_cupy: bad name expression {expr!r}: {err}", source=spec.source)
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
        log = _nvrtc_log(nvrtc, prog)
        if err != ok:
            raise CompileError(
                f"deepep_cupy: NVRTC failed to compile {spec.describe()} for {arch}",
                log=log,
                options=tuple(options),
                source=spec.source,
                excerpts=_excerpts(log, root, source_path, source_text),
            )
        lowered = {}
        for expr in spec.name_expressions:
            err, name = nvrtc.nvrtcGetLoweredName(prog, expr.encode())
            if err != ok:
                raise CompileError(f"deepep_cupy: no lowered name for {expr!r}: {err}", source=spec.source)
            lowered[expr] = name.decode() if isinstance(name, bytes) else str(name)
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        if err != ok or size == 0:
            raise CompileError(
                f"deepep_cupy: NVRTC produced no cubin for {spec.source} ({err})",
                log=log,
                options=tuple(options),
                source=spec.source,
            )
        cubin = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        if err != ok:
            raise CompileError(f"deepep_cupy: nvrtcGetCUBIN failed: {err}", source=spec.source)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    t1 = time.perf_counter()
    link_s = 0.0
    if spec.nvshmem:
        _, library = toolchain().require_nvshmem()
        cubin, link_log = _link(cubin, arch, library, spec.source)
        link_s = time.perf_counter() - t1
        if link_log.strip():
            log = (log + "\n" + link_log).strip()
    return CompileResult(cubin, lowered, log, t1 - t0, link_s)
