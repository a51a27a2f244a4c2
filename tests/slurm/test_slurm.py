"""Jobs on a real Slurm cluster (cluster.py: slurmctld, a slurmd per node, each node
its own network and host name), submitted with ``sbatch`` as a user would; the
training scripts are tests/workers' own, unchanged.  ``make test-slurm`` runs these.

Times are measured and written to ``<cluster scratch>/measures.jsonl`` (docs/slurm.md's
table); none is asserted: the machine is 2 shared cores."""

import json
import os
import signal
import time
from pathlib import Path

import pytest

from conftest import WORKERS, results, wait_nodes_clean
from mpijob import assert_same_weights_every_step
from test_elastic_fit import read_lines, trained_ids

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(400)]

TWO_NODES = ["-N2", "--ntasks-per-node=2"]
SAMPLES = 100  # elastic_fit.py's N


def measure(cluster, what, **values):
    with open(cluster.scratch / "measures.jsonl", "a") as f:
        f.write(json.dumps({"what": what, **values}) + "\n")


def fit(out, epochs, launcher="", env=None):
    """A batch script's lines: elastic_fit.py under elastic-hvd-run, its exit status the job's."""
    env = {"TEST_OUT_DIR": str(out), **(env or {})}
    exports = "".join(f"export {k}={v}\n" for k, v in env.items())
    xs = " ".join(f"-x {k}" for k in env)
    return (f"mkdir -p {out}\n{exports}"
            f"exec elastic-hvd-run {launcher} {xs} python {WORKERS}/elastic_fit.py {epochs}")


def steps_logged(out, rank=0):
    return read_lines(Path(out) / f"steps{rank}.jsonl")


def wait_steps(jobs, job, out, count, timeout=240):
    """Wait until rank 0 logged ``count`` steps (the job must still run)."""
    deadline = time.monotonic() + timeout
    while len(steps_logged(out)) < count:
        state = jobs.state(job)
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), (state, jobs.output(job)[-3000:])
        assert time.monotonic() < deadline, f"rank 0 logged no {count} steps: {jobs.output(job)}"
        time.sleep(0.1)


def rank_pid(cluster, node, rank, script="elastic_fit.py"):
    """The pid of MPI rank ``rank`` of ``script`` on ``node`` (by its environment)."""
    for pid, _ in cluster.processes_on(node):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if script.encode() in cmd and f"OMPI_COMM_WORLD_RANK={rank}".encode() in env:
            return pid
    return None


def job_processes(cluster):
    """``{node: [(pid, comm)]}`` of everything but slurmd on the nodes."""
    return {node: [p for p in cluster.processes_on(node) if p[1] != "slurmd"]
            for node in cluster.nodes}


def tree(path):
    """``{relative path: bytes}`` of the files under ``path``."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(Path(path).rglob("*"))
            if p.is_file()}


def test_a_two_node_allocation_is_taken_by_elastic_hvd_run_and_plain_mpirun(cluster, jobs,
                                                                          tmp_path):
    # No host and no -np anywhere: the allocation's 2 nodes x 2 slots.
    out = {name: tmp_path / name for name in ("layout", "fit", "plain", "plain_np")}
    job = jobs.sbatch(
        f"mkdir -p {' '.join(map(str, out.values()))}\n"
        f"TEST_OUT_DIR={out['layout']} elastic-hvd-run -x TEST_OUT_DIR "
        f"python {WORKERS}/hosts.py layout || exit $?\n"
        f"TEST_OUT_DIR={out['fit']} elastic-hvd-run -np 4 -x TEST_OUT_DIR "
        f"python {WORKERS}/elastic_fit.py 2 || exit $?\n"
        f"TEST_OUT_DIR={out['plain']} mpirun --with-ft ulfm --allow-run-as-root -x TEST_OUT_DIR "
        f"python {WORKERS}/hosts.py layout || exit $?\n"
        f"TEST_OUT_DIR={out['plain_np']} mpirun -np 4 --with-ft ulfm --allow-run-as-root "
        f"-x TEST_OUT_DIR python {WORKERS}/hosts.py layout",
        options=[*TWO_NODES, "--no-kill"])
    started = time.monotonic()
    info = jobs.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL"), 300)
    output = jobs.output(job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), output[-4000:]
    assert "was not seen to have --no-kill" not in output
    for name in ("layout", "plain", "plain_np"):
        ranks = results(out[name])
        assert [ranks[i]["host"] for i in range(4)] == ["node1", "node1", "node2", "node2"], name
        assert [ranks[i]["local_rank"] for i in range(4)] == [0, 1, 0, 1], name
        assert ranks[0]["cross_size"] == 2, name
    fitted = results(out["fit"])
    assert sorted(fitted) == [0, 1, 2, 3], output[-4000:]
    assert len({r["digest"] for r in fitted.values()}) == 1
    assert_same_weights_every_step(out["fit"])
    for epoch, ids in trained_ids(out["fit"], []).items():
        assert sorted(ids) == list(range(SAMPLES)), f"epoch {epoch}: not exactly once"
    measure(cluster, "allocation: 4 launches (2 elastic-hvd-run, 2 mpirun), 2-epoch fit",
            seconds=round(time.monotonic() - started, 1))


def test_salloc_runs_mpirun_on_the_login_node_and_ranks_on_the_allocation(cluster, jobs,
                                                                          tmp_path):
    # SALLOC_NO_KILL=set is salloc's --no-kill, and the one form of it the job can see.
    out = tmp_path / "out"
    out.mkdir()
    done = cluster.sh(f"cd {tmp_path} && TMPDIR={tmp_path} TEST_OUT_DIR={out} SALLOC_NO_KILL=set "
                      f"salloc -N2 --ntasks-per-node=2 elastic-hvd-run -x TEST_OUT_DIR "
                      f"python {WORKERS}/hosts.py layout", timeout=180, env=jobs.env(),
                      check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "--no-kill" not in output
    ranks = results(out)
    assert [ranks[i]["host"] for i in range(4)] == ["node1", "node1", "node2", "node2"], output


def test_a_job_without_no_kill_is_warned_at_start(cluster, jobs, tmp_path):
    job = jobs.sbatch(f"mkdir -p {tmp_path}/o\nTEST_OUT_DIR={tmp_path}/o elastic-hvd-run "
                      f"-x TEST_OUT_DIR python {WORKERS}/hosts.py layout", options=TWO_NODES)
    info = jobs.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"), 120)
    output = jobs.output(job)
    assert info["JobState"] == "COMPLETED", output
    lines = [line for line in output.splitlines() if "--no-kill" in line]
    assert len(lines) == 1 and lines[0].startswith(f"elastic-hvd-run: Slurm job {job} was not "
                                                   "seen to have --no-kill"), output


def test_a_rank_killed_from_outside_is_survived_in_place(cluster, jobs, tmp_path):
    out = tmp_path / "out"
    job = jobs.sbatch(fit(out, 3, env={"TEST_STEP_SLEEP": "0.2"}),
                      options=[*TWO_NODES, "--no-kill"])
    wait_steps(jobs, job, out, 8)
    pid = rank_pid(cluster, "node2", 3)
    assert pid, job_processes(cluster)
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    info = jobs.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL"), 300)
    output = jobs.output(job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), output[-4000:]
    ranks = results(out)
    assert sorted(ranks) == [0, 1, 2], output[-4000:]
    assert_same_weights_every_step(out)
    events = read_lines(out / "events.jsonl")
    assert sorted(r for e in events for r in e["lost"]) == [3]
    for epoch, ids in trained_ids(out, events).items():
        assert sorted(ids) == list(range(SAMPLES)), f"epoch {epoch}: not exactly once"
    after = [s["time"] for s in steps_logged(out) if s["time"] > killed]
    measure(cluster, "rank SIGKILLed: kill -> next step done on rank 0",
            seconds=round(min(after) - killed, 2), step_sleep=0.2)


def test_scancel_mid_step_leaves_nothing_and_the_checkpoint_intact(cluster, jobs, tmp_path):
    out = tmp_path / "out"
    job = jobs.sbatch(fit(out, 6, env={"TEST_STEP_SLEEP": "0.3"}),
                      options=[*TWO_NODES, "--no-kill"])
    # 100 samples, 4 ranks x 4: 7 steps an epoch; step 10 is mid-epoch 2.
    wait_steps(jobs, job, out, 10)
    ckpt = out / "ckpt"
    assert (ckpt / "checkpoint.json").exists()
    before = tree(ckpt)
    jobs.scancel(job)
    cancelled = time.monotonic()
    info = jobs.wait_state(job, ("CANCELLED",), 120)
    state_at = time.monotonic() - cancelled
    left = wait_nodes_clean(cluster, 60)
    gone_at = time.monotonic() - cancelled
    assert not left, left
    after = tree(ckpt)
    meta = json.loads(after["checkpoint.json"])
    if after["checkpoint.json"] == before["checkpoint.json"]:  # no commit since: the same bytes
        named = {k: v for k, v in before.items() if ".tmp" not in k}
        assert {k: after.get(k) for k in named} == named
    else:  # a commit raced the scancel: what it names is complete
        assert meta["epoch"] >= json.loads(before["checkpoint.json"])["epoch"]
    assert (ckpt / meta["weights"]).exists() and (ckpt / meta["state"]).exists(), meta
    measure(cluster, "scancel mid-step: -> job CANCELLED; -> no process left on the nodes",
            state_s=round(state_at, 2), clean_s=round(gone_at, 2), exit_code=info["ExitCode"])


def test_a_lost_node_is_relaunched_on_what_is_left_and_slurm_keeps_the_job(cluster, jobs,
                                                                          tmp_path):
    out = tmp_path / "out"
    job = jobs.sbatch(fit(out, 3, env={"TEST_STEP_SLEEP": "0.3",
                                       "ELASTIC_HVD_REPLICA_BUDGET": "1"}),
                      options=[*TWO_NODES, "--no-kill"])
    wait_steps(jobs, job, out, 10)
    victims = cluster.lose_node("node2")
    lost = time.time()
    try:
        info = jobs.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL"), 300)
        node2 = cluster.sh("sinfo -h -n node2 -o %t", check=False).stdout.strip()
    finally:
        cluster.revive("node2")
    output = jobs.output(job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), output[-4000:]
    assert node2.startswith("down"), node2  # Slurm saw the node go, and kept the job
    assert "node loss: the MPI runtime lost the daemon of host node2" in output, output[-4000:]
    assert "relaunching on node1:2 (2 ranks; relaunch 1 of 3)" in output, output[-4000:]
    assert sorted(results(out)) == [0, 1], output[-4000:]
    assert_same_weights_every_step(out)
    steps = steps_logged(out)
    first = [s for s in steps if s["launch"] == 0]
    done = max(s["step"] for s in first)
    restored = results(out)[0]["restored"]
    assert done - 1 <= restored["step"] <= done, (done, restored)
    assert restored["digest"] == next(s["digest"] for s in first if s["step"] == restored["step"])
    assert f"from the launcher's copy of step {restored['step']}" in output
    again = min(s["time"] for s in steps if s["launch"] == 1)
    measure(cluster, "node lost (slurmd + every process, network gone): loss -> relaunched "
            "job's first step", seconds=round(again - lost, 1), victims=len(victims),
            steps_redone=done - restored["step"], node_state=node2)


def test_without_no_kill_slurm_ends_the_allocation_after_a_node_loss(cluster, jobs, tmp_path):
    # Why the launcher warns: the relaunch on node1 starts, and Slurm ends it with the job
    # once node2 is DOWN (SlurmdTimeout): a batch job is requeued then (JobRequeue=1, the
    # default; to run again from its start after Slurm's requeue delay), or NODE_FAIL.
    out = tmp_path / "out"
    job = jobs.sbatch(f"mkdir -p {out}\nexport TEST_OUT_DIR={out}\n"
                      f"exec elastic-hvd-run -np 4 -x TEST_OUT_DIR "
                      f"python {WORKERS}/hosts.py steps 6000 0.02", options=TWO_NODES)

    def progressed():
        done = [int(p.read_text() or 0) for p in out.glob("progress*")]
        return len(done) == 4 and min(done) >= 20
    cluster.wait_for(progressed, 120, "every rank passed step 20")
    cluster.lose_node("node2")
    lost = time.monotonic()
    try:
        info = jobs.wait_state(job, ("NODE_FAIL", "PENDING", "REQUEUED", "COMPLETED", "FAILED",
                                     "CANCELLED"), 120)
        ended = time.monotonic() - lost
        if info["JobState"] != "NODE_FAIL":
            jobs.scancel(job)  # the requeued run is not wanted
    finally:
        cluster.revive("node2")
    output = jobs.output(job)
    assert info["JobState"] in ("NODE_FAIL", "PENDING", "REQUEUED"), (info, output[-3000:])
    assert info["JobState"] == "NODE_FAIL" or info["Restarts"] == "1", info
    assert "was not seen to have --no-kill" in output
    assert "relaunching on node1:2" in output, output[-3000:]  # Slurm ended the relaunch
    measure(cluster, "node lost without --no-kill: loss -> Slurm ends the job",
            seconds=round(ended, 1), state=info["JobState"], restarts=info["Restarts"],
            slurmd_timeout=10)


def test_a_requeued_job_resumes_from_its_checkpoint_exactly_once(cluster, jobs, tmp_path):
    # What preemption (PreemptMode=REQUEUE) does to a job: `scontrol requeue`.  The
    # batch script (not the training script) keeps the first run's logs apart: a
    # requeued job starts it again with SLURM_RESTART_COUNT=1.
    out, run0 = tmp_path / "out", tmp_path / "run0"
    body = (f'if [ "${{SLURM_RESTART_COUNT:-0}}" -gt 0 ]; then mkdir -p {run0} && '
            f'mv {out}/*.jsonl {run0}/; fi\n' + fit(out, 3, env={"TEST_STEP_SLEEP": "0.3"}))
    job = jobs.sbatch(body, options=[*TWO_NODES, "--no-kill", "--requeue"])
    run1 = out
    wait_steps(jobs, job, out, 10)  # mid-epoch 2
    jobs.cluster.sh(f"scontrol requeue {job}")
    requeued = time.monotonic()
    requeued_at = time.time()
    cluster.wait_for(lambda: not any(job_processes(cluster).values()), 120,
                     "the first run's processes gone", every=0.05)
    ended = time.monotonic() - requeued
    pending = jobs.wait_state(job, ("PENDING",), 60)
    # Slurm holds a requeued job back (Reason=BeginTime) for a while before it may start
    begin = time.mktime(time.strptime(pending["EligibleTime"], "%Y-%m-%dT%H:%M:%S"))
    cluster.wait_for(run0.exists, 300, "the requeued run started")
    info = jobs.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"), 360)
    output = jobs.output(job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), \
        output[-4000:]
    first, second = steps_logged(run0), steps_logged(run1)
    resumed = results(run1)[0]["initial_epoch"]
    assert resumed >= 1, output[-4000:]
    assert "resuming at epoch" in output
    # exactly once across both runs: the epochs before the checkpoint from run 0, the rest
    # from run 1, each epoch's samples once
    per_epoch = {e: ids for e, ids in trained_ids(run0, []).items() if e < resumed}
    per_epoch.update(trained_ids(run1, []))
    assert sorted(per_epoch) == [0, 1, 2], sorted(per_epoch)
    for epoch, ids in per_epoch.items():
        assert sorted(ids) == list(range(SAMPLES)), f"epoch {epoch}: not exactly once"
    assert_same_weights_every_step(run1)
    restart = min(s["time"] for s in second) - requeued_at
    measure(cluster, "scontrol requeue (preemption): -> first run's processes gone; -> "
            "requeued run's first step", gone_s=round(ended, 2), first_step_s=round(restart, 1),
            begin_time_after_s=round(begin - requeued_at), reason=pending.get("Reason"),
            steps_done_first_run=max(s["step"] for s in first), resumed_epoch=resumed)


@pytest.mark.parametrize("how", ["scancel", "requeue"])
def test_slurms_sigterm_reaches_every_rank_and_the_runtime_ends_them_at_once(cluster, jobs,
                                                                            tmp_path, how):
    # Ranks that catch SIGTERM and sleep on (term_probe.py): when does Slurm's SIGTERM
    # reach each, and how long do they live after it (KillWait is 30 s here)?
    out = tmp_path / "out"
    out.mkdir()
    probe = Path(__file__).parent / "term_probe.py"
    job = jobs.sbatch(f"exec elastic-hvd-run -np 4 python {probe} {out}",
                      options=[*TWO_NODES, "--no-kill", "--requeue" if how == "requeue" else
                               "--no-requeue"])
    cluster.wait_for(lambda: len(list(out.glob("ready*"))) == 4, 120, "4 probes ready")
    time.sleep(1)
    sent = time.time()
    jobs.cluster.sh(f"scancel {job}" if how == "scancel" else f"scontrol requeue {job}")
    last_seen = sent
    while any(p[1] == "python" for ps in job_processes(cluster).values() for p in ps):
        last_seen = time.time()
        assert last_seen - sent < 60, job_processes(cluster)
        time.sleep(0.02)
    if how == "scancel":
        jobs.wait_state(job, ("CANCELLED",), 60)
    else:
        jobs.wait_state(job, ("PENDING",), 60)
        jobs.scancel(job)  # the requeued run is not wanted
    got = {}
    for path in out.glob("SIGTERM*.jsonl"):
        for line in read_lines(path):
            got.setdefault(int(line["rank"]), []).append(line["time"] - sent)
    assert sorted(got) == [0, 1, 2, 3], got  # every rank, node1's and node2's
    measure(cluster, f"{how}: Slurm's SIGTERM -> each rank (a rank catching it); -> the last "
            "rank gone", term_s={r: [round(t, 3) for t in ts] for r, ts in sorted(got.items())},
            last_rank_gone_s=round(last_seen - sent, 2))


def test_sigusr1_before_the_end_writes_a_final_checkpoint_and_the_next_job_resumes_from_it(
        cluster, jobs, tmp_path):
    # What `#SBATCH --signal=B:USR1@N` does N seconds before the time limit: SIGUSR1 to the
    # batch shell, elastic-hvd-run itself (the script execs it), which passes it on to
    # mpirun and every rank.  `scancel --signal=USR1 --batch` sends the same, now.  The
    # ranks save the last step trained and exit 8; the job submitted again resumes there.
    from elastic_hvd import state_format
    out, run0 = tmp_path / "out", tmp_path / "run0"
    job = jobs.sbatch(fit(out, 3, env={"TEST_STEP_SLEEP": "0.3"}),
                      options=[*TWO_NODES, "--no-kill"])
    wait_steps(jobs, job, out, 10)  # mid-epoch 2
    sent = time.time()
    jobs.scancel(job, "--signal=USR1", "--batch")
    info = jobs.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"), 120)
    ended = time.time() - sent
    output = jobs.output(job)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "8:0"), (info, output[-4000:])
    assert not wait_nodes_clean(cluster, 60)
    ckpt = out / "ckpt"
    meta = json.loads((ckpt / "checkpoint.json").read_text())
    written = (ckpt / "checkpoint.json").stat().st_mtime - sent
    state = state_format.load(ckpt / meta["state"])
    last = {p.name: max(s["step"] for s in read_lines(p)) for p in out.glob("steps*.jsonl")}
    assert len(last) == 4 and set(last.values()) == {meta["step"]}, (last, meta)  # every rank
    assert (f"exit status 8: preempted: final checkpoint at step {meta['step']}; requeue "
            "resumes from it") in output, output[-4000:]
    assert_same_weights_every_step(out)
    digest = next(s["digest"] for s in steps_logged(out) if s["step"] == meta["step"])
    run0.mkdir()
    for path in out.glob("*.jsonl"):
        path.rename(run0 / path.name)

    again = jobs.sbatch(fit(out, 3, env={"TEST_STEP_SLEEP": "0.3"}),
                        options=[*TWO_NODES, "--no-kill"], name="again")
    info = jobs.wait_state(again, ("COMPLETED", "FAILED", "CANCELLED"), 300)
    output = jobs.output(again, "again")
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), output[-4000:]
    assert results(out)[0]["restored"] == {"step": meta["step"], "digest": digest}
    assert min(s["step"] for s in steps_logged(out)) == meta["step"] + 1  # 0 steps redone
    assert_same_weights_every_step(out)
    # exactly once across both jobs (as tests/test_preempt_signal.py checks it): run 0's
    # epochs before the interrupted one, the interrupted one's samples not in the
    # checkpoint's queue, then run 1's
    stopped, queue = state["sampler"]["epoch"], state["sampler"]["queue"]
    assert len(queue) == len(set(queue)) and 0 < len(queue) < SAMPLES, state["sampler"]
    per_epoch = {e: ids for e, ids in trained_ids(run0, []).items() if e < stopped}
    assert not set(trained_ids(run0, [])[stopped]) & set(queue)
    per_epoch[stopped] = sorted(set(range(SAMPLES)) - set(queue))
    for epoch, ids in trained_ids(out, []).items():
        per_epoch.setdefault(epoch, []).extend(ids)
    assert sorted(per_epoch) == [0, 1, 2], sorted(per_epoch)
    for epoch, ids in per_epoch.items():
        assert sorted(ids) == list(range(SAMPLES)), f"epoch {epoch}: not exactly once"
    measure(cluster, "SIGUSR1 to the batch shell (elastic-hvd-run): -> final checkpoint "
            "committed; -> job ended (exit 8)", checkpoint_s=round(written, 2),
            ended_s=round(ended, 2), step=meta["step"], step_sleep=0.3)
