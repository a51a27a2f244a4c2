"""Hot spares for plain Horovod-style Keras scripts: a spare becomes the rank that was lost.

A plain script (``hvd.init()``, data sharded by ``hvd.rank()``, ``model.fit`` with
``DistributedOptimizer`` and ``BroadcastGlobalVariablesCallback``) has no point where
a process could join mid-epoch: the new one's ``fit`` would start at epoch 0 with
its own data order.  So its spares wait in ``init()`` (see ``elastic_hvd.core.spares``);
after a loss, one is given the lost rank's number and the job's size, runs the
script as that rank (its data shard, its model) while the others train on, and:

* in the spare, the first ``model.fit`` (:func:`install`) runs one step alone to
  compile (nothing it computes survives), joins, receives the live training state
  (weights, optimizer, epoch) and trains from that epoch (``initial_epoch``);
* in the others, ``BroadcastGlobalVariablesCallback`` at each epoch's start
  (:func:`adopt_at_epoch_start`) adopts a ready spare and sends it the state.

Nobody waits for the spare's start-up; the lost rank's shard goes untrained from
the loss to the next epoch's start, and from then on is trained as before.

What a script gives rank 0 alone (Horovod's ``if hvd.rank() == 0:
callbacks.append(...)``) follows the script, not the rank: a spare in rank 0's place
runs the script as rank 0 and creates them again (a ``CSVLogger`` appends to the
job's file), but survivors renumbered after a loss of rank 0 ran that ``if`` long
ago.  :class:`RankZeroDuties` knows each rank's callbacks and says, in the loss's
announcement, which of rank 0's stopped with it.
"""

import collections
import functools
import inspect
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from ...core import announce, runtime, timings
from ..elastic import growth_policy
from ..training_state import TrainingState

if TYPE_CHECKING:
    from ...core.comm import ResilientComm
    from ...core.membership import MembershipEvent

POLLS, PAUSE = timings.REPLACEMENT_POLLS, timings.REPLACEMENT_PAUSE  # see there


def install() -> None:
    """In a spare given a lost rank's number: make the next ``model.fit`` join first."""
    model_class = tf.keras.Model
    original = model_class.fit

    def fit(model: Any, *args: Any, **kwargs: Any) -> Any:
        model_class.fit = original  # once
        return _fit_as_replacement(model, original, args, kwargs)

    model_class.fit = fit


def _fit_as_replacement(model: Any, original: Callable[..., Any], args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> Any:
    comm = runtime.current("model.fit")
    bound = inspect.signature(original).bind(model, *args, **kwargs).arguments
    bound.update(bound.pop("kwargs", {}))
    _rehearse(model, original, bound, comm)
    TrainingState(model).warm_up()
    event = runtime.growth("model.fit").join()
    state = comm.broadcast_object(None, root_rank=state_root(comm, event))
    epoch = TrainingState(model, policy=growth_policy()).load_state(state)
    for callback in bound.get("callbacks") or ():
        if hasattr(callback, "joined_at"):  # a BroadcastGlobalVariablesCallback
            callback.broadcast_done = True  # the live state is what the others have
            callback.joined_at = epoch
        if isinstance(callback, tf.keras.callbacks.CSVLogger):
            callback.append = True  # the rows of the epochs the job trained stay
    bound["initial_epoch"] = epoch
    del bound["self"]
    return original(model, **bound)


def adopt_at_epoch_start(model: Any, epoch: int) -> "MembershipEvent | None":
    """Every rank of an in-place job, at an epoch's start (collective): adopt a spare
    that is ready to take a vacant rank number and hand it the live state."""
    comm = runtime.current("BroadcastGlobalVariablesCallback")
    growth = runtime.growth("BroadcastGlobalVariablesCallback")
    if not growth.spares_in_place or comm.joining:
        return None
    if not growth.pending and not (growth.vacant_slots() and growth.spares_left
                                   and growth.adopt_spare()):
        return None
    for _ in range(POLLS):  # the outcome of each look is agreed: all ranks leave together
        event = growth.poll()
        if event is not None:
            runtime.session().boundary()
            comm.broadcast_object(TrainingState(model, policy=growth_policy()).state(epoch),
                                  root_rank=state_root(comm, event))
            return event
        if not growth.pending:
            return None
        time.sleep(PAUSE)
    return None  # not ready yet: the next epoch's start looks again


def refill_at_step_end() -> None:
    """Every rank of an in-place job, after each step (collective when it spawns): with
    ``--respawn``, spawn the spares that the vacant rank numbers need
    (:meth:`.growth_policy.GrowthPolicy.refill`)."""
    growth = runtime.growth("BroadcastGlobalVariablesCallback")
    if growth.spares_in_place:
        growth_policy().refill(growth)


def state_root(comm: "ResilientComm", event: "MembershipEvent") -> int:
    """The rank that sends the live state: the first one that did not just join (a
    spare may have taken rank 0's place)."""
    return next(r for r, i in enumerate(comm.ids) if i not in event.gained)


def _rehearse(model: Any, fit: Callable[..., Any], arguments: dict[str, Any],
              comm: "ResilientComm") -> None:
    """One step alone on the first batch of ``fit``'s data, to compile before joining."""
    x, y = arguments.get("x"), arguments.get("y")
    size = arguments.get("batch_size") or 32
    if isinstance(x, tf.data.Dataset):
        data = {"x": x.take(1)}
    else:
        data = {"x": tf.nest.map_structure(lambda a: a[:size], x), "batch_size": size}
        if y is not None:
            data["y"] = tf.nest.map_structure(lambda a: a[:size], y)
    rehearse(comm, functools.partial(fit, model), **data)


def rehearse(comm: "ResilientComm", fit: Callable[..., Any], **data: Any) -> None:
    """``fit(**data)`` for one step, its collectives on this process alone
    (``comm.rehearsal()``): a joiner compiles its training function before it joins,
    so that nobody waits for that.  Only a head start: a failure is said, not raised."""
    try:
        with comm.rehearsal():
            # One step of one batch, said so: Keras would warn that a dataset
            # ignores shuffle=True and that the input ran out of data.
            fit(**data, epochs=1, steps_per_epoch=1, shuffle=False, verbose=0)
    except Exception as exc:  # noqa: BLE001 - joining works without it
        print(f"elastic_hvd: joining without a rehearsal step ({type(exc).__name__}: {exc})",
              file=sys.stderr, flush=True)


class RankZeroDuties:
    """Which callbacks each rank trains with (class names, gathered once: collective),
    to say in a loss's announcement what the lost rank 0 alone did that the new rank 0
    does not (``announce.effect`` topic ``"rank 0"``; a listener keeps track of who is
    rank 0, on every rank alike)."""

    def __init__(self, callbacks: list[Any]) -> None:
        self.comm = comm = runtime.current("BroadcastGlobalVariablesCallback")
        self.growth = runtime.growth("BroadcastGlobalVariablesCallback")
        names = [type(c).__name__ for c in callbacks]
        self.by_id = dict(zip(comm.ids, comm.allgather_object(names)))
        self.rank0 = comm.ids[0]
        self.as_rank0 = self.by_id[self.rank0]  # what a script gives the rank 0 it starts as
        comm.listeners.add(self._follow)
        announce.effect("rank 0", self.describe)

    def describe(self, event: "MembershipEvent") -> str | None:
        """On the new rank 0 (before :meth:`_follow`): the lost rank 0's own callbacks."""
        new = self.comm.ids[0]
        if self.rank0 not in event.lost or new not in self.by_id:
            return None
        gone = collections.Counter(self.by_id[self.rank0]) - collections.Counter(self.by_id[new])
        if not gone:
            return None
        names = ", ".join(sorted(gone))
        later = ("until a spare takes rank 0's place at an epoch's start and runs them again"
                 if self.growth.spares_in_place and self.growth.spares_left else
                 "for the rest of this run (elastic_hvd's own checkpoint, event log and "
                 "progress move to the new rank 0; see docs/training.md)")
        return (f"rank 0's own callbacks ({names}) stopped with it: the script gave them to "
                f"rank 0 alone, and the new rank 0 did not create them; they stay stopped {later}")

    def _follow(self, event: "MembershipEvent") -> None:
        new = self.comm.ids[0]
        if new in event.gained:  # a spare in rank 0's place runs the script as rank 0
            self.by_id[new] = self.as_rank0
        self.rank0 = new


def fit_callbacks(callback: Any) -> list[Any]:
    """The callbacks of the ``model.fit`` that calls ``callback.on_train_begin`` (from
    there: Keras gives a callback no list of the others), or [] if not found."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, tf.keras.callbacks.CallbackList) and \
                any(c is callback for c in owner.callbacks):
            return list(owner.callbacks)
        frame = frame.f_back
    return []
