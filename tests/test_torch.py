"""The PyTorch front end (elastic_hvd.torch) in real jobs, launched as a Horovod user
launches an unchanged script (``elastic-hvd-run --as-horovod``; ``import horovod.torch``).

* every collective's values, gradients and the broadcasts of a model and its optimizer
  state on 2 ranks, and DistributedOptimizer's reduced gradients (backward passes,
  groups, sparse, fp16, predivide) against the average of every rank's local ones;
* training on 3 ranks, one SIGKILLed from outside at a moment no hook chose (rank 1 under
  hvd.elastic.run with a TorchState and an ElasticSampler, then rank 0 in a plain loop):
  the survivors finish every step, their parameters are identical after every
  step, the two counters of tests/workers/torch_job.py say that every committed step
  was applied once with one membership, and the launcher exits with status 0.
"""

import os
import random
import signal
import time

import pytest

pytest.importorskip("torch")

from mpijob import (assert_same_weights_every_step, job_processes, parent_of,  # noqa: E402
                    proc_entries, run_job, until)

pytestmark = pytest.mark.multirank
AS_HOROVOD = ("--as-horovod",)


def test_collectives_values_and_gradients_on_two_ranks(tmp_path):
    job = run_job("torch_job.py", "collectives", np=2, tmp_path=tmp_path, timeout=240,
                  launcher=AS_HOROVOD)
    assert sorted(job.results) == [0, 1], job.output[-3000:]
    got = [job.results[r]["got"] for r in (0, 1)]
    for r, g in enumerate(got):
        assert g["average"] == [[1.5] * 3] * 2 and g["sum"] == [[3.0] * 3] * 2
        assert g["max_int"] == [1, 10]
        assert g["scaled"] == [[3.0] * 3] * 2  # (1*2 + 2*2) * 0.5
        for name in ("half", "bf16", "fp16_compressed"):
            assert g[name] == [[3.0] * 3] * 2, name
        assert g["strided"] == [[2 * c + 1 + 8 * k for k in range(3)] for c in range(4)]
        assert g["inplace"] == [[[3.0] * 3] * 2, True]
        assert g["async"] == [True, [[3.0] * 3] * 2]
        assert g["grouped"] == [[[3.0] * 3] * 2, [3.0] * 3, "torch.float64"]
        assert g["grouped_inplace"] == [[[3.0] * 3] * 2, [[6.0] * 3] * 2]
        assert g["allgather"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert g["grouped_allgather"] == [[0.0, 1.0], [[0.0, 0.0], [10.0, 10.0]]]
        assert g["broadcast"] == g["broadcast_"] == [1.0, 1.0]
        assert g["broadcast_object"] == {"from": 1}
        assert g["allgather_object"] == [["r", 0], ["r", 1]]
        assert g["join"] in (0, 1) and g["join"] == got[0]["join"]
        # Horovod's gradients: allreduce's is the allreduce of the gradients; allgather's
        # the average of every rank's, this rank's rows; broadcast's the average at the root
        assert g["allreduce_grad"] == [2.0 * (r + 1), 4.0 * (r + 1)]
        assert g["allgather_grad"] == [1.0] * (r + 1)
        assert g["broadcast_grad"] == ([1.0, 1.0] if r == 0 else [0.0, 0.0])
        # rank 0's parameters and buffers (BatchNorm's int64 count), optimizer state and options
        assert g["params"] == got[0]["params"] and g["params"]["1.num_batches_tracked"] == 1
        assert g["momentum"] == got[0]["momentum"] and g["lr"] == 0.1
        assert g["zero_copy"] is True
        checks = g["optimizer"]  # DistributedOptimizer's gradients == every rank's average
        for case in ("plain", "passes2", "groups2", "sparse", "sparse_as_dense", "fp16",
                     "predivide"):
            assert checks[case] is True, (case, checks)
        assert checks["zero_grad_error"].startswith("optimizer.zero_grad() was called after")
        assert checks["passes_error"].startswith("Gradients were computed more than")
        assert g["sync_bn"] == {"output": True, "input_grad": True, "weight_grad": True,
                                "running": True}, g["sync_bn"]
    assert got[0]["alltoall"] == [[0.0, 10.0], [1, 1]]
    assert got[1]["alltoall"] == [[1.0, 2.0, 11.0, 12.0], [2, 2]]
    assert got[0]["alltoall_even"] == [0.0, 1.0, 10.0, 11.0]
    assert got[1]["alltoall_even"] == [2.0, 3.0, 12.0, 13.0]
    assert got[0]["reducescatter"] == [[0.0, 3.0], [6.0, 9.0]]
    assert got[1]["reducescatter"] == [[12.0, 15.0]]
    assert "`import horovod` resolves to elastic_hvd" in job.output


def _world_ranks(marker):
    """``{MPI_COMM_WORLD rank: pid}`` of the job's Python ranks (run as_horovod); not
    their DataLoader workers, forked children with the same command line and environment."""
    found = {}
    for pid in job_processes(marker):
        if b"elastic_hvd.runner.as_horovod" not in proc_entries(pid, "cmdline"):
            continue
        rank = [e for e in proc_entries(pid, "environ") if e.startswith(b"OMPI_COMM_WORLD_RANK=")]
        if rank:
            found[pid] = int(rank[0].split(b"=")[1])
    ranks = {}
    for pid, rank in found.items():
        try:
            if parent_of(pid) not in found:
                ranks[rank] = pid
        except ProcessLookupError:
            pass
    return ranks


def _kill_after(victim, step, seed):
    """A watcher: once some rank has committed ``step`` steps, SIGKILL world rank
    ``victim`` a random moment later, by PID."""
    def watch(out, marker):
        def reached():
            for name in os.listdir(out):
                if name.startswith("steps") and name.endswith(".jsonl"):
                    with open(out / name) as f:
                        if sum(1 for _ in f) >= step:
                            return True
            return False
        until(reached, 200, f"a rank committed {step} steps")
        pids = until(lambda: _world_ranks(marker), 10, "the ranks' processes found")
        time.sleep(random.Random(seed).uniform(0.0, 0.1))
        os.kill(pids[victim], signal.SIGKILL)
        (out / "victim").write_text(str(victim))
    return watch


STEPS = 60


@pytest.mark.parametrize("victim,script", [(1, "elastic"), (0, "train")],
                         ids=["rank1-elastic", "rank0-plain"])
def test_training_survives_a_rank_killed_from_outside(tmp_path, victim, script):
    """``train``: a plain loop of STEPS steps; ``elastic``: hvd.elastic.run with a
    TorchState and an ElasticSampler, 3 epochs of 20 batches on 3 ranks."""
    args = ("train", STEPS) if script == "train" else ("elastic", 3)
    job = run_job("torch_job.py", *args, np=3, tmp_path=tmp_path, timeout=300,
                  launcher=AS_HOROVOD, watcher=_kill_after(victim, 15, seed=victim))
    out = job.out_dir
    assert (out / "victim").exists(), job.output[-3000:]
    survivors = sorted(job.results)
    assert survivors == sorted({0, 1, 2} - {victim}), job.output[-3000:]
    assert_same_weights_every_step(out)
    steps = job.results[survivors[0]]["steps"]
    for i in survivors:
        r = job.results[i]
        assert r["steps"] == steps == len(r["sizes"]) and r["size"] == 2
        assert r["sizes"][0] == 3 and r["sizes"][-1] == 2
    if script == "train":
        assert steps == STEPS
        # nothing re-shares a plain loop's data: the torch front end's advice, not Keras's
        assert "(hvd.ElasticDataLoader re-shares the data (every sample once);" \
            in job.output and "hvd.fit" not in job.output, job.output[-3000:]
    else:  # the epoch the loss hit keeps its 20 batches; later ones are split over 2 ranks
        per_epoch = job.results[survivors[0]]["batches_per_epoch"]
        assert per_epoch[0] == 20 and per_epoch[-1] == 30 and steps == sum(per_epoch), per_epoch
        assert "ElasticSampler splits the next epoch over 2 ranks" in job.output
    a, b = job.results[survivors[0]]["counter_a"], job.results[survivors[0]]["counter_b"]
    assert a == b, "the two counters' collectives saw different memberships in a step"
    for i in survivors:
        assert a[i] == -steps, (i, a)
    # the lost rank was in every step before it was lost and in none after
    lost_in = -a[victim]
    assert 15 <= lost_in < steps and lost_in == int(lost_in), a
    sizes = job.results[survivors[0]]["sizes"]
    assert sizes.count(3) in (lost_in, lost_in - 1, lost_in + 1), (sizes, lost_in)
    assert "lost" in job.output  # the one-line announcement of the change
    # The learning rate follows the live size: the body's (lr_policy "linear") was scaled
    # by 2/3 at the loss, the counters' (a group's own "lr_policy": "none") stayed.
    for i in survivors:
        assert job.results[i]["lrs"] == [pytest.approx(0.01 * 2 / 3), 1.0], job.results[i]
    assert "the learning rate is scaled by 0.667 (linear) at the optimizer's next update" \
        in job.output, job.output[-3000:]


def test_elastic_data_loader_trains_every_sample_once_through_a_kill(tmp_path):
    """ElasticDataLoader with 2 workers a rank (prefetching), 121 samples in steps of 3x2
    (the last step leaves two ranks a weightless filler), rank 2 SIGKILLed from outside
    in the first epoch: every weight of the oracle (tests/workers/torch_job.py) is -1 after
    the first epoch and -2 after the second, on every survivor."""
    job = run_job("torch_job.py", "exactly_once", 2, 121, np=3, tmp_path=tmp_path, timeout=300,
                  launcher=AS_HOROVOD, watcher=_kill_after(2, 8, seed=2))
    out = job.out_dir
    assert (out / "victim").exists(), job.output[-3000:]
    assert sorted(job.results) == [0, 1], job.output[-3000:]
    assert_same_weights_every_step(out)
    for r in job.results.values():
        assert r["after_epoch"] == [[-1.0], [-2.0]], r["after_epoch"]
        assert r["sizes"][0] == 3 and r["sizes"][-1] == 2
        # the change made the draws differ from what was loading: thrown away, reloaded
        assert r["discarded"] > 0 and r["loaders_started"] >= 3, r
    assert "raised an uncaught exception" not in job.output  # the kill, not a worker's loss
    assert "the samples the lost rank had not trained go back into the epoch" in job.output
