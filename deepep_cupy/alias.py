"""``import deep_ep`` as deepep_cupy, for code written against DeepEP V1 (Megatron-Core, SGLang, vLLM).

Two ways in:

* ``DEEPEP_CUPY_AS_DEEP_EP=1`` in the environment. The file ``deepep_cupy_alias.pth``, installed into
  site-packages with the package (wheel and editable installs alike), puts a small finder on
  ``sys.meta_path`` when the interpreter starts, so every Python process of a job (torchrun ranks, spawned
  workers) finds ``deep_ep``, ``importlib.util.find_spec("deep_ep")`` included. The finder imports
  nothing until a ``deep_ep`` name is looked up; with the variable unset the ``.pth`` line does nothing.
* ``deepep_cupy.as_deep_ep()`` from code: the same in this process.

``deep_ep`` then holds DeepEP V1's public names (``Buffer``, ``Config``, ``EventOverlap``, ``topk_idx_t``),
with the submodules ``deep_ep.utils`` (``EventHandle``, ``EventOverlap``, ``check_nvlink_connections``) and
``deep_ep.buffer``, and V2's (``ElasticBuffer`` of 2.1, ``EPBuffer`` of 2.5, ``EPHandle``, ``EventHandle``,
``get_physical_domain_size``, ``get_logical_domain_size``; ``deepep_cupy.ep``); they are deepep_cupy's own
objects. ``deep_ep.EventOverlap`` stays V1's class (V2's events are instances of a subclass of it). No
``__version__`` is set: code that reads one to choose between V1 and V2 keeps its V1 path. Nothing of the
forks is there (``HybridEPBuffer``, ``deep_ep.buffers``), nor 2.5's experimental buffers.

A real DeepEP is never shadowed silently. When one is importable and the alias is asked for with ``1``,
``import deep_ep`` raises ImportError naming both (also written to stderr, since frameworks catch that
error); ``DEEPEP_CUPY_AS_DEEP_EP=force`` (``as_deep_ep(force=True)``) loads deepep_cupy in its place. Each
process that loads the alias says so in one line on stderr.

``python -m deepep_cupy.alias`` tells what ``import deep_ep`` gives in the current environment.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

__all__ = ["ENV", "as_deep_ep", "find_spec"]

#: The environment variable that turns the alias on: ``1`` (or any value but ``0``, ``false``, ``no``,
#: ``off``), or ``force`` to load deepep_cupy even where a real DeepEP is installed.
ENV = "DEEPEP_CUPY_AS_DEEP_EP"
_OFF = ("", "0", "false", "no", "off")
# DeepEP V1's modules: the package, its utils and the module its Buffer lives in.
_MODULES = ("deep_ep", "deep_ep.utils", "deep_ep.buffer")
_ORIGIN = "deepep_cupy alias"
# What as_deep_ep() asked for in this process: None, "on" or "force" (the environment counts as well).
_requested: str | None = None


def _mode() -> str:
    """'off', 'on' or 'force', from the environment and ``as_deep_ep``."""
    value = os.environ.get(ENV, "").strip().lower()
    env = "off" if value in _OFF else "force" if value == "force" else "on"
    if "force" in (env, _requested):
        return "force"
    return "on" if "on" in (env, _requested) else "off"


def _say(message: str) -> None:
    print(f"deepep_cupy: {message}", file=sys.stderr, flush=True)


def _package_dir() -> str:
    return os.path.dirname(os.path.abspath(__file__))


def _where(spec) -> str:
    locations = list(spec.submodule_search_locations or [])
    return locations[0] if locations else str(spec.origin)


def _other_deep_ep() -> str | None:
    """Where a ``deep_ep`` that is not this alias would be imported from, or None."""
    for finder in sys.meta_path:
        if getattr(finder, "_deepep_cupy_alias", False):
            continue
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find("deep_ep", None)
        except Exception:
            continue
        if spec is not None:
            return _where(spec)
    return None


def _fill(module) -> None:
    """Give one of the ``deep_ep`` modules DeepEP's public names (V1's, and V2's in ``deep_ep`` itself)."""
    from . import ep, utils
    from .buffer import Buffer
    from .config import Config

    names = {"deep_ep": {"Buffer": Buffer, "Config": Config, "EventOverlap": utils.EventOverlap,
                         "ElasticBuffer": ep.ElasticBuffer, "EPBuffer": ep.EPBuffer, "EPHandle": ep.EPHandle,
                         "EventHandle": utils.EventHandle, "get_physical_domain_size": ep.get_physical_domain_size,
                         "get_logical_domain_size": ep.get_logical_domain_size},
             "deep_ep.utils": {"EventHandle": utils.EventHandle, "EventOverlap": utils.EventOverlap,
                               "check_nvlink_connections": utils.check_nvlink_connections},
             "deep_ep.buffer": {"Buffer": Buffer, "Config": Config, "EventHandle": utils.EventHandle,
                                "EventOverlap": utils.EventOverlap,
                                "check_nvlink_connections": utils.check_nvlink_connections}}[module.__name__]
    module.__dict__.update(names)
    module.__all__ = list(names)
    if module.__name__ == "deep_ep":
        # topk_idx_t is torch.int64: looked up on first use, so that ``import deep_ep`` does not import torch.
        module.__getattr__ = _deep_ep_getattr
        module.__all__.append("topk_idx_t")
        # DeepEP's package imports both submodules, so ``deep_ep.utils`` works after a plain ``import deep_ep``.
        importlib.import_module("deep_ep.utils")
        importlib.import_module("deep_ep.buffer")


def _deep_ep_getattr(name: str):
    if name == "topk_idx_t":
        import deepep_cupy

        return deepep_cupy.topk_idx_t
    raise AttributeError(f"module 'deep_ep' has no attribute {name!r}")


class _Loader(importlib.abc.Loader):
    def __init__(self, shadowed: str | None, mode: str) -> None:
        self.shadowed = shadowed
        self.mode = mode

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        if module.__name__ == "deep_ep" and self.shadowed is not None and self.mode != "force":
            message = (f"import deep_ep: {ENV} asks for deepep_cupy ({_package_dir()}), but DeepEP is installed "
                       f"at {self.shadowed}; unset {ENV} to use DeepEP, or set {ENV}=force "
                       "(deepep_cupy.as_deep_ep(force=True)) to use deepep_cupy in its place")
            _say(message)
            raise ImportError(message, name="deep_ep")
        _fill(module)
        if module.__name__ == "deep_ep":
            import deepep_cupy

            instead = "" if self.shadowed is None else f", in place of DeepEP at {self.shadowed}"
            _say(f"deep_ep is deepep_cupy {deepep_cupy.__version__} ({_package_dir()}){instead}")


def find_spec(name: str, path=None, target=None):
    """The meta-path finder's answer for ``deep_ep`` names (None for every other name, or when the alias is off).

    Called by the finder the ``.pth`` file installs and by the one ``as_deep_ep`` installs.
    """
    if name not in _MODULES:
        return None
    mode = _mode()
    if mode == "off":
        return None
    shadowed = _other_deep_ep() if name == "deep_ep" else None
    return importlib.machinery.ModuleSpec(name, _Loader(shadowed, mode), origin=_ORIGIN,
                                          is_package=name == "deep_ep")


class _Finder:
    """The finder ``as_deep_ep`` puts first on ``sys.meta_path``."""

    _deepep_cupy_alias = True

    @staticmethod
    def find_spec(name, path=None, target=None):
        return find_spec(name, path, target)


def _is_alias(module) -> bool:
    spec = getattr(module, "__spec__", None)
    return spec is not None and isinstance(spec.loader, _Loader)


def as_deep_ep(force: bool = False):
    """Make ``import deep_ep`` give deepep_cupy in this process, as ``DEEPEP_CUPY_AS_DEEP_EP=1`` does for
    every process; returns the ``deep_ep`` module.

    Call it before the framework imports ``deep_ep`` (processes the framework spawns do not inherit it:
    use the environment variable for those).

    Arguments:
        force: load deepep_cupy even where a real DeepEP is installed (or already imported), in its place.

    Raises:
        ImportError: a real DeepEP is installed or imported and ``force`` is False.
    """
    global _requested
    existing = sys.modules.get("deep_ep")
    if existing is not None and not _is_alias(existing):
        spec = getattr(existing, "__spec__", None)
        where = _where(spec) if spec is not None else getattr(existing, "__file__", "?")
        if not force:
            raise ImportError(f"deep_ep is already imported from {where}; as_deep_ep(force=True) replaces it "
                              "with deepep_cupy", name="deep_ep")
        for name in [n for n in sys.modules if n == "deep_ep" or n.startswith("deep_ep.")]:
            del sys.modules[name]
    _requested = "force" if force else (_requested or "on")
    if not any(getattr(f, "_deepep_cupy_alias", False) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder)
    return importlib.import_module("deep_ep")


def _pth_files() -> list[str]:
    import site

    dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
    return [os.path.join(d, "deepep_cupy_alias.pth") for d in dirs
            if os.path.isfile(os.path.join(d, "deepep_cupy_alias.pth"))]


def main() -> int:
    """Print what ``import deep_ep`` gives here and why; exit status 0 when it is deepep_cupy."""
    hooks = _pth_files()
    print(f"{ENV}={os.environ.get(ENV, '')!r}; start-up hook: {', '.join(hooks) or 'not installed'}")
    active = any(getattr(f, "_deepep_cupy_alias", False) for f in sys.meta_path)
    spec = importlib.util.find_spec("deep_ep")
    if spec is None:
        why = (f"set {ENV}=1" if _mode() == "off" else
               "the start-up hook is not installed: install the package with pip, or call deepep_cupy.as_deep_ep()")
        print(f"import deep_ep: no such module ({why})")
        return 1
    if spec.origin != _ORIGIN:
        print(f"import deep_ep: DeepEP at {_where(spec)}" + ("" if active else f" (the alias is off: {ENV} unset)"))
        return 1
    try:
        import deep_ep
    except ImportError as exc:
        print(f"import deep_ep: {exc}")
        return 1
    print(f"import deep_ep: deepep_cupy (Buffer is {deep_ep.Buffer.__module__}.{deep_ep.Buffer.__qualname__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
