"""Growing back inside ``model.fit``: replacement and extra ranks start from the live state.

:class:`ElasticGrowth` runs the :class:`~elastic_hvd.growth_policy.GrowthPolicy`
at every step boundary.  The step at which joiners are adopted, the lowest rank
broadcasts the *live* training state -- a
:class:`~elastic_hvd.tensorflow.training_state.TrainingState`, the format
checkpoints and ``hvd.elastic`` use too: every model and optimizer variable, the
learning rate, momentum and session, the epoch, the sampler's position in it,
the growth policy's counters and the callbacks' live state -- and the joiners
start training at that very step: no disk checkpoint, no step lost or repeated.

Only callbacks with a live state (elastic_hvd's own: ``live_state()``) take part,
matched by position and class name: they must be the same on every rank, while
plain Keras callbacks may differ between ranks (Horovod's idiom gives
``ModelCheckpoint`` or ``CSVLogger`` to rank 0 alone).  A joiner whose list differs
fails at once, naming the first callback that differs.

Before the state leaves, the other membership callbacks settle the growth event
(the learning rate is rescaled back up, etc.), so a joiner receives the rate the
others will use for the step.  From then on the sampler splits the rest of the
epoch over the larger membership (see :mod:`elastic_hvd.sharding`).

A joining process runs the same script from the top; :func:`~keras_callbacks.fit_elastic`
calls :meth:`ElasticGrowth.join` before training.  Code before it must not run
collectives in a joiner (``if not comm.joining: ...``).
"""

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from elastic_hvd.core import ElasticHvdError, faults, runtime
from elastic_hvd.growth_policy import GrowthPolicy
from elastic_hvd.tensorflow.keras.callbacks import BroadcastGlobalVariablesCallback
from elastic_hvd.tensorflow.keras.replacement import rehearse
from elastic_hvd.tensorflow.training_state import TrainingState

if TYPE_CHECKING:
    from elastic_hvd.core.comm import ResilientComm
    from elastic_hvd.core.membership import MembershipEvent
    from elastic_hvd.sharding import ElasticSampler


class ElasticGrowth(tf.keras.callbacks.Callback):
    """Replace lost ranks / add ranks (``policy``, default: from ``elastic-hvd-run``'s
    ``--respawn`` / ``--max-np`` / ``--host-discovery-script``) and hand them the live state.

    ``sampler``: the :class:`~elastic_hvd.sharding.ElasticSampler` feeding the model.
    ``handovers`` lists ``(event, seconds)`` of every hand-over this rank took part in.
    """

    def __init__(self, sampler: "ElasticSampler", policy: GrowthPolicy | None = None) -> None:
        super().__init__()
        self.sampler = sampler
        self.policy = policy if policy is not None else GrowthPolicy.from_env()
        self.callbacks: list = []  # fit_elastic sets the callback list: their state travels too
        self.epoch = 0
        self.handovers: list[tuple["MembershipEvent | None", float]] = []
        self._skip_next = False

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._skip_next:  # a joiner at its first step: the others are at this point already
            self._skip_next = False
            return
        if not self.policy:
            return
        if self.sampler.uncommitted():
            # Mid-way through backward_passes_per_step: a joiner would start its
            # local accumulation out of step with the others.  Adopt after the commit.
            return
        if self.sampler.epoch == self.epoch and not self.sampler.queue:
            # Keras' extra batch at the end of an epoch of unknown length: it finds
            # no data and ends the epoch; a joiner adopted here would start an empty
            # epoch (no logs, no epoch-end collectives) out of step with the others.
            return
        comm = runtime.current("ElasticGrowth")
        event = self.policy.step(runtime.growth("ElasticGrowth"))
        if event is not None and event.gained:
            started = time.perf_counter()
            runtime.session().boundary()  # the growth event is applied before the state leaves
            faults.at_handover()
            comm.broadcast_object(self._live_state())
            # A rank lost during the hand-over is applied before this step, as the
            # joiners apply it (they start their fit with a boundary).
            runtime.session().boundary()
            self.handovers.append((event, time.perf_counter() - started))

    # -- the live state ------------------------------------------------------------
    def _training_state(self, callbacks: Sequence[Any]) -> TrainingState:
        return TrainingState(self.model, sampler=self.sampler, policy=self.policy,
                             callbacks=with_live_state(callbacks))

    def _live_state(self) -> dict[str, Any]:
        state = self._training_state(self.callbacks).state(self.epoch)
        state["callback_classes"] = classes(with_live_state(self.callbacks))
        return state

    def join(self, model: Any, callbacks: Sequence[Any], dataset: Any = None) -> int:
        """In a joining process, before training: rehearse a step on ``dataset``'s
        structure (compiles the training function, see ``ResilientComm.rehearsal``),
        join the job, take over the live state; returns the epoch to train from."""
        comm = runtime.current("ElasticGrowth.join")
        self.set_model(model)
        if dataset is not None:
            self._rehearse(model, dataset, comm)
        self._training_state(callbacks).warm_up()
        started = time.perf_counter()
        event = self.policy.step(runtime.growth("ElasticGrowth.join"))  # a joiner's step joins
        state = comm.broadcast_object(None)
        check_same_callbacks(with_live_state(callbacks), state["callback_classes"])
        self.epoch = self._training_state(callbacks).load_state(state)
        for callback in callbacks:
            if isinstance(callback, BroadcastGlobalVariablesCallback):
                callback.broadcast_done = True  # the live state is what the others have
        self._skip_next = True
        self.handovers.append((event, time.perf_counter() - started))
        return self.epoch

    def _rehearse(self, model: Any, dataset: Any, comm: "ResilientComm") -> None:
        """One step on zeros shaped like ``dataset``'s batches, alone, to compile."""
        spec = dataset.element_spec

        def zeros(s: Any) -> np.ndarray:
            shape = [self.sampler.batch_size if d is None else d for d in s.shape]
            return np.zeros(shape, s.dtype.as_numpy_dtype)

        batch = tf.nest.map_structure(zeros, spec)
        rehearsal = tf.data.Dataset.from_generator(lambda: iter([batch]), output_signature=spec)
        rehearse(comm, model.fit, x=rehearsal.with_options(dataset.options()))


def with_live_state(callbacks: Sequence[Any]) -> list[Any]:
    """The callbacks whose live state a joiner takes over (elastic_hvd's own)."""
    return [c for c in callbacks if hasattr(c, "live_state")]


def classes(callbacks: Sequence[Any]) -> list[str]:
    return [type(c).__name__ for c in callbacks]


def check_same_callbacks(mine: Sequence[Any], theirs: Sequence[str]) -> None:
    """Raise, naming the first difference, unless this joiner's callbacks with a live
    state are the job's (``theirs``: their class names, in order)."""
    here = classes(mine)
    if here == list(theirs):
        return
    at = next((i for i, (a, b) in enumerate(zip(here, theirs)) if a != b), min(len(here),
                                                                              len(theirs)))
    differs = (f"elastic_hvd callback #{at} is {here[at] if at < len(here) else 'missing'} "
               f"here and {theirs[at] if at < len(theirs) else 'missing'} in the job")
    raise ElasticHvdError(
        f"a joining process must train with the same elastic_hvd callbacks (those with a live "
        f"state) as the job, in the same order: {differs} (here: {', '.join(here) or 'none'}; "
        f"the job: {', '.join(theirs) or 'none'}); give these callbacks to every rank alike "
        "(only plain Keras callbacks may be given to some ranks, e.g. rank 0's "
        "ModelCheckpoint): see docs/training.md")
