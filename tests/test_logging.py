"""Diagnostics go through :mod:`logging` (elastic_hvd/log.py) and look as they did.

By default the console shows each line alone, on the stream it always used, whatever
the root logger's level and whether the program configured logging; a program can
silence them (``setLevel``) or route them (a handler of its own).  The jobs are real
2-rank ``elastic-hvd-run`` jobs whose rank 1 is SIGKILLed by the fault plan.
"""

import ast
import io
import logging
import traceback
from pathlib import Path

import pytest

from elastic_hvd import log
from mpijob import ROOT, run_job

WORKER = '''
import logging, os, sys
import numpy as np

mode = sys.argv[1]
if mode == "silenced":  # before the import: the package keeps what the program set
    logging.getLogger("elastic_hvd").setLevel(logging.CRITICAL)
from elastic_hvd import core
from elastic_hvd.log import CONSOLE
if mode == "routed":  # to a file of its own, through the root logger, and off the console
    logging.basicConfig(
        filename=os.path.join(os.environ["TEST_OUT_DIR"],
                              f"log-{os.environ['OMPI_COMM_WORLD_RANK']}.txt"),
        format="%(levelname)s %(name)s rank=%(rank)s id=%(id)s | %(message)s")
    logging.getLogger("elastic_hvd").removeHandler(CONSOLE)
    logging.getLogger("elastic_hvd").propagate = True
logging.getLogger().setLevel(logging.ERROR)  # the root's level does not matter

comm = core.init()


def broken(event):
    raise RuntimeError("a listener's own error")


comm.listeners.add(broken)  # after the announcer: its line comes first
for _ in range(60):
    comm.allreduce(np.ones(4, dtype=np.float32))
'''

LISTENER_LINES = ("elastic_hvd: a membership listener failed on rank 0:\n"
                  "Traceback (most recent call last):\n")
LISTENER_END = "RuntimeError: a listener's own error\n"


def _job(tmp_path, mode):
    worker = tmp_path / "logging_worker.py"
    worker.write_text(WORKER)
    return run_job(str(worker), mode, np=2, faults="rank=1,coll=30", tmp_path=tmp_path,
                   timeout=180)


def changes(output):
    """The membership lines (as tests/test_messages.py reads them)."""
    return [line for line in output.splitlines() if line.startswith("[elastic_hvd ")]


# -- jobs ------------------------------------------------------------------------------------
@pytest.mark.multirank
def test_by_default_the_lines_are_as_before(tmp_path):
    out = _job(tmp_path, "default").output
    [line] = changes(out)  # on stdout, alone on its line, no prefix
    assert line.split("] ", 1)[1].startswith("lost rank 1: 2 -> 1 ranks; "), out
    # A stderr line with its traceback, as print + traceback.print_exc wrote it.
    assert LISTENER_LINES in out and LISTENER_END in out, out
    assert out.index(LISTENER_LINES) < out.index(LISTENER_END), out
    for added in ("INFO", "WARNING:", "ERROR:", "elastic_hvd.core"):
        assert added not in out, out


@pytest.mark.multirank
def test_a_program_silences_them(tmp_path):
    out = _job(tmp_path, "silenced").output
    assert changes(out) == [] and "listener failed" not in out, out
    assert "Traceback" not in out, out


@pytest.mark.multirank
def test_a_program_routes_them_to_a_file_of_its_own(tmp_path):
    job = _job(tmp_path, "routed")
    assert changes(job.output) == [] and "listener failed" not in job.output, job.output
    text = (job.out_dir / "log-0.txt").read_text()
    lines = text.splitlines()
    [line] = [x for x in lines if "[elastic_hvd " in x]
    assert line.startswith("INFO elastic_hvd.core.announce rank=0 id=0 | [elastic_hvd "), text
    assert "] lost rank 1: 2 -> 1 ranks; " in line, line
    assert ("ERROR elastic_hvd.core.repair rank=0 id=0 | " + LISTENER_LINES) in text, text
    assert LISTENER_END in text, text


# -- units -----------------------------------------------------------------------------------
@pytest.fixture
def restored():
    """The package's loggers and the root logger as they were, after the test."""
    loggers = [logging.getLogger(name) for name in (*log.ROOTS, "")]
    saved = [(lg, lg.level, list(lg.handlers), lg.propagate) for lg in loggers]
    yield
    for lg, level, handlers, propagate in saved:
        lg.setLevel(level)
        lg.handlers[:] = handlers
        lg.propagate = propagate


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_the_console_handler_prints_the_message_alone_on_its_stream(capsys, restored):
    logging.getLogger().setLevel(logging.CRITICAL)  # the root's level does not matter
    root = Records()
    logging.getLogger().addHandler(root)  # as logging.basicConfig would
    _log = log.get_logger("elastic_hvd.core.example")
    _log.info("elastic_hvd: said on stderr")
    _log.info("[elastic_hvd 12:00:00] said on stdout", extra=log.STDOUT)
    log.get_logger("keras_callbacks.example").warning("elastic_hvd: from the callbacks")
    out, err = capsys.readouterr()
    assert out == "[elastic_hvd 12:00:00] said on stdout\n"
    assert err == "elastic_hvd: said on stderr\nelastic_hvd: from the callbacks\n"
    assert root.records == []  # not propagated: no second copy through the root's handlers


def test_a_traceback_looks_as_print_exc_wrote_it(capsys, restored):
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        before = io.StringIO()
        print("elastic_hvd: a membership listener failed on rank 0:", file=before)
        traceback.print_exc(file=before)
        log.get_logger("elastic_hvd.core.repair").error(
            "elastic_hvd: a membership listener failed on rank 0:", exc_info=True)
    assert capsys.readouterr().err == before.getvalue()


def test_a_program_silences_or_routes_them(capsys, restored):
    package = logging.getLogger("elastic_hvd")
    package.setLevel(logging.CRITICAL)
    log.get_logger("elastic_hvd.core.example").warning("elastic_hvd: unseen")
    assert capsys.readouterr() == ("", "")
    package.setLevel(logging.INFO)
    mine = Records()
    package.addHandler(mine)
    package.removeHandler(log.CONSOLE)
    log.get_logger("elastic_hvd.core.example").info("elastic_hvd: routed")
    assert capsys.readouterr() == ("", "")
    [record] = mine.records
    assert (record.getMessage(), record.name, record.rank, record.id) == \
        ("elastic_hvd: routed", "elastic_hvd.core.example", None, None)


def test_print_is_left_only_where_logging_would_be_unsafe_or_it_is_output():
    # Watchdogs that end a process whose main thread may hang holding a handler's
    # lock; --dry-run's output; Keras's verbose output; and the four files another
    # change of issue 43 moves (process, session, basics, replacement).
    allowed = {"elastic_hvd/core/mpi_env.py", "elastic_hvd/core/invitation.py",
               "elastic_hvd/core/heartbeat.py", "elastic_hvd/runner/launch.py",
               "elastic_hvd/tensorflow/keras/callbacks.py", "elastic_hvd/core/process.py",
               "elastic_hvd/core/session.py", "elastic_hvd/basics.py",
               "elastic_hvd/tensorflow/keras/replacement.py"}
    found = []
    for path in sorted([*(ROOT / "elastic_hvd").rglob("*.py"),
                        *(ROOT / "keras_callbacks").rglob("*.py")]):
        name = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print" \
                    and name not in allowed:
                found.append(f"{name}:{node.lineno}")
    assert found == [], found


def test_the_logger_names_follow_the_modules():
    from elastic_hvd.core import repair
    assert repair._log.logger.name == "elastic_hvd.core.repair"
    from elastic_hvd.runner import launch, supervisor
    assert launch._log.logger.name == "elastic_hvd.runner.launch"  # also run as __main__
    assert supervisor._log.logger.name == "elastic_hvd.runner.supervisor"
    assert Path(log.__file__).name == "log.py"
