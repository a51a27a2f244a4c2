"""How the job ended: what its processes recorded, and the exit status it gives.

Each process records its end in the status directory (:mod:`.program`,
:mod:`.supervisor`); the launcher returns the script's status from those records,
not mpirun's, which under ``--with-ft ulfm`` says 0 even when every rank was killed.
"""

import contextlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..core.freshness import ANOMALY_EXIT_STATUS
from . import reports

#: Exit status of a job whose ranks wrote a final checkpoint on SIGUSR1 and stopped
#: (``keras_callbacks.ElasticCheckpoint``; Slurm's ``--signal=B:USR1@N``): started
#: again, it resumes from that checkpoint with no step redone (docs/slurm.md).
EXIT_PREEMPTED = 8

#: What a rank records when its script imports Horovod, which is not installed ...
NO_HOROVOD = "ModuleNotFoundError: No module named 'horovod'"
#: ... and what the launcher then says: the error alone names no way out.
HOROVOD_HINT = ("the script imports horovod, which is not installed: add --as-horovod to run it "
                "unchanged on elastic_hvd, or change `horovod` to `elastic_hvd` in its imports")


def read_outcomes(status_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """What the processes recorded (see :mod:`.program` and :mod:`.supervisor`), each
    with ``"process"`` (``host-pid``) and, after a fatal signal, ``"crashed"`` (its
    name) and ``"fault_stack"`` (a Python rank's)."""
    outcomes = []
    for path in Path(status_dir).glob("*.json"):
        try:
            outcome = json.loads(path.read_text())
        except (OSError, ValueError):  # being replaced right now: read it next time
            continue
        outcome["process"] = path.stem
        with contextlib.suppress(OSError, ValueError):  # where it stopped on SIGUSR1
            outcome["preempted"] = json.loads(path.with_suffix(".preempted").read_text())
        if outcome["code"] is None and not outcome.get("raised") and not outcome.get("signal"):
            outcome["crashed"], outcome["fault_stack"] = reports.read_fault(path)
        outcomes.append(outcome)
    return one_per_rank(outcomes)


def one_per_rank(outcomes: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``outcomes`` without a supervisor's record of a rank whose program recorded
    itself: a wrapper that started ``python -m elastic_hvd.runner.program`` as a child
    (not by exec, which keeps the pid and so the record: see :mod:`.supervisor`)."""
    def rank(outcome: Mapping[str, Any]) -> tuple[str, Any]:
        return outcome["process"].rpartition("-")[0], outcome.get("world")
    recorded = {rank(o) for o in outcomes if not o.get("supervised") and not o.get("spawned")}
    return [o for o in outcomes if not (o.get("supervised") and rank(o) in recorded)]


def members_done(outcomes: Iterable[Mapping[str, Any]]) -> bool:
    """True when every rank that met the job's final barrier has recorded so.

    Only that barrier, which every rank left meets, knows the job's last members: a
    process that ended earlier (a rank that left early, a spare or spawned process
    that never joined) names the members of its own time.  A rank killed between the
    barrier and its record keeps this False: mpirun then ends by itself, or at a
    lingering process's own deadline."""
    final = [o for o in outcomes if o.get("final")]
    done = {o["id"] for o in final}
    return bool(final) and all(set(o["members"]) <= done for o in final)


def strict_abort(outcomes: Iterable[Mapping[str, Any]]) -> bool:
    """Whether a process recorded that strict mode ends the job (an anomaly)."""
    return any(o["code"] == ANOMALY_EXIT_STATUS and o.get("aborted") for o in outcomes)


def horovod_missing(outcomes: Iterable[Mapping[str, Any]]) -> bool:
    """Whether a rank failed because its script imports Horovod (:data:`HOROVOD_HINT`)."""
    return any(o.get("raised") == NO_HOROVOD for o in outcomes)


def exit_status(code: int, outcomes: Sequence[Mapping[str, Any]]) -> tuple[int, str | None]:
    """The job's exit status from mpirun's ``code`` and the ``outcomes`` the ranks
    recorded, and a line that says why (None for a plain 0).

    Ranks lost on the way do not fail the job; a rank that finished with a non-zero
    status does (the lowest original id's status is returned), and so does a job in
    which no rank completed: none finished, or those that did *left early* (with
    status 0, while the others trained on) or never joined (a spare or spawned
    process) and the others were all lost.
    """
    if not outcomes:  # no rank could write to the status directory (another host's)
        return code, (f"the job failed (mpirun exit status {code}); see the ranks' messages above"
                      if code else None)
    ended = [o for o in outcomes if o["code"] is not None]
    # A spare or spawned process that ended before it joined (members []) was no rank.
    completed = [o for o in ended if not o.get("left") and o.get("members") != []]
    if strict_abort(outcomes) or (not completed and code == ANOMALY_EXIT_STATUS):
        code = ANOMALY_EXIT_STATUS
        return code, (f"exit status {code}: strict mode ended the job on an anomaly (see the "
                      "'elastic_hvd: ANOMALY' line above)")
    if not ended:
        status = code or 1
        return status, (f"exit status {status}: no rank completed: all "
                        f"{reports.lost_words(outcomes)} (mpirun exit status {code})")
    failed = sorted((o for o in ended if o["code"]), key=reports.order)
    if failed and all(o["code"] == EXIT_PREEMPTED for o in failed) and \
            any(o.get("preempted") for o in failed):
        return EXIT_PREEMPTED, preempted_line(failed)
    if failed:
        status = failed[0]["code"]
        which = ", ".join(f"{reports.short(o)}: {o['code']}" for o in failed)
        return status, (f"exit status {status}: the program exited non-zero on {len(failed)} "
                        f"of the {len(ended)} ranks that finished ({which}; "
                        f"mpirun exit status {code})")
    if not completed:
        return _none_completed(code, outcomes, ended)
    if code:
        return 0, (f"mpirun exited with status {code} for processes lost on the way, but the "
                   f"program exited 0 on all {len(ended)} ranks that finished")
    return 0, None


def _none_completed(code: int, outcomes: Sequence[Mapping[str, Any]],
                    ended: Sequence[Mapping[str, Any]]) -> tuple[int, str]:
    """:func:`exit_status` where every process that ended with a status (``ended``)
    left early or never joined, and the others were lost."""
    status = code or 1
    left = [o for o in ended if o.get("left")]
    which = ", ".join(reports.short(o) for o in left)
    said = [f"{len(left)} left early with status 0 ({which}) while the others trained on"
            ] if left else []
    if len(ended) > len(left):
        said.append(f"{len(ended) - len(left)} never joined (a spare or spawned process "
                    "that ended before it was adopted)")
    lost = [o for o in outcomes if o["code"] is None]
    return status, (f"exit status {status}: no rank completed: {', '.join(said)}, and the "
                    f"other {reports.lost_words(lost)} (mpirun exit status {code})")


def preempted_line(outcomes: Sequence[Mapping[str, Any]]) -> str:
    """What the launcher says of a job whose ranks stopped with :data:`EXIT_PREEMPTED`:
    the step of the final checkpoint, from what the ranks recorded of it (at least one did)."""
    last = next(o["preempted"] for o in outcomes if o.get("preempted"))
    if not last.get("saved"):
        return (f"exit status {EXIT_PREEMPTED}: preempted at step {last.get('step')}: the final "
                f"checkpoint failed; a requeue resumes from the last committed one in "
                f"{last.get('directory')}")
    return (f"exit status {EXIT_PREEMPTED}: preempted: final checkpoint at step "
            f"{last.get('step')}; requeue resumes from it ({last.get('directory')})")
