"""Horovod's collective functions on TensorFlow tensors (``hvd.allreduce``,
``hvd.broadcast_variables``, ...), each a thin shell over :mod:`.ops`: argument
checks and Horovod's conventions here, the op and its gradient there.
"""

import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from ..core import runtime
from ..core.errors import RanksBelowMinimumError
from ..core.ops import Adasum, Average, ReduceOp, Sum
from . import ops as _ops
from .compression import Compression, Compressor
from .ops import ProcessSet, global_process_set

if TYPE_CHECKING:
    from ..core.comm import ResilientComm

#: Raised by Horovod when a collective fails; here failures are survived, and the
#: one that ends training (too few ranks left) is raised on every rank.
HorovodInternalError = RanksBelowMinimumError


#: Horovod's words for Adasum on IndexedSlices (horovod/tensorflow/__init__.py).
NO_SPARSE_ADASUM = ("The Adasum reduction does not currently support sparse tensors. As a "
                    "workaround please pass sparse_as_dense=True to DistributedOptimizer")


#: Horovod's refusal of Adasum on a non-global process set.
NO_SET_ADASUM = "Adasum does not support non-global process sets yet."


def _tensor(value: Any) -> Any:
    return value if isinstance(value, (tf.Tensor, tf.Variable, tf.IndexedSlices)) \
        else tf.convert_to_tensor(value)


def _on(process_set: ProcessSet, what: str) -> Any:
    """The live communicator, or ``process_set``'s (see :func:`.ops.check_process_set`)."""
    set_id = _ops.check_process_set(process_set)
    return _ops.raised_as_tensorflow(_ops._on_set, runtime.current(what), set_id)


def _checked_op(op: ReduceOp, set_id: int) -> ReduceOp:
    """``op``, unless Adasum on a non-global set: refused, as Horovod refuses it."""
    if op == Adasum and set_id != 0:
        raise NotImplementedError(NO_SET_ADASUM)
    return op


def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "",
              device_sparse: str = "", compression: type[Compressor] = Compression.none,
              op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              name: str | None = None, process_set: ProcessSet = global_process_set,
              ignore_name_scope: bool = False) -> Any:
    """Reduce ``tensor`` over all live ranks of ``process_set`` (default op: Average over
    the live size; ``op=Adasum``: :mod:`elastic_hvd.core.adasum`, over any live size)."""
    set_id = _ops.check_process_set(process_set)
    op = _checked_op(_ops.resolve_op(op, average), set_id)
    tensor = _tensor(tensor)
    if isinstance(tensor, tf.IndexedSlices):
        [reduced] = _allreduce_slices([tensor], op, prescale_factor, postscale_factor, set_id)
        return reduced
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    [reduced] = _ops.allreduce_tensors([compressed], op, prescale_factor, postscale_factor,
                                        name or "HorovodAllreduce", set_id)
    return compression.decompress(reduced, ctx)


def grouped_allreduce(tensors: Iterable[Any], average: bool | None = None,
                      device_dense: str = "", device_sparse: str = "",
                      compression: type[Compressor] = Compression.none, op: int | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      ignore_name_scope: bool = False, name: str | None = None) -> list[Any]:
    """Allreduce a list of tensors in as few fused collectives as possible
    (``IndexedSlices`` among them gathered, as :func:`allreduce` does)."""
    set_id = _ops.check_process_set(process_set)
    op = _checked_op(_ops.resolve_op(op, average), set_id)
    tensors = [_tensor(t) for t in tensors]
    results: list[Any] = [None] * len(tensors)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    if sparse:
        reduced = _allreduce_slices([tensors[i] for i in sparse], op, prescale_factor,
                                    postscale_factor, set_id)
        for i, r in zip(sparse, reduced):
            results[i] = r
    dense = [i for i in range(len(tensors)) if results[i] is None]
    pairs = [compression.compress(tf.convert_to_tensor(tensors[i])) for i in dense]
    reduced = _ops.allreduce_tensors([p[0] for p in pairs], op, prescale_factor,
                                      postscale_factor, name or "HorovodGroupedAllreduce", set_id)
    for i, r, p in zip(dense, reduced, pairs):
        results[i] = compression.decompress(r, p[1])
    return results


def _allreduce_slices(slices: Sequence[Any], op: ReduceOp, prescale_factor: float,
                      postscale_factor: float, set_id: int = 0) -> list[Any]:
    """``IndexedSlices`` reduced as Horovod reduces them: every rank's values and
    indices gathered, in one op (Average divides the values by the live size);
    ``dense_shape`` kept as it is, even None.  Like Horovod, only Average and Sum,
    and no scale factors."""
    if op == Adasum:
        raise NotImplementedError(NO_SPARSE_ADASUM)
    if op not in (Average, Sum):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")
    _, gathered = _ops.reduce_together([], [(s.values, s.indices) for s in slices], op,
                                       name="HorovodAllgatherSlices", set_id=set_id)
    return [tf.IndexedSlices(values, indices, dense_shape=s.dense_shape)
            for (values, indices), s in zip(gathered, slices)]


def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> Any:
    """Concatenate every rank's tensor along the first axis (sizes may differ)."""
    set_id = _ops.check_process_set(process_set)
    return _ops.allgather_tensor(tf.convert_to_tensor(tensor), name, set_id)


def grouped_allgather(tensors: Iterable[Any], name: str | None = None,
                      ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> list[Any]:
    """:func:`allgather` of each tensor (one collective each, not fused)."""
    return [allgather(t, name=name, process_set=process_set) for t in tensors]


def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> Any:
    """``tensor`` of ``root_rank`` on every rank (lowest survivor if the root died);
    ``root_rank`` is a global rank, also with a ``process_set`` (as Horovod's)."""
    set_id = _ops.check_process_set(process_set)
    return _ops.broadcast_tensor(tf.convert_to_tensor(tensor), root_rank, name, set_id)


def broadcast_(variables: Iterable[Any], root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> list[Any]:
    """Broadcast in place: assign ``root_rank``'s values to ``variables``; returns their
    values read after the assignment, as Horovod does (returning the variables
    themselves would leave a graph nothing to fetch that runs the broadcast)."""
    variables = list(variables)
    with tf.control_dependencies([broadcast_variables(variables, root_rank,
                                                      process_set=process_set)]):
        return [v.read_value() for v in variables]


def broadcast_variables(variables: Iterable[Any], root_rank: int,
                        process_set: ProcessSet = global_process_set,
                        inplace: bool = False) -> Any:
    """Assign ``root_rank``'s values to every variable, in one fused broadcast per dtype."""
    set_id = _ops.check_process_set(process_set)
    variables = list(variables)
    if not variables:
        return tf.group()

    def fn(comm: "ResilientComm", *arrays: np.ndarray) -> list[Any]:
        root = _ops.set_root(comm, root_rank)
        out: list[Any] = [None] * len(arrays)
        by_dtype: dict[np.dtype, list[int]] = {}
        for i, a in enumerate(arrays):
            by_dtype.setdefault(a.dtype, []).append(i)
        for idx in by_dtype.values():
            flat = comm.broadcast(np.concatenate([arrays[i].reshape(-1) for i in idx]), root,
                                  shapes=[arrays[i].shape for i in idx])
            offset = 0
            for i in idx:
                out[i] = flat[offset:offset + arrays[i].size].reshape(arrays[i].shape)
                offset += arrays[i].size
        return out

    values = _ops.numpy_op("HorovodBroadcastVariables", fn, [v.read_value() if hasattr(
        v, "read_value") else tf.convert_to_tensor(v) for v in variables],
        [tf.as_dtype(v.dtype).base_dtype for v in variables], into_variables=True, set_id=set_id)
    return tf.group(*[v.assign(tf.reshape(x, v.shape)) for v, x in zip(variables, values)])


def broadcast_global_variables(root_rank: int) -> Any:
    """TF1 graphs only (as in Horovod): eager code uses broadcast_variables."""
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution; "
                           "use hvd.broadcast_variables(model.variables, root_rank)")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Any picklable ``obj`` of ``root_rank`` on every rank (lowest survivor's if the
    root died); ``session`` and ``name`` are ignored."""
    on = _on(process_set, "broadcast_object")
    return _ops.raised_as_tensorflow(lambda: on.broadcast_object(obj, _ops.set_root(on, root_rank)))


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: ProcessSet = global_process_set) -> Callable[[Any], Any]:
    """A function ``obj -> broadcast_object(obj, root_rank)``."""
    return lambda obj: broadcast_object(obj, root_rank, process_set=process_set)


def allgather_object(obj: Any, session: Any = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """List of every live rank's picklable ``obj``, in rank order."""
    return _ops.raised_as_tensorflow(_on(process_set, "allgather_object").allgather_object, obj)


def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             ignore_name_scope: bool = False, process_set: ProcessSet = global_process_set) -> Any:
    """``received``, and ``(received, received_splits)`` when ``splits`` is given (as
    Horovod returns); rows for ranks that die are dropped."""
    set_id = _ops.check_process_set(process_set)
    tensor = tf.convert_to_tensor(tensor)
    name = name or "HorovodAlltoall"

    @tf.custom_gradient
    def exchange(x: Any) -> tuple[tuple[Any, Any], Callable[..., Any]]:
        received, rsplits = _ops.alltoall_raw(x, splits, name, set_id)

        def grad(dy: Any, _dsplits: Any = None) -> Any:
            back, _ = _ops.alltoall_raw(dy, rsplits, name + "_grad", set_id)
            return back
        return (received, rsplits), grad

    received, rsplits = exchange(tensor)
    return received if splits is None else (received, rsplits)


def reducescatter(tensor: Any, device_dense: str = "",
                  compression: type[Compressor] = Compression.none, op: int = Average,
                  name: str | None = None, process_set: ProcessSet = global_process_set,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> Any:
    """:func:`grouped_reducescatter` of one tensor."""
    [out] = grouped_reducescatter([tensor], device_dense, compression, op, process_set,
                                  prescale_factor, postscale_factor, name=name)
    return out


def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "",
                          compression: type[Compressor] = Compression.none, op: int = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          name: str | None = None) -> list[Any]:
    """Reduce, then give rank i the i-th block of the first axis (lower ranks get extra rows)."""
    set_id = _ops.check_process_set(process_set)
    op = _ops.resolve_op(op, None)
    if op not in (Average, Sum):
        raise NotImplementedError("reducescatter supports Average and Sum")
    if not tensors:
        return []
    pairs = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
    outs = _ops.reducescatter_tensors([p[0] for p in pairs], op, prescale_factor,
                                       postscale_factor, name or "HorovodReducescatter", set_id)
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every live rank of ``process_set`` reaches it (a rank lost meanwhile is
    not waited for)."""
    _ops.raised_as_tensorflow(_on(process_set, "barrier").barrier)


def join(device: str = "") -> Any:
    """Every rank calls join() when it is done; returns the rank that joined last.

    Unlike Horovod, ranks that have not joined cannot keep running collectives
    against joined ones: such a collective raises MismatchError on every rank.
    """
    comm = runtime.current("join")
    stamps = _ops.raised_as_tensorflow(comm.allgather_object, time.time())
    return tf.constant(int(np.argmax(stamps)), dtype=tf.int32)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """TF1 ``MonitoredTrainingSession`` hook: broadcast global variables once the session exists."""

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op: Any = None

    def begin(self) -> None:
        if self.bcast_op is None or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session: Any, coord: Any) -> None:
        session.run(self.bcast_op)
