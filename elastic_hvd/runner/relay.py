"""mpirun's stderr, passed through to the launcher's as it comes.

Less TensorFlow's start-up lines where the user did not ask for them
(:mod:`.console`), and under the reporter's lock, so that a failure report and a
relayed chunk do not interleave.
"""

import io
import select
import subprocess
import sys
import threading
from typing import cast

from .console import NoiseFilter

#: Seconds the relay waits for output before it looks whether mpirun has exited ...
LOOK_PERIOD = 0.5
#: ... and while it holds back an incomplete line (let go when the stream pauses).
HOLD_PERIOD = 0.1
#: Bytes read at once.
CHUNK = 65536
#: Bytes of mpirun's last output kept for the verdict (a lost node's words).
TAIL = 4096


def relay_stderr(proc: subprocess.Popen[bytes], lock: threading.Lock, quiet_tf: bool) -> bytes:
    """Copy ``proc``'s stderr to ours (without TensorFlow's start-up lines if
    ``quiet_tf``) until EOF, or until ``proc`` has exited: a frozen daemon it started
    may hold the pipe open for ever.  Returns the last :data:`TAIL` bytes."""
    stream = cast(io.BufferedReader, proc.stderr)  # as stderr=PIPE makes it
    noise = NoiseFilter() if quiet_tf else None
    tail = b""

    def write(data: bytes) -> None:
        if data:
            with lock:
                sys.stderr.buffer.write(data)
                sys.stderr.flush()

    while True:
        holding = noise is not None and noise.holding
        if select.select([stream], [], [], HOLD_PERIOD if holding else LOOK_PERIOD)[0]:
            chunk = stream.read1(CHUNK)
            if not chunk:
                break
            write(noise.feed(chunk) if noise is not None else chunk)
            tail = (tail + chunk)[-TAIL:]
        elif noise is not None and holding:
            write(noise.flush())
        elif proc.poll() is not None:
            break
    if noise is not None:
        write(noise.flush())
    return tail

