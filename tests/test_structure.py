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
            if node.module == "fd_cudagraph_plugin" or node.module.startswith(
                "fd_cudagraph_plugin."
            ):
                # ``from pkg import name`` imports the module pkg.name where one exists, else
                # a name of pkg itself: keep both, _graph() keeps those that are modules.
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
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
    module.write_text("def f():\n    from fd_cudagraph_plugin.core import stats\n")
    assert "fd_cudagraph_plugin.core.stats" in _imports(module)


def test_the_serving_core_never_imports_the_tools():
    graph = _graph()
    core = {m: deps for m, deps in graph.items() if m.startswith("fd_cudagraph_plugin.core")}
    reaching = {
        m: sorted(d for d in deps if d.startswith("fd_cudagraph_plugin.tools"))
        for m, deps in core.items()
    }
    assert {m: d for m, d in reaching.items() if d} == {}
    assert "fd_cudagraph_plugin.core.observability" in graph["fd_cudagraph_plugin.tools.demo"]


def test_the_package_is_pure_python():
    assert [p.name for p in PACKAGE.rglob("*") if p.suffix in {".c", ".so", ".pyx"}] == []


#: Lines a wing may hold, set to the sizes it had when the budget was last set (0.8.0, 2026-12-07).
#: Raising one is a change of its own, with its reason in the commit: every feature deletes as it
#: adds, or says why not. Lowering one after a clean-up keeps what the clean-up won.
BUDGETS = {
    "core": 7912,
    "core/ranks": 1340,
    "tools": 5235,
}
#: The largest module, whichever it is.
LARGEST_MODULE = 980


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_every_wing_stays_within_its_budget():
    sizes = {wing: sum(_lines(p) for p in (PACKAGE / wing).rglob("*.py")) for wing in BUDGETS}
    over = {wing: (sizes[wing], limit) for wing, limit in BUDGETS.items() if sizes[wing] > limit}
    assert not over, f"lines over budget (wing: (lines, budget)): {over}"
    largest = max(PACKAGE.rglob("*.py"), key=_lines)
    assert _lines(largest) <= LARGEST_MODULE, (largest.name, _lines(largest))


def test_the_budget_check_counts_a_module_added_to_a_wing(tmp_path, monkeypatch):
    """A planted module of 2,000 lines in a copy of the ranks' wing puts it over its budget."""
    import shutil

    copy = tmp_path / "fd_cudagraph_plugin"
    shutil.copytree(PACKAGE, copy)
    (copy / "core" / "ranks" / "grown.py").write_text("x = 1\n" * 2000, encoding="utf-8")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", copy)
    try:
        test_every_wing_stays_within_its_budget()
    except AssertionError as error:
        assert "core/ranks" in str(error)
    else:
        raise AssertionError("a wing over its budget passed")


def test_this_run_has_a_temporary_directory_of_its_own(tmp_path):
    """Not pytest's shared ``pytest-of-<user>``, which another run of the same user rotates."""
    assert "pytest-of-" not in str(tmp_path), tmp_path
