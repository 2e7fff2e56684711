"""The package's import graph, read from the source (imports inside functions included): no cycle, no import to a
higher floor (FLOORS), nothing outside cli/ imports cli/, and the config reaches neither into model conversion nor
into metrics."""

import ast
import functools
import pathlib

PACKAGE = "openrlhf_async"
ROOT = pathlib.Path(__file__).resolve().parent.parent / PACKAGE

# The package's floors, lowest first: a module (a folder's, or a top-level one) imports only from its own floor or
# below, so that each role is built on what lies beneath it and can be read without what lies above.
FLOORS = {"errors": 0, "compat": 0, "utils": 1, "data": 2, "models": 3, "reward": 4, "agent": 5, "config": 6,
          "rollout": 7, "trainer": 8, "cli": 9}


def module_files(root: pathlib.Path = ROOT) -> dict:
    """{dotted module name: file} for every .py under the package; a package's __init__.py is the package itself."""
    files = {}
    for path in sorted(root.rglob("*.py")):
        parts = (PACKAGE,) + path.relative_to(root).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` names, its relative dots resolved against the importing module."""
    if not node.level:
        return node.module
    parts = module.split(".")
    anchor = parts if is_package else parts[:-1]
    anchor = anchor[:len(anchor) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def imports_of(module: str, path: pathlib.Path, modules) -> list:
    """(imported package module, line) for every import in the file, at any depth: `import a.b`, `from a import b`
    (b a submodule: that submodule; otherwise a), relative forms, and importlib.import_module("...") literals."""
    is_package = path.name == "__init__.py"
    found = []

    def add(target, line):
        if target in modules and (target, line) not in found:
            found.append((target, line))

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, is_package, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in modules else base, node.lineno)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) == "import_module"):
            add(node.args[0].value, node.lineno)
    return found


@functools.lru_cache(maxsize=None)
def import_graph(root: pathlib.Path = ROOT) -> dict:
    """{module: [(imported module, file:line), ...]} over the package's own modules."""
    files = module_files(root)
    base = root.parent
    return {module: [(target, f"{path.relative_to(base)}:{line}") for target, line in imports_of(module, path, files)]
            for module, path in files.items()}


def cycles(graph: dict) -> list:
    """Strongly connected components with more than one module, or with a self-loop (Tarjan's algorithm)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1 or any(w == v for w, _ in graph[v]):
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _edge(source, target, where):
    return f"  {source} -> {target}  ({where})"


def test_the_scanner_sees_every_kind_of_import(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import leaf\n")
    (pkg / "sub" / "leaf.py").write_text("def f():\n    from ..top import g\n")
    (pkg / "top.py").write_text("import importlib\n\n"
                                "def g():\n    def h():\n        import openrlhf_async.sub\n"
                                "    importlib.import_module('openrlhf_async.sub.leaf')\n"
                                "from openrlhf_async.sub import leaf, not_a_module\n")
    graph = {m: sorted(t for t, _ in edges) for m, edges in import_graph(pkg).items()}
    assert graph == {PACKAGE: [],
                     f"{PACKAGE}.sub": [f"{PACKAGE}.sub.leaf"],
                     f"{PACKAGE}.sub.leaf": [f"{PACKAGE}.top"],
                     f"{PACKAGE}.top": [f"{PACKAGE}.sub", f"{PACKAGE}.sub", f"{PACKAGE}.sub.leaf",
                                        f"{PACKAGE}.sub.leaf"]}
    assert [sorted(c) for c in cycles(import_graph(pkg))] == [
        [f"{PACKAGE}.sub", f"{PACKAGE}.sub.leaf", f"{PACKAGE}.top"]]


def test_no_import_cycle():
    graph = import_graph()
    report = []
    for component in cycles(graph):
        report.append("cycle among " + ", ".join(sorted(component)) + ":")
        report += [_edge(m, t, where) for m in sorted(component) for t, where in graph[m] if t in component]
    assert not report, "\n" + "\n".join(report)


def floor(module: str):
    """The floor of a package module: its folder's or its own (a top-level module's); None for the package itself."""
    parts = module.split(".")
    return FLOORS.get(parts[1]) if len(parts) > 1 else None


def test_every_module_stands_on_a_floor():
    assert [m for m in import_graph() if m != PACKAGE and floor(m) is None] == []


def test_no_import_reaches_a_higher_floor():
    upward = [f"{where}: {m} (floor {floor(m)}) imports {t} (floor {floor(t)})"
              for m, edges in sorted(import_graph().items()) if floor(m) is not None
              for t, where in edges if floor(t) is not None and floor(t) > floor(m)]
    assert not upward, "\n" + "\n".join(upward)


def test_nothing_outside_cli_imports_cli():
    cli = f"{PACKAGE}.cli"
    inside = lambda m: m == cli or m.startswith(cli + ".")  # noqa: E731
    upward = [_edge(m, t, where) for m, edges in sorted(import_graph().items()) if not inside(m)
              for t, where in edges if inside(t)]
    assert not upward, "\n" + "\n".join(upward)


def test_config_imports_no_model_conversion_or_metrics():
    banned = (f"{PACKAGE}.models", f"{PACKAGE}.utils.metrics")
    config = f"{PACKAGE}.config"
    reached = [_edge(m, t, where) for m, edges in import_graph().items() if m == config or m.startswith(config + ".")
               for t, where in edges if any(t == b or t.startswith(b + ".") for b in banned)]
    assert not reached, "\n" + "\n".join(reached)
