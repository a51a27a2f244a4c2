"""Helpers that Horovod's TF/Keras modules re-export from their own utilities, so
that scripts which reach them as ``hvd.<name>`` keep working."""

from itertools import pairwise

from packaging import version  # a dependency of TensorFlow

from ..basics import cuda_built, rocm_built
from .ops import Average, _resolve_op


def handle_average_backwards_compatibility(op, average, default=Average):
    """The reduce op meant by an ``op=``/deprecated ``average=`` pair (``default`` if
    neither); both given raises ValueError, Adasum NotImplementedError."""
    return _resolve_op(op, average, default)


def gpu_available(ext_base_name, verbose=False):
    """Whether collectives run on GPU memory: never here (they go through MPI on host
    memory), whatever the framework ``ext_base_name``."""
    return cuda_built() or rocm_built()


def split_list(l, n):  # noqa: E741 -- Horovod's parameter name (keyword calls, API parity)
    """``l`` cut into ``n`` consecutive chunks whose lengths differ by at most one."""
    size, extra = divmod(len(l), n)
    bounds = [i * size + min(i, extra) for i in range(n + 1)]
    return [l[start:stop] for start, stop in pairwise(bounds)]


def check_num_rank_power_of_2(num_rank):
    """Whether ``num_rank`` is a power of two (1, 2, 4, ...)."""
    return num_rank > 0 and num_rank & (num_rank - 1) == 0


def vars_to_refs(vars):
    """Hashable references (``v.ref()``) of a variable or nested lists of them."""
    return tuple(map(vars_to_refs, vars)) if isinstance(vars, list) else vars.ref()


def refs_to_vars(refs):
    """Inverse of :func:`vars_to_refs`."""
    return list(map(refs_to_vars, refs)) if isinstance(refs, tuple) else refs.deref()


def is_version_greater_equal_than(ver, target):
    """``ver >= target`` for version strings (``"2.16.1" >= "2.6.0"``)."""
    return version.parse(ver) >= version.parse(target)
