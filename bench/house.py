"""The shape of the code (issue 22), read from the source of a tree, nothing run:

    python bench/house.py [--tree T]

- import cycles among the package's modules (function-level imports included), at run time
  and counting the type-only imports (``if TYPE_CHECKING:``) too;
- modules that reach another module's private name (``from .x import _y``, ``x._y``);
- functions with type hints: a function counts when its return and every parameter but
  ``self``/``cls`` are annotated;
- the methods of ``ResilientComm`` and of the mixins it is made of.
"""

import argparse
import ast
from pathlib import Path

PACKAGES = ("elastic_hvd", "keras_callbacks")
COMM_CLASSES = {"core/comm.py": "ResilientComm", "core/repair.py": "RepairMixin",
                "core/joining.py": "JoiningMixin", "core/collectives.py": "CollectivesMixin"}


def modules(root):
    """{dotted name: (path, is a package's __init__)}."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            dotted = ".".join(path.relative_to(root).with_suffix("").parts)
            is_init = dotted.endswith(".__init__")
            found[dotted[:-len(".__init__")] if is_init else dotted] = (path, is_init)
    return found


def _typing_only(tree):
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks."""
    return {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and "TYPE_CHECKING" in ast.unparse(node.test)
            for stmt in node.body for n in ast.walk(stmt)}


def import_graph(found, with_typing):
    graph = {}
    for name, (path, is_init) in found.items():
        tree = ast.parse(path.read_text())
        skip = set() if with_typing else _typing_only(tree)
        base = name if is_init else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                deps |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    parts = base.split(".")[:len(base.split(".")) - node.level + 1]
                    module = ".".join(parts + ([node.module] if node.module else []))
                for alias in node.names:  # ``from pkg import module`` names the module
                    sub = f"{module}.{alias.name}"
                    deps.add(sub if sub in found else module)
        graph[name] = {d for d in deps if d in found and d != name}
    return graph


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def private_reaches(root, found):
    lines = []
    for path, _ in found.values():
        tree = ast.parse(path.read_text())
        ours = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (
                    node.level or (node.module or "").split(".")[0] in PACKAGES):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        lines.append(f"{path.relative_to(root)}:{node.lineno}: "
                                     f"from {node.module} import {alias.name}")
                    ours.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                ours |= {(a.asname or a.name).split(".")[0] for a in node.names
                         if a.name.split(".")[0] in PACKAGES}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in ours and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                lines.append(f"{path.relative_to(root)}:{node.lineno}: {node.value.id}.{node.attr}")
    return lines


def hinted(found):
    total = annotated = 0
    for path, _ in found.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = [a for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                          if a.arg not in ("self", "cls")]
                total += 1
                annotated += node.returns is not None and all(a.annotation for a in params)
    return annotated, total


def methods(root):
    counts = {}
    for rel, cls in COMM_CLASSES.items():
        path = root / "elastic_hvd" / rel
        if path.exists():
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and node.name == cls:
                    counts[cls] = sum(isinstance(b, ast.FunctionDef) for b in node.body)
    return counts


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]))
    root = Path(p.parse_args().tree).resolve()
    found = modules(root)
    print(f"house of {root}: {len(found)} modules")
    print("import cycles at run time:", cycles(import_graph(found, False)) or "none")
    print("import cycles with type-only imports:", cycles(import_graph(found, True)) or "none")
    reaches = private_reaches(root, found)
    print(f"private names reached from another module: {len(reaches)}")
    for line in reaches:
        print("  " + line)
    annotated, total = hinted(found)
    print(f"functions with type hints: {annotated} of {total}")
    print("methods:", ", ".join(f"{c} {n}" for c, n in methods(root).items()))


if __name__ == "__main__":
    main()
