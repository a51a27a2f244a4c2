"""A record of every membership change: JSON lines and TensorBoard scalars.

The console line of each change comes from the core (``elastic_hvd.core.announce``),
for every kind of script; this log adds where training was and the learning rate
before and after.

Every rank makes sure at the start of training that it can write the log (and the
TensorBoard directory): any of them may become its writer, and the first record
comes at the first change -- a path that cannot be written would otherwise show
in production, at the first lost rank, not when the script is tried.
"""

import json
import os
import time
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from elastic_hvd.core import runtime, safe_files
from elastic_hvd.tensorflow.keras.callbacks import get_lr

from .base import MembershipCallback
from elastic_hvd.log import get_logger

if TYPE_CHECKING:
    from elastic_hvd.core.membership import MembershipEvent

    from .lr import LearningRateRescaler

_log = get_logger(__name__)


class MembershipEventLog(MembershipCallback):
    """One JSON line per change (written by the current lowest rank), e.g.::

        {"time": ..., "epoch": 1, "step": 7, "lost": [2], "gained": [], "old_size": 4,
         "new_size": 3, "detect_ms": 38.1, "repair_ms": 0.3, "during": "HorovodGradients",
         "lr_before": 0.04, "lr_after": 0.03}

    ``epoch`` and ``step`` count from 1, as Keras prints them ("Epoch 2/5"); the change
    happened during that step.  For a loss, ``detect_ms`` runs from the moment this
    rank entered the collective the failure interrupted to the survivors' agreement
    that it failed (not from the failure itself, which no survivor can see), and
    ``repair_ms`` is the revoke and shrink after it; for a join, ``spawn_ms`` is what
    the running ranks spent starting the process and ``repair_ms`` the time from
    then until it joined, while training went on.  A restart from a
    checkpoint is a record too (``"during": "resume"``, with ``checkpoint``; see
    :meth:`record_resume`), and so is every anomaly (``"anomaly": kind`` and its
    evidence, see ``elastic_hvd.core.freshness``), written by the rank that met it.
    Pass the ``rescaler`` so that ``lr_after`` is the rescaled rate; ``log_dir`` adds
    TensorBoard scalars (``membership/size``, ``membership/recovery_ms``).
    """

    def __init__(self, path: str, rescaler: "LearningRateRescaler | None" = None,
                 log_dir: str | None = None) -> None:
        super().__init__()
        self.path, self.rescaler = path, rescaler
        self.log_dir = log_dir
        self.records: list[dict[str, Any]] = []
        self._writer: Any = None
        self._steps_done = 0

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._check_paths()
        anomalies = self.comm.anomalies.listeners
        if self._on_anomaly not in anomalies:
            anomalies.add(self._on_anomaly)
        super().on_train_begin(logs)

    def _on_anomaly(self, entry: dict[str, Any]) -> None:
        """Called inside the collective that met it: only a line of the file."""
        record = {"epoch": self.epoch + 1, "step": self.step, **entry}
        self.records.append(record)
        self._append(record)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._steps_done += 1
        super().on_train_batch_end(batch, logs)

    def live_state(self) -> dict[str, Any]:
        return {**super().live_state(), "steps_done": self._steps_done}

    def load_live_state(self, state: dict[str, Any]) -> None:
        super().load_live_state(state)
        self._steps_done = state["steps_done"]

    def record_resume(self, record: dict[str, Any]) -> None:
        """Log a restart from a checkpoint (``ElasticCheckpoint.resumed``): the
        job's size and learning rate may have changed since it was written."""
        self._check_paths()
        record = {"time": time.time(), **record}
        self.records.append(record)
        if runtime.current().rank == 0:
            self._append(record)

    def _check_paths(self) -> None:
        """The log's directory made (0700) if missing and the log opened for appending;
        the TensorBoard directory likewise.  ``UnsafePathError`` (one line) if not."""
        directories = [("event log directory", os.path.dirname(os.path.abspath(self.path)))]
        if self.log_dir and "://" not in self.log_dir:  # tf.summary also writes to gs:// etc.
            directories.append(("TensorBoard directory", os.path.join(self.log_dir, "elastic")))
        for what, directory in directories:
            if not os.path.isdir(directory):
                safe_files.checked_dir(directory, what)
            elif not os.access(directory, os.W_OK | os.X_OK):
                raise safe_files.UnsafePathError(f"{what} {directory}: not writable")
        try:
            with open(self.path, "a"):
                pass
        except OSError as exc:
            raise safe_files.UnsafePathError(f"event log {self.path}: cannot be written "
                                             f"({exc.strerror or exc})") from None

    def _append(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def handle(self, event: "MembershipEvent") -> None:
        lr_before = lr_after = get_lr(self.model.optimizer)
        if self.rescaler is not None:  # it handled the event already (an earlier ORDER)
            lr_before = next((b for s, b, _ in self.rescaler.changes if s == event.sequence),
                             lr_before)
        record = {"time": event.wall_time, "epoch": self.epoch + 1, "step": self.step,
                  "lost": list(event.lost), "gained": list(event.gained),
                  "old_size": event.old_size, "new_size": event.new_size,
                  "detect_ms": round(event.detect_s * 1e3, 3),
                  "repair_ms": round(event.repair_s * 1e3, 3), "during": event.during,
                  "spawn_ms": round(event.spawn_s * 1e3, 3),
                  "lr_before": lr_before, "lr_after": lr_after}
        self.records.append(record)
        if self.comm.rank != 0:
            return
        self._append(record)
        if self.log_dir:
            self._tensorboard(event, record)

    def _tensorboard(self, event, record):
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(os.path.join(self.log_dir, "elastic"))
        try:
            with self._writer.as_default(step=self._steps_done):
                tf.summary.scalar("membership/size", event.new_size)
                tf.summary.scalar("membership/recovery_ms",
                                  record["detect_ms"] + record["repair_ms"])
            self._writer.flush()
        except Exception as exc:  # TBNotInstalledError: tensorflow-cpu comes without it
            if type(exc).__name__ != "TBNotInstalledError":
                raise
            _log.warning(f"elastic_hvd: no TensorBoard scalars ({exc}); `pip install tensorboard`")
            self.log_dir = None
