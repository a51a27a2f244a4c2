"""What elastic_hvd's TF ops return and raise where Horovod's users can tell (issue
13), reported for tests/test_horovod_parity.py, which holds it against Horovod 0.28.1.

    python tf_parity.py one_rank                          # a plain process: one rank
    elastic-hvd-run -np 2 python tf_parity.py two_ranks
"""

import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

import report  # noqa: E402
import elastic_hvd.tensorflow as hvd  # noqa: E402

#: Classes whose ``except`` catches an error, by the name a test asks for.
CATCHERS = {"tf.FailedPreconditionError": tf.errors.FailedPreconditionError,
            "tf.InvalidArgumentError": tf.errors.InvalidArgumentError,
            "hvd.MismatchError": hvd.MismatchError,
            "hvd.RemoteCollectiveError": hvd.RemoteCollectiveError,
            "ValueError": ValueError, "NotImplementedError": NotImplementedError}

MODES = ("eager", "function", "tf1")

#: (prescale_factor, postscale_factor) pairs; 0.1 and 0.3 are not float32 numbers.
FACTORS = [(0.5, 1.0), (1.0, 0.3), (0.1, 3.0)]


def listed(x):
    return None if x is None else np.asarray(x).tolist()


def raised(fn):
    """The names in CATCHERS that catch what ``fn()`` raises (None: it did not)."""
    try:
        fn()
    except Exception as exc:  # what is raised is the observation
        return sorted(name for name, cls in CATCHERS.items() if isinstance(exc, cls))
    return None


def modes(build):
    """``build()`` run eagerly, in a tf.function and in a TF1 graph session."""
    def tf1():
        with tf.Graph().as_default():
            out = build()
            with tf.compat.v1.Session() as session:
                return session.run(out)
    return {"eager": build, "function": tf.function(build), "tf1": tf1}


def gradient(loss, x):
    """d loss(x) / dx: a tape when eager, ``tf.gradients`` in a graph (TF1 code's way)."""
    if tf.executing_eagerly():
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = loss(x)
        return tape.gradient(y, x)
    return tf.gradients(loss(x), x)[0]


def scaled(inputs_by_dtype, collective="allreduce"):
    """Records of a collective with scale factors, dtype by dtype."""
    records = []
    for dtype, x in inputs_by_dtype.items():
        for op in ("Sum", "Average"):
            for pre, post in FACTORS:
                got = getattr(hvd, collective)(tf.constant(x, dtype), op=getattr(hvd, op),
                                               prescale_factor=pre, postscale_factor=post)
                records.append({"collective": collective, "dtype": dtype, "op": op, "pre": pre,
                                "post": post, "input": listed(x), "output": listed(got)})
    return records


def one_rank():
    r = hvd.rank()
    ints = [-7, -5, -3, -1, 0, 1, 4, 9]
    halves = np.linspace(-4, 4, 257).astype(np.float16)  # dense: double rounding shows
    inputs = {"int8": ints, "uint8": [0, 1, 3, 5, 7, 9, 50, 80], "int32": ints, "int64": ints,
              "float16": halves, "float32": halves.astype(np.float32) / 3,
              "float64": halves.astype(np.float64) / 3}
    reducescatter_inputs = {d: np.reshape(inputs[d], (-1, 1))
                            for d in ("int32", "int64", "float16", "float64")}
    obs = {"scaled": scaled(inputs) + scaled(reducescatter_inputs, "reducescatter")}

    # IndexedSlices without dense_shape, alone and among dense tensors.
    slices = tf.IndexedSlices(tf.constant([[1.0, 2.0], [3.0, 4.0]]), tf.constant([3, 0]))
    obs["slices"] = {}
    for op in ("Sum", "Average"):
        out, dense = hvd.grouped_allreduce([slices, tf.constant([1.0, 2.0])], op=getattr(hvd, op))
        obs["slices"][op] = {"values": listed(out.values), "indices": listed(out.indices),
                             "dense_shape": listed(out.dense_shape), "dense": listed(dense)}
    out = hvd.allreduce(slices, op=hvd.Sum)
    obs["slices"]["allreduce"] = {"values": listed(out.values), "indices": listed(out.indices),
                                  "dense_shape": listed(out.dense_shape)}
    obs["slices errors"] = {
        "allreduce prescale": raised(lambda: hvd.allreduce(slices, prescale_factor=2.0)),
        "allreduce postscale": raised(lambda: hvd.allreduce(slices, postscale_factor=2.0)),
        "grouped prescale": raised(lambda: hvd.grouped_allreduce([slices], prescale_factor=2.0)),
        "grouped postscale": raised(
            lambda: hvd.grouped_allreduce([slices], postscale_factor=2.0)),
        "grouped Max": raised(lambda: hvd.grouped_allreduce([slices], op=hvd.Max))}

    # alltoall with splits given as an int32 tensor.
    obs["alltoall"] = {}
    for dtype in (tf.uint8, tf.float32):
        def exchange(dtype=dtype):
            return hvd.alltoall(tf.constant([1, 2, 3], dtype), splits=tf.constant([3], tf.int32))
        for mode, run in modes(exchange).items():
            received, splits = run()
            obs["alltoall"][f"{dtype.name} {mode}"] = [listed(received), listed(splits)]
    # ... and without splits: the tensor alone (Horovod 0.28.1's return value).
    for mode, run in modes(lambda: hvd.alltoall(tf.constant([1, 2, 3]))).items():
        got = run()
        obs["alltoall"][f"no splits {mode}"] = "pair" if isinstance(got, (tuple, list)) \
            else listed(got)

    # reducescatter: scale factors on a group, gradients in every mode.
    a, b = tf.constant([[1.0, 2.0], [3.0, 4.0]]), tf.constant([[5.0], [7.0]])
    obs["grouped reducescatter"] = {
        f"{op} {pre} {post}": [listed(t) for t in hvd.grouped_reducescatter(
            [a, b], op=getattr(hvd, op), prescale_factor=pre, postscale_factor=post)]
        for op in ("Sum", "Average") for pre, post in FACTORS}
    obs["reducescatter gradients"] = reducescatter_gradients(r)

    # A tf_keras legacy optimizer's minimize() (its own _compute_gradients, whose
    # Horovod namesake the wrapper does not provide): one SGD step of d(2w)/dw = 2.
    import tf_keras
    weight = tf.Variable(1.0)
    optimizer = hvd.DistributedOptimizer(tf_keras.optimizers.legacy.SGD(0.25))
    optimizer.minimize(lambda: 2.0 * weight, [weight])
    obs["legacy minimize"] = float(weight.numpy())

    # PartialDistributedGradientTape.get_local_and_global_gradients: d(3a + 5b), a local.
    a, b = tf.Variable(1.0), tf.Variable(2.0)
    with tf.GradientTape() as plain:
        loss = 3.0 * a + 5.0 * b
    tape = hvd.PartialDistributedGradientTape(plain)
    tape.register_local_source(a)
    obs["local and global"] = [[[float(s.numpy()), float(g.numpy())] for s, g in part]
                               for part in tape.get_local_and_global_gradients(loss, [a, b])]
    report.write(r, **obs)


def reducescatter_gradients(r):
    """d(sum of the outputs times (rank + 1)) / d(input) for reducescatter and a group
    of two, for each op and factors, in every mode; inputs of ones, 4 x 1."""
    grads = {}
    for op in ("Sum", "Average"):
        for pre, post in [(1.0, 1.0), (0.5, 3.0)]:
            kwargs = {"op": getattr(hvd, op), "prescale_factor": pre, "postscale_factor": post}

            def single(kwargs=kwargs):
                return gradient(lambda x: tf.reduce_sum(hvd.reducescatter(x, **kwargs))
                                * (r + 1), tf.ones([4, 1]))

            def grouped(kwargs=kwargs):
                return gradient(lambda x: tf.add_n([tf.reduce_sum(y) for y in
                                                    hvd.grouped_reducescatter([x, 2 * x],
                                                                              **kwargs)])
                                * (r + 1), tf.ones([4, 1]))
            for name, build in (("single", single), ("grouped", grouped)):
                for mode, run in modes(build).items():
                    grads[f"{name} {op} {pre} {post} {mode}"] = listed(run())
    return grads


def same_size_other_shape(r):
    """What each collective raises when rank 0's input has rank 1's number of elements
    in another shape (or other trailing dimensions, where the first may differ): Horovod's
    coordinator compares full shapes and fails them all (FailedPreconditionError); and
    the message of the eager allreduce's error."""
    def shaped(*shapes):
        return tf.ones(shapes[r])

    def variables():
        return [tf.Variable(tf.ones([2, 2])), tf.Variable(shaped([4, 6], [6, 4]))]
    cases = {
        "allreduce": lambda: hvd.allreduce(shaped([4, 6], [6, 4])),
        "allreduce 3-d": lambda: hvd.allreduce(shaped([17, 1311], [17, 23, 57])),
        "grouped_allreduce": lambda: hvd.grouped_allreduce([tf.ones([3]),
                                                            shaped([4, 6], [6, 4])]),
        "broadcast": lambda: hvd.broadcast(shaped([4, 6], [6, 4]), 0),
        "allgather": lambda: hvd.allgather(shaped([2, 6], [2, 3, 2])),
        "reducescatter": lambda: hvd.reducescatter(shaped([4, 6], [6, 4])),
        "alltoall": lambda: hvd.alltoall(shaped([2, 6], [2, 3, 2])),
    }
    got = {f"{name} {mode}": raised(run) for name, build in cases.items()
           for mode, run in modes(build).items()}
    held = variables()  # tf.function cannot create variables on every call

    @tf.function
    def broadcast_held():
        hvd.broadcast_variables(held, 0)
    got["broadcast_variables eager"] = raised(lambda: hvd.broadcast_variables(variables(), 0))
    got["broadcast_variables function"] = raised(broadcast_held)
    try:
        hvd.allreduce(shaped([4, 6], [6, 4]))
        message = None
    except hvd.MismatchError as exc:
        message = str(exc)
    return got, message


def other_dtype(r):
    """What each collective raises when rank 0 passes bfloat16 where rank 1 passes
    float32 (Horovod's coordinator compares dtypes: FailedPreconditionError on every
    rank), each call after three float32 ones, so that rank 1's call is the one its
    signature predictor expects (the cheap path); and the eager allreduce's message.
    bfloat16 is reduced in float32: its signature must still name bfloat16.  So must
    int16 slices averaged (float32 values, Horovod's ``values / size``) against float32
    ones."""
    def gradients(dtype):  # a DistributedGradientTape: the step's fused reduction
        x = tf.ones([3], dtype)
        with tf.GradientTape() as plain:
            plain.watch(x)
            loss = tf.reduce_sum(x * x)
        return hvd.DistributedGradientTape(plain).gradient(loss, x)

    def slices(dtype):
        return hvd.allreduce(tf.IndexedSlices(tf.ones([1, 2], dtype), tf.constant([0])),
                             op=hvd.Average).values
    bfloat16 = [tf.bfloat16, tf.float32][r]
    cast = {"allreduce": lambda dtype: hvd.allreduce(tf.ones([4], dtype)),
            "grouped_allreduce": lambda dtype: hvd.grouped_allreduce([tf.ones([3]),
                                                                      tf.ones([4], dtype)]),
            "gradients": gradients, "slices int16 Average": slices}
    moved = {"broadcast": lambda dtype: hvd.broadcast(tf.ones([4], dtype), 0),
             "allgather": lambda dtype: hvd.allgather(tf.ones([2, 2], dtype)),
             "reducescatter": lambda dtype: hvd.reducescatter(tf.ones([4], dtype)),
             "alltoall": lambda dtype: hvd.alltoall(tf.ones([2, 2], dtype))}
    got = {}
    for name, build in list(cast.items()) + list(moved.items()):
        mine = [tf.int16, tf.float32][r] if name.startswith("slices") else bfloat16
        for mode in MODES if name in cast else ("eager",):
            for _ in range(3):
                modes(lambda build=build: build(tf.float32))[mode]()
            got[f"{name} {mode}"] = raised(modes(lambda build=build, mine=mine: build(mine))[mode])
    try:
        hvd.allreduce(tf.ones([4], bfloat16))
        message = None
    except hvd.MismatchError as exc:
        message = str(exc)
    return got, message


def broadcast_inplace(r):
    """Horovod's test_horovod_broadcast_inplace_[multiple_]cpu: ``hvd.broadcast_`` of
    variables holding the rank, from root 1, eagerly, in a tf.function and in a TF1
    session (resource and reference variables): per mode, the distinct values of
    what it returned, then of the variables."""
    shapes = ([3], [3, 3], [3, 3, 3])

    def distinct(values):
        return [np.unique(v).tolist() for v in values]
    held = [tf.Variable(tf.ones(s) * r) for s in shapes]
    eager = [tf.Variable(tf.ones(s) * r) for s in shapes]
    got = {"eager": distinct(hvd.broadcast_(eager, 1)) + distinct(eager),
           "function": distinct(tf.function(lambda: hvd.broadcast_(held, 1))())
           + distinct(held)}
    for resource in (True, False):
        with tf.Graph().as_default():
            graph = [tf.compat.v1.Variable(tf.ones(s) * r, use_resource=resource)
                     for s in shapes]
            returned = hvd.broadcast_(graph, 1)
            with tf.compat.v1.Session() as session:
                session.run(tf.compat.v1.global_variables_initializer())
                values = session.run(returned)
                got[f"tf1 resource={resource}"] = distinct(values) + distinct(
                    session.run(graph))
    return got


def two_ranks():
    r = hvd.rank()
    obs = {"rank": r}

    def shape_mismatch():
        return hvd.allreduce(tf.ones([2 + r]))

    def uneven_alltoall():  # rank 0's 2 rows divide by 2 ranks, rank 1's 3 do not
        return hvd.alltoall(tf.ones([2 + r]))

    def in_session(build):
        return modes(build)["tf1"]

    obs["errors"] = {
        "shape eager": raised(shape_mismatch),
        "dtype eager": raised(lambda: hvd.allreduce(tf.ones([2], [tf.float32, tf.float64][r]))),
        "root eager": raised(lambda: hvd.broadcast(tf.ones([2]), root_rank=r)),
        "root broadcast_object": raised(lambda: hvd.broadcast_object(r, root_rank=r)),
        "shape function": raised(tf.function(shape_mismatch)),
        "shape tf1": raised(in_session(shape_mismatch)),
        "alltoall eager": raised(uneven_alltoall),
        "alltoall function": raised(tf.function(uneven_alltoall)),
        "alltoall tf1": raised(in_session(uneven_alltoall))}
    obs["same size, other shape"], obs["mismatch message"] = same_size_other_shape(r)
    obs["other dtype"], obs["dtype message"] = other_dtype(r)
    obs["broadcast_"] = broadcast_inplace(r)
    obs["after errors"] = listed(hvd.allreduce(tf.ones([2]), op=hvd.Sum))

    ints = [[-3, 3, -1, 5], [-4, 2, -2, -9]][r]
    halves = (np.linspace(-4, 4, 129) * (1 + r)).astype(np.float16)
    obs["scaled"] = scaled({"int32": ints, "int64": ints, "float16": halves,
                            "float64": halves.astype(np.float64) / 3})

    # Gradients: every rank's output gradient is rank + 1.
    def gathered():
        return gradient(lambda x: tf.reduce_sum(hvd.allgather(x)) * (r + 1),
                        tf.constant([[r + 1.0]]))

    def broadcast():
        return gradient(lambda x: tf.reduce_sum(hvd.broadcast(x, 0)) * (r + 1),
                        tf.constant([r + 1.0]))
    obs["gradients"] = {f"{name} {mode}": listed(run())
                        for name, build in (("allgather", gathered), ("broadcast", broadcast))
                        for mode, run in modes(build).items()}
    obs["reducescatter gradients"] = reducescatter_gradients(r)

    # reducescatter of a group with scale factors; 3 rows: rank 0 gets two.
    a = np.arange(6, dtype=np.float32).reshape(3, 2) + 10 * r
    b = np.array([[1.0], [2.0], [3.0]], np.float32) * (r + 1)
    obs["grouped reducescatter"] = {
        "inputs": [listed(a), listed(b)],
        **{f"{op} {pre} {post}": [listed(t) for t in hvd.grouped_reducescatter(
            [tf.constant(a), tf.constant(b)], op=getattr(hvd, op), prescale_factor=pre,
            postscale_factor=post)] for op in ("Sum", "Average") for pre, post in FACTORS}}

    slices = tf.IndexedSlices(tf.constant([[r + 1.0, 2.0]]), tf.constant([r]))
    out, dense = hvd.grouped_allreduce([slices, tf.constant([r + 1.0])], op=hvd.Average)
    obs["slices"] = {"values": listed(out.values), "indices": listed(out.indices),
                     "dense": listed(dense)}
    report.write(r, **obs)


if __name__ == "__main__":
    hvd.init()
    globals()[sys.argv[1]]()
