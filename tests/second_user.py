"""Another local user, for the tests that attack a job as one would (issue 41): uid 65534
(``nobody``) through ``setpriv``.  The tests run as root, as CI does; skipped otherwise."""

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

NOBODY = 65534
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")


def as_nobody(*command, **options):
    """Run ``command`` as the second user; raises if it fails."""
    return subprocess.run([*AS_NOBODY, *map(str, command)], check=True, timeout=30, **options)


@contextlib.contextmanager
def reachable_dir(prefix, mode=0o755):
    """A new directory of ``mode`` that the second user can reach (pytest's temporary
    directories are private to root), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(mode)
    try:
        yield path
    finally:
        shutil.rmtree(path)
