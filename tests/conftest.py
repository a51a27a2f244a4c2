"""No test may leave an Open MPI session directory behind.

prterun (mpirun) keeps its session directory in ``$TMPDIR/ompi.<its pid>`` and removes
it only when it ends by itself.  One left by a killed prterun makes a later prterun that
gets the same pid fail before any rank starts ("The PMIx server's listener thread
failed to start"): the CI failure of a plain-mpirun test, reproduced by planting such a
directory (tests/test_session_dirs.py).  So a test after which a new one is left fails,
and ones found at the start (from a killed mpirun, before this run) are removed, with a
line saying so: they would fail an unrelated test later, 1 launch in 32 768 each.

A simulated host's daemon (prted) keeps its own in ``$TMPDIR/prted.<pid>``, and a killed
one leaves it too: a later daemon of the same host name that gets that pid then exits
with status 213 before it reports back (its PMIx listener cannot create
``pmix.<host>.tool``: the CI failure of a multi-host test, reproduced by planting them).
Tests that kill a daemon leave one on purpose, so these are removed after every test,
without failing it.
"""

import re
import shutil
import tempfile
from pathlib import Path

import pytest

#: Known upstream failures: the ``upstream`` marker and its count (tests/known_failures.py).
pytest_plugins = ["known_failures"]

SESSION_DIR = re.compile(r"ompi\.(\d+)")
DAEMON_SESSION_DIR = re.compile(r"prted\.(\d+)")


def _gone(pid, comm):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() != comm
    except OSError:
        return True


def stale_session_dirs():
    """prterun session directories in the temporary directory whose prterun is gone."""
    stale = set()
    for path in Path(tempfile.gettempdir()).glob("ompi.*"):
        match = SESSION_DIR.fullmatch(path.name)
        if match is not None and _gone(match[1], "prterun"):
            stale.add(path)
    return stale


def stale_daemon_dirs():
    """prted session directories (``$TMPDIR/prted.<pid>``) whose prted is gone: a
    simulated host's daemon killed by a test leaves one, and a later prted of the same
    hostname that gets the same pid fails to start ("Daemon exit status: 213")."""
    return {path for path in Path(tempfile.gettempdir()).glob("prted.*")
            if (m := DAEMON_SESSION_DIR.fullmatch(path.name)) and _gone(m[1], "prted")}


def remove(paths):
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def pytest_sessionstart(session):
    found = stale_session_dirs()
    if found:
        remove(found)
        print(f"\nremoved {len(found)} session directories of mpiruns killed before this run "
              f"({', '.join(sorted(p.name for p in found))}): a later mpirun with the same "
              "pid could not start")
    remove(stale_daemon_dirs())


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
