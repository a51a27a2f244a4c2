"""The Horovod TF/Keras API on real multi-rank jobs (Keras 3 by default)."""

import importlib.metadata

import numpy as np
import pytest

from mpijob import run_job

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("np_", [2, 4])
def test_tf_ops_match_numpy_eager_and_graph(tmp_path, np_):
    job = run_job("tf_numerics.py", np=np_, tmp_path=tmp_path, timeout=300)
    assert sorted(job.results) == list(range(np_)), job.output[-3000:]
    for rank, result in job.results.items():
        assert result["failures"] == [], f"rank {rank}: {result['failures']}"


KERAS_MAJOR = int(importlib.metadata.version("keras").split(".")[0])
FLAVOURS = ["default", "tf_keras"]


def _flavour_env(flavour):
    if flavour == "tf_keras" and KERAS_MAJOR < 3:
        pytest.skip("TF < 2.16: tf.keras is Keras 2 already (the 'default' case)")
    return {"TF_USE_LEGACY_KERAS": "1"} if flavour == "tf_keras" else {}


#: flavour -> the weights after fit on 1 rank (the same reference for every test of a flavour).
_ONE_RANK = {}


def _fit_two_ranks_and_one(tmp_path, env, passes):
    """Weights after fit on 2 ranks (``passes`` micro-batches per update) and on 1 rank."""
    two = run_job("tf_scenarios.py", "fit_equivalence", 32, 6, passes, np=2,
                  tmp_path=tmp_path / "two", timeout=300, env=env)
    flavour = tuple(sorted(env.items()))
    if flavour not in _ONE_RANK:
        run_job("tf_scenarios.py", "fit_equivalence", 32, 6, 1, np=1, tmp_path=tmp_path / "one",
                timeout=300, env=env)
        with np.load(tmp_path / "one" / "out" / "weights0_of1x1.npz") as weights:
            _ONE_RANK[flavour] = dict(weights)
    assert two.results[0]["digest"] == two.results[1]["digest"]
    a = np.load(tmp_path / "two" / "out" / f"weights0_of2x{passes}.npz")
    b = _ONE_RANK[flavour]
    for key in a:
        np.testing.assert_allclose(a[key], b[key], atol=1e-5)
    assert any(np.abs(a[k]).sum() > 0 for k in a)
    return two


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_two_rank_fit_equals_one_rank_on_the_concatenated_batch(tmp_path, flavour):
    two = _fit_two_ranks_and_one(tmp_path, _flavour_env(flavour), passes=1)
    # The wrapped optimizer keeps its class name and config (saved models load without us).
    assert two.results[0]["optimizer_class"] == "SGD"
    # Keras 3 names its optimizers "sgd", tf_keras and Keras 2 "SGD": proof of which Keras ran.
    keras3 = flavour == "default" and KERAS_MAJOR >= 3
    assert two.results[0]["optimizer_config_class"] == ("sgd" if keras3 else "SGD")


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_backward_passes_per_step_accumulates_locally(tmp_path, flavour):
    # 2 ranks x 2 averaged micro-batches of 8 per update == 1 rank on batches of 32.
    _fit_two_ranks_and_one(tmp_path, _flavour_env(flavour), passes=2)


@pytest.mark.check
def test_after_a_kill_in_fit_survivors_average_over_survivors(tmp_path):
    # x = 2**r on rank r and loss = mean(x @ w): every step moves w by -mean(2**r) over live ranks.
    job = run_job("tf_scenarios.py", "fit_gradient_scale", 12, np=4, faults="rank=2,step=6",
                  tmp_path=tmp_path, timeout=300)
    assert sorted(job.results) == [0, 1, 3], job.output[-3000:]
    digests = {r["digest"] for r in job.results.values()}
    assert len(digests) == 1, "survivors' weights differ"
    for r in job.results.values():
        sizes, deltas = r["sizes"], r["deltas"]
        assert sizes[:5] == [4] * 5 and sizes[5:] == [3] * 7, sizes
        for size, delta in zip(sizes, deltas):
            expected = -(1 + 2 + 4 + 8) / 4 if size == 4 else -(1 + 2 + 8) / 3
            assert delta == pytest.approx(expected, rel=1e-6)


def test_gradients_keep_the_forward_pass_membership_after_a_loss(tmp_path):
    # Rank 1 dies between the forward collectives and their gradients: each survivor
    # still gets the rows it gave to the gather (not a slice of the new membership),
    # and the broadcast's gradient goes to the forward pass's root, original rank 2
    # (now rank 1), not to whoever has rank 2 now.
    job = run_job("tf_scenarios.py", "gradients_after_a_loss", np=4, tmp_path=tmp_path,
                  timeout=300)
    assert sorted(job.results) == [0, 2, 3], job.output[-3000:]
    w_gather = np.arange(20, dtype=np.float32).reshape(10, 2)
    starts = {0: 0, 2: 3, 3: 6}  # rows 0 | 1-2 (rank 1) | 3-5 | 6-9
    for me, r in job.results.items():
        assert r["ids"] == [0, 2, 3]
        np.testing.assert_array_equal(r["grad_x"], w_gather[starts[me]:starts[me] + me + 1])
        expected_v = [1.0, 2.0, 3.0] if me == 2 else [0.0, 0.0, 0.0]
        assert r["grad_v"] == expected_v, (me, r["grad_v"])


def test_distributed_gradient_tape_in_tf_function(tmp_path):
    job = run_job("tf_scenarios.py", "tape_loop", 5, np=2, tmp_path=tmp_path, timeout=300)
    assert len({r["digest"] for r in job.results.values()}) == 1


def test_unchanged_horovod_script_runs_as_horovod(tmp_path):
    job = run_job("horovod_script.py", np=2, launcher=["--as-horovod"], tmp_path=tmp_path,
                  timeout=300)
    assert "`import horovod` resolves to elastic_hvd" in job.output
    results = list(job.results.values())
    assert [r["module"] for r in results] == ["elastic_hvd.tensorflow.keras"] * 2
    assert results[0]["weights"] == results[1]["weights"]


def test_one_training_state_for_checkpoints_hvd_elastic_and_a_restart(tmp_path):
    directory = tmp_path / "ckpt"
    saved = run_job("tf_scenarios.py", "training_state", "save", directory, np=2,
                    tmp_path=tmp_path / "save", timeout=300)
    for r in saved.results.values():
        # hvd.elastic: restore goes back to the commit but keeps the rescaling since.
        assert r["rollback"] == {"digest_ok": True, "lr": pytest.approx(0.05), "batch": 2}
        assert r["same_as_live"] == {"keys": True, "arrays": True, "rest": True}
    syncs = {r["after_sync"]["digest"] for r in saved.results.values()}
    assert len(syncs) == 1 and saved.results[1]["after_sync"]["batch"] == 2
    first = saved.results[0]
    assert first["lr"] == pytest.approx(0.05) and first["lr_factor"] == 0.5 and first["step"] > 0
    assert len(first["queue"]) == 40 - 2 * 4  # one committed step of the epoch was drawn
    # A new job on 3 ranks (another seed for its fresh model) resumes it all, at the rate
    # its script sets for 3 ranks, not the old job's rescaled one.
    again = run_job("tf_scenarios.py", "training_state", "restart", directory, np=3,
                    tmp_path=tmp_path / "restart", timeout=300)
    assert "written on 2 ranks, now 3; learning rate 0.05 -> 0.15" in again.output
    for r in again.results.values():
        assert (r["digest"], r["optimizer"]) == (first["digest"], first["optimizer"])
        assert r["epoch"] == 1 and r["queue"] == first["queue"] and r["step"] == first["step"]
        assert r["lr"] == pytest.approx(0.15) and r["lr_factor"] == 1.0


def test_asked_to_grow_a_script_without_a_growth_point_warns_once(tmp_path):
    # A plain Horovod-style fit under --respawn: nothing would ever replace a lost rank.
    job = run_job("tf_scenarios.py", "fit_equivalence", 32, 6, 1, np=2, launcher=["--respawn"],
                  tmp_path=tmp_path, timeout=300)
    assert job.output.count("asked to grow (--respawn), but this script has no growth point") == 1


# Issue 13: independent collectives of one graph, started in any order by TF's executor.
ORDER_ENV = {"ELASTIC_HVD_MISMATCH_TIMEOUT": "2"}


@pytest.mark.parametrize("mode", ["tf1", "function"])
def test_independent_collectives_of_a_graph_match_on_every_rank(tmp_path, mode):
    job = run_job("tf_scenarios.py", "graph_order", mode, 50, np=2, tmp_path=tmp_path,
                  timeout=300, env=ORDER_ENV)
    assert sorted(job.results) == [0, 1], job.output[-3000:]
    for rank, result in job.results.items():
        assert result["failures"] == [], f"rank {rank}: {result['failures'][:3]}"
        if mode == "function":  # ordered by automatic control dependencies, not by us
            assert result["chained"] and result["collectives"] >= 9, result
        else:  # a collective is never chained after one that needs a feed it lacks
            assert result["alone"] == [[0.0, 0.0], [1.0, 1.0]], result["alone"]
            assert result["summed"] == [3.0, 3.0, 3.0], result["summed"]


def test_tf1_runs_execute_only_the_collectives_fetched(tmp_path):
    # A TF1 script builds broadcast_global_variables before its training op and runs
    # the broadcast once.  A training step must not broadcast the variables again
    # (before: chained after the broadcast, each step re-ran it), and a broadcast_ built
    # and fetched by itself runs only itself (before: all the earlier ones too).  Two
    # built together still follow one another, for when they are fetched together.
    steps, broadcasts = 4, 5
    job = run_job("tf_scenarios.py", "tf1_runs", tmp_path, steps, broadcasts, np=2,
                  tmp_path=tmp_path, timeout=300)
    assert sorted(job.results) == [0, 1], job.output[-3000:]
    for result in job.results.values():
        assert result["trained"] == {"HorovodGradients": steps}, result["trained"]
        assert result["broadcast"] == {"HorovodBroadcastVariables": broadcasts}
        # Rank 0's zeros, then steps of 0.1 x the gradient averaged over ranks, 1.5 x.
        assert result["weights"] == pytest.approx([-0.1 * steps * 1.5 * x for x in (1, 2, 3, 4)])
        assert result["values"] == [[1.0 + k] * 3 for k in range(broadcasts)]
        assert result["together"] == {"chained": True, "values": [[1.0] * 3, [11.0] * 3]}


def test_without_chaining_a_tf1_graph_mismatches(tmp_path):
    # The same TF1 runs with the chaining switched off (elastic_hvd before issue 13):
    # TF's executor starts the collectives in another order on each rank, and they fail.
    job = run_job("tf_scenarios.py", "graph_order", "tf1", 50, 0, np=2, tmp_path=tmp_path,
                  timeout=300, env=ORDER_ENV, expect_rc=None)
    failures = [f for r in job.results.values() for f in r["failures"]]
    assert failures or job.returncode != 0, job.output[-3000:]


def test_a_second_fit_does_not_rebroadcast_and_hide_a_drift(tmp_path):
    # Class 4 of issue 10: the callback broadcast at every fit() (and fit_elastic runs one
    # per epoch), silently re-synchronising ranks that had diverged.  Once per instance,
    # as Horovod's: the drift stays visible.
    job = run_job("tf_scenarios.py", "second_fit_same_broadcast", np=2, tmp_path=tmp_path)
    results = job.results
    assert results[0]["first"] == results[1]["first"]  # the first fit did broadcast
    assert results[0]["second"] != results[1]["second"]


def test_an_anomaly_during_fit_is_in_the_event_log_and_repaired(tmp_path):
    # An agreement on a gradient allreduce answers with another agreement's value on
    # both ranks: the step is redone, the ranks still agree, the event log says it.
    job = run_job("tf_scenarios.py", "anomaly_in_fit", tmp_path, np=2, tmp_path=tmp_path,
                  env={"ELASTIC_HVD_STRICT": "0"}, timeout=300)
    results = list(job.results.values())
    assert all(r["forced"] == 1 and r["anomalies"] == 1 for r in results), job.output[-3000:]
    assert len({r["weights"] for r in results}) == 1
    for r in results:
        [record] = r["logged"]
        assert record["anomaly"] == "the agreed value belongs to another agreement"
        assert record["call"] == "HorovodGradients" and record["epoch"] >= 1
