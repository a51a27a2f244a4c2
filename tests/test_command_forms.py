"""A true exit status for every command (issue 41, finding 1): ``elastic-hvd-run``
returns the ranks' status, not mpirun's (0 under ULFM even when every rank
crashed), however the command is written -- a script, ``-m``, ``-c``, a wrapper
script that execs Python, a program that is not Python.  Before, only the first
two recorded how a rank ended; the others exited 0 without a word.

Real 2-rank jobs through the real launcher, real signals; then the supervisor
(``elastic_hvd.runner.supervisor``) alone, as the MPI daemon starts it.
"""

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_hvd.core import config
from elastic_hvd.runner import launch, reports, watch
from elastic_hvd.runner.command import build_command
from mpijob import WORKERS, _run

WORKER = WORKERS / "command_forms.py"
WRAPPER = WORKERS / "command_forms.sh"
#: The worker's cases for a program that is not Python (`sh -c SHELL sh CASE`).
SHELL = """case $1 in
  exit) exit 3 ;;
  crash) kill -ABRT $$ ;;
  kill) echo $$ > "$TEST_OUT_DIR/pid$OMPI_COMM_WORLD_RANK.tmp"
        mv "$TEST_OUT_DIR/pid$OMPI_COMM_WORLD_RANK.tmp" "$TEST_OUT_DIR/pid$OMPI_COMM_WORLD_RANK"
        exec sleep 60 ;;
esac"""
FORMS = {
    "script": ["python", str(WORKER)],
    "module": ["python", "-m", "tests.workers.command_forms"],
    "code": ["python", "-c", WORKER.read_text()],
    "wrapper_exec": [str(WRAPPER), "exec", str(WORKER)],
    # A wrapper that starts Python through elastic_hvd.runner.program as its child:
    # the rank is recorded twice (by the supervisor, by the program), counted once.
    "wrapper_child": [str(WRAPPER), "child", str(WORKER)],
    "not_python": ["sh", "-c", SHELL, "sh"],
}
#: case: (the launcher's exit status, the start of its one line after "exit status N: ",
#: or None for no line).  Both ranks do the same; one that exits non-zero may end the
#: job before the other has recorded its end (Open MPI ends a job when a process that
#: is not an MPI rank exits non-zero), hence no count of ranks there.
VERDICTS = {
    "success": (0, None),
    "exit": (3, "the program exited non-zero on "),
    "crash": (1, "no rank completed: all 2 ranks crashed (Aborted)"),
    "kill": (1, "no rank completed: all 2 ranks were killed"),
}
#: Where mpirun's status is not 0, the launcher returns it for a job no rank completed:
#: here the wrapper shell's, which says 128 + the signal that ended its child.
STATUS = {("wrapper_child", "crash"): 128 + signal.SIGABRT,
          ("wrapper_child", "kill"): 128 + signal.SIGKILL}


def kill_both(out_dir, _marker):
    """SIGKILL both ranks from outside, once each has written its pid."""
    from mpijob import until
    paths = [Path(out_dir) / f"pid{rank}" for rank in (0, 1)]
    until(lambda: all(p.exists() for p in paths), 60, "both ranks wrote their pids")
    for path in paths:
        os.kill(int(path.read_text()), signal.SIGKILL)


def summary(output):
    """The launcher's own lines, less its reports of each rank that raised or crashed."""
    return [line for line in output.splitlines() if line.startswith("elastic-hvd-run:")
            and not line.startswith(("elastic-hvd-run: rank ", "elastic-hvd-run: world rank "))]


@pytest.mark.multirank
@pytest.mark.parametrize("case", list(VERDICTS))
@pytest.mark.parametrize("form", list(FORMS))
def test_every_command_form_gets_the_ranks_exit_status(tmp_path, form, case):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    cmd = [sys.executable, "-m", "elastic_hvd.runner.launch", "-np", "2",
           "-x", f"TEST_OUT_DIR={out_dir}", "-x", f"TEST_PYTHON={sys.executable}",
           *FORMS[form], case]
    job = _run(cmd, {}, out_dir, 60, None, kill_both if case == "kill" else None)
    status, line = VERDICTS[case]
    status = STATUS.get((form, case), status)
    said = summary(job.output)
    assert job.returncode == status, (said, job.output[-3000:])
    if line is None:
        assert said == [], job.output[-3000:]
    else:
        assert len(said) == 1 and said[0].startswith(
            f"elastic-hvd-run: exit status {status}: {line}"), (said, job.output[-3000:])


@pytest.mark.multirank
def test_a_wrapper_jobs_replacements_record_their_end(tmp_path):
    # A wrapper script's ranks run under the supervisor; the processes spawned to
    # replace them run the rank's Python command (not the wrapper).  Both original ranks
    # are lost, replacements (ids 2, 3) finish the training: the job completed, and only
    # the replacements' own records can say so.
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    cmd = [sys.executable, "-m", "elastic_hvd.runner.launch", "-np", "2", "--respawn",
           "--faults", "rank=0,step=10;rank=1,step=60", "--mpi-args=--oversubscribe",
           "-x", "ELASTIC_HVD_OVERSUBSCRIBE=1", "-x", "ELASTIC_HVD_SPAWN_TIMEOUT=20",
           "-x", f"TEST_OUT_DIR={out_dir}", "-x", f"TEST_PYTHON={sys.executable}",
           str(WRAPPER), "exec", str(WORKERS / "growth_scenarios.py"), "120"]
    # The replacements import the worker's helpers with mpirun's environment.
    path = os.pathsep.join(filter(None, (os.environ.get("PYTHONPATH"), str(WORKERS))))
    job = _run(cmd, {"PYTHONPATH": path}, out_dir, 120, None, None)
    assert sorted(job.results) == [2, 3], job.output[-3000:]
    assert job.returncode == 0, (summary(job.output), job.output[-3000:])
    assert not any("no rank completed" in line for line in summary(job.output)), job.output


@pytest.mark.parametrize("command, wrapped", [
    (["python", "x.py"], "program"), (["python", "-u", "-m", "m"], "program"),
    (["python", "-c", "pass"], "program"), (["python3", "-cpass"], "program"),
    (["./run.sh", "a"], "supervisor"), (["sh", "-c", "exit 3"], "supervisor"),
    (["python", "-"], "supervisor")])
def test_every_command_is_recorded_by_one_wrapper(command, wrapped):
    cmd = build_command(launch.parser().parse_args(["-np", "2", *command]), "mpirun")
    modules = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "-m"]
    assert [m for m in modules if m.startswith("elastic_hvd.runner.")] == \
        [f"elastic_hvd.runner.{wrapped}"], cmd
    assert cmd[-1] == command[-1], cmd


def test_a_crash_at_one_place_is_reported_once_whatever_the_form():
    # A Python rank's stack names its thread, whose id differs in every process; a
    # supervised rank has no stack.  Either way the second one is said in one line.
    out = io.StringIO()
    reporter = reports.Reporter(out=out)

    def crashed(world, stack):
        return {"process": f"h-{world}", "id": None, "world": str(world), "code": None,
                "crashed": "Aborted", "fault_stack": stack}

    reporter.news([crashed(i, f"Current thread 0x{i:016x} (most recent call first):\n"
                              '  File "a.py", line 4 in <module>') for i in (0, 1)])
    reporter.news([crashed(i, "") for i in (2, 3)])
    assert out.getvalue() == (
        "elastic-hvd-run: world rank 0 crashed (Aborted) and left the job; its Python stack:\n"
        "Current thread 0x0000000000000000 (most recent call first):\n"
        '  File "a.py", line 4 in <module>\n'
        "elastic-hvd-run: world rank 1 crashed the same at the same place as world rank 0\n"
        "elastic-hvd-run: world rank 2 crashed (Aborted) and left the job\n"
        "elastic-hvd-run: world rank 3 crashed the same at the same place as world rank 2\n")


# The supervisor alone, started as Open MPI's daemon starts a rank: in a process group
# of its own (setpgid), its status directory named by the variable the launcher names.

def supervised(tmp_path, *command):
    status_dir = tmp_path / "status"
    status_dir.mkdir(exist_ok=True)
    variable = config.env("status_dir")
    return subprocess.Popen(
        [sys.executable, "-m", "elastic_hvd.runner.supervisor", variable, *command],
        env={**os.environ, variable: str(status_dir)}, process_group=0), status_dir


def records(status_dir):
    return {int(p.stem.rpartition("-")[2]): json.loads(p.read_text())
            for p in status_dir.glob("*.json")}


def wait_for(path, seconds=20):
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never came"
        time.sleep(0.02)
    return path.read_text()


@pytest.mark.parametrize("command, returncode, record", [
    (["sh", "-c", "exit 3"], 3, {"code": 3}),
    (["sh", "-c", "kill -ABRT $$"], -signal.SIGABRT,
     {"code": None, "signal": "SIGABRT", "crashed": "Aborted"}),
    (["sh", "-c", "kill -KILL $$"], -signal.SIGKILL, {"code": None, "signal": "SIGKILL"}),
    (["/nonexistent/program"], 127, {"code": 127}),
])
def test_the_supervisor_ends_as_its_child_and_records_it(tmp_path, command, returncode, record):
    # The same status, or the same signal on itself: for Open MPI a rank that exits
    # 128 + 9 is not one killed by SIGKILL.
    proc, status_dir = supervised(tmp_path, *command)
    assert proc.wait(timeout=20) == returncode
    [(pid, written)] = records(status_dir).items()
    assert {k: written.get(k) for k in record} == record, written
    assert written["supervised"] and written["id"] is None
    assert pid != proc.pid or returncode == 127  # the child's pid (none was started: its own)


def test_a_child_that_execs_the_python_wrapper_keeps_its_own_record(tmp_path):
    # Same pid, so the same file: program.py's record (which says more) stays.
    proc, status_dir = supervised(tmp_path, "sh", "-c", f"exec {sys.executable} -m "
                                  "elastic_hvd.runner.program -c 'import sys; sys.exit(4)'")
    assert proc.wait(timeout=60) == 4
    [written] = records(status_dir).values()
    assert written["code"] == 4 and "supervised" not in written, written


#: A child that counts the SIGTERMs it gets (for a second after the first), says
#: it is ready in the file named by its argument, and exits with that count.
COUNTER = """
import os, signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda *_: got.append(1))
open(sys.argv[1] + ".tmp", "w").close()
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
end = time.monotonic() + 30
while not got and time.monotonic() < end:
    time.sleep(0.02)
time.sleep(1)
sys.exit(len(got))
"""


@pytest.mark.parametrize("sender", ["another process", "the daemon, to the process group"])
def test_a_signal_reaches_the_child_once(tmp_path, sender):
    # Sent to the supervisor alone, it is passed on; sent by its parent (Open MPI's
    # daemon signals a rank's whole process group), the child has it already.  The
    # child exits with the number of SIGTERMs it got.
    ready = tmp_path / "ready"
    proc, _ = supervised(tmp_path, sys.executable, "-c", COUNTER, str(ready))
    wait_for(ready)
    if sender == "another process":
        subprocess.run(["kill", "-TERM", str(proc.pid)], check=True)
    else:
        os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=20) == 1


def test_a_killed_supervisor_leaves_no_child(tmp_path):
    pid_file = tmp_path / "pid"
    proc, _ = supervised(tmp_path, "sh", "-c", f"echo $$ > {pid_file}.tmp && "
                         f"mv {pid_file}.tmp {pid_file} && exec sleep 60")
    child = int(wait_for(pid_file))
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while watch.process_state(child) not in ("", "Z", "X"):
        assert time.monotonic() < deadline, "the child outlived its supervisor"
        time.sleep(0.05)
