"""TensorFlow's start-up lines, kept off the console that ``elastic-hvd-run`` relays.

Every rank's ``import tensorflow`` prints absl's INFO lines (oneDNN, CPU features)
and its ``InitializeLog`` warning before TensorFlow reads ``TF_CPP_MIN_LOG_LEVEL``,
so that variable cannot hide them (``TF_ENABLE_ONEDNN_OPTS=0`` would, by turning
oneDNN's kernels off).  The launcher, which relays the ranks' stderr anyway, drops
them -- what ``TF_CPP_MIN_LOG_LEVEL=1`` means to hide -- unless the user sets
``TF_CPP_MIN_LOG_LEVEL`` (:func:`tf_logs_wanted`; docs/settings.md).
"""

import re
from collections.abc import Iterable, Mapping

#: absl's INFO line (``I<mmdd> <time> <thread> <file>:<line>] ...``) and its warning
#: that logging was not initialized yet.
NOISE = re.compile(rb"I\d{4} [\d:.]+ +\d+ [\w.+-]+:\d+\] |WARNING: All log messages before "
                   rb"absl::InitializeLog\(\) is called are written to STDERR\r?$")


def tf_logs_wanted(environ: Mapping[str, str], exported: Iterable[str]) -> bool:
    """Whether the user set ``TF_CPP_MIN_LOG_LEVEL`` (in the environment, or for the
    ranks with ``-x``): then the launcher neither sets it nor filters TF's lines."""
    return "TF_CPP_MIN_LOG_LEVEL" in environ or any(
        item.split("=", 1)[0] == "TF_CPP_MIN_LOG_LEVEL" for item in exported)


class NoiseFilter:
    """Feed it the relayed bytes; it returns them without the :data:`NOISE` lines.

    A line is judged once complete.  An incomplete one that cannot become noise
    (another first letter, a carriage return: a progress bar) passes at once, and
    :meth:`flush` lets one go when the stream pauses, so nothing waits for a newline."""

    def __init__(self) -> None:
        self._partial = b""
        self._passing = False  # the start of the current line was let through

    def feed(self, chunk: bytes) -> bytes:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        kept = []
        for line in lines:
            if self._passing or not NOISE.match(line):
                kept.append(line + b"\n")
            self._passing = False
        if self._partial and not (self._partial[:1] in (b"I", b"W") and b"\r" not in
                                  self._partial and len(self._partial) < 4096):
            kept.append(self.flush())
        return b"".join(kept)

    @property
    def holding(self) -> bool:
        """True while an incomplete line waits (the relay should not wait long)."""
        return bool(self._partial)

    def flush(self) -> bytes:
        """The incomplete line held back; the rest of that line will pass unjudged."""
        rest, self._partial = self._partial, b""
        self._passing = self._passing or bool(rest)
        return rest
