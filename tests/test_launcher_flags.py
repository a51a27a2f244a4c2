"""``elastic-hvd-run`` refuses an impossible flag before it starts anything, and names a
missing ``horovod`` module's way out (issue 42, findings 5 and 6).

Before: ``--heartbeat-timeout -5`` started the job, and seconds later every rank printed
a traceback naming ``ELASTIC_HVD_HEARTBEAT_TIMEOUT``; the same value through ``-x`` was
refused in one line.  ``-np 0`` ran a job on every core with exit status 0, and
``--dry-run`` checked nothing.  Now a flag meets the check a ``-x`` meets, in the same
words, naming what the user typed, with exit status 2; ``--dry-run`` too.  And an
unchanged Horovod script launched without ``--as-horovod`` only said
``ModuleNotFoundError: No module named 'horovod'``.
"""

import subprocess
import sys
import time

import pytest

from elastic_hvd.core import config
from elastic_hvd.runner.outcome import HOROVOD_HINT
from mpijob import ROOT, run_job

DOC = {s.name: s.doc for s in config.SETTINGS}
#: A command that starts elastic_hvd (its ranks check their settings then) and no more:
#: where a refused flag was let through, the job is over in seconds.
COMMAND = ["python", "-c", "from elastic_hvd.basics import init; init()"]

# case: (the flags, the one line the launcher says)
REFUSED = {
    "negative_heartbeat_timeout": (
        ["-np", "2", "--heartbeat-timeout", "-5"],
        f"--heartbeat-timeout -5: must be at least 0.001 ({DOC['heartbeat_timeout']})"),
    "heartbeat_timeout_not_above_3_periods": (
        ["-np", "2", "--heartbeat-timeout", "2"],
        "--heartbeat-timeout (2.0s) must exceed 3 x --heartbeat-period (1.0s): Open MPI "
        "refuses less"),
    "heartbeat_pair_from_a_flag_and_a_x": (
        ["-np", "2", "--heartbeat-period", "1", "-x", "ELASTIC_HVD_HEARTBEAT_TIMEOUT=2"],
        "ELASTIC_HVD_HEARTBEAT_TIMEOUT (2.0s) must exceed 3 x --heartbeat-period (1.0s): "
        "Open MPI refuses less"),
    "infinite_stall_timeout": (
        ["-np", "2", "--stall-timeout", "inf"],
        f"--stall-timeout inf: must be a finite number ({DOC['stall_timeout']})"),
    "not_a_number": (
        ["-np", "2", "--discovery-interval", "soon"],
        "--discovery-interval soon: could not convert string to float: 'soon' "
        f"({DOC['discovery_interval']})"),
    "np_0": (["-np", "0"], "-np 0: must be at least 1 (the number of ranks to start)"),
    "no_slots": (["-H", "a:2,b:0"],
                 "-H a:2,b:0: 'b:0' is not host or host:slots (slots: a whole number, at "
                 "least 1)"),
    "negative_spares": (["-np", "2", "--spares", "-1"],
                        f"--spares -1: must be at least 0 ({DOC['spares']})"),
    "min_np_above_np": (["-np", "2", "--min-np", "3"],
                        "--min-np 3: must be at most the number of ranks (-np 2): the job "
                        "would stop at its start"),
    "min_np_above_np_by_x": (["-np", "2", "-x", "ELASTIC_HVD_MIN_NP=3"],
                             "ELASTIC_HVD_MIN_NP='3': must be at most the number of ranks "
                             "(-np 2): the job would stop at its start"),
    "max_np_below_np": (["-np", "2", "--max-np", "1", "--host-discovery-script", "/bin/true"],
                        "--max-np 1: must be at least the number of ranks (-np 2)"),
    "max_np_without_host_source": (["-np", "2", "--max-np", "4"],
                                   "--max-np 4: needs a host source: --host-discovery-script "
                                   "or --hostfile"),
    "negative_max_relaunches": (["-np", "2", "--max-relaunches", "-1"],
                                "--max-relaunches -1: must be at least 0 (0: never)"),
    "flag_and_x_for_one_setting": (
        ["-np", "2", "--heartbeat-timeout", "5", "-x", "ELASTIC_HVD_HEARTBEAT_TIMEOUT=6"],
        "--heartbeat-timeout 5 and -x ELASTIC_HVD_HEARTBEAT_TIMEOUT=6 both set "
        "ELASTIC_HVD_HEARTBEAT_TIMEOUT: give one of them"),
    "dry_run_checks_too": (
        ["-np", "2", "--dry-run", "--heartbeat-timeout", "-5"],
        f"--heartbeat-timeout -5: must be at least 0.001 ({DOC['heartbeat_timeout']})"),
}


def launcher(*argv):
    """Run elastic-hvd-run with ``argv``: (its completed process, seconds it took)."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "elastic_hvd.runner.launch", *argv],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          start_new_session=True)
    return proc, time.monotonic() - started


@pytest.mark.parametrize("case", list(REFUSED))
def test_an_impossible_flag_is_refused_at_once_in_one_line_naming_it(case):
    flags, line = REFUSED[case]
    proc, took = launcher(*flags, *COMMAND)
    assert (proc.returncode, proc.stderr.splitlines(), proc.stdout) == (
        2, [f"elastic-hvd-run: {line}"], ""), proc.stderr[-3000:]
    assert took < 2, f"{took:.1f}s"


def test_a_good_dry_run_prints_the_command():
    # (the heartbeat pair at its rule's edge: --heartbeat-timeout 2 is fine with a 0.5 s period)
    proc, _ = launcher("-np", "2", "--dry-run", "--heartbeat-period", "0.5",
                       "--heartbeat-timeout", "2", "--spares", "1", "--min-np", "2", *COMMAND)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    [line] = proc.stdout.splitlines()
    for part in ("mpirun -np 3 --with-ft ulfm", "-x ELASTIC_HVD_HEARTBEAT_TIMEOUT=2.0",
                 "-x ELASTIC_HVD_HEARTBEAT_PERIOD=0.5", "-x ELASTIC_HVD_MIN_NP=2",
                 "-x ELASTIC_HVD_SPARES=1", "-m elastic_hvd.runner.program -c 'from "):
        assert part in line, line


@pytest.mark.multirank
def test_a_horovod_script_without_as_horovod_is_told_to_use_it(tmp_path):
    job = run_job("horovod_import.py", np=2, tmp_path=tmp_path, timeout=60, expect_rc=None)
    assert job.returncode != 0 and not job.results, job.output[-3000:]
    assert "ModuleNotFoundError: No module named 'horovod'" in job.output, job.output[-3000:]
    assert job.output.count(f"elastic-hvd-run: {HOROVOD_HINT}\n") == 1, job.output[-3000:]
