"""Horovod's ``DistributedOptimizer`` for PyTorch: gradients averaged across the live
ranks, every reduction of one ``step()`` in one step transaction.

Gradient hooks (``register_post_accumulate_grad_hook``) count each parameter's backward
passes as Horovod's do (``backward_passes_per_step``, the same errors); the reduction
itself runs in :meth:`synchronize` (called by ``step()``): all of the step's gradients,
fused into as few buffers as the fusion threshold allows (each of ``groups`` fused
separately), in one call of the core's :func:`~elastic_hvd.core.reducer.reduce_step`,
the step transaction -- a rank lost anywhere inside it makes the survivors redo all of
it with the same local gradients, so a step never mixes two memberships, and its end
commits the step (``runtime.session().step``).  Horovod overlaps each gradient's
allreduce with the rest of the backward pass; here the step's reductions start once the
backward pass is over (the price of redoing the whole step as one).

The learning rate follows the live size (``lr_policy``, :mod:`elastic_hvd.lr_policy`):
each membership change since the optimizer was made scales every parameter group's
``lr`` by the policy's factor (``"linear"`` by default: new size / old size; a group's
own ``"lr_policy"`` key overrides the optimizer's), applied in ``step()`` after the
reduction and before the update, so the update that follows a change uses the rate for
the new size -- alike on every rank, as the events are.  The change's announcement says
so (``core.announce.effect("lr", ...)``).  ``broadcast_optimizer_state`` applies what is
pending before sending the root's rate, so a rank that joins takes over the rate for the
size it joins.
"""

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from .. import lr_policy as _lr_policy
from ..common.util import split_list
from ..core import announce, faults, reducer, runtime
from ..core.ops import Average, check_op
from .compression import Compression, Compressor
from .data import data_state, weightless_step
from .mpi_ops import ProcessSet, check_process_set, global_process_set, run, to_numpy, to_tensor

#: The learning-rate policies of DistributedOptimizer (constant_global_batch is Keras's:
#: it needs the data layer's batch size).
LR_POLICIES = ("linear", "sqrt", "none")

#: Name of the step transaction in the core's messages.
GRADIENTS = "HorovodGradients"


class _DistributedOptimizer:
    """Put before the wrapped optimizer's class (a class made per optimizer by
    :func:`DistributedOptimizer`): ``super()`` is that class."""

    _hvd_params: list[torch.Tensor]
    _hvd_groups: list[list[int]]
    #: Backward passes left before the reduction, by ``id`` of the parameter (a tensor's
    #: own hash is a Python call: measurable per parameter and pass).
    _hvd_delay: dict[int, int]
    _hvd_pending: set[int]
    #: The policy by which each membership change scales the learning rate.
    _hvd_lr_policy: str
    #: How many of the communicator's membership events the rate has followed.
    _hvd_seen: int

    def _hvd_setup(self, named_parameters: Any, compression: type[Compressor],
                   backward_passes_per_step: int, op: int, gradient_predivide_factor: float,
                   groups: Any, sparse_as_dense: bool, process_set: ProcessSet,
                   lr_policy: str = "linear") -> None:
        param_groups: list[dict[str, Any]] = self.param_groups  # type: ignore[attr-defined]
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [(f"allreduce.noname.{i}.{j}", v)
                                for i, group in enumerate(param_groups)
                                for j, v in enumerate(group["params"])]
        if any(not isinstance(p, tuple) for p in named_parameters):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                             "usually produced by model.named_parameters().")
        dups = self.find_duplicates([k for k, _ in named_parameters])
        if dups:
            raise ValueError("Parameter names in named_parameters must be unique. "
                             f"Found duplicates: {', '.join(sorted(dups))}")
        all_ids = {id(v) for group in param_groups for v in group["params"]}
        unnamed = all_ids - {id(v) for _, v in named_parameters}
        if unnamed:
            raise ValueError("named_parameters was specified, but one or more model parameters "
                             f"were not named. Python object ids: {', '.join(map(str, unnamed))}")
        self._parameter_names = {v: k for k, v in named_parameters}
        self._compression = compression
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.op = op
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._synchronized = False
        self._should_synchronize = True
        self._hvd_params = [p for group in param_groups for p in group["params"]
                            if p.requires_grad]
        self._hvd_groups = self._hvd_partition(groups)
        self._hvd_delay = {id(p): self.backward_passes_per_step for p in self._hvd_params}
        self._hvd_pending = set()
        self._hvd_hooks = [p.register_post_accumulate_grad_hook(self._hvd_hook)
                           for p in self._hvd_params]
        self._hvd_lr_policy = _lr_policy.check(lr_policy, LR_POLICIES)
        for group in param_groups:
            if "lr_policy" in group:
                _lr_policy.check(group["lr_policy"], LR_POLICIES)
        # The rate given is the one for the size now: only later changes scale it.
        self._hvd_seen = len(runtime.current().events) if runtime.is_initialized() else 0
        policy = self._hvd_lr_policy
        announce.effect("lr", lambda event: _lr_policy.describe(
            policy, event, "at the optimizer's next update"))

    def _hvd_follow_size(self) -> int:
        """Scale each group's ``lr`` for the membership changes not followed yet (see
        the module doc); the number of changes followed."""
        if not runtime.is_initialized():
            return self._hvd_seen
        events = runtime.current("DistributedOptimizer").events
        for event in events[self._hvd_seen:]:
            for group in self.param_groups:  # type: ignore[attr-defined]
                factor = _lr_policy.scale_factor(group.get("lr_policy", self._hvd_lr_policy),
                                                 event.old_size, event.new_size)
                if factor != 1.0:
                    group["lr"] = group["lr"] * factor
        self._hvd_seen = len(events)
        return self._hvd_seen

    def _hvd_partition(self, groups: Any) -> list[list[int]]:
        """Indices of the parameters per fused group: all in one without ``groups``;
        else formed as Horovod forms them."""
        indices = list(range(len(self._hvd_params)))
        if groups is None:
            return [indices]
        if not (isinstance(groups, list) or groups > 0):
            raise ValueError("groups should be a non-negative integer or a list of list of "
                             "torch.Tensor.")
        position = {p: i for i, p in enumerate(self._hvd_params)}
        if isinstance(groups, list):
            seen: set[int] = set()
            for group in groups:
                for p in group:
                    if not isinstance(p, torch.Tensor):
                        raise ValueError("groups must consist of torch.Tensor.")
                    if id(p) in seen:
                        raise ValueError("A parameter can only appear once in groups.")
                    seen.add(id(p))
        # Horovod broadcasts rank 0's order of the parameters here; every rank builds the
        # same model, so its own order is rank 0's (shapes that differ fail the step's
        # signature check with a MismatchError), and construction stays free of collectives: a
        # process that joins a running job builds its optimizer before it joins.
        order = indices
        if isinstance(groups, list):
            parts = [[position[p] for p in group if p in position] for group in groups]
            grouped = {i for part in parts for i in part}
            parts += [[i] for i in order if i not in grouped]
        else:
            parts = [list(part) for part in split_list(order, groups)]
        return [part for part in parts if part]

    def _hvd_hook(self, p: torch.Tensor) -> None:
        """A backward pass gave ``p`` its gradient: count it (reduced in synchronize)."""
        key = id(p)
        if self._hvd_delay[key] <= 0:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call "
                "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
        self._hvd_delay[key] -= 1
        self._hvd_pending.add(key)

    @staticmethod
    def find_duplicates(lst: Sequence[Any]) -> set[Any]:
        seen, dups = set(), set()
        for el in lst:
            if el in seen:
                dups.add(el)
            seen.add(el)
        return dups

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        self._hvd_delay = dict.fromkeys(self._hvd_delay, passes)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._hvd_pending.clear()
        self._synchronized = False
        self._should_synchronize = True
        self._hvd_delay = dict.fromkeys(self._hvd_delay, self.backward_passes_per_step)
        super().load_state_dict(*args, **kwargs)  # type: ignore[misc]

    def synchronize(self) -> None:
        """Reduce every gradient of the step across the live ranks, in one step transaction
        (a parameter without a gradient contributes zeros, as in Horovod), and put the
        results in ``p.grad``."""
        if runtime.is_initialized():  # elastic-hvd-run --faults rank=R,step=N: before step N
            faults.at_step(runtime.session("DistributedOptimizer").step + 1)
        dense: list[list[tuple[torch.Tensor, torch.Tensor, Any]]] = []
        sparse: list[torch.Tensor] = []
        for group in self._hvd_groups:
            members = []
            for i in group:
                p = self._hvd_params[i]
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grad = p.grad
                if grad.is_sparse:
                    if not self.sparse_as_dense:
                        sparse.append(p)
                        continue
                    grad = grad.to_dense()
                compressed, ctx = self._compression.compress(grad)
                members.append((p, compressed, ctx))
            if members:
                dense.append(members)
        # A weightless filler batch (ElasticDataLoader, the end of an epoch) adds nothing.
        zero = weightless_step()
        arrays = [to_numpy(c) for members in dense for _, c, _ in members]
        if zero:
            arrays = [np.zeros_like(a) for a in arrays]
        for p in sparse:
            g = p.grad.coalesce()  # type: ignore[union-attr]
            values = to_numpy(g.values())
            arrays += [np.zeros_like(values) if zero else values,
                       to_numpy(g.indices().transpose(0, 1).contiguous())]
        average = self.op == Average
        prescale = 1.0 / self.gradient_predivide_factor if average else 1.0
        postscale = self.gradient_predivide_factor if average else 1.0
        sizes = [len(members) for members in dense]
        results = run(GRADIENTS, lambda comm: reducer.reduce_step(
            comm, *arrays, sizes=sizes, op=self.op, prescale_factor=prescale,
            postscale_factor=postscale, commit=True))
        with torch.no_grad():
            k = 0
            for members in dense:
                for p, compressed, ctx in members:
                    reduced = self._compression.decompress(to_tensor(results[k], compressed), ctx)
                    k += 1
                    dense_grad = p.grad
                    if dense_grad is None:
                        continue
                    if dense_grad.is_sparse:
                        dense_grad.zero_().add_(reduced.to_sparse())
                    elif dense_grad.device.type == "cpu" and reduced.dtype == dense_grad.dtype:
                        dense_grad.set_(reduced)  # the reduced buffer itself: no copy
                    else:
                        dense_grad.copy_(reduced)
            for p in sparse:
                values, indices = results[k], results[k + 1]
                k += 2
                sparse_grad = p.grad
                if sparse_grad is None:
                    continue
                gathered = torch.sparse_coo_tensor(
                    torch.from_numpy(np.ascontiguousarray(indices)).transpose(0, 1),
                    to_tensor(values, sparse_grad), sparse_grad.size(), check_invariants=False)
                sparse_grad.zero_().add_(gathered.to(sparse_grad.device))
        self._hvd_delay = dict.fromkeys(self._hvd_delay, self.backward_passes_per_step)
        self._hvd_pending.clear()
        self._synchronized = True
        if zero:
            data_state().weightless_step = False

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``optimizer.step()`` inside it does not synchronize (after an explicit
        ``optimizer.synchronize()``, e.g. to clip the reduced gradients)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        self._hvd_follow_size()  # a change inside the reduction: this update at the new size
        return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._hvd_pending:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(). This is "
                                 "prohibited as it can cause a race condition.")
        super().zero_grad(set_to_none)  # type: ignore[misc]


def DistributedOptimizer(optimizer: Any, named_parameters: Any = None,
                         compression: type[Compressor] = Compression.none,
                         backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Any = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set,
                         lr_policy: str = "linear") -> Any:
    """``optimizer`` (a ``torch.optim.Optimizer``) whose ``step()`` first averages the
    gradients across the live ranks (see the module's doc); its state, options and
    parameter groups are the wrapped optimizer's.  Arguments as Horovod 0.28's; op=Adasum
    raises NotImplementedError.  elastic_hvd's own: ``lr_policy``, how the learning rate
    follows the live size (``"linear"``, ``"sqrt"``, ``"none"``; a parameter group's
    ``"lr_policy"`` key overrides it for that group)."""
    _lr_policy.check(lr_policy, LR_POLICIES)
    check_process_set(process_set)
    op = check_op(op)
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed "
                      "in v0.23.0.", DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    base = type(optimizer)
    cls: Any = type(base.__name__, (_DistributedOptimizer, base), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    if hasattr(wrapped, "_patch_step_function"):  # torch's step hooks and profiling
        wrapped._patch_step_function()
    wrapped._hvd_setup(named_parameters, compression, backward_passes_per_step, op,
                       gradient_predivide_factor, groups, sparse_as_dense, process_set,
                       lr_policy)
    return wrapped
