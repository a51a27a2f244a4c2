"""TensorFlow ops over the resilient core, eager and inside ``tf.function``.

Each collective is one ``tf.numpy_function`` (stateful), which calls the core
with numpy views of the tensors (eagerly, the core is called directly).  Being
stateful, the ops keep program order under ``tf.function``'s automatic control
dependencies, so every rank issues its collectives in the same order; in a TF1
graph :mod:`.ordering` chains them.  Everything
that depends on the membership (averaging, rank, size) is computed inside the op
when it runs, never traced into the graph: a compiled step keeps averaging over
the survivors after a loss.
"""

import functools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import tensorflow as tf

from ..core import ElasticHvdError, reducer, runtime
from ..core import process_set_api, process_sets
from ..core.process_set_api import (ProcessSet, add_process_set, global_process_set,  # noqa: F401
                                    remove_process_set)
from ..core.ops import Average, Max, Min, Product, ReduceOp, Sum, check_op
from . import ordering, timeline
from .errors import for_tensorflow
from ..log import get_logger

if TYPE_CHECKING:
    from ..core.comm import ResilientComm

_log = get_logger(__name__)

_R = TypeVar("_R")

def check_process_set(process_set: ProcessSet | None) -> int:
    """The registered id of ``process_set`` (Horovod's ``process_set=``), read when the op
    is made, as Horovod bakes it into the op; UnknownProcessSetError (a ValueError, as
    Horovod's) when it is not registered."""
    return process_set_api.set_id_of(process_set)


def _on_set(comm: "ResilientComm", set_id: int) -> Any:
    """What an op on set ``set_id`` runs on: the live communicator, or the set's
    :class:`~elastic_hvd.core.process_sets.SetComm` (a non-member: NotInProcessSetError,
    raised as TF's InvalidArgumentError, as Horovod's op fails)."""
    return process_set_api.comm_of(comm, set_id)


def set_root(target: Any, root_rank: int) -> int:
    """The rank within ``target`` (a set's communicator, or the global one) of the
    process that is *global* rank ``root_rank`` now: Horovod names a broadcast's root
    by its global rank, also on a process set (ValueError, raised as TF's
    InvalidArgumentError, for a rank outside the set)."""
    if not isinstance(target, process_sets.SetComm):
        return root_rank
    ids, members = target.comm.ids, target.registry.entry(target.set_id).members
    if not 0 <= int(root_rank) < len(ids) or ids[int(root_rank)] not in members:
        raise ValueError(f"broadcast: root rank {root_rank} is not a member of process set "
                         f"{target.set_id} (its ranks: "
                         f"{target.registry.ranks(target.comm, target.set_id)})")
    root_id = ids[int(root_rank)]
    # a root lost since (the set repaired itself): the lowest surviving member, as the
    # global broadcast does
    return target.ids.index(root_id) if root_id in target.ids else 0


def _comm() -> "ResilientComm":
    return runtime.current("a collective")


def resolve_op(op: int | None, average: bool | None, default: int = Average) -> ReduceOp:
    """The ReduceOp meant by ``op=`` or the deprecated ``average=`` (``default`` if
    neither)."""
    if op is not None and average is not None:
        raise ValueError("give either op= or the deprecated average=, not both")
    if op is None:
        op = default if average is None else (Average if average else Sum)
    return check_op(op)


def _to_tensor(array: Any, dtype: Any) -> Any:
    """A tensor of ``array``, without copying it when TF can share its memory.

    ``tf.convert_to_tensor`` copies (cost: docs/measurements.md).  DLPack hands a
    fresh result over as it is, but TF aborts the process on memory that is not
    64-byte aligned, so only aligned, writable (i.e. our own) arrays go that way.
    """
    dtype = tf.as_dtype(dtype)
    if (isinstance(array, np.ndarray) and array.flags.writeable and array.flags.c_contiguous
            and array.ctypes.data % reducer.ALIGN == 0 and array.dtype == dtype.as_numpy_dtype
            and array.size):
        try:
            return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
        except (BufferError, TypeError, ValueError, tf.errors.InvalidArgumentError):
            pass
    return tf.convert_to_tensor(array, dtype=dtype)


#: The errors of a collective that its op raises as Horovod's TF op raises them.
_RAISED_AS_TENSORFLOW = (ElasticHvdError, ValueError)


def raised_as_tensorflow(fn: Callable[..., _R], *args: Any) -> _R:
    """``fn(*args)``; a collective's error raised as Horovod's TF op raises it (see
    :mod:`.errors`), without our frames: TF logs an op's error with its traceback on
    every rank, ours are complete sentences, and our frames would bury them (~60
    lines a rank)."""
    try:
        return fn(*args)
    except _RAISED_AS_TENSORFLOW as exc:
        raise for_tensorflow(exc).with_traceback(None) from None


def numpy_op(name: str, fn: Callable[..., Any], inputs: Sequence[Any], tout: Any,
             collective: bool = True, into_variables: bool = False, set_id: int = 0) -> Any:
    """Run ``fn(comm, *arrays)`` (the live communicator, or the :class:`SetComm` of process
    set ``set_id``; numpy in, numpy out) as a stateful op, traced in the timeline; in a
    TF1 graph, a ``collective`` is ordered after the graph's earlier ones, and none after
    one ``into_variables`` (a broadcast whose results only go into variables), see
    :mod:`.ordering`.  Its
    errors are raised as :func:`raised_as_tensorflow` says; in a graph, a mismatch
    comes back as a last output, whose error the graph raises."""
    many = isinstance(tout, (list, tuple))
    touts = list(tout) if many else [tout]
    # No graph to order: skip py_func's machinery (its cost per call: docs/measurements.md).
    in_graph = not tf.executing_eagerly()
    chained = in_graph and collective and ordering.needed()
    me: Any = ordering.Collective(into_variables) if chained else None  # None unless chained
    previous = me.predecessor(inputs) if chained else None

    def call(*arrays: np.ndarray) -> Any:
        comm = _comm()
        outer, comm.label = comm.label, name
        started = time.perf_counter()
        try:
            target = _on_set(comm, set_id)
            if chained:
                me.ran()
                with ordering.lock:
                    result = fn(target, *arrays)
            else:
                result = fn(target, *arrays)
        except _RAISED_AS_TENSORFLOW as exc:
            error = for_tensorflow(exc)
            if not (in_graph and isinstance(error, tf.errors.FailedPreconditionError)):
                raise error.with_traceback(None) from None
            _log.warning(f"elastic_hvd: {type(error).__name__} in {name}: {error}")
            return [np.zeros(0, t.as_numpy_dtype) for t in touts] + [np.bool_(True)]
        finally:
            comm.label = outer
            timeline.record(name, started, time.perf_counter())
        if not in_graph:
            return result
        return (list(result) if many else [result]) + [np.bool_(False)]

    if not in_graph:
        result = call(*[np.asarray(t) for t in inputs])  # zero-copy, read-only views
        if many:
            return [_to_tensor(r, d) for r, d in zip(result, tout)]
        return _to_tensor(result, tout)

    with tf.control_dependencies([previous] if previous is not None else []):
        *outputs, failed = tf.numpy_function(call, inputs, touts + [tf.bool],
                                             stateful=True, name=name)
    if chained:
        me.record(failed.op)
    outputs = _fail_precondition(failed, outputs, name)
    return outputs if many else outputs[0]


def _fail_precondition(failed: Any, outputs: Sequence[Any], name: str) -> list[Any]:
    """``outputs``, or ``tf.errors.FailedPreconditionError`` when ``failed``, as
    Horovod's op fails on a mismatch.  An exception in a py_func reaches the caller
    as a new error typed by a fixed table in TF's py_func.cc that has no
    FailedPrecondition, and no stock op fails with a given code and message; reading
    a variable that does not exist fails with that code, its name standing for the
    message (the rank's MismatchError is on its stderr)."""
    def fail() -> Any:
        handle = tf.raw_ops.VarHandleOp(
            dtype=tf.bool, shape=[], container="elastic_hvd",
            shared_name=f"MismatchError: the ranks called {name} differently (each rank's "
                        "call is on its stderr)")
        return tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.bool)

    ok = tf.cond(failed, fail, lambda: tf.constant(True))
    with tf.control_dependencies([ok]):
        return [tf.identity(o) for o in outputs]


try:  # whether a GradientTape could record right now (internal, but stable since TF 2.4)
    from tensorflow.python.eager.record import could_possibly_record as _could_record
except ImportError:  # pragma: no cover - older or newer TF: always take the differentiable path
    def _could_record() -> bool:
        return True


def _differentiable() -> bool:
    """False when executing eagerly with no tape around: gradients cannot be asked for,
    and tf.custom_gradient's eager bookkeeping would cost more than a small collective."""
    return not tf.executing_eagerly() or _could_record()


def _attribute(factor: float) -> float:
    """A scale factor as Horovod's TF ops receive it: their ``prescale_factor`` and
    ``postscale_factor`` attributes are float32 (horovod/tensorflow/mpi_ops.cc), so
    even a float64 tensor is scaled by the factor rounded to float32."""
    return float(np.float32(factor))


#: Name of the op (and ``ResilientComm.label``) that carries a step's gradients.
GRADIENTS = "HorovodGradients"


def reduce_together(groups: Sequence[Sequence[Any]], sparse: Sequence[tuple[Any, Any]],
                    op: ReduceOp, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    commit: bool = False, name: str = GRADIENTS, set_id: int = 0,
                    own_outside: bool = False,
                    ) -> tuple[list[list[Any]], list[tuple[Any, Any]]]:
    """Reduce dense tensors (``groups``: lists fused separately) and gather
    ``IndexedSlices`` parts (``sparse``: ``(values, indices)`` pairs) in one op
    whose results all come from one membership.

    With ``commit`` it is the step transaction of :mod:`elastic_hvd.core.session`:
    a rank lost anywhere inside it makes the survivors redo all of it, and its end
    commits the step (only the global set's: ``set_id`` 0).  ``own_outside``: on a
    non-global set, a process that is not a live member, or the only one, keeps its
    own tensors (Horovod's ``_allreduce_cond`` of the optimizer and the tape), decided
    when the op runs.  Returns ``(dense results per group, [(values, indices)])``.
    """
    dense = [t for group in groups for t in group]
    inputs = dense + [x for pair in sparse for x in pair]
    if not inputs:
        return [[] for _ in groups], []
    sizes = [len(group) for group in groups]
    prescale_factor, postscale_factor = _attribute(prescale_factor), _attribute(postscale_factor)

    step = functools.partial(reducer.reduce_step, op=op, sizes=sizes,
                             prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                             commit=commit and set_id == process_sets.GLOBAL_ID)

    def fn(target: Any, *arrays: np.ndarray) -> Any:
        if own_outside and isinstance(target, process_sets.SetComm):
            registry, comm = target.registry, target.comm
            if not registry.included(comm, set_id) or registry.size(comm, set_id) <= 1:
                return _own(arrays, len(dense), op)
        return step(target, *arrays)

    touts = [t.dtype for t in inputs]
    if op == Average:
        for k in range(len(dense), len(inputs), 2):
            touts[k] = tf.as_dtype(reducer.true_division_dtype(touts[k].as_numpy_dtype))
    outputs = numpy_op(name, fn, inputs, touts, set_id=set_id)
    for out, inp in zip(outputs, dense):
        out.set_shape(inp.shape)
    reduced, per_group, start = outputs[:len(dense)], [], 0
    for count in sizes:
        per_group.append(reduced[start:start + count])
        start += count
    gathered = []
    for k, (values, _indices) in enumerate(sparse):
        v, i = outputs[len(dense) + 2 * k], outputs[len(dense) + 2 * k + 1]
        v.set_shape(tf.TensorShape([None]).concatenate(values.shape[1:]))
        i.set_shape([None])
        gathered.append((v, i))
    return per_group, gathered


def _grouped_allreduce_raw(tensors: list[Any], op: ReduceOp, prescale_factor: float,
                           postscale_factor: float, name: str | None,
                           set_id: int = 0) -> list[Any]:
    prescale_factor, postscale_factor = _attribute(prescale_factor), _attribute(postscale_factor)

    def fn(comm: "ResilientComm", *arrays: np.ndarray) -> Any:
        return reducer.fused_allreduce(comm, arrays, op, prescale_factor, postscale_factor)

    outputs = numpy_op(name or "HorovodGroupedAllreduce", fn, tensors,
                        [t.dtype for t in tensors], set_id=set_id)
    for out, inp in zip(outputs, tensors):
        out.set_shape(inp.shape)
    return outputs


def allreduce_tensors(tensors: Sequence[Any], op: ReduceOp, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, name: str | None = None,
                      set_id: int = 0) -> list[Any]:
    """Differentiable grouped allreduce: the gradient is the same allreduce of the gradients
    (on process set ``set_id``, both)."""
    if not tensors:
        return []
    if not _differentiable():
        return _grouped_allreduce_raw(list(tensors), op, prescale_factor, postscale_factor, name,
                                      set_id)

    @tf.custom_gradient
    def reduce(*xs: Any) -> tuple[list[Any], Callable[..., list[Any]]]:
        ys = _grouped_allreduce_raw(list(xs), op, prescale_factor, postscale_factor, name,
                                    set_id)

        def grad(*dys: Any) -> list[Any]:
            if op in (Min, Max, Product):
                raise NotImplementedError(f"no gradient for allreduce with op {op.name}")
            return _grouped_allreduce_raw(list(dys), op, prescale_factor, postscale_factor,
                                          (name or "HorovodAllreduce") + "_grad", set_id)
        return ys, grad

    return list(reduce(*tensors))


def _allgather_raw(tensor: Any, name: str, set_id: int) -> tuple[Any, Any]:
    """(gathered, first row of this rank's part in it), both of the same membership."""
    def fn(comm: "ResilientComm", x: np.ndarray) -> tuple[Any, Any]:
        gathered, rows = comm.allgather(x, return_counts=True)
        return gathered, rows[:comm.rank].sum()

    gathered, start = numpy_op(name, fn, [tensor], [tensor.dtype, tf.int64], set_id=set_id)
    gathered.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
    return gathered, start


def allgather_tensor(tensor: Any, name: str | None = None, set_id: int = 0) -> Any:
    name = name or "HorovodAllgather"

    @tf.custom_gradient
    def gather(x: Any) -> tuple[Any, Callable[[Any], Any]]:
        y, start = _allgather_raw(x, name, set_id)

        def grad(dy: Any) -> Any:
            # Average the gradients of every rank (Horovod's _allgather_grad), then keep
            # the rows this rank gave -- where they were in the forward gather, even if
            # ranks were lost since.
            averaged = _grouped_allreduce_raw([dy], Average, 1.0, 1.0, name + "_grad",
                                              set_id)[0]
            return averaged[start:start + tf.shape(x, out_type=tf.int64)[0]]
        return y, grad

    return gather(tensor)


def broadcast_tensor(tensor: Any, root_rank: int, name: str | None = None,
                     set_id: int = 0) -> Any:
    """``root_rank`` (a global rank, also on a process set) broadcasts ``tensor``."""
    name = name or "HorovodBroadcast"

    def fn(comm: "ResilientComm", a: np.ndarray) -> tuple[Any, np.bool_]:
        ids, root = comm.ids, set_root(comm, root_rank)
        result = comm.broadcast(a, root_rank=root)
        return result, np.bool_(comm.root_id(ids, root) == comm.original_id)

    @tf.custom_gradient
    def bcast(x: Any) -> tuple[Any, Callable[[Any], Any]]:
        y, was_root = numpy_op(name, fn, [x], [x.dtype, tf.bool], set_id=set_id)
        y.set_shape(x.shape)

        def grad(dy: Any) -> Any:
            # The root of the forward pass gets the average (Horovod's _broadcast_grad),
            # the others zeros: the same process even if ranks were lost (and
            # renumbered) since.
            averaged = _grouped_allreduce_raw([dy], Average, 1.0, 1.0, name + "_grad",
                                              set_id)[0]
            return tf.where(was_root, averaged, tf.zeros_like(averaged))
        return y, grad

    return bcast(tensor)


def _scalar_op(name: str, value: Callable[["ResilientComm"], int]) -> Any:
    return numpy_op(name, lambda comm: np.int32(value(comm)), [], tf.int32, collective=False)


def size_op(process_set_id: int = 0, name: str | None = None) -> Any:
    """The live size of process set ``process_set_id`` (0: every rank), read when the op
    runs."""
    return _scalar_op(name or "HorovodSize",
                      lambda comm: comm.process_sets.size(comm, process_set_id))


def rank_op(name: str | None = None) -> Any:
    """The live rank, read when the op runs."""
    return _scalar_op(name or "HorovodRank", lambda comm: comm.rank)


def local_size_op(name: str | None = None) -> Any:
    """The live local size (:func:`~elastic_hvd.basics.local_size`), read when the op runs."""
    from .. import basics
    return _scalar_op(name or "HorovodLocalSize", lambda comm: basics.local_size())


def local_rank_op(name: str | None = None) -> Any:
    """The live local rank (:func:`~elastic_hvd.basics.local_rank`), read when the op runs."""
    from .. import basics
    return _scalar_op(name or "HorovodLocalRank", lambda comm: basics.local_rank())


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> Any:
    """1 if this process is a live member of process set ``process_set_id``, else 0, read
    when the op runs."""
    return _scalar_op(name or "HorovodProcessSetIncluded",
                      lambda comm: int(comm.process_sets.included(comm, process_set_id)))


def alltoall_raw(tensor: Any, splits: Any, name: str, set_id: int = 0) -> tuple[Any, Any]:
    def fn(comm: "ResilientComm", x: np.ndarray, s: Any) -> tuple[Any, Any]:
        received, rsplits = comm.alltoall(x, splits=None if s.size == 0 else s)
        return received, rsplits.astype(np.int32)

    splits = tf.zeros([0], tf.int32) if splits is None else tf.cast(splits, tf.int32)
    out, rsplits = numpy_op(name, fn, [tensor, splits], [tensor.dtype, tf.int32],
                            set_id=set_id)
    out.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
    rsplits.set_shape([None])
    return out, rsplits


def _reducescatter_raw(tensors: Sequence[Any], op: ReduceOp, prescale_factor: float,
                       postscale_factor: float, name: str, set_id: int) -> list[Any]:
    def fn(comm: "ResilientComm", *arrays: np.ndarray) -> list[Any]:
        return [comm.reducescatter(a, op=op, prescale_factor=prescale_factor,
                                   postscale_factor=postscale_factor) for a in arrays]

    outs = numpy_op(name, fn, tensors, [t.dtype for t in tensors], set_id=set_id)
    for out, t in zip(outs, tensors):
        out.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]))
    return outs


def _reducescatter_grad(dys: Sequence[Any], op: ReduceOp, prescale_factor: float,
                        postscale_factor: float, name: str, set_id: int) -> list[Any]:
    """Horovod's gradient of a (grouped) reducescatter (``_reducescatter_grad`` in
    horovod/tensorflow/mpi_ops.py): every rank's output gradients gathered, times the
    size for Sum and times the pre- and postscale factors, one multiplication each,
    in the gradient's dtype.  The size is the one the gathers ran with."""
    def fn(comm: "ResilientComm", *arrays: np.ndarray) -> list[Any]:
        def attempt() -> list[Any]:
            gathered = [comm.allgather(a) for a in arrays]
            factors = ([comm.size] if op == Sum else []) + \
                [f for f in (prescale_factor, postscale_factor) if f != 1.0]
            for g in gathered:
                for factor in factors:
                    g *= g.dtype.type(factor)
            return gathered

        return comm.consistent(attempt)

    return numpy_op(name, fn, dys, [dy.dtype for dy in dys], set_id=set_id)


def reducescatter_tensors(tensors: Sequence[Any], op: ReduceOp, prescale_factor: float,
                          postscale_factor: float, name: str, set_id: int = 0) -> list[Any]:
    """Differentiable (grouped) reducescatter, gradients as Horovod's."""
    prescale_factor, postscale_factor = _attribute(prescale_factor), _attribute(postscale_factor)
    if not _differentiable():
        return _reducescatter_raw(tensors, op, prescale_factor, postscale_factor, name, set_id)

    @tf.custom_gradient
    def scatter(*xs: Any) -> tuple[list[Any], Callable[..., list[Any]]]:
        ys = _reducescatter_raw(list(xs), op, prescale_factor, postscale_factor, name, set_id)

        def grad(*dys: Any) -> list[Any]:
            gathered = _reducescatter_grad(list(dys), op, prescale_factor, postscale_factor,
                                           name + "_grad", set_id)
            for g, x in zip(gathered, xs):
                g.set_shape(x.shape)
            return gathered
        return ys, grad

    return list(scatter(*tensors))


def _own(arrays: Sequence[np.ndarray], dense: int, op: ReduceOp) -> list[Any]:
    """What :func:`reduce_together` returns on a process that keeps its own tensors: the
    dense ones as they are, each sparse ``(values, indices)`` pair as if gathered from
    this process alone (Average: values in their true-division dtype, divided by 1)."""
    out = list(arrays[:dense])
    for k in range(dense, len(arrays), 2):
        values = arrays[k]
        if op == Average:
            values = values.astype(reducer.true_division_dtype(values.dtype))
        out += [values, arrays[k + 1]]
    return out
