"""Checkpoints that survive the death of whoever writes them.

The current lowest rank writes (rank 0 may be gone).  A checkpoint is the
job's :class:`~elastic_hvd.tensorflow.training_state.TrainingState` (model and
optimizer variables, learning rate, momentum, session step, the epoch to resume
at and the sampler's position: the format a joining rank receives), in one
file, plus the weights in Keras' own format for use outside elastic_hvd.  A
restarted job loads it without the old job's membership (see
``TrainingState.load_state``): it trains at the rate its own
script sets for its size.  How the files are named, written, committed and
kept is :mod:`keras_callbacks.ckpt_files`: a save never touches the files of a
committed checkpoint, so a writer that dies at any point (and the one that
takes over) leaves the last committed checkpoint loadable.  Names come from a
save counter that every rank counts (restored from the checkpoint, handed to
joining ranks), never from the writer's own history.

Under ``elastic-hvd-run``, with a ``sampler``, the current rank 0 also sends the
training state after a step to the launcher's memory
(:mod:`elastic_hvd.state_replica`): after every step if copying is cheap, less
often if not -- the copies take at most ``ELASTIC_HVD_REPLICA_BUDGET`` (5 %) of the
time -- and never while a send is in flight.  When the runtime ends the job for a
lost node, the launcher starts it again and ``restore()`` takes that copy if it
is newer than the newest checkpoint: only the steps since the copy are trained
again.

The state is written as data (:mod:`elastic_hvd.state_format`: JSON and
``.npz``, never pickle), in the checkpoint and in the launcher's copy alike, so
restoring from a directory someone else could write runs no code; a checkpoint
whose state is a pickle (from an elastic_hvd that wrote them) is read only with
``ELASTIC_HVD_UNPICKLE_CHECKPOINTS`` (see docs/checkpoints.md).

A save that fails (a full disk, a read-only or vanished directory) costs that
checkpoint, not the job: the writer removes what it wrote, tells the other ranks
(so that all count alike), rank 0 says which save failed and why, and training
goes on; the last committed checkpoint is untouched.  After
``ELASTIC_HVD_MAX_FAILED_SAVES`` failures in a row every rank stops with
EXIT_SAVES_FAILED: a job that can keep nothing should not train on for hours.

On SIGUSR1 (Slurm's ``--signal=B:USR1@N``, which ``elastic-hvd-run`` passes on to
every rank) the ranks agree on the next step boundary, save there -- a committed
checkpoint of the last step trained, mid-epoch included -- and every rank exits with
EXIT_PREEMPTED (8); a job started again resumes from it with no step redone
(:mod:`keras_callbacks.preempt`, docs/slurm.md).  On by default inside a Slurm job
(``SLURM_JOB_ID``) only: it adds an agreement to every step; ``final_on_signal=True`` or
``False`` says so outright.

Not guaranteed: if the writer dies during the *final* checkpoint (too few
ranks), nobody writes it in its place: the previous committed one stays.
"""

import contextlib
import os
import pickle
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from elastic_hvd import state_format, state_replica
from elastic_hvd.core import config, runtime, safe_files
from elastic_hvd.tensorflow.optimizer_state import get_lr
from elastic_hvd.tensorflow.training_state import TrainingState

from .ckpt_files import CheckpointFiles
from .keras_leaks import save_weights
from elastic_hvd.log import STDOUT, get_logger
from elastic_hvd.runner.outcome import EXIT_PREEMPTED

from . import preempt

if TYPE_CHECKING:
    from elastic_hvd.sharding import ElasticSampler

_log = get_logger(__name__)

#: Exit status of a job that stopped because too few ranks were left.
EXIT_BELOW_MIN_NP = 3
#: Exit status of a job that stopped because its checkpoint saves failed, too many in a row.
EXIT_SAVES_FAILED = 6


#: The opt-in that lets ``restore()`` unpickle a state file.
UNPICKLE_ENV = config.env("unpickle_checkpoints")


def _read_state(path: str, size: int, owned: bool) -> Any:
    """The training state in the file ``path`` (a regular file of at most ``size``
    bytes, ours if ``owned``), as data; a pickled one (``.pkl``) only with the opt-in.
    ``StateFileError`` if it cannot be read."""
    pickled = path.endswith(".pkl")
    if pickled and not config.current().unpickle_checkpoints:
        raise state_format.StateFileError(path, (
            "a pickled training state: unpickling runs whatever code the file holds, so "
            f"elastic_hvd reads it only with {UNPICKLE_ENV}=1. Set it for one restore if you "
            "wrote this checkpoint yourself: the next save writes the state as data"))
    try:
        if not pickled:  # read from the file, not from a copy of it in memory
            return state_format.load(path, size, owned)
        f = safe_files.open_regular(path, size, owned)
    except OSError as exc:  # replaced since it was checked (a link, a FIFO), or gone
        raise state_format.StateFileError(path, str(exc).removeprefix(f"{path}: ")) from None
    if not runtime.is_initialized() or runtime.current().rank == 0:
        _log.warning(f"elastic_hvd: unpickling {path} ({UNPICKLE_ENV} is set); the next "
                     "checkpoint is written as data")
    with f:
        return pickle.load(f)


def _one_line(exc: BaseException) -> str:
    """``exc`` in one line of sane length (h5py's messages span lines)."""
    text = re.sub(r"\s+", " ", f"{type(exc).__name__}: {exc}").strip()
    return text if len(text) <= 400 else text[:400] + "..."


class ElasticCheckpoint(tf.keras.callbacks.Callback):
    """Save at the end of every ``every`` epochs into ``directory``, keeping the newest
    ``keep`` committed checkpoints; ``restore()`` resumes from the newest.  With
    ``final_on_signal`` (default: inside a Slurm job), SIGUSR1 makes every rank save at the
    next step boundary they agree on and exit with ``EXIT_PREEMPTED`` (see the module doc)."""

    _sending: threading.Thread | None

    def __init__(self, directory: str, sampler: "ElasticSampler | None" = None, every: int = 1,
                 keep: int = 3, final_on_signal: bool | None = None) -> None:
        super().__init__()
        # None: on inside a Slurm job only (SLURM_JOB_ID), where --signal=B:USR1@N asks for
        # it; elsewhere the per-step agreement it adds is not paid unless asked for.
        self.final_on_signal = ("SLURM_JOB_ID" in os.environ if final_on_signal is None
                                else final_on_signal)
        self.signals = preempt.Requests()
        #: The step the job stopped at on SIGUSR1 (its final checkpoint's), else None.
        self.stopped_on_signal: int | None = None
        if final_on_signal:  # now: a signal before fit begins is kept for its first step
            self.signals.install()
        self.files = CheckpointFiles(directory, keep, counts=("epoch", "step", "writer"))
        self.directory, self.sampler, self.every = directory, sampler, every
        self.epoch = 0
        self.saves = 0  # saves so far, counted on every rank: the next one's sequence number
        self.failed_saves = 0  # saves that failed since the last committed one (every rank)
        #: Whether the latest ``save()`` committed its checkpoint (on every rank alike).
        self.last_saved = False
        #: After ``restore()`` found a checkpoint: what was resumed, as an event-log record.
        self.resumed: dict[str, Any] | None = None
        self._sending = None  # the thread sending the state to the launcher, if any
        self._next_copy = 0.0  # perf_counter() before which no copy is made (the budget)

    @property
    def meta_path(self) -> str:
        return self.files.meta_path

    # a rank that joins counts on from here (see ElasticGrowth)
    def live_state(self) -> dict[str, Any]:
        return {"saves": self.saves, "failed_saves": self.failed_saves}

    def load_live_state(self, state: dict[str, Any]) -> None:
        self.saves, self.failed_saves = state["saves"], state["failed_saves"]

    def on_train_begin(self, logs: dict | None = None) -> None:
        # Every rank (any may become the writer): a directory that cannot be used stops
        # the job at its start, in one line, rather than at its first save.
        self.files.checked_dir()
        if self.final_on_signal:
            self.signals.install()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.epoch = epoch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.stopped_on_signal is None and (epoch + 1) % self.every == 0:
            self.save(epoch + 1)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.final_on_signal and self.stopped_on_signal is None:
            requested = self.signals.received.is_set()
            if (preempt.agreed(runtime.current(), requested) if runtime.is_initialized()
                    else requested):
                self._final_on_signal()
        self._copy_to_launcher()

    def _final_on_signal(self) -> None:
        """Every rank, at the step boundary all agreed on: save the last step trained,
        record it for the launcher, and have Keras stop; ``on_train_end`` exits with
        EXIT_PREEMPTED.  Not from here: a process that exits in the middle of ``fit``
        tears TensorFlow down with its input pipeline running (10 s and more here)."""
        comm = runtime.current() if runtime.is_initialized() else None
        step = runtime.session().step if comm is not None else None
        done = self.sampler is not None and self.sampler.steps_left() == 0 and \
            not self.sampler.uncommitted()
        resume_epoch = self.epoch + 1 if done else self.epoch
        self.save(resume_epoch)
        if comm is None or comm.rank == 0:
            at = f"step {step}" if step is not None else f"epoch {resume_epoch + 1}"
            _log.warning(
                f"elastic_hvd: {preempt.SIGNAL.name} received: stopping at the end of {at}: "
                + (f"final checkpoint written to {self.directory}; a requeued or resubmitted "
                   f"job resumes from it (exit status {EXIT_PREEMPTED})" if self.last_saved else
                   f"the final checkpoint failed (said above); a requeued job resumes from the "
                   f"last committed one in {self.directory} (exit status {EXIT_PREEMPTED})"))
        preempt.record(step if step is not None else -1, resume_epoch, self.last_saved,
                       self.directory)
        self.stopped_on_signal = step if step is not None else -1
        self.model.stop_training = True

    def on_train_end(self, logs: dict | None = None) -> None:
        if self.stopped_on_signal is not None:
            runtime.exit_with(EXIT_PREEMPTED)

    def _copy_to_launcher(self) -> None:
        if self.sampler is None or not state_replica.configured():
            return
        if runtime.current().rank != 0 or (self._sending and self._sending.is_alive()):
            return
        budget = config.current().replica_budget
        started = time.perf_counter()
        if budget <= 0 or started < self._next_copy:
            return
        done = self.sampler.steps_left() == 0 and not self.sampler.uncommitted()
        state = self._training_state(self.model).state(self.epoch + 1 if done else self.epoch)
        self._next_copy = time.perf_counter() + (time.perf_counter() - started) / budget

        def send() -> None:
            try:
                state_replica.put([state["session"]["step"]], state_format.dumps(state))
            except OSError as exc:  # the launcher is gone or busy: the next step tries again
                _log.warning(f"elastic_hvd: could not send the state to the launcher: {exc}")
        self._sending = threading.Thread(target=send, name="elastic_hvd-replica", daemon=True)
        self._sending.start()

    def _training_state(self, model: Any) -> TrainingState:
        return TrainingState(model, sampler=self.sampler)

    def save(self, resume_epoch: int) -> None:
        """Called on every rank (it counts the save); the lowest live rank writes.
        ``resume_epoch`` is where to restart (the sampler's position resumes it if it
        is that epoch's, mid-way).  ``last_saved`` tells whether it was committed.

        Every rank learns the outcome from the writer (one broadcast), so all count
        failed saves alike and stop together (EXIT_SAVES_FAILED) -- except while too
        few ranks are left (the final checkpoint: no collective works then; only the
        writer knows) or when the writer is lost during the save (nobody knows: not
        counted either way)."""
        seq, self.saves = self.saves, self.saves + 1
        comm = runtime.current() if runtime.is_initialized() else None
        failure = self._write(seq, resume_epoch) if comm is None or comm.rank == 0 else None
        if comm is not None and comm.below_min_np is None:
            failure = comm.broadcast_object(failure)  # the writer's, or None if it was lost
        self.last_saved = failure == ""
        if self.last_saved:
            self.failed_saves = 0
        if not failure:
            return
        self.failed_saves += 1
        limit = config.current().max_failed_saves
        final = comm is not None and comm.below_min_np is not None  # the job stops anyway
        stop = self.failed_saves >= limit and not final
        if comm is None or comm.rank == 0:
            what = f"the checkpoint of epoch {resume_epoch} (save {seq}) failed: {failure}"
            setting = f"{config.env('max_failed_saves')}={limit}"
            (_log.error if stop else _log.warning)(f"elastic_hvd: {what}" if final else
                  f"elastic_hvd: stopping: {self.failed_saves} checkpoint saves in a row failed "
                  f"({setting}), the last: {what}. The last committed checkpoint in "
                  f"{self.directory} is kept: make room or fix the directory, then restart the "
                  f"job to resume from it (exit status {EXIT_SAVES_FAILED})." if stop else
                  f"elastic_hvd: {what}; training goes on, the last committed checkpoint in "
                  f"{self.directory} is kept ({self.failed_saves} of {setting} failed saves "
                  "in a row)")
        if stop:
            runtime.exit_with(EXIT_SAVES_FAILED)

    def _write(self, seq: int, resume_epoch: int) -> str:
        """Write the checkpoint: "" if it was committed, else why not (one line).
        h5py reports a failed write (ENOSPC...) as RuntimeError, the rest as OSError."""
        model = self.model
        state = self._training_state(model).state(resume_epoch)
        try:
            self.files.write(seq, resume_epoch, {
                "state": ("state.npz", lambda path: state_format.dump(state, path)),
                "weights": ("weights.h5", lambda path: save_weights(model, path)),
            }, {"epoch": resume_epoch, "step": state.get("session", {}).get("step"),
                "host": socket.gethostname(),
                "writer": runtime.current().original_id if runtime.is_initialized() else None})
        except (OSError, RuntimeError) as exc:
            return _one_line(exc)
        return ""

    def restore(self, model: Any, epochs: int | None = None) -> int:
        """Load the newest state into ``model`` (and the sampler): the launcher's
        copy if it is newer than the newest committed checkpoint, else that
        checkpoint; returns the epoch to resume at (0: none).  Rank 0 says what it
        resumes, before anything trains; given ``epochs`` (the run's total), also how
        many epochs are left, or that none is.  A process joining a running job loads
        nothing: it receives the live state."""
        if runtime.is_initialized() and runtime.current().joining:
            return 0
        entries = self.files.entries()
        if entries:
            self.saves = max(self.saves, self.files.next_seq(entries))
        kept = self._replica()
        if kept is not None and (not entries or kept["session"]["step"] >= (
                entries[0].get("step") or 0)):
            return self._load(model, kept, f"the launcher's copy of step {kept['session']['step']}",
                              epochs)
        if not entries:
            return 0
        epoch: list[int] = []
        self.files.load(lambda entry: epoch.append(self._read(model, entry, epochs)))
        return epoch[-1]

    @staticmethod
    def _replica() -> dict[str, Any] | None:
        """In a job ``elastic-hvd-run`` relaunched, the state it kept from the run before
        (else None).  Each rank fetches it: restoring stays a local act (a script may
        restore into a scratch model on one rank), and no rank can have stored a newer
        one yet -- that takes a training step, which needs every rank."""
        if not (state_replica.configured() and state_replica.relaunched()):
            return None
        try:
            blob = state_replica.get()[1]
        except OSError as exc:
            _log.warning(f"elastic_hvd: the launcher's copy of the state is out of reach: {exc}")
            return None
        if not blob:
            return None
        try:
            return state_format.loads(blob, "the launcher's copy of the state")
        except state_format.StateFileError as exc:
            _log.warning(f"elastic_hvd: ignoring the launcher's copy of the state ({exc.reason}); "
                         "restoring from the checkpoints on disk")
            return None

    def _read(self, model: Any, entry: dict[str, Any], epochs: int | None) -> int:
        name = entry.get("state")
        if name not in entry["files"]:
            raise ValueError(f"{self.meta_path}: the checkpoint of epoch {entry.get('epoch')} "
                             f"names no state file among its files {entry['files']} (written "
                             "before checkpoints held the training state, or edited)")
        path = os.path.join(self.directory, name)  # type: ignore[arg-type]  # (name in files)
        state = _read_state(path, entry["sizes"][name], self.files.shared())
        try:
            return self._load(model, state, entry["name"], epochs, in_directory=True)
        except (KeyError, IndexError, TypeError, AttributeError) as exc:  # data, not a state
            raise state_format.StateFileError(path, (
                f"not a training state ({type(exc).__name__}: {exc})")) from exc

    def _load(self, model: Any, state: dict[str, Any], source: str, epochs: int | None,
              in_directory: bool = False) -> int:
        epoch = self._training_state(model).load_state(state, membership=False)
        comm = runtime.current() if runtime.is_initialized() else None
        size = comm.size if comm is not None else 1
        self.resumed = {"epoch": epoch + 1, "step": 0, "lost": [], "gained": [],
                        "old_size": state.get("size"), "new_size": size, "during": "resume",
                        "checkpoint": source, "lr_before": state.get("lr"),
                        "lr_after": get_lr(model.optimizer)}
        if comm is None or comm.rank == 0:
            _log.info(f"elastic_hvd: {self._resume_line(epoch, epochs, source, in_directory)}",
                      extra=STDOUT)
        return epoch

    def _resume_line(self, epoch: int, epochs: int | None, source: str,
                     in_directory: bool) -> str:
        """What a resume at ``epoch`` (from 0) of ``epochs`` from ``source`` means.

        Printed on stdout, as Keras' output and the script's own prints: mpirun forwards
        stdout and stderr apart, so a line on stderr can reach the console after what
        the script printed later, and this one must come before anything of the run."""
        if epochs is not None and epoch >= epochs:
            what = f"the checkpoint {source} in {self.directory}" if in_directory else source
            trained = f"{epoch} of {epochs} epochs" if epoch == epochs else \
                f"{epoch} epochs, more than the {epochs} this run asks for"
            advice = "; remove it or raise epochs" if in_directory else ""
            return f"nothing left to train: {what} has trained {trained}{advice}"
        resumed = self.resumed or {}
        total, left = ("", "") if epochs is None else (
            f" of {epochs}", f"{epochs - epoch} epoch{'s' if epochs - epoch > 1 else ''} left; ")
        lr_before = resumed.get("lr_before")
        return (f"resuming at epoch {epoch + 1}{total} from {source} ({left}written on "
                f"{resumed.get('old_size') or '?'} ranks, now {resumed.get('new_size')}; "
                f"learning rate {'?' if lr_before is None else f'{lr_before:g}'} -> "
                f"{resumed.get('lr_after'):g}, as this job's script sets it)")

    @contextlib.contextmanager
    def final_on_failure(self) -> Iterator[None]:
        """Around ``model.fit``: if too few ranks are left (``RanksBelowMinimumError``,
        however TF wrapped it), the survivors save and exit with EXIT_BELOW_MIN_NP.

        The checkpoint resumes the interrupted epoch where it stopped (the sampler's
        remaining queue), so no sample is lost or repeated.
        """
        try:
            yield
        except Exception:  # inside model.fit, TF re-wraps the core's error
            below_min = runtime.current().below_min_np
            if below_min is None:
                raise
            self.save(self.epoch)
            if runtime.current().rank == 0:
                _log.error(f"elastic_hvd: stopping: {below_min}. " + (
                    f"Final checkpoint written to {self.directory}; restart the job to resume "
                    f"at epoch {self.epoch + 1}." if self.last_saved else
                    "The final checkpoint failed (said above): restart the job to resume from "
                    f"the last committed one in {self.directory}."))
            runtime.exit_with(EXIT_BELOW_MIN_NP)
