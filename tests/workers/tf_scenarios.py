"""Multi-rank TensorFlow/Keras scenarios; each rank reports JSON (see report.py).

    python tf_scenarios.py <scenario> [args...]
"""

import hashlib
import json
import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

import report  # noqa: E402

if os.environ.get("TEST_AS_HOROVOD"):
    import horovod.tensorflow.keras as hvd  # noqa: E402  (resolved by --as-horovod)
else:
    import elastic_hvd.tensorflow.keras as hvd  # noqa: E402
import elastic_hvd.tensorflow as hvd_tf  # noqa: E402
from elastic_hvd.core import faults, runtime  # noqa: E402

keras = tf.keras


def digest(arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def small_model(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(3)])
    return model


def fit_equivalence(global_batch="32", steps="6", passes="1"):
    """Train on this rank's share of each global batch; report the final weights.

    With ``passes`` > 1 each update accumulates that many local micro-batches
    (backward_passes_per_step, averaged), so the update still covers the global batch.
    """
    global_batch, steps, passes = int(global_batch), int(steps), int(passes)
    n, r = hvd.size(), hvd.rank()
    rng = np.random.default_rng(7)
    x = rng.normal(size=(global_batch * steps, 8)).astype(np.float32)
    y = rng.normal(size=(global_batch * steps, 3)).astype(np.float32)
    local = global_batch // (n * passes)
    # Global batch b is rows [b*G, (b+1)*G); pass p of rank r takes chunk p*n + r of it.
    idx = np.concatenate([np.arange(b * global_batch + (p * n + r) * local,
                                    b * global_batch + (p * n + r + 1) * local)
                          for b in range(steps) for p in range(passes)])
    model = small_model()
    model.compile(optimizer=hvd.DistributedOptimizer(
        keras.optimizers.SGD(0.1), backward_passes_per_step=passes,
        average_aggregated_gradients=True), loss="mse")
    model.fit(x[idx], y[idx], batch_size=local, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    weights = model.get_weights()
    np.savez(os.path.join(os.environ["TEST_OUT_DIR"], f"weights{hvd.rank()}_of{n}x{passes}.npz"),
             *weights)
    report.write(runtime.current().original_id, digest=digest(weights),
                 optimizer_class=type(model.optimizer).__name__,
                 optimizer_config_class=model.optimizer.get_config().get("name"))


class StepDeltas(keras.callbacks.Callback):
    """Records the kernel after every step and reports steps to the fault plan."""

    def __init__(self):
        super().__init__()
        self.kernels, self.sizes = [], []

    def on_train_batch_begin(self, batch, logs=None):
        faults.at_step(batch + 1)

    def on_train_batch_end(self, batch, logs=None):
        self.kernels.append(self.model.layers[0].kernel.numpy().copy())
        self.sizes.append(hvd.size())


def second_fit_same_broadcast():
    """Two ``fit()`` calls with one BroadcastGlobalVariablesCallback; between them
    rank 1's weights drift (as a bug would make them).  Report each rank's weights
    after the second fit: a callback that broadcast again would hide the drift."""
    hvd.init()
    rng = np.random.default_rng(hvd.rank())
    x = rng.normal(size=(64, 8)).astype(np.float32)
    y = rng.normal(size=(64, 3)).astype(np.float32)
    model = small_model(seed=hvd.rank())  # different starts: the first broadcast unifies
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    broadcast = hvd.callbacks.BroadcastGlobalVariablesCallback(0)
    model.fit(x, y, batch_size=16, epochs=1, callbacks=[broadcast], verbose=0)
    first = digest(model.get_weights())
    if hvd.rank() == 1:
        kernel = model.layers[0].kernel
        kernel.assign(kernel + 1.0)
    model.fit(x, y, batch_size=16, epochs=1, callbacks=[broadcast], verbose=0)
    report.write(hvd.rank(), first=first, second=digest(model.get_weights()))


def fit_gradient_scale(steps="12"):
    """Loss = mean(x @ w) with x = c_r on rank r: each step moves w by -lr * mean(c_live)."""
    steps = int(steps)
    me = runtime.current().original_id
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False,
                                                                    kernel_initializer="zeros")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(1.0)),
                  loss=lambda y_true, y_pred: tf.reduce_mean(y_pred))
    x = np.full((steps * 4, 1), float(1 << me), dtype=np.float32)  # c_r = 2**r: sums identify ranks
    recorder = StepDeltas()
    model.fit(x, np.zeros_like(x), batch_size=4, epochs=1, shuffle=False, verbose=0,
              callbacks=[recorder])
    kernels = [float(k.ravel()[0]) for k in recorder.kernels]
    deltas = [b - a for a, b in zip([0.0] + kernels[:-1], kernels)]
    report.write(me, deltas=deltas, sizes=recorder.sizes, ids=list(runtime.current().ids),
                 digest=digest(model.get_weights()))


def tape_loop(steps="5"):
    """A custom loop with DistributedGradientTape inside tf.function."""
    model = small_model()
    opt = keras.optimizers.SGD(0.1)
    rng = np.random.default_rng(hvd.rank())
    x = tf.constant(rng.normal(size=(16, 8)).astype(np.float32))
    y = tf.constant(rng.normal(size=(16, 3)).astype(np.float32))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        tape = hvd_tf.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    hvd_tf.broadcast_variables(model.variables, 0)
    for _ in range(int(steps)):
        step()
    report.write(runtime.current().original_id, digest=digest(model.get_weights()))


def gradients_after_a_loss():
    """Forward: an allgather (rank r gives r + 1 rows) and a broadcast from rank 2.
    Then original rank 1 SIGKILLs itself, so the backward pass's allreduces repair
    and run on three ranks: each survivor reports the gradients it got."""
    comm = runtime.current()
    me = comm.original_id
    x = tf.Variable(np.full((me + 1, 2), float(me), dtype=np.float32))
    v = tf.Variable(np.full(3, float(me), dtype=np.float32))
    w_gather = tf.constant(np.arange(20, dtype=np.float32).reshape(10, 2))  # 1+2+3+4 rows
    w_bcast = tf.constant([1.0, 2.0, 3.0])
    with tf.GradientTape() as tape:
        loss = (tf.reduce_sum(w_gather * hvd_tf.allgather(x))
                + tf.reduce_sum(w_bcast * hvd_tf.broadcast(v, root_rank=2)))
    if me == 1:
        os.kill(os.getpid(), 9)
    grad_x, grad_v = tape.gradient(loss, [x, v])
    report.write(me, grad_x=grad_x.numpy().tolist(), grad_v=grad_v.numpy().tolist(),
                 ids=list(comm.ids), loss=float(loss))


def training_state(phase, directory):
    """One training state, three uses.  Phase "save": train, rescale the rate as a
    membership change would, checkpoint mid-epoch, and check hvd.elastic's commit /
    restore / sync in place; phase "restart" (a new job): restore the checkpoint."""
    import keras_callbacks as kc
    from elastic_hvd import state_format
    from elastic_hvd.sharding import ElasticSampler
    from elastic_hvd.tensorflow import layer
    from elastic_hvd.tensorflow.training_state import TrainingState

    comm, session = runtime.current(), runtime.session()
    model = small_model(seed=1 if phase == "restart" else 0)
    lr = 0.05 * comm.size  # the linear scaling rule
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9)),
                  loss="mse")
    sampler = ElasticSampler(comm, 40, 4, seed=3)
    checkpoint = kc.ElasticCheckpoint(directory, sampler=sampler)
    result = {}
    if phase == "restart":
        result["epoch"] = checkpoint.restore(model)
        sampler.start_epoch()
        result["queue"] = list(sampler.queue)
    else:
        rng = np.random.default_rng(comm.rank)
        x = rng.normal(size=(8, 8)).astype(np.float32)
        y = rng.normal(size=(8, 3)).astype(np.float32)
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # two committed steps, slots exist
        sampler.start_epoch(1)
        sampler.next_batch()
        session.commits.notify(comm.ids)  # as the step transaction does
        elastic = hvd.elastic.KerasState(model, epoch=1, batch=2)
        elastic.commit()
        committed = digest(model.get_weights())
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
        # A membership change halves the rate (as LearningRateRescaler does).
        layer.session_state().lr_factor *= 0.5
        model.optimizer.learning_rate.assign(lr * 0.5)
        elastic.batch = 99
        elastic.restore()  # back to the commit, keeping the rescaling made since
        result["rollback"] = {"digest_ok": digest(model.get_weights()) == committed,
                              "lr": float(model.optimizer.learning_rate.numpy()),
                              "batch": elastic.batch}
        if comm.rank == 1:  # diverge; sync makes rank 0's state everyone's
            for v in model.trainable_variables:
                v.assign(v + 1.0)
            elastic.batch = 7
        elastic.sync()
        result["after_sync"] = {"digest": digest(model.get_weights()), "batch": elastic.batch}
        live = TrainingState(model, sampler=sampler).state(1)
        checkpoint.set_model(model)
        checkpoint.save(1)
        comm.barrier()
        saved = state_format.load(os.path.join(directory, checkpoint.files.entries()[0]["state"]))
        result["same_as_live"] = {
            "keys": sorted(saved) == sorted(live),
            "arrays": all(np.array_equal(a, b) for part in ("model", "optimizer")
                          for a, b in zip(saved[part], live[part])),
            "rest": all(saved[k] == live[k] for k in ("epoch", "lr", "momentum", "sampler",
                                                      "session"))}
        result["queue"] = saved["sampler"]["queue"]
    result.update(digest=digest(model.get_weights()),
                  optimizer=digest(v.numpy() for v in model.optimizer.variables  # not the rate
                                   if "learning_rate" not in v.name),
                  lr=float(model.optimizer.learning_rate.numpy()), step=session.step,
                  lr_factor=layer.session_state().lr_factor)
    report.write(comm.original_id, **result)


def graph_order(mode, reps="50", chain="1"):
    """Independent allgathers, allreduces and broadcasts of different shapes fetched
    together, ``reps`` times, in a TF1 session (``mode`` "tf1") or a tf.function;
    ``chain`` "0" switches off the ordering of TF1 graphs' collectives."""
    from elastic_hvd.tensorflow import layer
    layer.state().order_graph_collectives = chain == "1"
    n, r = hvd.size(), hvd.rank()

    def build():
        outs = []
        for k in range(3):
            outs.append(hvd_tf.allgather(tf.fill([r + 1, k + 1], float(r + 10 * k))))
            # Fed from a random op of its own too, as Horovod's "fused" tests are: still
            # chained (issue 19); it adds nothing to the value.
            noise = 0.0 * tf.random.uniform([k + 2], seed=k)
            outs.append(hvd_tf.allreduce(tf.fill([k + 2], float(r + k)) + noise, op=hvd_tf.Sum))
            outs.append(hvd_tf.broadcast(tf.fill([2, k + 3], float(r + 100 * k)), 0))
        return outs

    expected = []
    for k in range(3):
        expected.append(np.concatenate([np.full((q + 1, k + 1), float(q + 10 * k))
                                        for q in range(n)]))
        expected.append(np.full([k + 2], float(sum(q + k for q in range(n)))))
        expected.append(np.full([2, k + 3], float(100 * k)))
    failures = []

    def check(i, values):
        for j, (got, want) in enumerate(zip(values, expected)):
            if np.shape(got) != want.shape or not np.allclose(got, want):
                failures.append(f"run {i}: output {j} is {np.asarray(got).tolist()}")

    def attempt(i, fn):
        try:
            check(i, fn())
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            failures.append(f"run {i}: {type(exc).__name__}: {str(exc)[:300]}")

    reps = int(reps)
    if mode == "tf1":
        with tf.Graph().as_default():
            fetches = build()
            # Built later: one fed from a placeholder, then one that needs no feed.
            fed = tf.compat.v1.placeholder(tf.float32, [3])
            total = hvd_tf.allreduce(fed, op=hvd_tf.Sum)
            free = hvd_tf.allgather(tf.fill([1, 2], float(r)))
            with tf.compat.v1.Session() as session:
                for i in range(reps):
                    attempt(i, lambda: session.run(fetches))
                    if failures:
                        break
                # The free one is not chained after the fed one: it runs without a feed.
                try:
                    alone = session.run(free).tolist()
                    summed = session.run(total, {fed: np.full(3, r + 1.0)}).tolist()
                except Exception as exc:  # noqa: BLE001 - reported, not raised
                    alone = summed = f"{type(exc).__name__}: {str(exc)[:300]}"
        report.write(runtime.current().original_id, failures=failures, alone=alone,
                     summed=summed)
        return
    else:
        step = tf.function(build)
        for i in range(reps):
            attempt(i, lambda: [t.numpy() for t in step()])
            if failures:
                break
        # The graph TF runs: every collective after the one created before it.
        graph = step.get_concrete_function().graph
        pyfuncs = [op for op in graph.get_operations() if op.type == "PyFunc"]
        chained = all(_reaches(b, a) for a, b in zip(pyfuncs, pyfuncs[1:]))
        report.write(runtime.current().original_id, failures=failures, chained=chained,
                     collectives=len(pyfuncs))


def tf1_runs(directory, steps="4", broadcasts="5"):
    """The collectives that TF1 session runs execute, counted by name in the timeline
    (one event per collective run): ``steps`` runs of a training op built after a
    broadcast_global_variables, then ``broadcasts`` hvd.broadcast_ of a new variable,
    each built and fetched by itself (Horovod's test_horovod_broadcast_inplace_cpu);
    and the values they gave."""
    r, steps, broadcasts = hvd_tf.rank(), int(steps), int(broadcasts)
    path = os.path.join(directory, "timeline{rank}.json")

    def counted(fn):
        hvd_tf.start_timeline(path)
        result = fn()
        hvd_tf.stop_timeline()
        with open(path.format(rank=r)) as f:
            names = [event["name"] for event in json.load(f)]
        return {name: names.count(name) for name in sorted(set(names))}, result

    with tf.Graph().as_default():
        w = tf.compat.v1.Variable(tf.fill([4, 1], float(r)))
        bcast = hvd_tf.broadcast_global_variables(0)
        x = tf.constant([[1.0, 2.0, 3.0, 4.0]]) * (r + 1)
        optimizer = hvd_tf.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
        train = optimizer.minimize(tf.reduce_sum(tf.matmul(x, w)))
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            session.run(bcast)
            trained, _ = counted(lambda: [session.run(train) for _ in range(steps)])
            weights = session.run(w).ravel().tolist()

            def fetch_each():
                values = []
                for k in range(broadcasts):
                    v = tf.compat.v1.Variable(tf.fill([3], float(r + k)))
                    session.run(v.initializer)
                    values.append(session.run(hvd_tf.broadcast_([v], 1))[0].tolist())
                return values
            broadcast, values = counted(fetch_each)

            # Two broadcasts into variables of one shape, built together and fetched
            # together: the second follows the first (unordered, a rank could take the
            # root's values of one for the other).
            pair = [tf.compat.v1.Variable(tf.fill([3], float(r + 10 * k))) for k in range(2)]
            syncs = [hvd_tf.broadcast_variables([v], 1) for v in pair]
            first, second = [op for op in tf.compat.v1.get_default_graph().get_operations()
                             if op.type == "PyFunc"][-2:]
            session.run([v.initializer for v in pair])
            session.run(syncs)
            together = {"chained": _reaches(second, first),
                        "values": [v.tolist() for v in session.run(pair)]}
    report.write(r, trained=trained, weights=weights, broadcast=broadcast, values=values,
                 together=together)


def anomaly_in_fit(directory):
    """During hvd.fit, the agreement on one gradient allreduce answers every rank with
    the previous agreement's value: the anomaly must reach the event log, the step be
    redone, and the ranks end with equal weights."""
    comm = runtime.current()
    real, seen, forced = comm._agreement, [], []

    def agreement(mpi_comm, value, timeout):
        seen.append(real(mpi_comm, value, timeout))
        if comm.label == "HorovodGradients" and len(seen) > 20 and not forced:
            forced.append(seen[-2])
            return seen[-2]
        return seen[-1]

    comm._agreement = agreement
    rng = np.random.default_rng(3)
    x = rng.normal(size=(256, 8)).astype(np.float32)
    y = rng.normal(size=(256, 3)).astype(np.float32)
    model = small_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    events = os.path.join(directory, "events.jsonl")
    hvd.fit(model, hvd.ElasticData((x, y), batch_size=16, seed=1), epochs=2, events=events,
            verbose=0)
    with open(events) as f:
        records = [json.loads(line) for line in f]
    report.write(comm.original_id, forced=len(forced), anomalies=len(comm.anomalies),
                 logged=[r for r in records if r.get("original_rank") == comm.original_id],
                 weights=digest(model.get_weights()))


def _reaches(op, target):
    """Whether ``target`` runs before ``op`` (a path of data or control edges)."""
    seen, todo = set(), [op]
    while todo:
        o = todo.pop()
        if o is target:
            return True
        if o.name in seen:
            continue
        seen.add(o.name)
        todo.extend(list(o.control_inputs) + [t.op for t in o.inputs])
    return False


def main():
    scenario, args = sys.argv[1], sys.argv[2:]
    hvd.init()
    globals()[scenario](*args)


if __name__ == "__main__":
    main()
