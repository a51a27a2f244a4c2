"""No test may leave an Open MPI session directory behind.

prterun (mpirun) keeps its session directory in ``$TMPDIR/ompi.<its pid>`` and removes
it only when it ends by itself.  One left by a killed prterun makes a later prterun that
gets the same pid fail before any rank starts ("The PMIx server's listener thread
failed to start"): the CI failure of a plain-mpirun test, reproduced by planting such a
directory (tests/test_session_dirs.py).  So a test after which a new one is left fails,
and ones found at the start (from a killed mpirun, before this run) are removed, with a
line saying so: they would fail an unrelated test later, 1 launch in 32 768 each.
"""

import re
import shutil
import tempfile
from pathlib import Path

import pytest

SESSION_DIR = re.compile(r"ompi\.(\d+)")


def stale_session_dirs():
    """prterun session directories in the temporary directory whose prterun is gone."""
    stale = set()
    for path in Path(tempfile.gettempdir()).glob("ompi.*"):
        match = SESSION_DIR.fullmatch(path.name)
        if match is None:
            continue
        try:
            with open(f"/proc/{match[1]}/comm") as f:
                running = f.read().strip() == "prterun"
        except OSError:
            running = False
        if not running:
            stale.add(path)
    return stale


def remove(paths):
    for path in paths:
        shutil.rmtree(path)


def pytest_sessionstart(session):
    found = stale_session_dirs()
    if found:
        remove(found)
        print(f"\nremoved {len(found)} session directories of mpiruns killed before this run "
              f"({', '.join(sorted(p.name for p in found))}): a later mpirun with the same "
              "pid could not start")


@pytest.fixture(autouse=True)
def leaves_no_session_dir():
    before = stale_session_dirs()
    yield
    left = stale_session_dirs() - before
    if left:
        remove(left)
        pytest.fail(f"the test left Open MPI session directories of ended mpiruns behind: "
                    f"{sorted(p.name for p in left)} (removed now)")
