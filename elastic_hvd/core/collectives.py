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

from . import config
from .ops import ReduceOp, check_op, mpi_ops

# Dtypes MPI reduces natively; float16 is reduced in float32 and rounded back once
# (Horovod's float16 sum rounds after every addition: the same result on two ranks).
_REDUCIBLE = {np.dtype(t) for t in (
    np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
    np.float32, np.float64)}


def _contiguous(array):
    array = np.asarray(array)
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def _as_bytes(array):
    return array.reshape(-1).view(np.uint8)


def _reduce_input(x, prescale_factor):
    """What a rank contributes to a reduction: float16 widened, prescaled (see :func:`_scale`)."""
    if x.dtype in _REDUCIBLE:
        work = x.dtype
    elif x.dtype == np.float16:
        work = np.dtype(np.float32)
    else:
        raise TypeError(f"cannot reduce arrays of dtype {x.dtype}")
    send = x if work == x.dtype else x.astype(work)
    return send if prescale_factor == 1.0 else _scale(send, prescale_factor, x.dtype)


def _scale(values, factor, dtype):
    """``values`` (an array of ``dtype``, float16 held in float32) times ``factor``, as
    Horovod's ``ScaleBuffer`` computes it for ``dtype`` (horovod/common/ops/
    collective_operations.cc), so that scaled results match Horovod's to the bit:
    integers in float64, truncated toward zero on the way back; float16 in float32
    from its float16 value, rounded to float16; float32 and float64 in their own
    precision, the factor rounded to it.  A new array: ``values`` may be an input."""
    if values.dtype.kind in "iu":
        return (values * float(factor)).astype(values.dtype)
    if dtype == np.float16:
        halves = values.astype(np.float16).astype(np.float32)
        return (halves * np.float32(factor)).astype(np.float16).astype(np.float32)
    return values * values.dtype.type(factor)


def _finish_reduce(out, dtype, factor):
    """The reduced ``out`` times ``factor`` -- the postscale factor, divided by the live
    size for Average, as Horovod averages -- cast back to ``dtype``.  A factor of 1
    leaves the sum as it is (an integer Sum is never rounded through float64)."""
    if factor != 1.0:
        out = _scale(out, factor, dtype)
    return out.astype(dtype, copy=False)


def _allreduce_pieces(comm, send, target, mpi_op, scale, piece_bytes):
    """``target`` = reduction of ``send`` over ``comm``, ``piece_bytes`` at a time
    (``config.allreduce_piece_bytes``, 1 MiB; 0: one call).

    Why pieces: a whole-buffer call has Open MPI allocate a temporary above glibc's
    mmap threshold (page faults on every call) and stream it through memory twice;
    1 MiB pieces stay in cache and reuse one temporary -- three times faster for
    64 MiB on the machine of docs/measurements.md.

    ``scale`` (a scalar of ``target``'s dtype, or None) multiplies each reduced piece
    while it is still in cache, which saves a second pass over a large result.
    """
    step = max(1, piece_bytes // send.itemsize) if piece_bytes > 0 else send.size
    if step >= send.size:  # one piece: the common small call, without slicing
        comm.Allreduce(send, target, op=mpi_op)
        if scale is not None:
            target *= scale
        return
    send, target = send.reshape(-1), target.reshape(-1)
    for start in range(0, send.size, step):
        piece = target[start:start + step]
        comm.Allreduce(send[start:start + step], piece, op=mpi_op)
        if scale is not None:
            piece *= scale


def even_splits(rows, parts):
    """Split ``rows`` into ``parts`` counts, the first ranks taking one extra row."""
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class CollectivesMixin:
    """The collectives of :class:`~elastic_hvd.core.comm.ResilientComm`."""

    _mpi_ops = None

    if TYPE_CHECKING:  # what ResilientComm provides: the agreed transaction, the members
        MPI: Any

        def run(self, signature: Any, attempt: Callable[[Any], Any]) -> Any: ...

        @property
        def ids(self) -> tuple[int, ...]: ...

    def _mpi_op(self, op):
        if self._mpi_ops is None:
            type(self)._mpi_ops = mpi_ops(self.MPI)
        return self._mpi_ops[op]

    def allreduce(self, array: np.ndarray, op: int = ReduceOp.SUM, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, out: np.ndarray | None = None,
                  shapes: Sequence[Any] | None = None) -> np.ndarray:
        """Reduce ``array`` over all live ranks; Average divides by the live size.

        ``out`` (optional, not aliasing ``array``) receives the result and saves an
        allocation per call.  Scaling and averaging round as Horovod's do (see
        :func:`_scale`): an integer average is truncated toward zero.

        ``shapes``: when ``array`` is a buffer that packs arrays of these shapes end to
        end (a fused allreduce), the call's signature carries them instead of the
        buffer's flat shape, which would let ranks that pack tensors of equal sizes but
        other shapes (4x6 and 6x4) reduce elements that do not correspond; Horovod
        refuses them (its coordinator compares each tensor's full shape).
        """
        x = _contiguous(array)
        pieces = config.current().allreduce_piece_bytes
        # The piece size is part of the call: ranks cutting differently would mismatch.
        signature = ("allreduce", x.dtype.str, x.shape if shapes is None else tuple(shapes),
                     int(op), float(prescale_factor), float(postscale_factor), pieces)

        def attempt(comm):  # validation happens here, once ranks agree on the call
            mpi_op = self._mpi_op(check_op(op))
            send = _reduce_input(x, prescale_factor)
            if out is not None and (out.shape != x.shape or out.dtype != x.dtype):
                raise ValueError(f"out has shape {out.shape} and dtype {out.dtype}; "
                                 f"expected {x.shape} and {x.dtype}")
            target = out if out is not None and send.dtype == out.dtype else np.empty_like(send)
            factor = postscale_factor / (comm.size if op == ReduceOp.AVERAGE else 1)
            # float32/float64 are scaled piece by piece while in cache; the others need
            # their own rounding (_scale), done once the sum is complete.
            in_pieces = factor != 1.0 and target.dtype == x.dtype and x.dtype.kind == "f"
            _allreduce_pieces(comm, send, target, mpi_op,
                              target.dtype.type(factor) if in_pieces else None, pieces)
            return target, 1.0 if in_pieces else factor

        result, factor = self.run(signature, attempt)
        result = _finish_reduce(result, x.dtype, factor)
        if out is not None and result is not out:
            out[...] = result
            return out
        return result

    def allgather(self, array: np.ndarray, return_counts: bool = False) -> Any:
        """Concatenate every rank's ``array`` along the first axis (sizes may differ).

        With ``return_counts``: ``(result, rows of each rank)``, of the same membership."""
        x = _contiguous(array)
        if x.ndim == 0:
            x = x.reshape(1)
        signature = ("allgather", x.dtype.str, x.shape[1:])
        row_bytes = x.dtype.itemsize * int(np.prod(x.shape[1:], dtype=np.int64))

        def attempt(comm):
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
        x = _contiguous(array)
        signature = ("broadcast", x.dtype.str, x.shape if shapes is None else tuple(shapes),
                     int(root_rank))
        ids = self.ids

        def attempt(comm):
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
        x = _contiguous(array)
        if x.ndim == 0:
            x = x.reshape(1)
        signature = ("alltoall", x.dtype.str, x.shape[1:], splits is None)
        row_bytes = x.dtype.itemsize * int(np.prod(x.shape[1:], dtype=np.int64))
        dest_ids = self.ids

        def attempt(comm):
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
        x = _contiguous(array)
        signature = ("reducescatter", x.dtype.str, x.shape, int(op),
                     float(prescale_factor), float(postscale_factor))
        row = int(np.prod(x.shape[1:], dtype=np.int64))

        def attempt(comm):
            mpi_op = self._mpi_op(check_op(op))
            if x.ndim == 0:
                raise ValueError("reducescatter needs an array with at least one dimension")
            send = _reduce_input(x, prescale_factor)
            rows = even_splits(x.shape[0], comm.size)
            result = np.empty((rows[comm.rank],) + x.shape[1:], dtype=send.dtype)
            comm.Reduce_scatter(send, result, [r * row for r in rows], op=mpi_op)
            return result, comm.size

        result, size = self.run(signature, attempt)
        return _finish_reduce(result, x.dtype,
                              postscale_factor / (size if op == ReduceOp.AVERAGE else 1))

    def barrier(self) -> None:
        self.run(("barrier",), lambda comm: comm.Barrier())

    def broadcast_object(self, obj: Any, root_rank: int = 0) -> Any:
        """Any picklable ``obj`` of ``root_rank`` on every rank (root rule as :meth:`broadcast`)."""
        ids = self.ids

        def attempt(comm):
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

        def attempt(comm):
            lengths = np.empty(comm.size, dtype=np.int64)
            comm.Allgather(np.array([payload.size], dtype=np.int64), lengths)
            data = np.empty(int(lengths.sum()), dtype=np.uint8)
            comm.Allgatherv(payload, [data, lengths])
            bounds = np.concatenate([[0], np.cumsum(lengths)])
            return [pickle.loads(data[a:b].tobytes()) for a, b in zip(bounds[:-1], bounds[1:])]

        return self.run(("allgather_object",), attempt)

    def root_id(self, ids, root_rank):
        """Original id of the process acting as root ``root_rank`` of ``ids`` (the ranks
        when the call began): that process, or the lowest survivor if it is gone."""
        if not 0 <= int(root_rank) < len(ids):
            raise ValueError(f"root rank {root_rank} is out of range for {len(ids)} ranks")
        root_id = ids[int(root_rank)]
        return root_id if root_id in self.ids else self.ids[0]

    def _root(self, ids, root_rank):
        return self.ids.index(self.root_id(ids, root_rank))


def _alltoall_layout(rows, splits, dest_ids):
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
