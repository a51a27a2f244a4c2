"""Process sets through the TF layer with a real SIGKILL (tests/test_process_sets.py).

4 ranks, ``hvd.init(process_sets=[A, B])`` with A = ranks {0, 1} and B = {2, 3}.  Each
rank reduces 16 MiB ``calls`` times on its own set (``hvd.allreduce(..., process_set=)``,
eagerly and in a ``tf.function``); the test's fault plan kills rank 1 inside one of A's
allreduces (or, with ``kill_at`` > 0, rank 1 SIGKILLs itself 10 ms into that call).
Then every survivor calls a global allreduce (the global repair, and the sets derived
again), a broadcast on its set from a global root rank, and a DistributedGradientTape
step on its set.  Each rank reports what it got.

    python tf_process_sets.py [calls] [kill_at]
"""

import os
import signal
import sys
import threading

import numpy as np
import tensorflow as tf

import report
import elastic_hvd.tensorflow as hvd
from elastic_hvd.core import runtime

COUNT = 4 * 1024 * 1024  # float32: 16 MiB


def contribution(original_id, count):
    """Small integers as float32: any summation order is exact."""
    return ((np.arange(count) % 13) + 100 * (original_id + 1)).astype(np.float32)


def main(calls="6", kill_at="4"):
    a, b = hvd.ProcessSet([0, 1]), hvd.ProcessSet([2, 3])
    hvd.init(process_sets=[a, b])
    me = hvd.rank()  # the original id: no rank is lost yet
    mine = a if me in (0, 1) else b
    comm = runtime.current()
    x = tf.constant(contribution(me, COUNT))
    reduce_fn = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum, process_set=mine))
    exact = []
    for call in range(1, int(calls) + 1):
        if me == 1 and call == int(kill_at):
            threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGKILL)).start()
        if call % 2:
            got = hvd.allreduce(x, op=hvd.Sum, process_set=mine)
        else:
            got = reduce_fn(x)
        live = comm.process_sets.entry(mine.process_set_id).live
        exact.append([list(live), bool(np.array_equal(
            got.numpy(), sum(contribution(i, COUNT) for i in live)))])
    set_events = [[e.during, e.old_size, e.new_size, list(e.lost)]
                  for e in comm.process_sets.events(mine.process_set_id)]

    total = hvd.allreduce(tf.constant([float(me)]), op=hvd.Sum)  # the global repair
    root = max(mine.ranks)  # a global rank, as Horovod names a set's broadcast root
    root_id = comm.ids[root]
    broadcast = hvd.broadcast(tf.constant([float(me)]), root, process_set=mine)

    w = tf.Variable([0.0])
    with tf.GradientTape() as tape:
        loss = w * float(me + 1)
    tape = hvd.DistributedGradientTape(tape, process_set=mine)
    [grad] = tape.gradient(loss, [w])
    report.write(me, exact=exact, set_events=set_events, total=float(total.numpy()[0]),
                 ids=list(comm.ids), global_events=[list(e.lost) for e in comm.events],
                 ids_and_ranks={str(k): v for k, v in hvd.mpi_ops._basics
                                ._get_process_set_ids_and_ranks().items()},
                 size=mine.size(), rank=mine.rank(), included=[a.included(), b.included()],
                 broadcast=float(broadcast.numpy()[0]), root_id=root_id,
                 grad=float(grad.numpy()[0]),
                 size_op=int(hvd.size_op(mine.process_set_id).numpy()),
                 included_op=int(hvd.process_set_included_op(a.process_set_id).numpy()))


if __name__ == "__main__":
    main(*sys.argv[1:])
