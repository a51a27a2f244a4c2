"""The training state as data: JSON for its structure, NumPy's ``.npz`` for its arrays.

Why not pickle: a checkpoint directory is shared, copied between clusters and
downloaded, and unpickling a file runs whatever code the file names.  Reading
this format runs none: the structure is parsed as JSON, each array is raw bytes
behind a ``.npy`` header that is matched, not evaluated.  Why ``.npz`` rather
than safetensors: NumPy is already a dependency and keeps every dtype a model has
(bfloat16 as its bytes plus the dtype's name); safetensors would add one.

One archive holds a state (a zip, as ``np.savez`` writes): the member
``state.json`` is the structure, in which each array is a placeholder
``{"__ndarray__": n, "shape": [...], "dtype": "float32"}`` for the member
``<n>.npy`` (with ``"scalar": true`` for a NumPy scalar: a 0-d variable's
value).  Members are stored uncompressed (``unzip -p FILE state.json`` shows the
structure); a compressed member is refused (no zip bomb).

A state holds None, bool, int, float, str, lists and tuples (read back as
lists), dicts with str keys, NumPy arrays and NumPy scalars (numbers, bools,
strings, dates, raw bytes such as bfloat16: no objects, no structured dtypes).
Anything else is refused when the state is written, naming where it is.

Reading trusts nothing in the file (a checkpoint may be truncated, garbled or
planted; the launcher's copy arrives over the network): any file that is not a
state raises :class:`StateFileError` naming it, never another error, never a wait
(a FIFO, a symlink, a device or a directory in place of the file is refused), and
never an allocation the input's own bytes do not pay for: every member is checked
against the archive's size and its CRC, every ``.npy`` header's shape and dtype
against its member's size before the array is allocated, each member is used by
exactly one placeholder, and ``state.json`` is capped in size and nesting.
"""

import io
import json
import math
import os
import re
import struct
import sys
import zipfile
import zlib
from typing import IO, Any, cast

import numpy as np

from .core.errors import ElasticHvdError
from .core.safe_files import UnsafePathError, open_regular

#: What ``state.json`` says it is, and the version of this layout.
KIND, VERSION = "elastic_hvd training state", 1
STRUCTURE = "state.json"
#: The most bytes ``state.json`` may have: parsing JSON builds Python objects of up to
#: ~25 times its size; 1 GiB holds a sampler's queue of ~100 million sample ids.
MAX_STRUCTURE_BYTES = 1 << 30
#: The deepest nesting of lists and dicts in ``state.json``: Python 3.11's JSON parser
#: recurses on the C stack as deep as the recursion limit lets it (a raised limit and a
#: file of ``[[[[...`` crash the process).  A training state nests a few levels.
MAX_DEPTH = 100
_ARRAY = "__ndarray__"
_PLAIN = (type(None), bool, int, float, str)
_MEMBER = re.compile(r"(0|[1-9][0-9]{0,9})\.npy")
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature ... name length, extra length
#: A ``.npy`` header as NumPy writes it for the dtypes a state holds; matched, never
#: evaluated (``ast.literal_eval`` of a crafted header can raise MemoryError).
_NPY_HEADER = re.compile(
    rb"\{'descr': '([<>|=]?[biufcmMSUV][0-9]{1,10}(?:\[[0-9A-Za-z]{1,8}\])?)', "
    rb"'fortran_order': (True|False), 'shape': \(((?:[0-9]{1,19}, ?)*[0-9]{0,19})\), \}[ ]*\n")
_NPY_MAX_HEADER = 10_000  # NumPy's own limit
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b'[]{}"')
_STEPS = np.zeros(256, np.int8)  # what each byte does to the nesting depth
_STEPS[list(b"[{")] = 1
_STEPS[list(b"]}")] = -1


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


def load(path: str | os.PathLike[str], max_bytes: int = sys.maxsize, owned: bool = False) -> Any:
    """The state in the file at ``path`` (``FileNotFoundError`` if there is none).

    Only a regular file is read (a symlink, FIFO, device or directory is refused with
    :class:`StateFileError`), of at most ``max_bytes`` (its own bytes bound what reading
    it costs), and, if ``owned``, only one of this user (see ``safe_files``)."""
    try:
        file = open_regular(path, max_bytes, owned)
    except UnsafePathError as exc:
        raise StateFileError(path, str(exc).removeprefix(f"{path}: ")) from None
    with file:
        return _read(cast(io.BufferedReader, file), path)  # (what open_regular opens)


def loads(blob: bytes, source: str) -> Any:
    """The state in ``blob``; ``source`` names it in errors."""
    return _read(io.BytesIO(blob), source)


def _storable(dtype: np.dtype) -> bool:
    """Whether arrays of ``dtype`` are written and read: bytes that mean what the
    dtype's name says (no objects, no fields)."""
    return dtype.kind in "biufcmMSUV" and dtype.names is None and dtype.itemsize > 0


def _data(value: Any, where: str, arrays: list[np.ndarray]) -> Any:
    """``value`` with its arrays replaced by placeholders (appended to ``arrays``)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (np.ndarray, np.generic)) and _storable(value.dtype):
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
    what = (f"an array of {value.dtype}" if isinstance(value, (np.ndarray, np.generic))
            else f"a {type(value).__name__}")
    raise ValueError(f"{where} is {what}: a training state holds None, bool, int, float, str, "
                     "lists, dicts with str keys and NumPy arrays without objects or fields, so "
                     "that reading it runs no code")


def _read(file: io.BufferedIOBase, source: str | os.PathLike[str]) -> Any:
    """The state in ``file``; whatever keeps it from being one, a StateFileError."""
    try:
        head = file.read(4)
        if head != b"PK\x03\x04":
            raise ValueError("not a zip archive" + (
                ": a pickle, which elastic_hvd does not unpickle" if head[:1] == b"\x80" else ""))
        size = file.seek(0, os.SEEK_END)
        with zipfile.ZipFile(file) as archive:  # reads the directory only
            members = _members(archive.infolist(), size)
        structure = _structure(file, members.pop(STRUCTURE), size)
        arrays = {int(name[:-4]): _array(file, info, size) for name, info in members.items()}
        state = _rebuild(structure["state"], arrays)
        if arrays:
            raise ValueError(f"member {min(arrays)}.npy is named by no placeholder of {STRUCTURE}")
        return state
    except (ValueError, EOFError, OSError, KeyError, TypeError, RecursionError, struct.error,
            NotImplementedError, zipfile.BadZipFile) as exc:
        raise StateFileError(source, f"not a readable {KIND} ({type(exc).__name__}: {exc})") \
            from None


def _members(infos: list[zipfile.ZipInfo], size: int) -> dict[str, zipfile.ZipInfo]:
    """The archive's members by name, if they are those :func:`dump` writes and the
    archive holds their bytes (members sharing bytes would cost more than the file)."""
    members: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        name = info.filename
        if name != STRUCTURE and not _MEMBER.fullmatch(name):
            raise ValueError(f"a member {name[:80]!r}: a training state's members are "
                             f"{STRUCTURE} and <n>.npy")
        if name in members:
            raise ValueError(f"member {name} appears twice")
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise ValueError(f"member {name} is compressed")
        if info.flag_bits & 1:
            raise ValueError(f"member {name} is encrypted")
        members[name] = info
    claimed = sum(info.file_size for info in infos)
    if claimed > size:
        raise ValueError(f"its members claim {claimed} bytes, the archive has {size}")
    if STRUCTURE not in members:
        raise ValueError(f"no {STRUCTURE}")
    return members


def _start(file: io.BufferedIOBase, info: zipfile.ZipInfo, size: int) -> int:
    """Where the bytes of member ``info`` start (``file`` is left there)."""
    file.seek(info.header_offset)
    signature, name_length, extra_length = _LOCAL_HEADER.unpack(_exactly(file, _LOCAL_HEADER.size))
    if signature != b"PK\x03\x04" or _exactly(file, name_length) != info.filename.encode():
        raise ValueError(f"member {info.filename}: its local header does not match the directory")
    start = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
    if start + info.file_size > size:
        raise EOFError(f"member {info.filename} is truncated")
    file.seek(start)
    return start


def _exactly(file: io.BufferedIOBase, n: int) -> bytes:
    data = file.read(n)
    if len(data) != n:
        raise EOFError(f"{n - len(data)} bytes missing")
    return data


def _check_crc(info: zipfile.ZipInfo, crc: int) -> None:
    if crc != info.CRC:
        raise ValueError(f"member {info.filename}: its bytes do not match their CRC")


def _structure(file: io.BufferedIOBase, info: zipfile.ZipInfo, size: int) -> dict[str, Any]:
    """The parsed ``state.json`` (member ``info``), checked before it is parsed."""
    if info.file_size > MAX_STRUCTURE_BYTES:
        raise ValueError(f"{STRUCTURE} has {info.file_size} bytes, more than the "
                         f"{MAX_STRUCTURE_BYTES} it may have")
    _start(file, info, size)
    text = _exactly(file, info.file_size)
    _check_crc(info, zlib.crc32(text))
    if _depth(text) > MAX_DEPTH:
        raise ValueError(f"{STRUCTURE} nests deeper than {MAX_DEPTH} levels")
    structure = json.loads(text)
    if not isinstance(structure, dict) or structure.get("kind") != KIND:
        raise ValueError(f"{STRUCTURE} does not describe a {KIND}")
    if structure.get("version") != VERSION:
        raise ValueError(f"layout version {str(structure.get('version'))[:40]}, this "
                         f"elastic_hvd reads {VERSION} (written by another version?)")
    return structure


def _depth(text: bytes) -> int:
    """How deep the lists and dicts of the JSON ``text`` nest, found without a parser:
    escapes go, then brackets are counted where an even number of quotes precede them."""
    text = text.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_BRACKETS)
    quotes = depth = deepest = 0
    for at in range(0, len(text), 1 << 16):  # in pieces: their sums cost 10 bytes a byte
        chunk = np.frombuffer(text, np.uint8, min(1 << 16, len(text) - at), at)
        inside = np.cumsum(chunk == ord('"'), dtype=np.int32)
        inside += quotes
        inside &= 1
        steps = _STEPS[chunk]
        steps[inside == 1] = 0
        levels = np.cumsum(steps, dtype=np.int32)
        levels += depth
        quotes, depth, deepest = int(inside[-1]), int(levels[-1]), max(deepest, int(levels.max()))
    return deepest


def _array(file: io.BufferedIOBase, info: zipfile.ZipInfo, size: int) -> np.ndarray:
    """The array in member ``info``, allocated once its header is found to describe
    exactly the member's bytes, read straight into it."""
    start = _start(file, info, size)
    head = file.read(min(info.file_size, 12 + _NPY_MAX_HEADER))
    dtype, shape, fortran, header_length = _npy_header(head, info.filename)
    nbytes = math.prod(shape) * dtype.itemsize
    if header_length + nbytes != info.file_size:
        raise ValueError(f"member {info.filename}: its header says {dtype.str}{list(shape)} "
                         f"({nbytes} bytes), it holds {info.file_size - header_length}")
    data = np.empty(nbytes, np.uint8)
    file.seek(start + header_length)
    if file.readinto(data.data) != nbytes:
        raise EOFError(f"member {info.filename} is truncated")
    _check_crc(info, zlib.crc32(data.data, zlib.crc32(head[:header_length])))
    return data.view(dtype).reshape(shape, order="F" if fortran else "C")


def _npy_header(head: bytes, name: str) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    """dtype, shape, Fortran order and length of the ``.npy`` header that starts ``head``."""
    if head[:6] != b"\x93NUMPY" or head[6:8] not in (b"\1\0", b"\2\0", b"\3\0"):
        raise ValueError(f"member {name} is not a .npy array of a known version")
    length, begin = ((struct.unpack_from("<H", head, 8)[0], 10) if head[6] == 1
                     else (struct.unpack_from("<I", head, 8)[0], 12))
    match = _NPY_HEADER.fullmatch(head[begin:begin + length])
    if begin + length > len(head) or not match:
        raise ValueError(f"member {name}: a .npy header that is not one of an array of "
                         "numbers, bools, strings, dates or bytes")
    dtype = np.dtype(match[1].decode())
    if not _storable(dtype):
        raise ValueError(f"member {name}: an array of {dtype.str}")
    shape = tuple(int(d) for d in match[3].split(b",") if d.strip())
    return dtype, shape, match[2] == b"True", begin + length


def _rebuild(value: Any, arrays: dict[int, np.ndarray]) -> Any:
    """``value`` with its placeholders replaced by their arrays (taken from ``arrays``)."""
    if isinstance(value, list):
        if not any(isinstance(v, (list, dict)) for v in value):
            return value
        return [_rebuild(v, arrays) for v in value]
    if not isinstance(value, dict):
        return value
    if _ARRAY not in value:
        return {k: _rebuild(v, arrays) for k, v in value.items()}
    index, shape, dtype = value[_ARRAY], value.get("shape"), value.get("dtype")
    scalar = value.get("scalar", False)
    if (value.keys() - {_ARRAY, "shape", "dtype", "scalar"} or type(index) is not int
            or not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape)
            or type(dtype) is not str or type(scalar) is not bool or (scalar and shape)):
        raise ValueError(f"an array placeholder that is not one: {str(value)[:200]}")
    array = arrays.pop(index, None)
    if array is None:
        raise ValueError(f"array {index} is not in the archive, or named twice")
    if array.dtype.kind == "V" and array.dtype.name != dtype:  # bfloat16...: its bytes
        kind = np.sctypeDict.get(dtype)  # a name only: np.dtype(str) parses
        target = np.dtype(kind) if kind is not None else array.dtype
        if target.name != dtype or not _storable(target) or target.itemsize != array.itemsize:
            raise ValueError(f"array {index}: {dtype[:40]!r} names no dtype of "
                             f"{array.itemsize}-byte items known here (bfloat16 and float8 "
                             "need ml_dtypes, which TensorFlow imports)")
        array = array.view(target)
    if array.dtype.name != dtype or list(array.shape) != shape:
        raise ValueError(f"array {index} is {array.dtype.name}{list(array.shape)}, "
                         f"{STRUCTURE} says {dtype[:40]}{str(shape)[:80]}")
    return array[()] if scalar else array
