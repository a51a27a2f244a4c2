"""Parity with Horovod 0.28.1: its API's names, then what a program or test can tell apart.

Every public name of Horovod 0.28.1's TF/Keras API exists here with Horovod's parameters.
Horovod's parameters must come first and in Horovod's order (so positional calls work);
elastic_hvd may add parameters after them.

Where a Horovod 0.28.1 program or test can tell elastic_hvd from Horovod (issue 13), held
against what Horovod's sources do (named in each test).  What shows on one rank runs in a
plain process (``tests/workers/tf_parity.py one_rank``); mismatches and averaging over
ranks in one 2-rank job (``two_ranks``); the Horovod internals that code reaches for need
no MPI at all.
"""

import importlib
import inspect
import os
import sys

import numpy as np
import pytest

from horovod_api_0_28_1 import HOROVOD_API, HOROVOD_MEMBERS
from mpijob import run_job, run_process


# == names and parameters of Horovod's API ================================================
MODULES = {
    "horovod.tensorflow": "elastic_hvd.tensorflow",
    "horovod.tensorflow.keras": "elastic_hvd.tensorflow.keras",
    "horovod.tensorflow.keras.callbacks": "elastic_hvd.tensorflow.keras.callbacks",
    "horovod.tensorflow.keras.elastic": "elastic_hvd.tensorflow.keras.elastic",
    "horovod.tensorflow.elastic": "elastic_hvd.tensorflow.elastic",
    "horovod.keras": "elastic_hvd.keras",
    "horovod.keras.callbacks": "elastic_hvd.keras.callbacks",
    "horovod.keras.elastic": "elastic_hvd.keras.elastic",
}

# Horovod's names that elastic_hvd deliberately lacks: helpers of Horovod's own
# machinery that its __init__ imports for itself, with no meaning here.
NOT_PROVIDED = {
    ("horovod.tensorflow", "check_extension"):
        "checks that Horovod's compiled C extension was built; elastic_hvd has none",
    ("horovod.tensorflow", "LocalGradientAggregationHelper"):
        "Horovod's optimizer internals for backward_passes_per_step, driven by Horovod's "
        "allreduce function; elastic_hvd's is gradients.LocalAccumulator",
}

CASES = [(module, name, params) for module, names in HOROVOD_API.items()
         for name, params in names.items() if (module, name) not in NOT_PROVIDED]


def test_every_horovod_module_is_mapped():
    assert sorted(MODULES) == sorted(HOROVOD_API)


def test_not_provided_names_are_horovods_and_absent_here():
    for module, name in NOT_PROVIDED:
        assert name in HOROVOD_API[module]
        assert not hasattr(importlib.import_module(MODULES[module]), name)


def _parameters(obj):
    target = obj.__init__ if inspect.isclass(obj) else obj
    names = [p.name for p in inspect.signature(target).parameters.values()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return names[1:] if inspect.isclass(obj) else names


@pytest.mark.parametrize("module,name,params", CASES,
                         ids=[f"{m}.{n}" for m, n, _ in CASES])
def test_name_and_parameters(module, name, params):
    ours = importlib.import_module(MODULES[module])
    assert hasattr(ours, name), f"{MODULES[module]} lacks {name}"
    if params is None:
        return
    expected = [p for p in params if not p.startswith("*")]
    got = _parameters(getattr(ours, name))
    assert got[:len(expected)] == expected, f"{name}: ours {got}, Horovod {expected}"


def _made_by(factory, what):
    """An object that ``factory`` (ours) returns, as Horovod's factory returns the
    object its HOROVOD_MEMBERS entry "factory() -> what" describes."""
    import tensorflow as tf
    made = {"tape": lambda: factory(tf.GradientTape()),
            "Keras optimizer": lambda: factory(tf.keras.optimizers.SGD(0.1)),
            "TF1 optimizer": lambda: factory(tf.compat.v1.train.GradientDescentOptimizer(0.1))}
    return made[what]()


def _ours_for(key):
    """Our object for a HOROVOD_MEMBERS key: a class, or what a factory returns."""
    path, _, what = key.partition("() -> ")
    module, _, name = path.rpartition(".")
    found = getattr(importlib.import_module(MODULES[module]), name)
    return _made_by(found, what) if what else found


MEMBER_CASES = [(key, member, params) for key, members in HOROVOD_MEMBERS.items()
                if (key.rpartition(".")[0], key.rpartition(".")[2]) not in NOT_PROVIDED
                for member, params in members.items()]


@pytest.mark.parametrize("key,member,params", MEMBER_CASES,
                         ids=[f"{k}.{m}" for k, m, _ in MEMBER_CASES])
def test_methods_and_properties_of_classes_and_returned_objects(key, member, params):
    """Horovod's classes, and the objects its DistributedOptimizer and gradient tapes
    return, have their public methods and properties here, with Horovod's parameters."""
    ours = _ours_for(key)
    assert hasattr(ours, member), f"{key} lacks {member}"
    if params == "attribute":
        return
    method = getattr(ours, member)
    names = [p.name for p in inspect.signature(method).parameters.values()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if inspect.isclass(ours) and not isinstance(inspect.getattr_static(ours, member),
                                                staticmethod):
        names = names[1:]  # self
    expected = [p for p in params if not p.startswith("*")]
    assert names[:len(expected)] == expected, f"{key}.{member}: ours {names}, Horovod {expected}"


def test_calls_before_init_raise_a_clear_error():
    import elastic_hvd.tensorflow.keras as hvd
    from elastic_hvd.core import NotInitializedError
    if hvd.is_initialized():
        pytest.skip("initialized by another test in this process")
    with pytest.raises(NotInitializedError, match="hvd.init"):
        hvd.size()


# Every public module: the API that scripts import (Horovod's and elastic_hvd's own).
PUBLIC_MODULES = [
    "elastic_hvd.tensorflow", "elastic_hvd.tensorflow.keras",
    "elastic_hvd.tensorflow.keras.callbacks", "elastic_hvd.tensorflow.elastic",
    "elastic_hvd.tensorflow.keras.elastic", "elastic_hvd.keras", "elastic_hvd.keras.callbacks",
    "elastic_hvd.keras.elastic", "elastic_hvd.core", "elastic_hvd.sharding",
    "elastic_hvd.tensorflow.data", "keras_callbacks",
]


def _ours(obj):
    return (getattr(obj, "__module__", None) or "").split(".")[0] in ("elastic_hvd",
                                                                     "keras_callbacks")


def test_every_public_class_and_function_has_a_docstring():
    """A class's docstring must be its own (``__doc__``), not inherited from Keras or TF."""
    missing = {}  # "module.qualname" -> the public names it goes by
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        names = getattr(module, "__all__", None) or [n for n in dir(module)
                                                      if not n.startswith("_")]
        for name in names:
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)) or not _ours(obj):
                continue
            doc = obj.__doc__ if inspect.isclass(obj) else inspect.getdoc(obj)
            if not (doc or "").strip():
                missing.setdefault(f"{obj.__module__}.{obj.__qualname__}", []).append(
                    f"{module_name}.{name}")
    lines = [f"{where} (public as {', '.join(names)})" for where, names in sorted(missing.items())]
    assert not missing, f"{len(missing)} without a docstring:\n" + "\n".join(lines)


# == behaviour a program or test can tell apart (issue 13) ================================
MODES = ("eager", "function", "tf1")


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    job = run_process("tf_parity.py", "one_rank", tmp_path=tmp_path_factory.mktemp("one"),
                      timeout=300)
    assert sorted(job.results) == [0], job.output[-3000:]
    return job.results[0]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    job = run_job("tf_parity.py", "two_ranks", np=2, tmp_path=tmp_path_factory.mktemp("two"),
                  timeout=300, env={"ELASTIC_HVD_MISMATCH_TIMEOUT": "1"})
    assert sorted(job.results) == [0, 1], job.output[-3000:]
    return [job.results[0], job.results[1]]


# -- 1. error classes ------------------------------------------------------------------


@pytest.mark.multirank
def test_mismatched_collectives_raise_failed_precondition_still_ours(two_ranks):
    # Horovod's coordinator answers a mismatch with ErrorOp (PreconditionError in
    # horovod/common/ops/collective_operations.cc), which horovod/tensorflow/mpi_ops.cc's
    # ConvertStatus makes tf.errors.FailedPreconditionError.
    for rank in two_ranks:
        errors = rank["errors"]
        for case in ("shape eager", "dtype eager", "root eager", "root broadcast_object"):
            assert {"tf.FailedPreconditionError", "hvd.MismatchError"} <= set(errors[case]), case
        for case in ("shape function", "shape tf1"):  # a new TF error: only TF's class
            assert errors[case] == ["tf.FailedPreconditionError"], case
        assert rank["after errors"] == [2.0, 2.0]  # and the job goes on


@pytest.mark.multirank
def test_uneven_alltoall_raises_invalid_argument_on_every_rank(two_ranks):
    # EnqueueTensorAlltoall (horovod/common/operations.cc): "splits not provided, but
    # first dimension of tensor is not an even multiple" is Status::InvalidArgument.
    even, uneven = (rank["errors"] for rank in two_ranks)  # rank 0 has 2 rows, rank 1 has 3
    assert even["alltoall eager"] == ["ValueError", "hvd.RemoteCollectiveError",
                                      "tf.InvalidArgumentError"]
    assert uneven["alltoall eager"] == ["ValueError", "tf.InvalidArgumentError"]
    for errors in (even, uneven):
        for mode in ("function", "tf1"):
            assert errors[f"alltoall {mode}"] == ["tf.InvalidArgumentError"], mode


@pytest.mark.multirank
def test_same_size_in_another_shape_raises_failed_precondition_on_every_rank(two_ranks):
    # Horovod's coordinator (horovod/common/controller.cc, ConstructResponse) compares
    # every rank's full shape -- all dimensions for allreduce, broadcast and
    # reducescatter, those after the first for allgather and alltoall -- and answers a
    # difference with an error: FailedPreconditionError on every rank.  Before, a fused
    # buffer's flat shape let 4x6 and 6x4 add non-corresponding elements.
    for rank in two_ranks:
        for case, errors in rank["same size, other shape"].items():
            assert errors is not None and "tf.FailedPreconditionError" in errors, case
        assert "(4, 6)" in rank["mismatch message"] and "(6, 4)" in rank["mismatch message"]
        assert rank["after errors"] == [2.0, 2.0]


@pytest.mark.multirank
def test_bfloat16_against_float32_raises_failed_precondition_on_every_rank(two_ranks):
    # The same coordinator compares dtypes.  elastic_hvd reduces bfloat16 in float32,
    # and averages integer slices in floats; before, it cast before the collective, so
    # the signatures ranks compare both said float32 and one rank's bfloat16 (int16)
    # was summed with (gathered beside) the other's float32.  Each call comes after
    # three float32 ones: rank 1's is the one its predictor expects.
    for rank in two_ranks:
        for case, errors in rank["other dtype"].items():
            assert errors is not None and "tf.FailedPreconditionError" in errors, case
        assert "bfloat16" in rank["dtype message"] and "float32" in rank["dtype message"]


@pytest.mark.multirank
def test_inplace_broadcast_returns_and_assigns_the_roots_values_in_every_mode(two_ranks):
    # horovod/tensorflow/mpi_ops.py broadcast_: the variables' values read after the
    # in-place broadcast; test_horovod_broadcast_inplace_[multiple_]cpu.
    for rank in two_ranks:
        for mode, values in rank["broadcast_"].items():
            assert values == [[1.0]] * 6, mode


# -- 2. gradients of allgather and broadcast ---------------------------------------------


@pytest.mark.multirank
def test_allgather_and_broadcast_gradients_are_averaged_over_ranks(two_ranks):
    # horovod/tensorflow/mpi_ops.py: _allgather_grad and _broadcast_grad allreduce the
    # gradient with op=Average.  Rank r's output gradient is r + 1: the average is 1.5.
    for rank in two_ranks:
        for mode in MODES:
            assert rank["gradients"][f"allgather {mode}"] == [[1.5]], mode
            assert rank["gradients"][f"broadcast {mode}"] == [1.5 if rank["rank"] == 0 else 0.0]


# -- 3. scale factors, dtype by dtype ------------------------------------------------------


def horovod_scale(values, dtype, factor):
    """Horovod's ScaleBuffer on the CPU (ScaleBufferCPUImpl, horovod/common/ops/
    collective_operations.h and .cc): ``factor * value``, the factor a double for
    integers and float64 (an integer product converted back truncates toward zero),
    a float for float32 and float16 (computed in float32, rounded to float16)."""
    values = np.asarray(values, dtype)
    if values.dtype.kind in "iu":
        return (np.float64(factor) * values.astype(np.float64)).astype(dtype)
    if values.dtype == np.float64:
        return np.float64(factor) * values
    return (np.float32(factor) * values.astype(np.float32)).astype(dtype)


def horovod_reduce(inputs, dtype, op, pre, post):
    """Horovod's allreduce (and reducescatter, before its split) with scale factors, on
    the CPU: the factors are float32 op attributes (horovod/tensorflow/mpi_ops.cc),
    Average is a Sum postscaled by 1/size (horovod/common/operations.cc), a factor
    of 1 is not applied, and float16 sums round after every addition (its MPI op)."""
    pre, post = float(np.float32(pre)), float(np.float32(post))
    if op == "Average":
        post /= len(inputs)
    parts = [horovod_scale(x, dtype, pre) if pre != 1.0 else np.asarray(x, dtype)
             for x in inputs]
    total = parts[0]
    for part in parts[1:]:
        total = (total.astype(np.float32) + part.astype(np.float32)).astype(dtype) \
            if dtype == "float16" else total + part
    return horovod_scale(total, dtype, post) if post != 1.0 else total


def exact(inputs, dtype, op, pre, post):
    """What exact arithmetic gives, rounded once: what a rule of Horovod's changes."""
    total = sum(np.asarray(x, np.float64) for x in inputs) * pre * post
    total /= len(inputs) if op == "Average" else 1
    return np.round(total).astype(dtype) if np.dtype(dtype).kind in "iu" else total.astype(dtype)


def check_scaled(ranks):
    """Every rank's scaled results equal Horovod's to the bit; returns the dtypes for
    which Horovod's rounding made a difference somewhere."""
    differs = set()
    for k, record in enumerate(ranks[0]["scaled"]):
        inputs = [rank["scaled"][k]["input"] for rank in ranks]
        dtype, op, pre, post = (record[key] for key in ("dtype", "op", "pre", "post"))
        want = horovod_reduce(inputs, dtype, op, pre, post)
        if not np.array_equal(want, exact(inputs, dtype, op, pre, post)):
            differs.add(dtype)
        for rank in ranks:
            got = np.asarray(rank["scaled"][k]["output"], dtype)
            assert np.array_equal(got, want), (record["collective"], dtype, op, pre, post)
    return differs


def test_scale_factors_round_as_horovod_does_dtype_by_dtype(one_rank):
    differs = check_scaled([one_rank])
    # Integers truncate, float16 rounds twice, float64 takes a float32 factor: each
    # dtype's rule shows in at least one result above.
    assert differs >= {"int8", "int32", "int64", "float16", "float64"}, differs


@pytest.mark.multirank
def test_scale_factors_and_integer_averages_round_as_horovod_does_on_two_ranks(two_ranks):
    assert check_scaled(two_ranks) >= {"int32", "float16", "float64"}


# -- 4. IndexedSlices without dense_shape -------------------------------------------------


def test_indexed_slices_without_dense_shape_are_gathered(one_rank):
    # horovod/tensorflow/__init__.py: grouped_allreduce gathers the IndexedSlices among
    # its tensors (values and indices) and keeps their dense_shape, None here.
    slices = one_rank["slices"]
    for case in ("Sum", "Average", "allreduce"):
        assert slices[case]["values"] == [[1.0, 2.0], [3.0, 4.0]], case
        assert slices[case]["indices"] == [3, 0] and slices[case]["dense_shape"] is None
    assert slices["Sum"]["dense"] == slices["Average"]["dense"] == [1.0, 2.0]


@pytest.mark.multirank
def test_indexed_slices_among_dense_tensors_are_averaged_over_ranks(two_ranks):
    for rank in two_ranks:
        assert rank["slices"] == {"values": [[0.5, 1.0], [1.0, 1.0]], "indices": [0, 1],
                                  "dense": [1.5]}


# -- 5. alltoall splits as an int32 tensor ---------------------------------------------------


def test_alltoall_takes_splits_as_an_int32_tensor(one_rank):
    for dtype in ("uint8", "float32"):
        for mode in MODES:
            assert one_rank["alltoall"][f"{dtype} {mode}"] == [[1, 2, 3], [3]], (dtype, mode)


def test_partial_tape_splits_local_and_global_gradients(one_rank):
    # horovod/tensorflow/__init__.py _DistributedGradientTape.get_local_and_global_gradients:
    # ([(source, gradient)] of the local sources, [(source, gradient)] of the others).
    assert one_rank["local and global"] == [[[1.0, 3.0]], [[2.0, 5.0]]]


def test_alltoall_without_splits_returns_the_tensor_alone(one_rank):
    # horovod/tensorflow/mpi_ops.py alltoall: ``(output, rsplits) if splits is not None
    # else output``.
    for mode in MODES:
        assert one_rank["alltoall"][f"no splits {mode}"] == [1, 2, 3], mode


# -- 6. reducescatter gradients ---------------------------------------------------------------


def horovod_reducescatter_grad(output_grads, op, pre, post, times=1.0):
    """horovod/tensorflow/mpi_ops.py's _reducescatter_grad: every rank's output gradient
    gathered, times the size for Sum and the factors (float32 attributes) when not 1;
    ``times``: the gradient's coefficient in the loss (2 for the group's second)."""
    scale = (len(output_grads) if op == "Sum" else 1.0) * np.float32(pre) * np.float32(post)
    return [[g * scale * times] for g in np.concatenate(output_grads)]


def check_reducescatter_gradients(grads, size):
    # Inputs of 4 rows: rank r's block has 4 / size rows, its output gradient is r + 1.
    output_grads = [np.full(4 // size, r + 1.0) for r in range(size)]
    for op in ("Sum", "Average"):
        for pre, post in [(1.0, 1.0), (0.5, 3.0)]:
            want = horovod_reducescatter_grad(output_grads, op, pre, post)
            grouped = horovod_reducescatter_grad(output_grads, op, pre, post, times=3.0)
            for mode in MODES:
                assert grads[f"single {op} {pre} {post} {mode}"] == want, (op, pre, post, mode)
                assert grads[f"grouped {op} {pre} {post} {mode}"] == grouped


def test_reducescatter_gradients_exist_in_every_mode(one_rank):
    # None before in graphs (tf.function, TF1 tf.gradients) and eagerly.
    check_reducescatter_gradients(one_rank["reducescatter gradients"], 1)


@pytest.mark.multirank
def test_reducescatter_gradients_gather_and_scale_as_horovods(two_ranks):
    for rank in two_ranks:
        check_reducescatter_gradients(rank["reducescatter gradients"], 2)


# -- 7. grouped_reducescatter with scale factors ------------------------------------------------


def check_grouped_reducescatter(ranks, inputs):
    size = len(ranks)
    for key in (k for k in ranks[0]["grouped reducescatter"] if k != "inputs"):
        op, pre, post = key.split()
        for k in range(2):
            whole = horovod_reduce([inputs[r][k] for r in range(size)], "float32", op,
                                   float(pre), float(post))
            bounds = np.cumsum([0] + [len(whole) // size + (r < len(whole) % size)
                                      for r in range(size)])
            for r, rank in enumerate(ranks):
                got = np.asarray(rank["grouped reducescatter"][key][k], np.float32)
                assert np.array_equal(got, whole[bounds[r]:bounds[r + 1]]), (key, k, r)


def test_grouped_reducescatter_applies_scale_factors(one_rank):
    check_grouped_reducescatter([one_rank], [[[[1.0, 2.0], [3.0, 4.0]], [[5.0], [7.0]]]])


@pytest.mark.multirank
def test_grouped_reducescatter_applies_scale_factors_on_two_ranks(two_ranks):
    check_grouped_reducescatter(two_ranks, [rank["grouped reducescatter"]["inputs"]
                                            for rank in two_ranks])


# -- 8. scale factors on IndexedSlices ------------------------------------------------------------


def test_scale_factors_or_other_ops_on_indexed_slices_raise_not_implemented(one_rank):
    # horovod/tensorflow/__init__.py: "Pre/postscale_factor are not supported with
    # tf.IndexedSlices", "Only Sum and Average ops are supported with tf.IndexedSlices".
    assert set(map(tuple, one_rank["slices errors"].values())) == {("NotImplementedError",)}


# -- 9. Horovod internals that code reaches for ----------------------------------------------------


@pytest.fixture
def tf_hvd():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    tf = pytest.importorskip("tensorflow")
    import elastic_hvd.tensorflow as hvd
    return tf, hvd


def test_executing_eagerly_and_util_as_horovod_has_them(tf_hvd):
    # horovod/tensorflow/__init__.py imports _executing_eagerly from horovod/tensorflow/
    # util.py; horovod/_keras and Keras callbacks written for Horovod call it.
    tf, hvd = tf_hvd
    assert hvd._executing_eagerly() is True
    assert not tf.function(lambda: tf.constant(hvd._executing_eagerly()))().numpy()
    assert hvd.util._executing_eagerly is hvd._executing_eagerly
    assert hvd.util._make_subgraph(lambda: tf.constant(3))().numpy() == 3
    with pytest.raises(AttributeError, match="horovod.tensorflow.util.nothing_such is a part "
                                             "of Horovod that elastic_hvd does not provide"):
        hvd.util.nothing_such  # noqa: B018


def test_horovods_internal_modules_on_hvd_name_themselves(tf_hvd):
    # horovod/tensorflow/__init__.py imports from its modules mpi_ops, functions and
    # gradient_aggregation, so Horovod's hvd carries them; Horovod's dynamic process-set
    # test reads hvd.mpi_ops._basics.
    tf, hvd = tf_hvd
    for name in ("functions", "gradient_aggregation"):
        with pytest.raises(AttributeError, match=f"horovod.tensorflow.{name} is a part of "
                                                 "Horovod that elastic_hvd does not provide"):
            getattr(hvd, name)
    # hvd.mpi_ops carries _basics._get_process_set_ids_and_ranks (process sets), no more
    with pytest.raises(AttributeError, match="horovod.tensorflow.mpi_ops.no_such is a part of "
                                             "Horovod that elastic_hvd does not provide"):
        hvd.mpi_ops.no_such  # noqa: B018
    assert not hasattr(hvd, "no_such_name") and hvd.util.__name__ == "elastic_hvd.tensorflow.util"


def test_keras_wrapper_internals_are_horovods_or_name_themselves(tf_hvd):
    # horovod/_keras/__init__.py: the wrapper's _agg_helper is None unless
    # backward_passes_per_step > 1 (then it has Horovod's helper's counter and methods);
    # its _compute_gradients returns allreduced gradients (Horovod's test_tensorflow2_keras
    # aggregation tests run them on 2 ranks: docs/horovod-tests.md).
    tf, hvd = tf_hvd
    optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1))
    assert optimizer._agg_helper is None and callable(optimizer._compute_gradients)
    accumulating = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1),
                                            backward_passes_per_step=2)
    helper = accumulating._agg_helper
    assert helper.backward_passes_per_step == 2 and helper.counter is None
    assert callable(helper.compute_gradients) and callable(helper.apply_gradients)


def test_tf_keras_legacy_optimizers_still_minimize(one_rank):
    # minimize() takes its own _compute_gradients: one SGD step, 1 - 0.25 * 2.
    assert one_rank["legacy minimize"] == 0.5


@pytest.fixture
def horovod_alias():
    """``import horovod...`` resolves to elastic_hvd for the test, and no longer after."""
    from elastic_hvd import horovod_alias
    before = set(sys.modules)
    horovod_alias.install(quiet=True)
    yield
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, horovod_alias._AliasFinder)]
    for name in set(sys.modules) - before:
        if name.split(".")[0] == "horovod":
            del sys.modules[name]


def test_horovods_helper_modules_resolve_to_stand_ins(horovod_alias):
    # Horovod's helpers import horovod.tensorflow.util (_executing_eagerly),
    # horovod.common.util (env, split_list, ...) and horovod.runner.util.threads.
    tf_util = importlib.import_module("horovod.tensorflow.util")
    assert tf_util._executing_eagerly() is True
    common = importlib.import_module("horovod.common.util")
    assert common.split_list([1, 2, 3], 2) == [[1, 2], [3]] and common.num_rank_is_power_2(4)
    with common.env(ELASTIC_HVD_PARITY_TEST="1", NOT_SET=None):
        assert os.environ["ELASTIC_HVD_PARITY_TEST"] == "1" and "NOT_SET" not in os.environ
    assert "ELASTIC_HVD_PARITY_TEST" not in os.environ
    threads = importlib.import_module("horovod.runner.util.threads")
    # Each aliased package is elastic_hvd's own of the same shape: the import sets
    # `util` and `threads` on elastic_hvd's packages, where they are already.
    import elastic_hvd.runner
    assert sys.modules["horovod.runner"] is elastic_hvd.runner
    assert elastic_hvd.runner.util.threads is threads
    assert threads.execute_function_multithreaded(lambda a, b: a * b, [[2, 3], [4, 5]]) \
        == {0: 6, 1: 20}
    done = []
    threads.in_thread(done.append, ("ran",), daemon=False).join()
    assert done == ["ran"]
    # What is not provided says so, by Horovod's name.
    with pytest.raises(AttributeError, match="horovod.common.util.check_extension is a part"):
        common.check_extension  # noqa: B018
    runner = importlib.import_module("horovod.runner")
    with pytest.raises(AttributeError, match="horovod.runner.run is a part of Horovod"):
        runner.run  # noqa: B018
    with pytest.raises(ImportError, match="horovod.spark has no elastic_hvd equivalent"):
        importlib.import_module("horovod.spark")


def test_runner_env_helper_gives_the_launch_rank_and_size(horovod_alias, monkeypatch):
    # Horovod's process-set tests call get_env_rank_and_size() before init()
    # (horovod/runner/common/util/env.py): HOROVOD_*, then OMPI_COMM_WORLD_*, then PMI_*.
    env = importlib.import_module("horovod.runner.common.util.env")
    for name in ("HOROVOD_RANK", "HOROVOD_SIZE", "OMPI_COMM_WORLD_RANK",
                 "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert env.get_env_rank_and_size() == (0, 1)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    assert env.get_env_rank_and_size() == (1, 2)
    monkeypatch.setenv("HOROVOD_RANK", "3")
    with pytest.raises(RuntimeError, match="only one of HOROVOD_RANK and HOROVOD_SIZE"):
        env.get_env_rank_and_size()
    with pytest.raises(AttributeError, match="horovod.runner.common.util.env.is_kubeflow_mpi "
                                             "is a part of Horovod"):
        env.is_kubeflow_mpi  # noqa: B018
