"""The test harness's watcher (mpijob.run_job's ``watcher``): what it raises, and a moment
that never comes, fail the test that ran it; nothing is killed on a deadline that passed."""

import sys
import time

import pytest

import mpijob


def run(watcher, seconds=1.0, tmp_path=None):
    out = tmp_path / "out"
    out.mkdir()
    return mpijob._run([sys.executable, "-c", f"import time; time.sleep({seconds})"], {}, out,
                       30, 0, watcher)


def test_what_a_watcher_raises_is_raised_in_the_test(tmp_path):
    def watcher(_out, _marker):
        raise ProcessLookupError("the victim was gone")

    with pytest.raises(ProcessLookupError, match="the victim was gone") as raised:
        run(watcher, tmp_path=tmp_path)
    assert any("raised by the job's watcher" in note for note in raised.value.__notes__)


def test_a_watchers_deadline_fails_the_test(tmp_path):
    acted = []

    def watcher(_out, _marker):
        mpijob.until(lambda: False, 0.2, "a moment that never comes")
        acted.append(True)

    with pytest.raises(mpijob.WatcherFailed, match="not within 0.2 s: a moment that never"):
        run(watcher, tmp_path=tmp_path)
    assert not acted


def test_a_job_that_ends_before_the_watchers_moment_fails_the_test(tmp_path):
    started = time.monotonic()

    def watcher(_out, _marker):
        mpijob.until(lambda: False, 60, "a moment that never comes")

    with pytest.raises(mpijob.WatcherFailed, match="the job ended before a moment that never"):
        run(watcher, seconds=0.2, tmp_path=tmp_path)
    assert time.monotonic() - started < 10  # not the 60 s


def test_a_watcher_that_returns_leaves_the_job_as_it_was(tmp_path):
    seen = []
    job = run(lambda out, marker: seen.append(mpijob.until(out.exists, 5, "the out dir")),
              tmp_path=tmp_path)
    assert job.returncode == 0 and seen == [True]
