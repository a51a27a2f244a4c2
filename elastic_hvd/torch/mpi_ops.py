"""Horovod's ``horovod.torch`` collectives over the resilient core.

A CPU tensor reaches MPI without a copy: the core is handed ``tensor.numpy()``, a numpy
view of the tensor's own memory, and a result comes back as ``torch.from_numpy`` of the
core's array, sharing it.  Tensors on another device (CUDA) are staged through host
memory (one copy each way): the core only moves host memory.  bfloat16, which numpy
lacks, travels as float32.

Each call is one resilient transaction of the core (:mod:`elastic_hvd.core.comm`): a
rank lost inside it makes the survivors redo it among themselves with the same inputs,
and everything that depends on the membership (the average's divisor, the broadcast's
root, the split of a reducescatter) is computed inside it.  The ``_async`` forms run
the collective when they are called (ranks must issue collectives in the same order,
which Horovod's scripts do) and return a handle whose :func:`synchronize` returns the
result, or raises the collective's error, as Horovod's does.
"""

import itertools
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import torch

from ..core import reducer, runtime
from ..core.errors import NO_PROCESS_SETS, RanksBelowMinimumError
from ..core.ops import Average, Max, Min, Product, ReduceOp, Sum, check_op
from .compression import Compression, Compressor

if TYPE_CHECKING:
    from ..core.comm import ResilientComm

#: What Horovod raises when a collective fails; here when too few ranks are left
#: (the errors every survivor gets alike: :mod:`elastic_hvd.core.errors`).
HorovodInternalError = RanksBelowMinimumError


# == process sets (only the global one) ==================================================
class ProcessSet:
    """A set of ranks.  Only the global set (all live ranks) is supported."""

    #: Horovod's fields: the set's id (0 for the global set), its ranks (None: all)
    #: and its MPI communicator (None: elastic_hvd makes none for a set).
    process_set_id: int | None = None
    ranks: list[int] | None = None
    mpi_comm: Any = None

    def __init__(self, ranks_or_comm: Iterable[int] | None = None) -> None:
        self.ranks = None if ranks_or_comm is None else list(ranks_or_comm)
        self.process_set_id = 0 if ranks_or_comm is None else None

    def size(self) -> int:
        return _comm().size

    def rank(self) -> int:
        return _comm().rank

    def included(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "ProcessSet(global)" if self.ranks is None else f"ProcessSet({self.ranks})"


global_process_set = ProcessSet()


def add_process_set(process_set: ProcessSet | Sequence[int]) -> NoReturn:
    """Always raises NotImplementedError: only the global process set is supported."""
    raise NotImplementedError(NO_PROCESS_SETS)


def remove_process_set(process_set: ProcessSet) -> NoReturn:
    """Always raises NotImplementedError: only the global process set is supported."""
    raise NotImplementedError(NO_PROCESS_SETS)


def check_process_set(process_set: ProcessSet) -> None:
    if process_set is not global_process_set and getattr(process_set, "ranks", None) is not None:
        raise NotImplementedError(f"{process_set!r}: {NO_PROCESS_SETS}")


def _comm() -> "ResilientComm":
    return runtime.current("a collective")


def handle_average_backwards_compatibility(op: int | None, average: bool | None) -> ReduceOp:
    """The ReduceOp meant by ``op=`` or the deprecated ``average=`` (Average if
    neither); Adasum raises NotImplementedError."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if op is None:
        op = Average if average is None or average else Sum
    return check_op(op)


# == tensors <-> numpy ===================================================================
def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """The array the core is given for ``tensor``: a view of its memory when it is a
    contiguous CPU tensor of a dtype numpy has (no copy), else a host copy."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t.numpy()


def to_tensor(array: Any, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor of ``array`` with ``like``'s dtype (or ``dtype``) and device: the array's
    own memory when on the CPU and of that dtype (the core's results are fresh arrays)."""
    a = np.asarray(array)
    if not a.flags.writeable:
        a = a.copy()
    t = torch.from_numpy(a)
    dtype = like.dtype if dtype is None else dtype
    if t.dtype != dtype:
        t = t.to(dtype)
    if like.device.type != "cpu":
        t = t.to(like.device)
    return t


# == a timeline (Horovod's start_timeline/stop_timeline) =================================
_timeline_lock = threading.Lock()
_timeline: dict[str, Any] = {"path": None, "events": []}
_EPOCH = time.perf_counter()


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record every collective from now on, for :func:`stop_timeline` to write to
    ``file_path`` (Chrome trace JSON); ``mark_cycles`` is ignored."""
    with _timeline_lock:
        _timeline.update(path=file_path, events=[])


def stop_timeline() -> None:
    """Write the recorded events: rank 0 writes, or every rank when the path contains
    ``{rank}``.  A no-op if no timeline was started."""
    with _timeline_lock:
        path, events = _timeline["path"], _timeline["events"]
        _timeline.update(path=None, events=[])
    if path is None:
        return
    rank = runtime.current().rank if runtime.is_initialized() else 0
    if "{rank}" in path:
        path = path.format(rank=rank)
    elif rank != 0:
        return
    with open(path + ".tmp", "w") as f:
        json.dump(events, f)
    os.replace(path + ".tmp", path)


def run(name: str, fn: Callable[["ResilientComm"], Any]) -> Any:
    """``fn(comm)`` on the live communicator, labelled ``name`` in the core's messages
    and recorded in the timeline."""
    comm = _comm()
    outer, comm.label = comm.label, name
    started = time.perf_counter()
    try:
        return fn(comm)
    finally:
        comm.label = outer
        if _timeline["path"] is not None:
            finished = time.perf_counter()
            with _timeline_lock:
                _timeline["events"].append({
                    "name": name, "cat": "collective", "ph": "X", "pid": os.getpid(),
                    "tid": 0, "ts": (started - _EPOCH) * 1e6,
                    "dur": (finished - started) * 1e6})


# == handles =============================================================================
#: handle -> (result, error): the ``_async`` calls ran when called.
_handles: dict[int, tuple[Any, BaseException | None]] = {}
_numbers = itertools.count(1)


def _submit(compute: Callable[[], Any]) -> int:
    """Run ``compute()`` now and keep its result (or error) for :func:`synchronize`."""
    handle = next(_numbers)
    try:
        _handles[handle] = (compute(), None)
    except (RuntimeError, ValueError) as exc:  # the collective's errors (core errors included)
        _handles[handle] = (None, exc)
    return handle


def poll(handle: int) -> bool:
    """Whether the operation of ``handle`` completed: always True (an ``_async`` call
    runs its collective before it returns)."""
    if handle not in _handles:
        raise ValueError(f"handle {handle} was not found (already synchronized?)")
    return True


def synchronize(handle: int) -> Any:
    """The result of the ``_async`` operation of ``handle`` (None for an unknown
    handle, as Horovod); raises the collective's error."""
    if handle not in _handles:
        return None
    result, error = _handles.pop(handle)
    if error is not None:
        raise error.with_traceback(None)
    return result


# == allreduce ===========================================================================
def _allreduce(tensors: Sequence[torch.Tensor], op: ReduceOp, prescale_factor: float,
               postscale_factor: float, name: str) -> list[np.ndarray]:
    arrays = [to_numpy(t) for t in tensors]
    if len(arrays) == 1:
        return [run(name, lambda comm: comm.allreduce(
            arrays[0], op=op, prescale_factor=prescale_factor,
            postscale_factor=postscale_factor))]
    return run(name, lambda comm: reducer.fused_allreduce(
        comm, arrays, op, prescale_factor, postscale_factor))


def _reduce_args(average: bool | None, op: int | None, process_set: ProcessSet) -> ReduceOp:
    check_process_set(process_set)
    return handle_average_backwards_compatibility(op, average)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: int | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start reducing ``tensor`` over the live ranks (default Average); a handle."""
    op = _reduce_args(average, op, process_set)
    return _submit(lambda: to_tensor(_allreduce([tensor], op, prescale_factor, postscale_factor,
                                                name or "HorovodAllreduce")[0], tensor))


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """As :func:`allreduce_async`, the result written into ``tensor``."""
    op = _reduce_args(average, op, process_set)

    def compute() -> torch.Tensor:
        result = _allreduce([tensor], op, prescale_factor, postscale_factor,
                            name or "HorovodAllreduce")[0]
        with torch.no_grad():
            tensor.copy_(to_tensor(result, tensor))
        return tensor
    return _submit(compute)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: int | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` in place; returns it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


class _Allreduce(torch.autograd.Function):
    """Grouped allreduce, differentiable: the gradient is the same reduction of the
    gradients (Sum/Average only, as Horovod)."""

    @staticmethod
    def forward(ctx: Any, op: ReduceOp, prescale_factor: float, postscale_factor: float,
                name: str, *tensors: torch.Tensor) -> Any:
        ctx.args = (op, prescale_factor, postscale_factor, name)
        results = _allreduce(tensors, op, prescale_factor, postscale_factor, name)
        return tuple(to_tensor(r, t) for r, t in zip(results, tensors))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        op, prescale_factor, postscale_factor, name = ctx.args
        if op in (Min, Max, Product):
            raise NotImplementedError(f"no gradient for allreduce with op {op.name}")
        reduced = _allreduce(grads, op, prescale_factor, postscale_factor, name + "_grad")
        return (None, None, None, None) + tuple(to_tensor(r, g) for r, g in zip(reduced, grads))


def _compressed_allreduce(tensors: Sequence[torch.Tensor], compression: type[Compressor],
                          op: ReduceOp, prescale_factor: float, postscale_factor: float,
                          name: str) -> list[torch.Tensor]:
    compressed = [compression.compress(t) for t in tensors]
    results = _Allreduce.apply(op, float(prescale_factor), float(postscale_factor), name,
                               *[c for c, _ in compressed])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(results, compressed)]


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op: int | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """``tensor`` reduced over the live ranks (default: averaged over the live size);
    differentiable.  The input is not modified."""
    op = _reduce_args(average, op, process_set)
    return _compressed_allreduce([tensor], compression, op, prescale_factor, postscale_factor,
                                 name or "HorovodAllreduce")[0]


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: int | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start reducing ``tensors`` together (fused, one transaction); a handle."""
    op = _reduce_args(average, op, process_set)
    tensors = list(tensors)
    return _submit(lambda: [to_tensor(r, t) for r, t in zip(_allreduce(
        tensors, op, prescale_factor, postscale_factor, name or "HorovodGroupedAllreduce"),
        tensors)])


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: int | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    """As :func:`grouped_allreduce_async`, each result written into its tensor."""
    op = _reduce_args(average, op, process_set)
    tensors = list(tensors)

    def compute() -> list[torch.Tensor]:
        results = _allreduce(tensors, op, prescale_factor, postscale_factor,
                             name or "HorovodGroupedAllreduce")
        with torch.no_grad():
            for t, r in zip(tensors, results):
                t.copy_(to_tensor(r, t))
        return tensors
    return _submit(compute)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: type[Compressor] = Compression.none,
                      op: int | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """``tensors`` reduced together (fused, one transaction); differentiable."""
    op = _reduce_args(average, op, process_set)
    return _compressed_allreduce(list(tensors), compression, op, prescale_factor,
                                 postscale_factor, name or "HorovodGroupedAllreduce")


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: int | None = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce ``tensors`` together, in place; returns them."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: int,
                           process_set: ProcessSet = global_process_set) -> Callable[[], Any]:
    """A sparse COO tensor's values and indices gathered from every rank (one
    transaction; Average divides the values by its size).  Returns a function that
    returns the gathered sparse tensor, as Horovod's does."""
    check_process_set(process_set)
    op = check_op(op)
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    indices = to_numpy(t.indices().transpose(0, 1).contiguous())
    values = to_numpy(t.values())

    def gather(comm: "ResilientComm") -> tuple[np.ndarray, np.ndarray, int]:
        return comm.consistent(lambda: (comm.allgather(values), comm.allgather(indices),
                                        comm.size))

    gathered_values, gathered_indices, size = run(name or "HorovodSparseAllreduce", gather)

    def result() -> torch.Tensor:
        v = to_tensor(gathered_values, t)
        if op == Average:
            v = v / size
        i = torch.from_numpy(np.ascontiguousarray(gathered_indices)).transpose(0, 1)
        return torch.sparse_coo_tensor(i.to(t.device), v, t.size(), check_invariants=False)
    return result


# == allgather ===========================================================================
def _gather(tensors: Sequence[torch.Tensor], name: str) -> tuple[list[np.ndarray], list[int],
                                                                  list[int]]:
    """Every rank's tensors concatenated, and this rank's first row and row count in
    each, all of one membership."""
    arrays = [to_numpy(t) for t in tensors]
    for a in arrays:
        if a.ndim == 0:
            raise ValueError("allgather needs a tensor with at least one dimension")

    def fn(comm: "ResilientComm") -> tuple[list[np.ndarray], list[int]]:
        def attempt() -> tuple[list[np.ndarray], list[int]]:
            out, starts = [], []
            for a in arrays:
                gathered, rows = comm.allgather(a, return_counts=True)
                out.append(gathered)
                starts.append(int(rows[:comm.rank].sum()))
            return out, starts
        return attempt() if len(arrays) == 1 else comm.consistent(attempt)

    gathered, starts = run(name, fn)
    return gathered, starts, [a.shape[0] for a in arrays]


class _Allgather(torch.autograd.Function):
    """Grouped allgather, differentiable: every rank's gradients averaged, this rank's
    rows kept (Horovod's gradient), where they were in the forward gather even if ranks
    were lost since."""

    @staticmethod
    def forward(ctx: Any, name: str, *tensors: torch.Tensor) -> Any:
        gathered, starts, rows = _gather(tensors, name)
        ctx.name, ctx.starts, ctx.rows = name, starts, rows
        return tuple(to_tensor(g, t) for g, t in zip(gathered, tensors))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        reduced = _allreduce(grads, Average, 1.0, 1.0, ctx.name + "_grad")
        return (None,) + tuple(to_tensor(r, g).narrow(0, s, n) for r, g, s, n
                               in zip(reduced, grads, ctx.starts, ctx.rows))


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start concatenating every rank's ``tensor`` along the first dimension; a handle."""
    check_process_set(process_set)
    return _submit(lambda: to_tensor(_gather([tensor], name or "HorovodAllgather")[0][0],
                                     tensor))


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension (sizes may differ);
    differentiable."""
    check_process_set(process_set)
    return _Allgather.apply(name or "HorovodAllgather", tensor)[0]


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start gathering each of ``tensors`` (one transaction); a handle."""
    check_process_set(process_set)
    tensors = list(tensors)
    return _submit(lambda: [to_tensor(g, t) for g, t in zip(
        _gather(tensors, name or "HorovodGroupedAllgather")[0], tensors)])


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Each of ``tensors`` gathered from every rank (one transaction); differentiable."""
    check_process_set(process_set)
    return list(_Allgather.apply(name or "HorovodGroupedAllgather", *tensors))


# == broadcast ===========================================================================
def _broadcast(tensor: torch.Tensor, root_rank: int, name: str) -> tuple[np.ndarray, bool]:
    """(``root_rank``'s tensor, whether this process was the root), of one membership;
    the root's own array comes back as it is."""
    array = to_numpy(tensor)

    def fn(comm: "ResilientComm") -> tuple[np.ndarray, bool]:
        ids = comm.ids
        result = comm.broadcast(array, root_rank=root_rank)
        return result, comm.root_id(ids, root_rank) == comm.original_id

    result, was_root = run(name, fn)
    return (result.copy() if result is array else result), was_root


class _Broadcast(torch.autograd.Function):
    """Broadcast, differentiable: the root of the forward pass gets the average of the
    gradients, the others zeros (Horovod's gradient)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str) -> Any:
        result, ctx.was_root = _broadcast(tensor, root_rank, name)
        ctx.name = name
        return to_tensor(result, tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = to_tensor(_allreduce([grad], Average, 1.0, 1.0, ctx.name + "_grad")[0], grad)
        return (reduced if ctx.was_root else torch.zeros_like(reduced)), None, None


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start broadcasting ``root_rank``'s ``tensor``; a handle (a new tensor)."""
    check_process_set(process_set)
    return _submit(lambda: to_tensor(_broadcast(tensor, root_rank,
                                                name or "HorovodBroadcast")[0], tensor))


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank (the lowest survivor's if the root is
    lost during the call), a new tensor; differentiable."""
    check_process_set(process_set)
    return _Broadcast.apply(tensor, int(root_rank), name or "HorovodBroadcast")


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """As :func:`broadcast_async`, the result written into ``tensor``."""
    check_process_set(process_set)

    def compute() -> torch.Tensor:
        result, was_root = _broadcast(tensor, root_rank, name or "HorovodBroadcast")
        if not was_root:
            with torch.no_grad():
                tensor.copy_(to_tensor(result, tensor))
        return tensor
    return _submit(compute)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """``root_rank``'s ``tensor`` written into ``tensor`` on every rank; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# == alltoall ============================================================================
def _alltoall(tensor: torch.Tensor, splits: Any, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    array = to_numpy(tensor)
    split_array: Any = None if splits is None else \
        np.asarray(splits.tolist() if isinstance(splits, torch.Tensor) else splits,
                   dtype=np.int64).reshape(-1)
    received, counts = run(name, lambda comm: comm.alltoall(array, splits=split_array))
    return to_tensor(received, tensor), torch.from_numpy(counts.astype(np.int32))


class _Alltoall(torch.autograd.Function):
    """Alltoall, differentiable: the gradient goes back the way the rows came."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str) -> Any:
        received, counts = _alltoall(tensor, splits, name)
        ctx.counts, ctx.name = counts, name
        ctx.mark_non_differentiable(counts)
        return received, counts

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *ignored: Any) -> Any:
        back, _ = _alltoall(grad.contiguous(), ctx.counts, ctx.name + "_grad")
        return back, None, None


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Start an alltoall; a handle whose result is ``(received, received_splits)``."""
    check_process_set(process_set)
    return _submit(lambda: _alltoall(tensor, splits, name or "HorovodAlltoall"))


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[i]`` rows of ``tensor`` to rank ``i`` (equal parts without
    ``splits``); returns the rows received and, with ``splits``, how many came from each
    rank (as Horovod 0.28).  Rows meant for a rank lost during the call are dropped."""
    check_process_set(process_set)
    received, counts = _Alltoall.apply(tensor, splits, name or "HorovodAlltoall")
    return received if splits is None else (received, counts)


# == reducescatter =======================================================================
def _reducescatter(tensors: Sequence[torch.Tensor], op: ReduceOp, prescale_factor: float,
                   postscale_factor: float, name: str) -> list[torch.Tensor]:
    arrays = [to_numpy(t) for t in tensors]

    def fn(comm: "ResilientComm") -> list[np.ndarray]:
        def attempt() -> list[np.ndarray]:
            return [comm.reducescatter(a, op=op, prescale_factor=prescale_factor,
                                       postscale_factor=postscale_factor) for a in arrays]
        return attempt() if len(arrays) == 1 else comm.consistent(attempt)

    return [to_tensor(r, t) for r, t in zip(run(name, fn), tensors)]


def _scatter_op(op: int | None, process_set: ProcessSet) -> ReduceOp:
    check_process_set(process_set)
    op = check_op(Average if op is None else op)
    if op not in (Average, Sum):
        raise ValueError(f"reducescatter supports op=Average or op=Sum, not {op.name}")
    return op


class _Reducescatter(torch.autograd.Function):
    """Grouped reducescatter, differentiable: every rank's output gradients gathered,
    times the size for Sum and the scale factors (Horovod's gradient)."""

    @staticmethod
    def forward(ctx: Any, op: ReduceOp, prescale_factor: float, postscale_factor: float,
                name: str, *tensors: torch.Tensor) -> Any:
        ctx.args = (op, prescale_factor, postscale_factor, name)
        return tuple(_reducescatter(tensors, op, prescale_factor, postscale_factor, name))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        op, prescale_factor, postscale_factor, name = ctx.args
        arrays = [to_numpy(g) for g in grads]

        def fn(comm: "ResilientComm") -> list[np.ndarray]:
            def attempt() -> list[np.ndarray]:
                gathered = [comm.allgather(a) for a in arrays]
                factor = (comm.size if op == Sum else 1) * prescale_factor * postscale_factor
                return [g * g.dtype.type(factor) if factor != 1 else g for g in gathered]
            return comm.consistent(attempt)

        gathered = run(name + "_grad", fn)
        return (None, None, None, None) + tuple(to_tensor(g, d) for g, d in zip(gathered, grads))


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int = Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Start a reducescatter; a handle."""
    op = _scatter_op(op, process_set)
    return _submit(lambda: _reducescatter([tensor], op, prescale_factor, postscale_factor,
                                          name or "HorovodReducescatter")[0])


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: type[Compressor] = Compression.none, op: int = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """``tensor`` reduced over the live ranks, rank ``i`` keeping the ``i``-th block of
    its first dimension (lower ranks take the extra rows); differentiable."""
    return grouped_reducescatter([tensor], name or "HorovodReducescatter", compression, op,
                                 process_set, prescale_factor, postscale_factor)[0]


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: int = Average, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Start a reducescatter of each of ``tensors`` (one transaction); a handle."""
    op = _scatter_op(op, process_set)
    tensors = list(tensors)
    return _submit(lambda: _reducescatter(tensors, op, prescale_factor, postscale_factor,
                                          name or "HorovodGroupedReducescatter"))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: type[Compressor] = Compression.none, op: int = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Each of ``tensors`` reduce-scattered (one transaction); differentiable."""
    op = _scatter_op(op, process_set)
    compressed = [compression.compress(t) for t in tensors]
    results = _Reducescatter.apply(op, float(prescale_factor), float(postscale_factor),
                                   name or "HorovodGroupedReducescatter",
                                   *[c for c, _ in compressed])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(results, compressed)]


# == join, barrier =======================================================================
def join(device: int = -1) -> int:
    """Every rank calls join() when it is done; returns the rank that joined last.

    Unlike Horovod, ranks that have not joined cannot keep running collectives against
    joined ones: such a collective raises MismatchError on every rank."""
    stamps = run("HorovodJoin", lambda comm: comm.allgather_object(time.time()))
    return int(np.argmax(stamps))


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every live rank reaches it (a rank lost meanwhile is not waited for)."""
    check_process_set(process_set)
    run("HorovodBarrier", lambda comm: comm.barrier())
