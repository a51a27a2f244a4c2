"""Horovod's ``horovod.tensorflow.util`` (``hvd.util``; ``--as-horovod`` maps that module
here): the small helpers that Horovod's own Keras code and code written for Horovod
reach for (``hvd._executing_eagerly()`` above all).  Any other name raises an
AttributeError that names it as a Horovod internal elastic_hvd does not provide.
"""

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from ..horovod_alias import not_provided
from ..core.ops import Average, ReduceOp
from .ops import resolve_op

__getattr__ = not_provided("horovod.tensorflow.util")


def _executing_eagerly() -> bool:
    """Whether TensorFlow executes eagerly here (False while tracing a graph)."""
    return tf.executing_eagerly()


def _make_subgraph(f: Callable[..., Any]) -> Any:
    """``f`` as a ``tf.function``."""
    return tf.function(f)


def _cache(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` memoized on its (hashable) positional arguments, separately for eager
    execution and graph building (a graph's tensors must not leak into eager code)."""
    results: dict[tuple[tuple[Any, ...], bool], Any] = {}

    def cached(*args: Any) -> Any:
        key = (args, _executing_eagerly())
        if key not in results:
            results[key] = f(*args)
        return results[key]
    return cached


def handle_average_backwards_compatibility(op: int | None, average: bool | None,
                                           default: int = Average) -> ReduceOp:
    """The reduce op meant by an ``op=``/deprecated ``average=`` pair (``default`` if
    neither); both given raises ValueError."""
    return resolve_op(op, average, default)


def vars_to_refs(vars: Any) -> Any:
    """Hashable references (``v.ref()``) of a variable or nested lists of them."""
    return tuple(map(vars_to_refs, vars)) if isinstance(vars, list) else vars.ref()


def refs_to_vars(refs: Any) -> Any:
    """Inverse of :func:`vars_to_refs`."""
    return list(map(refs_to_vars, refs)) if isinstance(refs, tuple) else refs.deref()
