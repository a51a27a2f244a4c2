"""Horovod's ``horovod.common.util`` helpers that code written for Horovod imports,
without TensorFlow (``--as-horovod`` maps that module here).

Only the cheap, harmless ones; the others (extension checks, build probes) are
Horovod's machinery and raise an AttributeError that names them.
"""

import contextlib
import os
from collections.abc import Iterator, Sequence
from itertools import pairwise
from typing import Any, TypeVar

from ..basics import cuda_built, rocm_built
from ..horovod_alias import not_provided

__getattr__ = not_provided("horovod.common.util")

_T = TypeVar("_T")


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether collectives run on GPU memory: never here (they go through MPI on host
    memory), whatever the framework ``ext_base_name``."""
    return cuda_built() or rocm_built()


def split_list(
        l: Sequence[_T],  # noqa: E741 -- Horovod's parameter name (keyword calls, API parity)
        n: int) -> list[Sequence[_T]]:
    """``l`` cut into ``n`` consecutive chunks whose lengths differ by at most one."""
    size, extra = divmod(len(l), n)
    bounds = [i * size + min(i, extra) for i in range(n + 1)]
    return [l[start:stop] for start, stop in pairwise(bounds)]


def num_rank_is_power_2(num_rank: int) -> bool:
    """Whether ``num_rank`` is a power of two (1, 2, 4, ...)."""
    return num_rank > 0 and num_rank & (num_rank - 1) == 0


def is_version_greater_equal_than(ver: str, target: str) -> bool:
    """``ver >= target`` for version strings (``"2.16.1" >= "2.6.0"``)."""
    from packaging import version  # TensorFlow's dependency, not ours: imported when needed
    return version.parse(ver) >= version.parse(target)


def is_iterable(x: Any) -> bool:
    """Whether ``iter(x)`` works."""
    try:
        iter(x)
    except TypeError:
        return False
    return True


@contextlib.contextmanager
def env(**kwargs: str | None) -> Iterator[None]:
    """Set the environment variables given (None: left alone) for the ``with``
    block, then restore what was there."""
    changes = {k: v for k, v in kwargs.items() if v is not None}
    saved = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
