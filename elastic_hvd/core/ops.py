"""Reduction operations, numbered as Horovod numbers them."""

import enum
from typing import Any

#: Where Adasum is refused: it is a reduction of an allreduce (:mod:`.adasum`) only.
NO_ADASUM_HERE = "op=Adasum reduces only in allreduce (and grouped_allreduce), not in {}"


class ReduceOp(enum.IntEnum):
    """Horovod's reduce ops (``hvd.Average``, ``hvd.Sum``, ...); ADASUM is the
    algorithm of :mod:`.adasum`, not an MPI operation (see :func:`mpi_op`)."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average, Sum, Adasum, Min, Max, Product = (
    ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)


#: The name in mpi4py's ``MPI`` of each ReduceOp's operation (Average is a Sum followed
#: by a division; Adasum is no MPI operation: :mod:`.adasum`).
_MPI_NAMES = {ReduceOp.AVERAGE: "SUM", ReduceOp.SUM: "SUM", ReduceOp.MIN: "MIN",
              ReduceOp.MAX: "MAX", ReduceOp.PRODUCT: "PROD"}


def mpi_ops(MPI: Any) -> dict[ReduceOp, Any]:
    """{ReduceOp: MPI.Op}."""
    return {op: getattr(MPI, name) for op, name in _MPI_NAMES.items()}


def mpi_op(MPI: Any, op: int) -> Any:
    """The MPI.Op of ``op`` (checked as :func:`check_op` does), without building the
    table or an enum member: a reduction asks for it on every call.  Adasum, which
    no MPI operation computes, raises NotImplementedError (a collective other than
    allreduce was asked for it)."""
    name = _MPI_NAMES.get(op)  # type: ignore[call-overload]  # an int finds its IntEnum key
    if name is None and check_op(op) is ReduceOp.ADASUM:
        raise NotImplementedError(NO_ADASUM_HERE.format("this collective"))
    return getattr(MPI, name if name is not None else _MPI_NAMES[check_op(op)])


def check_op(op: int) -> ReduceOp:
    """``op`` as a ReduceOp (ValueError for a number that is none)."""
    return ReduceOp(op)
