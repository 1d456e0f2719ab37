"""The package's import structure: no module of sft/ imports itself back through others.

A circle works only as long as its imports stay inside functions, or in the one order that happens to work; it
also means two modules that cannot be understood (or tested) apart. The graph counts every import, at the top of
a module or inside a function, except those under `if TYPE_CHECKING:` (never run)."""

from __future__ import annotations

import ast
from pathlib import Path

SFT = Path(__file__).resolve().parent.parent / "sft"


def module_name(path: Path, root: Path = SFT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:`."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skipped


def _dynamic_import(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and ast.unparse(node.func) in ("__import__", "importlib.import_module") \
        and bool(node.args) and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)


def import_graph(root: Path = SFT) -> dict[str, set[str]]:
    """module -> the sft modules it imports (a name imported from a package is its submodule when there is one)."""
    modules = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        skipped = _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            elif _dynamic_import(node):  # __import__("sft.x") or importlib.import_module("sft.x"): an import too
                targets = [node.args[0].value]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle of imports per strongly connected group of modules, each as a path a -> ... -> a."""
    return [_circle(graph, group) for group in tangles(graph)]


def tangles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected groups of more than one node (Tarjan): nodes that import each other in circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # the package has a few dozen modules: recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """folder -> the folders it imports from: sft/data/*.py are `data`; a module at the top (sft/train.py) is its
    own `train`."""
    def folder(module: str) -> str:
        return module.split(".")[1] if "." in module else module

    folders: dict[str, set[str]] = {folder(m): set() for m in graph}
    for module, targets in graph.items():
        folders[folder(module)] |= {folder(t) for t in targets} - {folder(module)}
    return folders


def _circle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """The shortest circle through the group's first module (breadth first), to name in a failure."""
    start = min(group)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & group):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    raise AssertionError(f"no circle in {group}")


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles among sft modules:\n" + "\n".join(" -> ".join(c) for c in found)


# The folders that still import each other in circles: the data audit's command (python -m sft.data.dataset)
# reads the options and loads a tokenizer, while sft/options/ checks data names and sft/model/ renders templates;
# sft/model/ and sft/speed/ read sft/safety/'s tables (run_dir, private_names) while sft/safety/ reloads models.
# No other folder may join them (parallel, plan, report and the trainer left in issue 25).
TANGLED = {"data", "model", "options", "safety", "speed"}


def test_no_folder_joins_the_known_import_circles():
    graph = folder_graph(import_graph())
    grown = [group for group in tangles(graph) if not group <= TANGLED]
    assert not grown, "folders importing each other in a circle:\n" + "\n".join(
        " -> ".join(_circle(graph, group)) + f" (the group: {', '.join(sorted(group))})" for group in grown)


def test_the_cycle_finder_finds_one(tmp_path):
    package = tmp_path / "sft"
    (package / "a").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a" / "__init__.py").write_text("")
    (package / "a" / "x.py").write_text("from sft.b import helper\n")
    (package / "b.py").write_text("def helper():\n    from sft.a import x  # inside a function: counted\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import sft.b\n")
    (package / "b2.py").write_text("import sft.c\n__import__('sft.b', fromlist=['helper'])\n")
    graph = import_graph(package)
    assert graph["sft.b"] == {"sft.a.x"} and graph["sft.c"] == set() and graph["sft.b2"] == {"sft.c", "sft.b"}
    assert cycles(graph) == [["sft.a.x", "sft.b", "sft.a.x"]]
    assert tangles(folder_graph(graph)) == [{"a", "b"}]
