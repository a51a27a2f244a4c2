"""Exactly once while batches are loaded ahead (issue 44).

First, in one process on simulated ranks (as tests/test_units.py's sampler tests):
the sampler's ``upcoming()`` guesses are the draws while the membership stays, and a
WorkAhead hands over only what was drawn when a rank is lost with batches in flight;
then ElasticData's other inputs in a one-rank job (``workers/input_rows.py``):
``from_dataset`` read by index (kept or spilled), ``map=``, ``validation_shard(load=)``.
Then on real 4-rank jobs:
``tests/workers/input_ahead.py`` trains ``hvd.fit`` on an ``ElasticData`` that keeps 4
batches loading in threads while each step trains, and changes the membership while
they are in flight: a rank SIGKILLed from outside at a random moment, a killed rank
replaced by a respawned process, a hot spare adopted in a killed rank's place.  The
oracle reads what the model applied (one weight per sample id, each committed step
subtracts 1 per sample trained): after epoch e every weight is -(e+1) -- every sample
trained exactly once per epoch, nothing twice, nothing lost -- and the weights agree
across ranks after every step.  The work-ahead's own counts show that it worked
(batches handed over from threads) and that the change met batches in flight (some
thrown away, to be drawn again by the new membership).
"""

import json
import os
import random
import signal
import time

import pytest

from elastic_hvd.core import process
from mpijob import assert_same_weights_every_step, job_ranks, run_job, run_process, until
from test_units import _Cluster

EPOCHS, N = 4, 96
SLOW = {"TEST_STEP_SLEEP": "0.1", "TEST_LOAD_SLEEP": "0.06"}


# -- one process: the sampler's guesses and the work-ahead, on simulated ranks ----------


@pytest.fixture
def cluster(request):
    """``cluster(size)``: simulated ranks sharing one membership and one real Session, the
    process runtime's while the test runs (tests/test_units.py's sampler tests)."""
    def make(size):
        made = _Cluster(size)
        old = process.use(process.Runtime(comm=made, session=made.session))
        request.addfinalizer(lambda: process.use(old))
        return made
    return make


def test_upcoming_is_what_the_next_draws_are_while_the_membership_stays(cluster):
    # 50 samples, 3 ranks x batch 4: 4 full steps, then 2 samples (rank 2 weightless).
    c = cluster(3)
    samplers = c.start(50, 4, seed=5)
    for s in samplers.values():
        s.start_epoch()
    guesses = {i: s.upcoming(10) for i, s in samplers.items()}
    assert {len(g) for g in guesses.values()} == {5}
    for step in range(5):
        drawn = c.draw()
        c.commit()
        for i in c.ids:
            assert [a.tolist() for a in drawn[i]] == [a.tolist() for a in guesses[i][step]]
    assert c.draw() == {0: None, 1: None, 2: None}
    assert all(s.upcoming(3) == [] for s in samplers.values())


def test_work_ahead_hands_over_only_what_was_drawn_when_a_rank_is_lost(cluster):
    # Each rank loads 3 batches ahead; rank 1 is lost during step 3 (before its commit).
    # Every batch handed over is the draw's own, the guesses for 3 ranks are thrown
    # away, and the committed batches hold every sample exactly once.
    from elastic_hvd.tensorflow.data import WorkAhead
    c = cluster(3)
    samplers = c.start(60, 2, seed=1)
    loads = []
    work = {i: WorkAhead(lambda ids, w, e: (ids.copy(), loads.append(ids.tolist())), 3, 1)
            for i in c.ids}
    for s in samplers.values():
        s.start_epoch()
    trained, step = [], 0
    while True:
        batches = {}
        for i in c.ids:
            work[i].plan(samplers[i].upcoming(4), 0)
            drawn = samplers[i].next_batch()
            if drawn is not None:
                ids, _ = work[i].take(*drawn, 0)
                assert ids.tolist() == drawn[0].tolist()
                batches[i] = drawn
        if not batches:
            break
        step += 1
        if step == 3:
            c.lose(1)
        c.commit()
        for i in c.ids:
            ids, weights = batches[i]
            trained += ids[weights > 0].tolist()
    assert sorted(trained) == list(range(60))
    assert work[0].discarded and work[2].discarded  # guesses for 3 ranks, in flight
    assert work[0].hits == step and work[0].misses == 0  # each step's batch came from a thread


def test_from_dataset_map_and_validation_read_what_they_should(tmp_path):
    # One process (a singleton job): from_dataset keeps a random-access dataset and
    # spills any other to a file, both read by index; map= and validation_shard(load=).
    job = run_process("input_rows.py", tmp_path=tmp_path, timeout=300)
    result = job.results[0]
    every, odd = list(range(70)), list(range(1, 70, 2))
    # only the element indices are held, not the elements
    assert result["random_access"] == {"epochs": [every, every], "arrays": [[70]], "count": 70}
    assert result["spilled"] == {"epochs": [odd, odd], "count": 35, "spill_file": True}
    assert result["map"]["epochs"] == [every, every]
    assert result["validation"]["batches"] == 2 * [list(range(k, min(k + 16, 70)))
                                                   for k in range(0, 70, 16)]


def epoch_weights(out):
    """{epoch: [weights after it, one list per rank that wrote it]}"""
    found = {}
    for path in out.glob("epochs*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            found.setdefault(record["epoch"], []).append(record["weights"])
    return found


def check(job, out, survivors, lost, gained=()):
    results = job.results
    assert sorted(results) == sorted(survivors), job.output[-4000:]
    for rank, result in results.items():
        assert sorted(result["lost"]) == sorted(lost), (rank, result)
        assert sorted(result["gained"]) == sorted(gained), (rank, result)
    weights = epoch_weights(out)
    assert sorted(weights) == list(range(EPOCHS)), sorted(weights)
    for epoch, copies in weights.items():
        for w in copies:
            wrong = {i: v for i, v in enumerate(w) if v != -(epoch + 1)}
            assert not wrong, (f"after epoch {epoch + 1}: sample id -> weight (must be "
                               f"{-(epoch + 1)}: trained once in each epoch): {wrong}")
    assert_same_weights_every_step(out)
    assert all(r["hits"] > r["misses"] for r in results.values()), results
    assert all(r["peak_bytes"] > 0 for r in results.values()), results


def kill_from_outside(seed, victim=None, after_steps=6, world_rank=None):
    """A watcher: once original rank 0 committed ``after_steps`` steps, SIGKILL original
    rank ``victim`` (or world rank ``world_rank``, found through the job's marker) at a
    random moment of a step; writes the victim's id to ``victim``."""
    def watch(out, marker):
        rng = random.Random(seed)
        path = out / "steps0.jsonl"
        until(lambda: path.exists() and len(path.read_text().splitlines()) >= after_steps,
              240, f"original rank 0 committed {after_steps} steps")
        time.sleep(rng.uniform(0.0, 0.15))
        if world_rank is None:  # not 0: rank 0 writes steps0.jsonl, which this reads
            os.kill(int((out / f"pid{victim}").read_text()), signal.SIGKILL)
        else:
            os.kill(job_ranks(marker)[world_rank], signal.SIGKILL)
        (out / "victim").write_text(str(victim if world_rank is None else world_rank))
    return watch


@pytest.mark.multirank
@pytest.mark.parametrize("seed,victim", [pytest.param(1, 1, marks=pytest.mark.check), (2, 3)])
def test_rank_killed_from_outside_while_batches_are_in_flight(tmp_path, seed, victim):
    job = run_job("input_ahead.py", EPOCHS, np=4, env=SLOW, tmp_path=tmp_path, timeout=300,
                  watcher=kill_from_outside(seed, victim))
    out = tmp_path / "out"
    victim = int((out / "victim").read_text())
    check(job, out, set(range(4)) - {victim}, [victim])
    # the change met batches loaded for the old membership: thrown away, drawn again
    assert any(r["discarded"] for r in job.results.values()), job.results


@pytest.mark.multirank
def test_respawned_rank_joins_while_batches_are_in_flight(tmp_path):
    # Rank 2 dies at step 5; its replacement (id 4) is adopted at a step boundary while
    # the survivors hold batches loaded for three ranks.  The survivors slow down while
    # they are 3 so that the replacement (TF import, compile) arrives before the end.
    job = run_job("input_ahead.py", EPOCHS, np=4, faults="rank=2,step=5",
                  launcher=["--respawn"], env=dict(SLOW, TEST_SLOW_UNTIL_SIZE="4"),
                  tmp_path=tmp_path, timeout=300)
    check(job, tmp_path / "out", [0, 1, 3, 4], [2], [4])
    assert "no growth point" not in job.output


@pytest.mark.multirank
def test_hot_spare_adopted_while_batches_are_in_flight(tmp_path):
    # World rank 4 waits as a hot spare; world rank 2 is SIGKILLed from outside; the
    # spare takes its place at a step boundary, batches for 3 ranks in flight.
    job = run_job("input_ahead.py", EPOCHS, np=4, launcher=["--spares", "1"],
                  env=dict(SLOW, TEST_SLOW_UNTIL_SIZE="4"), tmp_path=tmp_path, timeout=300,
                  watcher=kill_from_outside(3, world_rank=2))
    check(job, tmp_path / "out", [0, 1, 3, 4], [2], [4])
    assert "no growth point" not in job.output
