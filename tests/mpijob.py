"""Run a real multi-rank job, or one process, for a test: hard timeout, nothing left behind.

Every job runs in its own session; on timeout (or when the test is done) the whole
session and every descendant is killed, so a hang fails the test instead of
stalling CI, and no mpirun/prted/python is left over.
"""

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

import known_failures
from elastic_hvd.core import procfs

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "workers"


@dataclasses.dataclass
class Job:
    returncode: int
    output: str
    results: dict  # original id -> the JSON a rank wrote
    seconds: float
    out_dir: Path | None = None  # TEST_OUT_DIR of its ranks


def _descendants(pid):
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = procfs.stat_fields(f"/proc/{entry}/stat")
            if fields:
                children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def proc_entries(pid, what):
    """``/proc/PID/<what>`` (``environ``: the environment it started with; ``cmdline``),
    as bytes entries ([] if gone or not ours)."""
    try:
        with open(f"/proc/{pid}/{what}", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def job_processes(marker, *wanted):
    """PIDs of the processes of the job marked ``marker`` (see run_job) whose
    environment has an entry starting with each of ``wanted`` (``"PMIX_HOSTNAME=hostB"``)."""
    needed = [f"{JOB_MARKER}={marker}".encode(), *(w.encode() for w in wanted)]
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            env = proc_entries(entry, "environ")
            if all(any(e.startswith(n) for e in env) for n in needed):
                found.append(int(entry))
    return sorted(found)


def parent_of(pid):
    """The parent process of ``pid`` (a rank's parent is its host's Open MPI daemon)."""
    fields = procfs.stat_fields(f"/proc/{pid}/stat")
    if fields is None:
        raise ProcessLookupError(f"process {pid} is gone")
    return int(fields[1])


def process_state(pid):
    """The state letter of ``pid`` (``T`` stopped, ``Z`` zombie...), or None if gone."""
    fields = procfs.stat_fields(f"/proc/{pid}/stat")
    return fields[0] if fields else None


def job_ranks(marker, host=None):
    """``{MPI_COMM_WORLD rank: pid}`` of the job's ranks started by mpirun (on ``host``)."""
    ranks = {}
    for pid in job_processes(marker, *([f"PMIX_HOSTNAME={host}"] if host else [])):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"elastic_hvd.runner.program" not in f.read().split(b"\0"):
                    continue
        except OSError:
            continue
        rank = [e for e in proc_entries(pid, "environ") if e.startswith(b"OMPI_COMM_WORLD_RANK=")]
        if rank:
            ranks[int(rank[0].split(b"=")[1])] = pid
    return ranks


def spawned_processes(marker):
    """PIDs of the job's processes that Open MPI spawned (they run the join wrapper)."""
    pids = []
    for pid in job_processes(marker):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"elastic_hvd.runner.join" in f.read().split(b"\0"):
                pids.append(pid)
    return pids


@contextlib.contextmanager
def killed_at_the_end(pids):
    """Yields ``pids`` (a list the test fills, e.g. with processes it stopped) and SIGKILLs
    each of them at the end, whatever happened: no stopped process outlives its test."""
    try:
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def kill_tree(proc, marker=None):
    """SIGKILL ``proc``'s session and every descendant (also stopped ones), and every
    process of the job marked ``marker``: a simulated host's daemon detaches itself."""
    victims = _descendants(proc.pid) + (job_processes(marker) if marker else [])
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


#: Environment variable that marks every process of one test job (see kill_tree).
JOB_MARKER = "ELASTIC_HVD_TEST_JOB"
HOSTS_DIR = ROOT / "tests" / "hosts"
#: mpirun options for simulated hosts (tests/hosts/agent.sh), inside tests/hosts/netns.sh.
SIMULATED_HOSTS_ARGS = (
    f"--prtemca plm_ssh_agent {HOSTS_DIR / 'agent.sh'} --prtemca plm_ssh_no_tree_spawn 1 "
    "--prtemca oob_tcp_if_include simhost0 --mca btl_tcp_if_include simhost0 "
    "--pmixmca ptl_base_if_include lo")


def run_job(worker, *args, np=4, timeout=120, faults=None, launcher=(), env=None,
            tmp_path=None, expect_rc=0, watcher=None, hosts=None, hostfile=False,
            launcher_env=None):
    """Launch ``tests/workers/<worker>`` on ``np`` ranks through elastic-hvd-run
    (``env``: exported to the ranks with ``-x``; ``launcher_env``: the launcher's own).

    ``watcher(out_dir, marker)``, if given, runs in a thread while the job runs (e.g.
    to kill a rank from outside at a moment no hook chose; ``job_processes(marker,
    ...)`` finds them).  ``hosts`` (``"hostA:2,hostB:2"``): run on simulated hosts,
    each with its own daemon and hostname, talking TCP (see tests/hosts/), given
    with ``-H`` or, with ``hostfile``, in an Open MPI hostfile."""
    out_dir = Path(tmp_path) / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "elastic_hvd.runner.launch", "-np", str(np), *launcher]
    if hosts:
        where = ["-H", hosts]
        if hostfile:
            path = Path(tmp_path) / "hostfile"
            path.write_text("".join(f"{h.split(':')[0]} slots={h.split(':')[1]}\n"
                                    for h in hosts.split(",")))
            where = ["--hostfile", str(path)]
        cmd = [str(HOSTS_DIR / "netns.sh"), *cmd, *where, "--mpi-args", SIMULATED_HOSTS_ARGS]
    if faults:
        cmd += ["--faults", faults]
    cmd += ["-x", f"TEST_OUT_DIR={out_dir}"]
    # A spawn that never completes (rare) is given up after this many seconds; the
    # default 60 (+ the stuck joiner's own deadline) would not fit the tests' timeouts.
    env = {"ELASTIC_HVD_SPAWN_TIMEOUT": "20", **(env or {})}
    for name, value in env.items():
        cmd += ["-x", f"{name}={value}"]
    cmd += ["python", str(WORKERS / worker), *map(str, args)]
    return _run(cmd, launcher_env or {}, out_dir, timeout, expect_rc, watcher)


def run_plain_mpirun(np, env, command, timeout=90):
    """``(exit status, output)`` of ``command`` on ``np`` ranks under plain ``mpirun
    --with-ft ulfm`` (``env``: exported with ``-x``); a hang fails the test."""
    from elastic_hvd.runner.command import find_mpirun
    cmd = [find_mpirun(), "-np", str(np), "--with-ft", "ulfm", "--allow-run-as-root",
           *(arg for name, value in env.items() for arg in ("-x", f"{name}={value}")),
           *map(str, command)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"plain mpirun hung for {timeout}s: {' '.join(cmd)}")
    finally:
        kill_tree(proc)
    return proc.returncode, output


def run_process(worker, *args, tmp_path, timeout=120, expect_rc=0):
    """Run ``tests/workers/<worker>`` as one plain process, without mpirun: its
    ``init()`` makes a one-rank MPI job of it (a singleton)."""
    out_dir = Path(tmp_path) / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {"TEST_OUT_DIR": str(out_dir)}
    cmd = [sys.executable, str(WORKERS / worker), *map(str, args)]
    return _run(cmd, env, out_dir, timeout, expect_rc, None)


class WatcherFailed(AssertionError):
    """A watcher's moment did not come: its deadline passed, or the job ended first."""


#: In a watcher's thread: ``ended``, the event set when its job has ended.
_watching = threading.local()


def until(condition, within, what, every=0.05):
    """Call ``condition()`` every ``every`` seconds until it returns something true, and
    return that.  Raises :class:`WatcherFailed` when ``within`` seconds pass first or, in
    a watcher, when its job ends first: a watcher never acts on a moment that did not
    come, and run_job re-raises the error in the test."""
    deadline = time.monotonic() + within
    ended = getattr(_watching, "ended", None)
    while True:
        value = condition()
        if value:
            return value
        if ended is not None and ended.is_set():
            raise WatcherFailed(f"the job ended before {what}")
        if time.monotonic() > deadline:
            raise WatcherFailed(f"not within {within} s: {what}")
        time.sleep(every)


class _Watcher(threading.Thread):
    """Runs a test's ``watcher(out_dir, marker)`` beside its job and keeps what it raised."""

    #: Seconds a watcher may still run after its job ended (its waits end at once).
    GRACE = 30

    def __init__(self, watcher, out_dir, marker):
        super().__init__(target=watcher, args=(out_dir, marker), daemon=True)
        self.ended = threading.Event()
        self.error = None

    def run(self):
        _watching.ended = self.ended
        try:
            super().run()
        except BaseException as exc:  # noqa: BLE001 -- every error goes to the test
            self.error = exc

    def outcome(self):
        """None once the watcher returned; else why the test fails (it raised, or runs on)."""
        self.join(self.GRACE)
        if self.is_alive():
            return f"the watcher still ran {self.GRACE} s after the job ended"
        return self.error


def _run(cmd, env, out_dir, timeout, expect_rc, watcher):
    """Run ``cmd`` (with ``env`` added to ours) in its own session, killed with every
    descendant and every process marked as the job's when done or after ``timeout``
    seconds; the JSON its ranks wrote to ``out_dir`` read back.  What ``watcher``
    raised fails the test."""
    started = time.monotonic()
    marker = uuid.uuid4().hex
    known_failures.out_dirs.append(out_dir)  # where its records of upstream failures go
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=ROOT,
                            env={**os.environ, **env, JOB_MARKER: marker})
    watch = None if watcher is None else _Watcher(watcher, out_dir, marker)
    if watch is not None:
        watch.start()
    # Read until EOF in a thread, but wait for the launcher itself: a frozen process
    # (a stopped daemon in a test) may hold the pipe open after the launcher is done.
    chunks = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    hung = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        hung = True
    finally:
        if watch is not None:
            watch.ended.set()
        kill_tree(proc, marker)
    reader.join(10)
    output = "".join(chunks)
    (out_dir.parent / "job.log").write_text(output)  # whole, for a failure's post-mortem
    watched = None if watch is None else watch.outcome()
    if hung:
        pytest.fail(f"job hung for {timeout}s and was killed: {' '.join(cmd)}"
                    + (f" (its watcher: {watched!r})" if watched else "")
                    + f"\n{output[-6000:]}")
    if isinstance(watched, BaseException):
        watched.add_note(f"raised by the job's watcher; the job's output:\n{output[-6000:]}")
        raise watched
    if watched:
        pytest.fail(f"{watched}\n{output[-6000:]}")
    results = {}
    for path in out_dir.glob("rank*.json"):
        results[int(path.stem[4:])] = json.loads(path.read_text())
    job = Job(proc.returncode, output, results, time.monotonic() - started, out_dir)
    if expect_rc is not None:
        assert job.returncode == expect_rc, f"exit status {job.returncode}\n{output[-6000:]}"
    return job


def assert_resumed_from_the_kept_copy(job, out):
    """A job ``elastic-hvd-run`` relaunched (``elastic_fit.py``) finished on 4 ranks with
    the same weights after every step of each launch, and resumed from its copy of the
    last committed step of the first launch, or the one before (the copy is sent after
    a step while the previous send is not in flight): that step's exact weights.
    Returns (the first launch's last step, the step the relaunch resumed from)."""
    assert sorted(job.results) == [0, 1, 2, 3], job.output[-4000:]
    assert_same_weights_every_step(out)  # in each launch
    first = [json.loads(line) for line in (out / "steps0.jsonl").read_text().splitlines()
             if json.loads(line)["launch"] == 0]
    done = max(e["step"] for e in first)
    restored = job.results[0]["restored"]
    assert done - 1 <= restored["step"] <= done, (done, restored["step"])
    assert restored["digest"] == next(e["digest"] for e in first if e["step"] == restored["step"])
    assert f"from the launcher's copy of step {restored['step']}" in job.output
    return done, restored["step"]


def assert_same_weights_every_step(out):
    """Every rank has the same weights after each committed step (``stepcheck.py``),
    in each launch of the job."""
    by_step = {}
    for path in Path(out).glob("steps*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            step = (entry.get("launch", 0), entry["step"])  # a relaunch redoes steps
            by_step.setdefault(step, {}).setdefault(entry["digest"], []).append(
                (path.stem, entry["epoch"], entry["batch"]))
    assert by_step, "no step digests written"
    for step, digests in sorted(by_step.items()):
        assert len(digests) == 1, f"ranks differ after step {step}: {digests}"
