"""Horovod's ``horovod.tensorflow.util`` (``hvd.util``; ``--as-horovod`` maps that module
here): the small helpers that Horovod's own Keras code and code written for Horovod
reach for (``hvd._executing_eagerly()`` above all).  Any other name raises an
AttributeError that names it as a Horovod internal elastic_hvd does not provide.
"""

import tensorflow as tf

from ..horovod_alias import not_provided
from ..core.ops import Average
from .ops import resolve_op

__getattr__ = not_provided("horovod.tensorflow.util")


def _executing_eagerly():
    """Whether TensorFlow executes eagerly here (False while tracing a graph)."""
    return tf.executing_eagerly()


def _make_subgraph(f):
    """``f`` as a ``tf.function``."""
    return tf.function(f)


def _cache(f):
    """``f`` memoized on its (hashable) positional arguments, separately for eager
    execution and graph building (a graph's tensors must not leak into eager code)."""
    results = {}

    def cached(*args):
        key = (args, _executing_eagerly())
        if key not in results:
            results[key] = f(*args)
        return results[key]
    return cached


def handle_average_backwards_compatibility(op, average, default=Average):
    """The reduce op meant by an ``op=``/deprecated ``average=`` pair (``default`` if
    neither); both given raises ValueError, Adasum NotImplementedError."""
    return resolve_op(op, average, default)


def vars_to_refs(vars):
    """Hashable references (``v.ref()``) of a variable or nested lists of them."""
    return tuple(map(vars_to_refs, vars)) if isinstance(vars, list) else vars.ref()


def refs_to_vars(refs):
    """Inverse of :func:`vars_to_refs`."""
    return list(map(refs_to_vars, refs)) if isinstance(refs, tuple) else refs.deref()
