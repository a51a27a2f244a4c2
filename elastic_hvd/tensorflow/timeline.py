"""A Chrome-trace timeline of the collectives, like Horovod's ``HOROVOD_TIMELINE``.

``start_timeline(path)`` records one complete event ("ph": "X") per collective
op until ``stop_timeline()``, which writes the JSON array that chrome://tracing
and Perfetto read.  Each rank writes its own file when the path contains ``{rank}``;
otherwise only the lowest rank writes.
"""

import json
import os
import threading
import time
from typing import Any

from ..core import runtime
from . import layer

_lock = threading.Lock()
_epoch = time.perf_counter()


class _Recording:
    """The events recorded so far, for ``path``; kept in the TF layer's state (:mod:`.layer`)."""

    events: list[dict[str, Any]]
    def __init__(self, path: str) -> None:
        self.path, self.events = path, []


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record every collective op from now on, for :func:`stop_timeline` to write to
    ``file_path``; events recorded before are dropped.  ``mark_cycles`` is ignored."""
    with _lock:
        layer.state().timeline = _Recording(file_path)


def record(name: str, started: float, finished: float) -> None:
    recording = layer.state().timeline
    if recording is None:
        return
    with _lock:
        recording.events.append({"name": name, "cat": "collective", "ph": "X",
                                 "pid": os.getpid(), "tid": 0, "ts": (started - _epoch) * 1e6,
                                 "dur": (finished - started) * 1e6})


def stop_timeline() -> None:
    """Stop recording and write the events, atomically: rank 0 writes, or every rank
    when the path contains ``{rank}``.  A no-op if no timeline was started."""
    tf_layer = layer.state()
    with _lock:
        recording, tf_layer.timeline = tf_layer.timeline, None
    if recording is None:
        return
    events, path = recording.events, recording.path
    rank = runtime.current().rank if runtime.is_initialized() else 0
    if "{rank}" in path:
        path = path.format(rank=rank)
    elif rank != 0:
        return
    with open(path + ".tmp", "w") as f:
        json.dump(events, f)
    os.replace(path + ".tmp", path)
