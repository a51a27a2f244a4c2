"""Checkpoints never touch the committed files (issue 10).

The writer of a checkpoint is SIGKILLed at every point of a save: after the
weights file, after the optimizer file, after the fsyncs, just before the
metadata rename, just after it, during the deletion of old checkpoints.  Each
time, checkpoint.json and every file it references must be byte for byte what
they were before that save (or, after the rename, the new commit plus the
untouched previous one), the next writer must commit under fresh names, and
the newest committed checkpoint must restore to exactly what was saved.

* fast, single process: the file protocol with a forked writer SIGKILLed at each
  point, retention, fallback to an older checkpoint, metadata of another layout;
  ElasticCheckpoint without MPI (restore, a restarted job's save);
* 4-rank ``model.fit`` jobs (tests/workers/checkpoint_crash.py): three crash
  points per job (each kills the current writer: 4 -> 3 -> 2 -> 1 ranks), and the
  reported case: the old writer commits, dies, and the new one writes the final
  checkpoint (too few ranks) at the same epoch.
"""

import hashlib
import json
import os
import signal
import warnings

import pytest

from keras_callbacks.ckpt_files import CheckpointFiles

PRE_COMMIT = ("wrote weights", "wrote optimizer", "synced", "before commit")
POST_COMMIT = ("committed", "removed a file")


def before_commit(point):
    """Whether a crash point (``wrote <role>`` for any role) comes before the commit."""
    return point.startswith("wrote ") or point in PRE_COMMIT


# -- helpers shared by the single-process and the multi-rank tests -------------------
def sha(path):
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        return None


def committed_hashes(directory):
    """sha256 of checkpoint.json and of every file it references (either format)."""
    meta_path = os.path.join(directory, "checkpoint.json")
    if not os.path.exists(meta_path):
        return {}
    meta = json.loads(open(meta_path).read())
    names = set()
    for entry in [meta, *meta.get("older", [])]:
        names.update(entry.get("files", []))
        names.update(entry[k] for k in ("weights", "optimizer") if k in entry)
    return {"checkpoint.json": sha(meta_path),
            **{name: sha(os.path.join(directory, name)) for name in names}}


# -- the file protocol, one process ------------------------------------------------------
def text_part(text):
    def write(path):
        with open(path, "w") as f:
            f.write(text)
    return write


def write(files, seq, epoch, text=None):
    return files.write(seq, epoch, {"weights": ("weights.h5", text_part(text or f"w{seq}")),
                                    "optimizer": ("optimizer.npz", text_part(f"o{seq}"))},
                       {"epoch": epoch})


def read_texts(files):
    got = {}
    files.load(lambda e: got.update(
        {k: open(os.path.join(files.directory, e[k])).read() for k in ("weights", "optimizer")}))
    return got


@pytest.mark.parametrize("point", PRE_COMMIT + POST_COMMIT)
def test_forked_writer_sigkilled_at_each_point(tmp_path, point):
    files = CheckpointFiles(str(tmp_path), keep=2)
    for seq in range(3):  # two kept, one deleted, so that the crashing save deletes one too
        write(files, seq, seq + 1)
    before = committed_hashes(tmp_path)
    present = set(os.listdir(tmp_path))
    pid = os.fork()
    if pid == 0:  # the writer: dies at ``point`` of save 3 (reusing seq 1: names must differ)
        try:
            files.reached = lambda p: p == point and os.kill(os.getpid(), signal.SIGKILL)
            write(files, 1, 2, text="new")
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    after = committed_hashes(tmp_path)
    if point in PRE_COMMIT:
        assert after == before
        assert read_texts(files) == {"weights": "w2", "optimizer": "o2"}
    else:
        assert {k: v for k, v in after.items() if k in before and k != "checkpoint.json"} == \
            {k: v for k, v in before.items() if k != "checkpoint.json" and "000001" not in k}
        assert read_texts(files) == {"weights": "new", "optimizer": "o1"}
        assert not set(files.entries()[0]["files"]) & present
    write(files, 4, 5)  # the next writer commits and cleans up
    assert read_texts(files) == {"weights": "w4", "optimizer": "o4"}
    kept = {f for e in files.entries() for f in e["files"]}
    assert set(os.listdir(tmp_path)) == kept | {"checkpoint.json"}


def test_names_retention_and_restart(tmp_path):
    files = CheckpointFiles(str(tmp_path), keep=3)
    entries = [write(files, seq, seq + 1) for seq in range(5)]
    assert [e["name"] for e in files.entries()] == [e["name"] for e in entries[::-1][:3]]
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["checkpoint.json"] + [f for e in entries[2:] for f in e["files"]])
    # A restarted job counts on from the newest committed number; leftovers of a save
    # that never committed (same number) and committed names are never written over.
    assert CheckpointFiles.next_seq(files.entries()) == 5
    (tmp_path / "ckpt-000005-e0006.weights.h5").write_text("leftover")
    before = committed_hashes(tmp_path)
    fresh = write(CheckpointFiles(str(tmp_path), keep=3), 5, 6)
    assert fresh["name"] == "ckpt-000005-e0006-1"
    again = write(CheckpointFiles(str(tmp_path), keep=3), 4, 5)  # a counter gone wrong
    assert again["name"] == "ckpt-000004-e0005-1"
    for name, digest in before.items():  # unchanged, or deleted once beyond ``keep``
        assert sha(tmp_path / name) in (digest, None) or name == "checkpoint.json"
    assert [e["name"] for e in files.entries()] == \
        [again["name"], fresh["name"], "ckpt-000004-e0005"]
    assert not (tmp_path / "ckpt-000005-e0006.weights.h5").exists()  # leftover cleaned


def test_load_falls_back_to_an_older_checkpoint(tmp_path):
    files = CheckpointFiles(str(tmp_path), keep=3)
    write(files, 0, 1)
    newest = write(files, 1, 2)
    (tmp_path / newest["weights"]).write_text("truncated")
    with pytest.warns(UserWarning, match="trying an older one"):
        assert read_texts(files) == {"weights": "w0", "optimizer": "o0"}
    for name in os.listdir(tmp_path):
        if name.startswith("ckpt-000000"):
            os.remove(tmp_path / name)
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="weights.h5: missing"):
        read_texts(files)


def test_metadata_without_a_file_list_is_refused_clearly(tmp_path):
    # The layout of elastic_hvd before its commit protocol (issue 10) is not read: the
    # error names the file instead of loading a checkpoint of unknown parts.
    (tmp_path / "checkpoint.json").write_text(json.dumps(
        {"epoch": 1, "weights": "epoch0001-0.weights.h5", "sampler": None}))
    with pytest.raises(ValueError, match="checkpoint.json: a checkpoint without its list of files"):
        CheckpointFiles(str(tmp_path), keep=2).entries()


# -- ElasticCheckpoint in one process (no MPI: that process writes) ------------------
def make_model(tf):
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1, momentum=0.5), loss="mse")
    return model


def values(model):
    """The model's weights and its optimizer's variables, as arrays."""
    from elastic_hvd.tensorflow.optimizer_state import optimizer_variables
    return model.get_weights() + [v.numpy() for v in optimizer_variables(model.optimizer)]


def test_elastic_checkpoint_restores_newest_and_a_restart_writes_fresh_names(tmp_path):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf
    from keras_callbacks import ElasticCheckpoint

    model = make_model(tf)
    checkpoint = ElasticCheckpoint(str(tmp_path), keep=2)
    checkpoint.set_model(model)
    x, y = np.ones((8, 4), np.float32), np.ones((8, 1), np.float32)
    for epoch in range(3):
        model.fit(x, y, verbose=0)
        checkpoint.save(epoch + 1)
    assert checkpoint.saves == 3 and len(checkpoint.files.entries()) == 2
    fresh = make_model(tf)
    restarted = ElasticCheckpoint(str(tmp_path), keep=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert restarted.restore(fresh) == 3
    assert not [w for w in caught if "Skipping variable loading" in str(w.message)]
    for a, b in zip(values(model), values(fresh)):
        np.testing.assert_array_equal(a, b)
    assert restarted.saves == 3  # counts on from the checkpoint
    before, present = committed_hashes(tmp_path), set(os.listdir(tmp_path))
    restarted.set_model(fresh)
    restarted.save(3)  # the same epoch again (a restarted job's final checkpoint)
    newest = restarted.files.entries()[0]
    assert not set(newest["files"]) & present
    assert all(committed_hashes(tmp_path)[name] == digest for name, digest in before.items()
               if name in newest["files"] or name in restarted.files.entries()[1]["files"])


# -- real 4-rank model.fit jobs ---------------------------------------------------------
def read_log(out):
    return [json.loads(line) for line in open(out / "ckpt_log.jsonl")]


def test_the_checkpoint_writer_keeps_no_memory_per_save_and_its_weights_file_loads(tmp_path):
    """Keras 3 leaks ~70 kB at each ``save_weights`` of a compiled model (a reference
    optimizer built at each save: keras_callbacks.keras_leaks); the writer saves every epoch.
    300 saves through ElasticCheckpoint keep < 4 MB (21 MB with the leak), and the weights
    file still holds what Keras' own load_weights needs: model and optimizer variables."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import gc

    import numpy as np
    import tensorflow as tf
    from keras_callbacks import ElasticCheckpoint

    def rss_kb():
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))

    model = make_model(tf)
    model.fit(np.ones((8, 4), np.float32), np.ones((8, 1), np.float32), verbose=0)
    checkpoint = ElasticCheckpoint(str(tmp_path), keep=1)
    checkpoint.set_model(model)
    for epoch in range(30):  # warm-up
        checkpoint.save(epoch + 1)
    gc.collect()
    before = rss_kb()
    for epoch in range(30, 330):
        checkpoint.save(epoch + 1)
    gc.collect()
    assert rss_kb() - before < 4096, f"{rss_kb() - before} kB kept by 300 saves"
    fresh = make_model(tf)
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.load_weights(os.path.join(tmp_path, checkpoint.files.entries()[0]["weights"]))
    for a, b in zip(values(model), values(fresh)):
        np.testing.assert_array_equal(a, b)


def check_saves(records):
    """The invariants over every save of a job, from the writers' logs."""
    befores = {r["seq"]: r for r in records if r["kind"] == "before"}
    afters = {r["seq"]: r for r in records if r["kind"] == "after"}
    crashes = {r["seq"]: r["point"] for r in records if r["kind"] == "crash"}
    first_hash = {}
    for r in records:  # a committed file's name always holds the same bytes
        for name, digest in r.get("snap", {}).get("hashes", {}).items():
            assert digest is not None, f"save {r['seq']}: committed {name} is missing"
            if name != "checkpoint.json":
                assert first_hash.setdefault(name, digest) == digest, \
                    f"save {r['seq']} ({r['kind']}): committed file {name} was rewritten"
    for seq, after in afters.items():  # a save writes fresh names only
        reused = set(after["snap"]["newest"]) & set(befores[seq]["present"])
        assert not reused, f"save {seq} wrote over existing files {reused}"
    for seq, point in crashes.items():
        if seq + 1 not in befores:
            continue  # the job ended with that save (final checkpoint): see the caller
        before, later = befores[seq]["snap"], befores[seq + 1]["snap"]
        if before_commit(point):
            assert later == before, f"save {seq} died at {point!r}: the commit changed"
        else:
            assert later["seq"] == seq, f"save {seq} died at {point!r} after committing"
            newest = {n: before["hashes"][n] for n in before["newest"]}
            assert {n: later["hashes"].get(n) for n in newest} == newest
            assert not set(later["newest"]) & set(befores[seq]["present"])
    saved = {seq: (r["digest"], r["optimizer"], r["epoch"]) for seq, r in befores.items()}
    for seq, r in befores.items():  # the committed checkpoint restores what was saved
        if r["loaded"] is not None:
            committed = r["snap"]["seq"]
            assert (r["loaded"]["digest"], r["loaded"]["optimizer"], r["loaded"]["epoch"]) == \
                saved[committed], f"save {seq}: checkpoint {committed} restores other values"
    return befores, crashes


JOBS = {
    "before_commit": ("wrote state", "wrote weights", "synced"),
    "around_commit": ("before commit", "committed", "removed a file"),
}


@pytest.mark.multirank
@pytest.mark.parametrize("job", [pytest.param("before_commit", marks=pytest.mark.check),
                                 "around_commit"])
def test_writer_sigkilled_at_each_point_of_a_save(tmp_path, job):
    """Saves 0..6 (epochs 1..7, keep=2); the writers of saves 1, 3 and 5 die at the
    job's three points, so the old writer has committed and the next one takes over."""
    from mpijob import run_job
    plan = ";".join(f"{seq}:{point}" for seq, point in zip((1, 3, 5), JOBS[job]))
    result = run_job("checkpoint_crash.py", 7, np=4, tmp_path=tmp_path, timeout=240,
                     env={"TEST_CRASH_PLAN": plan, "TEST_KEEP": "2"})
    befores, crashes = check_saves(read_log(tmp_path / "out"))
    assert crashes == dict(zip((1, 3, 5), JOBS[job])), result.output[-3000:]
    assert [befores[s]["writer"] for s in range(7)] == [0, 0, 1, 1, 2, 2, 3]
    assert sorted(result.results) == [3]
    final = result.results[3]
    assert final["size"] == 1 and final["final_epoch"] == 7 and final["saves"] == 7
    assert final["final_weights_equal"] and final["final_optimizer_equal"]
    assert final["skipped"] == []


@pytest.mark.multirank
def test_new_writer_of_the_final_checkpoint_dies_too(tmp_path):
    """The reported case: rank 0 commits epoch 1 (save 0) and dies in epoch 2; too few
    ranks are left (--min-np 4), so the new writer writes the final checkpoint at the
    same resume epoch (1), and dies after its weights file.  Before issue 10 its file
    names were those of the committed checkpoint."""
    from mpijob import run_job
    run_job("checkpoint_crash.py", 3, np=4, tmp_path=tmp_path, timeout=240,
            faults="rank=0,step=9", launcher=["--min-np", "4"], expect_rc=None,
            env={"TEST_CRASH_PLAN": "1:wrote weights"})
    directory = tmp_path / "out" / "ckpt"
    befores, crashes = check_saves(read_log(tmp_path / "out"))
    assert crashes == {1: "wrote weights"} and befores[1]["writer"] == 1
    assert committed_hashes(directory) == befores[1]["snap"]["hashes"]
    # The committed checkpoint restores what rank 0 saved, and a job restarted from it
    # (here: this process) writes under fresh names, leaving it as it is.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    from keras_callbacks import ElasticCheckpoint
    model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(8, activation="tanh"),
                                 tf.keras.layers.Dense(1)])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1, momentum=0.5), loss="mse")
    restarted = ElasticCheckpoint(str(directory))
    assert restarted.restore(model) == 1
    digest = hashlib.sha256(b"".join(w.tobytes() for w in model.get_weights())).hexdigest()
    assert digest == befores[0]["digest"]
    present, before = set(os.listdir(directory)), committed_hashes(directory)
    restarted.set_model(model)
    restarted.save(1)
    assert not set(restarted.files.entries()[0]["files"]) & present
    after = committed_hashes(directory)
    assert all(after[name] == digest for name, digest in before.items()
               if name != "checkpoint.json")
