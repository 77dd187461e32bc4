"""The layout of the package: modules stay small, the modules' imports of each other form no circle, and no path
in the package reaches outside it (an installed package has no checkout around it)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "transformers_jakiro"
MAX_LINES = 600
# Modules allowed a path that climbs out of the package (none).
CLIMBING_ALLOWED = set()


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported_modules(name: str, path: Path, modules: dict) -> set[str]:
    """The package's modules that `name` imports by name: at module level and inside functions alike (a function-local
    import of a module that imports this one back is still a circle, only a deferred one)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # `from . import x` imports the submodule x, `from .x import y` the module x
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {module for module in found if module in modules and module != name}


def test_no_module_is_longer_than_the_limit():
    lengths = {name: len(path.read_text(encoding="utf-8").splitlines()) for name, path in _modules().items()}
    assert {name: n for name, n in lengths.items() if n > MAX_LINES} == {}


def test_the_import_graph_has_no_circle():
    modules = _modules()
    graph = {name: _imported_modules(name, path, modules) for name, path in modules.items()}
    done, path = set(), []

    def visit(name):
        if name in path:
            pytest.fail("import circle: " + " -> ".join(path[path.index(name):] + [name]))
        if name in done:
            return
        path.append(name)
        for imported in sorted(graph[name]):
            visit(imported)
        path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def _levels_up(node) -> int | None:
    """How many directories above the module's own file a `Path(__file__)...` expression ends: `.parent` is 1,
    `.parents[n]` is n + 1; None when the expression does not start from `__file__`."""
    levels = 0
    while True:
        if isinstance(node, ast.Attribute) and node.attr == "parent":
            levels, node = levels + 1, node.value
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "parents":
            if not isinstance(node.slice, ast.Constant):
                return None
            levels, node = levels + node.slice.value + 1, node.value.value
        elif isinstance(node, ast.Call) and node.args:  # Path(__file__), Path(__file__).resolve()
            node = node.args[0] if not isinstance(node.func, ast.Attribute) else node.func.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            node = node.func.value
        elif isinstance(node, ast.Name):
            return levels if node.id == "__file__" else None
        else:
            return None


def test_no_path_climbs_out_of_the_package():
    for name, path in _modules().items():
        if name in CLIMBING_ALLOWED:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        # The outermost expression of each chain is the one to measure: ast.walk reaches it before its parts.
        seen = set()
        for node in ast.walk(tree):
            if id(node) in seen or not isinstance(node, (ast.Attribute, ast.Subscript)):
                continue
            levels = _levels_up(node)
            if levels is None:
                continue
            seen.update(id(inner) for inner in ast.walk(node))
            reached = path.parents[levels - 1] if levels else path
            assert reached == PACKAGE or PACKAGE in reached.parents, (
                f"{name} (line {node.lineno}) reaches {reached}, outside the package"
            )
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert "shared/data" not in node.value and "../" not in node.value, f"{name}: {node.value[:80]!r}"
