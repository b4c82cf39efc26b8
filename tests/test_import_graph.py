"""No two modules of the package import each other, directly or through others, counting imports inside
functions: a cycle works only while each module happens to be half-initialized at the right moment."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the folders that install as packages, by their installed name (pyproject.toml's package-dir)
PACKAGES = {"speculators": ROOT / "speculators", "speculators.kernels": ROOT / "kernels",
            "speculators.export": ROOT / "export"}


def modules() -> dict[str, Path]:
    """{installed module name: file} for every module; a subfolder of a mapped folder that is itself
    mapped (none today) is left to its own mapping."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found.setdefault(".".join([package, *parts]), path)
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `name` imports anywhere in its file (`from . import x` counts x when x
    is a module, else the package)."""
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                stem = base[: len(base) - node.level + 1]
                module = ".".join(stem + ([node.module] if node.module else []))
            else:
                module = node.module
            targets = [f"{module}.{alias.name}" for alias in node.names] + [module]
        else:
            continue
        for target in targets:
            while target and target not in known:  # speculators.target.Target -> speculators.target
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path that returns to its start, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph = {name: imports(name, path, set(mods)) for name, path in mods.items()}
    # a package's __init__ runs before any of its modules: a module importing its own package (or an
    # ancestor) is the normal direction, not a cycle
    return {name: {t for t in deps if not name.startswith(t + ".")} for name, deps in graph.items()}


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 30 and "speculators.assets" in graph["speculators.target"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path):
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from .c import g\n")
    (tmp_path / "c.py").write_text("import pkg.a\n")
    known = {"pkg", "pkg.a", "pkg.b", "pkg.c"}
    graph = {f"pkg.{m}": imports(f"pkg.{m}", tmp_path / f"{m}.py", known) for m in "abc"}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
