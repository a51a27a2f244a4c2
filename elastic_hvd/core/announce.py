"""One console line per membership change, printed by the current rank 0, by default.

Why in the core: an unchanged Horovod script (a data shard chosen by ``hvd.rank()``
at start, a learning rate scaled by ``hvd.size()`` once) has no callback that would
say it, and a lost rank changes what such a run trains -- the user must hear it.
The layers that act on a change (the elastic data, the learning-rate rescaler) say
what they do through :func:`effect`; what no layer handles is said as what it means
for the run, with the front end's advice on what would handle it (:func:`advise`: the
PyTorch layer names its own classes; without one, Keras's ``hvd.fit``).
``ELASTIC_HVD_ANNOUNCE=0`` turns the lines off.  Every message of the job names a rank as
:func:`who` does, so that one process keeps one name.
"""

import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TextIO, cast

from . import config, process
from .membership import MembershipEvent
from ..log import STDOUT, get_logger

if TYPE_CHECKING:  # the communicator's interface: a leaf, so no import cycle with comm
    from .comm_api import Communicator as ResilientComm

_log = get_logger(__name__)

#: Said of a loss when no layer re-shares the data / rescales the learning rate.
UNSHARED_DATA = "the lost {whose} data {shards} not trained {until}"
UNCHANGED_LR = "the learning rate was not changed"
#: The advice after what no layer handles, unless a front end gave its own (:func:`advise`).
ADVICE = "hvd.fit with hvd.ElasticData re-shares the data and rescales the rate"
SPARES_ADVICE = "elastic-hvd-run --spares K keeps replacements ready"


def effect(topic: str, describe: Callable[[MembershipEvent], str | None]) -> None:
    """Register ``describe(event) -> text or None``: what this process does about a
    membership change in ``topic`` (``"data"`` or ``"lr"``), or where training was
    (``"when"``), for the line; replaces the earlier description of that topic.  Kept in
    the process's runtime: callables ``event -> text or None`` by topic."""
    process.runtime().effects[topic] = describe


def advise(by_topic: Mapping[str, str]) -> None:
    """The front end's advice on what would handle a loss: by topic (``"data"``,
    ``"lr"``), which of its calls re-share the data / rescale the rate.  Said, for the
    topics no layer handled, after what the loss means, in place of :data:`ADVICE`.  Kept
    with the effects, as the topic ``"advice"`` (its text: the unhandled topics' advice)."""
    advice = dict(by_topic)
    process.runtime().effects["advice"] = lambda topics: " and ".join(
        advice[t] for t in topics if t in advice) or None


def who(rank: int | None, original_id: int | None, *, with_id: bool = False) -> str:
    """The one naming of a rank in every message: ``rank 2``, ``rank 1 (id 2)`` once
    ranks were renumbered (the id, its first rank, follows one process; docs/training.md),
    ``id 2`` where the rank is unknown; ``with_id``: the id even where it equals the rank."""
    if rank is None:
        return f"id {original_id}"
    return f"rank {_number(rank, original_id, with_id)}"


def _number(rank: int, original_id: int | None, with_id: bool = False) -> str:
    same = original_id is None or (original_id == rank and not with_id)
    return f"{rank}" if same else f"{rank} (id {original_id})"


def _ranks(pairs: Sequence[tuple[int | None, int]]) -> str:
    """``who`` of several ``(rank, id)``: ``ranks 1, 3 (id 4)``."""
    known = [(rank, i) for rank, i in pairs if rank is not None]
    if len(pairs) == 1 or len(known) < len(pairs):
        return " and ".join(who(rank, i) for rank, i in pairs)
    return "ranks " + ", ".join(_number(rank, i) for rank, i in known)


def _ms(seconds: float) -> str:
    if seconds < 0.01:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def describe(event: MembershipEvent, comm: "ResilientComm", steps: int | None = None,
             before: Sequence[int] = ()) -> str:
    """The facts of ``event``: who was lost (by :func:`who`: their ranks in ``before``,
    the ids of the ranks before the change) or gained (their ranks now), their hosts
    on a multi-host job, the new size, and what it cost -- each time with what it
    measures."""
    hosts = {comm.host_of(i) for i in (*event.lost, *event.gained)} | set(comm.hosts())
    multi_host = len(hosts - {None}) > 1  # a host not known (None) is no second host

    def where(ids: Iterable[int]) -> str:
        return f" on {', '.join(sorted({str(comm.host_of(i)) for i in ids}))}" if multi_host else ""

    def named(ids: Sequence[int], ranks: Sequence[int]) -> str:
        return _ranks([(list(ranks).index(i) if i in ranks else None, i) for i in ids])

    who = [f"{what} {named(ids, ranks)}{where(ids)}"
           for what, ids, ranks in (("lost", event.lost, before),
                                    ("gained", event.gained, comm.ids)) if ids]
    effects = process.runtime().effects
    place = effects["when"](event) if "when" in effects else None
    when = f" in {place}" if place else f" after {steps} training steps" if steps else ""
    text = f"{' and '.join(who)}{when}: {event.old_size} -> {event.new_size} ranks"
    if event.gained:
        them, they = ("them", "they") if len(event.gained) > 1 else ("it", "it")
        return (f"{text}; the ranks spent {_ms(event.spawn_s)} starting {them} (spawn, or "
                f"connecting a hot spare), and {they} joined {_ms(event.repair_s)} after that "
                "began, while training went on")
    collective = f" ({event.during})" if event.during else ""
    return (f"{text}; the failure was agreed {_ms(event.detect_s)} after rank 0 entered the "
            f"collective it interrupted{collective}, and the repair (revoke + shrink) took "
            f"{_ms(event.repair_s)}")


def consequences(event: MembershipEvent, comm: "ResilientComm") -> list[str]:
    """What the change means for the run: each topic's registered effect, or what an
    unhandled loss means."""
    effects = process.runtime().effects
    said = [text for topic, of in effects.items()
            if topic not in ("when", "advice") and (text := of(event))]
    if not event.lost:
        return said
    many = len(event.lost) > 1
    growth = process.runtime().growth
    replaced = (growth is not None and growth.spares_left) or config.current().respawn
    unshared = UNSHARED_DATA.format(
        whose="ranks'" if many else "rank's", shards="shards are" if many else "shard is",
        until="until a replacement takes its place" if replaced else "for the rest of this run")
    topics = [topic for topic in ("data", "lr") if topic not in effects]
    unhandled = [{"data": unshared, "lr": UNCHANGED_LR}[topic] for topic in topics]
    if not unhandled:
        return said
    advice = (effects["advice"](topics) if "advice" in effects else None) or ADVICE
    unhandled[-1] += f" ({advice})" if replaced else f" ({advice}; {SPARES_ADVICE})"
    return said + unhandled


class _Steps(Protocol):
    """What the line reads of the training session (:class:`.session.Session`)."""
    step: int


class Announcer:
    """The listener (``ResilientComm.listeners``) that prints the line on rank 0.

    Called inside the collective that met the change, on every rank alike: the
    line comes at once, whether or not the program ever reaches a step boundary."""

    def __init__(self, comm: "ResilientComm", session: "_Steps") -> None:
        self.comm, self.session = comm, session
        self.ids = comm.ids  # until the next change: where the lost ones were
        watch_stdout()

    def __call__(self, event: MembershipEvent) -> None:
        comm = self.comm
        before, self.ids = self.ids, comm.ids  # on every rank: any may be rank 0 next
        if comm.rank != 0 or comm.joining:
            return
        line = "; ".join([describe(event, comm, self.session.step, before),
                          *consequences(event, comm)])
        # A progress bar may be half-drawn (Keras's leaves its line open until the
        # epoch ends, wherever stdout goes): start on a line of our own.
        start = "\n" if mid_line() else ""
        _log.info(f"{start}[elastic_hvd {time.strftime('%H:%M:%S')}] {line}", extra=STDOUT)


class _LineWatch:
    """``sys.stdout`` as it was, noting whether its last write left a line open.

    Why this process's own stream: under ``mpirun`` each rank's output reaches the
    console line by line (Open MPI holds an open line back until its end:
    docs/measurements.md), so only this rank's own output can share the line."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.open = stream, False

    def write(self, text: str) -> int:
        if text:
            self.open = not text.endswith("\n")
        return self.stream.write(text)

    def __getattr__(self, name: str) -> Any:  # isatty, flush, fileno, encoding, ...
        return getattr(self.stream, name)


def watch_stdout() -> None:
    """Watch ``sys.stdout`` for :func:`mid_line` (once per process)."""
    if sys.stdout is not None and not isinstance(sys.stdout, _LineWatch):
        sys.stdout = cast(TextIO, _LineWatch(sys.stdout))


def mid_line() -> bool:
    """Whether this process's stdout is inside a line it began (a progress bar)."""
    stream: Any = sys.stdout
    return isinstance(stream, _LineWatch) and stream.open


def stdout_is_terminal() -> bool:
    """Whether this process's stdout reaches a terminal.  Under ``mpirun`` a rank's
    stdout is always a pseudo-terminal (Open MPI forwards it through one), wherever
    mpirun's own output goes; ``elastic-hvd-run`` tells its ranks what its own stdout
    is in ``$ELASTIC_HVD_STDOUT_TTY``."""
    told = config.read("stdout_tty")
    return sys.stdout.isatty() if told is None else told
