"""One shard file: named numpy arrays <-> bytes, hashed while they stream.

The file is in the safetensors layout, so any shard opens with the ``safetensors``
package (or is memory-mapped by hand) without this library::

    8 bytes   little-endian u64 N, the header length
    N bytes   JSON header: {name: {"dtype", "shape", "data_offsets": [begin, end]}, ...,
              "__metadata__": {str: str}}, padded with spaces to a multiple of 8
    rest      the arrays' bytes, C order, little-endian, back to back

Arrays are laid out by item size, largest first, so every array starts at an offset
that is a multiple of its item size. The file's sha256 and xxh3-64 cover every byte.

We write the format by hand rather than with ``safetensors.numpy.save_file``: that
builds the whole file in memory (a full extra copy of the state) and neither hashes
nor fsyncs, while a checkpoint must stream the arrays once, hashing as it writes.
"""

from __future__ import annotations

import hashlib
import json
import json.encoder
import math
import operator
import os
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import BinaryIO, Literal

import numpy as np

from tiered_ckpt.errors import InvalidStateError, ShardFormatError
from tiered_ckpt.format.differences import into_difference
from tiered_ckpt.format.dtypes import DTYPE_CODES, DTYPES, NUMPY_CODES, code_of
from tiered_ckpt.format.packing import Placed, fill_arrays, read_arrays, write_arrays
from tiered_ckpt.io.blockread import read_blocks
from tiered_ckpt.io.gc_pause import cyclic_gc_paused
from tiered_ckpt.io.hashing import HashedStream, Hasher, ShardDigest, Verify, check_verify, hashing_writer
from tiered_ckpt.io.pages import blocks_of, whole_map

__all__ = [
    "DTYPES",
    "DTYPE_CODES",
    "check_arrays",
    "array_problem",
    "dtype_code",
    "write_order",
    "write_shard",
    "read_shard_file",
    "read_shard_buffer",
    "ShardContents",
    "ShardHeader",
    "read_header",
    "header_length",
    "header_of",
    "header_problem",
    "json_length_bound",
    "MAX_HEADER_BYTES",
    "MAX_DIMS",
]

# safetensors refuses headers over 100 MB; so does our reader, before allocating anything,
# and so does the writer (header_problem), before writing anything: a shard that saves loads.
MAX_HEADER_BYTES = 100_000_000
# Shapes numpy can make: at most 64 dimensions, and the product of the non-zero ones
# times the item size below 2**63 (numpy checks it even when another dimension is 0).
# A header asking for more is not a shard we wrote, whatever its bytes.
MAX_DIMS = 64
MAX_BYTES = 2**63
_METADATA = "__metadata__"
_ENTRY_KEYS = frozenset(("dtype", "shape", "data_offsets"))
_INT = frozenset((int,))
_BY_PLACE = operator.itemgetter(3, 4)  # an entry's (begin, end)
_quote = json.encoder.encode_basestring_ascii  # the escaping json.dumps applies to a str


def _dtype_code(name: str, array: np.ndarray, owner: str = "state") -> str:
    dtype = array.dtype
    if dtype.byteorder == ">":
        dtype = dtype.newbyteorder("<")
    code = code_of(dtype)
    if code is None:
        raise InvalidStateError(f"{owner}: array {name!r} {array_problem(array)}")
    return code


def dtype_code(array: np.ndarray) -> str:
    """The safetensors dtype code of ``array`` (``"F32"``, ``"BF16"``...); :class:`InvalidStateError` if none."""
    return _dtype_code("array", array)


def _is_utf8(text: str) -> bool:
    """True if ``text`` encodes as UTF-8 (a lone surrogate does not; safetensors refuses such a name)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def array_problem(array: np.ndarray) -> str | None:
    """Why a shard cannot hold ``array`` (a phrase: "has dtype ..."), or None if it can."""
    if type(array) is np.ndarray and array.dtype in NUMPY_CODES:  # the common case, checked first
        return None
    if isinstance(array, np.ma.MaskedArray):
        return "is a masked array, whose mask a shard cannot hold; pass .filled() or .data"
    dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    if code_of(dtype) is None:
        supported = ", ".join(str(d) for d in DTYPES.values())
        return f"has dtype {array.dtype}, which a shard cannot hold ({supported})"
    # The reader's limits on a shape (MAX_DIMS, MAX_BYTES) are numpy's own: every array meets them.
    return None


def check_arrays(arrays: Mapping[str, np.ndarray], owner: str = "state") -> dict[str, np.ndarray]:
    """Return ``arrays`` with numpy scalars as 0-d arrays; raise :class:`InvalidStateError`
    naming ``owner`` and the key if a name or value cannot go into a shard."""
    checked: dict[str, np.ndarray] = {}
    for name, array in arrays.items():
        if type(array) is np.ndarray and type(name) is str and name.isascii() and array.dtype in NUMPY_CODES:
            if name and name != _METADATA:  # the common case, without the general checks' calls
                checked[name] = array
                continue
        if not isinstance(name, str) or not name or name == _METADATA or not _is_utf8(name):
            raise InvalidStateError(f"{owner}: invalid array name {name!r} (a non-empty UTF-8 string)")
        if isinstance(array, np.generic):  # a numpy scalar is saved as a 0-d array
            array = np.asarray(array)
        if not isinstance(array, np.ndarray):
            raise InvalidStateError(f"{owner}: {name!r} is a {type(array).__name__}, not a numpy array")
        problem = array_problem(array)
        if problem is not None:
            raise InvalidStateError(f"{owner}: {name!r} {problem}")
        checked[name] = array
    return checked


def write_order(arrays: Mapping[str, np.ndarray]) -> list[str]:
    """The names of ``arrays`` in the order :func:`write_shard` writes them: largest item size
    first (each array aligned for its dtype without padding), then by name."""
    names = sorted(arrays)
    sizes = {name: -array.dtype.itemsize for name, array in arrays.items()}
    if len(set(sizes.values())) > 1:
        names.sort(key=sizes.__getitem__)  # stable: by name within an item size
    return names


@cyclic_gc_paused()  # an object or more per array, all alive until returned: see io/gc_pause.py
def _layout(arrays: Mapping[str, np.ndarray]) -> list[tuple[str, str, np.ndarray, int, int]]:
    """Order arrays as :func:`write_order` does; return (name, code, array, begin, end)."""
    checked = check_arrays(arrays)
    layout, offset = [], 0
    codes = NUMPY_CODES
    for name in write_order(checked):
        array = checked[name]
        code = codes.get(array.dtype) or _dtype_code(name, array)
        layout.append((name, code, array, offset, offset + array.nbytes))
        offset += array.nbytes
    return layout


@cyclic_gc_paused()  # an object or more per array, all alive until returned: see io/gc_pause.py
def _header_text(layout: list[tuple[str, str, np.ndarray, int, int]], metadata: Mapping[str, str] | None) -> str:
    """The header's JSON, unpadded; ASCII (json escapes the rest), so its length is its size in bytes."""
    return _json_of([(name, code, array.shape, begin, end) for name, code, array, begin, end in layout], metadata)


def _json_of(entries: Sequence[tuple[str, str, tuple[int, ...], int, int]], metadata: Mapping[str, str] | None) -> str:
    """What ``json.dumps(header, separators=(",", ":"))`` gives, each entry formatted in one step:
    building a dict per array for json to walk took most of a large header's time."""
    parts = []
    if metadata:
        fields = ",".join(f"{_quote(str(k))}:{_quote(str(v))}" for k, v in metadata.items())
        parts.append(f'"{_METADATA}":{{{fields}}}')
    for name, code, shape, begin, end in entries:
        dims = ",".join(map(str, map(int, shape)))
        parts.append(f'{_quote(name)}:{{"dtype":{_quote(code)},"shape":[{dims}],"data_offsets":[{begin},{end}]}}')
    return "{" + ",".join(parts) + "}"


def _padded(text: str) -> bytes:
    encoded = text.encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


def _header_bytes(layout: list[tuple[str, str, np.ndarray, int, int]], metadata: Mapping[str, str]) -> bytes:
    return _padded(_header_text(layout, metadata))


def header_of(tensors: Sequence[tuple[str, str, tuple[int, ...]]], metadata: Mapping[str, str] | None = None) -> bytes:
    """The header (the 8 length bytes and the padded JSON) of a safetensors file holding
    ``tensors`` (name, dtype code, shape) back to back in that order: what a writer that
    streams the tensors one at a time writes first. Raises ``KeyError`` for an unknown code."""
    entries, offset = [], 0
    for name, code, shape in tensors:
        size = DTYPES[code].itemsize * math.prod(shape)
        entries.append((name, code, shape, offset, offset + size))
        offset += size
    return _padded(_json_of(entries, metadata))


def header_length(arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> int:
    """The length of the (padded) JSON header :func:`write_shard` writes for ``arrays`` and
    ``metadata``: the number the reader compares with :data:`MAX_HEADER_BYTES`. Touches no
    array's bytes; raises :class:`InvalidStateError` as :func:`write_shard` would."""
    length = len(_header_text(_layout(arrays), metadata))
    return length + (-length % 8)


def json_length_bound(text: str) -> int:
    """At least the length of ``text`` as a JSON string (``json.dumps``): exact for printable
    ASCII without quotes or backslashes (any real tensor name), 6 characters per character for
    other ASCII (``\\u0001``), 12 for the rest (a surrogate pair)."""
    if not text.isascii():
        return 2 + 12 * len(text)
    if text.isprintable() and '"' not in text and "\\" not in text:
        return 2 + len(text)
    return 2 + 6 * len(text)


# Bytes of one header entry besides its name and shape: its keys, dtype code, two offsets.
_ENTRY_BYTES = 100
_DIM_BYTES = 21  # a dimension of at most 20 digits, and its comma


def header_problem(arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str], reserve: int = 0) -> str | None:
    """Why the shard of ``arrays`` and ``metadata`` (checked arrays: what :func:`check_arrays`
    returns) cannot be read back, its header being over :data:`MAX_HEADER_BYTES` with
    ``reserve`` more bytes of metadata still to come, as a phrase; None if it can.

    What the reader refuses, the writer refuses: this is the reader's own limit. Cheap for
    any state well under it (a bound from the names' and values' lengths); a header near
    the limit is measured exactly, as :func:`write_shard` would write it.
    """
    bound = 32 + reserve + sum(json_length_bound(key) + json_length_bound(value) for key, value in metadata.items())
    # First a bound that costs no call per array (12 bytes a character, every array at most MAX_DIMS dimensions)
    loose = bound + sum(map(len, arrays)) * 12 + len(arrays) * (2 + _ENTRY_BYTES + _DIM_BYTES * MAX_DIMS)
    if loose <= MAX_HEADER_BYTES:
        return None
    bound += sum(json_length_bound(name) + _ENTRY_BYTES + _DIM_BYTES * array.ndim for name, array in arrays.items())
    if bound <= MAX_HEADER_BYTES:
        return None
    length = header_length(arrays, metadata) + reserve
    if length > MAX_HEADER_BYTES:
        return f"takes {length:,} bytes, over the {MAX_HEADER_BYTES:,} a shard's reader accepts"
    return None


def write_shard(
    out: BinaryIO,
    arrays: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
    *,
    part_digests: Literal["both", "xxh3"] | None = None,
    done_with: Callable[[str], None] | None = None,
    tails: Mapping[str, np.ndarray] | None = None,
) -> ShardDigest:
    """Write ``arrays`` to ``out`` as one shard and return the size and checksums of what was written.

    Guarantees: one pass over each array's memory, no copy of a C-contiguous
    little-endian array, extra memory bounded by one chunk for any other. Raises
    :class:`InvalidStateError` (before writing anything) for a name, dtype or shape a
    shard cannot hold, or a header over :data:`MAX_HEADER_BYTES` (whatever the reader
    refuses). Flushing to stable storage is the caller's job. The header's size and
    sha256 are measured too; ``part_digests`` also hashes each array on its own, in the same
    pass: ``"both"`` a second sha256 and xxh3-64 of every byte, ``"xxh3"`` only the xxh3-64
    (a few percent of the sha256's cost): with them, a reader of parts of the file verifies
    what it reads (:func:`read_header`). ``done_with(name)`` is called once the array called
    ``name`` is read for the last time (its memory may then change); ``tails[name]`` holds the
    last bytes of that array (C-contiguous little-endian), written from there instead.
    """
    layout = _layout(arrays)
    hasher = Hasher()
    header = _header_bytes(layout, metadata or {})
    if len(header) - 8 > MAX_HEADER_BYTES:
        raise InvalidStateError(
            f"state: the shard's header (array names, shapes and metadata) takes {len(header) - 8:,} bytes, "
            f"over the {MAX_HEADER_BYTES:,} a shard's reader accepts"
        )
    write = hashing_writer(out, hasher)
    write(header)
    arrays_in_order, names = [entry[2] for entry in layout], [entry[0] for entry in layout]
    digests = write_arrays(write, arrays_in_order, names, part_digests, done_with, tails)
    return replace(
        hasher.digest(), header_bytes=len(header), header_sha256=hashlib.sha256(header).hexdigest(), arrays=digests
    )


@dataclass(frozen=True)
class ShardContents:
    """What a verified shard holds: its arrays by name, and its ``__metadata__``."""

    arrays: dict[str, np.ndarray]
    metadata: dict[str, str]


_Entry = Placed


@cyclic_gc_paused()  # an object or more per array, all alive until returned: see io/gc_pause.py
def _parse_header(raw: bytes, data_bytes: int) -> tuple[list[_Entry], dict[str, str]]:
    """Parse a header strictly into its entries and metadata; raise ValueError describing the first problem."""
    document = json.loads(raw.decode("utf-8"))
    if not isinstance(document, dict):
        raise ValueError("header is not a JSON object")
    entries = []
    metadata: dict[str, str] = {}
    for name, info in document.items():
        if name == _METADATA:
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise ValueError("__metadata__ must map strings to strings")
            metadata = info
            continue
        if type(info) is not dict or info.keys() != _ENTRY_KEYS:
            raise ValueError(f"entry {name!r} must have exactly dtype, shape and data_offsets")
        code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        dtype = DTYPES.get(code) if type(code) is str else None
        if dtype is None:
            raise ValueError(f"entry {name!r} has unsupported dtype {code!r}")
        # set(map(type, ...)): the exact-type check (a bool is not a dimension) without a Python loop
        if type(shape) is not list or not set(map(type, shape)) <= _INT or (shape and min(shape) < 0):
            raise ValueError(f"entry {name!r} has invalid shape {str(shape)[:200]}")
        numel = math.prod(shape)
        if len(shape) > MAX_DIMS or (numel or math.prod(d for d in shape if d)) * dtype.itemsize >= MAX_BYTES:
            raise ValueError(f"entry {name!r} has a shape numpy cannot make: {str(shape)[:200]}")
        if type(offsets) is not list or len(offsets) != 2 or not set(map(type, offsets)) <= _INT:
            raise ValueError(f"entry {name!r} has invalid data_offsets {offsets!r}")
        begin, end = offsets
        if end - begin != numel * dtype.itemsize or begin < 0:
            raise ValueError(f"entry {name!r}: data_offsets {offsets} do not fit shape {shape} of {info['dtype']}")
        entries.append(_Entry(name, dtype, tuple(shape), begin, end))
    entries.sort(key=_BY_PLACE)
    position = 0
    for entry in entries:
        if entry.begin != position:
            raise ValueError(f"entry {entry.name!r} starts at {entry.begin}, expected {position}")
        position = entry.end
    if position != data_bytes:
        raise ValueError(f"arrays cover {position} bytes but the file holds {data_bytes}")
    return entries, metadata


def _parse_prefix(stream: HashedStream, size: int) -> tuple[int, list[_Entry], dict[str, str]]:
    """Take (and hash) the length and header at the start of a file of ``size`` bytes and parse
    them; ValueError if invalid. Returns where the arrays' bytes start, the arrays in file
    order and the metadata."""
    prefix = stream.take(8)
    if len(prefix) < 8:
        raise ValueError("file is too short to hold a header")
    (header_bytes,) = struct.unpack("<Q", prefix)
    if header_bytes > min(MAX_HEADER_BYTES, size - 8):
        raise ValueError(f"header length {header_bytes} does not fit a file of {size} bytes")
    start = 8 + header_bytes
    return (start, *_parse_header(stream.take(header_bytes), size - start))


@dataclass(frozen=True)
class ShardHeader:
    """A shard's header, parsed: where each array's bytes are in the file (``begin``, ``end``,
    counted from the file's start), their dtypes and shapes, and the metadata."""

    size: int
    arrays: Mapping[str, _Entry]
    metadata: dict[str, str]


def read_header(raw: bytes, file_size: int, what: str) -> ShardHeader:
    """Parse the first bytes of a shard (exactly its header: the 8 length bytes and the JSON,
    as :func:`write_shard` measured it) of a file of ``file_size`` bytes.

    The caller verifies ``raw`` first (its recorded sha256); this only checks it is a valid
    header of such a file, raising :class:`ShardFormatError` naming ``what`` otherwise.
    """
    try:
        if len(raw) < 8:
            raise ValueError("too short to hold a header")
        (length,) = struct.unpack("<Q", raw[:8])
        if length != len(raw) - 8:
            raise ValueError(f"the header says {length} bytes, {len(raw) - 8} were recorded")
        entries, metadata = _parse_header(raw[8:], file_size - len(raw))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ShardFormatError(f"{what}: not a valid shard header: {exc}") from exc
    start = len(raw)
    placed = {e.name: _Entry(e.name, e.dtype, e.shape, start + e.begin, start + e.end) for e in entries}
    return ShardHeader(start, placed, metadata)


def read_shard_file(
    source: BinaryIO,
    *,
    check: Callable[[ShardDigest], None],
    verify: Verify = "full",
    what: str,
    into: Mapping[str, np.ndarray] | None = None,
) -> ShardContents:
    """Read one shard file into arrays and return them (and its metadata) only if its bytes verify.

    ``source`` is an open regular file whose size the caller has checked, that nobody
    truncates while it is read (committed shards never are). ``verify`` picks which
    checksum is computed ("full": sha256, "fast": xxh3-64); ``check`` receives the
    digest of the bytes (those of the returned arrays, hashed after they were copied)
    and raises :class:`ChecksumMismatchError` if they are not the recorded ones.
    ``what`` (e.g. "rank 2 shard /ckpt/rank-...") names the file in errors. Raises
    :class:`ShardFormatError` if the bytes match but do not form a valid shard.

    With ``into``, the shard's arrays are copied into those (writable, C-contiguous)
    arrays instead of new ones; it must hold exactly the shard's names, dtypes and
    shapes (checked before anything is copied, :class:`InvalidStateError`). If the
    bytes then fail to verify, the arrays in ``into`` hold unspecified values.
    """
    check_verify(verify)
    size = os.fstat(source.fileno()).st_size
    with read_blocks(source.fileno(), size) as blocks:
        return _read(blocks, size, check, verify, what, into)


def read_shard_buffer(
    data: memoryview,
    *,
    check: Callable[[ShardDigest], None],
    verify: Verify = "full",
    what: str,
    into: Mapping[str, np.ndarray] | None = None,
) -> ShardContents:
    """:func:`read_shard_file` of a shard's bytes already in memory (a copy a partner sent):
    the same checks, each byte hashed once while it is copied into its array. Where ``data``
    is a whole map of a file (:func:`~tiered_ckpt.io.pages.whole_map`), each block's pages are
    let go as the read moves on: reading it holds a block of it resident."""
    check_verify(verify)
    return _read(blocks_of(data, _MEMORY_BLOCK, whole_map(data)), len(data), check, verify, what, into)


_MEMORY_BLOCK = 4 << 20  # pieces hashed while in the CPU's cache, as read_blocks's blocks are


def _read(
    blocks: Iterator[memoryview],
    size: int,
    check: Callable[[ShardDigest], None],
    verify: Verify,
    what: str,
    into: Mapping[str, np.ndarray] | None,
) -> ShardContents:
    # The sha256 of what is copied runs on a second core (one thread per shard); xxh3 is too fast to gain
    stream = HashedStream(blocks, Hasher(verify), behind=verify == "full")
    try:
        try:
            _start, entries, metadata = _parse_prefix(stream, size)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            # A broken header is usually a corrupted file: hash the rest to tell which.
            stream.hash_rest()
            check(stream.digest())
            raise ShardFormatError(f"{what}: bytes verify but are not a valid shard: {exc}") from exc
        if into is None:
            targets = read_arrays(stream, entries)
        else:
            targets = _targets(entries, into, what)
            fill_arrays(stream, entries, targets)
        check(stream.digest())
    finally:
        stream.close()
    return ShardContents(dict(targets), metadata)


def _targets(entries: list[_Entry], into: Mapping[str, np.ndarray], what: str) -> dict[str, np.ndarray]:
    """The caller's arrays to fill, after checking they match the shard."""
    difference = into_difference({entry.name: (entry.dtype, entry.shape) for entry in entries}, into)
    if difference:
        raise InvalidStateError(f"{what}: into does not match the shard: {difference}")
    for entry in entries:
        array = into[entry.name]
        if not (array.flags.c_contiguous and array.flags.writeable):
            raise InvalidStateError(f"{what}: into[{entry.name!r}] must be writable and C-contiguous")
    return dict(into)
