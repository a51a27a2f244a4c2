"""The TF ops against numpy, eagerly and inside tf.function, on however many ranks."""

import os

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

import report  # noqa: E402
import elastic_hvd.tensorflow as hvd  # noqa: E402
from elastic_hvd.core.collectives import even_splits  # noqa: E402

DTYPES = [tf.float16, tf.float32, tf.float64, tf.int32, tf.int64]
OPS = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max,
       "Product": hvd.Product}


def data(rank, dtype, shape=(3, 4)):
    rng = np.random.default_rng(500 + rank)
    return rng.integers(1, 4, size=shape).astype(dtype.as_numpy_dtype)


def reference(arrays, op):
    s = np.stack([a.astype(np.float64) for a in arrays])
    return {"Sum": s.sum(0), "Average": s.mean(0), "Min": s.min(0), "Max": s.max(0),
            "Product": s.prod(0)}[op]


def main():
    hvd.init()
    n, me = hvd.size(), hvd.rank()
    failures = []

    def check(name, ok):
        if not ok:
            failures.append(name)

    def close(got, want, integer=False):
        got = np.asarray(got, dtype=np.float64)
        want = np.trunc(want) if integer else want  # Horovod's integer averages truncate
        return got.shape == np.shape(want) and np.allclose(got, want, rtol=1e-3)

    for mode in ("eager", "graph"):
        wrap = (lambda f: f) if mode == "eager" else tf.function
        for dtype in DTYPES:
            inputs = [data(r, dtype) for r in range(n)]
            for op_name, op in OPS.items():
                f = wrap(lambda x, op=op: hvd.allreduce(x, op=op))
                got = f(tf.constant(inputs[me]))
                check(f"{mode} allreduce {dtype.name} {op_name}",
                      got.dtype == dtype and close(got, reference(inputs, op_name),
                                                   dtype.is_integer and op_name == "Average"))
            grouped = wrap(lambda a, b: hvd.grouped_allreduce([a, b], op=hvd.Sum))(
                tf.constant(inputs[me]), tf.constant(inputs[me][:1]))
            check(f"{mode} grouped {dtype.name}",
                  close(grouped[0], reference(inputs, "Sum"))
                  and close(grouped[1], reference(inputs, "Sum")[:1]))
            parts = [data(r, dtype, (r + 1, 2)) for r in range(n)]
            got = wrap(hvd.allgather)(tf.constant(parts[me]))
            check(f"{mode} allgather {dtype.name}",
                  np.array_equal(got.numpy(), np.concatenate(parts)))
            for root in range(n):
                got = wrap(lambda x, root=root: hvd.broadcast(x, root))(tf.constant(inputs[me]))
                check(f"{mode} broadcast {root} {dtype.name}",
                      np.array_equal(got.numpy(), inputs[root]))
            rows = [data(r, dtype, (2 * n + 1, 2)) for r in range(n)]
            got = wrap(lambda x: hvd.reducescatter(x, op=hvd.Sum))(tf.constant(rows[me]))
            start = sum(even_splits(2 * n + 1, n)[:me])
            want = reference(rows, "Sum")[start:start + even_splits(2 * n + 1, n)[me]]
            check(f"{mode} reducescatter {dtype.name}", close(got, want))
        splits = [(me + j) % 3 for j in range(n)]
        send = np.concatenate([np.full((s, 2), [me, j])
                               for j, s in enumerate(splits)]).astype(np.int32)
        got, rsplits = wrap(lambda x, splits=splits: hvd.alltoall(x, splits=splits))(
            tf.constant(send.reshape(-1, 2)))
        want = np.concatenate([np.full(((r + me) % 3, 2), [r, me])
                               for r in range(n)]).reshape(-1, 2)
        check(f"{mode} alltoall", np.array_equal(got.numpy(), want)
              and rsplits.numpy().tolist() == [(r + me) % 3 for r in range(n)])
        got = wrap(lambda x: hvd.allreduce(x, compression=hvd.Compression.fp16))(
            tf.constant([1.5, 2.25], dtype=tf.float32))
        check(f"{mode} fp16 compression", got.dtype == tf.float32 and close(got, [1.5, 2.25]))
        check(f"{mode} size_op", int(wrap(hvd.size_op)()) == n)
        check(f"{mode} rank_op", int(wrap(hvd.rank_op)()) == me)

    # Fusion: several tensors, split over buffers by a tiny threshold, padded for alignment
    os.environ["HOROVOD_FUSION_THRESHOLD"] = "64"
    parts = [tf.constant(np.arange(k + 1, dtype=np.float32) * (me + 1)) for k in range(7)]
    got = hvd.grouped_allreduce(parts, op=hvd.Sum)
    os.environ.pop("HOROVOD_FUSION_THRESHOLD")
    factor = n * (n + 1) / 2
    check("fusion buffers", all(np.allclose(g.numpy(), np.arange(k + 1) * factor)
                                for k, g in enumerate(got)))
    from elastic_hvd import basics
    check("local and cross ranks (one host)",
          (basics.local_rank(), basics.local_size(), basics.cross_rank(), basics.cross_size())
          == (me, n, 0, 1))
    # IndexedSlices: gathered, and averaged over the live size
    slices = tf.IndexedSlices(tf.constant([[float(me + 1)] * 2]), tf.constant([me]),
                              dense_shape=tf.constant([n, 2]))
    got = hvd.allreduce(slices, op=hvd.Average)
    check("indexed slices", isinstance(got, tf.IndexedSlices)
          and got.indices.numpy().tolist() == list(range(n))
          and np.allclose(got.values.numpy()[:, 0], [(r + 1) / n for r in range(n)]))
    # integer slices are averaged as Horovod does, by `values / size`: floats, not truncated
    for dtype, want in ((tf.uint8, tf.float32), (tf.int32, tf.float64)):
        ints = tf.IndexedSlices(tf.constant([[me + 1, 1]], dtype=dtype), tf.constant([me]))
        got = hvd.allreduce(ints, op=hvd.Average)
        check(f"indexed slices {dtype.name} average", got.values.dtype == want
              and np.allclose(got.values.numpy(), [[(r + 1) / n, 1 / n] for r in range(n)]))
    # gradients flow through the collectives as in Horovod (averaged over the ranks)
    v = tf.Variable(float(me + 1))
    with tf.GradientTape() as tape:
        y = tf.reduce_sum(hvd.allgather(tf.reshape(v * 2.0, [1])))
    check("allgather gradient", float(tape.gradient(y, v)) == 2.0)
    with tf.GradientTape() as tape:
        y = hvd.broadcast(v * 3.0, 0)
    check("broadcast gradient", float(tape.gradient(y, v)) == (3.0 if me == 0 else 0.0))
    check("broadcast_object", hvd.broadcast_object({"r": me}, 0) == {"r": 0})
    check("allgather_object", hvd.allgather_object(me) == list(range(n)))
    variables = [tf.Variable(np.full(3, me, np.float32)), tf.Variable(np.int64(me))]
    hvd.broadcast_variables(variables, root_rank=n - 1)
    check("broadcast_variables", variables[0].numpy().tolist() == [n - 1] * 3
          and int(variables[1].numpy()) == n - 1)
    report.write(me, failures=failures)


if __name__ == "__main__":
    main()
