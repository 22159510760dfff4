"""The layering of the package, checked on its import graph (every import, lazy ones too).

- Pure cores (``symmetry``, ``mmd``, ``metrics``) work on arrays and state dicts: they
  import neither the store, the collection layer, the CLI, the Hub code nor ``train_zoo``
  (nor h5py).
- The store (``zoo``) does not import the collection layer or the CLI; the collection layer
  does not import the CLI or ``train_zoo``.
- ``train_zoo`` never imports the CLI.
- No two modules import each other, directly or through others.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("posteriorzoo", "train_zoo")
CORES = ("posteriorzoo.symmetry", "posteriorzoo.mmd", "posteriorzoo.metrics")
FORBIDDEN = {
    CORES: ("posteriorzoo.zoo", "posteriorzoo.collection", "posteriorzoo.cli",
            "posteriorzoo.hub", "posteriorzoo.reference", "train_zoo", "h5py"),
    ("posteriorzoo.zoo",): ("posteriorzoo.collection", "posteriorzoo.cli", "train_zoo"),
    ("posteriorzoo.collection",): ("posteriorzoo.cli", "train_zoo"),
    ("train_zoo",): ("posteriorzoo.cli",),
}


def _modules() -> dict[str, tuple[Path, bool]]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


MODULES = _modules()


def _imports(module: str) -> set[str]:
    """Every module name ``module`` imports (absolute names, relative ones resolved)."""
    path, is_package = MODULES[module]
    package = module if is_package else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            # ``from package import module`` depends on the module; ``from module import
            # name`` on the module that defines the name.
            names.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                         for alias in node.names)
    return names


def _own(name: str) -> str | None:
    """The module of this project that ``name`` refers to (a package for its members)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


GRAPH = {module: {own for name in _imports(module) if (own := _own(name)) and own != module}
         for module in MODULES}


def _inside(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("layer", list(FORBIDDEN), ids=lambda layer: "+".join(layer))
def test_no_module_imports_a_layer_above_it(layer):
    forbidden = FORBIDDEN[layer]
    offences = sorted(f"{module} imports {name}" for module in MODULES if _inside(module, layer)
                      for name in _imports(module) if _inside(name, forbidden))
    assert not offences, offences


def test_no_import_cycles():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in GRAPH[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in GRAPH:
        if module not in index:
            visit(module)
    assert not cycles, cycles


def test_the_checker_sees_violations():
    """The checks are not vacuous: the graph has the edges the code has."""
    assert "posteriorzoo.zoo" in GRAPH["posteriorzoo.collection.canonicalization"]
    assert "posteriorzoo.symmetry.canonical" in GRAPH["posteriorzoo.collection.canonicalization"]
    assert "train_zoo" in {_own(n) for n in _imports("posteriorzoo.cli.train_command")} or \
        any(_inside(n, ("train_zoo",)) for n in _imports("posteriorzoo.cli.train_command"))
    assert len(MODULES) > 80


def test_the_result_base_is_neutral():
    """Every layer may build on ``posteriorzoo.results``: it imports no layer itself."""
    # errors and text are leaves (standard library only), as outputs is
    assert GRAPH["posteriorzoo.results"] <= {"posteriorzoo.outputs", "posteriorzoo.errors",
                                             "posteriorzoo.text"}
    for leaf in ("posteriorzoo.errors", "posteriorzoo.text"):
        assert not GRAPH[leaf], leaf
