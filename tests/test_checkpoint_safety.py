"""Checkpoints and the launcher's copy of the state cannot run code (issue 21).

A checkpoint directory is shared, copied and downloaded: whoever can write into
it must not get code run by ``restore()``.  The tests plant a pickle whose
unpickling creates a marker file wherever a state is read -- in place of a
checkpoint's state file (checkpoint.json's record of its size fixed, as someone
who owns the directory would), as a state file checkpoint.json names anew, as
the launcher's copy of the state -- and check that restore refuses it naming the
file, or passes it by, and that the marker never appears.  Truncated or garbled
files give an error naming the file.  One process, no MPI.

Nothing another local user plants is followed or trusted (issue 41): a link at the
old, guessable temporary name of the metadata; a symlink (to /dev/zero or to a
valid copy), FIFO, directory or oversized file in place of checkpoint.json or of
the state file (read in a forked child with capped memory and a deadline, so that
the old code's endless read or wait fails the test instead of the machine); a
directory of another user (uid 65534, via setpriv) or writable by others.  Files
are 0600 in a 0700 directory.  A fuzz of checkpoint.json (truncations, bit flips,
values of every other type, huge numbers) gives restore() or the documented
ValueError, nothing else.
"""

import json
import os
import pickle
import re
import zipfile

import numpy as np
import pytest

from second_user import as_nobody, reachable_dir

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

OPT_IN = "ELASTIC_HVD_UNPICKLE_CHECKPOINTS"


class Plant:
    """Unpickling this creates ``path``: it stands for any code a pickle can run."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "marker"
    yield path
    assert not path.exists(), "reading the state ran the planted code"


@pytest.fixture
def settings(monkeypatch):
    """Set environment variables and reload elastic_hvd's settings; reloaded once more
    at the end (the settings are cached for the process)."""
    from elastic_hvd.core import config

    def set_env(**env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        config.load()
    yield set_env
    monkeypatch.undo()
    config.load()


def make_model():
    import tensorflow as tf
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1, momentum=0.5), loss="mse")
    return model


def saved(directory, epochs=1):
    """A model trained a little and checkpointed after each of ``epochs`` epochs."""
    from keras_callbacks import ElasticCheckpoint
    model = make_model()
    checkpoint = ElasticCheckpoint(str(directory), keep=3)
    checkpoint.set_model(model)
    for epoch in range(epochs):
        model.fit(np.ones((8, 4), np.float32), np.ones((8, 2), np.float32), verbose=0)
        checkpoint.save(epoch + 1)
    return model


def plant(directory, content, name=None):
    """Put ``content`` in the newest checkpoint's state file (or in a new file ``name``
    that checkpoint.json names instead), with checkpoint.json's sizes to match.
    Returns the file's path."""
    meta_path = directory / "checkpoint.json"
    meta = json.loads(meta_path.read_text())
    old = meta["state"]
    if name is not None:
        meta["state"] = name
        meta["files"] = [name if f == old else f for f in meta["files"]]
    (directory / meta["state"]).write_bytes(content)
    meta["sizes"] = {f: os.path.getsize(directory / f) for f in meta["files"]}
    meta_path.write_text(json.dumps(meta))
    return directory / meta["state"]


def restore(directory):
    from keras_callbacks import ElasticCheckpoint
    model = make_model()
    return ElasticCheckpoint(str(directory)).restore(model), model


@pytest.mark.parametrize("name", [None, "ckpt-000000-e0001.state.pkl"],
                         ids=["in place of the state file", "as a .pkl file"])
def test_a_pickle_planted_as_the_state_is_never_run(tmp_path, marker, name):
    saved(tmp_path)
    path = plant(tmp_path, pickle.dumps(Plant(marker)), name)
    with pytest.warns(UserWarning, match="unreadable"), \
            pytest.raises(ValueError, match=re.escape(str(path))) as caught:
        restore(tmp_path)
    if name is not None:  # a pickled state is refused, and the opt-in named
        assert OPT_IN in str(caught.value)


def test_a_tampered_newest_checkpoint_is_passed_by_for_an_older_one(tmp_path, marker):
    model = saved(tmp_path, epochs=2)
    path = plant(tmp_path, pickle.dumps(Plant(marker)))
    model.fit(np.ones((8, 4), np.float32), np.ones((8, 2), np.float32), verbose=0)
    with pytest.warns(UserWarning, match=f"{re.escape(path.name)}: .*trying an older one"):
        epoch, _ = restore(tmp_path)
    assert epoch == 1


@pytest.mark.parametrize("damage", ["truncated", "garbled", "compressed", "object array"])
def test_a_damaged_state_file_is_an_error_naming_it(tmp_path, marker, damage):
    saved(tmp_path)
    meta = json.loads((tmp_path / "checkpoint.json").read_text())
    content = (tmp_path / meta["state"]).read_bytes()
    if damage == "truncated":
        content = content[:len(content) // 2]
    elif damage == "garbled":
        content = content.replace(b'"dtype": "float32"', b'"dtype": "float64"', 1)
    else:  # an archive of this layout, with one member deflated or made of pickles
        rebuilt = tmp_path / "rebuilt.npz"
        with zipfile.ZipFile(tmp_path / meta["state"]) as old, \
                zipfile.ZipFile(rebuilt, "w") as new:
            for info in old.infolist():
                data = old.read(info)
                if info.filename == "0.npy":
                    if damage == "compressed":
                        new.writestr(info.filename, data, zipfile.ZIP_DEFLATED)
                        continue
                    with new.open(info.filename, "w") as member:
                        np.lib.format.write_array(
                            member, np.array([Plant(marker)], dtype=object), allow_pickle=True)
                    continue
                new.writestr(info.filename, data)
        content = rebuilt.read_bytes()
    path = plant(tmp_path, content)
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=re.escape(str(path))):
        restore(tmp_path)


def test_a_truncated_checkpoint_json_is_an_error_naming_it(tmp_path):
    saved(tmp_path)
    meta = tmp_path / "checkpoint.json"
    meta.write_text(meta.read_text()[:40])
    with pytest.raises(ValueError, match=re.escape(str(meta))):
        restore(tmp_path)


def test_a_pickled_checkpoint_is_refused_then_read_once_with_the_opt_in(tmp_path, settings):
    """A checkpoint of the pickle format (before issue 21): refused by default; read with
    the opt-in, after which the next save writes data."""
    from elastic_hvd import state_format
    from keras_callbacks import ElasticCheckpoint
    model = saved(tmp_path)
    meta = json.loads((tmp_path / "checkpoint.json").read_text())
    state = state_format.load(tmp_path / meta["state"])
    os.remove(tmp_path / meta["state"])
    path = plant(tmp_path, pickle.dumps(state), "ckpt-000000-e0001.state.pkl")
    settings()
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=OPT_IN) as caught:
        restore(tmp_path)
    assert str(path) in str(caught.value)
    settings(**{OPT_IN: "1"})
    fresh = make_model()
    checkpoint = ElasticCheckpoint(str(tmp_path))
    assert checkpoint.restore(fresh) == 1
    for a, b in zip(model.get_weights(), fresh.get_weights()):
        np.testing.assert_array_equal(a, b)
    checkpoint.set_model(fresh)
    checkpoint.save(1)
    assert checkpoint.files.entries()[0]["state"].endswith(".state.npz")


# -- the launcher's copy of the state (elastic_hvd.state_replica) ----------------------
@pytest.fixture
def keeper(monkeypatch):
    """A real keeper on this host, and this process set up as a rank of a relaunched job."""
    from elastic_hvd import state_replica
    kept = state_replica.Keeper(host="127.0.0.1")
    for name, value in {**kept.environ(), state_replica.LAUNCH_ENV: "1"}.items():
        monkeypatch.setenv(name, value)
    yield kept
    kept.close()


def test_a_pickle_as_the_launchers_copy_is_never_run(tmp_path, marker, keeper, capfd):
    from elastic_hvd import state_replica
    saved(tmp_path)
    state_replica.put([10 ** 6], pickle.dumps(Plant(marker)))
    epoch, _ = restore(tmp_path)  # from the checkpoint on disk
    assert epoch == 1
    assert "ignoring the launcher's copy of the state" in capfd.readouterr().err


def test_the_launchers_copy_is_read_as_data(tmp_path, keeper, capfd):
    """A copy that is data is taken (it is newer than the checkpoint); the same copy
    truncated is passed by, with the reason."""
    from elastic_hvd import state_format, state_replica
    from elastic_hvd.tensorflow.training_state import TrainingState
    saved(tmp_path)
    model = make_model()
    model.fit(np.ones((8, 4), np.float32), np.zeros((8, 2), np.float32), verbose=0)
    state = TrainingState(model).state(1)
    state["session"] = {"step": 7, "lr_factor": 1.0, "applied": {}}
    blob = state_format.dumps(state)
    state_replica.put([7], blob[:len(blob) - 100])
    assert restore(tmp_path)[0] == 1
    assert "ignoring the launcher's copy of the state" in capfd.readouterr().err
    state_replica.put([8], blob)
    epoch, restored = restore(tmp_path)
    assert epoch == 1 and "from the launcher's copy of step 7" in capfd.readouterr().out
    for a, b in zip(model.get_weights(), restored.get_weights()):
        np.testing.assert_array_equal(a, b)


# -- the format itself ----------------------------------------------------------------
def test_the_format_keeps_values_and_dtypes():
    import ml_dtypes
    from elastic_hvd import state_format
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array(3, np.int64),
              np.zeros((0, 4), np.float16), np.array([True, False]),
              np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)]
    state = {"format": 1, "epoch": None, "lr": float("nan"), "model": arrays,
             "momentum": (0.9, None), "sampler": {"queue": [np.int64(3), 4], "step": 2},
             "values": {"name": "x", "nested": [{"a": np.float32(0.5)}]}}
    back = state_format.loads(state_format.dumps(state), "test")
    for a, b in zip(arrays, back["model"]):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    assert back["momentum"] == [0.9, None] and np.isnan(back["lr"])
    assert back["sampler"] == {"queue": [3, 4], "step": 2}
    assert back["values"] == {"name": "x", "nested": [{"a": 0.5}]}
    assert type(back["values"]["nested"][0]["a"]) is np.float32


@pytest.mark.parametrize("value, where", [
    (object(), "state['values']['bad']"),
    ({1: "int key"}, "state['values']['bad']"),
    (np.array([None], dtype=object), "state['values']['bad']"),
    ([b"bytes"], "state['values']['bad'][0]"),
])
def test_values_that_are_not_data_are_refused_naming_where(value, where):
    from elastic_hvd import state_format
    with pytest.raises(ValueError) as caught:
        state_format.dumps({"values": {"ok": 1, "bad": value}})
    assert str(caught.value).startswith(where)


def test_every_truncation_is_an_error_naming_the_source():
    from elastic_hvd import state_format
    blob = state_format.dumps({"a": np.arange(3.0), "b": [1, {"c": "d"}]})
    for end in range(len(blob)):
        with pytest.raises(state_format.StateFileError, match="^the copy: "):
            state_format.loads(blob[:end], "the copy")


def test_file_names_reaching_outside_the_directory_are_refused(tmp_path):
    """checkpoint.json names the files that a save deletes once they are past ``keep``:
    a name with a directory in it would delete a file outside the checkpoints."""
    from keras_callbacks import ElasticCheckpoint
    directory = tmp_path / "ckpt"
    model = saved(directory)
    victim = tmp_path / "victim"
    victim.write_text("not a checkpoint")
    meta_path = directory / "checkpoint.json"
    meta = json.loads(meta_path.read_text())
    meta["older"] = [{"name": "x", "seq": 0, "epoch": 0, "files": ["../victim"]}]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=re.escape(str(meta_path))):
        restore(directory)
    checkpoint = ElasticCheckpoint(str(directory), keep=1)
    checkpoint.set_model(model)
    with pytest.raises(ValueError, match="not plain file names"):
        checkpoint.save(2)
    assert victim.read_text() == "not a checkpoint"


# -- links, special files, other users' directories, malformed metadata (issue 41) ------
def bounded(fn, seconds=30, memory=1 << 30):
    """``fn()`` in a forked child whose address space may grow by ``memory`` bytes at most
    and which is killed after ``seconds``: ``["returned", repr]``, ``["raised", type name,
    message]`` or ``["hung"]``.  A reader that follows /dev/zero or waits on a FIFO fails
    the test instead of taking the machine's memory or the test run's time."""
    import resource
    import signal
    import time
    readable, writable = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(readable)
            with open("/proc/self/status") as status:
                used = next(int(line.split()[1]) for line in status
                            if line.startswith("VmSize")) * 1024
            resource.setrlimit(resource.RLIMIT_AS, (used + memory, used + memory))
            try:
                outcome = ["returned", repr(fn())]
            except BaseException as exc:  # noqa: BLE001 -- reported to the parent
                outcome = ["raised", type(exc).__name__, str(exc)]
            os.write(writable, json.dumps(outcome).encode())
        finally:
            os._exit(0)
    os.close(writable)
    deadline = time.monotonic() + seconds
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(readable)
            return ["hung"]
        time.sleep(0.02)
    with os.fdopen(readable, "rb") as pipe:
        return json.loads(pipe.read() or b'["died"]')


def restore_bounded(directory):
    """``restore()`` of a fresh model from ``directory``, run by :func:`bounded`."""
    from keras_callbacks import ElasticCheckpoint
    model = make_model()
    return bounded(lambda: ElasticCheckpoint(str(directory)).restore(model))


def test_checkpoint_files_are_private(tmp_path):
    """Weights are the job's data: the directory it creates is 0700, every file 0600."""
    directory = tmp_path / "ckpt"
    saved(directory, epochs=2)
    assert oct(directory.stat().st_mode & 0o777) == "0o700"
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in directory.iterdir()}
    assert len(modes) == 5 and set(modes.values()) == {"0o600"}, modes


def test_a_link_planted_at_the_temporary_name_is_not_followed(tmp_path):
    """The old temporary name of the metadata, ``.checkpoint.json.<name>.tmp``, could be
    guessed: a link planted there was written through and became checkpoint.json."""
    from keras_callbacks import ElasticCheckpoint
    directory = tmp_path / "ckpt"
    model = saved(directory)
    victim = tmp_path / "victim"
    victim.write_text("not a checkpoint")
    for suffix in ("", "-1", "-2"):  # the names the next save (1, epoch 2) could take
        os.symlink(victim, directory / f".checkpoint.json.ckpt-000001-e0002{suffix}.tmp")
    checkpoint = ElasticCheckpoint(str(directory))
    assert checkpoint.restore(make_model()) == 1
    checkpoint.set_model(model)
    checkpoint.save(2)
    assert victim.read_text() == "not a checkpoint"
    meta = directory / "checkpoint.json"
    assert not meta.is_symlink() and meta.is_file()
    assert checkpoint.files.entries()[0]["epoch"] == 2


SPECIAL = ["symlink to /dev/zero", "FIFO", "directory", "symlink to a valid copy",
           "17 MiB of JSON"]


def put_special(path, kind, valid):
    """Replace ``path`` by a special file of ``kind`` (``valid``: a good copy's path)."""
    os.remove(path)
    if kind == "symlink to /dev/zero":
        os.symlink("/dev/zero", path)
    elif kind == "FIFO":
        os.mkfifo(path)
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "symlink to a valid copy":
        os.symlink(valid, path)
    else:  # valid JSON, but past the cap: nothing real is that large
        with open(path, "wb") as f:
            f.write(open(valid, "rb").read().ljust(17 << 20))


@pytest.mark.parametrize("kind", SPECIAL)
def test_a_special_file_as_checkpoint_json_is_refused(tmp_path, kind):
    directory = tmp_path / "ckpt"
    saved(directory)
    meta = directory / "checkpoint.json"
    valid = tmp_path / "copy.json"
    valid.write_bytes(meta.read_bytes())
    put_special(meta, kind, valid)
    outcome = restore_bounded(directory)
    assert outcome[:2] == ["raised", "ValueError"] and outcome[2].startswith(str(meta)), outcome


@pytest.mark.parametrize("kind", SPECIAL[:-1])
def test_a_special_file_as_the_state_file_is_refused(tmp_path, kind):
    """checkpoint.json's record of the size fixed (as the directory's owner could): the
    file itself must be a regular one, not followed or waited on."""
    directory = tmp_path / "ckpt"
    saved(directory)
    meta_path = directory / "checkpoint.json"
    meta = json.loads(meta_path.read_text())
    state = directory / meta["state"]
    valid = tmp_path / "copy.npz"
    valid.write_bytes(state.read_bytes())
    put_special(state, kind, valid)
    meta["sizes"][meta["state"]] = os.lstat(state).st_size
    meta_path.write_text(json.dumps(meta))
    outcome = restore_bounded(directory)
    assert outcome[:2] == ["raised", "ValueError"] and outcome[2].startswith(str(state)), outcome


@pytest.fixture
def public():
    """A directory every local user can reach and write, as /tmp (tmp_path is private)."""
    with reachable_dir("elastic_hvd-test-", 0o1777) as path:
        yield path


def test_a_directory_of_another_user_or_writable_by_others_is_refused(tmp_path, public,
                                                                      settings):
    """Another user who made the directory first (a guessable path in /tmp) could read
    the weights and plant files; so could anyone, in a directory writable by others.
    Refused with elastic_hvd.core.safe_files.UnsafePathError, a PermissionError."""
    from keras_callbacks import ElasticCheckpoint
    theirs = public / "ckpt"
    as_nobody("mkdir", theirs)
    model = make_model()
    checkpoint = ElasticCheckpoint(str(theirs))
    checkpoint.set_model(model)
    with pytest.raises(PermissionError, match="belongs to uid 65534"):
        checkpoint.restore(model)
    with pytest.raises(PermissionError, match="belongs to uid 65534"):
        checkpoint.files.write(0, 1, {}, {})
    assert os.listdir(theirs) == []
    open_to_all = tmp_path / "open"
    saved(open_to_all)
    open_to_all.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by group or others"):
        restore(open_to_all)
    # Shared on purpose: the directory is used, and only files we own are read there.
    settings(ELASTIC_HVD_SHARED_DIRS="1")
    assert restore(open_to_all)[0] == 1
    meta = open_to_all / "checkpoint.json"
    os.chown(meta, 65534, 65534)
    with pytest.raises(ValueError, match=f"{re.escape(str(meta))}: .*belongs to uid 65534"):
        restore(open_to_all)


@pytest.mark.parametrize("seq", ["x", 10 ** 300, -1, True, 1.5, None],
                         ids=["x", "10**300", "-1", "true", "1.5", "null"])
def test_a_sequence_number_of_another_type_or_size_is_refused(tmp_path, seq):
    """``"seq": "x"`` raised TypeError; ``"seq": 10**300`` gave "File name too long" at
    every save.  Both restore and save now refuse it, naming checkpoint.json."""
    from keras_callbacks import ElasticCheckpoint
    model = saved(tmp_path)
    meta_path = tmp_path / "checkpoint.json"
    meta = json.loads(meta_path.read_text())
    meta["seq"] = seq
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=re.escape(str(meta_path))):
        restore(tmp_path)
    checkpoint = ElasticCheckpoint(str(tmp_path))
    checkpoint.set_model(model)
    with pytest.raises(ValueError, match=re.escape(str(meta_path))):
        checkpoint.save(2)


def leaves(value, path=()):
    """Every place in a JSON value: (path of keys and indexes, value)."""
    yield path, value
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        yield from leaves(item, (*path, key))


def replaced(value, path, new):
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = replaced(value[path[0]], path[1:], new)
    return copy


WRONG = ["x", 10 ** 300, -1, 1.5, None, [], {}, True, 2 ** 64, float("inf")]


def test_malformed_checkpoint_json_gives_only_the_documented_error(tmp_path):
    """Fuzz: truncations, bit flips, every value replaced by one of another type or size,
    a 5000-digit number.  restore() either restores (a change it does not use, such as
    the host) or raises ValueError naming a file of the directory; nothing else, no hang
    (special files in its place: test_a_special_file_as_checkpoint_json_is_refused)."""
    import random
    import signal
    import warnings
    from keras_callbacks import ElasticCheckpoint
    saved(tmp_path, epochs=2)
    meta_path = tmp_path / "checkpoint.json"
    good = meta_path.read_bytes()
    meta = json.loads(good)
    rng = random.Random(41)
    cases = [good[:end] for end in range(0, len(good), 23)]
    for _ in range(80):
        flipped = bytearray(good)
        flipped[rng.randrange(len(good))] ^= 1 << rng.randrange(8)
        cases.append(bytes(flipped))
    for path, _ in leaves(meta):
        cases += [json.dumps(replaced(meta, path, new)).encode() for new in WRONG if path]
    cases.append(good.replace(b'"seq": 1', b'"seq": ' + b"9" * 5000))
    model = make_model()

    def hung(*_):
        raise TimeoutError("restore() hung")
    previous = signal.signal(signal.SIGALRM, hung)
    outcomes = {"restored": 0, "refused": 0}
    try:
        for case in cases:
            meta_path.write_bytes(case)
            signal.alarm(20)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    ElasticCheckpoint(str(tmp_path)).restore(model)
                outcomes["restored"] += 1
            except ValueError as exc:
                assert str(tmp_path) in str(exc), (case, exc)
                outcomes["refused"] += 1
            except Exception as exc:
                raise AssertionError(f"{type(exc).__name__}: {exc} for {case!r}") from None
            finally:
                signal.alarm(0)
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert outcomes["refused"] > len(cases) // 2, outcomes


def test_the_directory_is_made_or_refused_when_training_starts(tmp_path, public):
    """Not at the first save, an epoch later (issue 42: every path the job writes is
    checked at its start), on every rank: any rank may become the writer."""
    from keras_callbacks import ElasticCheckpoint
    made = ElasticCheckpoint(str(tmp_path / "new" / "ckpt"))
    made.on_train_begin()
    assert oct((tmp_path / "new" / "ckpt").stat().st_mode & 0o777) == "0o700"
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(PermissionError, match="taken is not a directory$"):
        ElasticCheckpoint(str(tmp_path / "taken")).on_train_begin()
    with pytest.raises(PermissionError, match="writable by group or others"):
        ElasticCheckpoint(str(public)).on_train_begin()
