"""Every setting of elastic_hvd in one table, read and checked once (in the spirit of
``mpi4py.rc``).

Why one place: settings were read in seven modules, some at import time, with no
check -- a typo'd value surfaced minutes later as a crash deep inside training.
Each :class:`Setting` names its environment variable, type, default and lower
bound; :func:`load` reads them all when ``init()`` runs (or before, if MPI is
loaded first) and rejects a bad value with a message naming the variable.
``elastic-hvd-run``'s flags set these variables; plain ``mpirun`` users pass
them with ``-x``.  docs/settings.md's tables are checked against this one by a test.

The table also names the variables by which our own processes talk to each other
(the launcher to its ranks, a rank to the processes it spawns), marked
``internal``: never set by users, so not in the users' table, but named here once
(:func:`env`) and read through here (:func:`read`) like the others.  A test checks
that no other module spells out one of our variables.
"""

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

from . import process


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str                 # attribute of the Config
    env: str                  # environment variable
    kind: type                # int, float, bool or str
    default: object           # None: unset
    minimum: float | None = None  # inclusive lower bound of a number
    doc: str = ""
    internal: bool = False    # set by elastic_hvd for its own processes, never by users
    maximum: float | None = None  # inclusive upper bound (floats: DAY unless set)


#: The upper bound of a float setting that names none: every one is a time or a share,
#: and a day is past any sensible value, yet finite (``inf`` kills timers that take it).
DAY = 86400.0


SETTINGS = (
    Setting("min_np", "ELASTIC_HVD_MIN_NP", int, 1, 1,
            "fewest ranks a job goes on with; below it the survivors stop with exit status 3"),
    Setting("heartbeat_period", "ELASTIC_HVD_HEARTBEAT_PERIOD", float, 1.0, 0.001,
            "seconds between heartbeats of Open MPI's failure detector"),
    Setting("heartbeat_timeout", "ELASTIC_HVD_HEARTBEAT_TIMEOUT", float, 10.0, 0.001,
            "seconds without a heartbeat before a rank is declared dead (> 3 x period)"),
    Setting("stall_timeout", "ELASTIC_HVD_STALL_TIMEOUT", float, 0.0, 0.0,
            "seconds without progress, while others wait, before a rank kills itself (0: off)"),
    Setting("waiting_board", "ELASTIC_HVD_WAITING_BOARD", str, None, None,
            "directory where ranks tell the stall watchdog that they wait (default: the "
            "launcher's status directory, or mpirun's session directory on each host; with "
            "plain mpirun on several hosts, one every host shares: yours and not writable by "
            "group or others, or set ELASTIC_HVD_SHARED_DIRS=1)"),
    Setting("mismatch_timeout", "ELASTIC_HVD_MISMATCH_TIMEOUT", float, 5.0, 0.0,
            "seconds a rank whose collective differs from the predicted one waits"),
    Setting("anomaly_timeout", "ELASTIC_HVD_ANOMALY_TIMEOUT", float, 5.0, 0.001,
            "seconds, times 1 + the rank, that a rank which met an anomaly (see "
            "ELASTIC_HVD_STRICT) has to agree with the others again before it leaves as a "
            "crash (staggered: one rank at a time goes)"),
    Setting("finalize_deadline", "ELASTIC_HVD_FINALIZE_DEADLINE", float, 15.0, 0.0,
            "seconds MPI_Finalize may take before the process exits without it"),
    Setting("connected_finalize_deadline", "ELASTIC_HVD_CONNECTED_FINALIZE_DEADLINE", float,
            3.0, 0.0,
            "the same for a process connected to another mpirun job (a spawned process, or a "
            "rank merged with one); the smaller of the two applies"),
    Setting("allreduce_piece_bytes", "ELASTIC_HVD_ALLREDUCE_PIECE_BYTES", int, 1 << 20, 0,
            "large allreduces go through MPI in pieces of this size (0: one call)"),
    Setting("fusion_threshold", "HOROVOD_FUSION_THRESHOLD", int, 128 << 20, 0,
            "bytes of gradients fused into one allreduce (Horovod's variable)"),
    Setting("respawn", "ELASTIC_HVD_RESPAWN", bool, False, None,
            "replace lost ranks, back up to the starting size; with spares, also refill the "
            "pool with spawned spares (--respawn)"),
    Setting("spares", "ELASTIC_HVD_SPARES", int, 0, 0,
            "the last N processes of the job wait as hot spares that replace lost ranks at "
            "the next step boundary (--spares; with plain mpirun add them to -np)"),
    Setting("spares_wait", "ELASTIC_HVD_SPARES_WAIT", str, "auto", None,
            "where a hot spare (or a process spawned by --respawn) waits: 'growth' (at its "
            "script's growth point: hvd.fit, ElasticData, hvd.elastic.run; adopted at the next "
            "step), 'init' (in hvd.init(), then it runs the script as the rank it replaces and "
            "is adopted at an epoch's start: a plain Horovod script), 'auto' (growth if the "
            "main script uses one of those, else init)"),
    Setting("max_np", "ELASTIC_HVD_MAX_NP", int, None, 1,
            "add ranks up to this many while discovered hosts have free slots (--max-np)"),
    Setting("host_discovery", "ELASTIC_HVD_HOST_DISCOVERY", str, None, None,
            "script printing host:slots lines (--host-discovery-script)"),
    Setting("hostfile", "ELASTIC_HVD_HOSTFILE", str, None, None,
            "hostfile re-read to discover hosts (--hostfile with --max-np)"),
    Setting("discovery_interval", "ELASTIC_HVD_DISCOVERY_INTERVAL", float, 5.0, 0.001,
            "seconds between runs of the discovery (--discovery-interval)"),
    Setting("discovery_check_every", "ELASTIC_HVD_DISCOVERY_CHECK_EVERY", int, 10, 1,
            "steps between broadcasts of the discovered hosts"),
    Setting("discovery_timeout", "ELASTIC_HVD_DISCOVERY_TIMEOUT", float, 30.0, 0.001,
            "seconds a run of the host discovery script may take before it is ended and "
            "counted as failed"),
    Setting("spawn_timeout", "ELASTIC_HVD_SPAWN_TIMEOUT", float, 60.0, 0.001,
            "seconds a spawn may take before it is given up"),
    Setting("growth_retry_steps", "ELASTIC_HVD_GROWTH_RETRY_STEPS", int, 20, 1,
            "steps after a failed spawn (or joiners lost before they joined) before the next "
            "try"),
    Setting("growth_max_failures", "ELASTIC_HVD_GROWTH_MAX_FAILURES", int, 3, 1,
            "failed spawns in a row after which the job stops growing (rank 0 says so); one "
            "that a loss of the job's own ranks ended does not count"),
    Setting("exit_grace", "ELASTIC_HVD_EXIT_GRACE", float, 10.0, 0.0,
            "seconds a spawned process that the job gave up may take to exit before it "
            "prints its main thread's stack and ends itself with SIGKILL"),
    Setting("adopt_timeout", "ELASTIC_HVD_ADOPT_TIMEOUT", float, 5.0, 0.001,
            "seconds the ranks wait for a hot spare to connect when they adopt it (it takes "
            "milliseconds); one that does not, e.g. a stopped spawned spare, which Open MPI's "
            "detector never watches, is dropped"),
    Setting("stopped_peer_patience", "ELASTIC_HVD_STOPPED_PEER_PATIENCE", float, 1.5, 1.0,
            "heartbeat timeouts a process of the job may stay stopped (SIGSTOP) before the "
            "lowest running member on its host kills it (Open MPI's detector does not watch "
            "spawned processes)"),
    Setting("oversubscribe", "ELASTIC_HVD_OVERSUBSCRIBE", bool, False, None,
            "spawned ranks may oversubscribe the host (set by elastic-hvd-run)"),
    Setting("replica_budget", "ELASTIC_HVD_REPLICA_BUDGET", float, 0.05, 0.0,
            "share of training time rank 0 may spend copying the state to elastic-hvd-run "
            "(for a relaunch of the job; 0: no copies)", maximum=1.0),
    Setting("unpickle_checkpoints", "ELASTIC_HVD_UNPICKLE_CHECKPOINTS", bool, False, None,
            "restore() may read a checkpoint whose state is a pickle (written before checkpoints "
            "were data only): unpickling runs any code the file holds, so set it only for "
            "checkpoints you wrote; the next save writes data (docs/checkpoints.md)"),
    Setting("strict", "ELASTIC_HVD_STRICT", bool, False, None,
            "an anomaly (an agreed value from another agreement, an outcome the protocol rules "
            "out) aborts the whole job with exit status 70 instead of being repaired and "
            "logged (--strict; make test and make soak set it)"),
    Setting("announce", "ELASTIC_HVD_ANNOUNCE", bool, True, None,
            "the current rank 0 prints one line per membership change: the ranks lost or gained, "
            "the new size, what it cost and what it means for the run (0: off)"),
    Setting("shared_dirs", "ELASTIC_HVD_SHARED_DIRS", bool, False, None,
            "the waiting board and checkpoint directory may be owned by another user or "
            "writable by group or others (a shared path, intended): the job then trusts only "
            "files it created itself there (docs/security.md); unset, such a directory is "
            "refused"),
    Setting("max_failed_saves", "ELASTIC_HVD_MAX_FAILED_SAVES", int, 3, 1,
            "checkpoint saves that may fail in a row (a full disk, a read-only or vanished "
            "directory) before the job stops, with exit status 6; each failed one costs "
            "that checkpoint only"),
    Setting("faults", "ELASTIC_HVD_FAULTS", str, "", None,
            "fault plan for tests and demos, e.g. rank=2,step=40 (--faults)"),
    # -- internal ---------------------------------------------------------------------------
    Setting("status_dir", "ELASTIC_HVD_STATUS_DIR", str, None, None,
            "directory where each process of an elastic-hvd-run job records how it ended",
            internal=True),
    Setting("stdout_tty", "ELASTIC_HVD_STDOUT_TTY", bool, None, None,
            "whether elastic-hvd-run's own stdout is a terminal (a rank's always is one)",
            internal=True),
    Setting("program", "ELASTIC_HVD_PROGRAM", str, None, None,
            "the program (script or module and its arguments) that a spawned process runs",
            internal=True),
    Setting("spawned_spare", "ELASTIC_HVD_SPAWNED_SPARE", bool, False, None,
            "the process being spawned waits as a hot spare (it refills the pool)",
            internal=True),
    Setting("joiner_fault", "ELASTIC_HVD_JOINER_FAULT", str, None, None,
            "a fault of the plan for the process being spawned (a signal it sends itself)",
            internal=True),
    Setting("replica", "ELASTIC_HVD_REPLICA", str, None, None,
            "host:port of elastic-hvd-run's copy of the training state", internal=True),
    Setting("job_secret", "ELASTIC_HVD_JOB_SECRET", str, None, None,
            "the secret that proves a connection to that copy comes from the job",
            internal=True),
    Setting("launch", "ELASTIC_HVD_LAUNCH", int, 0, 0,
            "how many times elastic-hvd-run relaunched the job (see runner/relaunch.py)",
            internal=True),
)
_BY_NAME = {s.name: s for s in SETTINGS}


def _default(name: str) -> Any:
    """The default of the setting ``name``, for :class:`Config`'s field of that name."""
    return _BY_NAME[name].default


@dataclasses.dataclass(frozen=True)
class Config:
    """The values of every :data:`SETTINGS` entry, in its order, typed for the checker.

    Names, defaults and meanings live in :data:`SETTINGS` only; a test checks that these
    fields match its rows (name, order, type; ``X | None`` where the default is unset)."""

    min_np: int = _default("min_np")
    heartbeat_period: float = _default("heartbeat_period")
    heartbeat_timeout: float = _default("heartbeat_timeout")
    stall_timeout: float = _default("stall_timeout")
    waiting_board: str | None = _default("waiting_board")
    mismatch_timeout: float = _default("mismatch_timeout")
    anomaly_timeout: float = _default("anomaly_timeout")
    finalize_deadline: float = _default("finalize_deadline")
    connected_finalize_deadline: float = _default("connected_finalize_deadline")
    allreduce_piece_bytes: int = _default("allreduce_piece_bytes")
    fusion_threshold: int = _default("fusion_threshold")
    respawn: bool = _default("respawn")
    spares: int = _default("spares")
    spares_wait: str = _default("spares_wait")
    max_np: int | None = _default("max_np")
    host_discovery: str | None = _default("host_discovery")
    hostfile: str | None = _default("hostfile")
    discovery_interval: float = _default("discovery_interval")
    discovery_check_every: int = _default("discovery_check_every")
    discovery_timeout: float = _default("discovery_timeout")
    spawn_timeout: float = _default("spawn_timeout")
    growth_retry_steps: int = _default("growth_retry_steps")
    growth_max_failures: int = _default("growth_max_failures")
    exit_grace: float = _default("exit_grace")
    adopt_timeout: float = _default("adopt_timeout")
    stopped_peer_patience: float = _default("stopped_peer_patience")
    oversubscribe: bool = _default("oversubscribe")
    replica_budget: float = _default("replica_budget")
    unpickle_checkpoints: bool = _default("unpickle_checkpoints")
    strict: bool = _default("strict")
    announce: bool = _default("announce")
    shared_dirs: bool = _default("shared_dirs")
    max_failed_saves: int = _default("max_failed_saves")
    faults: str = _default("faults")
    # -- internal
    status_dir: str | None = _default("status_dir")
    stdout_tty: bool | None = _default("stdout_tty")
    program: str | None = _default("program")
    spawned_spare: bool = _default("spawned_spare")
    joiner_fault: str | None = _default("joiner_fault")
    replica: str | None = _default("replica")
    job_secret: str | None = _default("job_secret")
    launch: int = _default("launch")


#: Every setting at its default (for defaults of arguments that a setting also sets).
DEFAULTS = Config()

#: Values of ``ELASTIC_HVD_SPARES_WAIT``.
SPARES_WAIT = ("auto", "growth", "init")

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _parse(setting: Setting, text: str) -> object:
    text = text.strip()
    if setting.kind is bool:
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise ValueError("expected 1/0, true/false, yes/no or on/off")
    if setting.kind is str:
        return text or setting.default
    value = setting.kind(text)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("must be a finite number")
    if setting.minimum is not None and value < setting.minimum:
        raise ValueError(f"must be at least {setting.minimum:g}")
    upper = _upper(setting)
    if upper is not None and value > upper:
        raise ValueError(f"must be at most {upper:g}")
    return value


def _upper(setting: Setting) -> float | None:
    """The inclusive upper bound of a number setting (every float has one)."""
    return setting.maximum if setting.maximum is not None else (
        DAY if setting.kind is float else None)


def _value(setting: Setting, environ: Mapping[str, str]) -> Any:
    """The value of ``setting`` in ``environ``, parsed to its kind (checked by a test)."""
    text = environ.get(setting.env)
    if text is None:
        return setting.default
    try:
        return _parse(setting, text)
    except ValueError as exc:
        raise ValueError(f"{setting.env}={text!r}: {exc} ({setting.doc})") from None


def env(name: str) -> str:
    """The environment variable of the setting ``name``."""
    return _BY_NAME[name].env


def read(name: str, environ: Mapping[str, str] = os.environ) -> Any:
    """The setting ``name`` as ``environ`` has it now: for the internal ones, which our
    own processes set at any time (see :func:`current` for the others)."""
    return _value(_BY_NAME[name], environ)


def from_environ(environ: Mapping[str, str] = os.environ) -> Config:
    """A :class:`Config` from ``environ``; ``ValueError`` naming the variable if a
    value is invalid."""
    config = Config(**{s.name: _value(s, environ) for s in SETTINGS})
    if config.spares_wait not in SPARES_WAIT:
        raise ValueError(f"ELASTIC_HVD_SPARES_WAIT={config.spares_wait!r}: expected one of "
                         f"{', '.join(SPARES_WAIT)}")
    if config.heartbeat_timeout <= 3 * config.heartbeat_period:
        raise ValueError(
            f"ELASTIC_HVD_HEARTBEAT_TIMEOUT ({config.heartbeat_timeout}s) must exceed 3 x "
            f"ELASTIC_HVD_HEARTBEAT_PERIOD ({config.heartbeat_period}s): Open MPI refuses less")
    return config


def load(environ: Mapping[str, str] = os.environ) -> Config:
    """Read (again) and check every setting; ``init()`` calls it."""
    settings = process.runtime().settings = from_environ(environ)
    return settings


def current() -> Config:
    """The settings as last loaded (loaded now if never)."""
    settings = process.runtime().settings
    return settings if settings is not None else load()


def table(internal: bool = False) -> str:
    """The table of settings in docs/settings.md (a test checks that the page has it);
    ``internal=True``: the table of the internal ones."""
    rows = ["| Variable | Type | Default | Meaning |", "|---|---|---|---|"]
    for s in (s for s in SETTINGS if s.internal == internal):
        default = "unset" if s.default is None else repr(s.default)
        bound = f", at least {s.minimum:g}" if s.minimum is not None else ""
        if _upper(s) is not None:
            bound += f", at most {_upper(s):g}"
        rows.append(f"| `{s.env}` | {s.kind.__name__}{bound} | {default} | {s.doc} |")
    return "\n".join(rows)
