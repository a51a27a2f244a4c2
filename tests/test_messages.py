"""What a user reads (issue 21): one line per membership change on rank 0, for every
kind of script; failures reported once for the whole job, each from the launcher,
which tells raised, crashed and killed apart; a mismatch that names each rank's
call; no TensorFlow start-up noise, no Keras warnings from inside the library, no
progress-bar redraws in a log.

Real jobs with hard timeouts; ranks die by real SIGKILLs (the fault plan), a real
segfault, real exceptions.
"""

import io
import platform
import re

import pytest

from elastic_hvd.core import announce, process
from elastic_hvd.core.errors import MismatchError
from elastic_hvd.core.membership import MembershipEvent
from elastic_hvd.runner import reports
from elastic_hvd.runner.console import NoiseFilter
from mpijob import run_job

#: What ``import tensorflow`` printed on every rank (measured, TF 2.21 on x86).
ABSL = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
ONEDNN = (b"I0000 00:00:1796439562.233657   11124 port.cc:153] oneDNN custom operations are on. "
          b"You may see slightly different numerical results due to floating-point round-off "
          b"errors from different computation orders. To turn them off, set the environment "
          b"variable `TF_ENABLE_ONEDNN_OPTS=0`.\n")


def changes(output):
    """The membership lines of a job's output."""
    return [line for line in output.splitlines() if line.startswith("[elastic_hvd ")]


# -- units ---------------------------------------------------------------------------------
def test_mismatch_names_each_ranks_op_dtype_and_real_shape():
    # Before: "rank 0: ('allreduce', '<f4', ((2, 3),), 0, 1.0, 1.0, 1048576)".
    text = str(MismatchError([("allreduce", "<f4", ((2, 3),), 0, 1.0, 1.0, 1 << 20, (1,)),
                              ("allreduce", "<f4", ((3, 2),), 0, 1.0, 1.0, 1 << 20, (1,))],
                             ["grad_x", "grad_x"]))
    assert text == ("ranks disagree on the collective they called (they differ in: shape):\n"
                    "  rank 0: allreduce name='grad_x' dtype=float32 shape=(2, 3) op=Average\n"
                    "  rank 1: allreduce name='grad_x' dtype=float32 shape=(3, 2) op=Average")
    bf16 = str(MismatchError([
        ("allreduce", "<f4", ("bfloat16", (4,), (2, 2)), 1, 1.0, 2.0, 8, (2,)),
        ("allreduce", "<f4", ((4,), (2, 2)), 1, 1.0, 1.0, 8, (2,))]))
    assert "they differ in: dtype, postscale_factor" in bf16
    assert "dtype=bfloat16 (reduced as float32) shape=[(4,), (2, 2)] (2 tensors) op=Sum " \
        "postscale_factor=2.0" in bf16
    # 200 fused shapes: said from the first that differs, equal neighbours counted
    many = [("allreduce", "<f4", ((8,),) * 150 + (last,) + ((8,),) * 49, 1, 1.0, 1.0, 8, cut)
            for last, cut in (((8,), (1,) * 200), ((9,), (1,) * 200), ((8,), (200,)))]
    text = str(MismatchError(many[:2]))
    assert "rank 0: allreduce dtype=float32 shape=[from tensor 150: (8,) x50] (200 tensors)" in text
    assert "rank 1: allreduce dtype=float32 shape=[from tensor 150: (9,), (8,) x49] (200 tensors)" \
        in text
    # the same tensors cut into other buffers (another HOROVOD_FUSION_THRESHOLD)
    text = str(MismatchError([many[0], many[2]]))
    assert "(they differ in: tensors_per_buffer)" in text
    assert "shape=[(8,) x200] (200 tensors) op=Sum tensors_per_buffer=(1 x200)\n" in text
    assert text.endswith("tensors_per_buffer=(200)")
    kinds = str(MismatchError([("broadcast", "<i8", (3,), 1), ("barrier",)], ["w", ""]))
    assert "(they differ in: the collective)" in kinds
    assert "rank 0: broadcast name='w' dtype=int64 shape=(3,) root_rank=1\n  rank 1: barrier" \
        in kinds


def test_a_change_is_said_with_what_each_time_measures(monkeypatch):
    monkeypatch.setattr(process.runtime(), "effects", {})  # a script that does nothing about it
    class Hosts:  # where a job's processes ran: all the line needs of the communicator
        spares_left = 0
        ids = (0, 2, 4, 5)  # the ranks' ids now (after the join below)

        def hosts(self):
            return ["a", "b"]

        def host_of(self, i):
            return "ab"[i % 2]

    loss = MembershipEvent(4, 2, lost=(1, 3), detect_s=0.0412, repair_s=0.0003,
                           during="HorovodGradients")
    assert announce.describe(loss, Hosts(), 40, before=(0, 1, 2, 3)) == (
        "lost ranks 1, 3 on b after 40 training steps: 4 -> 2 ranks; the failure was agreed "
        "41 ms after rank 0 entered the collective it interrupted (HorovodGradients), and the "
        "repair (revoke + shrink) took 0.3 ms")
    assert announce.consequences(loss, Hosts())[-1].startswith(
        "the learning rate was not changed (hvd.fit with hvd.ElasticData")
    join = MembershipEvent(2, 4, gained=(4, 5), spawn_s=1.25, repair_s=12.0)
    assert announce.describe(join, Hosts()) == (
        "gained ranks 2 (id 4), 3 (id 5) on a, b: 2 -> 4 ranks; the ranks spent 1.2 s starting "
        "them (spawn, or connecting a hot spare), and they joined 12.0 s after that began, "
        "while training went on")

    class OneHost(Hosts):  # the lost rank's host is not known: still a one-host job
        def hosts(self):
            return ["a"]

        def host_of(self, i):
            return None if i == 3 else "a"

    alone = MembershipEvent(4, 3, lost=(3,), detect_s=0.0412, repair_s=0.0003)
    assert announce.describe(alone, OneHost(), 40, before=(0, 1, 2, 3)).startswith(
        "lost rank 3 after 40 training steps")


def test_tensorflows_start_up_lines_are_dropped_and_nothing_else():
    noise = NoiseFilter()
    ours = b"Fruits 360: 12 classes\nI am a line of the program\n"
    assert noise.feed(ABSL + ONEDNN + ours + ABSL) == ours
    # Split anywhere, a noise line is still recognized; an incomplete line of another
    # kind (a progress bar) passes at once, the rest of it when it comes.
    assert noise.feed(ONEDNN[:30]) == b"" and noise.holding
    assert noise.feed(ONEDNN[30:] + b"  3/10 [===") == b"  3/10 [==="
    assert noise.feed(b"===]\n") == b"===]\n"
    # A held incomplete line goes out when the stream pauses, and its end follows.
    assert noise.feed(b"Images") == b"" and noise.flush() == b"Images"
    assert noise.feed(b" loaded\n") == b" loaded\n"


def test_the_launcher_reports_a_failure_once_per_place():
    out = io.StringIO()
    reporter = reports.Reporter(out=out)

    def raised(i, where, text="ValueError: bad"):
        return {"process": f"h-{i}", "id": i, "rank": i, "code": None, "raised": text,
                "stack": [where], "traceback": f"Traceback ...\n{text}\n"}

    reporter.news([raised(1, "a.py:3", "ValueError: worse\nsee"), raised(0, "a.py:3"),
                   raised(2, "b.py:9"), raised(4, "a.py:3"),
                   {"process": "h-3", "id": 3, "rank": 3, "code": 0}])
    reporter.news([raised(0, "a.py:3")])  # told already
    assert out.getvalue() == (
        "elastic-hvd-run: rank 0 raised an uncaught exception and left the job:\n"
        "Traceback ...\nValueError: bad\n"
        "elastic-hvd-run: rank 1 raised ValueError: worse ..., at the same place as rank 0\n"
        "elastic-hvd-run: rank 2 raised an uncaught exception and left the job:\n"
        "Traceback ...\nValueError: bad\n"
        "elastic-hvd-run: rank 4 raised the same at the same place as rank 0\n")
    killed = {"code": None}
    assert reports.lost_words([raised(0, "x"), raised(1, "x")]) == \
        "2 ranks raised an uncaught exception"
    assert reports.lost_words([raised(0, "x"), {"code": None, "crashed": "Aborted"}, killed,
                               killed]).startswith(
        "4 ranks were lost: 1 raised an uncaught exception, 1 crashed (Aborted), 2 were killed")


# -- jobs ------------------------------------------------------------------------------------
@pytest.mark.multirank
@pytest.mark.parametrize("announce", [True, False])
def test_a_plain_horovod_script_says_it_lost_a_rank(tmp_path, monkeypatch, announce):
    # Before: the job lost rank 1, finished on 2 ranks with status 0, and said nothing.
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)  # as on a fresh machine
    job = run_job("messages.py", "plain", np=3, faults="rank=1,coll=30", tmp_path=tmp_path,
                  timeout=180, env={} if announce else {"ELASTIC_HVD_ANNOUNCE": "0"})
    if not announce:
        assert changes(job.output) == [], job.output[-3000:]
        return
    [line] = changes(job.output)
    for words in ("lost rank 1 after ", "3 -> 2 ranks",
                  "ms after rank 0 entered the collective it interrupted (HorovodGradients)",
                  "repair (revoke + shrink) took ", "the lost rank's data shard is not trained "
                  "for the rest of this run", "the learning rate was not changed (hvd.fit"):
        assert words in line, line
    # And nothing of TensorFlow's start-up (before: 2 lines per rank).
    assert "absl::InitializeLog" not in job.output and "oneDNN" not in job.output, job.output


@pytest.mark.multirank
def test_hvd_fit_says_each_change_and_keras_stays_quiet(tmp_path):
    # hvd.fit without events= (before: silent), a spare adopted (before: Keras warned in
    # it: "`shuffle=True` was passed..." and "Your input ran out of data"), output to a
    # pipe without verbose= (before: a progress bar's redraws).
    job = run_job("messages.py", "fit", 12, np=3, launcher=["--spares", "1"],
                  faults="rank=1,step=20", tmp_path=tmp_path, timeout=300)
    lines = changes(job.output)
    assert len(lines) == 2, job.output[-4000:]
    assert "lost rank 1 in epoch 1, step 20: 3 -> 2 ranks; " in lines[0], lines
    assert "the samples the lost rank had not trained go back into the epoch; the rest of the " \
           "epoch is split over 2 ranks" in lines[0], lines[0]
    assert "the learning rate is scaled by 0.667 (linear) at the next step" in lines[0]
    assert "gained rank 2 (id 3) " in lines[1] and "2 -> 3 ranks" in lines[1], lines[1]
    assert "the learning rate is scaled by 1.5 (linear)" in lines[1], lines[1]
    for warning in ("shuffle=True", "ran out of data", "UserWarning"):
        assert warning not in job.output, job.output[-4000:]
    assert "\r" not in job.output and "\x08" not in job.output  # no redraws
    assert job.output.count("Epoch 12/12") == 1 and "/step - loss: " in job.output


@pytest.mark.multirank
def test_every_rank_raising_is_reported_once(tmp_path):
    # Before: three interleaved tracebacks, each rank claiming "the other ranks continue
    # without it", and "all 3 ranks were lost (killed or crashed)".
    job = run_job("messages.py", "raise_all", np=3, tmp_path=tmp_path, timeout=120, expect_rc=1)
    out = job.output
    assert out.count("Traceback (most recent call last)") == 1, out
    assert "elastic-hvd-run: rank 0 raised an uncaught exception and left the job:\n" \
           "Traceback (most recent call last):\n  File " in out, out
    assert "ValueError: the data of rank 0 is bad" in out
    for rank in (1, 2):
        assert (f"elastic-hvd-run: rank {rank} raised ValueError: the data of rank {rank} is bad, "
                "at the same place as rank 0\n") in out, out
    assert "stops on an uncaught exception" not in out and "continue without it" not in out
    assert out.rstrip().endswith("no rank completed: all 3 ranks raised an uncaught exception "
                                 "(mpirun exit status 0)"), out


@pytest.mark.multirank
def test_a_crash_is_named_and_the_others_go_on(tmp_path):
    job = run_job("messages.py", "crash", 1, np=3, tmp_path=tmp_path, timeout=120)
    out = job.output
    assert "elastic-hvd-run: world rank 1 crashed (Segmentation fault) and left the job; its " \
           "Python stack:\nCurrent thread " in out, out
    assert "messages.py\", line " in out  # where, in the program
    [line] = changes(out)
    assert line.split("] ", 1)[1].startswith("lost rank 1: 3 -> 2 ranks; "), out


@pytest.mark.multirank
def test_a_mismatch_names_each_call_once(tmp_path, monkeypatch):
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    job = run_job("messages.py", "mismatch", np=2, tmp_path=tmp_path, timeout=120, expect_rc=1)
    out = job.output
    assert out.count("Traceback (most recent call last)") == 1, out
    assert ("ranks disagree on the collective they called (they differ in: shape):\n"
            "  rank 0: allreduce name='grad_x' dtype=float32 shape=(2, 3) op=Average\n"
            "  rank 1: allreduce name='grad_x' dtype=float32 shape=(3, 2) op=Average") in out, out
    assert "elastic-hvd-run: rank 1 raised the same at the same place as rank 0\n" in out, out
    assert "all 2 ranks raised an uncaught exception" in out
    assert "absl::InitializeLog" not in out and "oneDNN" not in out, out


@pytest.mark.multirank
@pytest.mark.skipif(platform.machine() != "x86_64", reason="TF logs oneDNN on x86 only")
def test_tensorflows_logs_come_back_when_the_user_sets_its_level(tmp_path):
    job = run_job("messages.py", "mismatch", np=2, tmp_path=tmp_path, timeout=120, expect_rc=1,
                  env={"TF_CPP_MIN_LOG_LEVEL": "0"})
    # absl's warning comes with TF's first start-up line, whichever the CPU makes it
    # print: oneDNN's on an Intel CPU that TF turns oneDNN on for, cpu_feature_guard's
    # on an AMD EPYC without AVX-512 (seen here: no oneDNN line at all).
    assert "absl::InitializeLog() is called are written to STDERR" in job.output, job.output
    assert re.search(r"^I\d{4} [\d:.]+ +\d+ [\w.+-]+:\d+\] ", job.output, re.M), job.output
