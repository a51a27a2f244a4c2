"""The package's diagnostics through :mod:`logging`, printed as they always were.

A leaf: it imports nothing of the package (``horovod_alias`` and the launcher use it).

Every module logs through ``get_logger(__name__)`` (loggers ``elastic_hvd.core.growth``,
``elastic_hvd.runner.watch``, ``keras_callbacks.checkpoint``...).  At import, one
handler, :data:`CONSOLE`, is put on the ``elastic_hvd`` and ``keras_callbacks``
loggers: it writes each message alone (no prefix), to stderr -- or stdout for the
lines that always went there (``extra=STDOUT``) -- and flushes, so that the console
shows what it showed before logging.  Those two loggers get level INFO and
``propagate = False`` (unless the program configured them before importing the
package): the lines show whatever the root logger's level, and a root handler
(``logging.basicConfig``) does not print them a second time.

To silence them: ``logging.getLogger("elastic_hvd").setLevel(logging.CRITICAL)``; to
route them: add a handler to that logger (and remove :data:`CONSOLE` to keep them off
the console), or set its ``propagate = True`` to hand them to the root's handlers.
Every record carries ``rank`` and ``id`` (the current rank and its id; None where
unknown: the launcher, a process not joined yet) for a format such as
``"%(rank)s %(message)s"``.  docs/training.md, "Diagnostics".
"""

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

#: The loggers :data:`CONSOLE` sits on (the package's two top-level packages).
ROOTS = ("elastic_hvd", "keras_callbacks")
#: ``extra=`` for a line that goes to stdout, as it always did (the rest go to stderr).
STDOUT = {"stdout": True}


class Console(logging.Handler):
    """The message alone (a traceback below it with ``exc_info``), then a newline, to
    the process's stderr -- stdout for a record logged with ``extra=STDOUT`` -- as it
    is at the time (a replaced ``sys.stderr`` is used), flushed at once."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.set_name("elastic_hvd.console")
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stdout if getattr(record, "stdout", False) else sys.stderr
            if stream is None:  # pythonw, or closed by the program
                return
            stream.write(self.format(record) + "\n")
            stream.flush()
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


def identity() -> dict[str, Any]:
    """``rank`` and ``id`` of this process now (None where there is no communicator)."""
    process = sys.modules.get("elastic_hvd.core.process")  # not imported: no communicator
    comm = getattr(process.runtime(), "comm", None) if process is not None else None
    if comm is None:
        return {"rank": None, "id": None}
    return {"rank": getattr(comm, "rank", None), "id": getattr(comm, "original_id", None)}


class RankAdapter(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A module's logger that adds ``rank`` and ``id`` (:func:`identity`) to every
    record; a call's own ``extra`` (``STDOUT``) is kept beside them."""

    def process(self, msg: Any,
                kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        try:
            fields = identity()
        except Exception:  # never let the naming stop a line
            fields = {"rank": None, "id": None}
        kwargs["extra"] = {**fields, **(kwargs.get("extra") or {})}
        return msg, kwargs


def get_logger(name: str) -> RankAdapter:
    """The logger of module ``name`` (its ``__name__``; a module also run as a script
    passes its dotted name), with ``rank`` and ``id`` on each record."""
    return RankAdapter(logging.getLogger(name), {})


#: The default console handler (remove it from ``logging.getLogger("elastic_hvd")`` to
#: keep the lines off the console while a handler of your own takes them).
CONSOLE = Console()


def _install() -> None:
    """Put :data:`CONSOLE` on the :data:`ROOTS` loggers, once per process (at import)."""
    for name in ROOTS:
        logger = logging.getLogger(name)
        if any(h.get_name() == CONSOLE.get_name() for h in logger.handlers):
            continue  # a reloaded module: the first one's handler stays
        if logger.level == logging.NOTSET and not logger.handlers:  # not configured yet
            logger.setLevel(logging.INFO)
            logger.propagate = False
        logger.addHandler(CONSOLE)


_install()
