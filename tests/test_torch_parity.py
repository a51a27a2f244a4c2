"""Parity with Horovod 0.28.1's ``horovod.torch``: every public name exists in
``elastic_hvd.torch`` with Horovod's parameters first and in Horovod's order (so
positional calls work; elastic_hvd may add parameters after them), and so do the public
methods of its classes and of the optimizer its DistributedOptimizer returns.  The
record is tests/horovod_torch_api_0_28_1.py (tests/dump_horovod_torch_api.py).

Names still to come would be listed in NOT_YET (the test fails once one of them exists,
so the list shrinks with the work); none are now.  No MPI here: single-process checks.

Everything that touches ``elastic_hvd.torch`` runs in a Python process of its own, never in
the pytest process: that one may have TensorFlow loaded (other tests of its pytest-xdist
worker import it), and with PyPI's CUDA build of torch, which brings triton, making a torch
optimizer there imports ``torch._dynamo``, which imports triton, whose ``libtriton.so``
segfaults while it is loaded after TensorFlow (its LLVM's static constructors run on
TensorFlow's LLVM symbols: ``llvm::DebugCounter`` in ``_GLOBAL__sub_I_PassBuilder.cpp``,
gdb).  The child reports what the tests compare, as JSON.
"""

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")  # the extra is not installed: nothing to check

from horovod_torch_api_0_28_1 import HOROVOD_TORCH_API, HOROVOD_TORCH_MEMBERS  # noqa: E402

MODULES = {"horovod.torch": "elastic_hvd.torch",
           "horovod.torch.elastic": "elastic_hvd.torch.elastic"}

# Horovod's names that elastic_hvd deliberately lacks.
NOT_PROVIDED = {
    ("horovod.torch", "check_extension"):
        "checks that Horovod's compiled C extension was built; elastic_hvd has none",
}

# Horovod's names that issue 47 still has to bring (a module: all of its names): none now.

NOT_YET: dict = {}


def _pending(module, name):
    return (module, name) in NOT_PROVIDED or (module, name) in NOT_YET \
        or (module, None) in NOT_YET


CASES = [(module, name, params) for module, names in HOROVOD_TORCH_API.items()
         for name, params in names.items() if not _pending(module, name)]

MEMBER_CASES = [(key, member, params) for key, members in HOROVOD_TORCH_MEMBERS.items()
                if not _pending(*key.partition("() -> ")[0].rpartition(".")[::2])
                for member, params in members.items()]

#: Run in a process of its own (see the module doc): our names' parameters, the members'
#: parameters, and the facts the other tests check, as JSON on stdout.
CHILD = """
import importlib, inspect, json, sys

import torch

modules, names, members = json.loads(sys.argv[1])


def parameters(obj):
    target = obj.__init__ if inspect.isclass(obj) else obj
    got = [p.name for p in inspect.signature(target).parameters.values()
           if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return got[1:] if inspect.isclass(obj) else got


def ours_for(key):
    # a class, or the optimizer that DistributedOptimizer returns (made without init():
    # it needs no collective)
    path, _, what = key.partition("() -> ")
    module, _, name = path.rpartition(".")
    found = getattr(importlib.import_module(modules[module]), name)
    if what:
        model = torch.nn.Linear(2, 1)
        return found(torch.optim.SGD(model.parameters(), lr=0.1),
                     named_parameters=model.named_parameters())
    return found


out = {"names": {}, "members": {}, "absent": {}}
for module, name, signed in names:
    ours = importlib.import_module(modules[module])
    key = module + "." + name
    if not hasattr(ours, name):
        out["names"][key] = "missing"
    else:
        out["names"][key] = parameters(getattr(ours, name)) if signed else "exists"
    out["absent"][key] = not hasattr(ours, name)
for key, member, kind in members:
    ours = ours_for(key)
    where = key + "." + member
    if not hasattr(ours, member):
        out["members"][where] = "missing"
        continue
    if kind == "attribute":
        out["members"][where] = "exists"
        continue
    got = [p.name for p in inspect.signature(getattr(ours, member)).parameters.values()
           if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if inspect.isclass(ours) and not isinstance(inspect.getattr_static(ours, member),
                                                staticmethod):
        got = got[1:]  # self
    out["members"][where] = got

import elastic_hvd.torch as hvd
model = torch.nn.Linear(2, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.25, momentum=0.5))
out["wrapped"] = [isinstance(opt, torch.optim.SGD), type(opt).__name__,
                  opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]]

from elastic_hvd import horovod_alias
horovod_alias.install(quiet=True)
import horovod.torch
import horovod.torch.mpi_ops
import elastic_hvd.torch.mpi_ops
out["alias"] = (horovod.torch is hvd and horovod.torch.mpi_ops is elastic_hvd.torch.mpi_ops)

from elastic_hvd.core import NotInitializedError
try:
    hvd.allreduce(torch.ones(2))
    out["before_init"] = "no error"
except NotInitializedError as exc:
    out["before_init"] = str(exc)

out["tensorflow"] = sorted(m for m in sys.modules
                           if m.split(".")[0] in ("tensorflow", "keras", "tf_keras",
                                                  "keras_callbacks"))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def ours():
    """What the child process found (see the module doc)."""
    names = [(module, name, params is not None) for module, name, params in CASES]
    names += [(module, name, False) for module, name in NOT_PROVIDED]
    names += [(module, name, False) for module, name in NOT_YET if name is not None]
    members = [(key, member, "attribute" if params == "attribute" else "signed")
               for key, member, params in MEMBER_CASES]
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps([MODULES, names, members])],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_horovod_torch_module_is_mapped_or_pending():
    assert sorted(MODULES) == sorted(HOROVOD_TORCH_API)
    for module, ours_ in MODULES.items():
        assert ours_ is not None or (module, None) in NOT_YET


def test_not_provided_and_pending_names_are_horovods_and_absent_here(ours):
    for module, name in list(NOT_PROVIDED) + [k for k in NOT_YET if k[1] is not None]:
        assert name in HOROVOD_TORCH_API[module]
        assert ours["absent"][f"{module}.{name}"], f"{name} exists now: take it off NOT_YET"


@pytest.mark.parametrize("module,name,params", CASES, ids=[f"{m}.{n}" for m, n, _ in CASES])
def test_name_and_parameters(ours, module, name, params):
    got = ours["names"][f"{module}.{name}"]
    assert got != "missing", f"{MODULES[module]} lacks {name}"
    if params is None:
        return
    expected = [p for p in params if not p.startswith("*")]
    assert got[:len(expected)] == expected, f"{name}: ours {got}, Horovod {expected}"


@pytest.mark.parametrize("key,member,params", MEMBER_CASES,
                         ids=[f"{k}.{m}" for k, m, _ in MEMBER_CASES])
def test_methods_and_properties(ours, key, member, params):
    got = ours["members"][f"{key}.{member}"]
    assert got != "missing", f"{key} lacks {member}"
    if params == "attribute":
        return
    expected = [p for p in params if not p.startswith("*")]
    assert got[:len(expected)] == expected, f"{key}.{member}: ours {got}, Horovod {expected}"


def test_the_returned_optimizer_is_the_wrapped_class(ours):
    """As Horovod's: an instance of the wrapped optimizer's class, with its options."""
    assert ours["wrapped"] == [True, "SGD", 0.25, 0.5]


def test_horovod_torch_imports_as_elastic_hvd_torch(ours):
    assert ours["alias"] is True


def test_calls_before_init_raise_a_clear_error(ours):
    assert "hvd.init" in ours["before_init"], ours["before_init"]


def test_the_torch_layer_imports_no_tensorflow(ours):
    """The core has no TensorFlow in it: the torch front end runs without it (the child
    imported elastic_hvd.torch, made optimizers and used the alias)."""
    assert ours["tensorflow"] == [], ours["tensorflow"]


def test_a_torch_optimizer_made_after_tensorflow_was_imported_does_not_crash():
    """With TensorFlow loaded first, torch's first optimizer would load triton (PyPI's CUDA
    torch brings it) and segfault (see the module doc): elastic_hvd.torch keeps triton out."""
    code = ("import tensorflow, torch, elastic_hvd.torch as hvd; "
            "m = torch.nn.Linear(2, 1); "
            "hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1)); print('made')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "made" in done.stdout, (done.returncode, done.stderr[-2000:])
