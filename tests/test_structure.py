"""The package's shape: imports run one way, and no module is a grab bag."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fd_cudagraph_plugin"


def _imports(path: Path) -> set[str]:
    """Every ``fd_cudagraph_plugin`` module that ``path`` imports, lazily or not."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "fd_cudagraph_plugin":
                found.update(f"fd_cudagraph_plugin.{alias.name}" for alias in node.names)
            elif node.module.startswith("fd_cudagraph_plugin."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("fd_cudagraph_plugin."))
    return found


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _imports(path) & set(modules) for name, path in modules.items()}


def test_no_import_cycle_in_the_package():
    graph = _graph()
    # The package __init__ only re-exports lazily; it is the top, never imported for its own code.
    graph = {m: {d for d in deps if d != "fd_cudagraph_plugin"} for m, deps in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(module: str, stack: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_cycle_check_sees_lazy_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from fd_cudagraph_plugin import stats\n")
    assert _imports(module) == {"fd_cudagraph_plugin.stats"}


def test_no_module_over_about_400_lines_and_a_small_backend():
    sizes = {p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in PACKAGE.glob("*.py")}
    assert sizes["backend.py"] < 300
    assert {name: n for name, n in sizes.items() if n > 450} == {}


def test_the_package_is_pure_python():
    assert [p.name for p in PACKAGE.rglob("*") if p.suffix in {".c", ".so", ".pyx"}] == []
