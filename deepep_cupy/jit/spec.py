"""What to compile (:class:`BuildSpec`) and what a build produced (:class:`CompiledKernel`)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BuildSpec", "CompiledKernel"]

_DEFINE_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class BuildSpec:
    """One kernel instantiation: a source file plus everything fixed at compile time.

    Attributes:
        source: path relative to ``cuda_src/``, e.g. ``"layout/count_tokens.cu"`` or
            ``"intranode/dispatch.cu"``.
        defines: ``(NAME, VALUE)`` pairs passed as ``-DNAME=VALUE``; keep them sorted (use :meth:`make`) so
            equal specs hash equally.
        name_expressions: template instantiations to emit and look up by name, e.g.
            ``"layout_kernel<8>"``; ``extern "C"`` kernels need none.
        nvshmem: compile relocatable device code with the NVSHMEM headers and link NVSHMEM's device
            library with nvJitLink.
    """

    source: str
    defines: tuple[tuple[str, str], ...] = ()
    name_expressions: tuple[str, ...] = ()
    nvshmem: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source or self.source.startswith("/"):
            raise ValueError(f"BuildSpec.source must be a path relative to cuda_src/, got {self.source!r}")
        for item in self.defines:
            if len(item) != 2 or not _DEFINE_NAME_RE.match(str(item[0])):
                raise ValueError(f"BuildSpec.defines: bad entry {item!r}; expected (NAME, VALUE)")
        if isinstance(self.name_expressions, str):
            raise TypeError("BuildSpec.name_expressions must be a tuple of strings, not a string")

    @staticmethod
    def make(
        source: str,
        defines: Mapping[str, object] | None = None,
        name_expressions: Iterable[str] = (),
        nvshmem: bool = False,
    ) -> BuildSpec:
        """Build a spec from a dict of defines (values turned into strings; ``True``/``False`` -> 1/0)."""

        def text(value: object) -> str:
            if isinstance(value, bool):
                return "1" if value else "0"
            return str(value)

        items = tuple(sorted((str(k), text(v)) for k, v in (defines or {}).items()))
        return BuildSpec(source, items, tuple(name_expressions), bool(nvshmem))

    def params(self) -> str:
        """Defines and name expressions as ``"NUM_RANKS=2, kernel<8>"`` (empty when there are none)."""
        return ", ".join([f"{k}={v}" for k, v in self.defines] + list(self.name_expressions))

    def describe(self) -> str:
        """Short human-readable form: ``layout/count_tokens.cu (K=8, ...)``."""
        params = self.params()
        return f"{self.source} ({params})" if params else self.source


@dataclass
class CompiledKernel:
    """A cubin on disk and the mangled names of its template instantiations.

    Attributes:
        cubin_path: the cached cubin (load it with ``cupy.RawModule(path=str(cubin_path))``).
        lowered_names: name expression -> mangled symbol.
        key: the cache key (hex SHA-256).
        from_cache: True when no compile ran in this call.
    """

    cubin_path: Path
    lowered_names: dict[str, str]
    key: str
    from_cache: bool
