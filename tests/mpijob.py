"""Run a real multi-rank job, or one process, for a test: hard timeout, nothing left behind.

Every job runs in its own session; on timeout (or when the test is done) the whole
session and every descendant is killed, so a hang fails the test instead of
stalling CI, and no mpirun/prted/python is left over.
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "workers"


@dataclasses.dataclass
class Job:
    returncode: int
    output: str
    results: dict  # original id -> the JSON a rank wrote
    seconds: float


def _descendants(pid):
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(proc):
    """SIGKILL ``proc``'s session and every descendant (also stopped ones)."""
    victims = _descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def run_job(worker, *args, np=4, timeout=120, faults=None, launcher=(), env=None,
            tmp_path=None, expect_rc=0, watcher=None):
    """Launch ``tests/workers/<worker>`` on ``np`` ranks through elastic-hvd-run.

    ``watcher(out_dir)``, if given, runs in a thread while the job runs (e.g. to
    kill a rank from outside at a moment no hook chose)."""
    out_dir = Path(tmp_path) / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "elastic_hvd.runner.launch", "-np", str(np), *launcher]
    if faults:
        cmd += ["--faults", faults]
    cmd += ["-x", f"TEST_OUT_DIR={out_dir}"]
    # A spawn that never completes (rare) is given up after this many seconds; the
    # default 60 (+ the stuck joiner's own deadline) would not fit the tests' timeouts.
    env = {"ELASTIC_HVD_SPAWN_TIMEOUT": "20", **(env or {})}
    for name, value in env.items():
        cmd += ["-x", f"{name}={value}"]
    cmd += ["python", str(WORKERS / worker), *map(str, args)]
    return _run(cmd, None, out_dir, timeout, expect_rc, watcher)


def run_process(worker, *args, tmp_path, timeout=120, expect_rc=0):
    """Run ``tests/workers/<worker>`` as one plain process, without mpirun: its
    ``init()`` makes a one-rank MPI job of it (a singleton)."""
    out_dir = Path(tmp_path) / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TEST_OUT_DIR": str(out_dir)}
    cmd = [sys.executable, str(WORKERS / worker), *map(str, args)]
    return _run(cmd, env, out_dir, timeout, expect_rc, None)


def _run(cmd, env, out_dir, timeout, expect_rc, watcher):
    """Run ``cmd`` in its own session, killed with every descendant when done or
    after ``timeout`` seconds; the JSON its ranks wrote to ``out_dir`` read back."""
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=ROOT, env=env)
    if watcher is not None:
        threading.Thread(target=watcher, args=(out_dir,), daemon=True).start()
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        output, _ = proc.communicate()
        pytest.fail(f"job hung for {timeout}s and was killed: {' '.join(cmd)}\n{output[-6000:]}")
    finally:
        kill_tree(proc)
    results = {}
    for path in out_dir.glob("rank*.json"):
        results[int(path.stem[4:])] = json.loads(path.read_text())
    job = Job(proc.returncode, output, results, time.monotonic() - started)
    if expect_rc is not None:
        assert job.returncode == expect_rc, f"exit status {job.returncode}\n{output[-6000:]}"
    return job


def assert_same_weights_every_step(out):
    """Every rank has the same weights after each committed step (``stepcheck.py``)."""
    by_step = {}
    for path in Path(out).glob("steps*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            by_step.setdefault(entry["step"], {}).setdefault(entry["digest"], []).append(
                (path.stem, entry["epoch"], entry["batch"]))
    assert by_step, "no step digests written"
    for step, digests in sorted(by_step.items()):
        assert len(digests) == 1, f"ranks differ after step {step}: {digests}"
