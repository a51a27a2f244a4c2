"""A new user's first day (issue 42, finding 1): the README's own example, and what a
job writes, survive the first fault.

The README's example, run verbatim in a fresh directory through the real launcher
with a fault before its first checkpoint, died: the event log's directory did not
exist, the first write came at the first lost rank, and its error ended rank 0 --
"no rank completed", or "lost rank 0" for the survivors of a larger job.  Here:
the example taken from README.md itself; an event log where nothing made a
directory; one that cannot be written (refused at the start, on every rank); and a
membership handler that raises (reported as what it is, and training goes on).
Real jobs, real SIGKILLs (``--faults``).
"""

import json
import os
import re
import shlex
import subprocess
import sys
import uuid

import pytest

from mpijob import JOB_MARKER, ROOT, kill_tree, run_job

pytestmark = pytest.mark.multirank

#: The issue's fault: rank 1 SIGKILLed at step 10, before the first epoch's checkpoint.
FAULT = "rank=1,step=10"


def readme_example():
    """(the first Python block of README.md, the launch line in the bash block after it)."""
    text = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S)
    assert code, "README.md has no ```python block"
    launch = re.search(r"```bash\n(.*?)```", text[code.end():], re.S)
    assert launch, "README.md has no ```bash block after its example"
    line = next((ln for ln in launch[1].splitlines() if ln.startswith("elastic-hvd-run ")), None)
    assert line, f"no elastic-hvd-run line after the README's example: {launch[1]!r}"
    return code[1], shlex.split(line, comments=True)


def with_fault(argv):
    """The README's launch line with the issue's fault in place of its own (if any)."""
    argv = list(argv)
    if "--faults" in argv:
        del argv[argv.index("--faults"):argv.index("--faults") + 2]
    return [argv[0], "--faults", FAULT, *argv[1:]]


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_readme_example_survives_a_fault_before_its_first_checkpoint(tmp_path):
    code, argv = readme_example()
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    script = next(a for a in argv if a.endswith(".py"))
    (fresh / script).write_text(code)
    bin_dir = os.path.dirname(sys.executable)  # elastic-hvd-run beside this interpreter
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(ROOT), JOB_MARKER: uuid.uuid4().hex}
    proc = subprocess.Popen(with_fault(argv), cwd=fresh, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output = proc.communicate(timeout=240)[0]
    except subprocess.TimeoutExpired:
        kill_tree(proc, env[JOB_MARKER])
        pytest.fail(f"the README's example hung: {' '.join(with_fault(argv))}")
    finally:
        kill_tree(proc, env[JOB_MARKER])
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{output[-6000:]}"
    assert "lost rank 1" in output and "Epoch 3/3" in output, output[-6000:]
    events = fresh / "out" / "events.jsonl"
    assert events.exists(), f"no event log\n{output[-6000:]}"
    assert [(r["lost"], r["new_size"]) for r in records(events)] == [([1], 1)]


def test_event_log_directory_is_made_at_the_start(tmp_path):
    events = tmp_path / "logs" / "run1" / "events.jsonl"  # no checkpoint makes a parent
    job = run_job("first_day.py", events, np=2, faults="rank=1,step=3", tmp_path=tmp_path)
    assert sorted(job.results) == [0], job.output[-6000:]
    assert [(r["lost"], r["new_size"]) for r in records(events)] == [([1], 1)]
    assert oct((tmp_path / "logs" / "run1").stat().st_mode & 0o777) == "0o700"


def test_event_log_that_cannot_be_written_is_refused_at_the_start(tmp_path):
    (tmp_path / "taken").write_text("a file, not a directory")
    events = tmp_path / "taken" / "events.jsonl"
    job = run_job("first_day.py", events, np=2, tmp_path=tmp_path, expect_rc=None)
    assert job.returncode != 0 and not job.results, job.output[-6000:]
    line = f"UnsafePathError: event log directory {tmp_path / 'taken'} is not a directory"
    assert line in job.output, job.output[-6000:]
    assert "same at the same place" in job.output, job.output[-6000:]  # on every rank


@pytest.mark.parametrize("where", ["every", "rank0"])
def test_a_failing_membership_handler_is_reported_and_training_goes_on(tmp_path, where):
    events = tmp_path / "events.jsonl"
    job = run_job("first_day.py", events, where, np=3, faults="rank=2,step=3",
                  tmp_path=tmp_path)
    assert sorted(job.results) == [0, 1], job.output[-6000:]
    said = ("the membership handler __main__.BrokenReport failed on rank {} at the change "
            "3 -> 2 ranks: ValueError: broken report of 3 -> 2 ranks; training "
            "goes on")
    failed_on = [0, 1] if where == "every" else [0]
    for rank in (0, 1):
        assert (said.format(rank) in job.output) == (rank in failed_on), job.output[-6000:]
    assert "Traceback" in job.output and "in handle" in job.output, job.output[-6000:]
    assert "lost rank 0" not in job.output, job.output[-6000:]
    assert [(r["lost"], r["new_size"]) for r in records(events)] == [([2], 2)]


def test_a_failing_learning_rate_handler_stops_the_ranks_naming_it(tmp_path):
    """A handler ordered before the reports changes what every rank trains: a rank that
    could not apply the change cannot go on alike with the others."""
    job = run_job("first_day.py", tmp_path / "events.jsonl", "lr", np=3, faults="rank=2,step=3",
                  tmp_path=tmp_path, expect_rc=1)
    assert not job.results, job.output[-6000:]
    said = ("ElasticHvdError: the membership handler __main__.BrokenReport failed on rank {} at "
            "the change 3 -> 2 ranks: ValueError: broken report of 3 -> 2 ranks; it changes what "
            "every rank trains, so this rank cannot go on with the others")
    for rank in (0, 1):
        assert said.format(rank) in job.output, job.output[-6000:]
    assert "lost rank 0" not in job.output, job.output[-6000:]
