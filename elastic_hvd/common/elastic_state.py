"""What Horovod's elastic ``State`` classes share in every front end (TF, torch): the
user's attributes kept as state values, the reset callbacks, ``commit``.  The front end's
class adds ``save``/``restore``/``sync`` and ``check_host_updates``."""

from collections.abc import Callable, Iterable
from typing import Any


class StateBasics:
    """Mixed into a front end's ``State``: needs ``_values`` (dict) and ``_reset_callbacks``
    (list) set in its ``__init__``, and its ``save`` and ``check_host_updates``."""

    _values: dict[str, Any]
    _reset_callbacks: list[Callable[[], Any]]

    def save(self) -> None:
        raise NotImplementedError

    def check_host_updates(self) -> None:
        raise NotImplementedError

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("_values", {})
        if name in values:
            return values[name]
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            super().__setattr__(name, value)
        else:
            self._values[name] = value

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def reset(self) -> None:
        """Horovod's hook for subclasses: called by :meth:`on_reset` before the reset
        callbacks (here: after the job grew).  Nothing to do by default."""

    def on_hosts_updated(self, timestamp: float, update_res: Any) -> None:
        """Not provided: Horovod's driver calls it to announce host changes; here ranks
        join through the growth policy checked by :meth:`check_host_updates`."""
        raise NotImplementedError(
            "State.on_hosts_updated is how Horovod's elastic driver announces host changes; "
            "elastic_hvd has no such driver: joining ranks are found by commit() "
            "(check_host_updates) through the growth policy")

    def commit(self) -> None:
        self.save()
        self.check_host_updates()
