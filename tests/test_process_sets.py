"""Process sets (elastic_hvd/core/process_sets.py; design: docs/process-sets.md).

Single-process: the registry's pure parts, read against a communicator's membership
data (ids, rank, size: a plain object holding them; no MPI).  Multi-rank: real 4-rank
jobs with real SIGKILLs (tests/workers/process_sets.py)."""

import pytest

from elastic_hvd.core import process_sets as ps
from elastic_hvd.core.membership import Listeners
from mpijob import run_job


class _Membership:
    """What the registry reads of a communicator: its members' original ids, in rank order."""

    def __init__(self, ids, me):
        self.ids, self.original_id = tuple(ids), me
        self.listeners = Listeners()

    @property
    def size(self):
        return len(self.ids)

    @property
    def rank(self):
        return self.ids.index(self.original_id)

    def run(self, signature, attempt):
        raise AssertionError("no collective expected here")


def _registry(sets, ids=(0, 1, 2, 3)):
    """A registry with ``sets`` (lists of original ids) as a derivation over ``ids`` left it."""
    registry = ps.Registry()
    for members in sets:
        entry = registry._allocate(members)
        entry.derived = entry.live = tuple(i for i in ids if i in members)
    return registry


# -- single process ------------------------------------------------------------------------

def test_ids_are_allocated_as_horovods_table_does():
    registry = ps.Registry()
    assert [registry._allocate([i]).set_id for i in range(3)] == [1, 2, 3]
    registry._release(2)
    registry._release(1)
    # freed ids are used again, the oldest freed first, before new ones
    assert [registry._allocate([i]).set_id for i in (5, 6, 7)] == [2, 1, 4]
    assert registry.set_ids() == [0, 1, 2, 3, 4]


def test_a_set_is_its_members_whatever_their_order():
    registry = _registry([[2, 0]])
    assert registry.find([0, 2]) == registry.find((2, 0)) == 1
    assert registry.find([0]) is None


def test_ranks_size_rank_and_included_follow_the_live_membership():
    registry = _registry([[1, 3], [0, 2]])
    comm = _Membership([0, 1, 2, 3], me=3)
    assert registry.ranks(comm, 1) == [1, 3] and registry.rank(comm, 1) == 1
    assert registry.size(comm, 1) == 2 and registry.included(comm, 1)
    assert not registry.included(comm, 2)
    with pytest.raises(ps.NotInProcessSetError, match="not part of provided process set"):
        registry.rank(comm, 2)
    # original id 1 lost: the global ranks shift, the set shrinks with them
    comm = _Membership([0, 2, 3], me=3)
    registry.entry(1).live = (3,)
    assert registry.ranks(comm, 1) == [2] and registry.rank(comm, 1) == 0
    assert registry.ids_and_ranks(comm) == {0: [0, 1, 2], 1: [2], 2: [0, 1]}
    assert registry.size(comm, ps.GLOBAL_ID) == 3 and registry.rank(comm, ps.GLOBAL_ID) == 2


def test_an_emptied_set_has_size_0_and_refuses_its_collectives_with_a_clear_error():
    registry = _registry([[1]])
    comm = _Membership([0, 2, 3], me=0)
    registry.entry(1).settle_on(None, (), "global repair")
    assert registry.size(comm, 1) == 0 and not registry.included(comm, 1)
    with pytest.raises(ps.EmptiedProcessSetError, match="every one of its members"):
        ps.SetComm(comm, registry, 1).allreduce([1.0])
    [event] = registry.events(1)
    assert (event.old_size, event.new_size, event.lost, event.during) == \
        (1, 0, (1,), "global repair")


def test_unknown_ids_raise_valueerror_as_horovod():
    registry = _registry([[0]])
    comm = _Membership([0, 1], me=0)
    for bad in (10, None, "1"):
        with pytest.raises(ps.UnknownProcessSetError):
            registry.size(comm, bad)
    with pytest.raises(ValueError):
        ps.SetComm(comm, registry, 10).allreduce([1.0])


def test_a_non_member_calling_a_sets_collective_gets_notinprocessseterror():
    registry = _registry([[1]])
    registry.entry(1).mpi_comm = object()  # a member's communicator: never reached here
    with pytest.raises(ps.NotInProcessSetError):
        ps.SetComm(_Membership([0, 1], me=0), registry, 1).barrier()


def test_members_are_checked_as_horovod_checks_ranks():
    comm = _Membership([0, 2, 5], me=0)  # ids after a loss: rank 1 is original id 2
    assert ps.members_of(comm, [2, 1]) == (2, 5)
    assert ps.members_of(comm, []) == (0, 2, 5)  # Horovod's ProcessSet([]): the global set
    for bad in ([0, 0], [3], [-1], [0.5], [True]):
        with pytest.raises(ValueError):
            ps.members_of(comm, bad)


def test_the_book_hands_the_table_to_a_joiner():
    registry = _registry([[0, 1], [2]])
    registry._release(1)
    other = ps.Registry()
    other.load_book(registry.book())
    comm = _Membership([0, 1, 2, 3], me=3)
    assert other.ids_and_ranks(comm) == registry.ids_and_ranks(comm) == {0: [0, 1, 2, 3],
                                                                            2: [2]}
    assert other._allocate([3]).set_id == 1  # the freed id travelled too


def test_a_membership_event_derives_only_when_it_lost_a_member_of_a_set():
    registry = _registry([[0, 1]])
    comm = _Membership([0, 1, 2, 3], me=0)
    # a join (nobody lost), or a loss outside every set: no collective (comm.run would raise)
    ps.after_loss(comm, registry, ())
    ps.after_loss(comm, registry, (3,))
    with pytest.raises(AssertionError, match="no collective"):
        ps.after_loss(comm, registry, (1,))


def test_the_step_transaction_runs_again_only_when_a_set_it_uses_changed():
    class _Set:
        generation = 0

    used, other = _Set(), _Set()
    runs = []

    def attempt():
        runs.append(1)
        if len(runs) == 1:
            other.generation += 1  # a set the step does not use: no second run
        return len(runs)

    assert ps.consistent([used], attempt) == 1

    def hit():
        runs.append(1)
        if len(runs) == 2:
            used.generation += 1
        return len(runs)

    assert ps.consistent([used, other], hit) == 3


# -- real jobs -------------------------------------------------------------------------------

@pytest.mark.multirank
def test_a_member_killed_inside_a_sets_allreduce_a_disjoint_set_finishes_untouched(tmp_path):
    # A = {0, 1}, B = {2, 3}; rank 1 SIGKILLed inside A's fourth 16 MiB allreduce (the first
    # on the fast path: straight to the transfer), once its transfer completed and before
    # the agreement (phase=after: a kill 10 ms into the transfer landed in the fifth call
    # whenever the transfer took less), while B's members reduce 10 times on their own
    # communicator.
    job = run_job("process_sets.py", "kill_in_set", "16", "5", "10",
                  faults="rank=1,coll=4,phase=after", tmp_path=tmp_path)
    assert sorted(job.results) == [0, 2, 3], job.output[-3000:]
    for rank, r in job.results.items():
        assert r["ids"] == [0, 2, 3] and r["global_events"] == [[1]]
        assert r["ids_and_ranks"] == {"0": [0, 1, 2], "1": [0], "2": [1, 2]}
        assert r["sizes"] == {"1": 1, "2": 2}
        assert r["exact_in_set"] and r["exact_global"] and r["exact_again"]
        assert r["included"] == {"1": rank == 0, "2": rank != 0}
    a = job.results[0]
    # A's survivor ran the interrupted call again, alone, at once (its own repair) ...
    assert a["live_in_set"] == [0] and a["retries_in_set"] == 1, a["why"]
    [(during, old, new, lost, repaired, _)] = a["events"]["1"]
    assert (during, old, new, lost) == ("set repair", 2, 1, [1])
    # the plan kills inside the fourth call; the survivor finds it in that call's agreement
    # or, when the agreement completed among the survivors (every transfer had), in the next
    assert a["windows"][3][0] <= repaired <= a["windows"][4][1], (repaired, a["windows"])
    for rank in (2, 3):
        b = job.results[rank]
        # ... B was not hit: not one of its calls ran again, no event of its own
        assert b["live_in_set"] == [2, 3] and b["retries_in_set"] == 0
        assert b["events"]["2"] == []
        # the global repair told the non-members of A
        assert [e[:4] for e in b["events"]["1"]] == [["global repair", 2, 1, [1]]]


@pytest.mark.multirank
def test_overlapping_sets_a_member_lost_in_one_while_another_waits_in_the_other(tmp_path):
    # S = {0, 1}, T = {0, 2}: rank 2 SIGKILLed inside T's 4th allreduce while rank 1 waits
    # for rank 0 in S's: T's survivor repairs T alone and goes on to S (no global repair
    # from inside a set's collective, which would wait for rank 1 for ever).
    # (phase=after: inside T's 4th call whatever the transfer's speed, as above)
    job = run_job("process_sets.py", "overlap", "6", faults="rank=2,coll=4,phase=after",
                  tmp_path=tmp_path)
    assert sorted(job.results) == [0, 1, 3], job.output[-3000:]
    zero = job.results[0]
    assert zero["t_exact"] and zero["t_live"] == [0] and zero["t_retries"] == 1
    assert zero["t_events"] == [["set repair", 2, 1, [2]]]
    for rank in (0, 1):
        assert job.results[rank]["s_exact"] and job.results[rank]["s_retries"] == 0
    for r in job.results.values():
        assert r["global_exact"] and r["global_events"] == [[2]] and r["s_events"] == []
        assert r["ids_and_ranks"] == {"0": [0, 1, 2], "1": [0, 1], "2": [0]}
    assert job.results[1]["t_events"] == job.results[3]["t_events"] == \
        [["global repair", 2, 1, [2]]]


@pytest.mark.multirank
def test_a_set_emptied_by_losses_raises_and_dynamic_sets_are_agreed(tmp_path):
    job = run_job("process_sets.py", "emptied", faults="rank=1,coll=1", tmp_path=tmp_path)
    assert sorted(job.results) == [0, 2, 3], job.output[-3000:]
    for r in job.results.values():
        assert r["exact_b"] and r["size_a"] == 0 and not r["included_a"]
        assert r["events_a"] == [["global repair", 1, 0, [1]]]
        assert r["use_a"].startswith("EmptiedProcessSetError: process set 1 is empty")
        assert r["disagreeing_add"].startswith("ValueError: hvd.add_process_set must be "
                                               "called by every rank with the same")
        assert (r["removed_a"], r["removed_again"], r["removed_global"]) == (True, False, False)
        assert r["duplicate_add"].startswith("DuplicateProcessSetError")
        assert r["new_id"] == 1  # the freed id, as Horovod's table gives it
        assert r["ids_and_ranks"] == {"0": [0, 1, 2], "1": [0, 1], "2": [0, 1, 2]}
    assert job.results[0]["exact_new"] and job.results[2]["exact_new"]
    assert (job.results[0]["new_rank"], job.results[2]["new_rank"]) == (0, 1)
    assert job.results[0]["broadcast"] == job.results[2]["broadcast"] == [2]
    assert job.results[3]["new_rank"] == "NotInProcessSetError"


@pytest.mark.multirank
def test_the_step_transaction_of_a_set_is_redone_among_its_survivors(tmp_path):
    # rank 1 dies in the step's second allreduce once its transfer completed, before the
    # agreement (phase=after: 5 ms into the 4 MiB transfer, as before, often came after the
    # whole step on an idle machine, and the step ran once)
    job = run_job("process_sets.py", "step", "4", faults="rank=1,coll=2,phase=after",
                  tmp_path=tmp_path)
    assert sorted(job.results) == [0, 2, 3], job.output[-3000:]
    for rank in (0, 2):
        r = job.results[rank]
        assert r["runs"] == [[0, 1, 2], [0, 2]] and r["exact"] and r["live"] == [0, 2]
    assert all(r["ids_and_ranks"] == {"0": [0, 1, 2], "1": [0, 1], "2": [2]}
               for r in job.results.values())


@pytest.mark.multirank
def test_a_mismatch_inside_a_set_raises_on_its_members_only(tmp_path):
    job = run_job("process_sets.py", "mismatch", tmp_path=tmp_path)
    assert sorted(job.results) == [0, 1, 2, 3], job.output[-3000:]
    assert [job.results[i].get("error") for i in range(4)] == \
        ["MismatchError", "MismatchError", None, None]
    assert all(r["after"] == [2.0] * 8 and r["total"] == [4.0, 4.0] and r["retries"] == 0
               for r in job.results.values())


@pytest.mark.multirank
def test_registration_gives_horovods_ids_and_duplicates(tmp_path):
    job = run_job("process_sets.py", "static", tmp_path=tmp_path)
    assert sorted(job.results) == [0, 1, 2, 3], job.output[-3000:]
    for rank, r in job.results.items():
        assert r["ids_and_ranks"] == {"0": [0, 1, 2, 3], "1": [0, 2], "2": [1, 3], "3": [0]}
        # [its half by a communicator, the world's dup, the half's dup, the evens, [0]]
        assert r["first"] == ([1, None, None, None, 3] if rank % 2 == 0
                              else [2, None, None, 1, 3])
        assert r["second"] == [1 + rank % 2, 3] and r["rank_in_sub"] == rank // 2


@pytest.mark.multirank
def test_tf_a_member_killed_inside_hvd_allreduce_on_its_set(tmp_path):
    # The TF layer: hvd.init(process_sets=[A = {0, 1}, B = {2, 3}]); rank 1 is SIGKILLed
    # inside its 4th 16 MiB hvd.allreduce(..., process_set=A), once its transfer completed
    # and before the agreement (its 4th checked collective: registration's are unchecked;
    # eager and tf.function calls alternate).  A's survivor finishes alone, B is untouched;
    # after a global allreduce every survivor sees the same sets; a set broadcast from a
    # global root rank and a DistributedGradientTape step on the set follow the survivors.
    job = run_job("tf_process_sets.py", "6", "0", faults="rank=1,coll=4,phase=after",
                  tmp_path=tmp_path, timeout=240)
    assert sorted(job.results) == [0, 2, 3], job.output[-3000:]
    zero = job.results[0]
    assert all(exact for _, exact in zero["exact"])
    assert [live for live, _ in zero["exact"]] == [[0, 1]] * 3 + [[0]] * 3
    assert zero["set_events"] == [["set repair", 2, 1, [1]]]
    for rank in (2, 3):
        r = job.results[rank]
        assert r["exact"] == [[[2, 3], True]] * 6 and r["set_events"] == []
    for rank, r in job.results.items():
        assert r["ids"] == [0, 2, 3] and r["global_events"] == [[1]] and r["total"] == 5.0
        assert r["ids_and_ranks"] == {"0": [0, 1, 2], "1": [0], "2": [1, 2]}
        assert r["included"] == [rank == 0, rank != 0]
        assert r["included_op"] == int(rank == 0)
    assert (zero["size"], zero["rank"], zero["size_op"]) == (1, 0, 1)
    assert [(job.results[r]["size"], job.results[r]["rank"]) for r in (2, 3)] == [(2, 0), (2, 1)]
    # broadcast from global rank max(set.ranks): rank 0 on A (alone), rank 2 (original 3) on B
    assert zero["broadcast"] == 0.0 and zero["root_id"] == 0
    assert job.results[2]["broadcast"] == job.results[3]["broadcast"] == 3.0
    # A's survivor alone keeps its own gradient (Horovod's _allreduce_cond); B averages
    assert zero["grad"] == 1.0
    assert job.results[2]["grad"] == job.results[3]["grad"] == 3.5
