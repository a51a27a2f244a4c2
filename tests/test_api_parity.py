"""Every public name of Horovod 0.28.1's TF/Keras API exists here with Horovod's parameters.

Horovod's parameters must come first and in Horovod's order (so positional calls
work); elastic_hvd may add parameters after them.
"""

import importlib
import inspect

import pytest

from horovod_api_0_28_1 import HOROVOD_API, HOROVOD_MEMBERS

MODULES = {
    "horovod.tensorflow": "elastic_hvd.tensorflow",
    "horovod.tensorflow.keras": "elastic_hvd.tensorflow.keras",
    "horovod.tensorflow.keras.callbacks": "elastic_hvd.tensorflow.keras.callbacks",
    "horovod.tensorflow.keras.elastic": "elastic_hvd.tensorflow.keras.elastic",
    "horovod.tensorflow.elastic": "elastic_hvd.tensorflow.elastic",
    "horovod.keras": "elastic_hvd.keras",
    "horovod.keras.callbacks": "elastic_hvd.keras.callbacks",
    "horovod.keras.elastic": "elastic_hvd.keras.elastic",
}

# Horovod's names that elastic_hvd deliberately lacks: helpers of Horovod's own
# machinery that its __init__ imports for itself, with no meaning here.
NOT_PROVIDED = {
    ("horovod.tensorflow", "check_extension"):
        "checks that Horovod's compiled C extension was built; elastic_hvd has none",
    ("horovod.tensorflow", "LocalGradientAggregationHelper"):
        "Horovod's optimizer internals for backward_passes_per_step, driven by Horovod's "
        "allreduce function; elastic_hvd's is gradients.LocalAccumulator",
}

CASES = [(module, name, params) for module, names in HOROVOD_API.items()
         for name, params in names.items() if (module, name) not in NOT_PROVIDED]


def test_every_horovod_module_is_mapped():
    assert sorted(MODULES) == sorted(HOROVOD_API)


def test_not_provided_names_are_horovods_and_absent_here():
    for module, name in NOT_PROVIDED:
        assert name in HOROVOD_API[module]
        assert not hasattr(importlib.import_module(MODULES[module]), name)


def _parameters(obj):
    target = obj.__init__ if inspect.isclass(obj) else obj
    names = [p.name for p in inspect.signature(target).parameters.values()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return names[1:] if inspect.isclass(obj) else names


@pytest.mark.parametrize("module,name,params", CASES,
                         ids=[f"{m}.{n}" for m, n, _ in CASES])
def test_name_and_parameters(module, name, params):
    ours = importlib.import_module(MODULES[module])
    assert hasattr(ours, name), f"{MODULES[module]} lacks {name}"
    if params is None:
        return
    expected = [p for p in params if not p.startswith("*")]
    got = _parameters(getattr(ours, name))
    assert got[:len(expected)] == expected, f"{name}: ours {got}, Horovod {expected}"


def _made_by(factory, what):
    """An object that ``factory`` (ours) returns, as Horovod's factory returns the
    object its HOROVOD_MEMBERS entry "factory() -> what" describes."""
    import tensorflow as tf
    made = {"tape": lambda: factory(tf.GradientTape()),
            "Keras optimizer": lambda: factory(tf.keras.optimizers.SGD(0.1)),
            "TF1 optimizer": lambda: factory(tf.compat.v1.train.GradientDescentOptimizer(0.1))}
    return made[what]()


def _ours_for(key):
    """Our object for a HOROVOD_MEMBERS key: a class, or what a factory returns."""
    path, _, what = key.partition("() -> ")
    module, _, name = path.rpartition(".")
    found = getattr(importlib.import_module(MODULES[module]), name)
    return _made_by(found, what) if what else found


MEMBER_CASES = [(key, member, params) for key, members in HOROVOD_MEMBERS.items()
                if (key.rpartition(".")[0], key.rpartition(".")[2]) not in NOT_PROVIDED
                for member, params in members.items()]


@pytest.mark.parametrize("key,member,params", MEMBER_CASES,
                         ids=[f"{k}.{m}" for k, m, _ in MEMBER_CASES])
def test_methods_and_properties_of_classes_and_returned_objects(key, member, params):
    """Horovod's classes, and the objects its DistributedOptimizer and gradient tapes
    return, have their public methods and properties here, with Horovod's parameters."""
    ours = _ours_for(key)
    assert hasattr(ours, member), f"{key} lacks {member}"
    if params == "attribute":
        return
    method = getattr(ours, member)
    names = [p.name for p in inspect.signature(method).parameters.values()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if inspect.isclass(ours) and not isinstance(inspect.getattr_static(ours, member),
                                                staticmethod):
        names = names[1:]  # self
    expected = [p for p in params if not p.startswith("*")]
    assert names[:len(expected)] == expected, f"{key}.{member}: ours {names}, Horovod {expected}"


def test_calls_before_init_raise_a_clear_error():
    import elastic_hvd.tensorflow.keras as hvd
    from elastic_hvd.core import NotInitializedError
    if hvd.is_initialized():
        pytest.skip("initialized by another test in this process")
    with pytest.raises(NotInitializedError, match="hvd.init"):
        hvd.size()


# Every public module: the API that scripts import (Horovod's and elastic_hvd's own).
PUBLIC_MODULES = [
    "elastic_hvd.tensorflow", "elastic_hvd.tensorflow.keras",
    "elastic_hvd.tensorflow.keras.callbacks", "elastic_hvd.tensorflow.elastic",
    "elastic_hvd.tensorflow.keras.elastic", "elastic_hvd.keras", "elastic_hvd.keras.callbacks",
    "elastic_hvd.keras.elastic", "elastic_hvd.core", "elastic_hvd.sharding",
    "elastic_hvd.tensorflow.data", "keras_callbacks",
]


def _ours(obj):
    return (getattr(obj, "__module__", None) or "").split(".")[0] in ("elastic_hvd",
                                                                     "keras_callbacks")


def test_every_public_class_and_function_has_a_docstring():
    """A class's docstring must be its own (``__doc__``), not inherited from Keras or TF."""
    missing = {}  # "module.qualname" -> the public names it goes by
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        names = getattr(module, "__all__", None) or [n for n in dir(module)
                                                      if not n.startswith("_")]
        for name in names:
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)) or not _ours(obj):
                continue
            doc = obj.__doc__ if inspect.isclass(obj) else inspect.getdoc(obj)
            if not (doc or "").strip():
                missing.setdefault(f"{obj.__module__}.{obj.__qualname__}", []).append(
                    f"{module_name}.{name}")
    lines = [f"{where} (public as {', '.join(names)})" for where, names in sorted(missing.items())]
    assert not missing, f"{len(missing)} without a docstring:\n" + "\n".join(lines)
