"""One optimizer step's gradient traffic, without TensorFlow: the allreduce of a buffer,
fusion into buffers, the gathers of sparse gradients, and the step transaction around
all of them.

The TF layer turns a step's gradients into numpy arrays, calls :func:`reduce_step`
once (one op per step) and turns the results back into tensors.  Everything in
between -- which arrays share a buffer and how a buffer is laid out, how a buffer is
reduced, scaled and averaged as Horovod does it, how slices are gathered, and that
all of it runs with one membership and commits the step (:mod:`.session`) -- is in
this file, so that a reader follows a gradient from the op to ``MPI_Allreduce``
through it and the agreed transaction (:mod:`.comm`) alone.
"""

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import adasum, config, process
from .ops import ReduceOp, mpi_op

#: Bytes: TF shares a result's memory without a copy only when it is 64-byte aligned.
ALIGN = 64

#: Dtypes numpy cannot reduce, reduced in a wider one (by name: bfloat16 is
#: ml_dtypes', which TF registers with numpy).
_WIDEN = {"bfloat16": np.dtype(np.float32)}
#: dtype -> the dtype its buffers travel in (``dtype.name`` costs microseconds per call).
_wires: dict[np.dtype, np.dtype] = {}


def _wire(dtype: np.dtype) -> np.dtype:
    wire = _wires.get(dtype)
    if wire is None:
        wire = _wires[dtype] = _WIDEN.get(dtype.name, dtype)
    return wire


# Dtypes MPI reduces natively; float16 is reduced in float32 and rounded back once
# (Horovod's float16 sum rounds after every addition: the same result on two ranks).
_REDUCIBLE = {np.dtype(t) for t in (
    np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
    np.float32, np.float64)}


def contiguous(array: Any) -> np.ndarray:
    """``array`` as a C-contiguous numpy array (itself when it is one already)."""
    array = np.asarray(array)
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def reduce_input(x: np.ndarray, prescale_factor: float) -> np.ndarray:
    """What a rank contributes to a reduction: float16 widened, prescaled (see :func:`_scale`)."""
    if x.dtype in _REDUCIBLE:
        work = x.dtype
    elif x.dtype == np.float16:
        work = np.dtype(np.float32)
    else:
        raise TypeError(f"cannot reduce arrays of dtype {x.dtype}")
    send = x if work == x.dtype else x.astype(work)
    return send if prescale_factor == 1.0 else _scale(send, prescale_factor, x.dtype)


def _scale(values: np.ndarray, factor: float, dtype: Any) -> np.ndarray:
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


def finish_reduce(out: np.ndarray, dtype: Any, factor: float) -> np.ndarray:
    """The reduced ``out`` times ``factor`` -- the postscale factor, divided by the live
    size for Average, as Horovod averages -- cast back to ``dtype``.  A factor of 1
    leaves the sum as it is (an integer Sum is never rounded through float64)."""
    if factor != 1.0:
        out = _scale(out, factor, dtype)
    return out.astype(dtype, copy=False)


def _allreduce_pieces(comm: Any, send: np.ndarray, target: np.ndarray, mpi_op: Any,
                      scale: np.generic | None, piece_bytes: int) -> None:
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



def allreduce(comm: Any, array: np.ndarray, op: int = ReduceOp.SUM, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, out: np.ndarray | None = None,
              shapes: Sequence[Any] | None = None) -> np.ndarray:
    """Reduce ``array`` over all live ranks of ``comm``; Average divides by the live size.

    ``ResilientComm.allreduce`` is this function.  ``out`` (optional, not aliasing
    ``array``) receives the result and saves an allocation per call.  Scaling and
    averaging round as Horovod's do (see :func:`_scale`): an integer average is
    truncated toward zero.

    ``shapes``: when ``array`` is a buffer that packs arrays of these shapes end to
    end (a fused allreduce), the call's signature carries them instead of the
    buffer's flat shape, which would let ranks that pack tensors of equal sizes but
    other shapes (4x6 and 6x4) reduce elements that do not correspond; Horovod
    refuses them (its coordinator compares each tensor's full shape).
    """
    x = contiguous(array)
    pieces = config.current().allreduce_piece_bytes
    signature = _signature(x.dtype, x.shape if shapes is None else tuple(shapes), op,
                           prescale_factor, postscale_factor, pieces, (1,))
    targets, factor = comm.run(signature, _reduction(comm, [x], op, prescale_factor,
                                                     postscale_factor, [out], pieces))
    result = finish_reduce(targets[0], x.dtype, factor)
    if out is not None and result is not out:
        out[...] = result
        return out
    return result


def _signature(dtype: np.dtype, shapes: Any, op: int, prescale_factor: float,
               postscale_factor: float, pieces: int, buffers: tuple[int, ...]) -> tuple:
    """What ranks must agree on before an allreduce of ``dtype`` arrays: ``shapes``,
    the reduction, and how the arrays are cut into MPI calls -- the piece size and
    ``buffers`` (tensors per buffer, one MPI_Allreduce each): ranks that cut
    differently would pair calls of different sizes."""
    return ("allreduce", dtype.str, shapes, int(op), float(prescale_factor),
            float(postscale_factor), pieces, buffers)


def _reduction(comm: Any, sends: Sequence[np.ndarray], op: int, prescale_factor: float,
               postscale_factor: float, outs: Sequence[np.ndarray | None],
               pieces: int, segments: Sequence[Sequence[int]] | None = None) -> Any:
    """The attempt of one allreduce call for ``ResilientComm.run_many``: each of ``sends``
    (C-contiguous arrays of one dtype) reduced by its own MPI_Allreduce (in pieces when
    large) into its ``outs`` entry when that fits.  Returns ``(targets, factor)``:
    the reduced arrays and the factor :func:`finish_reduce` still has to apply.

    One call for a step's 200 unfused gradients, not 200: the signature that
    covers them all is checked once, and the loop below is all the Python an
    array costs (Horovod's coordinator too negotiates a cycle's tensors at once).

    Adasum (:mod:`.adasum`) combines each send by its own algorithm instead of
    MPI_Allreduce; ``segments[k]``: the sizes of the tensors packed in ``sends[k]``
    (each combined with its own dot products; None: each send is one tensor)."""
    if op == ReduceOp.ADASUM:
        return _adasum_reduction(sends, prescale_factor, postscale_factor, segments)

    def attempt(mpi_comm: Any) -> tuple[list[np.ndarray], float]:
        # validation happens here, once ranks agree on the call
        reduction = mpi_op(comm.MPI, op)
        factor = postscale_factor / (mpi_comm.size if op == ReduceOp.AVERAGE else 1)
        dtype = sends[0].dtype
        # float32/float64 are scaled piece by piece while in cache; the others need
        # their own rounding (_scale), done once the sum is complete.
        in_pieces = factor != 1.0 and dtype.kind == "f" and dtype != np.float16
        scale = dtype.type(factor) if in_pieces else None
        targets = []
        for x, out in zip(sends, outs):
            send = reduce_input(x, prescale_factor)
            if out is not None and (out.shape != x.shape or out.dtype != x.dtype):
                raise ValueError(f"out has shape {out.shape} and dtype {out.dtype}; "
                                 f"expected {x.shape} and {x.dtype}")
            target = out if out is not None and send.dtype == out.dtype else np.empty_like(send)
            _allreduce_pieces(mpi_comm, send, target, reduction, scale, pieces)
            targets.append(target)
        return targets, 1.0 if in_pieces else factor

    return attempt


def _adasum_reduction(sends: Sequence[np.ndarray], prescale_factor: float,
                      postscale_factor: float,
                      segments: Sequence[Sequence[int]] | None) -> Any:
    """The attempt of :func:`_reduction` for Adasum: each send prescaled as Horovod
    scales (:func:`_scale`), combined by :func:`.adasum.reduce` on the attempt's
    communicator (float16 in float32, rounded to float16 after every pairwise step,
    as Horovod's float16 kernels store it), the postscale factor left to
    :func:`finish_reduce`."""
    def attempt(mpi_comm: Any) -> tuple[list[np.ndarray], float]:
        targets = []
        for k, x in enumerate(sends):
            if x.dtype not in adasum.FLOATS:
                raise TypeError(f"op=Adasum reduces float16, float32 and float64 tensors "
                                f"(as Horovod's), not {x.dtype}")
            send = reduce_input(x, prescale_factor)
            counts = [x.size] if segments is None else list(segments[k])
            targets.append(adasum.reduce(mpi_comm, send.reshape(-1), counts,
                                         x.dtype).reshape(x.shape))
        return targets, postscale_factor

    return attempt


def aligned_empty(count: int, dtype: Any) -> np.ndarray:
    """A 1-D array of ``count`` elements starting on a 64-byte boundary."""
    dtype = np.dtype(dtype)
    raw = np.empty(count * dtype.itemsize + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + count * dtype.itemsize].view(dtype)


def _buffers(arrays: Sequence[np.ndarray], threshold: int) -> list[list[list[int]]]:
    """Indices of ``arrays`` per fusion buffer, per dtype: each buffer at most
    ``threshold`` bytes unless one array alone is larger; arrays in their given order."""
    by_dtype: dict[np.dtype, list[int]] = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(a.dtype, []).append(i)
    per_dtype = []
    for indices in by_dtype.values():
        buffers: list[list[int]] = []
        batch: list[int] = []
        nbytes = 0
        for i in indices:
            if batch and nbytes + arrays[i].nbytes > threshold:
                buffers.append(batch)
                batch, nbytes = [], 0
            batch.append(i)
            nbytes += arrays[i].nbytes
        buffers.append(batch)
        per_dtype.append(buffers)
    return per_dtype


def fused_allreduce(comm: Any, arrays: Sequence[np.ndarray], op: int,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list:
    """Allreduce many arrays over ``comm`` in as few MPI calls as the fusion threshold
    allows, as one transaction (``ResilientComm.run_many``: one agreement); how arrays
    are packed, and what the signature names, is :func:`_fused_calls`'s doc."""
    calls, unpack = _fused_calls(comm, [arrays], op, prescale_factor, postscale_factor)
    return unpack(comm.run_many(calls))


def _fused_calls(comm: Any, groups: Sequence[Sequence[np.ndarray]], op: int,
                 prescale_factor: float, postscale_factor: float) -> tuple[list, Any]:
    """The calls of :func:`fused_allreduce` for each group of arrays (each fused
    separately; one call per group and dtype), and what turns their outcomes into
    the results, flat, in order.

    Arrays of one dtype are packed into buffers of at most the fusion threshold, one
    MPI_Allreduce each, one call of the transaction whose signature carries the arrays'
    shapes (ranks that pack other shapes mismatch, even with equal sizes) and the cut
    into buffers.  bfloat16 is packed into float32 and its signature names bfloat16:
    ranks that pass bfloat16 and float32 mismatch, as Horovod's do, instead of summing.
    All buffers' results share one allocation, each result in the arrays' own dtype at
    a 64-byte boundary (segments padded with zeros), so TF takes it without a copy."""
    settings = config.current()
    pieces = settings.allreduce_piece_bytes
    # (sends, wire dtype, signature, byte offset of each result), one per call
    planned: list[tuple[list[np.ndarray], np.dtype, tuple, list[int]]] = []
    # (result index, call, buffer, start, size, shape, dtype to cast to), one per array
    unpacks: list[tuple[int, int, int, int, int, tuple[int, ...], np.dtype | None]] = []
    packing: list[list[list[int]]] = []  # per call, per send: its tensors' padded sizes
    first = nbytes = 0
    for arrays in groups:
        for buffers in _buffers(arrays, settings.fusion_threshold):
            dtype = arrays[buffers[0][0]].dtype
            wire, call = _wire(dtype), len(planned)
            cast = None if wire == dtype else dtype
            sends: list[np.ndarray] = []
            offsets: list[int] = []
            segments: list[list[int]] = []  # per send, its tensors' sizes with padding
            shapes: list[Any] = [] if cast is None else [dtype.name]
            for batch in buffers:
                if len(batch) == 1 and cast is None:  # unfused: the array as it is
                    array = arrays[batch[0]]
                    send = array.reshape(-1)
                    unpacks.append((first + batch[0], call, len(sends), 0, array.size,
                                    array.shape, None))
                    segments.append([array.size])
                else:
                    align = max(1, ALIGN // wire.itemsize)
                    starts, total = [], 0
                    for j in batch:
                        starts.append(total)
                        total += -(-arrays[j].size // align) * align
                    send = np.zeros(total, dtype=wire)
                    for j, start in zip(batch, starts):
                        send[start:start + arrays[j].size] = arrays[j].reshape(-1)
                        unpacks.append((first + j, call, len(sends), start, arrays[j].size,
                                        arrays[j].shape, cast))
                    segments.append(np.diff(starts + [total]).tolist())
                shapes.extend(arrays[j].shape for j in batch)
                sends.append(send)
                offsets.append(nbytes)
                nbytes += -(-send.size * wire.itemsize // ALIGN) * ALIGN
            signature = _signature(wire, tuple(shapes), op, prescale_factor, postscale_factor,
                                   pieces, tuple(len(batch) for batch in buffers))
            planned.append((sends, wire, signature, offsets))
            packing.append(segments)
        first += len(arrays)
    arena = aligned_empty(nbytes, np.uint8)
    calls: list[tuple[Any, Any]] = []
    for (sends, wire, signature, offsets), segments in zip(planned, packing):
        outs = [arena[offset:offset + send.size * wire.itemsize].view(wire)
                for send, offset in zip(sends, offsets)]
        calls.append((signature, _reduction(comm, sends, op, prescale_factor,
                                            postscale_factor, outs, pieces, segments)))

    def unpack(outcomes: Sequence[Any]) -> list:
        reduced = [[finish_reduce(target, wire, factor) for target in targets]
                   for (targets, factor), (_, wire, _, _) in zip(outcomes, planned)]
        results: list = [None] * first
        for index, call, buffer, start, size, shape, cast in unpacks:
            segment = reduced[call][buffer][start:start + size].reshape(shape)
            results[index] = segment if cast is None else segment.astype(cast)
        return results

    return calls, unpack


def true_division_dtype(dtype: Any) -> np.dtype:
    """The dtype of ``values / size`` as TF computes it (Horovod averages slices so):
    integers give float32 up to 16 bits, float64 above; floats stay."""
    dtype = np.dtype(dtype)
    if dtype.kind not in "iu":
        return dtype
    return np.dtype(np.float32 if dtype.itemsize <= 2 else np.float64)


def reduce_step(comm: Any, *arrays: np.ndarray, sizes: Sequence[int], op: int,
                prescale_factor: float, postscale_factor: float, commit: bool) -> list:
    """Every collective of one optimizer step, with one membership, on ``comm``.

    ``arrays``: dense arrays, ``sizes[g]`` of them for group ``g`` (each group fused
    separately), then a ``(values, indices)`` pair per sparse gradient, whose parts are
    gathered from every rank (Average divides the values by the live size).  The
    dense buffers are one transaction (one agreement: ``comm.run_many``); all of
    it is one step transaction (``comm.consistent``): a rank lost anywhere inside
    makes the survivors redo all of it.  With ``commit`` it is the step transaction
    of :mod:`.session`, whose end commits the step there.
    Returns the dense results, then the gathered pairs, flat, in the same order.
    """
    groups, dense = [], 0
    for count in sizes:
        groups.append(arrays[dense:dense + count])
        dense += count

    def attempt() -> list[Any]:
        calls, unpack = _fused_calls(comm, groups, op, prescale_factor, postscale_factor)
        out = unpack(comm.run_many(calls))
        for k in range(dense, len(arrays), 2):
            values = comm.allgather(arrays[k])
            if op == ReduceOp.AVERAGE:
                values = values.astype(true_division_dtype(values.dtype), copy=False)
                values = values / values.dtype.type(comm.size)
            out += [values, comm.allgather(arrays[k + 1])]
        return out

    result = comm.consistent(attempt)
    if commit:
        process.runtime().session.commit()
    return result
