"""Fuzzing the reader of training states (issue 41, finding 7).

Whatever the bytes, ``load(path)`` and ``loads(blob)`` give the state back or raise
``StateFileError`` -- never another exception (``restore()`` ignores the launcher's
copy and tries older checkpoints only on that one), never a wait, never an
allocation the input's own bytes do not pay for.  Single-process, seconds.
"""

import collections
import functools
import io
import json
import os
import pickle
import random
import re
import struct
import subprocess
import sys
import threading
import tracemalloc
import zipfile
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from elastic_hvd import state_format
from elastic_hvd.state_format import StateFileError

_REFUSED, _GOOD = "refused", "good"


def _states() -> list[Any]:
    rng = np.random.default_rng(41)
    return [
        {"model": [rng.standard_normal((3, 4)).astype(np.float32),
                   rng.standard_normal(5).astype(np.float32).astype(ml_dtypes.bfloat16)],
         "epoch": 2, "lr": 0.5, "step": np.int64(7), "momentum": np.float32(0.9),
         "sampler": {"queue": [5, 3, 1], "epoch": 1}, "nested": [[1, [2.5, None]], {"a": "b"}]},
        {"w": rng.standard_normal((6, 2)).T, "flag": np.bool_(True),
         "empty": np.zeros((0, 3), np.float32), "names": ["x", "y"], "t": True},
        {"only": "plain", "n": [1, 2, 3]},
    ]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (np.ndarray, np.generic)):
        return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
                and a.tobytes() == b.tobytes())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def _outcome(read: Callable[[], Any], size: int, good: Any = None) -> str:
    """``_REFUSED``, ``_GOOD`` (``good`` came back), or what went wrong: an exception
    other than StateFileError, an allocation beyond a few times ``size``, a state read
    from a malformed input (``good`` None), another state."""
    tracemalloc.start()
    try:
        back = read()
    except StateFileError:
        return _REFUSED
    except Exception as exc:  # noqa: BLE001 -- what the test is looking for
        return type(exc).__name__
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        if peak > 3 * size + (1 << 20):
            return f"allocated {peak} bytes for {size}"  # noqa: B012 -- (overrides the rest)
    if good is None:
        return "a state read from it"
    return _GOOD if _same(back, good) else "another state"


def _check(cases: Iterator[tuple[str, bytes, Any]], tmp_path: Any) -> None:
    """Each case read both ways; fails with the count of each kind of failure."""
    path, reads = tmp_path / "state.npz", 0
    failed: collections.Counter[str] = collections.Counter()
    first: dict[str, str] = {}
    for label, blob, good in cases:
        path.write_bytes(blob)
        for how, read in (("loads", functools.partial(state_format.loads, blob, "the copy")),
                          ("load", functools.partial(state_format.load, path))):
            reads += 1
            outcome = _outcome(read, len(blob), good)
            if outcome not in (_REFUSED, _GOOD):
                failed[outcome] += 1
                first.setdefault(outcome, f"{how}: {label}")
    assert not failed, (f"{sum(failed.values())} of {reads} reads escaped: "
                        + "; ".join(f"{kind} x{n} (first: {first[kind]})"
                                    for kind, n in failed.most_common()))


def _members(blob: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(blob)) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def _zip(members: dict[str, bytes], compression: int = zipfile.ZIP_STORED) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def _with_structure(blob: bytes, structure: Any) -> bytes:
    return _zip({**_members(blob), "state.json": json.dumps(structure).encode()})


def _npy(descr: Any, shape: Any, data: bytes = b"", fortran: Any = False,
         header: str | None = None, version: bytes = b"\1\0") -> bytes:
    text = header or f"{{'descr': {descr!r}, 'fortran_order': {fortran!r}, 'shape': {shape!r}, }}"
    text += " " * (-(len(text) + 11) % 64) + "\n"
    length = struct.pack("<H" if version == b"\1\0" else "<I", len(text))
    return b"\x93NUMPY" + version + length + text.encode("latin1") + data


def _placeholder(shape: list[int], dtype: str) -> dict[str, Any]:
    return {"kind": state_format.KIND, "version": 1,
            "state": {"a": {"__ndarray__": 0, "shape": shape, "dtype": dtype}}}


def _garbled(blob: bytes, rng: random.Random) -> tuple[str, bytes]:
    """``blob`` with 1 to 3 bits flipped, or 1 to 8 bytes overwritten (random, 0, 255)."""
    garbled = bytearray(blob)
    if rng.random() < 0.6:
        bits = [rng.randrange(8 * len(blob)) for _ in range(rng.randint(1, 3))]
        for bit in bits:
            garbled[bit // 8] ^= 1 << bit % 8
        return f"bits {bits} flipped", bytes(garbled)
    at, n = rng.randrange(len(blob)), rng.randint(1, 8)
    garbled[at:at + n] = rng.choice([rng.randbytes(n), b"\0" * n, b"\xff" * n])
    return f"bytes {at}..{at + n} overwritten", bytes(garbled[:len(blob)])


def _plain_npz() -> bytes:
    """What ``np.savez`` writes: no state.json."""
    buffer = io.BytesIO()
    np.savez(buffer, a=np.arange(3.0))
    return buffer.getvalue()


def test_truncated_garbled_and_other_formats_are_refused(tmp_path):
    """Three states cut at every offset (every 7th for two), garbled 500 times each
    (seeded), and inputs that are no state at all."""
    def cases() -> Iterator[tuple[str, bytes, Any]]:
        rng = random.Random(41)
        for n, state in enumerate(_states()):
            blob = state_format.dumps(state)
            yield f"state {n} whole", blob, state
            for end in range(0, len(blob), 1 if n == 0 else 7):
                yield f"state {n} cut at {end}", blob[:end], state
            for _ in range(500):
                how, garbled = _garbled(blob, rng)
                yield f"state {n} {how}", garbled, state
        state = _states()[0]
        yield "empty", b"", None
        yield "a pickle", pickle.dumps(state), None
        yield "zip magic only", b"PK\x03\x04", None
        yield "an empty zip", _zip({}), None
        yield "random bytes after zip magic", b"PK\x03\x04" + rng.randbytes(3000), None
        yield "a plain .npz", _plain_npz(), None
    _check(cases(), tmp_path)


def test_wrong_types_in_state_json_are_refused(tmp_path):
    """Every field of the structure and of the array placeholders, given a value of
    another type or out of range."""
    wrong = [None, True, -1, 0.5, 10**30, "x", "", "object", "O", "bfloat16", "void2", "a",
             "float64", [], [-1], [1 << 40], [1 << 62, 1 << 62], [10**30], ["3"], [True],
             [1.0], {}, {"a": 1}]

    def cases() -> Iterator[tuple[str, bytes, Any]]:
        for n, state in enumerate(_states()[:2]):
            blob = state_format.dumps(state)
            structure = json.loads(_members(blob)["state.json"])
            for key in ("kind", "version", "state"):
                for value in wrong:
                    yield f"state {n}: {key}={value!r}", \
                        _with_structure(blob, {**structure, key: value}), state
            for name, placeholder in structure["state"].items():
                if not (isinstance(placeholder, dict) and "__ndarray__" in placeholder):
                    continue
                for key in ("__ndarray__", "shape", "dtype", "scalar", "extra"):
                    for value in [*wrong, 99, 1, 0]:
                        changed = {**structure, "state": {**structure["state"],
                                                          name: {**placeholder, key: value}}}
                        yield f"state {n}: {name}.{key}={value!r}", \
                            _with_structure(blob, changed), state
                twice = {**structure["state"], "again": placeholder}
                yield f"state {n}: {name} named twice", \
                    _with_structure(blob, {**structure, "state": twice}), None
        blob = state_format.dumps(_states()[0])
        for text in (b"[]", b"3", b'"x"', b"\xff\xfe", "{}".encode("utf-16"), b"NaN", b"{",
                     b"[" * 100_000 + b"]" * 100_000, b'{"a": ' * 50_000 + b"1" + b"}" * 50_000,
                     b"9" * 5000):
            yield f"state.json={text[:20]!r}", _zip({**_members(blob), "state.json": text}), None
    _check(cases(), tmp_path)


def test_npy_headers_that_do_not_describe_their_bytes_are_refused(tmp_path):
    """Huge shapes (8 TiB, 2 GiB, overflowing), objects, zero-size items, structured
    and subarray dtypes, a header NumPy's parser cannot survive, bad versions."""
    def cases() -> Iterator[tuple[str, bytes, Any]]:
        data = np.arange(4.0).tobytes()
        for label, descr, shape, npy in (
                ("8 TiB", "<f8", [1 << 40], _npy("<f8", (1 << 40,), data)),
                ("4 TiB in 2-d", "<f4", [1 << 20, 1 << 20], _npy("<f4", (1 << 20, 1 << 20), data)),
                ("2 GiB", "<f8", [1 << 28], _npy("<f8", (1 << 28,), data)),
                ("overflowing", "<f8", [1 << 62, 1 << 62], _npy("<f8", (1 << 62, 1 << 62), data)),
                ("negative", "<f8", [-1], _npy("<f8", (-1,), data)),
                ("objects", "object", [4], _npy("|O", (4,), data)),
                ("zero-size items", "void0", [1 << 60], _npy("|V0", (1 << 60,), data)),
                ("structured", "void8", [4], _npy([("a", "<f8")], (4,), data)),
                ("subarray", "float64", [4], _npy(("<f8", (1,)), (4,), data)),
                ("fortran not a bool", "float64", [4], _npy("<f8", (4,), data, fortran="yes")),
                ("a header the parser runs out of memory on", "float64", [4],
                 _npy("<f8", (4,), data, header="{'descr': " + "-" * 9000 + "1}")),
                ("header longer than the member", "float64", [4],
                 _npy("<f8", (4,), data)[:8] + struct.pack("<H", 60000) + data),
                ("version 9", "float64", [4], _npy("<f8", (4,), data, version=b"\x09\0")),
                ("not an npy", "float64", [4], b"not an array"),
        ):
            members = {"state.json": json.dumps(_placeholder(shape, descr)).encode(), "0.npy": npy}
            yield label, _zip(members), None
        good = {"state.json": json.dumps(_placeholder([2, 2], "float64")).encode(),
                "0.npy": _npy("<f8", (2, 2), data, fortran=True)}
        yield "fortran order (good)", _zip(good), {"a": np.arange(4.0).reshape(2, 2, order="F")}
    _check(cases(), tmp_path)


def _local(name: bytes, data: bytes) -> bytes:
    """A zip's local entry: header, name, stored bytes."""
    return struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0, zlib.crc32(data), len(data),
                       len(data), len(name), 0) + name + data


def _raw_zip(body: bytes, entries: list[tuple[bytes, bytes, int]]) -> bytes:
    """``body`` (local entries) and a directory of ``(name, data, offset)`` after it."""
    central = b"".join(
        struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 0, 0, 0, zlib.crc32(data),
                    len(data), len(data), len(name), 0, 0, 0, 0, 0, offset) + name
        for name, data, offset in entries)
    return body + central + struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(entries),
                                        len(entries), len(central), len(body), 0)


def _overlapping(links: int, size: int) -> tuple[bytes, int]:
    """The 'overlapping files' zip bomb: each member's array bytes are the next
    member's whole entry; returns it and the sum of its members' sizes."""
    datas: list[bytes] = []
    payloads: list[int] = []
    entry = b"\0" * size
    for n in reversed(range(links)):
        payloads.insert(0, len(entry))
        datas.insert(0, _npy("|u1", (len(entry),), entry))
        entry = _local(f"{n}.npy".encode(), datas[0])
    structure = json.dumps({"kind": state_format.KIND, "version": 1, "state": {
        f"a{n}": {"__ndarray__": n, "shape": [payloads[n]], "dtype": "uint8"}
        for n in range(links)}}).encode()
    head = _local(b"state.json", structure)
    entries, offset = [(b"state.json", structure, 0)], len(head)
    for n, data in enumerate(datas):
        name = f"{n}.npy".encode()
        entries.append((name, data, offset))
        offset += 30 + len(name) + len(data) - payloads[n]  # the next entry is in this one
    return _raw_zip(head + entry, entries), len(structure) + sum(map(len, datas))


def test_members_other_than_those_dump_writes_are_refused(tmp_path):
    """Names, members missing or extra, compressed, encrypted, twice, overlapping."""
    def cases() -> Iterator[tuple[str, bytes, Any]]:
        state = _states()[0]
        blob = state_format.dumps(state)
        members = _members(blob)
        yield "a member that is not .npy (0 for 0.npy)", _zip(
            {("0" if k == "0.npy" else k): v for k, v in members.items()}), None
        for old, new in (("0.npy", "00.npy"), ("0.npy", "a/0.npy"), ("0.npy", "../0.npy"),
                         ("0.npy", "9.npy"), ("state.json", "State.json")):
            yield f"{old} renamed {new}", _zip(
                {(new if k == old else k): v for k, v in members.items()}), None
        yield "0.npy missing", _zip({k: v for k, v in members.items() if k != "0.npy"}), None
        yield "state.json missing", _zip({k: v for k, v in members.items()
                                          if k != "state.json"}), None
        yield "an extra member", _zip({**members, "notes.txt": b"hello"}), None
        yield "an array no placeholder names", _zip({**members, "9.npy": members["0.npy"]}), None
        yield "compressed members", _zip(members, zipfile.ZIP_DEFLATED), None
        encrypted = bytearray(blob)
        for signature, flags in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):  # local, central
            for entry in re.finditer(re.escape(signature), blob):
                encrypted[entry.start() + flags] |= 1  # bit 0 of the flags: encrypted
        yield "encrypted members", bytes(encrypted), None
        duplicated = io.BytesIO(blob)
        with zipfile.ZipFile(duplicated, "a") as archive, pytest.warns(UserWarning):
            archive.writestr("0.npy", members["0.npy"])
        yield "a member twice", duplicated.getvalue(), None
        bomb, claimed = _overlapping(50, 100_000)
        assert claimed > 20 * len(bomb)
        yield f"overlapping members ({claimed} bytes from {len(bomb)})", bomb, None
    _check(cases(), tmp_path)


def test_only_a_regular_file_is_read(tmp_path):
    """A symlink (to a good state, to /dev/zero), a device, a directory: refused at
    once; a missing file is FileNotFoundError, as the callers expect."""
    state = _states()[0]
    good = tmp_path / "good.npz"
    state_format.dump(state, good)
    assert _outcome(lambda: state_format.load(good), good.stat().st_size, state) == _GOOD
    (tmp_path / "link").symlink_to(good)
    (tmp_path / "zero").symlink_to("/dev/zero")
    (tmp_path / "dir").mkdir()
    outcomes = {name: _outcome(functools.partial(state_format.load, path), 1 << 20)
                for name, path in (("symlink to a good state", tmp_path / "link"),
                                   ("symlink to /dev/zero", tmp_path / "zero"),
                                   ("/dev/zero", "/dev/zero"), ("a directory", tmp_path / "dir"))}
    assert outcomes == dict.fromkeys(outcomes, _REFUSED)
    with pytest.raises(FileNotFoundError):
        state_format.load(tmp_path / "missing.npz")


def test_a_fifo_in_place_of_the_file_is_refused_without_waiting(tmp_path):
    fifo = tmp_path / "state.npz"
    os.mkfifo(fifo)
    outcome: list[str] = []
    reader = threading.Thread(target=lambda: outcome.append(
        _outcome(lambda: state_format.load(fifo), 1 << 20)), daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # let the blocked open go (a writer comes and leaves), then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
        pytest.fail("load() of a FIFO waited for a writer (10 s)")
    assert outcome == [_REFUSED]


def test_a_state_json_above_its_cap_is_refused_unread(tmp_path):
    """A state.json above the cap (1 GiB; sparse on disk) is refused unread."""
    name, size = b"state.json", (1 << 30) + 1
    path = tmp_path / "state.npz"
    with open(path, "wb") as f:
        f.write(struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0, 0, size, size,
                            len(name), 0) + name)
        f.seek(size, os.SEEK_CUR)
        central = struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 0, 0, 0, 0, size, size,
                              len(name), 0, 0, 0, 0, 0, 0) + name
        end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 1, 1, len(central), f.tell(), 0)
        f.write(central + end)
    assert _outcome(lambda: state_format.load(path), 0) == _REFUSED


def test_deep_nesting_is_refused_under_a_raised_recursion_limit(tmp_path):
    """Python 3.11's JSON parser recurses on the C stack as deep as the recursion
    limit allows: with a raised limit, ``[[[[...`` must be refused, not crash."""
    structure = b"[" * 200_000 + b"]" * 200_000
    path = tmp_path / "deep.npz"
    path.write_bytes(_zip({"state.json": structure}))
    code = ("import sys; sys.setrecursionlimit(10**7)\n"
            "from elastic_hvd import state_format as s\n"
            f"try: s.loads(open({str(path)!r}, 'rb').read(), 'the copy')\n"
            "except s.StateFileError as exc: print('refused:', exc.reason)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout[:8]) == (0, "refused:"), done


def test_arrays_it_could_not_read_are_refused_when_written():
    structured = np.zeros(2, dtype=[("a", "<f4")])
    with pytest.raises(ValueError, match=r"^state\['values'\]\[1\] is an array of"):
        state_format.dumps({"values": [1, structured]})
