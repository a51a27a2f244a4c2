"""One optimizer step's gradient traffic, without TensorFlow: fusion into buffers, the
gathers of sparse gradients, and the step transaction around all of them.

The TF layer turns a step's gradients into numpy arrays, calls :func:`reduce_step`
once (one op per step) and turns the results back into tensors.  Everything in
between -- which arrays share a buffer and how a buffer is laid out, how slices are
gathered and averaged, and that all of it runs with one membership and commits the
step (:mod:`.session`) -- happens here, on the core's side, so that the way from the
op to ``MPI_Allreduce`` never leaves the core once it entered it.
"""

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import config, runtime
from .ops import ReduceOp

#: Bytes: TF shares a result's memory without a copy only when it is 64-byte aligned.
ALIGN = 64

#: Dtypes numpy cannot reduce, reduced in a wider one (by name: bfloat16 is
#: ml_dtypes', which TF registers with numpy).
_WIDEN = {"bfloat16": np.dtype(np.float32)}


def aligned_empty(count: int, dtype: Any) -> np.ndarray:
    """A 1-D array of ``count`` elements starting on a 64-byte boundary."""
    dtype = np.dtype(dtype)
    raw = np.empty(count * dtype.itemsize + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + count * dtype.itemsize].view(dtype)


def _buffers(arrays: Sequence[np.ndarray], threshold: int) -> list[list[int]]:
    """Indices of ``arrays`` per fusion buffer: one dtype each, at most ``threshold``
    bytes unless one array alone is larger; arrays in their given order."""
    by_dtype: dict[np.dtype, list[int]] = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(a.dtype, []).append(i)
    buffers = []
    for indices in by_dtype.values():
        batch: list[int] = []
        nbytes = 0
        for i in indices:
            if batch and nbytes + arrays[i].nbytes > threshold:
                buffers.append(batch)
                batch, nbytes = [], 0
            batch.append(i)
            nbytes += arrays[i].nbytes
        buffers.append(batch)
    return buffers


def fused_allreduce(comm: Any, arrays: Sequence[np.ndarray], op: int,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list:
    """Allreduce many arrays over ``comm`` in as few collectives as possible.

    Arrays of one dtype are packed into buffers of at most the fusion threshold;
    each buffer is one resilient collective, whose signature carries the arrays'
    shapes (ranks that pack other shapes mismatch, even with equal sizes).  bfloat16
    is packed into float32 and its signature names bfloat16 too: ranks that pass
    bfloat16 and float32 mismatch, as Horovod's do, instead of summing together.
    Every result of a buffer in the arrays' own dtype starts on a 64-byte boundary
    (segments are padded with zeros), so TF can take it without a copy.
    """
    results: list = [None] * len(arrays)
    for batch in _buffers(arrays, config.current().fusion_threshold):
        dtype = arrays[batch[0]].dtype
        wire = _WIDEN.get(dtype.name, dtype)
        align = max(1, ALIGN // wire.itemsize)
        starts, total = [], 0
        for j in batch:
            starts.append(total)
            total += -(-arrays[j].size // align) * align
        if len(batch) == 1 and wire == dtype:
            send = arrays[batch[0]].reshape(-1)
        else:
            send = np.zeros(total, dtype=wire)
            for j, start in zip(batch, starts):
                send[start:start + arrays[j].size] = arrays[j].reshape(-1)
        layout = [arrays[j].shape for j in batch]
        reduced = comm.allreduce(send, op=op, prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor,
                                 out=aligned_empty(send.size, wire),
                                 shapes=layout if wire == dtype else [dtype.name] + layout)
        for j, start in zip(batch, starts):
            segment = reduced[start:start + arrays[j].size].reshape(arrays[j].shape)
            results[j] = segment if wire == dtype else segment.astype(dtype)
    return results


def true_division_dtype(dtype: Any) -> np.dtype:
    """The dtype of ``values / size`` as TF computes it (Horovod averages slices so):
    integers give float32 up to 16 bits, float64 above; floats stay."""
    dtype = np.dtype(dtype)
    if dtype.kind not in "iu":
        return dtype
    return np.dtype(np.float32 if dtype.itemsize <= 2 else np.float64)


def reduce_step(*arrays: np.ndarray, sizes: Sequence[int], op: int, prescale_factor: float,
                postscale_factor: float, commit: bool) -> list:
    """Every collective of one optimizer step, with one membership, on the live
    communicator.

    ``arrays``: dense arrays, ``sizes[g]`` of them for group ``g`` (each group fused
    separately), then a ``(values, indices)`` pair per sparse gradient, whose parts are
    gathered from every rank (Average divides the values by the live size).  With
    ``commit`` it is the step transaction of :mod:`.session`: a rank lost anywhere
    inside makes the survivors redo all of it, and its end commits the step.
    Returns the dense results, then the gathered pairs, flat, in the same order.
    """
    comm, dense = runtime.current("a step's gradients"), sum(sizes)

    def attempt():
        out, start = [], 0
        for count in sizes:
            out += fused_allreduce(comm, arrays[start:start + count], op, prescale_factor,
                                   postscale_factor)
            start += count
        for k in range(dense, len(arrays), 2):
            values = comm.allgather(arrays[k])
            if op == ReduceOp.AVERAGE:
                values = values.astype(true_division_dtype(values.dtype), copy=False)
                values = values / values.dtype.type(comm.size)
            out += [values, comm.allgather(arrays[k + 1])]
        return out

    return runtime.session().step_transaction(attempt) if commit else comm.consistent(attempt)
