"""Known upstream failures: a strict marker, granted on a record, never on words.

A test that an Open MPI bug can fail is marked ``@pytest.mark.upstream("<entry>")``,
``<entry>`` the name of its row in ``elastic_hvd.core.workarounds.TABLE`` (checked when
the tests are collected).  Its failure becomes an expected failure only when, during
the test, the job left a *record* of that bug: a line ``{"entry": "<entry>", ...}`` in
``upstream.jsonl`` of a job's output directory, written by a worker rank
(``tests/workers/report.upstream``) or by the test from a machine-readable outcome of
the launcher (:func:`record`: e.g. its exit status for a node loss).  What the job
printed never decides: a regression that prints the same words still fails.

Every marked test is counted in the terminal summary: those that passed (the bug did
not strike this run: if it never does any more, the entry may be obsolete), those that
failed with the record (xfail), and those that failed without one (real failures).

Enabled by ``pytest_plugins = ["known_failures"]`` in tests/conftest.py.
"""

import json
from pathlib import Path

import pytest

from elastic_hvd.core import workarounds

MARKER = "upstream"
RECORDS = "upstream.jsonl"

#: The output directories of the jobs the running test started (mpijob._run adds them).
out_dirs: list[Path] = []
#: nodeid -> (entries, outcome: "passed" | "xfailed" | "failed", evidence)
_seen: dict[str, tuple[tuple[str, ...], str, str]] = {}


def record(out_dir, entry, **evidence):
    """Append a record of the upstream failure ``entry`` to ``out_dir``'s records."""
    if entry not in {w.name for w in workarounds.TABLE}:
        raise ValueError(f"{entry!r} is no entry of workarounds.TABLE")
    with open(Path(out_dir) / RECORDS, "a") as f:
        f.write(json.dumps({"entry": entry, **evidence}) + "\n")


def records(directories):
    """The records in ``directories``' record files, in order."""
    found = []
    for directory in directories:
        path = Path(directory) / RECORDS
        if path.exists():
            found.extend(json.loads(line) for line in path.read_text().splitlines() if line)
    return found


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"{MARKER}(entry): an Open MPI bug (workarounds.TABLE's entry) may fail "
        "this test; a failure is an xfail only where the job left a record of it "
        "(tests/known_failures.py)")


def pytest_collection_modifyitems(config, items):
    names = {w.name for w in workarounds.TABLE}
    for item in items:
        for mark in item.iter_markers(MARKER):
            if len(mark.args) != 1 or mark.args[0] not in names:
                raise pytest.UsageError(
                    f"{item.nodeid}: @pytest.mark.{MARKER}{mark.args} must name one entry of "
                    f"elastic_hvd.core.workarounds.TABLE ({', '.join(sorted(names))})")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    out_dirs.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    entries = tuple(m.args[0] for m in item.iter_markers(MARKER))
    if not entries or report.when != "call" or getattr(report, "wasxfail", None) is not None:
        return
    met = [r for r in records(out_dirs) if r.get("entry") in entries]
    evidence = "; ".join(json.dumps(r) for r in met)
    if report.passed:
        seen = "passed"
    elif report.failed and met:
        w = next(w for w in workarounds.TABLE if w.name == met[0]["entry"])
        report.outcome = "skipped"
        report.wasxfail = f"upstream {w.name} ({w.measured_on}), recorded: {evidence}"
        seen = "xfailed"
    elif report.failed:
        report.sections.append((
            "known upstream failures",
            f"marked {', '.join(entries)}, but no job of this test left a record of it "
            f"({RECORDS}): a real failure"))
        seen, evidence = "failed", ""
    else:
        return
    # Counted where the reports arrive (pytest_runtest_logreport): with pytest-xdist, in
    # the controller, which prints the summary, not in the worker that ran the test.
    report.user_properties.append((MARKER, [list(entries), seen, evidence]))


def pytest_runtest_logreport(report):
    for name, value in report.user_properties:
        if name == MARKER:
            entries, outcome, evidence = value
            _seen[report.nodeid] = (tuple(entries), outcome, evidence)


def pytest_terminal_summary(terminalreporter):
    if not _seen:
        return
    tr = terminalreporter
    counts = {o: sum(1 for _, outcome, _ in _seen.values() if outcome == o)
              for o in ("passed", "xfailed", "failed")}
    tr.write_sep("=", "known upstream failures (@pytest.mark.upstream)")
    for nodeid, (entries, outcome, evidence) in sorted(_seen.items()):
        tr.write_line(f"{outcome.upper():8} {nodeid} [{', '.join(entries)}]"
                      + (f" {evidence}" if evidence else ""))
    tr.write_line(f"{len(_seen)} marked: {counts['passed']} passed (the bug did not strike), "
                  f"{counts['xfailed']} xfailed with its record, {counts['failed']} failed "
                  "without a record")
