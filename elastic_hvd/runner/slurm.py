"""``elastic-hvd-run`` inside a Slurm allocation (docs/slurm.md).

Open MPI's ``mpirun`` reads the allocation by itself (PRRTE's ``ras/slurm``) and starts
its daemons through ``srun``; the launcher still names the hosts to it, from the same
allocation, for two reasons measured under Slurm 22.05 with Open MPI 5.0.11:

* a relaunch after a node loss must leave the lost node out, and only the hosts the
  launcher knows can be left out (PRRTE would otherwise try the dead node again);
* without named hosts the launcher adds ``--oversubscribe`` when ``-np`` exceeds this
  machine's cores, and PRRTE then maps every rank onto the first node.

:func:`at_start` does that, and says in one line when the job may lack ``--no-kill``:
by default Slurm ends the whole allocation once a node of it stops answering
(``SlurmdTimeout``), which would end the relaunched job too.  Slurm 22.05 shows no job's
``--no-kill`` to the job itself (not in ``scontrol show job``, not in its environment),
so what is checked is what can be seen: ``SBATCH_NO_KILL``/``SALLOC_NO_KILL`` in the
environment and an ``#SBATCH --no-kill`` (or ``-k``) line in the batch script.
"""

import argparse
import copy
import os
import re
import shlex
import subprocess
from collections.abc import Mapping

from ..log import get_logger

_log = get_logger(__name__)

#: mpirun options by which --mpi-args can name hosts (then the launcher names none).
_HOST_OPTIONS = ("-H", "--host", "-host", "--hostfile", "-hostfile", "--machinefile",
                 "-machinefile", "--default-hostfile")
_NO_KILL_LINE = re.compile(r"^#SBATCH\b.*?(\s--no-kill(?!=off)\b|\s-k\b)", re.M)


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list (``node[1-3,7],gpu[01-02]-a,login``) as names."""
    names: list[str] = []
    for item in _split_top(hostlist):
        names += _expand_one(item)
    return names


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item for item in items if item]


def _expand_one(item: str) -> list[str]:
    found = re.search(r"\[([^\]]*)\]", item)
    if not found:
        return [item]
    head, tail = item[:found.start()], item[found.end():]
    names = []
    for part in found.group(1).split(","):
        first, _, last = part.partition("-")
        width = len(first)
        for number in range(int(first), int(last or first) + 1):
            names += _expand_one(f"{head}{number:0{width}d}{tail}")
    return names


def expand_counts(counts: str) -> list[int]:
    """Slurm's per-node counts (``2(x3),1``) as one count per node."""
    result: list[int] = []
    for part in counts.split(","):
        found = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not found:
            raise ValueError(f"not a Slurm count list: {counts!r}")
        result += [int(found.group(1))] * int(found.group(2) or 1)
    return result


def allocation(environ: Mapping[str, str] = os.environ) -> dict[str, int]:
    """``{node: slots}`` of the Slurm allocation this process runs in ({} if none): the
    nodes of ``SLURM_JOB_NODELIST`` with ``SLURM_TASKS_PER_NODE`` slots each (what PRRTE's
    ``ras/slurm`` reads), or ``SLURM_JOB_CPUS_PER_NODE`` without tasks."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    counts = environ.get("SLURM_TASKS_PER_NODE") or environ.get("SLURM_JOB_CPUS_PER_NODE")
    if not environ.get("SLURM_JOB_ID") or not nodelist or not counts:
        return {}
    try:
        nodes, slots = expand_hostlist(nodelist), expand_counts(counts)
    except ValueError:
        return {}
    if len(nodes) != len(slots):
        return {}
    return dict(zip(nodes, slots))


def batch_script(job_id: str) -> str:
    """The batch script of Slurm job ``job_id`` ("" for an salloc or when unreadable)."""
    try:
        done = subprocess.run(["scontrol", "write", "batch_script", job_id, "-"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout if done.returncode == 0 else ""


def no_kill_seen(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this job visibly asked Slurm not to end it when a node fails."""
    for name in ("SBATCH_NO_KILL", "SALLOC_NO_KILL"):
        if environ.get(name, "").lower() not in ("", "0", "off", "no"):
            return True
    return bool(_NO_KILL_LINE.search(batch_script(environ.get("SLURM_JOB_ID", ""))))


def _names_hosts(args: argparse.Namespace) -> bool:
    return bool(args.hosts or args.hostfile or args.host_discovery_script or any(
        word.split("=")[0] in _HOST_OPTIONS for word in shlex.split(args.mpi_args or "")))


def at_start(args: argparse.Namespace,
             environ: Mapping[str, str] = os.environ) -> argparse.Namespace:
    """The launch arguments inside a Slurm allocation: its nodes and slots as ``-H`` when
    the user named no hosts, and a one-line warning when ``--no-kill`` was not seen on a
    job of several nodes.  Outside Slurm, ``args`` unchanged."""
    nodes = allocation(environ)
    if not nodes:
        return args
    if len(nodes) > 1 and not no_kill_seen(environ):
        _log.warning(f"elastic-hvd-run: Slurm job {environ.get('SLURM_JOB_ID')} was not seen "
                     "to have --no-kill: Slurm ends the whole allocation when one of its "
                     "nodes fails, before a relaunch can resume; add `#SBATCH --no-kill` "
                     "(docs/slurm.md)")
    if _names_hosts(args):
        return args
    args = copy.copy(args)
    args.hosts = ",".join(f"{node}:{slots}" for node, slots in nodes.items())
    return args
