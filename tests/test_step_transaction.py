"""One optimizer step is one transaction (issue 10, class 2), checked by an oracle.

``tests/workers/step_oracle.py`` trains counters -- one weight per sample id,
gradients summed, SGD with lr 1 -- so after E epochs every weight must be
exactly -E whatever died: the oracle reads what the model applied, not what the
sampler believes.  Each case makes a step's gradients travel in several
collectives (two dtypes, ``num_groups``, a fusion threshold below one counter,
``IndexedSlices`` gathers next to a dense buffer, ``backward_passes_per_step``),
and a rank dies between two of them or inside one -- or is SIGKILLed from
outside at a random moment.  Weights are compared across ranks after every batch.
"""

import os
import random
import signal
import time

import pytest

from mpijob import assert_same_weights_every_step, run_job, until

pytestmark = pytest.mark.multirank

EPOCHS = 2
#: case -> collectives per optimizer step (see CASES in the worker)
#: (fusion: a step's 3 buffers of one dtype are one call of 3 MPI_Allreduces)
PER_STEP = {"mixed_dtypes": 2, "num_groups": 3, "fusion": 1, "sparse": 3, "accumulate": 1}
ENV = {"fusion": {"HOROVOD_FUSION_THRESHOLD": "100"}}


def between(case):  # rank 2 dies as step 2's second collective starts: the first one is agreed
    return f"rank=2,coll={PER_STEP[case] + 2}"


def inside(case):  # rank 2 dies after step 2's last transfer, before its agreement
    return f"rank=2,coll={2 * PER_STEP[case]},phase=after"


SCENARIOS = {
    "mixed_dtypes-between": ("mixed_dtypes", between("mixed_dtypes")),
    "num_groups-between": ("num_groups", between("num_groups")),
    "num_groups-inside": ("num_groups", inside("num_groups")),
    "fusion-inside": ("fusion", inside("fusion")),
    "sparse-between_values_and_indices": ("sparse", between("sparse")),
    "sparse-inside": ("sparse", inside("sparse")),
    # backward_passes_per_step=2: dies after accumulating pass 3, before pass 4 reduces
    "accumulate-between_passes": ("accumulate", "rank=2,step=4"),
    "accumulate-inside": ("accumulate", "rank=2,coll=2,phase=after"),
}


def check(job, out, lost, epochs=EPOCHS):
    results = job.results
    assert sorted(results) == sorted(set(range(4)) - set(lost)), job.output[-4000:]
    for rank, result in results.items():
        assert result["lost"] == lost
        for k, counter in enumerate(result["counters"]):
            wrong = {i: c for i, c in enumerate(counter) if c != -epochs}
            assert not wrong, (f"rank {rank}, counter {k}: sample id -> weight (must be "
                               f"{-epochs}: trained once per epoch): {wrong}")
    assert_same_weights_every_step(out)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_rank_lost_within_a_multi_collective_step(tmp_path, scenario):
    case, faults = SCENARIOS[scenario]
    job = run_job("step_oracle.py", case, EPOCHS, np=4, faults=faults, env=ENV.get(case),
                  tmp_path=tmp_path, timeout=240)
    check(job, tmp_path / "out", [2])


def kill_at_random(seed):
    """A watcher: once training runs, SIGKILL one random rank at a random moment."""
    def watch(out, _job):
        rng = random.Random(seed)
        victim = rng.randrange(4)
        until(lambda: any(p.stat().st_size for p in out.glob("steps*.jsonl")), 120,
              "training runs")
        time.sleep(rng.uniform(0.0, 1.5))
        pid = int((out / f"pid{victim}").read_text())
        os.kill(pid, signal.SIGKILL)
        (out / "victim").write_text(str(victim))
    return watch


@pytest.mark.parametrize("case,seed", [pytest.param("sparse", 1, marks=pytest.mark.check),
                                       ("num_groups", 2), ("fusion", 3)])
def test_rank_killed_from_outside_at_a_random_moment(tmp_path, case, seed):
    # fusion: a step's 3 buffers are one call, one agreement at its end
    job = run_job("step_oracle.py", case, 3, np=4,
                  env={"TEST_STEP_SLEEP": "0.05", **ENV.get(case, {})},
                  tmp_path=tmp_path, timeout=240, watcher=kill_at_random(seed))
    out = tmp_path / "out"
    victim = int((out / "victim").read_text())
    check(job, out, [victim], epochs=3)
