"""``elastic-hvd-run``: start a fault-tolerant job, horovodrun-style (the CLI).

The flags are read and checked here, before anything starts; the rest is done by
one module per job: :mod:`.command` (the mpirun command line), :mod:`.job` (one
launch: :mod:`.relay` passes mpirun's stderr through, :mod:`.watch` ends a job
mpirun would wait on for ever), :mod:`.outcome` (the exit status from the ranks'
records) and :mod:`.relaunch` (a job started again after a failure only that repairs).
"""

import argparse
import copy
import os
import re
import shlex
import sys
from collections.abc import Container, Mapping, Sequence
from typing import Any

from ..core import config
from . import relaunch, slurm
from .command import (SETTING_FLAGS, SWITCHES, build_command, flag_settings, host_slots,
                      program, program_start)
from ..log import get_logger

_log = get_logger("elastic_hvd.runner.launch")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="elastic-hvd-run",
        description="Run a training script on N ranks whose collectives survive rank loss.",
        epilog="Example: elastic-hvd-run -np 4 --min-np 2 python train.py")
    _add_size_flags(p)
    _add_liveness_flags(p)
    _add_job_flags(p)
    return p


def _add_size_flags(p: argparse.ArgumentParser) -> None:
    """Where the job runs and how its size may change."""
    p.add_argument("-np", "--num-proc", type=int, dest="np", help="number of ranks to start")
    p.add_argument("-H", "--hosts",
                   help="host:slots,host:slots,... (as horovodrun / mpirun --host)")
    p.add_argument("--hostfile", help="mpirun hostfile")
    p.add_argument("--min-np", help="fewest ranks the job may continue with")
    p.add_argument("--respawn", action="store_true",
                   help="replace lost ranks with new processes, back up to -np, while training "
                        "goes on (a script with a growth point: at a step boundary; a plain "
                        "Horovod Keras script: at an epoch's start, as a spare); with --spares, "
                        "also spawn spares that refill the pool")
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


def _add_liveness_flags(p: argparse.ArgumentParser) -> None:
    """How a lost, frozen or stuck rank is noticed, and what an anomaly does."""
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


def _add_job_flags(p: argparse.ArgumentParser) -> None:
    """The ranks' environment and program, mpirun's own arguments, relaunches."""
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


def checked(args: argparse.Namespace) -> tuple[argparse.Namespace, Any]:
    """``args`` with the flags' numbers read, and the settings the ranks will have (the
    flags', else -x's, else our environment's); ``ValueError``, one line naming what the
    user typed, for what cannot work.

    Why here: checked only by the ranks, a flag's error came seconds later, once per
    rank, in a traceback naming the variable.  The flags meet the rules -x values meet
    (``config.from_environ``); a flag and a -x for one setting are refused, as neither
    reads as the one that wins."""
    size, source = _size(args)
    flags = flag_settings(args)
    settings, environ = _settings(args, flags)

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
    _check_inputs(args)
    args = copy.copy(args)
    for name in flags:
        setattr(args, name, getattr(settings, name))
    return args, settings


def _size(args: argparse.Namespace) -> tuple[int, str]:
    """The number of ranks to start and how the user said it (``-np 4``, ``5 from -H
    ...``); ``ValueError`` for a command, a size or a relaunch count that cannot work."""
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
    return size, source


def _settings(args: argparse.Namespace, flags: Mapping[str, str]) -> tuple[Any, dict[str, str]]:
    """The ranks' settings and the environment they are read from: ours, -x's over it,
    the ``flags``' (by setting name, as :func:`flag_settings` gives them) over that."""
    by_x = {item.split("=", 1)[0]: item for item in args.env}
    for name, text in flags.items():
        if config.env(name) in by_x:
            raise ValueError(f"{typed(name, text)} and -x {by_x[config.env(name)]} both set "
                             f"{config.env(name)}: give one of them")
    environ = {**os.environ, **dict(item.split("=", 1) for item in args.env if "=" in item),
               **{config.env(name): text for name, text in flags.items()}}
    try:
        return config.from_environ(environ), environ
    except ValueError as exc:
        raise ValueError(as_typed(str(exc), flags, {*by_x, *os.environ})) from None


def _check_inputs(args: argparse.Namespace) -> None:
    """``ValueError`` for a host source, --mpi-args or --as-horovod that cannot work."""
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


def main(argv: Sequence[str] | None = None) -> int:
    try:  # before anything starts, and for --dry-run too; in one line, as argparse's
        args, settings = checked(slurm.at_start(parser().parse_args(argv)))  # docs/slurm.md
    except ValueError as exc:
        _log.error(f"elastic-hvd-run: {exc}")
        return 2
    cmd = build_command(args)
    if args.dry_run:
        print(shlex.join(cmd))  # --dry-run's output, not a diagnostic
        return 0
    status, why = relaunch.run(args, cmd, settings)
    if why:
        _log.warning(f"elastic-hvd-run: {why}")
    return status


if __name__ == "__main__":
    sys.exit(main())
