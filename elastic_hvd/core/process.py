"""This process's elastic_hvd in one object: what ``init()`` makes, what the layers
above find there, and what the process's end needs.

Why one object: these are needed from many modules (the heartbeat's watchdog names
the rank, the TF layer finds the session, the fault plan fires inside the core), and
one object reached through one accessor (:func:`runtime`) is where a reader finds
them and what a test replaces as a whole (:func:`use`).  This module imports nothing
of the package, so that any module may import it.
"""

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

_Part = TypeVar("_Part")


class Layers:
    """The state of the layers above core (the TF layer, the growth policy...), one
    object per class, made by ``cls()`` when first asked for: core reads none of it.

    Why here: a layer's state lives as long as what holds it (the process's
    :class:`Runtime`, or one training session), and goes with it when a test
    replaces the runtime (:func:`use`)."""

    def __init__(self) -> None:
        self._parts: dict[type, Any] = {}

    def get(self, cls: type[_Part]) -> _Part:
        """The ``cls`` object of this holder (made now if there is none yet)."""
        part = self._parts.get(cls)
        if part is None:  # setdefault: one object even if two threads ask at once
            part = self._parts.setdefault(cls, cls())
        return part  # type: ignore[no-any-return]


@dataclasses.dataclass
class Runtime:
    """Everything of elastic_hvd that lives as long as this process (or its ``init()``)."""

    #: The settings (``config.Config``) as last loaded: by ``init()``, or on first use.
    settings: Any = None
    #: The resilient communicator, its join protocol (``growth.Growth``, which holds it)
    #: and its training session, from ``init()`` to ``shutdown()``.
    comm: Any = None
    growth: Any = None
    session: Any = None
    #: The heartbeat (GIL-free MPI progress, stall watchdog), from ``init()`` to its stop.
    heartbeat: Any = None
    #: The watch of this host's stopped members (``stopped_peers``), from the first
    #: elastic ``init()`` to the process's end.
    stopped_peers: Any = None
    #: The fault plan of tests and demos (``faults.configure``), None without one.
    faults: Any = None
    #: A hand-over that the next ``init()`` takes: a spawned process's merged
    #: communicator, or a hot spare's invitation.
    invitation: Any = None
    #: What the layers do about a membership change, by topic, for rank 0's line
    #: (see ``announce.effect``).
    effects: dict[str, Callable[[Any], str | None]] = dataclasses.field(default_factory=dict)
    #: Uses of each Open MPI workaround (see :mod:`.workarounds`).
    workarounds: collections.Counter[str] = dataclasses.field(
        default_factory=lambda: collections.Counter())
    #: Communicators done with but never freed (see ``mpi_env.retire``).
    retired: list[Any] = dataclasses.field(default_factory=list)
    #: The state of the layers above core, by class (see :class:`Layers`).
    layers: Layers = dataclasses.field(default_factory=Layers)
    # -- how the process ends (see runtime) ---------------------------------------------
    exit_status: int | None = None
    #: Called with True if this rank leaves while others go on, False after the final
    #: barrier of all ranks (see runtime.when_leaving).
    on_leaving: Callable[[bool], None] | None = None
    on_strict_abort: Callable[[int], None] | None = None
    #: Called with the reason just before this process ends because Open MPI can make
    #: no communicator here any more (see mpi_env.end_broken, runtime.when_broken).
    on_broken: Callable[[str], None] | None = None
    say_when_raising: bool = True
    #: Set when the ranks leave together: hosts where no rank is left, and this rank then.
    emptied_hosts: Sequence[str] = ()
    rank_at_exit: int | None = None


_runtime = Runtime()


def runtime() -> Runtime:
    """This process's runtime (the one accessor)."""
    return _runtime


def use(new: Runtime) -> Runtime:
    """Make ``new`` this process's runtime; returns the one it replaces (for tests)."""
    global _runtime
    old, _runtime = _runtime, new
    return old
