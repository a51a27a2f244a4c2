"""Time from a SIGKILL to the survivors' next completed collective.

The victim writes the wall-clock time of its own kill to a file and kills itself
as it starts collective ``KILL_AT``; every survivor notes when that collective
completes.  All ranks share one host, so their clocks agree.
"""

import json
import os
import signal
import sys
import time

import numpy as np

from elastic_hvd import core

KILL_AT = 50


def main():
    victim, stamp = int(sys.argv[1]), sys.argv[2]
    comm = core.init()
    x = np.ones(1024, dtype=np.float32)  # 4 KiB
    for i in range(KILL_AT + 20):
        if i == KILL_AT and comm.original_id == victim:
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        comm.allreduce(x)
        if i == KILL_AT and comm.rank == 0:
            done = time.time()
            with open(stamp) as f:
                killed = float(f.read())
            event = comm.events[0]
            print("RESULT " + json.dumps({"np_before": event.old_size, "recovery_s": done - killed,
                                          "detect_s": event.detect_s, "repair_s": event.repair_s}))
            sys.stdout.flush()


if __name__ == "__main__":
    main()
