"""op=Adasum (elastic_hvd/core/adasum.py) against a plain numpy reference written here:
2, 3 and 4 ranks, single and fused calls, three dtypes, scale factors, and a rank
SIGKILLed in the middle of an Adasum allreduce (the survivors' result is the Adasum
of the survivors' inputs)."""

import types

import numpy as np
import pytest

from mpijob import run_job

pytestmark = pytest.mark.multirank


def _tensor(original_id, k, shape, dtype):
    """A rank's tensor ``k``, as tests/workers/adasum.py makes it."""
    rng = np.random.default_rng(1000 * (original_id + 1) + k)
    return rng.normal(size=shape).astype(dtype)


#: What the worker reduces (tests/workers/adasum.py: the same values).
worker = types.SimpleNamespace(tensor=_tensor, SHAPES=[(3, 5), (7,), (1,), (2, 2, 3)],
                               KILL_COUNT=1 << 20)


def pair(a, b):
    """The Adasum paper's rule for two vectors, in float64 (a: the lower ranks')."""
    dot, aa, bb = float(a @ b), float(a @ a), float(b @ b)
    return (1 - dot / (2 * aa)) * a + (1 - dot / (2 * bb)) * b


def reference(vectors):
    """Adasum of ``vectors`` (in rank order) as docs/horovod.md defines it: a power of
    two splits in halves, recursively, and combines the halves' results (Horovod's
    tree); otherwise the ranks above the largest power of two p first combine with
    rank - p."""
    n = len(vectors)
    if n == 1:
        return vectors[0]
    p = 1 << (n.bit_length() - 1)
    if p < n:
        return reference([pair(vectors[j], vectors[p + j]) if p + j < n else vectors[j]
                          for j in range(p)])
    return pair(reference(vectors[:n // 2]), reference(vectors[n // 2:]))


TOLERANCE = {"float16": 5e-3, "float32": 1e-5, "float64": 1e-12}


def close(got, want, dtype):
    scale = max(1.0, float(np.abs(want).max()))
    return float(np.abs(got.astype(np.float64) - want).max()) <= TOLERANCE[dtype] * scale


def load(out, name):
    return np.load(out / name)


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_adasum_matches_the_reference(tmp_path, np_):
    job = run_job("adasum.py", "numerics", np=np_, tmp_path=tmp_path, timeout=90)
    assert sorted(job.results) == list(range(np_)), job.output[-3000:]
    out = tmp_path / "out"
    for dtype in ("float16", "float32", "float64"):
        inputs = [worker.tensor(r, 0, (4, 6), dtype).astype(np.float64).reshape(-1)
                  for r in range(np_)]
        single = reference(inputs).reshape(4, 6)
        scaled = 3.0 * reference([0.5 * x for x in inputs]).reshape(4, 6)
        fused = [reference([worker.tensor(r, 1 + k, shape, dtype).astype(np.float64).reshape(-1)
                            for r in range(np_)]).reshape(shape)
                 for k, shape in enumerate(worker.SHAPES)]
        for rank in range(np_):
            got = load(out, f"single_{dtype}_{rank}.npy")
            assert got.dtype == dtype and close(got, single, dtype), (rank, dtype, got, single)
            assert close(load(out, f"scaled_{dtype}_{rank}.npy"), scaled, dtype), (rank, dtype)
            for k, want in enumerate(fused):  # each tensor of a fused call by its own dots
                assert close(load(out, f"fused{k}_{dtype}_{rank}.npy"), want, dtype), \
                    (rank, dtype, k)
    for result in job.results.values():
        assert [name for name, _ in result["refused"]] == ["reducescatter", "int32"], result
        assert "op=Adasum reduces only in allreduce" in result["refused"][0][1]
        assert "float16, float32 and float64" in result["refused"][1][1]


def test_rank_killed_inside_adasum_survivors_reduce_among_themselves(tmp_path):
    # Collective 3 is an Adasum allreduce of 4 MiB; rank 1 is SIGKILLed 5 ms into it.
    # The survivors (3: not a power of two) redo it; each one's result is the Adasum
    # of the survivors' inputs, in their new order [0, 2, 3].
    job = run_job("adasum.py", "kill", "3", np=4, faults="rank=1,coll=3,delay=0.005",
                  tmp_path=tmp_path, timeout=90)
    assert sorted(job.results) == [0, 2, 3], job.output[-4000:]
    want = reference([worker.tensor(i, 0, (worker.KILL_COUNT,), np.float32).astype(np.float64)
                      for i in (0, 2, 3)])
    results = [load(tmp_path / "out", f"kill_{i}.npy") for i in (0, 2, 3)]
    for r in job.results.values():
        assert r["ids"] == [0, 2, 3]
        [event] = r["events"]
        assert (event["old_size"], event["new_size"], event["lost"]) == (4, 3, [1])
        assert r["changed_in"] == [3], "the kill did not land inside the Adasum call"
    assert all(np.array_equal(results[0], other) for other in results[1:]), \
        "survivors disagree"
    assert close(results[0], want, "float32")


def _tf_tensor(rank, k, shape):
    """As tests/workers/tf_adasum.py makes it."""
    return np.random.default_rng(50 * (rank + 1) + k).normal(size=shape).astype(np.float32)


def test_tensorflow_adasum_and_the_keras_gradient_helpers(tmp_path):
    n = 2
    job = run_job("tf_adasum.py", np=n, tmp_path=tmp_path, timeout=150)
    assert sorted(job.results) == list(range(n)), job.output[-3000:]

    def want(k, shape):
        return reference([_tf_tensor(r, k, shape).astype(np.float64).reshape(-1)
                          for r in range(n)]).reshape(shape)

    total = n * (n + 1) / 2  # Sum over ranks of (rank + 1)
    for rank, res in job.results.items():
        for key in ("allreduce", "allreduce_fn"):
            assert close(np.array(res[key]), want(0, (3, 4)), "float32"), (rank, key)
        assert close(np.array(res["grouped"][0]), want(1, (5,)), "float32")
        assert close(np.array(res["grouped"][1]), want(2, (2, 3)), "float32")
        assert close(np.array(res["tape"]), want(3, (6,)), "float32")
        assert close(np.array(res["optimizer"]), -want(3, (6,)), "float32")
        assert [name for name, _ in res["refusals"]] == \
            ["sparse", "average_aggregated", "reducescatter"], res["refusals"]
        assert "does not currently support sparse tensors" in res["refusals"][0][1]
        assert "average_aggregated_gradients" in res["refusals"][1][1]
        # _compute_gradients: reduced once (a second Sum would multiply by n), the
        # local variable's gradient divided by the size once
        assert res["computed"] == [[total] * 2, [(rank + 1) / n] * 2]
        assert res["applied"] == [[-total] * 2, [-(rank + 1) / n] * 2]
        assert res["helper_none"]
        assert res["passes"] == [
            {"grad": [rank + 1.0] * 2, "u": [0.0, 0.0], "counter": 1, "iterations": 1},
            {"grad": [2 * total] * 2, "u": [-2 * total] * 2, "counter": 0, "iterations": 2},
            {"grad": [rank + 1.0] * 2, "u": [-2 * total] * 2, "counter": 1, "iterations": 3},
        ], res["passes"]
