"""Exceptions of elastic_hvd.

Every exception a collective raises is raised on *every* surviving rank (the
outcome of each collective is agreed on), so a script can handle them without
fearing that another rank went on without it.
"""

from collections.abc import Container, Iterable, Sequence
from typing import Any

from .ops import ReduceOp

#: Why only the global process set exists (the message of every refusal).
NO_PROCESS_SETS = (
    "process sets other than the global one (all live ranks) are not supported by "
    "elastic_hvd: every set would need its own resilient communicator, re-derived from "
    "the repaired global one after each loss, and its own agreement on every collective; "
    "use the global process set (leave process_set= out)")


class ElasticHvdError(RuntimeError):
    """Base class of elastic_hvd's own errors."""


class NotInitializedError(ElasticHvdError, ValueError):
    """An API that needs the communicator was called before ``init()``."""

    def __init__(self, what: str = "this call") -> None:
        super().__init__(
            f"elastic_hvd has not been initialized; call hvd.init() before {what}.")


class RanksBelowMinimumError(ElasticHvdError):
    """Survivors of a failure fell below ``min_np``: training cannot go on.

    Raised on every survivor by the collective that noticed it, and by every
    collective after it.  The repaired communicator stays usable for a last
    checkpoint.
    """

    def __init__(self, size: int, min_np: int, lost: Iterable[int]) -> None:
        self.size, self.min_np, self.lost = size, min_np, tuple(lost)
        super().__init__(
            f"only {size} rank(s) left after losing original rank(s) {list(self.lost)}; "
            f"min_np is {min_np}")


class MismatchError(ElasticHvdError, ValueError):
    """Ranks called a collective with different shapes, dtypes, ops or roots.

    ``signatures``: each rank's call, in rank order (see :data:`SIGNATURE_FIELDS`);
    ``names``: the name each rank gave its op (``name=``, "" for none), which is said
    but not compared: Horovod does not require ranks to name a collective alike.
    """

    def __init__(self, signatures: Iterable[tuple[Any, ...]],
                 names: Sequence[str] | None = None) -> None:
        self.signatures = list(signatures)
        # (a rank lost while the names were gathered leaves them unmatched: none then)
        self.names = list(names) if names is not None and len(names) == len(self.signatures) \
            else [""] * len(self.signatures)
        at = _first_difference(self.signatures)
        calls = [_labelled(s, at) for s in self.signatures]
        if len({s[0] for s in self.signatures}) > 1:
            differ = ["the collective"]
        else:
            differ = [f for f in calls[0] if len({c.get(f) for c in calls}) > 1]
        lines = "\n".join(
            f"  rank {r}: {describe_call(s, n, differ, at)}"
            for r, (s, n) in enumerate(zip(self.signatures, self.names)))
        super().__init__(f"ranks disagree on the collective they called (they differ in: "
                         f"{', '.join(differ)}):\n{lines}")


#: What a collective's signature holds after its kind (the tuples built in
#: ``collectives.py``), so that a mismatch names each part.
SIGNATURE_FIELDS = {
    "allreduce": ("dtype", "shape", "op", "prescale_factor", "postscale_factor",
                  "allreduce_piece_bytes", "tensors_per_buffer"),
    "allgather": ("dtype", "shape[1:]"),
    "broadcast": ("dtype", "shape", "root_rank"),
    "alltoall": ("dtype", "shape[1:]", "splits"),
    "reducescatter": ("dtype", "shape", "op", "prescale_factor", "postscale_factor"),
    "broadcast_object": ("root_rank",),
}
#: Parts said only where ranks differ in them.
_QUIET = ("prescale_factor", "postscale_factor", "allreduce_piece_bytes", "tensors_per_buffer")


def describe_call(signature: tuple[Any, ...], name: str = "",
                  show: Container[str] = (), at: int = 0) -> str:
    """One rank's call with its parts labelled, its real shapes and dtype names, e.g.
    ``allreduce name='loss' dtype=float32 shape=(2, 3) op=Average``; the parts in
    :data:`_QUIET` only when named in ``show``; tensors fused into one call from
    tensor ``at`` on."""
    parts = [signature[0]] + ([f"name={name!r}"] if name else [])
    parts += [f"{field}={text}" for field, text in _labelled(signature, at).items()
              if field not in _QUIET or field in show]
    return " ".join(parts)


def _fused_shapes(signature: tuple[Any, ...]) -> list[tuple[Any, ...]] | None:
    """The shapes of the tensors an allreduce call fuses (None for one tensor or another
    collective), without the name of a dtype reduced in a wider one."""
    shapes = signature[2] if signature[0] == "allreduce" and len(signature) > 2 else None
    if not shapes or isinstance(shapes[0], int):
        return None
    return _without_dtype_names(shapes)


def _without_dtype_names(shapes: Sequence[Any]) -> list[tuple[Any, ...]]:
    """Fused shapes without the name of a dtype reduced in a wider one (bfloat16)."""
    return [tuple(s) for s in shapes if not isinstance(s, str)]


def _first_difference(signatures: Sequence[tuple[Any, ...]]) -> int:
    """The first tensor whose shape differs between calls that fuse many (0 if none
    does): 200 fused shapes are said from there on, not from the first."""
    found = [shapes for shapes in map(_fused_shapes, signatures) if shapes is not None]
    if len(found) < len(signatures):
        return 0
    for k, shapes in enumerate(zip(*found)):
        if len(set(shapes)) > 1:
            return k
    shortest = min(map(len, found))
    return shortest if any(len(shapes) != shortest for shapes in found) else 0


def _labelled(signature: tuple[Any, ...], at: int = 0) -> dict[str, str]:
    """``{part: text}`` of a signature (after its kind); fused tensors from ``at`` on."""
    names, rest = SIGNATURE_FIELDS.get(signature[0], ()), signature[1:]
    if len(names) != len(rest):  # a kind this table does not know: numbered parts
        return {f"part{i + 1}": repr(value) for i, value in enumerate(rest)}
    fields = dict(zip(names, rest))
    texts: dict[str, str] = {}
    for field, value in fields.items():
        if field == "dtype":
            texts[field] = _dtype_name(value)
        elif field == "op":
            texts[field] = ReduceOp(value).name.title()
        elif field == "tensors_per_buffer":
            texts[field] = f"({_runs(value)})"
        elif field == "splits":
            texts[field] = "none" if value else "given"
        elif field == "shape" and value and not isinstance(value[0], int):
            # Tensors fused into one buffer: their shapes, and their dtype when it is
            # not the buffer's (bfloat16 is reduced in float32).
            packed = [d for d in value if isinstance(d, str)]
            if packed:
                texts["dtype"] = f"{packed[0]} (reduced as {texts['dtype']})"
            texts[field] = _shapes(_without_dtype_names(value), at)
        else:
            texts[field] = repr(value)
    return texts


def _shapes(shapes: Sequence[tuple[Any, ...]], at: int = 0) -> str:
    """Shapes of fused tensors from tensor ``at`` on (see :func:`_runs`)."""
    if len(shapes) == 1:
        return str(shapes[0])
    start = f"from tensor {at}: " if at else ""
    return f"[{start}{_runs(shapes[at:])}] ({len(shapes)} tensors)"


def _runs(items: Sequence[Any], limit: int = 4) -> str:
    """``items`` with equal neighbours counted (``(8,) x7, (9,)``), the first ``limit`` runs."""
    runs: list[list[Any]] = []
    for item in items:
        if runs and runs[-1][0] == item:
            runs[-1][1] += 1
        else:
            runs.append([item, 1])
    listed = ", ".join(f"{item} x{count}" if count > 1 else str(item)
                       for item, count in runs[:limit])
    return listed + (", ..." if len(runs) > limit else "")


def _dtype_name(text: Any) -> str:
    import numpy as np  # the core's errors are imported before anything needs numpy
    try:
        return np.dtype(text).name
    except TypeError:
        return str(text)


class RemoteCollectiveError(ElasticHvdError):
    """A collective failed because of an error raised on another rank.

    ``error_types``: the names of that error's class and of its bases (empty if the
    rank was lost before it could say), so that a framework layer can tell which
    kind of error it was -- elastic_hvd.tensorflow raises a bad argument there as
    TensorFlow's InvalidArgumentError on every rank, as Horovod does.
    """

    def __init__(self, message: str, error_types: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.error_types = tuple(error_types)


class FaultInjected(ElasticHvdError):
    """Raised by fault injection when asked to raise instead of sending a signal."""


class JoinOrderError(ElasticHvdError):
    """A joining process called a collective before it received the live state."""

    def __init__(self, signature: tuple[Any, ...]) -> None:
        super().__init__(
            f"this process was spawned into a running job and called {signature[0]!r} before "
            "receiving the live training state; a joining process must skip start-up "
            "collectives (guard them with `if not comm.joining:`) and reach training "
            "(hvd.fit or keras_callbacks.fit_elastic) first")
