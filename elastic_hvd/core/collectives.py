"""Collectives on numpy arrays, each one resilient transaction (``ResilientComm.run``).

Rules every collective follows so that a re-run on the survivors is correct:
inputs are never written to (an attempt may have to be repeated), work that
depends on the membership (splits, averaging, the broadcast root) is computed
inside the attempt from the *current* communicator, and data-movement
collectives travel as bytes so that every dtype (float16, bool...) is supported.
"""

import pickle
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from . import reducer
from .ops import ReduceOp, mpi_op
from .reducer import contiguous, finish_reduce, reduce_input

def _as_bytes(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1).view(np.uint8)


def even_splits(rows: int, parts: int) -> list[int]:
    """Split ``rows`` into ``parts`` counts, the first ranks taking one extra row."""
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class CollectivesMixin:
    """The collectives of :class:`~elastic_hvd.core.comm.ResilientComm`."""

    if TYPE_CHECKING:  # what ResilientComm provides: the agreed transaction, the members
        MPI: Any

        def run(self, signature: Any, attempt: Callable[[Any], Any]) -> Any: ...

        @property
        def ids(self) -> tuple[int, ...]: ...

    #: Reduce an array over all live ranks: defined with the step's reductions, in
    #: :mod:`.reducer` (one file for a gradient's way), as a method of the communicator.
    allreduce = reducer.allreduce

    def allgather(self, array: np.ndarray, return_counts: bool = False) -> Any:
        """Concatenate every rank's ``array`` along the first axis (sizes may differ).

        With ``return_counts``: ``(result, rows of each rank)``, of the same membership."""
        x = contiguous(array)
        if x.ndim == 0:
            x = x.reshape(1)
        signature = ("allgather", x.dtype.str, x.shape[1:])
        row_bytes = x.dtype.itemsize * int(np.prod(x.shape[1:], dtype=np.int64))

        def attempt(comm: Any) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
            rows = np.empty(comm.size, dtype=np.int64)
            comm.Allgather(np.array([x.shape[0]], dtype=np.int64), rows)
            result = np.empty((int(rows.sum()),) + x.shape[1:], dtype=x.dtype)
            comm.Allgatherv(_as_bytes(x), [_as_bytes(result), rows * row_bytes])
            return (result, rows) if return_counts else result

        return self.run(signature, attempt)

    def broadcast(self, array: np.ndarray, root_rank: int = 0,
                  shapes: Sequence[Any] | None = None) -> np.ndarray:
        """``array`` of ``root_rank`` on every rank.

        If the root dies before the broadcast completes everywhere, the lowest
        surviving rank becomes the root and its ``array`` is broadcast instead.
        The root gets its own ``array`` back (not a copy).  ``shapes``: as in
        :meth:`allreduce` (a fused broadcast).
        """
        x = contiguous(array)
        signature = ("broadcast", x.dtype.str, x.shape if shapes is None else tuple(shapes),
                     int(root_rank))
        ids = self.ids

        def attempt(comm: Any) -> np.ndarray:
            root = self._root(ids, root_rank)
            if comm.rank == root:
                comm.Bcast(_as_bytes(x), root=root)
                return x
            result = np.empty_like(x)
            comm.Bcast(_as_bytes(result), root=root)
            return result

        return self.run(signature, attempt)

    def alltoall(self, array: np.ndarray,
                 splits: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Send ``splits[i]`` consecutive rows of ``array`` to rank ``i``.

        Returns ``(received, received_splits)``.  Without ``splits`` the first
        dimension must divide evenly by the size.  If ranks die during the call,
        the rows meant for them are dropped and the survivors exchange the rest.
        """
        x = contiguous(array)
        if x.ndim == 0:
            x = x.reshape(1)
        signature = ("alltoall", x.dtype.str, x.shape[1:], splits is None)
        row_bytes = x.dtype.itemsize * int(np.prod(x.shape[1:], dtype=np.int64))
        dest_ids = self.ids

        def attempt(comm: Any) -> tuple[np.ndarray, np.ndarray]:
            starts, counts = _alltoall_layout(x.shape[0], splits, dest_ids)
            ids = self.ids
            send_rows = np.array([counts[i] for i in ids], dtype=np.int64)
            if ids == dest_ids:
                send = x
            else:
                send = np.concatenate([x[starts[i]:starts[i] + counts[i]] for i in ids])
            recv_rows = np.empty(comm.size, dtype=np.int64)
            comm.Alltoall(send_rows, recv_rows)
            result = np.empty((int(recv_rows.sum()),) + x.shape[1:], dtype=x.dtype)
            comm.Alltoallv([_as_bytes(send), send_rows * row_bytes],
                           [_as_bytes(result), recv_rows * row_bytes])
            return result, recv_rows

        return self.run(signature, attempt)

    def reducescatter(self, array: np.ndarray, op: int = ReduceOp.SUM,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> np.ndarray:
        """Reduce ``array`` and give rank ``i`` the ``i``-th block of its first axis.

        Blocks follow :func:`even_splits` of the live size (lower ranks get the
        extra rows).
        """
        x = contiguous(array)
        signature = ("reducescatter", x.dtype.str, x.shape, int(op),
                     float(prescale_factor), float(postscale_factor))
        row = int(np.prod(x.shape[1:], dtype=np.int64))

        def attempt(comm: Any) -> tuple[np.ndarray, int]:
            reduction = mpi_op(self.MPI, op)
            if x.ndim == 0:
                raise ValueError("reducescatter needs an array with at least one dimension")
            send = reduce_input(x, prescale_factor)
            rows = even_splits(x.shape[0], comm.size)
            result = np.empty((rows[comm.rank],) + x.shape[1:], dtype=send.dtype)
            comm.Reduce_scatter(send, result, [r * row for r in rows], op=reduction)
            return result, comm.size

        result, size = self.run(signature, attempt)
        return finish_reduce(result, x.dtype,
                              postscale_factor / (size if op == ReduceOp.AVERAGE else 1))

    def barrier(self) -> None:
        self.run(("barrier",), lambda comm: comm.Barrier())

    def broadcast_object(self, obj: Any, root_rank: int = 0) -> Any:
        """Any picklable ``obj`` of ``root_rank`` on every rank (root rule as :meth:`broadcast`)."""
        ids = self.ids

        def attempt(comm: Any) -> Any:
            root = self._root(ids, root_rank)
            payload = (pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
                       if comm.rank == root else b"")
            length = np.array([len(payload)], dtype=np.int64)
            comm.Bcast(length, root=root)
            data = np.frombuffer(payload, dtype=np.uint8) if comm.rank == root \
                else np.empty(int(length[0]), dtype=np.uint8)
            comm.Bcast(data, root=root)
            return obj if comm.rank == root else pickle.loads(data.tobytes())

        return self.run(("broadcast_object", int(root_rank)), attempt)

    def allgather_object(self, obj: Any) -> list:
        """List of every rank's picklable ``obj``, in rank order."""
        payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)

        def attempt(comm: Any) -> list[Any]:
            lengths = np.empty(comm.size, dtype=np.int64)
            comm.Allgather(np.array([payload.size], dtype=np.int64), lengths)
            data = np.empty(int(lengths.sum()), dtype=np.uint8)
            comm.Allgatherv(payload, [data, lengths])
            bounds = np.concatenate([[0], np.cumsum(lengths)])
            return [pickle.loads(data[a:b].tobytes()) for a, b in zip(bounds[:-1], bounds[1:])]

        return self.run(("allgather_object",), attempt)

    def root_id(self, ids: Sequence[int], root_rank: int) -> int:
        """Original id of the process acting as root ``root_rank`` of ``ids`` (the ranks
        when the call began): that process, or the lowest survivor if it is gone."""
        if not 0 <= int(root_rank) < len(ids):
            raise ValueError(f"root rank {root_rank} is out of range for {len(ids)} ranks")
        root_id = ids[int(root_rank)]
        return root_id if root_id in self.ids else self.ids[0]

    def _root(self, ids: Sequence[int], root_rank: int) -> int:
        return self.ids.index(self.root_id(ids, root_rank))


def _alltoall_layout(rows: int, splits: Sequence[int] | np.ndarray | None,
                     dest_ids: Sequence[int]) -> tuple[dict[int, int], dict[int, int]]:
    """(first row, row count) per destination original id."""
    if splits is None:
        if rows % len(dest_ids):
            raise ValueError(f"alltoall: first dimension {rows} does not divide evenly "
                             f"by {len(dest_ids)} ranks; pass splits")
        splits = [rows // len(dest_ids)] * len(dest_ids)
    splits = np.asarray(splits, dtype=np.int64).reshape(-1)
    if splits.size != len(dest_ids) or splits.sum() != rows or (splits < 0).any():
        raise ValueError(f"alltoall: splits {splits.tolist()} must have one non-negative "
                         f"entry per rank ({len(dest_ids)}) summing to {rows}")
    starts = np.concatenate([[0], np.cumsum(splits)[:-1]])
    return dict(zip(dest_ids, starts.tolist())), dict(zip(dest_ids, splits.tolist()))
