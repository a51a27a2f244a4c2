"""elastic_hvd/runner/slurm.py without a cluster: the allocation as -H, the --no-kill check."""

import argparse

import pytest

from elastic_hvd.runner import slurm
from elastic_hvd.runner.launch import parser


@pytest.mark.parametrize("hostlist, names", [
    ("node[1-2]", ["node1", "node2"]),
    ("node[1-3,07],gpu[01-02]-a,login", ["node1", "node2", "node3", "node07", "gpu01-a",
                                         "gpu02-a", "login"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("single", ["single"]),
])
def test_host_lists_expand_as_slurm_writes_them(hostlist, names):
    assert slurm.expand_hostlist(hostlist) == names


def test_counts_expand():
    assert slurm.expand_counts("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ValueError):
        slurm.expand_counts("two")


ALLOC = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)",
         "SBATCH_NO_KILL": "1"}


def test_the_allocation_becomes_the_hosts_unless_the_user_named_some():
    args = slurm.at_start(parser().parse_args(["python", "x.py"]), ALLOC)
    assert args.hosts == "node1:2,node2:2"
    named = parser().parse_args(["-H", "a:1", "python", "x.py"])
    assert slurm.at_start(named, ALLOC).hosts == "a:1"
    via_mpi_args = parser().parse_args(["--mpi-args", "--hostfile f", "python", "x.py"])
    assert slurm.at_start(via_mpi_args, ALLOC).hosts is None
    outside = parser().parse_args(["python", "x.py"])
    assert slurm.at_start(outside, {}) is outside


def test_a_job_without_no_kill_is_warned_once(caplog, monkeypatch):
    monkeypatch.setattr(slurm, "batch_script", lambda job: "#!/bin/sh\n#SBATCH -N2\n")
    env = {k: v for k, v in ALLOC.items() if k != "SBATCH_NO_KILL"}
    slurm.at_start(argparse.Namespace(hosts=None, hostfile=None, host_discovery_script=None,
                                      mpi_args=None), env)
    assert [r.getMessage()[:61] for r in caplog.records] == [
        "elastic-hvd-run: Slurm job 7 was not seen to have --no-kill: "]


@pytest.mark.parametrize("script, seen", [
    ("#SBATCH --no-kill\n", True), ("#SBATCH -N2 -k\n", True), ("#SBATCH --no-kill=off\n", False),
    ("# --no-kill\n", False), ("#SBATCH -N2\n", False)])
def test_no_kill_is_read_from_the_batch_script(monkeypatch, script, seen):
    monkeypatch.setattr(slurm, "batch_script", lambda job: script)
    assert slurm.no_kill_seen({"SLURM_JOB_ID": "7"}) is seen
