"""Reduction operations, numbered as Horovod numbers them."""

import enum
from typing import Any

#: Why Adasum is refused.
NO_ADASUM = (
    "op=Adasum is not supported by elastic_hvd: Adasum is its own algorithm (a recursive "
    "pairwise exchange, not an allreduce) that the resilient core does not implement, and "
    "its pairing needs a power-of-2 number of ranks, which a loss breaks; use op=Average "
    "or op=Sum")


class ReduceOp(enum.IntEnum):
    """Horovod's reduce ops (``hvd.Average``, ``hvd.Sum``, ...); ADASUM exists for
    Horovod's numbering only and is rejected (see :func:`check_op`)."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average, Sum, Adasum, Min, Max, Product = (
    ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)


#: The name in mpi4py's ``MPI`` of each ReduceOp's operation (Average is a Sum followed
#: by a division; no Adasum).
_MPI_NAMES = {ReduceOp.AVERAGE: "SUM", ReduceOp.SUM: "SUM", ReduceOp.MIN: "MIN",
              ReduceOp.MAX: "MAX", ReduceOp.PRODUCT: "PROD"}


def mpi_ops(MPI: Any) -> dict[ReduceOp, Any]:
    """{ReduceOp: MPI.Op}."""
    return {op: getattr(MPI, name) for op, name in _MPI_NAMES.items()}


def mpi_op(MPI: Any, op: int) -> Any:
    """The MPI.Op of ``op`` (checked as :func:`check_op` does), without building the
    table or an enum member: a reduction asks for it on every call."""
    name = _MPI_NAMES.get(op)  # type: ignore[call-overload]  # an int finds its IntEnum key
    return getattr(MPI, name if name is not None else _MPI_NAMES[check_op(op)])


def check_op(op: int) -> ReduceOp:
    """``op`` as a ReduceOp; a clear error for Adasum, which is not supported."""
    op = ReduceOp(op)
    if op is ReduceOp.ADASUM:
        raise NotImplementedError(NO_ADASUM)
    return op
