"""The shape of the source tree: files small enough to read in one sitting, no import circle between the
package's modules, and no machine anecdotes in the code (measurements live in the docs)."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "deepep_cupy"
SOURCES = [*PACKAGE.rglob("*.py"), *(ROOT / "cuda_src").rglob("*.cu"), *(ROOT / "cuda_src").rglob("*.cuh")]
MAX_LINES = 500


def test_no_file_is_too_long_to_read_in_one_sitting():
    long = {str(p.relative_to(ROOT)): n for p in SOURCES if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


# GPU models and machine kinds: what a figure was measured on belongs in docs/, beside the figure.
_MACHINES = re.compile(r"\b(?:[AHBL][1-9]\d{1,2}[A-Z]?|GB\d{3}|MI\d{3}X?|RTX ?\d{4})\b")


def test_no_machine_names_in_the_code():
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in SOURCES
             for i, line in enumerate(p.read_text().splitlines(), 1) if _MACHINES.search(line)]
    assert found == []


def test_the_machine_pattern_finds_what_it_is_for():
    for text in ("on 2 x H200", "H100s", "an A100", "GB200 NVL72", "B200", "MI300X"):
        assert _MACHINES.search(text.rstrip("s")), text
    for text in ("sm_90", "int4", "x H", "H2D copies", "BF16", "kH200Words"):
        assert not _MACHINES.search(text), text


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str) -> set[str]:
    """The package modules ``path`` imports anywhere in it (function bodies included: a lazy import that
    closes a circle is a circle all the same)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("deepep_cupy")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("deepep_cupy"):
                module = node.module
            else:
                continue
            out.add(module)
            out |= {f"{module}.{a.name}" for a in node.names}
    return out


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imports(path, name):
            # "from .x import y" names either module x.y or attribute y of x: keep what is a module.
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + "."):
                targets.add(imported)
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    # A package's __init__ importing its own modules is no circle; a module importing its package's
    # __init__ (which imports the module back) is.
    assert _cycles(_graph()) == []


def test_the_circle_finder_finds_circles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
