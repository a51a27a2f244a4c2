"""Single-process: the optimizer helpers every Keras flavour goes through."""

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")

from elastic_hvd.tensorflow import optimizer_state as opt  # noqa: E402


def sgd(momentum=0.9):
    return tf.keras.optimizers.SGD(0.1, momentum=momentum)


def test_overlapping_momentum_corrections_compound_then_restore_to_the_original():
    optimizer = sgd()
    opt.momentum_correct(optimizer, 0.1, 0.2)   # a schedule doubles the rate ...
    opt.momentum_correct(optimizer, 0.2, 0.15)  # ... and a rank loss rescales it, same step
    assert opt.momentum_state(optimizer) == (pytest.approx(0.9 * 1.5), 0.9)
    opt.momentum_restore(optimizer)  # the schedule callback's batch end
    opt.momentum_restore(optimizer)  # the rescaler's: nothing left to undo
    assert opt.momentum_state(optimizer) == (pytest.approx(0.9), None)


def test_momentum_state_travels_with_its_pending_correction():
    source, target = sgd(), sgd(momentum=0.5)
    opt.momentum_correct(source, 0.1, 0.05)
    opt.load_momentum_state(target, opt.momentum_state(source))
    assert opt.momentum_state(target) == (pytest.approx(0.45), 0.9)
    opt.momentum_restore(target)
    assert opt.momentum_state(target) == (pytest.approx(0.9), None)
    # Loading a state without a pending correction drops the target's own.
    opt.momentum_correct(target, 0.1, 0.2)
    opt.load_momentum_state(target, (0.7, None))
    opt.momentum_restore(target)
    assert opt.momentum_state(target) == (pytest.approx(0.7), None)


def test_no_momentum_no_correction_and_lr_round_trip():
    optimizer = tf.keras.optimizers.Adam(0.01)
    opt.momentum_correct(optimizer, 0.01, 0.02)
    assert opt.momentum_state(optimizer) == (None, None)
    opt.set_lr(optimizer, 0.03)
    assert opt.get_lr(optimizer) == pytest.approx(0.03)


@pytest.mark.parametrize("flavour", ["keras", "tf_keras"])
def test_training_state_load_and_warm_up_reach_every_variable(flavour):
    # A joiner loads the live state through the TF variables under Keras' (faster);
    # warm_up (before it joins) assigns each its own value and must change nothing.
    from elastic_hvd.tensorflow.training_state import TrainingState
    keras = tf.keras if flavour == "keras" else pytest.importorskip("tf_keras")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                              keras.layers.BatchNormalization(), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    model.fit(tf.random.normal((8, 3)), tf.random.normal((8, 2)), epochs=2, verbose=0)
    state = TrainingState(model)
    before = state.state()
    assert any(abs(x).sum() > 0 for x in before["optimizer"][1:])  # momentum slots in use
    state.warm_up()
    after = state.state()
    for part in ("model", "optimizer"):
        assert all((a == b).all() for a, b in zip(before[part], after[part])), part
    # Values of another dtype (a state from elsewhere) load as the variables' own dtype.
    moved = {**before, "model": [(x + 1).astype("float64") for x in before["model"]],
             "optimizer": [x * 2 for x in before["optimizer"]]}
    state.load_state(moved)
    loaded = state.state()
    assert all((a == (b + 1).astype(a.dtype)).all()
               for a, b in zip(loaded["model"], before["model"]))
    assert all(v.dtype == "float32" for v in model.variables)
    # Every optimizer variable doubled but Keras 3's learning rate, which state["lr"] sets
    # (Keras 2's optimizers keep the rate out of their variables).
    doubled = [(a == b * 2).all() for a, b in zip(loaded["optimizer"], before["optimizer"])]
    version = getattr(keras, "__version__", None) or pytest.importorskip("keras").__version__
    keras3 = version.startswith("3.")
    assert sum(doubled) == len(doubled) - keras3, doubled
    assert loaded["lr"] == pytest.approx(before["lr"])
