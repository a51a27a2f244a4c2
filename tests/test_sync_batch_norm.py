"""hvd.SyncBatchNormalization against plain BatchNormalization on the joint batch."""

import importlib.metadata

import pytest

from mpijob import run_job

pytestmark = pytest.mark.multirank

TOL = 1e-5  # relative to the reference's largest value, where that is over 1
KERAS_MAJOR = int(importlib.metadata.version("keras").split(".")[0])


def _env(flavour):
    if flavour == "tf_keras" and KERAS_MAJOR < 3:
        pytest.skip("TF < 2.16: tf.keras is Keras 2 already (the 'default' case)")
    return {"TF_USE_LEGACY_KERAS": "1"} if flavour == "tf_keras" else {}


@pytest.mark.parametrize("flavour", ["default", "tf_keras"])
def test_uneven_batches_match_the_joint_batch_eager_and_in_a_function(tmp_path, flavour):
    job = run_job("sync_bn.py", "equivalence", 3, 5, np=2, tmp_path=tmp_path, timeout=300,
                  env=_env(flavour))
    assert sorted(job.results) == [0, 1], job.output[-3000:]
    for rank, result in job.results.items():
        for mode in ("eager", "function"):
            r = result[mode]
            for key in ("y", "dx", "dgamma", "dbeta", "dgamma_sum", "moving_mean",
                        "moving_variance", "inference", "inference_kept_stats"):
                assert r[key] < TOL, f"rank {rank} {mode} {key}: {r[key]}"
            assert r["moved"] > 0.5 and r["y_scale"] > 0.5 and r["dx_scale"] > 1e-3, r
    for mode in ("eager", "function"):
        assert job.results[0][mode]["stats"] == job.results[1][mode]["stats"]


@pytest.mark.parametrize("flavour", ["default", "tf_keras"])
def test_model_fit_matches_one_process_on_the_joint_batch(tmp_path, flavour):
    job = run_job("sync_bn.py", "fit", "4,4", 5, np=2, tmp_path=tmp_path, timeout=300,
                  env=_env(flavour))
    assert sorted(job.results) == [0, 1], job.output[-3000:]
    assert job.results[0]["weights"] == job.results[1]["weights"]
    for result in job.results.values():
        assert max(result["diffs"].values()) < TOL, result["diffs"]
        assert result["moved"] > 0.5
        assert result["layer_class"] == result["round_trip_class"] == "SyncBatchNormalization"
        assert result["momentum"] == 0.5
        assert result["base"].startswith("tf_keras" if flavour == "tf_keras" else "keras")


@pytest.mark.parametrize("phase", ["before", "after"])
def test_a_rank_killed_in_its_allreduce_leaves_the_survivors_statistics(tmp_path, phase):
    # Rank 2 (4 samples) is SIGKILLed inside the forward pass's statistics allreduce.
    job = run_job("sync_bn.py", "killed", phase, 3, 5, 4, np=3, tmp_path=tmp_path, timeout=300)
    assert sorted(job.results) == [0, 1], job.output[-3000:]
    for rank, r in job.results.items():
        assert r["size"] == 2
        for key in ("y", "dx", "moving_mean", "moving_variance"):
            assert r[key] < TOL, f"rank {rank} {key}: {r[key]}"
    assert job.results[0]["stats"] == job.results[1]["stats"]


@pytest.mark.parametrize("fused", [True, None, False])
def test_the_fused_kernel_is_refused_as_by_horovod(fused):
    # horovod/tensorflow/sync_batch_norm.py refuses fused in (True, None): None lets
    # Keras 2 pick the fused kernel.  Keras 3 has none: there None is the unfused path.
    import elastic_hvd.tensorflow as hvd
    from elastic_hvd.tensorflow.sync_batch_norm import _KERAS3
    if fused or (fused is None and not _KERAS3):
        with pytest.raises(ValueError, match=f"fused={fused}"):
            hvd.SyncBatchNormalization(fused=fused)
    else:
        assert not hvd.SyncBatchNormalization(fused=fused).get_config().get("fused")
