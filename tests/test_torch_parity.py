"""Parity with Horovod 0.28.1's ``horovod.torch``: every public name exists in
``elastic_hvd.torch`` with Horovod's parameters first and in Horovod's order (so
positional calls work; elastic_hvd may add parameters after them), and so do the public
methods of its classes and of the optimizer its DistributedOptimizer returns.  The
record is tests/horovod_torch_api_0_28_1.py (tests/dump_horovod_torch_api.py).

Names still to come would be listed in NOT_YET (the test fails once one of them exists,
so the list shrinks with the work); none are now.  No MPI here: single-process checks.
"""

import importlib
import inspect
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

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


def test_every_horovod_torch_module_is_mapped_or_pending():
    assert sorted(MODULES) == sorted(HOROVOD_TORCH_API)
    for module, ours in MODULES.items():
        assert ours is not None or (module, None) in NOT_YET


def test_not_provided_and_pending_names_are_horovods_and_absent_here():
    for module, name in list(NOT_PROVIDED) + [k for k in NOT_YET if k[1] is not None]:
        assert name in HOROVOD_TORCH_API[module]
        ours = importlib.import_module(MODULES[module])
        assert not hasattr(ours, name), f"{name} exists now: take it off NOT_YET"


def _parameters(obj):
    target = obj.__init__ if inspect.isclass(obj) else obj
    names = [p.name for p in inspect.signature(target).parameters.values()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return names[1:] if inspect.isclass(obj) else names


@pytest.mark.parametrize("module,name,params", CASES, ids=[f"{m}.{n}" for m, n, _ in CASES])
def test_name_and_parameters(module, name, params):
    ours = importlib.import_module(MODULES[module])
    assert hasattr(ours, name), f"{MODULES[module]} lacks {name}"
    if params is None:
        return
    expected = [p for p in params if not p.startswith("*")]
    got = _parameters(getattr(ours, name))
    assert got[:len(expected)] == expected, f"{name}: ours {got}, Horovod {expected}"


def _ours_for(key):
    """Our object for a HOROVOD_TORCH_MEMBERS key: a class, or the optimizer that
    DistributedOptimizer returns (made without init(): it needs no collective)."""
    path, _, what = key.partition("() -> ")
    module, _, name = path.rpartition(".")
    found = getattr(importlib.import_module(MODULES[module]), name)
    if what:
        model = torch.nn.Linear(2, 1)
        return found(torch.optim.SGD(model.parameters(), lr=0.1),
                     named_parameters=model.named_parameters())
    return found


MEMBER_CASES = [(key, member, params) for key, members in HOROVOD_TORCH_MEMBERS.items()
                if not _pending(*key.partition("() -> ")[0].rpartition(".")[::2])
                for member, params in members.items()]


@pytest.mark.parametrize("key,member,params", MEMBER_CASES,
                         ids=[f"{k}.{m}" for k, m, _ in MEMBER_CASES])
def test_methods_and_properties(key, member, params):
    ours = _ours_for(key)
    assert hasattr(ours, member), f"{key} lacks {member}"
    if params == "attribute":
        return
    names = [p.name for p in inspect.signature(getattr(ours, member)).parameters.values()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if inspect.isclass(ours) and not isinstance(inspect.getattr_static(ours, member),
                                                staticmethod):
        names = names[1:]  # self
    expected = [p for p in params if not p.startswith("*")]
    assert names[:len(expected)] == expected, f"{key}.{member}: ours {names}, Horovod {expected}"


def test_the_returned_optimizer_is_the_wrapped_class():
    """As Horovod's: an instance of the wrapped optimizer's class, with its options."""
    import elastic_hvd.torch as hvd
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.25, momentum=0.5))
    assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
    assert opt.param_groups[0]["lr"] == 0.25 and opt.param_groups[0]["momentum"] == 0.5


def test_horovod_torch_imports_as_elastic_hvd_torch():
    from elastic_hvd import horovod_alias
    before = set(sys.modules)
    horovod_alias.install(quiet=True)
    try:
        import horovod.torch as hvd
        import horovod.torch.mpi_ops as mpi_ops
        import elastic_hvd.torch
        assert hvd is elastic_hvd.torch and mpi_ops is elastic_hvd.torch.mpi_ops
    finally:  # as test_horovod_parity's fixture: no alias after the test
        sys.meta_path[:] = [f for f in sys.meta_path
                            if not isinstance(f, horovod_alias._AliasFinder)]
        for name in set(sys.modules) - before:
            if name.split(".")[0] == "horovod":
                del sys.modules[name]


def test_calls_before_init_raise_a_clear_error():
    import elastic_hvd.torch as hvd
    from elastic_hvd.core import NotInitializedError
    if hvd.is_initialized():
        pytest.skip("initialized by another test in this process")
    with pytest.raises(NotInitializedError, match="hvd.init"):
        hvd.allreduce(torch.ones(2))


def test_the_torch_layer_imports_no_tensorflow():
    """The core has no TensorFlow in it: the torch front end runs without it."""
    code = ("import sys, elastic_hvd.torch, elastic_hvd.torch.optimizer; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('tensorflow', 'keras', 'tf_keras', 'keras_callbacks')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]", out
