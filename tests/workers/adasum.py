"""Adasum on the resilient core: each rank saves its inputs' seeds' results for the
test, which checks them against its own numpy reference (tests/test_adasum.py).

    python adasum.py numerics        # single and fused Adasum allreduces, three dtypes
    python adasum.py kill <calls>    # Adasum allreduces; the fault plan kills a rank
"""

import os
import sys

import numpy as np

import report
from elastic_hvd import core
from elastic_hvd.core import reducer

#: Shapes of the tensors of the fused (grouped) call: sizes that split unevenly at
#: every halving, and one of a single element.
SHAPES = [(3, 5), (7,), (1,), (2, 2, 3)]
KILL_COUNT = 1 << 20  # elements of the allreduce the fault plan interrupts (4 MiB)


def tensor(original_id, k, shape, dtype):
    """Tensor ``k`` of a rank: what the test rebuilds from the same seed."""
    rng = np.random.default_rng(1000 * (original_id + 1) + k)
    return rng.normal(size=shape).astype(dtype)


def save(name, array):
    np.save(os.path.join(os.environ["TEST_OUT_DIR"], name), array)


def numerics(comm):
    me = comm.original_id
    for dtype in (np.float16, np.float32, np.float64):
        name = np.dtype(dtype).name
        single = comm.allreduce(tensor(me, 0, (4, 6), dtype), op=core.Adasum)
        assert single.dtype == dtype and single.shape == (4, 6)
        save(f"single_{name}_{me}.npy", single)
        scaled = comm.allreduce(tensor(me, 0, (4, 6), dtype), op=core.Adasum,
                                prescale_factor=0.5, postscale_factor=3.0)
        save(f"scaled_{name}_{me}.npy", scaled)
        fused = reducer.fused_allreduce(
            comm, [tensor(me, 1 + k, shape, dtype) for k, shape in enumerate(SHAPES)],
            core.Adasum)
        assert [f.shape for f in fused] == SHAPES and all(f.dtype == dtype for f in fused)
        for k, f in enumerate(fused):
            save(f"fused{k}_{name}_{me}.npy", f)
    refused = []
    for name, call in (("reducescatter", lambda: comm.reducescatter(np.ones(4), op=core.Adasum)),
                       ("int32", lambda: comm.allreduce(np.ones(4, np.int32), op=core.Adasum))):
        try:
            call()
        except (NotImplementedError, TypeError) as exc:
            refused.append([name, str(exc)])
    report.write(me, ids=list(comm.ids), refused=refused)


def kill(comm, calls="3"):
    me = comm.original_id
    x = tensor(me, 0, (KILL_COUNT,), np.float32)
    changed_in = []  # the calls (1-based) during which the membership changed
    for call in range(1, int(calls) + 1):
        before = len(comm.events)
        result = comm.allreduce(x, op=core.Adasum)
        if len(comm.events) > before:
            changed_in.append(call)
    save(f"kill_{me}.npy", result)
    report.write(me, ids=list(comm.ids), changed_in=changed_in,
                 events=[e.as_dict() for e in comm.events])


if __name__ == "__main__":
    globals()[sys.argv[1]](core.init(), *sys.argv[2:])
