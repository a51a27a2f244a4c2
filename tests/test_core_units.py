"""Single-process pieces of the core: fault plans, signature prediction, the launcher."""

import ast
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from elastic_hvd.core import faults
from elastic_hvd.core.collectives import even_splits
from elastic_hvd.core import config, growth, process, signals
from elastic_hvd.core.stopped_peers import StoppedPeers, state_of
from elastic_hvd.core.signature import SignaturePredictor
from elastic_hvd.runner import command, launch, outcome


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
    table = {w.name for w in workarounds.TABLE}
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
    assert growth._read_hello(growth._hello()) == (here, signals.mine())  # how a joiner says it
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
        old = process.use(process.Runtime(settings=settings, comm=members))
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
            process.use(process.Runtime(settings=settings, comm=_Members(
                {5: (here, _who(d)), 3: (here, signals.mine()), 4: (here, _who(b))})))
            watch = StoppedPeers()
            assert watch.look(100.0) == [] and watch.look(200.0) == []
            assert state_of(_who(b)) == "T"
        finally:
            process.use(old)
    finally:
        for proc in (a, b, c, d, e):
            proc.kill()
            proc.wait()
