"""The package's modules are layered one way (docs/architecture.md): no import cycles between
modules, lazy (in-function) imports included, and no module imports another's private names.
A package's ``__init__.py`` only re-exports: an import through it counts as an import of the
submodule that defines the name."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "linbackprop"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = [PACKAGE.name, *path.relative_to(PACKAGE).with_suffix("").parts]
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()
PACKAGES = {name for name, path in MODULES.items() if path.name == "__init__.py"}


def _imports(name: str) -> list[tuple[str, str | None]]:
    """(module, imported name or None) for every import of ``name``'s source, lazy ones included."""
    path = MODULES[name]
    here = name.split(".") if name in PACKAGES else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:
                found.append((f"{base}.{alias.name}", None) if f"{base}.{alias.name}" in MODULES
                             else (base, alias.name))
        elif isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
    return [(module, imported) for module, imported in found if module in MODULES]


def _defining(module: str, imported: str | None, seen: frozenset = frozenset()) -> set[str]:
    """The modules an import stands for: a package's re-exported name is its defining submodule."""
    if module not in PACKAGES or module in seen:
        return {module}
    if imported is None:  # the whole package: every module in it
        return {m for m in MODULES if m.startswith(module + ".") and m not in PACKAGES}
    for source, name in _imports(module):
        if name == imported or source.rpartition(".")[2] == imported:
            return _defining(source, name, seen | {module})
    return {module}


def _graph() -> dict[str, set[str]]:
    return {name: {target for module, imported in _imports(name) for target in _defining(module, imported)} - {name}
            for name in MODULES if name not in PACKAGES}


def test_no_import_cycles():
    graph, state, cycles = _graph(), {}, []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles


def test_no_private_names_across_modules():
    private = [f"{name} imports {imported} from {module}" for name in MODULES if name not in PACKAGES
               for module, imported in _imports(name)
               if imported and imported.startswith("_") and not imported.startswith("__")
               and _defining(module, imported) != {name}]
    assert not private, private


def test_the_check_sees_lazy_imports_and_re_exports():
    """The graph is not vacuous: a lazy import inside a function is an edge, and an import through
    a package's __init__ reaches the submodule that defines the name."""
    graph = _graph()
    assert sum(len(targets) for targets in graph.values()) > 50
    assert "linbackprop._capture._rewrite" in graph["linbackprop._curvature._split"]
    assert any(target.startswith("linbackprop._curvature._") for target in graph["linbackprop._optim._kfac"])


MAX_LINES = 450


def test_every_module_is_short():
    """One idea per module: none over MAX_LINES lines."""
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def _table_rows() -> list[str]:
    """docs/architecture.md's layer table, top to bottom, one line per row."""
    lines = (PACKAGE.parent / "docs" / "architecture.md").read_text().splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith("| module | stage |")) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("| `"):
            break
        rows.append(line)
    return rows


def _declared_layers() -> list[set[str]]:
    """The table's rows: each row's top-level modules and packages."""
    return [{name.removesuffix(".py").rstrip("/") for name in line.split("|")[1].split("`")[1::2]}
            for line in _table_rows()]


MAX_TOP_LEVEL = 14


def test_one_package_per_stage():
    """At most MAX_TOP_LEVEL entries at the top of linbackprop/, and every module of a package
    is named (as `_module`) in its package's row of the layer table, so the page is a map."""
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__" and not p.name.startswith("."))
    assert len(entries) <= MAX_TOP_LEVEL, entries
    rows = {name: line for line, names in zip(_table_rows(), _declared_layers()) for name in names}
    packages = [package for package in PACKAGE.iterdir() if (package / "__init__.py").exists()]
    unnamed = sorted(f"{package.name}/{module.name}" for package in packages
                     for module in package.glob("_*.py") if module.name != "__init__.py"
                     and f"`{module.stem}`" not in rows[package.name].split("|", 3)[3])
    assert not unnamed, f"modules the layer table does not name in their package's row: {unnamed}"


def test_architecture_page_names_every_module_in_import_order():
    """The page's layer table is the declared layer list: every top-level module and package of
    linbackprop is in it once, and each imports only from rows above its own (or its own row)."""
    rows = _declared_layers()
    row_of = {name: n for n, row in enumerate(rows) for name in row}
    entries = {path.relative_to(PACKAGE).parts[0].removesuffix(".py") for path in PACKAGE.glob("*")
               if (path.suffix == ".py" and path.name != "__init__.py") or (path / "__init__.py").exists()}
    assert entries - row_of.keys() == set(), f"modules the page does not name: {sorted(entries - row_of.keys())}"
    assert row_of.keys() - entries == set(), f"the page names what is not there: {sorted(row_of.keys() - entries)}"
    top = lambda module: module.split(".")[1]
    upward = sorted(f"{source} imports {target}" for source, targets in _graph().items() for target in targets
                    if source.count(".") and target.count(".") and top(source) != top(target)
                    and row_of[top(target)] > row_of[top(source)])
    assert not upward, f"imports from a row below (reorder the page or the code): {upward}"


def test_every_benchmark_module_imports():
    """benchmarks/ is a package of row families on one timing helper: each module imports (the
    rows themselves run in ``python benchmarks/run.py``, not here)."""
    import importlib
    import sys

    sys.path.insert(0, str(PACKAGE.parent))
    try:
        names = sorted(p.stem for p in (PACKAGE.parent / "benchmarks").glob("*.py")
                       if p.stem not in ("__init__", "kfac_jax_digits", "kronfluence_digits"))  # their own environments
        for name in names:
            importlib.import_module(f"benchmarks.{name}")
    finally:
        sys.path.remove(str(PACKAGE.parent))
    assert {"timing", "models", "run", "tables"} <= set(names)
