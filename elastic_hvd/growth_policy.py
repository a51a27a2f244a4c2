"""When a job grows, decided alike on every rank: the growth policy and host discovery.

Why outside ``core``: the join protocol only knows *how* to spawn and adopt
processes (``Growth.spawn`` / ``poll`` / ``join``, :mod:`.core.growth`); *when* to
grow -- replace lost ranks, fill slots a discovery script or hostfile reports --
is a policy above it, which talks to it and its communicator through those calls only.
"""

import ast
import dataclasses
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .core import config, process
from .log import get_logger

if TYPE_CHECKING:
    from .core.comm import ResilientComm
    from .core.comm_api import Communicator
    from .core.growth import Growth
    from .core.membership import MembershipEvent
    from .core.session import Session

_log = get_logger("elastic_hvd.growth_policy")


@dataclasses.dataclass
class Seen:
    """This layer's state in the process's runtime (``process.runtime().layers``)."""

    #: Whether the program adopts joiners at step boundaries (hvd.fit, ElasticData,
    #: ``state.commit()``): set by those when they run (see :func:`warn_if_cannot_grow`).
    growth_point: bool = False


def mark_growth_point() -> None:
    """The program runs a growth point (a policy's step, ``hvd.elastic.run``)."""
    process.runtime().layers.get(Seen).growth_point = True


class GrowthPolicy:
    """When to grow, identically on every rank.

    Joiners are spawned one per join: ``--with-ft ulfm`` covers mpirun's own job only,
    so in a spawned job of several processes the death of one kills its siblings
    (docs/measurements.md).

    ``spares``: the job's number of hot spares (:mod:`.core.spares`): a lost rank is
    replaced by a ready spare first, back up to the size the job started with; when
    none is left, by a spawned process if ``respawn``.
    ``respawn``: replace lost ranks, back up to the size the job started with; with
    ``spares``, also refill the pool once the job is back to that size: a spawned
    process waits as a spare, so that the next loss costs no start-up either.
    ``max_np`` + ``discover`` (a callable returning ``{host: slots}``, run on rank 0
    in a background thread every ``interval`` seconds): add ranks while slots are
    free, up to ``max_np``.  The discovered target reaches the other ranks through
    one small broadcast every ``check_every`` steps.  After a failed spawn (or
    joiners that died before joining) the next try waits ``retry_steps`` steps;
    after ``max_failures`` failures in a row the job stops trying, and rank 0 says so.
    A spawn or a join that a loss of the job's own ranks ended is no failure of growth:
    the next step tries again (counted, frequent losses stopped growth for good;
    docs/measurements.md).
    """

    def __init__(self, respawn: bool = False, max_np: int | None = None,
                 discover: Callable[[], dict[str, int]] | None = None,
                 interval: float = config.DEFAULTS.discovery_interval,
                 check_every: int = config.DEFAULTS.discovery_check_every,
                 retry_steps: int = config.DEFAULTS.growth_retry_steps,
                 max_failures: int = config.DEFAULTS.growth_max_failures,
                 spares: int = 0) -> None:
        self.respawn, self.max_np, self.discover = respawn, max_np, discover
        self.spares = spares
        self.interval, self.check_every, self.retry_steps = interval, check_every, retry_steps
        self.steps = 0           # step boundaries seen (the same on every rank)
        self.next_try: float = 0  # no spawn before this step
        self.failures, self.max_failures = 0, max_failures
        self.discovered: dict[str, int] = {}  # host -> slots, as last agreed
        self._latest: dict[str, int] | None
        self._latest = None      # rank 0's latest discovery (its thread writes it)
        self._thread: threading.Thread | None = None
        self._generation = 0     # the job's membership generation when its last spawn began

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "GrowthPolicy":
        """The policy ``elastic-hvd-run --respawn / --max-np / --host-discovery-script``
        asked for (the settings of :mod:`.config`, from ``environ`` if given)."""
        settings = config.current() if environ is None else config.from_environ(environ)
        script, hostfile = settings.host_discovery, settings.hostfile
        discover = None
        if script:
            discover = lambda: discover_hosts(script, settings.discovery_timeout)  # noqa: E731
        elif hostfile:
            discover = lambda: read_hostfile(hostfile)  # noqa: E731
        return cls(respawn=settings.respawn, max_np=settings.max_np, discover=discover,
                   interval=settings.discovery_interval,
                   check_every=settings.discovery_check_every,
                   retry_steps=settings.growth_retry_steps,
                   max_failures=settings.growth_max_failures, spares=settings.spares)

    def __bool__(self) -> bool:
        return bool(self.respawn or self.spares or (self.max_np and self.discover))

    def state(self) -> dict[str, Any]:
        return {"steps": self.steps, "next_try": self.next_try, "failures": self.failures,
                "discovered": self.discovered}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.steps, self.next_try = state["steps"], state["next_try"]
        self.failures = state["failures"]
        self.discovered = dict(state["discovered"])

    def step(self, growth: "Growth") -> "MembershipEvent | None":
        """Call at every step boundary on every rank, with the job's join protocol
        (``runtime.growth()``): adopts ready joiners (returns their event) and spawns new
        ones when the job is below its target.  In a joining process the first call joins
        (and returns the same event)."""
        mark_growth_point()
        comm = growth.comm
        if comm.joining:
            return growth.join()
        pending = growth.pending
        event = growth.poll()
        if event is not None:
            self.failures = 0
            return event
        if pending and not growth.pending:  # abandoned: its joiners died or ranks changed
            self._failed(comm)
        self.steps += 1
        if self.max_np and self.discover:
            self._start_discovery(comm)
            if self.steps % self.check_every == 1 or self.check_every == 1:
                self.discovered = comm.broadcast_object(
                    self._latest if self._latest is not None else self.discovered)
        if growth.pending or self.steps < self.next_try:
            return None
        count, hosts = self.wanted(comm)
        self._generation = comm.generation
        if count <= 0:
            if self.respawn and growth.spares_left < self.spares and not growth.spares_in_place \
                    and not growth.spawn_spare(self.lost_hosts(comm)[:1]):
                self._failed(comm)
            return None
        if self.spares and growth.spares_left:
            growth.adopt_spare(self.lost_hosts(comm))  # none ready yet: the next step tries again
        elif (self.respawn or (self.max_np and self.discover)) and not growth.spawn(1, hosts[:1]):
            self._failed(comm)
        return None

    def refill(self, growth: "Growth") -> None:
        """Call after every step on every rank of a job whose spares take a lost rank's
        number (a plain script's: ``growth.spares_in_place``), a member's policy state
        the same on every rank: with ``respawn``, spawn a process that waits as a spare
        (in ``init()``, for a claim) while the spares fall short of the vacant rank
        numbers plus ``spares``, one per step.  A spawned process is a spare that
        arrives late: rank 0 claims it for a vacant number and an epoch's start adopts
        it, as a spare of the world."""
        comm = growth.comm
        self.steps += 1
        if not self.respawn or comm.joining or growth.pending or self.steps < self.next_try:
            return
        if len(growth.vacant_slots()) + self.spares <= growth.spares_left:
            return
        self._generation = comm.generation
        if not growth.spawn_spare(self.lost_hosts(comm)[:1]):
            self._failed(comm)

    def _failed(self, comm: "Communicator") -> None:
        """The last spawn (or its join) did not bring a rank.  Not counted when the job's
        own ranks changed since it began."""
        if comm.generation != self._generation:
            return
        self.failures += 1
        if self.failures < self.max_failures:
            self.next_try = self.steps + self.retry_steps
            return
        self.next_try = float("inf")
        if comm.rank == 0:
            _log.warning(f"elastic_hvd: {self.failures} tries in a row to start a process for "
                         f"the job failed; it stops growing and trains on at {comm.size} ranks")

    def wanted(self, comm: "Communicator") -> tuple[int, list[str]]:
        """(ranks to add, hosts to put them on) -- the same on every rank."""
        target = comm.initial_size if self.respawn or self.spares else comm.size
        placed = comm.hosts()
        if self.discovered and self.max_np:
            target = max(target, min(self.max_np, sum(self.discovered.values())))
        if self.max_np:
            target = min(target, self.max_np)
        count = target - comm.size
        if count <= 0:
            return 0, []
        if self.discovered:
            free = []
            for host, slots in sorted(self.discovered.items()):
                free += [host] * max(0, slots - placed.count(host))
            return min(count, len(free)), free[:count]
        return count, self.lost_hosts(comm)[:count]

    @staticmethod
    def lost_hosts(comm: "Communicator") -> list[str]:
        """Hosts of the lost ranks, the latest first."""
        return [h for h in (comm.host_of(i) for e in reversed(comm.events) for i in e.lost) if h]

    def _start_discovery(self, comm: "Communicator") -> None:
        if self._thread is not None or comm.rank != 0:
            return

        def loop() -> None:
            while True:
                try:
                    self._latest = self.discover()  # type: ignore[misc]  # step() checked it
                except Exception as exc:  # a broken script must not stop training
                    _log.warning(f"elastic_hvd: host discovery failed: {exc}")
                time.sleep(self.interval)

        self._thread = threading.Thread(target=loop, name="elastic_hvd-discovery", daemon=True)
        self._thread.start()


#: Names of the elastic Keras API: a script that uses one adopts joiners at its steps.
_GROWTH_NAMES = frozenset(("ElasticData", "fit_elastic", "ElasticGrowth"))


def main_has_growth_point() -> bool:
    """Whether the main script trains with a growth point (hvd.fit, ElasticData,
    fit_elastic/ElasticGrowth, hvd.elastic.run), read from its source before it runs.

    Why read the source: a hot spare must know in ``init()`` whether to wait there
    (a plain script shards its data by ``hvd.rank()`` right after) or to run on to
    the growth point; nothing the script has done by then tells.
    ``ELASTIC_HVD_SPARES_WAIT`` overrides it."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    try:
        with open(path) as f:  # type: ignore[arg-type]  # None: TypeError, caught
            return has_growth_point(ast.parse(f.read()))
    except (OSError, TypeError, SyntaxError, ValueError):
        return False


def has_growth_point(tree: ast.AST) -> bool:
    """Whether the module ``tree`` (an ``ast.Module``) uses the elastic training API."""
    ours = ("elastic_hvd", "horovod")
    aliases: set[str] = set()  # names bound to our (or Horovod's) modules
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name.split(".")[0] for a in node.names
                        if a.name.split(".")[0] in ours}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ours:
            aliases |= {a.asname or a.name for a in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in _GROWTH_NAMES:
            return True
        if isinstance(node, ast.Attribute):
            value = node.value
            if (node.attr in _GROWTH_NAMES
                    or (node.attr == "run" and (getattr(value, "attr", None) == "elastic"
                                                or getattr(value, "id", None) == "elastic"))
                    or (node.attr == "fit" and getattr(value, "id", None) in aliases)):
                return True
    return "fit" in aliases  # from elastic_hvd.tensorflow.keras import fit


CANNOT_GROW_WARNING = (
    "elastic_hvd: WARNING: the job was asked to grow ({what}), but this script has no growth "
    "point: lost ranks will not be replaced and no ranks added. Train with "
    "keras_callbacks.ElasticGrowth (in fit_elastic's callbacks) or under hvd.elastic.run with "
    "state.commit().")
CANNOT_ADD_WARNING = (
    "elastic_hvd: WARNING: the job was asked to add ranks (--max-np {max_np}), but this script "
    "has no growth point: no ranks will be added (lost ranks are replaced, at an epoch's "
    "start). Train with hvd.fit, or keras_callbacks.ElasticGrowth in fit_elastic's callbacks.")


def warn_if_cannot_grow(session: "Session", comm: "ResilientComm", growth: "Growth") -> None:
    """Once the first step commits, rank 0 says so if growth was asked for but nothing
    in the script will ever run a growth policy (a plain Horovod-style ``fit``)."""
    policy = GrowthPolicy.from_env()
    if not policy:
        return

    def check(_ids: Sequence[int]) -> None:
        session.commits.remove(check)
        if growth.spares_in_place and not policy.max_np:
            return  # spares (spawned ones too) wait in init() and take the lost ranks' numbers
        if not process.runtime().layers.get(Seen).growth_point and comm.rank == 0 \
                and not comm.joining:
            if growth.spares_in_place:
                _log.warning(CANNOT_ADD_WARNING.format(max_np=policy.max_np))
                return
            what = ("--respawn" if policy.respawn else "--spares" if policy.spares
                    else f"--max-np {policy.max_np}")
            _log.warning(CANNOT_GROW_WARNING.format(what=what))

    session.commits.add(check)


def parse_hosts(text: str) -> dict[str, int]:
    """``host:slots`` lines (horovodrun's discovery format) -> ``{host: slots}``.
    ``localhost`` means this machine, under the name MPI knows it by."""
    hosts: dict[str, int] = {}
    for line in text.splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        host, _, slots = line.partition(":")
        if host in ("localhost", "127.0.0.1"):
            host = socket.gethostname()
        hosts[host] = hosts.get(host, 0) + int(slots or 1)
    return hosts


def discover_hosts(script: str, timeout: float | None = None) -> dict[str, int]:
    """The hosts ``script`` prints, within ``timeout`` s (``ELASTIC_HVD_DISCOVERY_TIMEOUT``)."""
    if timeout is None:
        timeout = config.current().discovery_timeout
    out = subprocess.run([script], capture_output=True, text=True, timeout=timeout, check=True)
    return parse_hosts(out.stdout)


def read_hostfile(path: str) -> dict[str, int]:
    """An Open MPI hostfile (``host slots=N``) or discovery-format file."""
    with open(path) as f:
        text = f.read().replace(" slots=", ":")
    return parse_hosts(text)
