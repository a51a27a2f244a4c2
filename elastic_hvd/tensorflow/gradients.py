"""Averaging gradients across ranks: DistributedOptimizer and DistributedGradientTape.

Both use one :class:`GradientReducer`, so the optimizer path (``model.fit``) and the
tape path (custom loops) reduce gradients identically: dense gradients in as few
fused collectives as the fusion threshold allows, ``IndexedSlices`` gathered (or
densified with ``sparse_as_dense``), local variables left alone.
"""

import functools
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NoReturn, Self

import tensorflow as tf

from . import ops
from .compression import Compression, Compressor
from ..core.ops import Adasum, Average, Sum
from .collectives import NO_SET_ADASUM, NO_SPARSE_ADASUM
from .ops import ProcessSet, global_process_set


class GradientReducer:
    def __init__(self, compression: type[Compressor] = Compression.none,
                 sparse_as_dense: bool = False, op: int = Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 groups: int | Sequence[Sequence[Any]] | None = None,
                 process_set: ProcessSet = global_process_set,
                 scale_local_gradients: bool = True) -> None:
        #: The process set the gradients are reduced over; a step on a non-global set does
        #: not commit the training session (that says "every live rank's gradients").
        self.set_id = ops.check_process_set(process_set)
        self.op = ops.resolve_op(op, None)
        if self.op == Adasum and self.set_id != 0:
            raise NotImplementedError(NO_SET_ADASUM)
        if self.op not in (Average, Sum, Adasum):
            raise ValueError("gradients can be reduced with Average, Sum or Adasum, not "
                             f"{self.op.name}")
        if gradient_predivide_factor != 1.0 and self.op is not Average:
            raise ValueError("gradient_predivide_factor needs op=Average")
        # As Horovod 0.28: ``groups`` is a number of groups or a list of lists of
        # variables; ``num_groups`` is its deprecated name, used when groups is None.
        if num_groups:
            warnings.warn("Parameter `num_groups` has been replaced by `groups`",
                          DeprecationWarning, stacklevel=3)
            if groups is None:
                groups = num_groups
        if isinstance(groups, int):
            if groups <= 0:
                raise ValueError("groups should be a non-negative integer or a list of list "
                                 f"of tf.Variable, not {groups}")
            num_groups, groups = groups, None
        else:
            num_groups = 0
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.predivide = float(gradient_predivide_factor)
        self.num_groups = num_groups
        self.groups: Sequence[Sequence[Any]] | None = groups
        self.scale_local_gradients = scale_local_gradients
        self.local_vars: set[int] = set()
        #: The gradients the optimizer's ``_compute_gradients`` returned last (already
        #: reduced): ``apply_gradients`` given these very tensors does not reduce again.
        self.computed: list[Any] | None = None

    def register_local_var(self, var: Any) -> None:
        """Gradients of ``var`` stay local (not averaged across ranks)."""
        self.local_vars.add(id(var))

    def __call__(self, grads: Iterable[Any], variables: Iterable[Any] | None = None) -> list[Any]:
        """Reduce one step's gradients in one step transaction (see
        :func:`.ops.reduce_together`): all of them come from the same ranks."""
        grads = list(grads)
        variables = list(variables) if variables is not None else [None] * len(grads)
        out = list(grads)
        dense, sparse = [], []
        for i, (g, v) in enumerate(zip(grads, variables)):
            if g is None:
                continue
            if v is not None and id(v) in self.local_vars:
                if self.scale_local_gradients:
                    out[i] = g / tf.cast(ops.size_op(self.set_id), g.dtype)
                continue
            if isinstance(g, tf.IndexedSlices):
                if not self.sparse_as_dense:
                    if self.op == Adasum:
                        raise NotImplementedError(NO_SPARSE_ADASUM)
                    sparse.append(i)
                    continue
                grads[i] = tf.convert_to_tensor(g)
            dense.append(i)
        groups = self._partition(dense, variables)
        compressed = {i: self.compression.compress(grads[i]) for i in dense}
        reduced, gathered = ops.reduce_together(
            [[compressed[i][0] for i in group] for group in groups],
            [(grads[i].values, grads[i].indices) for i in sparse], self.op,
            prescale_factor=1.0 / self.predivide, postscale_factor=self.predivide, commit=True,
            set_id=self.set_id, own_outside=True)
        for group, results in zip(groups, reduced):
            for i, r in zip(group, results):
                out[i] = self.compression.decompress(r, compressed[i][1])
        for i, (values, indices) in zip(sparse, gathered):
            out[i] = tf.IndexedSlices(values, indices, dense_shape=grads[i].dense_shape)
        return out

    def _partition(self, indices: list[int], variables: Sequence[Any]) -> list[list[int]]:
        if self.groups is not None:
            position: dict[int, int] = {}
            for k, group in enumerate(self.groups):
                for v in group:
                    position[id(v)] = k
            parts: dict[int, list[int]] = {}
            for i in indices:
                v = variables[i]
                key = position.get(id(v), len(self.groups) + i) if v is not None else i
                parts.setdefault(key, []).append(i)
            return [parts[k] for k in sorted(parts)]
        if self.num_groups > 1:
            n = self.num_groups
            return [p for p in (indices[k::n] for k in range(n)) if p]
        return [indices] if indices else []


_REDUCER_KWARGS = ("compression", "sparse_as_dense", "op", "gradient_predivide_factor",
                   "num_groups", "groups", "process_set", "scale_local_gradients")


class LocalAccumulator:
    """``backward_passes_per_step``: sum gradients locally, reduce and apply every N-th
    pass.  It is also the optimizer's ``_agg_helper``, with the interface of Horovod's
    LocalGradientAggregationHelper(Eager): ``counter`` (passes since the last
    reduction, back to 0 at each), ``compute_gradients`` and ``apply_gradients``.

    The accumulators are created once, outside any graph (``tf.init_scope``); the
    N-th pass is chosen by the counter variable, so a compiled step keeps working.
    Ranks step in lockstep, so every rank reduces on the same pass.
    """

    #: Per variable, the TF variable summing its gradients (None for a variable with no
    #: gradient), and the count of passes: created at the first pass (None before).
    sums: Any
    counter: Any

    def __init__(self, passes: int, average: bool) -> None:
        self.passes, self.average = int(passes), average
        self.backward_passes_per_step, self.average_aggregated_gradients = self.passes, average
        self.sums = self.counter = None

    def _accumulate(self, grads: Sequence[Any], variables: Sequence[Any]) -> None:
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        if self.sums is None:
            with tf.init_scope():
                self.counter = tf.Variable(0, dtype=tf.int64, trainable=False)
                self.sums = [None if g is None else
                             tf.Variable(tf.zeros(v.shape, g.dtype), trainable=False)
                             for g, v in zip(grads, variables)]
        added = [total.assign_add(g) for total, g in zip(self.sums, grads) if g is not None]
        # Count the pass only once its gradients exist: without the dependence, TF
        # runs the increment even when the step has no data (Keras' probe at the end
        # of an epoch of unknown length), a phantom pass per epoch (docs/measurements.md).
        with tf.control_dependencies(added):
            self.counter.assign_add(1)

    def _scaled(self) -> list[Any]:
        scale = 1.0 / self.passes if self.average else 1.0
        return [None if t is None else t.read_value() * tf.cast(scale, t.dtype)
                for t in self.sums]

    def _clear(self) -> None:
        for total in self.sums:
            if total is not None:
                total.assign(tf.zeros_like(total))
        self.counter.assign(0)

    def _when_due(self, flush: Callable[[], Any], otherwise: Callable[[], Any]) -> Any:
        due = tf.equal(self.counter, self.passes)
        if tf.executing_eagerly():
            return flush() if bool(due) else otherwise()
        return tf.cond(due, flush, otherwise)

    def __call__(self, grads: Sequence[Any], variables: Sequence[Any],
                 update: Callable[[list[Any]], Any]) -> None:
        """The apply path: accumulate; on the N-th pass, ``update`` (reduce and apply)
        the sums and clear them."""
        self._accumulate(grads, variables)

        def flush() -> Any:
            update(self._scaled())
            self._clear()
            return tf.constant(True)

        self._when_due(flush, lambda: tf.constant(False))

    def compute_gradients(self, grads: Sequence[Any], variables: Sequence[Any],
                          reduce: Callable[[list[Any]], list[Any]]) -> list[Any]:
        """Horovod's helper's: accumulate; return the local sums so far, or on the
        N-th pass the sums (divided by N with ``average_aggregated_gradients``)
        ``reduce``d across ranks, and clear them."""
        self._accumulate(grads, variables)
        present = [i for i, t in enumerate(self.sums) if t is not None]

        def flush() -> list[Any]:
            scaled = self._scaled()
            reduced = reduce(scaled)
            out = [reduced[i] for i in present]
            with tf.control_dependencies(out):
                self._clear()
                return [tf.identity(r) for r in out]

        def local() -> list[Any]:
            return [self.sums[i].read_value() for i in present]

        values = self._when_due(flush, local)
        result: list[Any] = [None] * len(self.sums)
        for i, value in zip(present, values):
            result[i] = value
        return result

    def apply_gradients(self, apply: Callable[[], Any], optimizer: Any) -> Any:
        """Horovod's helper's: ``apply`` right after a reduction (the counter back at
        0), otherwise only count the optimizer's iteration."""
        def applied() -> Any:
            apply()
            return tf.constant(True)

        def counted() -> Any:
            if getattr(optimizer, "iterations", None) is not None:
                optimizer.iterations.assign_add(1)
            return tf.constant(False)

        if tf.executing_eagerly():
            return applied() if int(self.counter) == 0 else counted()
        return tf.cond(tf.equal(self.counter, 0), applied, counted)


def _update(optimizer: Any, grads: list[Any], variables: list[Any],
            apply: Callable[[list[Any]], Any]) -> Any:
    """Reduce ``grads`` (after local accumulation, if any) and ``apply`` them; gradients
    that ``_compute_gradients`` returned (reduced already) are applied as Horovod's
    wrapper applies them: at once, or with ``backward_passes_per_step`` only on the
    pass that reduced them (the others count an iteration)."""
    computed, optimizer._hvd_reducer.computed = optimizer._hvd_reducer.computed, None
    if computed is not None and len(computed) == len(grads) \
            and all(g is c for g, c in zip(grads, computed)):
        if optimizer._hvd_accumulator is None:
            return apply(grads)
        return optimizer._hvd_accumulator.apply_gradients(lambda: apply(grads), optimizer)

    def reduce_and_apply(local_grads: list[Any]) -> Any:
        return apply(optimizer._hvd_reducer(local_grads, variables))

    if optimizer._hvd_accumulator is None:
        return reduce_and_apply(grads)
    return optimizer._hvd_accumulator(grads, variables, reduce_and_apply)


def _agg_helper(self: Any) -> "LocalAccumulator | None":
    """Horovod's local gradient aggregation helper: None without
    ``backward_passes_per_step`` > 1, as in Horovod; else the :class:`LocalAccumulator`
    (Horovod's helper's ``counter``, ``compute_gradients`` and ``apply_gradients``)."""
    return self._hvd_accumulator


def _compute_gradients_of(base: Any) -> Callable[..., list[tuple[Any, Any]]]:
    """Horovod's Keras wrapper's ``_compute_gradients`` for subclasses of ``base``."""
    def _compute_gradients(self: Any, loss: Any, var_list: Any, grad_loss: Any = None,
                           tape: Any = None) -> list[tuple[Any, Any]]:
        """This rank's gradients of ``loss`` (the optimizer's own way), reduced across
        ranks as ``apply_gradients`` reduces them -- one step transaction -- and, with
        ``backward_passes_per_step`` > 1, accumulated as Horovod's helper does (the
        local sums on the other passes).  Given back to ``apply_gradients``, they are
        applied without a second reduction."""
        tape = tf.GradientTape() if tape is None else tape
        if hasattr(base, "_compute_gradients"):
            pairs = base._compute_gradients(self, loss, var_list, grad_loss, tape=tape)
        elif hasattr(base, "compute_gradients"):
            pairs = base.compute_gradients(self, loss, var_list, tape=tape)
        else:  # Keras 3: no gradient method of its own
            pairs = _tape_gradients(loss, var_list, tape)
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        if self._hvd_accumulator is None:
            reduced = self._hvd_reducer(grads, variables)
        else:
            reduced = self._hvd_accumulator.compute_gradients(
                grads, variables, lambda local: self._hvd_reducer(local, variables))
        self._hvd_reducer.computed = list(reduced)
        return list(zip(reduced, variables))
    return _compute_gradients


def _tape_gradients(loss: Any, var_list: Any, tape: Any) -> list[tuple[Any, Any]]:
    """``[(gradient, variable)]`` of ``loss`` (a tensor recorded on ``tape``, or a
    callable) for ``var_list`` (a list, or a callable giving one)."""
    if callable(loss):
        with tape:
            value = loss()
    else:
        value = loss
    variables = list(var_list() if callable(var_list) else var_list)
    return list(zip(tape.gradient(value, variables), variables))


def _no_averaged_gradients(name: str) -> NotImplementedError:
    return NotImplementedError(
        f"DistributedOptimizer.{name}, which returns allreduced gradients in Horovod, is "
        "not provided with Keras 3 optimizers, which have no get_gradients(): compute "
        "gradients with compute_gradients() or a tf.GradientTape "
        "(hvd.DistributedGradientTape to see them averaged), or call minimize()")


def _refused_get_gradients(self: Any, loss: Any, params: Any) -> NoReturn:
    """Not provided (Keras 3), see :func:`_no_averaged_gradients`."""
    raise _no_averaged_gradients("get_gradients")


@functools.cache  # one subclass per optimizer class, however many optimizers are wrapped
def _distributed_class(base: Any) -> Any:
    """A subclass of ``base`` (same name, module and config) that averages gradients."""
    body: dict[str, Any]
    body = {"_hvd_distributed": True, "_hvd_accumulator": None,
            "register_local_var": lambda self, var: self._hvd_reducer.register_local_var(var),
            "_agg_helper": property(_agg_helper)}
    if not issubclass(base, tf.compat.v1.train.Optimizer):  # Keras, as Horovod's wrapper
        body["_compute_gradients"] = _compute_gradients_of(base)
        # Horovod's public ones too, where the optimizer lacks them (Keras 3); where it
        # has them they give this rank's gradients, and apply_gradients() averages.
        if not hasattr(base, "compute_gradients"):
            def reduced_gradients(self: Any, loss: Any, var_list: Any,
                                  tape: Any = None) -> list[tuple[Any, Any]]:
                """Horovod's: ``_compute_gradients`` (reduced gradients)."""
                return self._compute_gradients(loss, var_list, None, tape)
            body["compute_gradients"] = reduced_gradients
        if not hasattr(base, "get_gradients"):
            body["get_gradients"] = _refused_get_gradients
        if hasattr(base, "_compute_gradients"):  # tf_keras' legacy ones minimize() with it
            def minimize(self: Any, loss: Any, var_list: Any, grad_loss: Any = None,
                         name: str | None = None, tape: Any = None) -> Any:
                pairs = base._compute_gradients(self, loss, var_list=var_list,
                                                grad_loss=grad_loss, tape=tape)
                return self.apply_gradients(pairs, name=name)
            body["minimize"] = minimize
    if hasattr(base, "stateless_apply"):  # Keras 3: model.fit calls apply()
        def apply(self: Any, grads: Iterable[Any], trainable_variables: Any = None) -> Any:
            variables = list(self._trainable_variables if trainable_variables is None
                             else trainable_variables)
            if not self.built:  # build outside the accumulator's tf.cond
                self.build(variables)
                self.built = True
            return _update(self, list(grads), variables,
                           lambda g: base.apply(self, g, trainable_variables))
        body["apply"] = apply
    elif issubclass(base, tf.compat.v1.train.Optimizer):  # TF1-style optimizers
        def compute_gradients(self: Any, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
            pairs = base.compute_gradients(self, *args, **kwargs)
            grads = self._hvd_reducer([g for g, _ in pairs], [v for _, v in pairs])
            return list(zip(grads, [v for _, v in pairs]))
        body["compute_gradients"] = compute_gradients
    else:  # tf_keras / Keras 2 optimizers
        def apply_gradients(self: Any, grads_and_vars: Iterable[tuple[Any, Any]], *args: Any,
                            **kwargs: Any) -> Any:
            pairs = list(grads_and_vars)
            variables = [v for _, v in pairs]
            return _update(self, [g for g, _ in pairs], variables,
                           lambda g: base.apply_gradients(self, list(zip(g, variables)),
                                                          *args, **kwargs))
        body["apply_gradients"] = apply_gradients
    cls = type(base.__name__, (base,), body)
    cls.__module__, cls.__qualname__ = base.__module__, base.__qualname__
    return cls


def DistributedOptimizer(optimizer: Any, name: str | None = None, use_locking: bool = False,
                         device_dense: str = "", device_sparse: str = "",
                         compression: type[Compressor] = Compression.none,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1,
                         op: int = Average, gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: int | Sequence[Sequence[Any]] | None = None,
                         process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wrap a Keras (3 or 2/tf_keras) or TF1 optimizer so that it averages gradients.

    The wrapper is a subclass with the optimizer's own class name, module and
    config: a model saved with it loads without elastic_hvd.
    """
    if int(backward_passes_per_step) < 1:
        raise ValueError("backward_passes_per_step must be at least 1")
    if ops.resolve_op(op, None) == Adasum and average_aggregated_gradients:
        raise ValueError("Adasum does not support average_aggregated_gradients == True")
    reducer = GradientReducer(compression, sparse_as_dense, op, gradient_predivide_factor,
                              num_groups, groups, process_set, scale_local_gradients)
    if getattr(optimizer, "_hvd_distributed", False):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    cls = _distributed_class(type(optimizer))  # type: ignore[arg-type]  # (mypy: not Hashable)
    if issubclass(cls, tf.compat.v1.train.Optimizer):
        wrapped = cls.__new__(cls)
        wrapped.__dict__.update(optimizer.__dict__)
        wrapped._optimizer = optimizer  # Horovod's TF1 wrapper holds it there (its tests read it)
    else:
        wrapped = cls.from_config(optimizer.get_config())
    wrapped._hvd_reducer = reducer
    if backward_passes_per_step > 1:
        if issubclass(cls, tf.compat.v1.train.Optimizer):
            raise NotImplementedError("backward_passes_per_step > 1 needs a Keras optimizer")
        wrapped._hvd_accumulator = LocalAccumulator(backward_passes_per_step,
                                                    average_aggregated_gradients)
    return wrapped


def distribute_in_place(optimizer: Any,
                        compression: type[Compressor] = Compression.none) -> Any:
    """Make an optimizer that already holds state (a loaded model's) average its
    gradients, keeping its variables: its class becomes the distributed subclass."""
    if not getattr(optimizer, "_hvd_distributed", False):
        optimizer.__class__ = _distributed_class(type(optimizer))  # type: ignore[arg-type]
        optimizer._hvd_reducer = GradientReducer(compression=compression)
    return optimizer


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape``: ``gradient()`` returns gradients averaged across ranks."""

    def __init__(self, gradtape: Any, device_dense: str = "", device_sparse: str = "",
                 compression: type[Compressor] = Compression.none, sparse_as_dense: bool = False,
                 op: int = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 groups: int | Sequence[Sequence[Any]] | None = None,
                 process_set: ProcessSet = global_process_set,
                 scale_local_gradients: bool = True) -> None:
        self._tape = gradtape
        self._reducer = GradientReducer(compression, sparse_as_dense, op,
                                        gradient_predivide_factor, num_groups, groups,
                                        process_set, scale_local_gradients)

    def __enter__(self) -> Self:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> bool | None:
        return self._tape.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tape, name)

    def register_local_source(self, source: Any) -> None:
        self._reducer.register_local_var(source)

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 use_generic_names: bool = False, **kwargs: Any) -> Any:
        """The tape's gradients, averaged across ranks (registered local sources' only
        scaled, see ``scale_local_gradients``).  ``use_generic_names`` (Horovod's names
        of its ops) changes nothing here; ``kwargs`` go to ``tf.GradientTape.gradient``."""
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        flat = tf.nest.flatten(grads)
        reduced = self._reducer(flat, tf.nest.flatten(sources))
        return tf.nest.pack_sequence_as(grads, reduced)

    def get_local_and_global_gradients(
            self, target: Any, sources: Iterable[Any], output_gradients: Any = None,
            use_generic_names: bool = False,
    ) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
        """:meth:`gradient`, split as Horovod splits it: ``([(source, gradient)] of the
        registered local sources, [(source, gradient)] of the others)``, in the order of
        ``sources``."""
        sources = list(sources)
        pairs = zip(sources, self.gradient(target, sources, output_gradients))
        local: list[tuple[Any, Any]]
        shared: list[tuple[Any, Any]]
        local, shared = [], []
        for source, grad in pairs:
            (local if id(source) in self._reducer.local_vars else shared).append((source, grad))
        return local, shared


def PartialDistributedGradientTape(gradtape: Any, device_dense: str = "", device_sparse: str = "",
                                   compression: type[Compressor] = Compression.none,
                                   sparse_as_dense: bool = False, op: int = Average,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                                   groups: int | Sequence[Sequence[Any]] | None = None,
                                   process_set: ProcessSet = global_process_set,
                                   local_layers: Iterable[Any] | None = None,
                                   scale_local_gradients: bool = True) -> DistributedGradientTape:
    """A DistributedGradientTape whose ``local_layers`` keep their gradients local."""
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    for layer in local_layers or []:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape
