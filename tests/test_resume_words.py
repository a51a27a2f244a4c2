"""What a run says about the checkpoint it starts from (issue 42, finding 8), on real
2-rank jobs run again in the same checkpoint directory (``workers/resume_words.py``).

Before: a finished run's directory made the next run train nothing and print "done",
and only after that (its stderr overtook by stdout) "resuming at epoch 3 from
ckpt-000001-e0002", with no word that nothing was left; a resumed run never said how
many epochs were left.
"""

import shutil

import pytest

from mpijob import run_job

pytestmark = pytest.mark.multirank


def fit(tmp_path, directory, epochs):
    return run_job("resume_words.py", epochs, directory, np=2, tmp_path=tmp_path, timeout=180)


def lines(job):
    return job.output.splitlines()


def batches(job):
    return [line for line in lines(job) if line.startswith("batch ")]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """The checkpoint directory of a run that trained all its 2 epochs."""
    tmp = tmp_path_factory.mktemp("finished")
    job = fit(tmp, tmp / "ckpt", 2)
    assert batches(job)[0] == "batch 1.1" and batches(job)[-1] == "batch 2.4", job.output[-3000:]
    assert "resuming" not in job.output and "nothing left" not in job.output, job.output[-3000:]
    return tmp / "ckpt"


def copy_of(finished, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(finished, directory)  # keeps its 0700
    return directory


def test_a_finished_runs_directory_says_nothing_is_left_and_exits_0(finished, tmp_path):
    directory = copy_of(finished, tmp_path)
    job = fit(tmp_path, directory, 2)  # the same run again: exit status 0 (run_job checks)
    said = [line for line in lines(job) if "nothing left to train" in line]
    assert len(said) == 1, job.output[-3000:]
    assert said[0].startswith("elastic_hvd: nothing left to train: the checkpoint "
                              "ckpt-000001-e0002 in "), said
    assert said[0].endswith(f"{directory} has trained 2 of 2 epochs; remove it or raise "
                            "epochs"), said
    assert batches(job) == [] and "done" not in lines(job), job.output[-3000:]
    assert "resuming" not in job.output, job.output[-3000:]


def test_a_resumed_run_says_where_and_how_much_is_left_before_it_trains(finished, tmp_path):
    directory = copy_of(finished, tmp_path)
    job = fit(tmp_path, directory, 5)
    said = [i for i, line in enumerate(lines(job)) if "resuming" in line]
    assert len(said) == 1, job.output[-3000:]  # once, by rank 0
    line = lines(job)[said[0]]
    assert line.startswith("elastic_hvd: resuming at epoch 3 of 5 from ckpt-000001-e0002 "
                           "(3 epochs left; "), line
    first = lines(job).index("batch 3.1")  # epochs 1 and 2 are not trained again
    assert said[0] < first and batches(job)[0] == "batch 3.1", job.output[-3000:]
    assert batches(job)[-1] == "batch 5.4" and lines(job)[-1] == "done", job.output[-3000:]
