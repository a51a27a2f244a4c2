"""``python -m elastic_hvd.runner.program script.py|-m module|-c code [args]``: run a program
as ``python`` would, and record how it ended, for ``elastic-hvd-run``'s exit status.

``elastic-hvd-run`` starts every Python rank through this module (any other command
through :mod:`.supervisor`, which records less: an exit code or a signal), and processes
spawned to grow the job run it too (they run the ranks' own command line, see
:func:`elastic_hvd.core.spawn.program_argv`).  In ``$ELASTIC_HVD_STATUS_DIR`` each
process writes ``<host>-<pid>.json``: ``{"id": null, "code": null}`` when it starts,
then its exit code, its original id and the job's members then (original ids)
when the program *ends by itself* (returns or calls ``sys.exit``) -- ``[]`` in a
spare or spawned process that never joined --, then ``"left": true`` once it has
*left early*: the others went on training without it (see ``ResilientComm.leave``),
so it completed nothing by itself, or ``"final": true`` once it has passed the
job's final barrier, which every rank left meets: only then are its members the
job's last ones (the launcher's end-of-job check reads these); ``"aborted": true``
when strict mode ends the job on an anomaly (the launcher then ends mpirun: an
``MPI_Abort`` in a spawned process ends only the spawned job); ``"broken"``: why,
with ``"code": null``, when it ends as a crash because Open MPI can make no new
communicator there (the launcher relaunches a job that every rank left so).  A process
killed, crashed, or ended by an uncaught exception (which the runtime turns into
a crash when other ranks go on, see ``runtime._at_exit``) keeps ``"code": null``:
it was lost; so does a spawned process that the job gave up before adopting it
(``invitation.JoinAbandoned``): it never was one of the job's ranks.  An atexit
handler could not do this: it does not see ``SystemExit``'s code.

So that the launcher can say how a lost process ended, and report each failure
once for the whole job instead of every rank printing at the same moment: an
uncaught exception is recorded (``"raised"``: its last line, ``"stack"``: where,
``"traceback"``) instead of printed, and a fatal signal (a segfault, an abort)
makes :mod:`faulthandler` write the Python stacks to ``<host>-<pid>.fault``.
A process with neither was killed (SIGKILL, SIGTERM, its node lost).
"""

import faulthandler
import json
import os
import runpy
import socket
import sys
import traceback
import types
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

#: What ``sys.excepthook`` is.
_ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]


def run(argv: list[str]) -> None:
    """Run ``script.py [args]``, ``-m module [args]`` or ``-c code [args]`` as ``python``
    would."""
    if argv[:2] == ["-m", "elastic_hvd.runner.program"]:
        sys.argv = argv[1:]  # a joiner re-runs a rank's command line, which starts with us:
        return main()        # run in place (runpy would import this module a second time)
    if argv[:1] == ["-m"]:
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0].startswith("-c"):  # -c code, or -ccode
        code, args = (argv[1], argv[2:]) if argv[0] == "-c" else (argv[0][2:], argv[1:])
        sys.argv = ["-c", *args]
        sys.path[0] = ""
        _run_code(code)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def _run_code(code: str) -> None:
    """Run ``code`` as ``python -c`` does: in a fresh ``__main__`` (runpy has no call for
    a string), so that it sees none of this module's names."""
    module, saved = types.ModuleType("__main__"), sys.modules["__main__"]
    sys.modules["__main__"] = module
    try:
        exec(compile(code, "<string>", "exec"), vars(module))  # noqa: S102 - it is the program
    finally:
        sys.modules["__main__"] = saved


def exit_code(code: str | int | None) -> int:
    """The process exit status ``SystemExit(code)`` gives (None: 0, text: 1)."""
    if code is None:
        return 0
    return code & 0xFF if isinstance(code, int) else 1


def write_record(path: str, record: Mapping[str, Any], replace: bool = True) -> bool:
    """Write ``record`` to ``path`` whole or not at all (the launcher reads it at any
    time); with ``replace`` False only if there is none yet.  Whether it was written."""
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        json.dump(record, f)
    if replace:
        os.replace(temporary, path)
        return True
    try:
        os.link(temporary, path)  # fails where one exists: no window in which to lose it
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(temporary)


def identity() -> dict[str, Any]:
    """Who this process is before ``init()`` (a crash may come first): mpirun's rank, and
    whether the job spawned it (a rank of its own small world then)."""
    return {"world": os.environ.get("OMPI_COMM_WORLD_RANK"),
            "spawned": getattr(sys.modules["__main__"].__spec__, "name", "") == JOIN}


#: :func:`identity` when this process started, before the program replaced ``__main__``.
_identity: dict[str, Any] = {}


def _record(path: str, code: int | None, left: bool = False, final: bool = False,
            aborted: bool = False, broken: str | None = None, **raised: Any) -> None:
    runtime = sys.modules.get("elastic_hvd.core.runtime")  # imported if the program used it
    comm = runtime.current() if runtime and runtime.is_initialized() else None
    try:
        rank = comm and comm.rank
    except Exception:  # noqa: BLE001 - a program may have freed its communicator by now
        rank = None
    write_record(path, {"id": comm and comm.original_id, "rank": rank, "code": code,
                        "members": comm and list(comm.ids), "left": left, "final": final,
                        "aborted": aborted, "broken": broken, **_identity, **raised})


#: The wrapper of a process spawned into the job, which runs this one in place.
JOIN = "elastic_hvd.runner.join"
#: Where the wrappers' frames come from: a traceback shows the program's below them.
WRAPPERS = (__file__, os.path.join(os.path.dirname(__file__), "join.py"), runpy.__file__)


def _ours(filename: str) -> bool:
    """Whether a frame is a wrapper's or runpy's (the program runs inside them)."""
    return filename in WRAPPERS or filename.startswith("<frozen runpy")


def _recording(path: str, show: _ExceptHook) -> _ExceptHook:
    """An excepthook that records the uncaught exception for the launcher, which
    prints it; ``show`` (the hook it replaces) if it cannot be recorded."""
    def hook(kind: type[BaseException], value: BaseException,
             tb: TracebackType | None) -> None:
        while tb is not None and _ours(tb.tb_frame.f_code.co_filename):
            tb = tb.tb_next  # the traceback starts in the program, as under plain python
        try:
            _record(path, None, raised=traceback.format_exception_only(kind, value)[-1].strip(),
                    stack=[f"{f.filename}:{f.lineno}" for f in traceback.extract_tb(tb)],
                    traceback="".join(traceback.format_exception(kind, value, tb)))
        except OSError:
            show(kind, value, tb)
    return hook


def _ended(path: str, code: int) -> None:
    """Record that the program ended with ``code``, and have the runtime record it
    again when this rank leaves the job: as left early if the others train on, as
    final (with the members of that moment) once past the barrier of all ranks."""
    _record(path, code)
    runtime = sys.modules.get("elastic_hvd.core.runtime")
    if runtime is not None:
        runtime.when_leaving(lambda early: _record(path, code, left=early, final=not early))


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(
            "usage: python -m elastic_hvd.runner.program script.py|-m module|-c code [args]")
    _identity.update(identity())
    from elastic_hvd.core import config  # imports the core, without MPI (init() starts it)
    directory = config.read("status_dir") or ""
    path = os.path.isdir(directory) and os.path.join(  # not on a host that lacks it
        directory, f"{socket.gethostname()}-{os.getpid()}.json")
    if path:
        _record(path, None)
        from elastic_hvd.core import runtime  # no MPI yet: that starts with init()
        runtime.when_strict_abort(lambda status: _record(path, status, aborted=True))
        runtime.when_broken(lambda why: _record(path, None, broken=why))
        runtime.leave_raising_to_launcher()
        sys.excepthook = _recording(path, sys.excepthook)
        # Before MPI_Init, so that Open MPI keeps its own signal handlers out.
        faulthandler.enable(open(path[:-len(".json")] + ".fault", "w"))
    try:
        run(sys.argv[1:])
    except SystemExit as exc:
        invitation = sys.modules.get("elastic_hvd.core.invitation")
        if path and not (invitation and isinstance(exc, invitation.JoinAbandoned)):
            _ended(path, exit_code(exc.code))
        runtime = sys.modules.get("elastic_hvd.core.runtime")  # type: ignore[assignment]
        if runtime is not None:  # it may have to end the process itself (see _at_exit)
            runtime.set_exit_status(exit_code(exc.code))
        raise
    if path:
        _ended(path, 0)


if __name__ == "__main__":
    main()
