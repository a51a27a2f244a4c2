"""What the join protocol (:mod:`.growth`, :mod:`.spare_pool`, :mod:`.spawn`,
:mod:`.spares`) uses of the resilient communicator: one :class:`Communicator`.

A leaf (it imports nothing of the package but :mod:`.membership`), so that those
modules name the communicator's interface without importing :mod:`.comm`, which
imports them.
"""

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from .membership import MembershipEvent


class Communicator(Protocol):
    """The part of :class:`.comm.ResilientComm` that growth uses (see there for each)."""

    MPI: Any
    initial_size: int
    original_id: int | None
    generation: int

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def ids(self) -> tuple[int, ...]: ...

    @property
    def mpi_comm(self) -> Any: ...

    def host_of(self, original_id: int) -> str | None: ...

    def run(self, signature: Any, attempt: Callable[[Any], Any]) -> Any: ...

    def agree(self, flag: int) -> int: ...

    def allgather_object(self, obj: Any) -> list[Any]: ...

    def revoke(self, comm: Any) -> None: ...

    def retire(self, comm: Any) -> None: ...

    def settle(self, new: Any) -> None: ...

    def replace(self, new: Any, ids: Sequence[int]) -> None: ...

    def book(self) -> dict[str, Any]: ...

    def load_book(self, book: Mapping[str, Any]) -> None: ...

    def meet(self, extra: Any = None) -> list[Any]: ...

    def labelled(self, label: str) -> AbstractContextManager[None]: ...

    def folded(self, label: str) -> AbstractContextManager[None]: ...

    def record(self, event: MembershipEvent) -> None: ...
