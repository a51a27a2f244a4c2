"""Single-process unit tests: the pure parts (the sampler's schedule, the growth policy and
host parsing, reduction finishing and fusion packing), then the core's pieces (fault plans,
signature prediction, the launcher).

No MPI here.  Where a piece reads a communicator, a small stand-in gives it exactly
what it reads (ids, sizes, hosts); what happens when real ranks die is the business
of the multirank tests.  Only the gradient-group test imports TensorFlow.
"""

import ast
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

from elastic_hvd.core import collectives, config, faults, invitation, process, reducer, signals
from elastic_hvd.core.collectives import CollectivesMixin, even_splits
from elastic_hvd.core.membership import MembershipEvent
from elastic_hvd.core.ops import ReduceOp, Sum, check_op, mpi_op, mpi_ops
from elastic_hvd.core.session import Session
from elastic_hvd.core.signature import SignaturePredictor
from elastic_hvd.core.stopped_peers import StoppedPeers, state_of
from elastic_hvd.growth_policy import GrowthPolicy, parse_hosts, read_hostfile
from elastic_hvd.runner import command, launch, outcome, relaunch
from elastic_hvd.sharding import ElasticSampler


# -- the sampler's schedule ------------------------------------------------------------


class _Rank:
    """What ElasticSampler reads of its communicator, as one simulated rank sees it."""

    def __init__(self, cluster, original_id):
        self._cluster, self.original_id = cluster, original_id

    @property
    def ids(self):
        return self._cluster.ids

    @property
    def size(self):
        return len(self._cluster.ids)


class _Cluster:
    """Simulated ranks in one process, one sampler each, sharing one agreed membership
    (``ids``, original ids in rank order) and one real Session as the commit point."""

    def __init__(self, size):
        self.ids = list(range(size))
        self.session = Session(self)
        self.samplers = {}

    def start(self, num_samples, batch_size, **kwargs):
        self.samplers = {i: ElasticSampler(_Rank(self, i), num_samples, batch_size, **kwargs)
                         for i in self.ids}
        return self.samplers

    def draw(self):
        """Every live rank draws its next batch: {original id: (ids, weights) or None}."""
        return {i: self.samplers[i].next_batch() for i in self.ids}

    def commit(self):
        """The step commits through the public path: the session names ``ids``."""
        self.session.commit()

    def lose(self, original_id):
        self.ids = [i for i in self.ids if i != original_id]


@pytest.fixture
def cluster(request):
    """``cluster(size)``: a _Cluster whose Session ``runtime.session()`` returns.

    ElasticSampler registers with the session that ``init()`` creates; without MPI
    there is no init(), so the test's process runtime is one of its own (replaced back
    after the test)."""
    def make(size):
        made = _Cluster(size)
        old = process.use(process.Runtime(comm=made, session=made.session))
        request.addfinalizer(lambda: process.use(old))
        return made
    return make


def _ids(batches):
    """{original id: sample ids as a list}, dropping weights."""
    return {i: b[0].tolist() for i, b in batches.items()}


def test_sampler_splits_each_step_over_the_ranks_in_rank_order(cluster):
    # 23 samples, 3 ranks x batch 4: a full step of 12, then 11 split 4, 4, 3.
    c = cluster(3)
    samplers = c.start(23, 4, shuffle=False)
    for s in samplers.values():
        s.start_epoch()
    assert [s.steps_left() for s in samplers.values()] == [2, 2, 2]
    first = c.draw()
    c.commit()
    assert _ids(first) == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7], 2: [8, 9, 10, 11]}
    second = c.draw()
    c.commit()
    assert _ids(second) == {0: [12, 13, 14, 15], 1: [16, 17, 18, 19], 2: [20, 21, 22]}
    assert all(b[1].dtype == np.float32 and (b[1] == 1).all() for b in second.values())
    assert c.draw() == {0: None, 1: None, 2: None}  # the epoch ends on the same step everywhere
    assert [s.step for s in samplers.values()] == [2, 2, 2]


def test_sampler_trains_every_sample_once_per_epoch_in_the_seeded_order(cluster):
    # 50 = 4 steps of 3 x 4, then 2 samples: rank 2's last one is weightless, not trained.
    c = cluster(3)
    samplers = c.start(50, 4, seed=7)
    for epoch in (0, 1):
        for s in samplers.values():
            s.start_epoch()
        drawn = []
        while (batches := c.draw())[0] is not None:
            c.commit()
            for i in c.ids:
                ids, weights = batches[i]
                drawn += ids[weights > 0].tolist()
        # Rank order within a step, steps in order: exactly the epoch's permutation.
        assert drawn == np.random.default_rng([7, epoch]).permutation(50).tolist()
    assert [s.requeued for s in samplers.values()] == [0, 0, 0]


def test_sampler_requeues_every_slice_of_a_rank_missing_from_the_commit(cluster):
    # Two draws before one commit (backward_passes_per_step=2); rank 1 is lost before
    # the step commits, so both of its slices go back at the end of the queue.
    c = cluster(3)
    samplers = c.start(12, 1, shuffle=False)
    for s in samplers.values():
        s.start_epoch()
    assert _ids(c.draw()) == {0: [0], 1: [1], 2: [2]}
    assert _ids(c.draw()) == {0: [3], 1: [4], 2: [5]}
    assert samplers[0].uncommitted()
    c.lose(1)
    c.commit()
    survivors = [samplers[0], samplers[2]]
    assert [s.requeued for s in survivors] == [2, 2]
    assert [list(s.queue) for s in survivors] == [[6, 7, 8, 9, 10, 11, 1, 4]] * 2
    assert not samplers[0].uncommitted()
    assert [s.steps_left() for s in survivors] == [4, 4]  # 8 samples, now 2 ranks x 1
    trained = {0: [0, 3], 2: [2, 5]}
    while (batches := c.draw())[0] is not None:
        c.commit()
        for i in c.ids:
            trained[i] += batches[i][0].tolist()
    assert trained == {0: [0, 3, 6, 8, 10, 1], 2: [2, 5, 7, 9, 11, 4]}
    assert sorted(trained[0] + trained[2]) == list(range(12))


def test_sampler_gives_ranks_without_a_sample_one_weightless_sample(cluster):
    # 6 samples over 4 ranks x batch 1: the second step has 2 samples for 4 ranks.
    c = cluster(4)
    samplers = c.start(6, 1, shuffle=False)
    for s in samplers.values():
        s.start_epoch()
    c.draw()
    c.commit()
    assert samplers[3].steps_left() == 1
    last = c.draw()
    assert _ids(last) == {0: [4], 1: [5], 2: [4], 3: [4]}
    assert [last[i][1].tolist() for i in c.ids] == [[1.0], [1.0], [0.0], [0.0]]
    c.lose(3)  # a rank holding only a weightless sample: nothing of it to redo
    c.commit()
    assert [s.requeued for s in samplers.values()] == [0, 0, 0, 0]
    assert c.draw() == {0: None, 1: None, 2: None}


def test_sampler_state_resumes_the_epoch_at_any_size(cluster):
    c = cluster(2)
    samplers = c.start(10, 2, seed=5)
    for s in samplers.values():
        s.start_epoch()
    order = np.random.default_rng([5, 0]).permutation(10).tolist()
    c.draw()
    c.commit()
    c.draw()  # drawn, never committed: not trained, so saved as still to do
    states = [s.state() for s in samplers.values()]
    assert states[0] == states[1] == {
        "epoch": 0, "step": 2, "queue": order[8:] + order[4:6] + order[6:8]}

    # A restart with one rank continues that epoch, then starts the next one afresh.
    c = cluster(1)
    [restarted] = c.start(10, 2, seed=5).values()
    restarted.load_state(states[0])
    restarted.start_epoch()
    assert (restarted.epoch, restarted.step) == (0, 2)
    rest = []
    while (batches := c.draw())[0] is not None:
        c.commit()
        rest += batches[0][0].tolist()
    assert rest == order[8:] + order[4:8]
    restarted.start_epoch()
    assert (restarted.epoch, restarted.step) == (1, 0)
    assert list(restarted.queue) == np.random.default_rng([5, 1]).permutation(10).tolist()


def test_sampler_loaded_state_is_ignored_by_another_epoch(cluster):
    c = cluster(1)
    [s] = c.start(6, 2, shuffle=False).values()
    s.load_state({"epoch": 0, "queue": [5], "step": 3})
    s.start_epoch(4)
    assert (s.epoch, s.step, list(s.queue)) == (4, 0, [0, 1, 2, 3, 4, 5])


# -- growth policy and host parsing ----------------------------------------------------


def test_parse_hosts_sums_slots_and_names_localhost_as_mpi_knows_it():
    text = "a:2\n# a comment\n\nb   # slots default to 1\nlocalhost:3\n127.0.0.1\na:1\n"
    assert parse_hosts(text) == {"a": 3, "b": 1, socket.gethostname(): 4}
    assert parse_hosts("") == {}


def test_read_hostfile_takes_open_mpi_and_discovery_formats(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("a slots=4\nb slots=2  # spare\nc:3\nd\n")
    assert read_hostfile(str(path)) == {"a": 4, "b": 2, "c": 3, "d": 1}


def test_growth_policy_from_env_defaults_and_when_it_is_active():
    policy = GrowthPolicy.from_env({})
    assert (policy.respawn, policy.max_np, policy.discover) == (False, None, None)
    assert (policy.interval, policy.check_every) == (5.0, 10)
    assert not policy
    assert GrowthPolicy.from_env({"ELASTIC_HVD_RESPAWN": "1"})
    # A ceiling without hosts to grow onto grows nothing.
    assert not GrowthPolicy.from_env({"ELASTIC_HVD_MAX_NP": "8"})


def test_growth_policy_from_env_discovers_hosts_afresh_each_time(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\nb slots=1\n")
    env = {"ELASTIC_HVD_MAX_NP": "8", "ELASTIC_HVD_HOSTFILE": str(hostfile),
           "ELASTIC_HVD_DISCOVERY_INTERVAL": "0.5", "ELASTIC_HVD_DISCOVERY_CHECK_EVERY": "3"}
    policy = GrowthPolicy.from_env(env)
    assert policy and (policy.max_np, policy.interval, policy.check_every) == (8, 0.5, 3)
    assert policy.discover() == {"a": 2, "b": 1}
    hostfile.write_text("a slots=2\nb slots=1\nc slots=4\n")
    assert policy.discover() == {"a": 2, "b": 1, "c": 4}

    # A discovery script, when given, wins over the hostfile.
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho z:5\n")
    script.chmod(0o755)
    policy = GrowthPolicy.from_env({**env, "ELASTIC_HVD_HOST_DISCOVERY": str(script)})
    assert policy.discover() == {"z": 5}


class _GrowthComm:
    """What GrowthPolicy reads of the communicator and its join protocol (both: ``comm``
    is itself), scripted.

    ``hosts``: host of each live rank; ``where``: host of every original id, lost ones
    included; ``spawn_ok``: what spawn() answers; ``polls``: what each poll() of a
    pending join does ("adopt", "abandon", "lost": a rank of the job was lost meanwhile,
    which abandons it; none left: still waiting)."""

    joining = False
    rank = 0

    def __init__(self, hosts, initial_size, where=None, events=(), spawn_ok=False, polls=()):
        self.placed, self.initial_size = list(hosts), initial_size
        self.where, self.events = dict(where or {}), list(events)
        self.spawn_ok, self.polls = spawn_ok, list(polls)
        self.pending = False
        self.spawned = []  # (count, hosts) of each spawn()

    @property
    def comm(self):
        return self

    @property
    def size(self):
        return len(self.placed)

    @property
    def generation(self):
        return len(self.events)

    def hosts(self):
        return list(self.placed)

    def host_of(self, original_id):
        return self.where.get(original_id)

    def spawn(self, count, hosts):
        self.spawned.append((count, list(hosts)))
        self.pending = self.spawn_ok
        return self.spawn_ok

    def poll(self):
        if not self.pending or not self.polls:
            return None
        self.pending = False
        what = self.polls.pop(0)
        if what == "lost":
            self.events.append(MembershipEvent(2, 1, lost=(2,)))
        return MembershipEvent(1, 2, gained=(2,)) if what == "adopt" else None


def _lost_two():
    """Ranks 0 and 2 alive on host a; 1 (host b) lost, then 3 (host c)."""
    return _GrowthComm(["a", "a"], 4, where={0: "a", 1: "b", 2: "a", 3: "c"},
                       events=[MembershipEvent(4, 3, lost=(1,)), MembershipEvent(3, 2, lost=(3,))])


def test_growth_wants_lost_ranks_back_on_their_hosts_most_recent_first():
    assert GrowthPolicy(respawn=True).wanted(_lost_two()) == (2, ["c", "b"])
    assert GrowthPolicy(respawn=True, max_np=3).wanted(_lost_two()) == (1, ["c"])
    assert GrowthPolicy().wanted(_lost_two()) == (0, [])
    unknown = _lost_two()
    del unknown.where[3]  # no host known for it: Open MPI places that one
    assert GrowthPolicy(respawn=True).wanted(unknown) == (2, ["b"])


def test_growth_wants_free_discovered_slots_up_to_max_np():
    comm = _GrowthComm(["a", "a"], 2)
    policy = GrowthPolicy(max_np=5)
    policy.discovered = {"b": 2, "a": 3}
    assert policy.wanted(comm) == (3, ["a", "b", "b"])  # hosts in name order
    policy.max_np = 3
    assert policy.wanted(comm) == (1, ["a"])
    policy.max_np, policy.discovered = 5, {"a": 1}  # fewer slots than ranks: no shrinking
    assert policy.wanted(comm) == (0, [])


def test_growth_retries_a_failed_spawn_after_retry_steps_then_gives_up():
    comm = _lost_two()
    policy = GrowthPolicy(respawn=True, retry_steps=2, max_failures=2)
    tried = []
    for step in range(1, 9):
        before = len(comm.spawned)
        assert policy.step(comm) is None
        if len(comm.spawned) > before:
            tried.append(step)
    assert tried == [1, 3]
    assert comm.spawned == [(1, ["c"]), (1, ["c"])]  # one joiner per spawn
    assert (policy.failures, policy.next_try) == (2, float("inf"))


def test_growth_counts_an_abandoned_join_as_a_failure_and_an_adoption_resets_the_count():
    comm = _lost_two()
    comm.spawn_ok, comm.polls = True, ["abandon", "adopt"]
    policy = GrowthPolicy(respawn=True, retry_steps=3)
    policy.step(comm)  # spawns
    policy.step(comm)  # its joiner never joins
    assert (policy.failures, policy.next_try) == (1, 4)
    policy.step(comm)
    assert len(comm.spawned) == 1  # waiting out retry_steps
    policy.step(comm)  # spawns again
    event = policy.step(comm)
    assert event is not None and event.gained == (2,)
    assert (policy.failures, len(comm.spawned)) == (0, 2)


def test_growth_does_not_count_a_join_that_a_loss_ended_and_says_when_it_stops(capsys):
    # Losses every ~15 s, each ending a join whose joiner needed ~11 s (the soak): none of
    # them is a failure of growth; three joiners that died on their own are, and then
    # rank 0 says that the job stops growing.
    comm = _lost_two()
    comm.spawn_ok, comm.polls = True, ["lost"] * 4 + ["abandon"] * 3
    policy = GrowthPolicy(respawn=True, retry_steps=1, max_failures=3)
    for _ in range(5):  # a spawn, then four steps at which a loss ended the join: each
        policy.step(comm)  # spawns again at once
    assert (policy.failures, len(comm.spawned)) == (0, 5)
    assert capsys.readouterr().err == ""
    for _ in range(20):
        policy.step(comm)
    assert (policy.failures, policy.next_try, len(comm.spawned)) == (3, float("inf"), 7)
    assert "3 tries in a row to start a process for the job failed; it stops growing and " \
           "trains on at 2 ranks" in capsys.readouterr().err


# -- reduction finishing ----------------------------------------------------------------


def test_check_op_and_its_mpi_operation():
    assert check_op(1) is ReduceOp.SUM and check_op(2) is ReduceOp.ADASUM
    mpi = types.SimpleNamespace(SUM="sum", MIN="min", MAX="max", PROD="prod")
    assert mpi_ops(mpi) == {ReduceOp.AVERAGE: "sum", ReduceOp.SUM: "sum",
                            ReduceOp.MIN: "min", ReduceOp.MAX: "max", ReduceOp.PRODUCT: "prod"}
    # Adasum is core.adasum's algorithm, no MPI operation: a collective other than
    # allreduce that asks for one says so
    with pytest.raises(NotImplementedError, match=r"op=Adasum reduces only in allreduce"):
        mpi_op(mpi, ReduceOp.ADASUM)


def test_process_sets_are_checked_as_horovod_checks_them(monkeypatch):
    # (process sets were refused until issue 45; tests/test_process_sets.py runs them)
    from elastic_hvd.core import process_set_api as ps
    with pytest.raises(ValueError, match="list of process ranks or an mpi4py Comm"):
        ps.ProcessSet([0.5])
    assert ps.ProcessSet(range(3, 0, -1)).ranks == [1, 2, 3]
    assert ps.ProcessSet([1]).size() is None  # unregistered, as Horovod's
    monkeypatch.delenv("HOROVOD_DYNAMIC_PROCESS_SETS", raising=False)
    with pytest.raises(ValueError, match="HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow adding"):
        ps.add_process_set([0])
    assert not ps.remove_process_set(ps.ProcessSet([0]))  # never registered


def test_reduce_input_widens_float16_prescales_and_never_writes_the_input():
    x = np.array([1.0, 2.5], dtype=np.float16)
    send = reducer.reduce_input(x, 2.0)
    assert send.dtype == np.float32 and send.tolist() == [2.0, 5.0]
    assert x.tolist() == [1.0, 2.5]
    y = np.arange(3, dtype=np.int64)
    assert reducer.reduce_input(y, 1.0) is y  # nothing to do: no copy
    with pytest.raises(TypeError, match="bool"):
        reducer.reduce_input(np.array([True]), 1.0)


def test_scale_rounds_dtype_by_dtype_as_horovods_scale_buffer():
    scale = reducer._scale
    # Integers: a float64 product, truncated toward zero (not floored).
    got = scale(np.array([7, -7, -3], dtype=np.int32), 0.5, np.dtype(np.int32))
    assert got.dtype == np.int32 and got.tolist() == [3, -3, -1]
    # float16 (held in float32): a sum of 1 + 1/2048 is rounded to float16 (1.0) before
    # it is scaled in float32, and the product is rounded to float16.
    x = np.float32(1 + 1 / 2048)
    got = scale(np.array([x]), 1 / 3, np.dtype(np.float16))
    assert got.dtype == np.float32 and got[0] == np.float16(np.float16(1) * np.float32(1 / 3))
    # float32 and float64: their own precision, the factor rounded to it.
    assert scale(np.array([3.0], np.float32), 0.1, np.dtype(np.float32))[0] \
        == np.float32(3) * np.float32(0.1)
    assert scale(np.array([3.0]), 0.1, np.dtype(np.float64))[0] == 3.0 * 0.1


def test_finish_reduce_scales_and_casts_back_but_leaves_a_factor_of_one():
    finish = reducer.finish_reduce
    got = finish(np.array([2.0, 5.0], dtype=np.float32), np.dtype(np.float16), 0.5)
    assert got.dtype == np.float16 and got.tolist() == [1.0, 2.5]
    assert finish(np.array([2.0, 5.0]), np.dtype(np.float64), 1.5).tolist() == [3.0, 7.5]
    # An integer average (factor 1/2) truncates toward zero, as Horovod's does.
    assert finish(np.array([7, -7], dtype=np.int64), np.dtype(np.int64), 0.5).tolist() \
        == [3, -3]
    big = np.array([2**62 + 1], dtype=np.int64)  # not rounded through float64 when Sum
    assert finish(big, np.dtype(np.int64), 1.0).tolist() == big.tolist()


class _TwoRanksAllreduce:
    """An MPI communicator's Allreduce as two ranks holding the same data would answer
    it (twice the input); records the length of each piece."""

    def __init__(self):
        self.pieces = []

    def Allreduce(self, send, target, op):
        self.pieces.append(send.size)
        np.multiply(send, 2, out=target)


def test_allreduce_pieces_cover_the_buffer_and_scale_each_piece():
    send = np.arange(10, dtype=np.float32)
    target = np.empty_like(send)
    comm = _TwoRanksAllreduce()
    reducer._allreduce_pieces(comm, send, target, "sum", np.float32(0.5), 16)  # 4 a piece
    assert comm.pieces == [4, 4, 2]
    assert target.tolist() == send.tolist()  # sum of two, averaged
    comm = _TwoRanksAllreduce()
    reducer._allreduce_pieces(comm, send, target, "sum", None, 0)  # 0: one call
    assert comm.pieces == [10] and target.tolist() == (2 * send).tolist()


def test_alltoall_layout_by_destination_and_its_errors():
    starts, counts = collectives._alltoall_layout(3, [1, 0, 2], [5, 2, 7])
    assert (starts, counts) == ({5: 0, 2: 1, 7: 1}, {5: 1, 2: 0, 7: 2})
    assert collectives._alltoall_layout(4, None, [0, 1]) == ({0: 0, 1: 2}, {0: 2, 1: 2})
    with pytest.raises(ValueError, match="divide evenly"):
        collectives._alltoall_layout(3, None, [0, 1])
    for bad in ([1, 2], [2, 2, -1], [1, 1, 0]):  # too few, negative, wrong sum
        with pytest.raises(ValueError, match="splits"):
            collectives._alltoall_layout(3, bad, [0, 1, 2])


def test_broadcast_root_falls_back_to_the_lowest_survivor():
    now = types.SimpleNamespace(ids=[0, 2, 3])  # rank 1 (original id 1) is gone
    assert CollectivesMixin.root_id(now, [0, 1, 2, 3], 2) == 2
    assert CollectivesMixin.root_id(now, [0, 1, 2, 3], 1) == 0
    with pytest.raises(ValueError, match="out of range"):
        CollectivesMixin.root_id(now, [0, 1, 2, 3], 4)


# -- fusion packing (elastic_hvd.core.reducer) and gradient groups ------------------------


@pytest.fixture(scope="module")
def tf_ops():
    """elastic_hvd.tensorflow.ops: the only test here that needs TensorFlow."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    pytest.importorskip("tensorflow")
    from elastic_hvd.tensorflow import ops
    return ops


class _RecordingComm:
    """The resilient communicator as fused_allreduce uses it, and the MPI communicator of
    its calls: runs each transaction's calls on itself, records each buffer sent and
    answers a Sum over two ranks holding the same data."""

    MPI = types.SimpleNamespace(SUM="sum")
    size = 2

    def __init__(self):
        self.sent = []

    def run_many(self, calls):
        return [attempt(self) for _, attempt in calls]

    def Allreduce(self, send, target, op):
        assert op == "sum"
        self.sent.append(send.copy())
        np.multiply(send, 2, out=target)


def test_fusion_packs_one_buffer_per_dtype_at_aligned_offsets():
    recording = _RecordingComm()
    arrays = [np.arange(3, dtype=np.float32), np.ones((2, 2)),
              np.arange(5, dtype=np.float32).reshape(5, 1)]
    results = reducer.fused_allreduce(recording, arrays, Sum)
    [fp32, fp64] = recording.sent
    # float32: 64-byte segments of 16 elements, the gap zero-filled.
    assert fp32.dtype == np.float32 and fp32.size == 32
    assert fp32[:3].tolist() == [0, 1, 2] and fp32[16:21].tolist() == [0, 1, 2, 3, 4]
    assert not fp32[3:16].any() and not fp32[21:].any()
    assert fp64.tolist() == [1.0] * 4  # a lone array goes as it is, unpadded
    for result, array in zip(results, arrays):
        assert result.dtype == array.dtype and result.shape == array.shape
        assert (result == 2 * array).all()
        assert result.ctypes.data % 64 == 0  # TF may take it without a copy


def test_fusion_threshold_cuts_buffers_and_never_splits_an_array(monkeypatch):
    recording = _RecordingComm()
    # Two 16-byte arrays fill the threshold exactly (allowed); a third does not fit.
    monkeypatch.setattr(process.runtime(), "settings",
                        config.from_environ({"HOROVOD_FUSION_THRESHOLD": "32"}))
    arrays = [np.full(4, k, dtype=np.float32) for k in range(3)] + [np.ones(25, np.float32)]
    results = reducer.fused_allreduce(recording, arrays, Sum)
    assert [s.size for s in recording.sent] == [32, 4, 25]  # [a0 pad a1 pad] [a2] [a3: 100 B]
    assert [r.tolist() for r in results[:3]] == [[0.0] * 4, [2.0] * 4, [4.0] * 4]
    assert results[3].tolist() == [2.0] * 25


def test_gradient_groups_partition_by_variable_or_round_robin(tf_ops):
    from elastic_hvd.tensorflow.gradients import GradientReducer

    v = [object() for _ in range(4)]
    reducer = GradientReducer(groups=[[v[2]], [v[0], v[1]]])
    # v3 is in no group: alone, after the groups.
    assert reducer._partition([0, 1, 2, 3], v) == [[2], [0, 1], [3]]
    # Horovod 0.28: groups=N is a number of groups, num_groups=N its deprecated name
    # (ignored when groups is given).
    assert GradientReducer(groups=2)._partition([0, 2, 3, 5, 6], [None] * 7) \
        == [[0, 3, 6], [2, 5]]
    with pytest.warns(DeprecationWarning, match="num_groups"):
        assert GradientReducer(num_groups=2)._partition([0, 2, 3, 5, 6], [None] * 7) \
            == [[0, 3, 6], [2, 5]]
    with pytest.warns(DeprecationWarning):
        assert GradientReducer(num_groups=2, groups=[[v[0]]])._partition([0, 1], v) \
            == [[0], [1]]
    assert GradientReducer()._partition([1, 4], v + v) == [[1, 4]]
    assert GradientReducer()._partition([], v) == []
    for bad in ({"op": tf_ops.Max}, {"op": tf_ops.Sum, "gradient_predivide_factor": 2.0},
                {"groups": 0}):
        with pytest.raises(ValueError):
            GradientReducer(**bad)


def test_a_relaunch_goes_where_the_discovery_points_else_to_the_hosts_named(tmp_path):
    args = types.SimpleNamespace(hosts="hostA:2,hostB:2,hostC:2", hostfile=None, np=4,
                                 min_np=None, host_discovery_script=None)
    again, _ = relaunch.without_host(args, "hostA")
    assert (again.hosts, again.np) == ("hostB:2,hostC:2", 4)
    script = tmp_path / "discover.sh"  # hostB went bad: only hostA and hostC are offered
    script.write_text("#!/bin/sh\necho hostA:2\necho hostC:2\n")
    script.chmod(0o755)
    args.host_discovery_script = str(script)
    again, _ = relaunch.without_host(args, "hostA")
    assert (again.hosts, again.np) == ("hostC:2", 2)
    script.write_text("#!/bin/sh\nexit 1\n")  # a discovery failing now: the hosts named
    again, _ = relaunch.without_host(args, "hostC")
    assert (again.hosts, again.np) == ("hostA:2,hostB:2", 4)


def test_a_job_is_relaunched_as_broken_only_when_no_rank_ended_by_itself_and_one_said_so():
    broken = {"code": None, "members": [0, 1, 2], "broken": "a process died inside its merge"}
    lost = {"code": None, "members": [0, 1, 2]}
    spare = {"code": 0, "members": []}  # a spare that never joined and exited
    why = relaunch.broken_why([broken, dict(broken), lost, spare])
    assert why is not None and why.startswith(
        "Open MPI left every rank unable to make a communicator (2 of the 4 processes ended so")
    assert why.endswith(": a process died inside its merge")
    assert relaunch.broken_why([lost, lost]) is None  # all lost, none broken: no relaunch
    for ended in ({"code": 0, "members": [0]}, {"code": 1, "members": [0], "left": True}):
        assert relaunch.broken_why([broken, ended]) is None  # the script's own end
    args = types.SimpleNamespace(hosts=None, hostfile=None, np=4)
    assert relaunch.arguments(args, relaunch.Cause()) == (args, None)  # as it was


def test_fit_elastic_bounds_keras_3_epochs_yet_each_ends_with_its_data(cluster):
    """keras_callbacks.fit_elastic passes Keras 3 a ``steps_per_epoch`` (and
    ``validation_steps``) no epoch reaches (one ``fit`` per epoch of unknown length without it
    keeps native memory: bench/fit_memory.py), and callbacks still see ``steps`` None; each
    epoch still trains, and validates on, exactly its own data."""
    tf = pytest.importorskip("tensorflow")
    from keras_callbacks.fit import fit_elastic
    if not any(c.__module__.startswith("keras.") for c in type(tf.keras.Sequential()).__mro__):
        pytest.skip("tf_keras: no bound is passed")
    cluster(1).joining = False
    lengths = iter([3, 5, 2])  # batches per epoch, unknown to Keras

    def batches(count=None):
        for _ in range(count or next(lengths)):
            yield np.ones((2, 1), np.float32), np.ones((2, 1), np.float32)

    spec = (tf.TensorSpec([None, 1], tf.float32),) * 2
    dataset = tf.data.Dataset.from_generator(batches, output_signature=spec)
    validation = tf.data.Dataset.from_generator(lambda: batches(2), output_signature=spec)

    class Model(tf.keras.Sequential):
        def fit(self, *args, **kwargs):
            given.append(kwargs.get("steps_per_epoch"))
            return super().fit(*args, **kwargs)

    class Seen(tf.keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            seen.append((epoch, self.params["steps"], []))

        def on_train_batch_end(self, batch, logs=None):
            seen[-1][2].append(batch)

        def on_test_batch_end(self, batch, logs=None):
            seen[-1][2].append(f"v{batch}")

    given, seen = [], []
    model = Model([tf.keras.Input((1,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    history = fit_elastic(model, dataset, epochs=3, callbacks=[Seen()], verbose=0,
                          validation_data=validation)
    assert given == [sys.maxsize] * 3
    assert seen == [(0, None, [0, 1, 2, "v0", "v1"]), (1, None, [0, 1, 2, 3, 4, "v0", "v1"]),
                    (2, None, [0, 1, "v0", "v1"])]
    assert history.epoch == [0, 1, 2] and len(history.history["val_loss"]) == 3


def test_fit_elastic_keeps_every_epochs_row_of_a_csv_logger(cluster, tmp_path):
    """fit_elastic runs one ``model.fit`` per epoch, and Keras' CSVLogger truncates its
    file at every fit: a run kept only its last epoch's row (issue 42)."""
    tf = pytest.importorskip("tensorflow")
    from keras_callbacks.fit import fit_elastic
    cluster(1).joining = False
    path = tmp_path / "log.csv"
    path.write_text("an earlier run's rows\n")  # a new run still starts the file afresh
    dataset = tf.data.Dataset.from_tensors((np.ones((2, 1), np.float32),) * 2)
    model = tf.keras.Sequential([tf.keras.Input((1,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    fit_elastic(model, dataset, epochs=3, verbose=0,
                callbacks=[tf.keras.callbacks.CSVLogger(str(path))])
    rows = path.read_text().splitlines()
    assert [row.split(",")[0] for row in rows] == ["epoch", "0", "1", "2"], rows


# == the core's pieces: fault plans, signature prediction, the launcher ===================
def test_fault_plan_parses_and_rejects():
    [a, b] = faults.parse("rank=1,coll=12,signal=KILL,delay=0.01; rank=3,step=40,signal=SIGSTOP")
    assert (a.rank, a.coll, a.signal, a.delay) == (1, 12, "KILL", 0.01)
    assert (b.rank, b.step, b.signal) == (3, 40, "STOP")
    [c] = faults.parse("joiner=2,signal=HANG")
    assert (c.rank, c.joiner, c.signal) == (None, 2, "HANG")
    for bad in ("rank=1", "rank=1,coll=2,step=3", "rank=1,coll=2,signal=NOPE",
                "rank=1,coll=2,when=3", "rank=1,coll=2,phase=during", "coll=2",
                "joiner=1,rank=0", "joiner=1,signal=NOPE", "rank=1,coll=2,signal=HANG",
                "rank=1,coll=2,phase=connect"):
        with pytest.raises(ValueError):
            faults.parse(bad)


def test_joiner_fault_goes_to_the_process_of_its_spawn(monkeypatch):
    faults.configure(0, "joiner=2,signal=USR1")
    try:
        assert faults.for_joiner(1) == {}
        env = faults.for_joiner(2)
        assert env == {faults.JOINER_ENV: "USR1"}
    finally:
        faults.configure(0, "")
    received = []
    old = signal.signal(signal.SIGUSR1, lambda *a: received.append(a[0]))
    try:
        monkeypatch.setenv(faults.JOINER_ENV, "USR1")
        faults.at_joiner_start()  # in the spawned process, before MPI_Init
        faults.at_joiner_start()  # once only
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert received == [signal.SIGUSR1]


def test_fault_plan_fires_only_on_its_rank_and_moment():
    plan = faults.FaultPlan(
        faults.parse("rank=2,coll=3,signal=RAISE;rank=1,step=5,signal=RAISE"), 2)
    plan.at_collective()
    plan.at_collective()
    plan.at_step(5)  # rank 1's fault: not ours
    with pytest.raises(faults.FaultInjected):
        plan.at_collective()
    plan.at_collective()  # fires once only


def test_a_fault_fires_in_its_launch_of_the_job_only():
    # A relaunch (elastic-hvd-run) runs the same plan: by default the first launch's
    # faults must not fire again at the same moments.
    spec = "rank=0,step=3,signal=RAISE;rank=0,step=4,signal=RAISE,launch=1;joiner=1,launch=1"
    first = faults.FaultPlan(faults.parse(spec), 0)
    again = faults.FaultPlan(faults.parse(spec), 0, launch=1)
    first.at_step(4)
    assert first.joiner_signal(1) is None
    with pytest.raises(faults.FaultInjected):
        first.at_step(3)
    again.at_step(3)
    assert again.joiner_signal(1) == "KILL"
    with pytest.raises(faults.FaultInjected):
        again.at_step(4)


def test_a_connect_fault_counts_attempts_not_successful_spawns():
    # phase=connect fires as the N-th connect starts, counted whether or not earlier
    # ones got further (a spawn that failed never reaches at_spawn's count).
    plan = faults.FaultPlan(faults.parse("rank=0,spawn=2,phase=connect,signal=RAISE"), 0)
    plan.at_connect()  # the first attempt, which fails before at_spawn
    with pytest.raises(faults.FaultInjected):
        plan.at_connect()
    plan.at_spawn()
    plan.at_merge()


def test_fault_sends_a_real_signal():
    received = []
    old = signal.signal(signal.SIGUSR1, lambda *a: received.append(a[0]))
    try:
        faults.Fault(rank=0, coll=1, signal="USR1").fire()
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert received == [signal.SIGUSR1]


def _predicted(predictor, transaction):
    """How many calls of ``transaction`` (signatures) were not predicted; commits them."""
    walk, missed = predictor.walk(), 0
    for signature in transaction:
        missed += not walk.expects(signature)
        walk.passed(signature)
    walk.commit()
    return missed


def test_predictor_learns_repeating_sequences():
    p = SignaturePredictor()
    misses = [i for i, sig in enumerate(["A", "A", "B"] * 4) if _predicted(p, [sig])]
    assert misses and max(misses) < 5  # after one period every call is predicted


def test_a_transaction_predicts_each_call_from_those_before_it_in_it():
    # A step of 200 unfused gradients whose last layer's shapes differ from the others':
    # the history ends with "kernel, bias -> last kernel", yet within the step a kernel
    # follows.  Learning only at commit missed ~99 calls of the first step; learning
    # along the walk misses the two where the pattern turns.
    step = ["K0", "B"] + ["K", "B"] * 98 + ["KL", "BL"]
    p = SignaturePredictor()
    assert _predicted(p, step) == 7  # 5 new contexts, and the two turns


@pytest.mark.parametrize("step", [
    ["K0", "B"] + ["K", "B"] * 98 + ["KL", "BL"],
    ["first"] + ["group"] * 10 + ["last"],  # equal groups= of repeated blocks
    ["A", "A", "B", "A", "A", "A", "B"],
])
def test_a_step_that_repeats_the_one_before_misses_no_prediction(step):
    # From the two calls before, a run of equal calls misses where it starts (the
    # history says the run ends) and where it ends: 2 misses, so 2 slow paths
    # (an agreement and an exchange each) in every step of such a model.
    # Two rounds to learn (the metric's call follows a new context in the second); an
    # internal exchange between them ([]: no signature) must not hide the last step.
    p = SignaturePredictor()
    misses = [_predicted(p, ["metric"]) + _predicted(p, []) + _predicted(p, step)
              for _ in range(5)]
    assert misses[2:] == [0, 0, 0], misses


def test_even_splits():
    assert even_splits(7, 3) == [3, 2, 2]
    assert even_splits(2, 4) == [1, 1, 0, 0]


def test_settings_are_checked_and_named():
    with pytest.raises(ValueError, match="must exceed 3 x ELASTIC_HVD_HEARTBEAT_PERIOD"):
        config.from_environ({"ELASTIC_HVD_HEARTBEAT_PERIOD": "1",
                             "ELASTIC_HVD_HEARTBEAT_TIMEOUT": "2"})
    with pytest.raises(ValueError, match="ELASTIC_HVD_MIN_NP='0': must be at least 1"):
        config.from_environ({"ELASTIC_HVD_MIN_NP": "0"})
    with pytest.raises(ValueError, match="ELASTIC_HVD_STALL_TIMEOUT='soon'"):
        config.from_environ({"ELASTIC_HVD_STALL_TIMEOUT": "soon"})
    with pytest.raises(ValueError, match="ELASTIC_HVD_RESPAWN='maybe'"):
        config.from_environ({"ELASTIC_HVD_RESPAWN": "maybe"})
    settings = config.from_environ({"ELASTIC_HVD_RESPAWN": "1", "HOROVOD_FUSION_THRESHOLD": "0",
                                    "ELASTIC_HVD_MAX_NP": "8"})
    assert (settings.respawn, settings.fusion_threshold, settings.max_np) == (True, 0, 8)
    assert config.from_environ({}) == config.Config()


def test_settings_page_lists_every_setting():
    page = open(os.path.join(os.path.dirname(__file__), "..", "docs", "settings.md")).read()
    assert config.table() in page, "docs/settings.md's table differs: paste config.table()"
    assert config.table(internal=True) in page, \
        "docs/settings.md's internal table differs: paste config.table(internal=True)"


def test_our_environment_variables_are_named_only_in_the_config_table():
    # Any string in the package that is (or sets, "NAME=") one of our variables, outside
    # config.py: each must come from config.env(), so that the table names every one.
    ours = re.compile(r"(ELASTIC_HVD_[A-Z_]+|HOROVOD_FUSION_THRESHOLD)=?")
    root = Path(__file__).resolve().parent.parent
    spelled = []
    for path in [*root.glob("elastic_hvd/**/*.py"), *root.glob("keras_callbacks/*.py")]:
        if path.name == "config.py" and path.parent.name == "core":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and ours.fullmatch(node.value):
                spelled.append(f"{path.relative_to(root)}:{node.lineno} {node.value}")
    assert spelled == []
    assert {s.env for s in config.SETTINGS} >= {"ELASTIC_HVD_PROGRAM", "ELASTIC_HVD_STATUS_DIR"}


def test_launcher_command_uses_our_mpirun_and_ulfm(tmp_path):
    args = launch.parser().parse_args(
        ["-np", "8", "--min-np", "2", "-x", "A=1", "--mpi-args", "--bind-to none",
         "python", "train.py", "--epochs", "3"])
    cmd = command.build_command(args, mpirun="/x/mpirun")
    assert cmd[:3] == ["/x/mpirun", "-np", "8"]
    assert ["--with-ft", "ulfm"] == cmd[3:5]
    assert "-x" in cmd and "ELASTIC_HVD_MIN_NP=2" in cmd and "A=1" in cmd
    assert "--bind-to" in cmd and cmd[-3:] == ["train.py", "--epochs", "3"]
    assert ("--oversubscribe" in cmd) == (8 > (os.cpu_count() or 1))
    assert ("--allow-run-as-root" in cmd) == (os.geteuid() == 0)
    real = command.find_mpirun()
    assert os.path.dirname(real) == os.path.dirname(os.path.realpath(
        os.path.join(os.path.dirname(os.sys.executable), "mpirun")))


def test_launcher_hosts_give_np():
    args = launch.parser().parse_args(["-H", "a:2,b:3", "python", "x.py"])
    cmd = command.build_command(args, mpirun="mpirun")
    assert cmd[1:3] == ["-np", "5"] and "--host" in cmd and "--oversubscribe" not in cmd


def _fake_mpirun(tmp_path, status, message):
    """An executable standing in for mpirun: records its arguments, makes its session
    directory where ``prte_local_tmpdir_base`` says, prints ``message``, exits ``status``."""
    script = tmp_path / "mpirun"
    script.write_text(
        "#!/bin/sh\n"
        f"echo \"$@\" >> {tmp_path}/calls\n"
        "prev=''; for a in \"$@\"; do\n"
        "  if [ \"$prev\" = prte_local_tmpdir_base ]; then\n"
        "    mkdir -p \"$a/ompi.$$\" && touch \"$a/ompi.$$/pmix.host.tool\" && echo \"$a\" > "
        f"{tmp_path}/base; fi\n"
        "  prev=$a; done\n"
        f"echo \"{message}\" >&2; exit {status}\n")
    script.chmod(0o755)
    return str(script)


def test_launcher_gives_mpirun_a_session_dir_of_its_own_and_removes_it(tmp_path, monkeypatch,
                                                                       capfd):
    # Even when mpirun did not start: no launching again (the cause is known and
    # prevented, see tests/test_session_dirs.py), its status and words pass through.
    monkeypatch.setattr(command, "find_mpirun", lambda: _fake_mpirun(
        tmp_path, 213, "The PMIx server's listener thread failed to start. We cannot"))
    assert launch.main(["-np", "2", "python", "x.py"]) == 213
    assert len((tmp_path / "calls").read_text().splitlines()) == 1
    base = Path((tmp_path / "base").read_text().strip())
    assert base.name.startswith("elastic_hvd") and not base.exists()
    assert "listener thread failed to start" in capfd.readouterr().err


@pytest.mark.parametrize("how", ["--mpi-args", "environment"])
def test_launcher_leaves_a_session_dir_base_the_user_chose(tmp_path, monkeypatch, how):
    monkeypatch.setattr(command, "find_mpirun", lambda: _fake_mpirun(tmp_path, 0, ""))
    argv = ["-np", "2", "python", "x.py"]
    if how == "--mpi-args":
        argv[2:2] = ["--mpi-args", f"--prtemca prte_tmpdir_base {tmp_path}"]
    else:
        monkeypatch.setenv("PRTE_MCA_prte_tmpdir_base", str(tmp_path))
    assert launch.main(argv) == 0
    assert "prte_local_tmpdir_base" not in (tmp_path / "calls").read_text()


def test_a_process_that_never_joined_completes_nothing_and_ends_nothing():
    # A spare (or spawned process) that exits 0 before it is adopted records members
    # [] -- it was no rank.  The soak's seed 1208: the launcher took one for "every
    # member finished" and ended a running job with exit status 0.
    killed = [{"id": i, "code": None, "members": None} for i in range(4)]
    spare = {"id": None, "code": 0, "members": [], "left": False, "final": False}
    status, why = outcome.exit_status(0, [*killed, spare])
    assert status == 1 and "no rank completed: 1 never joined" in why, why
    assert not outcome.members_done([*killed, spare])
    final = [{"id": i, "code": 0, "members": [0, 1], "final": True} for i in (0, 1)]
    assert outcome.members_done([*killed, spare, *final])
    assert not outcome.members_done([*killed, spare, final[0]])  # id 1 not past its record yet
    assert outcome.exit_status(0, [*killed, spare, *final]) == (0, None)


def test_waiting_board_hears_others_recent_words_not_its_own(tmp_path, monkeypatch):
    from elastic_hvd.core.heartbeat import WaitingBoard
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the board sets a variable
    board = WaitingBoard.of_job(environ={"ELASTIC_HVD_STATUS_DIR": str(tmp_path),
                                         "PMIX_NAMESPACE": "prterun-hostA-1@1"})
    assert board.path == tmp_path / "waiting"
    assert os.environ[WaitingBoard.ENV] == str(board.path)  # what spawned processes use
    board.say_waiting()
    assert not board.others_waited_within(5)  # its own word only
    other = board.path / f"{board.prefix}hostB-4242"
    other.touch()
    assert board.others_waited_within(5)
    os.utime(other, (0, os.path.getmtime(other) - 10))  # said 10 s ago
    assert not board.others_waited_within(5)
    board.leave()
    assert sorted(p.name for p in board.path.iterdir()) == [other.name]
    assert not WaitingBoard.of_job(environ={}).others_waited_within(5)  # no mpirun: no peers


def test_every_open_mpi_workaround_is_in_the_table_with_a_reproducer_and_is_counted():
    from elastic_hvd.core import workarounds

    root = Path(__file__).resolve().parent.parent
    called = set()
    for path in [*root.glob("elastic_hvd/**/*.py"), *root.glob("keras_callbacks/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "used"
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "workarounds"):
                called.add(node.args[0].value)
    table = {w.name for w in workarounds.TABLE if w.applied}
    assert called == table, "each workaround in the table is counted where it is applied"
    for w in workarounds.TABLE:
        where = w.reproducer.removeprefix("python ")
        file, _, test = where.partition("::")
        assert (root / file).is_file(), w.reproducer
        assert not test or f"def {test}(" in (root / file).read_text(), w.reproducer
        assert w.measured_on.startswith("Open MPI 5.0.11")
    old = process.use(process.Runtime())
    try:
        workarounds.used("settle")
        workarounds.used("settle", "again")
        assert workarounds.counts() == {"settle": 2}
        with pytest.raises(KeyError):
            workarounds.used("not_in_the_table")
    finally:
        process.use(old)


WAKE_COUNTER = r"""
import sys, time
import mpi4py
mpi4py.rc.initialize = False  # Open MPI's libraries loaded, no MPI_Init: nothing may progress
from mpi4py import MPI
from elastic_hvd.core.heartbeat import NativeProgress

def switches(tid):
    with open(f"/proc/self/task/{tid}/status") as status:
        return sum(int(line.split()[1]) for line in status if "ctxt_switches" in line)

loop = NativeProgress(float(sys.argv[1]))  # its timers do not fire within the test
tid = loop._thread.native_id
time.sleep(0.2)
before = switches(tid)
for _ in range(10000):
    loop.pause()
    loop.resume()
time.sleep(0.2)
print(switches(tid) - before)
loop.stop()
"""


def test_pausing_the_progress_loop_around_a_collective_never_wakes_its_thread():
    """The native progress loop pauses and resumes around every collective
    (core/heartbeat.py).  A resume that wakes the loop's thread (libevent does when the
    re-added timer becomes the earliest one) cost ~13 µs per small collective and, on a busy
    machine, preempts a rank; with the timer that keeps the loop waking armed, 10^4
    pauses and resumes wake it not at all."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", WAKE_COUNTER, "5.0"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    woke = int(out.stdout.split()[-1])
    assert woke < 10, f"10^4 pauses and resumes woke the loop's thread {woke} times"


def test_a_given_up_call_that_spins_is_told_from_one_that_waits():
    # A spawn or adoption given up leaves its thread behind.  One stuck in Open MPI's
    # endless context-id retry keeps a core busy (measured: 46-60 % per rank on 2 cores)
    # and the process is broken for good; one that waits for a joiner that never
    # starts sleeps (measured: 0 %) and does no harm.  MergeCall._end_if_broken tells
    # them apart by the thread's CPU time.
    from elastic_hvd.core import spawn

    def share(work):
        call = spawn.MergeCall.__new__(spawn.MergeCall)
        started, stop = threading.Event(), threading.Event()

        def run():
            call._thread_id = threading.get_native_id()
            started.set()
            work(stop)
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        started.wait()
        try:
            return call._cpu_share()
        finally:
            stop.set()
            thread.join()

    def spin(stop):
        while not stop.is_set():
            pass
    # What a loop gets is its part of the cores: a pure spin got 16 % of a core beside
    # 5 CPU hogs and a test suite (load ~10 on 2 cores), hence the low bound.
    assert share(spin) >= spawn.SPIN_SHARE
    assert share(lambda stop: stop.wait()) < spawn.SPIN_SHARE
    ended = spawn.MergeCall.__new__(spawn.MergeCall)
    ended._thread_id = None
    assert ended._cpu_share() == 0.0


class _Members:
    """What the watch of stopped members reads of a communicator: the members' original
    ids in rank order, and each one's (host, identity: :class:`.signals.Identity`)."""

    joining = False

    def __init__(self, procs, joiners=()):
        self.ids, self._procs, self._joiners = tuple(procs), procs, tuple(joiners)

    def process_of(self, original_id):
        return self._procs[original_id]

    def pending_processes(self):
        return self._joiners


def _who(proc):
    return signals.Identity(proc.pid, signals.start_of(proc.pid))


def _stopped(*procs):
    for proc in procs:
        os.kill(proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while any(state_of(_who(p)) != "T" for p in procs) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_member_stopped_on_this_host_is_killed_past_the_patience_by_the_lowest_running():
    # Real processes, really stopped; the communicator is only what the watch reads.
    here = socket.gethostname()
    assert invitation.read_hello(invitation.hello()) == (here, signals.mine())  # a joiner says it
    a, b, c, d, e = (subprocess.Popen(["sleep", "60"]) for _ in range(5))
    settings = config.from_environ({"ELASTIC_HVD_HEARTBEAT_PERIOD": "0.5",
                                    "ELASTIC_HVD_HEARTBEAT_TIMEOUT": "2"})
    try:
        _stopped(a, b, c, e)
        # Rank 0 stopped; this process, rank 1, is the lowest one running: it looks.
        # Rank 3 is stopped too, but on another host (nobody there to look: left alone).
        # A process spawned to join (not a member yet, its pid told by its hello) counts.
        members = _Members({7: (here, _who(a)), 3: (here, signals.mine()), 9: (here, _who(c)),
                            4: ("elsewhere", _who(b)), 5: (here, _who(d))},
                           joiners=[(here, _who(e)), ("elsewhere", _who(b))])
        old = process.use(process.Runtime(settings=settings, comm=members, growth=members))
        try:
            watch = StoppedPeers()
            assert watch.look(100.0) == []  # first seen stopped
            assert watch.look(102.9) == []  # not yet 1.5 x the 2 s heartbeat timeout
            assert watch.look(103.0) == [a.pid, c.pid, e.pid]
            assert a.wait(10) == c.wait(10) == e.wait(10) == -signal.SIGKILL
            assert state_of(_who(b)) == "T" and d.poll() is None
            # A running process of this host ranks lower (d, rank 0): it looks, not us.
            _stopped(d)
            os.kill(d.pid, signal.SIGCONT)
            members = _Members({5: (here, _who(d)), 3: (here, signals.mine()),
                                4: (here, _who(b))})
            process.use(process.Runtime(settings=settings, comm=members, growth=members))
            watch = StoppedPeers()
            assert watch.look(100.0) == [] and watch.look(200.0) == []
            assert state_of(_who(b)) == "T"
        finally:
            process.use(old)
    finally:
        for proc in (a, b, c, d, e):
            proc.kill()
            proc.wait()
