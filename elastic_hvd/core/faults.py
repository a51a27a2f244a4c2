"""Fault injection: make a chosen rank die for real, at a chosen point.

Tests, the demo and the benchmarks use it to kill real processes with real
signals.  The plan comes from the environment variable ``ELASTIC_HVD_FAULTS``
(or :func:`configure`), a ``;``-separated list of faults, each a ``,``-separated
list of ``key=value``::

    ELASTIC_HVD_FAULTS="rank=1,coll=12,signal=KILL,delay=0.01;rank=3,step=40,signal=STOP"

``rank``
    original id (rank at ``init()``) of the process that fails.
``coll`` / ``step`` / ``spawn`` / ``handover`` / ``repair``
    when: at the N-th collective this process starts (1-based, counted by the core),
    when the training loop reports step N (:func:`at_step`, called by the Keras
    layer before each step), or in the N-th spawn of new processes this process
    takes part in, between the spawn and the merge (a failure *during* the repair
    that grows the job back), or as the N-th hand-over of the live training state
    to joined processes starts on this rank (``keras_callbacks.ElasticGrowth``), or
    in the N-th repair of the communicator on this rank, once its shrink returned and
    before the survivors settle on the new communicator.  Exactly one of the five.
``signal``
    ``KILL`` (default), ``TERM``, ``STOP``, ``SEGV``… any ``signal.SIG*`` name, or
    ``RAISE`` to raise :class:`FaultInjected` (a Python exception in user code), or
    ``SYSEXIT`` to raise ``SystemExit(0)`` (the program ends cleanly, mid-job), or
    ``EXIT`` to call ``os._exit(1)``.  ``RAISE`` and ``SYSEXIT`` ignore ``delay``.
``delay``
    seconds to wait before the signal; with ``coll`` the signal then arrives from a
    helper thread *while* the collective runs (e.g. in the middle of a transfer).
``phase``
    with ``coll``: ``before`` (default) fires as the collective starts; ``after`` fires
    once its data transfer completed here but before the ranks agreed on the outcome
    -- the moment at which ULFM's non-uniform error reporting bites.  With ``spawn``:
    ``before`` fires before the ranks agree to merge, ``after`` once they agreed,
    as the merge starts (Open MPI 5.0.11 cannot survive a death inside it);
    ``connect`` fires as the N-th attempt to connect starts (spawn or a hot spare's
    adoption, counted whether or not it succeeds), so that with ``delay`` the death
    lands inside ``MPI_Comm_spawn`` / ``MPI_Comm_accept``.
``launch``
    the launch of the job in which the fault fires: 0 (default) the first, n the n-th
    relaunch by ``elastic-hvd-run`` (``runner/relaunch.py``).  A plan is the same
    in every launch; without this it would fire again at the same moments.
``joiner``
    instead of ``rank`` and a moment: the process started by the job's N-th spawn
    fails before ``MPI_Init`` -- with ``signal`` (default ``KILL``), or ``HANG``
    (it never gets further, as a process stuck in start-up).  The spawning ranks
    then give the spawn up after ``ELASTIC_HVD_SPAWN_TIMEOUT`` seconds.
"""

import dataclasses
import os
import signal as _signal
import threading
import time
from collections.abc import Iterable

from . import config, process, timings
from .errors import FaultInjected

ENV = config.env("faults")
#: How a spawned process learns the fault planned for it (set by its spawner).
JOINER_ENV = config.env("joiner_fault")


@dataclasses.dataclass(frozen=True)
class Fault:
    rank: int | None = None
    joiner: int | None = None
    coll: int | None = None
    step: int | None = None
    spawn: int | None = None
    handover: int | None = None
    repair: int | None = None
    signal: str = "KILL"
    delay: float = 0.0
    phase: str = "before"
    launch: int = 0

    def fire(self) -> None:
        if self.signal == "RAISE":  # an exception must come from the caller's thread
            raise FaultInjected(f"injected fault on original rank {self.rank}")
        if self.signal == "SYSEXIT":
            raise SystemExit(0)
        if self.delay > 0:
            threading.Thread(target=self._deliver, args=(self.delay,), daemon=True).start()
        else:
            self._deliver(0.0)

    def _deliver(self, delay: float) -> None:
        if delay:
            time.sleep(delay)
        _signal_self(self.signal)


def _signal_self(name: str) -> None:
    """Deliver the fault ``name`` (a signal name, ``EXIT`` or ``HANG``) to this process."""
    if name == "HANG":
        while True:
            time.sleep(timings.HANG)
    if name == "EXIT":
        os._exit(1)
    os.kill(os.getpid(), getattr(_signal, "SIG" + name))


#: The keys that say when a fault fires (one per fault, besides ``joiner``).
MOMENTS = ("coll", "step", "spawn", "handover", "repair")


def parse(spec: str | None) -> list[Fault]:
    """Parse a fault plan string into a list of :class:`Fault`."""
    faults = []
    for entry in filter(None, (part.strip() for part in (spec or "").split(";"))):
        fields = {}
        for item in entry.split(","):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"{ENV}: expected key=value, got {item!r} in {entry!r}")
            fields[key.strip()] = value.strip()
        unknown = set(fields) - {"rank", "joiner", "coll", "step", "spawn", "handover", "repair",
                                 "signal", "delay", "phase", "launch"}
        if unknown:
            raise ValueError(f"{ENV}: unknown key(s) {sorted(unknown)} in {entry!r}")
        sig = fields.get("signal", "KILL").upper().removeprefix("SIG")
        if "joiner" in fields:
            if set(fields) - {"joiner", "signal", "launch"}:
                raise ValueError(f"{ENV}: a joiner= fault takes only signal= and launch= in "
                                 f"{entry!r}")
            if sig not in ("HANG", "EXIT") and not hasattr(_signal, "SIG" + sig):
                raise ValueError(f"{ENV}: unknown signal {sig!r} in {entry!r}")
            faults.append(Fault(joiner=int(fields["joiner"]), signal=sig,
                                launch=int(fields.get("launch", 0))))
            continue
        if "rank" not in fields:
            raise ValueError(f"{ENV}: give rank= (or joiner=) in {entry!r}")
        if sum(key in fields for key in MOMENTS) != 1:
            raise ValueError(f"{ENV}: give exactly one of coll=, step=, spawn=, handover= or "
                             f"repair= in {entry!r}")
        if fields.get("phase", "before") not in ("before", "after", "connect"):
            raise ValueError(f"{ENV}: phase must be before, after or connect in {entry!r}")
        if fields.get("phase") == "connect" and "spawn" not in fields:
            raise ValueError(f"{ENV}: phase=connect goes with spawn= in {entry!r}")
        if sig not in ("RAISE", "SYSEXIT", "EXIT") and not hasattr(_signal, "SIG" + sig):
            raise ValueError(f"{ENV}: unknown signal {sig!r} in {entry!r}")
        faults.append(Fault(
            rank=int(fields["rank"]),
            coll=int(fields["coll"]) if "coll" in fields else None,
            step=int(fields["step"]) if "step" in fields else None,
            spawn=int(fields["spawn"]) if "spawn" in fields else None,
            handover=int(fields["handover"]) if "handover" in fields else None,
            repair=int(fields["repair"]) if "repair" in fields else None,
            signal=sig, delay=float(fields.get("delay", 0.0)),
            phase=fields.get("phase", "before"), launch=int(fields.get("launch", 0))))
    return faults


class FaultPlan:
    """The faults that concern this process, fired when their moment comes."""

    def __init__(self, faults: Iterable[Fault], original_id: int | None,
                 launch: int = 0) -> None:
        faults = [f for f in faults if f.launch == launch]
        mine = [f for f in faults if f.rank == original_id]
        self._by_coll = {f.coll: f for f in mine if f.coll is not None and f.phase == "before"}
        self._after_coll = {f.coll: f for f in mine if f.coll is not None and f.phase == "after"}
        self._by_step = {f.step: f for f in mine if f.step is not None}
        self._by_spawn = {f.spawn: f for f in mine if f.spawn is not None and f.phase == "before"}
        self._in_merge = {f.spawn: f for f in mine if f.spawn is not None and f.phase == "after"}
        self._in_connect = {f.spawn: f for f in mine if f.spawn is not None
                            and f.phase == "connect"}
        self._by_handover = {f.handover: f for f in mine if f.handover is not None}
        self._by_repair = {f.repair: f for f in mine if f.repair is not None}
        self._by_joiner = {f.joiner: f.signal for f in faults if f.joiner is not None}
        self._collectives = self._spawns = self._handovers = self._repairs = 0
        self._connects = 0

    def __bool__(self) -> bool:
        return bool(self._by_coll or self._after_coll or self._by_step or self._by_spawn
                    or self._in_merge or self._in_connect or self._by_handover
                    or self._by_repair or self._by_joiner)

    def at_repair(self) -> None:
        self._repairs += 1
        fault = self._by_repair.pop(self._repairs, None)
        if fault:
            fault.fire()

    def at_handover(self) -> None:
        self._handovers += 1
        fault = self._by_handover.pop(self._handovers, None)
        if fault:
            fault.fire()

    def at_spawn(self) -> None:
        self._spawns += 1
        fault = self._by_spawn.pop(self._spawns, None)
        if fault:
            fault.fire()

    def at_merge(self) -> None:
        fault = self._in_merge.pop(self._spawns, None)
        if fault:
            fault.fire()

    def at_connect(self) -> None:
        self._connects += 1
        fault = self._in_connect.pop(self._connects, None)
        if fault:
            fault.fire()

    def at_collective(self) -> None:
        self._collectives += 1
        fault = self._by_coll.pop(self._collectives, None)
        if fault:
            fault.fire()

    def after_transfer(self) -> None:
        fault = self._after_coll.pop(self._collectives, None)
        if fault:
            fault.fire()

    def joiner_signal(self, spawn_number: int) -> str | None:
        """The signal planned for the process of the ``spawn_number``-th spawn, or None."""
        return self._by_joiner.get(spawn_number)

    def at_step(self, step: int) -> None:
        fault = self._by_step.pop(int(step), None)
        if fault:
            fault.fire()


def configure(original_id: int | None, spec: str | None = None) -> FaultPlan:
    """Load this process's plan (from ``spec`` or the environment); called by init()."""
    settings = config.current()
    plan = FaultPlan(parse(settings.faults if spec is None else spec), original_id,
                     settings.launch)
    process.runtime().faults = plan
    return plan


def active() -> FaultPlan | None:
    """This process's plan while it has faults left to fire, else None: what a
    transaction of many collectives looks up once (its calls then count on it)."""
    plan = process.runtime().faults
    return plan if plan else None


def at_spawn() -> None:
    plan = process.runtime().faults
    if plan:
        plan.at_spawn()


def at_merge() -> None:
    plan = process.runtime().faults
    if plan:
        plan.at_merge()


def at_connect() -> None:
    plan = process.runtime().faults
    if plan:
        plan.at_connect()


def at_handover() -> None:
    plan = process.runtime().faults
    if plan:
        plan.at_handover()


def at_repair() -> None:
    plan = process.runtime().faults
    if plan:
        plan.at_repair()


def for_joiner(spawn_number: int) -> dict[str, str]:
    """The fault planned for the process of the job's ``spawn_number``-th spawn:
    ``{JOINER_ENV: signal}`` for its environment, or ``{}``."""
    plan = process.runtime().faults
    signal = plan.joiner_signal(spawn_number) if plan else None
    return {JOINER_ENV: signal} if signal else {}


def at_joiner_start() -> None:
    """In a spawned process, before MPI_Init: fire the fault its spawner planned."""
    signal = os.environ.pop(JOINER_ENV, None)
    if signal:
        _signal_self(signal)


def at_step(step: int) -> None:
    """Called by training loops before each step (counted from 1)."""
    plan = process.runtime().faults
    if plan:
        plan.at_step(step)
