"""Every core collective against numpy, on however many ranks it is launched with.

Each rank can rebuild any rank's input from its seed, so it checks its own
result against a numpy computation of the whole collective.
"""

import numpy as np

import report
from elastic_hvd import core
from elastic_hvd.core.collectives import even_splits

DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]
OPS = [core.Sum, core.Average, core.Min, core.Max, core.Product]


def data(rank, dtype, shape=(5, 3)):
    rng = np.random.default_rng(1000 + rank)
    return rng.integers(1, 4, size=shape).astype(dtype)


def expected_reduce(arrays, op, dtype):
    stacked = np.stack([a.astype(np.float64) for a in arrays])
    result = {core.Sum: stacked.sum(0), core.Min: stacked.min(0), core.Max: stacked.max(0),
              core.Product: stacked.prod(0), core.Average: stacked.sum(0) / len(arrays)}[op]
    if np.issubdtype(dtype, np.integer) and op == core.Average:
        result = np.trunc(result)  # as Horovod's integer averages
    return result


def main():
    comm = core.init()
    n, me = comm.size, comm.rank
    failures = []

    def check(name, ok):
        if not ok:
            failures.append(name)

    for dtype in DTYPES:
        inputs = [data(r, dtype) for r in range(n)]
        for op in OPS:
            got = comm.allreduce(inputs[me], op=op)
            want = expected_reduce(inputs, op, dtype)
            check(f"allreduce {np.dtype(dtype).name} {op.name}",
                  got.dtype == dtype and got.shape == want.shape
                  and np.allclose(got.astype(np.float64), want, rtol=1e-3))
        got = comm.allreduce(inputs[me], op=core.Sum, prescale_factor=2.0, postscale_factor=0.5)
        check(f"allreduce scaled {np.dtype(dtype).name}",
              np.allclose(got.astype(np.float64), expected_reduce(inputs, core.Sum, dtype)))
        # allgather with a different first dimension on every rank
        parts = [data(r, dtype, (r + 1, 2)) for r in range(n)]
        check(f"allgather {np.dtype(dtype).name}",
              np.array_equal(comm.allgather(parts[me]), np.concatenate(parts)))
        for root in range(n):
            check(f"broadcast root {root} {np.dtype(dtype).name}",
                  np.array_equal(comm.broadcast(inputs[me], root_rank=root), inputs[root]))
        rows = 2 * n + 1  # not divisible: lower ranks get an extra row
        blocks = [data(r, dtype, (rows, 2)) for r in range(n)]
        for op in (core.Sum, core.Average):
            got = comm.reducescatter(blocks[me], op=op)
            start = sum(even_splits(rows, n)[:me])
            want = expected_reduce(blocks, op, dtype)[start:start + even_splits(rows, n)[me]]
            check(f"reducescatter {op.name} {np.dtype(dtype).name}",
                  got.dtype == dtype and np.allclose(got.astype(np.float64), want, rtol=1e-3))

    # alltoall: rank r sends (r + j) % 3 rows to rank j, each row tagged (r, j)
    splits = [(me + j) % 3 for j in range(n)]
    send = np.concatenate([np.full((s, 2), [me, j]) for j, s in enumerate(splits)]).astype(np.int64)
    got, recv_splits = comm.alltoall(send, splits=splits)
    want = np.concatenate([np.full(((r + me) % 3, 2), [r, me]) for r in range(n)])
    check("alltoall splits", np.array_equal(got, want.reshape(-1, 2))
          and list(recv_splits) == [(r + me) % 3 for r in range(n)])
    got, _ = comm.alltoall(np.arange(2 * n) + 100 * me)
    check("alltoall even", np.array_equal(got, np.concatenate(
        [np.arange(2 * me, 2 * me + 2) + 100 * r for r in range(n)])))
    check("bool allgather", np.array_equal(comm.allgather(np.array([me % 2 == 0])),
                                           np.array([r % 2 == 0 for r in range(n)])))
    check("broadcast_object", comm.broadcast_object({"from": me, "x": [1, 2]}, root_rank=n - 1)
          == {"from": n - 1, "x": [1, 2]})
    check("allgather_object", comm.allgather_object(("r", me)) == [("r", r) for r in range(n)])
    comm.barrier()
    out = np.empty(7, dtype=np.float32)
    got = comm.allreduce(np.ones(7, dtype=np.float32), op=core.Average, out=out)
    check("allreduce out=", got is out and np.allclose(out, 1.0))
    report.write(comm.original_id, failures=failures, size=n)


if __name__ == "__main__":
    main()
