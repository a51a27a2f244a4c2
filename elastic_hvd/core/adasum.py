"""Adasum (``op=Adasum``) on CPU, as Horovod defines it, over any number of ranks.

The pairwise rule, for two ranks' vectors ``a`` (the lower rank's) and ``b``::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

with a coefficient of 1 where a norm is below sqrt(DBL_MIN) (Horovod's guard against
dividing by zero), dot products and norms accumulated in float64, the combination
computed in float64 and stored in the tensor's dtype after every pairwise step.  The
dot products are taken *per tensor*: a fused buffer of several tensors combines each
tensor with its own coefficients.

Over ``p = 2^k`` ranks the pairs form a binary tree: ranks ``2i`` and ``2i+1`` first,
then the results of ranks ``4i..4i+1`` and ``4i+2..4i+3``, and so on, the lower block
always ``a``.  It is computed as Horovod's MPI path computes it
(horovod/common/ops/adasum/adasum.h, ``FusedAllreduce``): vector halving, distance
doubling -- at the level of distance ``d`` a rank keeps half of its current segment,
swaps the other half with rank ``r ^ d``, and the ``2d`` ranks of its block sum their
partial dot products and norms (here by a butterfly of point-to-point exchanges
instead of Horovod's per-level communicators, which a repair would have to rebuild);
then distance halving gathers the segments back.  Each rank sends about twice the
buffer, as a ring allreduce does.

Sizes that are not a power of two.  Horovod refuses them (its TensorFlow and PyTorch
layers raise "Running Adasum with non-power of 2 ranks is not supported yet"); a
loss makes any size possible here, so the reduction is defined for every size ``n``:
with ``p`` the largest power of two <= n, rank ``p + j`` first hands its vector to
rank ``j``, which combines them (``adasum(x_j, x_{p+j})``, the lower rank ``a``), the
``p`` ranks then reduce as above, and rank ``j`` hands the result back.  For a power
of two it is exactly Horovod's tree.  The ranks are those of the communicator the
attempt runs on: after a loss, the survivors in their (order-preserving) new
numbering, so the result is the same function of the survivors' inputs on every
survivor.

Everything runs inside one attempt of the resilient transaction
(``ResilientComm.run``): a rank lost mid-way makes the survivors redo all of it
among themselves, from their inputs (never written to).
"""

from collections.abc import Sequence
from typing import Any

import numpy as np

#: Horovod's guard: a norm below this leaves its coefficient at 1.
_TINY = float(np.sqrt(np.finfo(np.float64).tiny))

#: Tag of Adasum's point-to-point messages on the transaction's communicator.
TAG = 4545

#: Dtypes Adasum combines (Horovod: float16, float32, float64 only).
FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def largest_power_of_two(n: int) -> int:
    p = 1
    while p * 2 <= n:
        p *= 2
    return p


def pairwise(a: np.ndarray, b: np.ndarray, counts: Sequence[int],
             store: np.dtype | None = None) -> np.ndarray:
    """``adasum(a, b)`` of two whole flat vectors, tensor by tensor (``counts``: the
    tensors' sizes, end to end), as a new array of ``a``'s dtype, rounded through
    ``store`` when given."""
    out = np.empty_like(a)
    start = 0
    for count in counts:
        stop = start + count
        dots = _dots(a[start:stop], b[start:stop])
        out[start:stop] = _combine(a[start:stop], b[start:stop], *dots, store)
        start = stop
    return out


def _dots(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    """(a.b, |a|^2, |b|^2) in float64.  By einsum, not ``@``: numpy's ``@`` calls
    OpenBLAS, whose threads spin against the ranks on a shared machine (38 ms for a
    1 MiB float64 dot here under load, einsum 0.07 ms)."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return (float(np.einsum("i,i->", a64, b64)), float(np.einsum("i,i->", a64, a64)),
            float(np.einsum("i,i->", b64, b64)))


def _coefficients(dot: float, anormsq: float, bnormsq: float) -> tuple[float, float]:
    acoeff = 1.0 - dot / anormsq * 0.5 if anormsq >= _TINY else 1.0
    bcoeff = 1.0 - dot / bnormsq * 0.5 if bnormsq >= _TINY else 1.0
    return acoeff, bcoeff


def _combine(a: np.ndarray, b: np.ndarray, dot: float, anormsq: float, bnormsq: float,
             store: np.dtype | None) -> np.ndarray:
    acoeff, bcoeff = _coefficients(dot, anormsq, bnormsq)
    result = (acoeff * a.astype(np.float64) + bcoeff * b.astype(np.float64)).astype(a.dtype)
    if store is not None and store != a.dtype:
        result = result.astype(store).astype(a.dtype)
    return result


def _sendrecv(comm: Any, send: np.ndarray, recv: np.ndarray, peer: int) -> None:
    comm.Sendrecv(send, peer, TAG, recv, peer, TAG)


def reduce(comm: Any, x: np.ndarray, counts: Sequence[int],
           store: np.dtype | None = None) -> np.ndarray:
    """Adasum of every rank's flat ``x`` over the MPI communicator ``comm`` (see the
    module doc); ``counts``: the sizes of the tensors packed end to end in ``x``
    (equal on every rank).  ``x`` is not written to.  ``store``: the dtype results
    are rounded to after each pairwise step, when ``x`` holds it widened (float16 in
    float32)."""
    n, rank = comm.size, comm.rank
    p = largest_power_of_two(n)
    work = np.array(x, copy=True).reshape(-1)
    if rank >= p:  # fold: hand the vector to rank - p, get the result back
        comm.Send(work, rank - p, TAG)
        comm.Recv(work, rank - p, TAG)
        return work
    if rank + p < n:
        other = np.empty_like(work)
        comm.Recv(other, rank + p, TAG)
        work = pairwise(work, other, counts, store)
    _halving_doubling(comm, work, counts, rank, p, store)
    if rank + p < n:
        comm.Send(work, rank + p, TAG)
    return work


def _halving_doubling(comm: Any, x: np.ndarray, counts: Sequence[int], rank: int, p: int,
                      store: np.dtype | None) -> None:
    """In place: ``x`` becomes the Adasum tree of ranks 0..p-1's ``x``."""
    bounds = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).tolist()
    lo, hi = 0, x.size
    segments = []  # (lo, hi) before each level's halving
    level = 1
    while level < p:
        peer = rank ^ level
        mid = lo + (hi - lo) // 2  # the lower rank keeps the first half (floor)
        left = not rank & level
        keep, give = ((lo, mid), (mid, hi)) if left else ((mid, hi), (lo, mid))
        theirs = np.empty(keep[1] - keep[0], dtype=x.dtype)
        _sendrecv(comm, np.ascontiguousarray(x[give[0]:give[1]]), theirs, peer)
        mine = x[keep[0]:keep[1]]
        # Per tensor: (dot, |lower block's part|^2, |upper block's part|^2), summed over
        # the 2*level ranks of this block (they hold disjoint parts of the vector).
        sums = np.zeros((len(counts), 3), dtype=np.float64)
        pieces = []
        for i in range(len(counts)):
            start, stop = max(bounds[i], keep[0]), min(bounds[i + 1], keep[1])
            if start >= stop:
                continue
            a = mine[start - keep[0]:stop - keep[0]]
            b = theirs[start - keep[0]:stop - keep[0]]
            dot, own, other = _dots(a, b)
            sums[i] = (dot, own, other) if left else (dot, other, own)
            pieces.append((i, start - keep[0], stop - keep[0]))
        _block_sum(comm, sums, rank, level)
        for i, start, stop in pieces:
            dot, lower, upper = sums[i]
            own, other = (lower, upper) if left else (upper, lower)
            mine[start:stop] = _combine(mine[start:stop], theirs[start:stop], dot, own, other,
                                        store)
        segments.append((lo, hi))
        lo, hi = keep
        level *= 2
    while segments:  # distance halving: gather the segments back
        level //= 2
        outer = segments.pop()
        other_part = (hi, outer[1]) if lo == outer[0] else (outer[0], lo)
        received = np.empty(other_part[1] - other_part[0], dtype=x.dtype)
        _sendrecv(comm, np.ascontiguousarray(x[lo:hi]), received, rank ^ level)
        x[other_part[0]:other_part[1]] = received
        lo, hi = outer


def _block_sum(comm: Any, sums: np.ndarray, rank: int, level: int) -> None:
    """In place: ``sums`` summed over the ``2 * level`` ranks of ``rank``'s block, by a
    butterfly (every rank ends with bitwise the same sums: each step adds the same
    two operands on both sides)."""
    other = np.empty_like(sums)
    d = 1
    while d <= level:
        peer = rank ^ d
        _sendrecv(comm, sums.copy(), other, peer)
        if rank < peer:
            sums += other
        else:
            sums[...] = other + sums
        d *= 2
