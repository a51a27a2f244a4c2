"""tests/known_failures.py: an upstream marker turns a failure into an xfail only on a
record of the bug from the job, never on what it printed; every marked test is counted."""

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

CASES = '''
import pytest
import known_failures

def job(tmp_path, entry=None):
    out = tmp_path / "out"
    out.mkdir()
    known_failures.out_dirs.append(out)
    if entry:
        known_failures.record(out, entry, launcher_exit_status=4)
    return "elastic-hvd-run: node loss: the MPI runtime lost the daemon of host hostB"

@pytest.mark.upstream("merge_death_crash")
def test_failed_with_the_record(tmp_path):
    job(tmp_path, "merge_death_crash")
    assert False

@pytest.mark.upstream("merge_death_crash")
def test_failed_with_the_words_only(tmp_path):
    assert "node loss" not in job(tmp_path)

@pytest.mark.upstream("merge_death_crash")
def test_failed_with_the_record_of_another_bug(tmp_path):
    job(tmp_path, "spawn_given_up")
    assert False

@pytest.mark.upstream("merge_death_crash")
def test_passed(tmp_path):
    job(tmp_path)

def test_unmarked_with_a_record(tmp_path):
    job(tmp_path, "merge_death_crash")
    assert False
'''


def pytest_run(tmp_path, source):
    (tmp_path / "test_cases.py").write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "known_failures", "-p", "no:cacheprovider",
         "-rxf", "-q", str(tmp_path / "test_cases.py")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={"PYTHONPATH": str(TESTS), "PATH": "/usr/bin:/bin"})


def test_a_failure_is_an_xfail_only_with_the_record_of_the_bug_it_names(tmp_path):
    done = pytest_run(tmp_path, CASES)
    out = done.stdout
    assert "3 failed, 1 passed, 1 xfailed" in out, out
    assert "XFAIL test_cases.py::test_failed_with_the_record - upstream merge_death_crash" in out
    for name in ("words_only", "record_of_another_bug"):
        assert f"FAILED test_cases.py::test_failed_with_the_{name}" in out, out
    assert "FAILED test_cases.py::test_unmarked_with_a_record" in out, out
    assert "4 marked: 1 passed (the bug did not strike), 1 xfailed with its record, 2 failed " \
        "without a record" in out, out
    assert "PASSED   test_cases.py::test_passed [merge_death_crash]" in out, out


def test_a_marker_must_name_an_entry_of_the_table(tmp_path):
    done = pytest_run(tmp_path, "import pytest\n\n@pytest.mark.upstream('no_such_bug')\n"
                                "def test_x():\n    pass\n")
    assert done.returncode != 0 and "must name one entry of" in done.stdout + done.stderr, \
        done.stdout + done.stderr
