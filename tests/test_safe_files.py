"""core/safe_files.py: what another local user leaves in the job's way is refused, not used.

The second user is real (tests/second_user.py).
"""

import os
import stat
import threading

import pytest

from elastic_hvd.core import safe_files
from elastic_hvd.core.safe_files import UnsafePathError
from second_user import as_nobody, needs_root, reachable_dir

@pytest.fixture
def sticky():
    """A world-writable sticky directory, as /tmp is, that the second user can reach."""
    with reachable_dir("safe_files-", 0o1777) as path:
        yield path


def test_a_directory_it_creates_is_private(tmp_path):
    made = safe_files.checked_dir(tmp_path / "a" / "b", "the board", shared=False)
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700


@needs_root
def test_a_directory_another_user_made_first_is_refused(sticky):
    as_nobody("mkdir", "-m", "700", str(sticky / "board"))
    with pytest.raises(UnsafePathError, match=r"^the board .*/board belongs to uid 65534, not "
                                              r"to this job's user \(root\): refused"):
        safe_files.checked_dir(sticky / "board", "the board", shared=False)


def test_a_directory_others_may_write_is_refused_unless_shared_is_meant(sticky):
    with pytest.raises(UnsafePathError, match="writable by group or others .mode 1777."):
        safe_files.checked_dir(sticky, "the checkpoint directory", shared=False)
    assert safe_files.checked_dir(sticky, "the checkpoint directory", shared=True) == str(sticky)


def test_the_setting_says_whether_shared_is_meant(sticky, monkeypatch):
    monkeypatch.setenv("ELASTIC_HVD_SHARED_DIRS", "1")
    assert safe_files.checked_dir(sticky, "the board") == str(sticky)
    monkeypatch.setenv("ELASTIC_HVD_SHARED_DIRS", "0")
    with pytest.raises(UnsafePathError, match="ELASTIC_HVD_SHARED_DIRS=1"):
        safe_files.checked_dir(sticky, "the board")


def test_a_file_in_place_of_the_directory_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(UnsafePathError, match="f is not a directory$"):
        safe_files.checked_dir(tmp_path / "f", "the board", shared=False)
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(UnsafePathError, match="link is not a directory$"):
        safe_files.checked_dir(tmp_path / "link", "the board", shared=False)


@pytest.mark.parametrize("plant", ["symlink", "fifo", "directory", "device", "too_big"])
def test_only_a_regular_file_within_its_cap_is_read(tmp_path, plant):
    path, target = tmp_path / "state", tmp_path / "target"
    target.write_bytes(b"x" * 10)
    if plant == "symlink":
        path.symlink_to(target)
    elif plant == "fifo":
        os.mkfifo(path)
    elif plant == "directory":
        path.mkdir()
    elif plant == "device":
        path.symlink_to("/dev/zero")
    else:
        path.write_bytes(b"x" * 11)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(_attempt(path)), daemon=True)
    reader.start()
    reader.join(10)
    assert got, "the read blocked"  # a FIFO without a writer blocks a plain open() for ever
    assert isinstance(got[0], UnsafePathError) and str(got[0]).startswith(f"{path}: refused: ")


def _attempt(path):
    try:
        return safe_files.read_regular(path, 10)
    except Exception as exc:  # noqa: BLE001 - the test checks which
        return exc


@needs_root
def test_a_file_of_another_user_is_refused_where_owned_is_asked(sticky):
    as_nobody("sh", "-c", f"echo planted > {sticky / 'board-file'}")
    assert safe_files.read_regular(sticky / "board-file", 100) == b"planted\n"
    with pytest.raises(UnsafePathError, match="belongs to uid 65534"):
        safe_files.read_regular(sticky / "board-file", 100, owned=True)


def test_files_it_writes_are_private_and_never_through_a_link(tmp_path):
    target = tmp_path / "victim"
    target.write_text("untouched")
    (tmp_path / "planted").symlink_to(target)
    with pytest.raises(FileExistsError):
        safe_files.create_private(tmp_path / "planted")
    assert target.read_text() == "untouched"
    with safe_files.create_private(tmp_path / "new") as f:
        f.write(b"data")
    f, path = safe_files.temp_file(tmp_path, ".checkpoint.json.")
    f.close()
    for made in (tmp_path / "new", path):
        assert stat.S_IMODE(os.stat(made).st_mode) == 0o600
