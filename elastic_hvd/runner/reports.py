"""What ``elastic-hvd-run`` says about processes that ended badly, once for the whole job.

Why the launcher: a bug usually fails on every rank at once, and ranks that each
print their traceback interleave them line by line; nor can a rank know whether
the others go on.  The ranks' wrapper (:mod:`.program`) records an uncaught
exception, and a fatal signal's stacks, in the status directory; the launcher,
which sees every process, prints the first traceback in full and every other
failure *from the same place* in one line, and the job's summary counts raised,
crashed and killed processes.
"""

import os
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from ..core import announce
from .program import WRAPPERS


def who(outcome: Mapping[str, Any], with_id: bool = False) -> str:
    """The process's name in the job's own words (:func:`.announce.who`: ``rank 2``,
    ``rank 1 (id 2)`` once ranks were renumbered; ``with_id``: the id said anyway),
    its rank being its last one; ``world rank 2`` for one that recorded no id (lost
    before ``init()``, or a command that is not a Python program: see ``.supervisor``),
    or the process of a spawned one not yet adopted."""
    if outcome.get("id") is None:
        if outcome.get("spawned") or outcome.get("world") is None:
            return f"a process spawned to join the job ({outcome['process']})"
        return f"world rank {outcome['world']}"
    return announce.who(outcome.get("rank"), outcome["id"], with_id=with_id)


#: The verdict's name of a process: the same as the reports'.
short = who


def order(outcome: Mapping[str, Any]) -> tuple[bool, int]:
    """Sort key: lowest original id first, then those without one by world rank."""
    if outcome.get("id") is not None:
        return False, outcome["id"]
    return True, int(outcome.get("world") or 0)


def how_lost(outcome: Mapping[str, Any]) -> str:
    """``"raised"``, ``"crashed"`` or ``"killed"``, for a process that did not finish."""
    return "raised" if outcome.get("raised") else "crashed" if outcome.get("crashed") else "killed"


def lost_words(outcomes: Sequence[Mapping[str, Any]]) -> str:
    """How processes that did not finish ended: ``"4 ranks raised an uncaught
    exception"``, or by kind: ``"4 ranks were lost: 3 raised an uncaught exception,
    1 was killed (...)"``."""
    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[how_lost(outcome)] = counts.get(how_lost(outcome), 0) + 1
    signals = sorted({o["crashed"] for o in outcomes if how_lost(o) == "crashed"})
    words = {"raised": "raised an uncaught exception",
             "crashed": f"crashed ({', '.join(signals)})",
             "killed": "{were} killed or ended without a record (SIGKILL, SIGTERM, os._exit, "
                       "a lost node)"}
    ranks = f"{len(outcomes)} rank{'s' if len(outcomes) != 1 else ''}"
    if len(counts) == 1:
        return f"{ranks} {words[how_lost(outcomes[0])].format(were='were')}"
    return f"{ranks} were lost: " + ", ".join(
        f"{n} {words[kind].format(were='was' if n == 1 else 'were')}" for kind, n in counts.items())


def read_fault(status_path: str | os.PathLike[str]) -> tuple[str | None, str]:
    """The fatal signal ``faulthandler`` reported for a process (e.g. ``Segmentation
    fault``) and the stack of its thread that met it; ``(None, "")`` without one."""
    try:
        text = Path(status_path).with_suffix(".fault").read_text()
    except OSError:
        return None, ""
    if not text.startswith("Fatal Python error: "):
        return None, ""
    signal = text.splitlines()[0][len("Fatal Python error: "):]
    blocks = text.split("\n\n")
    current = next((b for b in blocks if b.startswith("Current thread")), "").splitlines()
    # Without the wrappers' frames (runpy, elastic_hvd.runner.program): the program's.
    return signal, "\n".join(line for line in current if "<frozen runpy>" not in line
                             and not any(f'"{path}"' in line for path in WRAPPERS))


class Reporter:
    """Prints each failure once, while the job runs (see the module doc)."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out if out is not None else sys.stderr
        self.lock = threading.Lock()  # the launcher's stderr relay writes too
        self._told: set[str] = set()
        self._places: dict[tuple[Any, ...], tuple[Mapping[str, Any], str]]
        self._places = {}  # (kind, where) -> the outcome reported in full, its text

    def write(self, text: str) -> None:
        with self.lock:
            self.out.write(text)
            self.out.flush()

    def news(self, outcomes: Iterable[Mapping[str, Any]]) -> None:
        """Report what the ``outcomes`` (see :func:`.outcome.read_outcomes`) show that was not
        reported yet: a process that raised or crashed, lowest original id (or world
        rank) first.  Across calls the order is the order the records arrived in."""
        fresh = [o for o in outcomes if o.get("code") is None and how_lost(o) != "killed"
                 and o["process"] not in self._told]
        for outcome in sorted(fresh, key=order):
            self._told.add(outcome["process"])
            self.write(self._report(outcome))

    def _report(self, outcome: Mapping[str, Any]) -> str:
        if how_lost(outcome) == "raised":
            text = outcome["raised"]
            place = ("raised", text.split(":")[0], tuple(outcome.get("stack", ())))
            full = f"raised an uncaught exception and left the job:\n{outcome.get('traceback', '')}"
        else:
            text = outcome["crashed"]
            stack = outcome.get("fault_stack", "")  # none from a command that is not Python
            # The same place in each process, but not the same thread id (its header).
            place = ("crashed", text, tuple(line for line in stack.splitlines()
                                            if not line.startswith("Current thread ")))
            full = (f"crashed ({text}) and left the job; its Python stack:\n{stack}\n"
                    if stack else f"crashed ({text}) and left the job\n")
        first, first_text = self._places.setdefault(place, (outcome, text))
        if first["process"] == outcome["process"]:
            return f"elastic-hvd-run: {who(outcome)} {full}"
        lines = text.splitlines()
        what = ("the same" if text == first_text else
                f"{lines[0]}{' ...' if len(lines) > 1 else ''},")
        # Two processes that ended with one rank number (one was renumbered after the
        # other left) are told apart by their ids.
        both = first.get("rank") == outcome.get("rank")
        return (f"elastic-hvd-run: {who(outcome, both)} {place[0]} {what} at the same place "
                f"as {who(first, both)}\n")
