"""The training state as data: JSON for its structure, NumPy's ``.npz`` for its arrays.

Why not pickle: a checkpoint directory is shared, copied between clusters and
downloaded, and unpickling a file runs whatever code the file names.  Reading
this format runs none: the structure is parsed as JSON, the arrays are read by
``np.load(..., allow_pickle=False)``, which refuses object arrays.  Why ``.npz``
rather than safetensors: NumPy is already a dependency and keeps every dtype a
model has (bfloat16 as its bytes plus the dtype's name); safetensors would add one.

One archive holds a state (a zip, as ``np.savez`` writes): the member
``state.json`` is the structure, in which each array is a placeholder
``{"__ndarray__": n, "shape": [...], "dtype": "float32"}`` for the member
``<n>.npy`` (with ``"scalar": true`` for a NumPy scalar: a 0-d variable's
value).  Members are stored uncompressed (``unzip -p FILE state.json`` shows the
structure); a compressed member is refused (no zip bomb).

A state holds None, bool, int, float, str, lists and tuples (read back as
lists), dicts with str keys, NumPy arrays and NumPy scalars.  Anything else is
refused when the state is written, naming where it is; anything unexpected when
it is read raises :class:`StateFileError` naming the file.
"""

import io
import json
import os
import zipfile
from typing import IO, Any

import numpy as np

from .core.errors import ElasticHvdError

#: What ``state.json`` says it is, and the version of this layout.
KIND, VERSION = "elastic_hvd training state", 1
STRUCTURE = "state.json"
_ARRAY = "__ndarray__"
_PLAIN = (type(None), bool, int, float, str)


class StateFileError(ElasticHvdError, ValueError):
    """A state that cannot be read as data (truncated, tampered, another format)."""

    def __init__(self, source: str | os.PathLike[str], reason: str) -> None:
        self.source, self.reason = source, reason
        super().__init__(f"{source}: {reason}")


def dump(state: Any, file: str | os.PathLike[str] | IO[bytes]) -> None:
    """Write ``state`` to ``file`` (a path or a binary file object)."""
    arrays: list[np.ndarray] = []
    structure = {"kind": KIND, "version": VERSION, "state": _data(state, "state", arrays)}
    with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        archive.writestr(STRUCTURE, json.dumps(structure))
        for n, array in enumerate(arrays):
            with archive.open(f"{n}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, array, allow_pickle=False)


def dumps(state: Any) -> bytes:
    """``state`` as bytes (what the launcher keeps)."""
    buffer = io.BytesIO()
    dump(state, buffer)
    return buffer.getvalue()


def load(path: str | os.PathLike[str]) -> Any:
    """The state in the file at ``path``."""
    with open(path, "rb") as f:
        return _read(f, path)


def loads(blob: bytes, source: str) -> Any:
    """The state in ``blob``; ``source`` names it in errors."""
    return _read(io.BytesIO(blob), source)


def _data(value: Any, where: str, arrays: list[np.ndarray]) -> Any:
    """``value`` with its arrays replaced by placeholders (appended to ``arrays``)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (np.ndarray, np.generic)) and not value.dtype.hasobject:
        arrays.append(np.asarray(value))
        placeholder = {_ARRAY: len(arrays) - 1, "shape": list(value.shape),
                       "dtype": value.dtype.name}
        return placeholder if isinstance(value, np.ndarray) else {**placeholder, "scalar": True}
    if isinstance(value, (list, tuple)):
        if all(type(v) in _PLAIN for v in value):  # e.g. a sampler's queue: fast
            return list(value)
        return [_data(v, f"{where}[{i}]", arrays) for i, v in enumerate(value)]
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str) or key == _ARRAY:
                raise ValueError(f"{where} has the key {key!r}: a training state's dict keys "
                                 f"are strings other than {_ARRAY!r}")
        return {k: _data(v, f"{where}[{k!r}]", arrays) for k, v in value.items()}
    raise ValueError(f"{where} is a {type(value).__name__}: a training state holds None, bool, "
                     "int, float, str, lists, dicts with str keys and NumPy arrays, so that "
                     "reading it runs no code")


def _read(file: IO[bytes], source: str | os.PathLike[str]) -> Any:
    try:
        head = file.read(4)
        file.seek(0)
        if head != b"PK\x03\x04":
            raise ValueError("not a zip archive" + (
                ": a pickle, which elastic_hvd does not unpickle" if head[:1] == b"\x80" else ""))
        with np.load(file, allow_pickle=False) as archive:
            for info in archive.zip.infolist():
                if info.compress_type != zipfile.ZIP_STORED:
                    raise ValueError(f"member {info.filename} is compressed")
            if STRUCTURE not in archive.files:
                raise ValueError(f"no {STRUCTURE}")
            structure = json.loads(archive[STRUCTURE])
            if not isinstance(structure, dict) or structure.get("kind") != KIND:
                raise ValueError(f"{STRUCTURE} does not describe a {KIND}")
            if structure.get("version") != VERSION:
                raise ValueError(f"layout version {structure.get('version')!r}, this "
                                 f"elastic_hvd reads {VERSION} (written by another version?)")
            return _rebuild(structure["state"], archive)
    except (ValueError, EOFError, OSError, KeyError, TypeError, RecursionError,
            zipfile.BadZipFile) as exc:
        raise StateFileError(source, f"not a readable {KIND} ({type(exc).__name__}: {exc})") \
            from None


def _rebuild(value: Any, archive: np.lib.npyio.NpzFile) -> Any:
    if isinstance(value, list):
        if not any(isinstance(v, (list, dict)) for v in value):
            return value
        return [_rebuild(v, archive) for v in value]
    if not isinstance(value, dict):
        return value
    if _ARRAY not in value:
        return {k: _rebuild(v, archive) for k, v in value.items()}
    array = archive[f"{value[_ARRAY]:d}"]
    dtype = value["dtype"]
    if array.dtype.kind == "V" and array.dtype.name != dtype:  # bfloat16...: its bytes
        target = np.dtype(dtype)
        if target.hasobject:
            raise ValueError(f"array {value[_ARRAY]} is said to hold objects")
        array = array.view(target)
    if array.dtype.name != dtype or list(array.shape) != value["shape"]:
        raise ValueError(f"array {value[_ARRAY]} is {array.dtype.name}{list(array.shape)}, "
                         f"{STRUCTURE} says {dtype}{value['shape']}")
    return array[()] if value.get("scalar") is True else array
