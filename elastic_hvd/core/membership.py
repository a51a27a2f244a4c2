"""Membership changes and the listeners that react to them."""

import dataclasses
import time
from collections.abc import Callable
from typing import Any, TypeVar

#: A listener: called with each event.
_Callback = TypeVar("_Callback", bound=Callable[[Any], Any])


@dataclasses.dataclass(frozen=True)
class MembershipEvent:
    """One change of the live communicator, the same on every survivor.

    ``lost`` and ``gained`` hold *original* ids (the rank a process had at ``init()``),
    which never change, unlike ranks.  ``detect_s`` is how long the failing collective
    ran before its failure was agreed on; ``repair_s`` is revoke + shrink.  ``during``
    is the label the caller gave the interrupted collective (``ResilientComm.label``),
    e.g. ``"HorovodGradients"``: data sharding uses it to know whether the dead rank's
    gradients of the current step were lost.  For a join (``gained``), ``spawn_s`` is
    how long the running ranks waited in the spawn and ``repair_s`` the time from the
    spawn to the adoption (the joiners' start-up, during which training went on).
    """
    old_size: int
    new_size: int
    lost: tuple = ()
    gained: tuple = ()
    detect_s: float = 0.0
    repair_s: float = 0.0
    wall_time: float = dataclasses.field(default_factory=time.time)
    sequence: int = 0
    during: str = ""
    spawn_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Listeners:
    """Callbacks called with each MembershipEvent, in registration order."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[Any], Any]] = []

    def add(self, callback: _Callback) -> _Callback:
        self._callbacks.append(callback)
        return callback

    def __contains__(self, callback: object) -> bool:
        return callback in self._callbacks

    def remove(self, callback: Callable[[Any], Any]) -> None:
        self._callbacks.remove(callback)

    def notify(self, event: Any) -> None:
        for callback in list(self._callbacks):
            callback(event)
