"""The package's shape, as a reviewer reads it: total lines, the longest files and functions, the largest classes,
files per folder, import arrows between folders, imports to a higher floor and import cycles (the floors and the
import graph are tests/test_imports.py's). `--root` reads another checkout (e.g. an older commit's `git archive`) to
compare before and after. Prints a final JSON line."""

import argparse
import ast
import collections
import json
import pathlib
import sys


def shape(root: pathlib.Path) -> dict:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
    import test_imports as ti

    pkg = root / ti.PACKAGE
    graph = ti.import_graph(pkg)
    folder = lambda module: module.split(".")[1] if "." in module else "(top)"  # noqa: E731
    arrows, upward = collections.Counter(), []
    for module, edges in graph.items():
        for target, where in edges:
            if folder(module) != folder(target):
                arrows[f"{folder(module)}->{folder(target)}"] += 1
            low, high = ti.floor(module), ti.floor(target)
            if low is not None and high is not None and high > low:
                upward.append(f"{module} -> {target} ({where})")
    files, functions, classes = [], [], []
    for path in sorted(pkg.rglob("*.py")):
        text, name = path.read_text(), str(path.relative_to(pkg))
        files.append((text.count("\n"), name))
        for node in ast.walk(ast.parse(text)):
            span = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((span, f"{name}:{node.name}"))
            elif isinstance(node, ast.ClassDef):
                classes.append((span, f"{name}:{node.name}"))
    per_folder = collections.Counter(name.split("/")[0] if "/" in name else "(top)" for _, name in files)
    return {"total_lines": sum(n for n, _ in files), "files": len(files), "files_per_folder": dict(per_folder),
            "longest_files": sorted(files, reverse=True)[:3], "longest_functions": sorted(functions, reverse=True)[:3],
            "functions_over_60": sum(n > 60 for n, _ in functions), "largest_classes": sorted(classes, reverse=True)[:3],
            "import_arrows_between_folders": sum(arrows.values()), "upward_imports": upward,
            "cycles": [sorted(c) for c in ti.cycles(graph)]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(pathlib.Path(__file__).resolve().parent.parent),
                        help="the checkout to read (default: this one)")
    print(json.dumps(shape(pathlib.Path(parser.parse_args().root))))
