"""No test may leave an Open MPI session directory behind.

prterun (mpirun) keeps its session directory in ``$TMPDIR/ompi.<its pid>`` and removes
it only when it ends by itself.  One left by a killed prterun makes a later prterun that
gets the same pid fail before any rank starts ("The PMIx server's listener thread
failed to start"): the CI failure of a plain-mpirun test, reproduced by planting such a
directory (tests/test_session_dirs.py).  So a test after which a new one is left fails
(it would fail an unrelated test later, 1 launch in 32 768).

A simulated host's daemon (prted) keeps its own in ``$TMPDIR/prted.<pid>``, and a killed
one leaves it too: a later daemon of the same host name that gets that pid then exits
with status 213 before it reports back (its PMIx listener cannot create
``pmix.<host>.tool``: the CI failure of a multi-host test, reproduced by planting them).
Tests that kill a daemon leave one on purpose, so these are removed after every test,
without failing it.

The jobs of one pytest process get a ``TMPDIR`` of their own (made at its start, removed
at its end), so these checks see only its own jobs' session directories: those of a
pytest-xdist worker beside it (``make test`` runs two), or of another test run on the
same machine, are not its business.  The pytest process's own temporary files
(``tmp_path``, with each job's output) stay in the usual place.

A test marked ``serial`` (it steers the kernel's next pid, or keeps both cores busy) runs
alone under pytest-xdist: no other worker's test runs meanwhile (:func:`alone_if_serial`).
"""

import contextlib
import fcntl
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

#: Known upstream failures: the ``upstream`` marker and its count (tests/known_failures.py).
pytest_plugins = ["known_failures"]

SESSION_DIR = re.compile(r"ompi\.(\d+)")
DAEMON_SESSION_DIR = re.compile(r"prted\.(\d+)")


#: The TMPDIR of this pytest process's jobs (see pytest_configure).
jobs_tmpdir: Path | None = None


def pytest_configure(config):
    global jobs_tmpdir
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    if worker == "main" and getattr(config.option, "numprocesses", None):
        return  # pytest-xdist's controller: it runs no test
    tempfile.gettempdir()  # fixed now: tmp_path stays under the usual temporary directory
    jobs_tmpdir = Path(tempfile.mkdtemp(prefix=f"ehvd-{worker}-"))
    os.environ["TMPDIR"] = str(jobs_tmpdir)  # inherited by every mpirun, prted and rank


def pytest_sessionfinish(session):
    # Here, not at unconfigure: pytest-xdist may end a worker before its unconfigure is done.
    if jobs_tmpdir is not None:
        shutil.rmtree(jobs_tmpdir, ignore_errors=True)


def _gone(pid, comm):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() != comm
    except OSError:
        return True


def stale_session_dirs():
    """prterun session directories in the jobs' temporary directory whose prterun is gone."""
    stale = set()
    for path in jobs_tmpdir.glob("ompi.*"):
        match = SESSION_DIR.fullmatch(path.name)
        if match is not None and _gone(match[1], "prterun"):
            stale.add(path)
    return stale


def stale_daemon_dirs():
    """prted session directories (``$TMPDIR/prted.<pid>``) whose prted is gone: a
    simulated host's daemon killed by a test leaves one, and a later prted of the same
    hostname that gets the same pid fails to start ("Daemon exit status: 213")."""
    return {path for path in jobs_tmpdir.glob("prted.*")
            if (m := DAEMON_SESSION_DIR.fullmatch(path.name)) and _gone(m[1], "prted")}


def remove(paths):
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def leaves_no_session_dir():
    before = stale_session_dirs()
    yield
    remove(stale_daemon_dirs())  # tests that kill a daemon leave them: no failure
    left = stale_session_dirs() - before
    if left:
        remove(left)
        pytest.fail(f"the test left Open MPI session directories of ended mpiruns behind: "
                    f"{sorted(p.name for p in left)} (removed now)")


@contextlib.contextmanager
def _flock(path, exclusive):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


@pytest.fixture(autouse=True)
def alone_if_serial(request, tmp_path_factory):
    """Under pytest-xdist, a test marked ``serial`` holds the run's test lock exclusively,
    every other test holds it shared: the serial one waits for the tests under way to
    end, and no test starts until it has ended.  A test that waits for the lock holds
    the turnstile meanwhile, so a serial one is not starved by the others' next tests."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    run = tmp_path_factory.getbasetemp().parent  # the workers' basetemps are popen-gw<N> in it
    serial = request.node.get_closest_marker("serial") is not None
    with contextlib.ExitStack() as held:
        with _flock(run / "turnstile.lock", exclusive=True):
            held.enter_context(_flock(run / "tests.lock", exclusive=serial))
        yield


def pytest_collection_modifyitems(config, items):
    """The tests that start a job first, the single-process ones (quick) after them, each
    file's order kept: under pytest-xdist the quick ones fill the end of the run evenly."""
    items.sort(key=lambda item: item.get_closest_marker("multirank") is None)
