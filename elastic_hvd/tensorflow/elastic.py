"""Horovod's elastic API (``hvd.elastic``), on a job that recovers in place.

Elastic Horovod restarts the training function from the last ``commit()`` after
a failure.  elastic_hvd's collectives survive the failure where it happens, so
``run`` does not restart anything for a failure; the state objects keep Horovod's
meaning (``commit`` saves a copy in memory, ``restore`` goes back to it, ``sync``
broadcasts from rank 0) for scripts that use them, e.g. to roll back on their
own terms.

Growing (``elastic-hvd-run --respawn`` / ``--max-np``) follows Horovod's model
for added hosts: ``commit()`` runs the growth policy; the commit at which new
processes are adopted raises :class:`HostsUpdatedInterrupt` on the running ranks,
``run`` calls the reset callbacks, syncs the state (the new processes receive
it) and calls the training function again -- from the committed state, which is
the current one, so nothing is redone.  A new process runs the script from the
top and, in ``run``, joins and receives the state before training.
"""

import functools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from ..common.elastic_state import StateBasics
from ..core import runtime
from ..growth_policy import GrowthPolicy, mark_growth_point
from ..basics import init, rank, shutdown  # noqa: F401 (hvd.elastic.*, as Horovod's)
from .collectives import (HorovodInternalError, broadcast_object,  # noqa: F401
                          broadcast_object_fn, broadcast_variables)
from . import layer
from .training_state import TrainingState

if TYPE_CHECKING:
    from ..core.comm import ResilientComm

_R = TypeVar("_R")


def growth_policy() -> GrowthPolicy:
    """This process's growth policy (from elastic-hvd-run's flags)."""
    tf_layer = layer.state()
    if tf_layer.policy is None:
        tf_layer.policy = GrowthPolicy.from_env()
    return tf_layer.policy


class HostsUpdatedInterrupt(Exception):
    """Raised by ``State.commit()`` when new processes joined: ``run`` restarts training."""


def run(func: Callable[..., _R]) -> Callable[..., _R]:
    """Decorator for the training function ``func(state, ...)``: syncs the state and
    calls it; again after processes joined (see the module doc)."""
    return run_fn(func, _no_reset)


def _no_reset() -> None:
    """Horovod re-initializes itself here; elastic_hvd's communicator already
    includes the processes that joined."""


def run_fn(func: Callable[..., _R], reset: Callable[[], Any]) -> Callable[..., _R]:
    """``run`` with the step taken when processes joined: ``reset()``, then the
    state's reset callbacks, before syncing and calling ``func`` again."""
    @functools.wraps(func)
    def wrapper(state: "State", *args: Any, **kwargs: Any) -> _R:
        comm = runtime.current("hvd.elastic.run")
        mark_growth_point()  # state.commit() grows
        if comm.joining:
            growth_policy().step(runtime.growth("hvd.elastic.run"))  # a joiner's first step joins
        while True:
            _sync(state, comm)
            try:
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt:
                reset()
                state.on_reset()
    return wrapper


def _sync(state: "State", comm: "ResilientComm") -> None:
    state.sync()
    policy = growth_policy()
    policy.load_state(comm.broadcast_object(policy.state()))


class State(StateBasics):
    """Named values (epoch, batch, ...) kept in sync across ranks.

    ``commit``/``save`` keep a copy of the training state in memory, ``restore``
    goes back to it (keeping the learning-rate rescalings made since, see
    :mod:`.training_state`), ``sync`` makes rank 0's the state of every rank.
    The values may be any Python objects, as in Horovod: they stay in the job's
    memory and its broadcasts, and are never written to a file or to the launcher.
    """

    def __init__(self, **kwargs: Any) -> None:
        self._values = dict(kwargs)
        self._reset_callbacks: list[Callable[[], Any]] = []
        self.save()  # restore() before any commit goes back to the start

    def _training_state(self) -> TrainingState:
        return TrainingState(values=self._values)

    def check_host_updates(self) -> None:
        """Failures need nothing here (they are handled inside the collectives); this
        is where the job grows: see the module doc."""
        policy = growth_policy()
        if policy:
            event = policy.step(runtime.growth("state.commit()"))
            if event is not None and event.gained:
                raise HostsUpdatedInterrupt(f"rank(s) {list(event.gained)} joined")

    def save(self) -> None:
        self._saved = self._training_state().state()

    def restore(self) -> None:
        self._training_state().load_state(self._saved, membership=False)

    def sync(self) -> None:
        comm = runtime.current("state.sync()")
        state = self._training_state()
        state.load_state(comm.broadcast_object(state.state() if comm.rank == 0 else None, 0))
        self.save()


class ObjectState(State):
    """Horovod's base of the state classes.  Its ``bcast_object`` and ``get_rank`` are
    accepted and ignored: elastic_hvd syncs through its own broadcast, which survives
    a rank lost during the sync, from rank 0 of the live communicator."""

    def __init__(self, bcast_object: Any = None, get_rank: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)


class TensorFlowState(ObjectState):
    """State holding TF variables besides the named values."""

    def __init__(self, variables: Iterable[Any] | None = None, session: Any = None,
                 **kwargs: Any) -> None:
        if session is not None:
            raise NotImplementedError(
                "TF1 sessions are not supported by elastic_hvd's elastic state")
        self._variables = list(variables or [])
        super().__init__(**kwargs)

    def _training_state(self) -> TrainingState:
        return TrainingState(variables=self._variables, values=self._values)


class TensorFlowKerasState(ObjectState):
    """State of a Keras model and its optimizer, besides the named values."""

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None,
                 **kwargs: Any) -> None:
        self._model = model
        self._optimizer = optimizer or getattr(model, "optimizer", None)
        super().__init__(**kwargs)

    @property
    def model(self) -> Any:
        return self._model

    def _training_state(self) -> TrainingState:
        return TrainingState(self._model, self._optimizer, values=self._values)
