"""Write tests/horovod_api_0_28_1.py from Horovod's sdist, read with ``ast`` (Horovod is
neither built nor imported: it needs its C extension and a matching TensorFlow).

    pip download horovod==0.28.1 --no-deps --no-binary :all: -d /tmp/hvdsdist
    tar xzf /tmp/hvdsdist/horovod-0.28.1.tar.gz -C /tmp/hvdsdist
    python tests/dump_horovod_api.py /tmp/hvdsdist/horovod-0.28.1

A module's API is what ``hvd.<name>`` finds in it: every public name it defines or
re-exports (imports and assignments at module level, also inside top-level
``if``/``try``/``with``; ``from x import *`` through x's ``__all__``), except names
that come from outside Horovod (``tf``, ``np``, ``K``, ...), which are not
Horovod's API.  Parameters: those of a function, of a class's ``__init__`` (found
up the Horovod base classes) or of a method bound to a Horovod object
(``size = _basics.size``), ``self`` dropped; None when unknown (a constant, a
module, a class whose ``__init__`` comes from outside Horovod).
"""

import ast
import os
import pprint
import sys

MODULES = ["horovod.tensorflow", "horovod.tensorflow.keras",
           "horovod.tensorflow.keras.callbacks", "horovod.tensorflow.keras.elastic",
           "horovod.tensorflow.elastic", "horovod.keras", "horovod.keras.callbacks",
           "horovod.keras.elastic"]
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "horovod_api_0_28_1.py")

EXTERNAL = ("external",)  # from outside Horovod: not part of its API
UNKNOWN = ("unknown",)    # a value whose parameters cannot be read


class Source:
    """Horovod's modules, parsed on demand, and what each of their names is bound to."""

    def __init__(self, root):
        self.root = root
        self._bindings = {}

    def path(self, module):
        base = os.path.join(self.root, *module.split("."))
        for path in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(path):
                return path
        return None

    def bindings(self, module):
        """{name: (binding, module)} in order of first appearance; a binding in an
        ``except`` block is a fallback and does not replace the one before it."""
        if module not in self._bindings:
            path = self.path(module)
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            found = {}
            self._bindings[module] = found  # a module importing itself sees what is bound so far
            package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
            self._collect(tree.body, module, package, found, fallback=False)
        return self._bindings[module]

    def _collect(self, body, module, package, found, fallback):
        def bind(name, binding):
            if not (fallback and name in found):
                found[name] = (binding, module)

        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bind(node.name, node)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        bind(alias.asname, ("import", alias.name))
                    else:
                        top = alias.name.split(".")[0]
                        bind(top, ("import", top))
            elif isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:
                    parent = package.rsplit(".", node.level - 1)[0]
                    source = f"{parent}.{source}" if node.module else parent
                for alias in node.names:
                    if alias.name == "*":
                        for name in self.exports(source):
                            bind(name, ("from", source, name))
                    else:
                        bind(alias.asname or alias.name, ("from", source, alias.name))
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        bind(target.id, ("value", node.value))
            elif isinstance(node, ast.If):
                self._collect(node.body + node.orelse, module, package, found, fallback)
            elif isinstance(node, ast.With):
                self._collect(node.body, module, package, found, fallback)
            elif isinstance(node, ast.Try):
                self._collect(node.body + node.orelse + node.finalbody, module, package,
                              found, fallback)
                for handler in node.handlers:
                    self._collect(handler.body, module, package, found, fallback=True)

    def exports(self, module):
        """What ``from module import *`` binds: ``__all__``, else the public names."""
        if not _is_horovod(module) or self.path(module) is None:
            return []
        bindings = self.bindings(module)
        value = bindings.get("__all__", ((None,), None))[0]
        if value[0] == "value":
            return [ast.literal_eval(e) for e in value[1].elts]
        return [name for name in bindings if not name.startswith("_")]

    def resolve(self, module, name):
        """What ``module.name`` is: a def/class node with its module, a module, or
        EXTERNAL / UNKNOWN."""
        if not _is_horovod(module):
            return EXTERNAL
        if self.path(f"{module}.{name}"):
            return ("module", f"{module}.{name}")
        if self.path(module) is None or name not in self.bindings(module):
            return UNKNOWN
        binding, where = self.bindings(module)[name]
        if isinstance(binding, ast.AST):
            return ("def", binding, where)
        if binding[0] == "import":
            return ("module", binding[1]) if _is_horovod(binding[1]) else EXTERNAL
        if binding[0] == "from":
            return self.resolve(binding[1], binding[2])
        return self._value(binding[1], where)

    def _value(self, expr, module):
        """What an assigned expression is: an alias, a module's attribute, or a method
        of a Horovod object (``_basics = HorovodBasics(...)``; ``size = _basics.size``)."""
        if isinstance(expr, ast.Name):
            return self.resolve(module, expr.id)
        if isinstance(expr, ast.Attribute):
            base = self._value(expr.value, module)
            if base[0] == "module":
                return self.resolve(base[1], expr.attr)
            if base[0] == "instance":
                method = self._method(base[1], base[2], expr.attr)
                return ("method",) + method[1:] if method and method[0] == "def" else UNKNOWN
            return EXTERNAL if base is EXTERNAL else UNKNOWN
        if isinstance(expr, ast.Call):
            made_by = self._value(expr.func, module)
            if made_by[0] == "def" and isinstance(made_by[1], ast.ClassDef):
                return ("instance", made_by[1], made_by[2])
        return UNKNOWN

    def _method(self, cls, module, name):
        """(``"def"``, node, module) of ``cls.name``, looked up the Horovod bases."""
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return ("def", node, module)
        for base in cls.bases:
            found = self._value(base, module)
            if found[0] == "def" and isinstance(found[1], ast.ClassDef):
                method = self._method(found[1], found[2], name)
                if method:
                    return method
            elif not (isinstance(base, ast.Name) and base.id == "object"):
                return UNKNOWN  # a base from outside Horovod may define it
        return None

    def parameters(self, target):
        if target[0] == "method":
            return _arguments(target[1])[1:]
        if target[0] != "def":
            return None
        node, module = target[1], target[2]
        if not isinstance(node, ast.ClassDef):
            forwarded = self._forwarded_to(node, module)
            return self.parameters(forwarded) if forwarded else _arguments(node)
        init = self._method(node, module, "__init__")
        if init is None:
            return []  # object.__init__
        return _arguments(init[1])[1:] if init[0] == "def" else None

    def _forwarded_to(self, func, module):
        """What ``def f(*args, **kwargs)`` passes its arguments on to, when that is a
        Horovod function (``init`` forwards to ``_basics.init``): its parameters are f's."""
        a = func.args
        if a.posonlyargs or a.args or a.kwonlyargs or not (a.vararg and a.kwarg):
            return None
        for call in ast.walk(func):
            if isinstance(call, ast.Call) and \
                    any(isinstance(x, ast.Starred) and getattr(x.value, "id", None) == a.vararg.arg
                        for x in call.args) and \
                    any(k.arg is None and getattr(k.value, "id", None) == a.kwarg.arg
                        for k in call.keywords):
                target = self._value(call.func, module)
                if target[0] in ("def", "method"):
                    return target
        return None


def _is_horovod(module):
    return module == "horovod" or module.startswith("horovod.")


def _arguments(func):
    a = func.args
    names = [p.arg for p in a.posonlyargs + a.args]
    if a.vararg:
        names.append("*" + a.vararg.arg)
    names += [p.arg for p in a.kwonlyargs]
    if a.kwarg:
        names.append("**" + a.kwarg.arg)
    return names


#: The classes of the objects that Horovod's factory functions return, which no name
#: of the API reaches: (module, factory) -> [(what the object is, (module, function
#: the class is defined in or None, class))].  Read off horovod/tensorflow/__init__.py's
#: DistributedOptimizer / DistributedGradientTape and horovod/_keras/__init__.py's
#: create_distributed_optimizer (the Keras wrapper, a class made inside a function).
_KERAS_WRAPPER = ("horovod._keras", "create_distributed_optimizer", "_DistributedOptimizer")
_TAPE = ("horovod.tensorflow", None, "_DistributedGradientTape")
RETURNED = {
    ("horovod.tensorflow", "DistributedOptimizer"): [
        ("Keras optimizer", _KERAS_WRAPPER),
        ("TF1 optimizer", ("horovod.tensorflow", None, "_DistributedOptimizer"))],
    ("horovod.tensorflow", "DistributedGradientTape"): [("tape", _TAPE)],
    ("horovod.tensorflow", "PartialDistributedGradientTape"): [("tape", _TAPE)],
    ("horovod.tensorflow.keras", "DistributedOptimizer"): [("Keras optimizer", _KERAS_WRAPPER)],
    ("horovod.keras", "DistributedOptimizer"): [("Keras optimizer", _KERAS_WRAPPER)],
}


def _members(source, cls, module):
    """{public method or property: parameters (no ``self``), or "attribute"} of ``cls``
    and of its Horovod bases (a base from outside Horovod -- tf.GradientTape, a Keras
    Callback -- is that library's API, not Horovod's)."""
    found = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            decorators = {ast.unparse(d) for d in node.decorator_list}
            if "property" in decorators:
                found[node.name] = "attribute"
            elif not any(d.endswith((".setter", ".deleter")) for d in decorators):
                names = _arguments(node)
                found[node.name] = names if "staticmethod" in decorators else names[1:]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name) and not target.id.startswith("_"):
                    found[target.id] = "attribute"
    for base in reversed(cls.bases):
        resolved = source._value(base, module) if not isinstance(base, ast.Starred) else EXTERNAL
        if resolved[0] == "def" and isinstance(resolved[1], ast.ClassDef):
            found = {**_members(source, resolved[1], resolved[2]), **found}
    return found


def _class(source, module, function, name):
    """The ClassDef ``name`` at the top of ``module``, or inside its ``function``."""
    scope = source.bindings(module)[function or name][0]
    if function is None:
        return scope
    return next(n for n in ast.walk(scope) if isinstance(n, ast.ClassDef) and n.name == name)


def dump_members(source, api):
    """{"module.name": {member: parameters}} for every class of the API and, as
    "module.name() -> what", for the objects its factories return (RETURNED)."""
    members = {}
    for module, names in api.items():
        for name in names:
            target = source.resolve(module, name)
            if target[0] == "def" and isinstance(target[1], ast.ClassDef):
                members[f"{module}.{name}"] = _members(source, target[1], target[2])
            for what, (where, function, cls) in RETURNED.get((module, name), []):
                members[f"{module}.{name}() -> {what}"] = _members(
                    source, _class(source, where, function, cls), where)
    return members


def dump(root):
    source = Source(root)
    api = {}
    for module in MODULES:
        if source.path(module) is None:
            print(f"{module}: not in the sdist", file=sys.stderr)
            continue
        names = {}
        for name in source.bindings(module):
            target = source.resolve(module, name)
            if not name.startswith("_") and target is not EXTERNAL:
                names[name] = source.parameters(target)
        api[module] = names
    return api, dump_members(source, api)


HEADER = '''"""Public names and parameter names of Horovod 0.28.1's TF/Keras modules, and the
public methods and properties of its classes and of the objects its factories return.

Generated by tests/dump_horovod_api.py from Horovod's PyPI sdist (see that script's
docstring to re-run it); do not edit.  Used by test_horovod_parity.py.
"""

HOROVOD_API = '''


def main():
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} UNPACKED_HOROVOD_SDIST_DIR")
    api, members = dump(sys.argv[1])
    with open(OUT, "w") as f:
        f.write(HEADER + pprint.pformat(api, sort_dicts=False, width=100) + "\n")
        f.write("\nHOROVOD_MEMBERS = " + pprint.pformat(members, sort_dicts=False, width=100)
                + "\n")
    for module, names in api.items():
        print(f"{module}: {len(names)} names")
    print(f"{len(members)} classes, {sum(map(len, members.values()))} members")


if __name__ == "__main__":
    main()
