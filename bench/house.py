"""The shape of the code (issues 22 and 43), read from the source of a tree, nothing run:

    python bench/house.py [--tree T]

A tree before a change: ``git archive REV | tar -x -C /tmp/before``, then ``--tree /tmp/before``.

- files and lines per part (core, runner, TF layer, Keras callbacks, the rest);
- import cycles among the package's modules (function-level imports included), at run time
  and counting the type-only imports (``if TYPE_CHECKING:``) too;
- modules that reach another module's private name (``from .x import _y``, ``x._y``);
- functions with type hints: a function counts when its return and every parameter but
  ``self``/``cls`` are annotated;
- the methods of ``ResilientComm`` and of the mixins it is made of;
- ``print`` calls against logging calls;
- timing literals outside the settings table (``core/config.py``) and the named internal
  constants (``core/timings.py``): a number (not 0, 1, 2 or a unit factor) in code, not in a
  comment or docstring, on a line that names a time, a wait or a threshold;
- the longest functions.
"""

import argparse
import ast
import io
import re
import tokenize
from pathlib import Path

PACKAGES = ("elastic_hvd", "keras_callbacks")
#: The parts of the package, by path prefix (the first that matches wins).
PARTS = (("core", "elastic_hvd/core/"), ("runner", "elastic_hvd/runner/"),
         ("tensorflow", "elastic_hvd/tensorflow/"), ("keras_callbacks", "keras_callbacks/"),
         ("rest of elastic_hvd", "elastic_hvd/"))
#: A line whose code names a time, a wait or a threshold.
TIMEY = re.compile(r"sleep|timeout|deadline|wait|\.join\(|period|grace|interval|poll|pause|"
                   r"patience|spin|retry|retries|failures|limit|budget|rank\)|_s\b|seconds|"
                   r"check_every|polls|monotonic|perf_counter|burst|sample|share|margin", re.I)
#: Numbers that are no timing: zero, one, two, unit factors.
NOT_TIMINGS = {"0", "0.0", "1", "2", "1e3", "1e6", "1000", "1000.0"}
#: Where timings belong.
TIMING_HOMES = {"elastic_hvd/core/config.py", "elastic_hvd/core/timings.py"}
LOG_METHODS = {"debug", "info", "warning", "error", "exception", "critical", "log"}
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


def lines_per_part(root, found):
    parts = {}
    for path, _ in found.values():
        rel = path.relative_to(root).as_posix()
        name = next(n for n, prefix in PARTS if rel.startswith(prefix))
        files, lines = parts.get(name, (0, 0))
        parts[name] = (files + 1, lines + len(path.read_text().splitlines()))
    return parts


def calls(found):
    """(print calls, logging calls: ``<something with log in its name>.warning(...)`` etc.)"""
    prints = logs = 0
    for path, _ in found.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                prints += isinstance(f, ast.Name) and f.id == "print"
                logs += (isinstance(f, ast.Attribute) and f.attr in LOG_METHODS
                         and "log" in ast.unparse(f.value).lower())
    return prints, logs


def timing_literals(root, found):
    count = 0
    for path, _ in found.values():
        if path.relative_to(root).as_posix() in TIMING_HOMES:
            continue
        src = path.read_text()
        lines = src.splitlines()
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type == tokenize.NUMBER and tok.string not in NOT_TIMINGS:
                code = lines[tok.start[0] - 1].split("#")[0]
                count += bool(TIMEY.search(code)) and "round(" not in code
    return count


def longest(root, found, n=6):
    sizes = []
    for path, _ in found.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                sizes.append((node.end_lineno - node.lineno + 1,
                              f"{path.relative_to(root).as_posix()}:{node.name}"))
    return sorted(sizes, reverse=True)[:n]


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
    print("files and lines per part:", ", ".join(
        f"{name} {files}/{lines}" for name, (files, lines) in lines_per_part(root, found).items()))
    prints, logs = calls(found)
    print(f"print calls: {prints}; logging calls: {logs}")
    print(f"timing literals outside config.py and timings.py: {timing_literals(root, found)}")
    print("longest functions:", ", ".join(f"{name} {size}" for size, name in longest(root, found)))


if __name__ == "__main__":
    main()
