"""Horovod's ``horovod.torch.functions``: broadcasting a model's parameters, an
optimizer's state and Python objects, and gathering objects."""

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from .mpi_ops import ProcessSet, check_process_set, global_process_set, run, to_numpy, to_tensor


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Write ``root_rank``'s tensors into every rank's: ``params`` is a ``state_dict()``
    (its tensors, by sorted name) or a list of tensors or ``(name, tensor)`` pairs, as
    ``model.named_parameters()`` gives.  One transaction: tensors of one dtype travel in
    one buffer.  If the root is lost during it, the lowest survivor's tensors are used."""
    if isinstance(params, dict):
        pairs = sorted(params.items())
    elif isinstance(params, Iterable):
        pairs = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    tensors = [p for _, p in pairs if isinstance(p, torch.Tensor)]
    if not tensors:
        return
    by_dtype: dict[np.dtype, list[tuple[torch.Tensor, np.ndarray]]] = {}
    for t in tensors:
        a = to_numpy(t)
        by_dtype.setdefault(a.dtype, []).append((t, a))

    def fn(comm: Any) -> list[tuple[list[torch.Tensor], np.ndarray, list[np.ndarray], bool]]:
        def attempt() -> list[tuple[list[torch.Tensor], np.ndarray, list[np.ndarray], bool]]:
            out = []
            ids = comm.ids
            for members in by_dtype.values():
                arrays = [a for _, a in members]
                buffer = np.concatenate([a.reshape(-1) for a in arrays]) if len(arrays) > 1 \
                    else arrays[0].reshape(-1)
                result = comm.broadcast(buffer, root_rank=root_rank,
                                        shapes=[a.shape for a in arrays])
                was_root = comm.root_id(ids, root_rank) == comm.original_id
                out.append(([t for t, _ in members], result, arrays, was_root))
            return out
        return comm.consistent(attempt)

    with torch.no_grad():
        for members, result, arrays, was_root in run("HorovodBroadcastParameters", fn):
            if was_root:
                continue  # its own values
            start = 0
            for t, a in zip(members, arrays):
                t.copy_(to_tensor(result[start:start + a.size].reshape(a.shape), t))
                start += a.size


def broadcast_optimizer_state(optimizer: Any, root_rank: int, model: Any = None) -> None:
    """Give every rank ``root_rank``'s optimizer state and options (learning rate,
    momentum, ...): its ``state_dict()``, loaded on the others.  ``model`` is accepted
    for Horovod's signature and not needed.  A ``DistributedOptimizer`` first scales its
    rate for the membership changes it has not followed yet, and the others take the
    root's rate as following the same ones (a rank that joined: those before it joined)."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    follow = getattr(optimizer, "_hvd_follow_size", None)
    seen = follow() if follow is not None else None
    local = optimizer.state_dict()
    state = broadcast_object(local, root_rank, name="HorovodOptimizerState")
    if state is not local:  # the root gets its own object back
        optimizer.load_state_dict(state)
        if seen is not None:  # a change during the broadcast: followed later, as the root's
            optimizer._hvd_seen = seen


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Any picklable ``obj`` of ``root_rank`` on every rank (the lowest survivor's if the
    root is lost during the call)."""
    check_process_set(process_set)
    return run(name or "HorovodBroadcastObject",
               lambda comm: comm.broadcast_object(obj, root_rank))


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every live rank's picklable ``obj``, in rank order."""
    return run(name or "HorovodAllgatherObject", lambda comm: comm.allgather_object(obj))
