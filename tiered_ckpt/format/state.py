"""What a rank hands to ``save``: a nested state, flattened to named arrays and a structure document.

A rank's state is a dict nesting dicts, lists and tuples whose leaves are arrays (numpy
arrays, numpy scalars, torch tensors, DTensors, :class:`ChunkOf` boxes), ``bytes`` and
``io.BytesIO`` values, or JSON-like scalars (``int`` of any size, ``float``, ``bool``,
``str``, ``None``). Dict keys are ``str`` or ``int``. It is saved as its arrays, each
under the tensor name its path makes, and the structure document that puts them back
in place (both in :mod:`tiered_ckpt.format.structure`). A ``DTensor`` (one process per
rank) is saved as its local chunk (:mod:`tiered_ckpt.torch.dtensor`); a complex array
as its float pairs; a ``bytes`` or ``io.BytesIO`` value as a uint8 array.

Nothing else is accepted: :func:`flatten` raises :class:`InvalidStateError` naming the
path (``state["optim"]["foo"]``) of the first value it cannot store, before anything is
written. Nor is what the reader would refuse (a shard that saves always loads): a
container nested :data:`~tiered_ckpt.format.structure.MAX_DEPTH` keys deep, a shard header
over the reader's limit (:data:`~tiered_ckpt.format.shardfile.MAX_HEADER_BYTES`: the
arrays' names and shapes, and the structure document with every scalar in it; the error
names the largest value), a chunk placed by anything but integers. No pickle anywhere.
"""

from __future__ import annotations

import io
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiered_ckpt.errors import InvalidStateError
from tiered_ckpt.format.content import DIGEST_HEADER_BYTES
from tiered_ckpt.format.dtypes import NUMPY_CODES
from tiered_ckpt.format.manifest import ChunkRecord, record_bytes_bound, records_array_digests
from tiered_ckpt.format.shardfile import MAX_DIMS, ShardContents, array_problem, dtype_code, header_problem
from tiered_ckpt.format.structure import (
    COMPLEX_TAGS,
    MAX_DEPTH,
    STRUCTURE_KEY,
    Chunk,
    Kind,
    Structure,
    encode_float,
    encode_int,
    is_flat,
    key_segment,
    leaf_name,
    path_text,
    structure_of,
    too_deep,
)
from tiered_ckpt.io.gc_pause import cyclic_gc_paused
from tiered_ckpt.io.hashing import PartDigest
from tiered_ckpt.torch.device_copies import DeviceTargets, is_cuda, stand_in
from tiered_ckpt.torch.dtensor import is_dtensor, local_chunk
from tiered_ckpt.torch.tensors import float_pairs, is_tensor, to_numpy

__all__ = ["State", "ChunkOf", "FlatState", "flatten", "flatten_into", "own_targets", "sharded_names"]

State = Mapping[Any, Any]
"""A rank's state: a dict of arrays, tensors, scalars and nested dicts, lists and tuples."""

# Room flatten keeps in a shard's header for what the writer adds next to the structure
# document (the rank, world size and step: ~100 bytes), so that what flatten accepts fits.
_WRITER_METADATA_BYTES = 1024
_NAMED_VALUE_BYTES = 1024  # a header over its limit names its largest value if it is at least this large
_SCALARS = (type(None), bool, int, float, str)
_BLOBS: dict[type, Kind] = {bytes: "bytes", io.BytesIO: "bytesio"}


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True)
class ChunkOf:
    """A leaf that is one box of a larger tensor: ``data`` (an array or tensor) is the part of
    a tensor of ``global_shape`` that starts at ``offsets``. It is saved and restored as a
    DTensor's local chunk is (this is how a DTensor is saved), for writers that shard
    tensors themselves (the torch.distributed.checkpoint backend)."""

    data: Any
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


class _Flattener:
    """One walk over a state handed to ``save`` (or ``into``), building its structure."""

    def __init__(self, owner: str, into: bool, devices: DeviceTargets | None = None, off_host: bool = False) -> None:
        self.owner = owner
        self.into = into
        self.devices = devices  # into=: host buffers for CUDA tensors
        self.off_host = off_host  # a save: CUDA tensors stand in, copied later
        self.ready: dict[Any, Any] = {}  # by device, the caller's stream when the save began
        self.arrays: dict[str, np.ndarray] = {}
        self.kinds: dict[str, Kind] = {}
        self.paths: dict[str, tuple[str | int, ...]] = {}
        self.chunks: dict[str, Chunk] = {}
        self.replicate_chunks: set[str] = set()  # chunks on a Replicate mesh dimension
        self._open: set[int] = set()
        self.largest: tuple[int, tuple[str | int, ...]] = (0, ())  # roughly the most header bytes, and where

    def note(self, size: int, path: tuple[str | int, ...]) -> None:
        """Remember the value (or key) that takes the most of the header, to name it if the header is too large."""
        if size > self.largest[0]:
            self.largest = (size, path)

    def fail(self, path: tuple[str | int, ...], problem: str) -> InvalidStateError:
        return InvalidStateError(f"{self.owner}: {path_text(path)} {problem}")

    def node(self, value: Any, path: tuple[str | int, ...], name: str) -> Any:
        """``value``'s node; ``name`` is its tensor name so far (the escaped keys of ``path``)."""
        if type(value) in _SCALARS:
            return self.scalar(value, path)
        if type(value) is np.ndarray or isinstance(value, (np.ndarray, np.generic, ChunkOf)) or is_tensor(value):
            return self.leaf(value, path, "%5F_metadata__" if name == "__metadata__" else name)
        if type(value) in _BLOBS:
            return self.blob(value, path, "%5F_metadata__" if name == "__metadata__" else name)
        if too_deep(len(path)):
            raise self.fail(path, f"is nested deeper than {MAX_DEPTH} levels")
        if id(value) in self._open:
            raise self.fail(path, "contains itself (a state must be a tree)")
        self._open.add(id(value))
        try:
            if isinstance(value, dict):
                return {"dict": self.entries(value, path, name)}
            if type(value) in (list, tuple):
                tag = "list" if type(value) is list else "tuple"
                prefix = f"{name}/" if path else ""
                return {tag: [self.node(item, (*path, i), f"{prefix}{i}") for i, item in enumerate(value)]}
        finally:
            self._open.discard(id(value))
        raise self.fail(
            path,
            f"is a {type(value).__module__}.{type(value).__qualname__}, which a checkpoint "
            "cannot hold without pickle (arrays, tensors, dicts, lists, tuples, bytes, io.BytesIO, "
            "int, float, bool, str and None can)",
        )

    def entries(self, value: dict[Any, Any], path: tuple[str | int, ...], name: str) -> list[list[Any]]:
        """The ``[key, node]`` pairs of a dict. A plain numpy array of a dtype of numpy's own under an
        ASCII key with nothing to escape is taken inline, as :meth:`item` and :meth:`leaf` would: a
        state of tens of thousands of arrays spent most of its flattening in their general dispatch."""
        pairs: list[list[Any]] = []
        prefix = f"{name}/" if path else ""
        arrays, kinds, paths = self.arrays, self.kinds, self.paths
        for key, item in value.items():
            if (
                type(item) is np.ndarray
                and type(key) is str
                and key.isascii()
                and key
                and key[0] != "#"
                and "/" not in key
                and "%" not in key
                and item.dtype in NUMPY_CODES
                and (full := prefix + key) not in arrays
                and full != "__metadata__"
            ):
                if len(key) > self.largest[0]:  # as item() notes it: the first of the longest keys
                    self.note(len(key), (*path, key))
                arrays[full] = item
                kinds[full] = "array"
                paths[full] = (*path, key)
                pairs.append([key, {"array": full}])
            else:
                pairs.append(self.item(key, item, path, name))
        return pairs

    def item(self, key: Any, value: Any, path: tuple[str | int, ...], name: str) -> list[Any]:
        if type(key) is str:
            if not _is_text(key):
                raise self.fail(path, f"has the key {key!r:.80}, which is not valid Unicode text")
            self.note(_text_bytes(key), (*path, key))
            encoded: Any = key
        elif type(key) is int:
            encoded = encode_int(key)
        else:
            raise self.fail(path, f"has the key {key!r:.80} of type {type(key).__name__}; keys must be str or int")
        segment = key_segment("key", key)
        return [encoded, self.node(value, (*path, key), f"{name}/{segment}" if path else segment)]

    def scalar(self, value: Any, path: tuple[str | int, ...]) -> Any:
        if type(value) is int:
            encoded = encode_int(value)
            if isinstance(encoded, dict):
                self.note(len(encoded["int"]), path)
            return encoded
        if type(value) is float:
            return encode_float(value)
        if type(value) is str:
            if not _is_text(value):
                raise self.fail(path, "is a str that is not valid Unicode text (a lone surrogate)")
            self.note(_text_bytes(value), path)
        return value

    def check_header(self, state: FlatState) -> None:
        """Raise :class:`InvalidStateError` if the shard of ``state`` would have a header its reader refuses."""
        problem = header_problem(
            state.arrays, state.metadata(), _WRITER_METADATA_BYTES + DIGEST_HEADER_BYTES * len(state.arrays)
        )
        if problem is None:
            return
        size, path = self.largest
        advice = (
            f"its largest value is {path_text(path)} (~{size:,} bytes of it): store large values as arrays"
            if size >= _NAMED_VALUE_BYTES
            else "save fewer, larger arrays"
        )
        raise InvalidStateError(
            f"{self.owner}: the state's shard header (the names and shapes of its {len(state.arrays):,} arrays, "
            f"and the structure document with every scalar) {problem}; {advice}"
        )

    def leaf(self, value: Any, path: tuple[str | int, ...], name: str) -> dict[str, Any]:
        if name in self.arrays:  # distinct paths make distinct names; this guards that rule
            raise self.fail(path, f"has the tensor name {name!r} of {path_text(self.paths[name])}")
        kind: Kind = "array"
        if type(value) is not np.ndarray and is_tensor(value):
            kind = "dtensor" if is_dtensor(value) else "tensor"
        if isinstance(value, ChunkOf):
            kind = "dtensor"
        node: Any = name
        if kind == "dtensor":
            array, chunk = self.chunk_of(value, path) if isinstance(value, ChunkOf) else self.dtensor(value, path, name)
            self.chunks[name] = chunk
            node = [name, list(chunk.global_shape), list(chunk.offsets)]
        elif kind == "tensor":
            array = self.tensor(value, path)
        else:
            array = np.asarray(value) if isinstance(value, np.generic) else value
        complex_tag = None
        if array.dtype.kind == "c" and array.dtype.name in COMPLEX_TAGS:
            complex_tag, array = array.dtype.name, float_pairs(array)
            if kind == "dtensor":  # the pairs are one more dimension of the global tensor
                chunk = Chunk((*chunk.global_shape, 2), (*chunk.offsets, 0))
                self.chunks[name] = chunk
                node = [name, list(chunk.global_shape), list(chunk.offsets)]
        problem = array_problem(array)
        if problem is not None:
            raise self.fail(path, problem)
        self.arrays[name] = array
        self.kinds[name] = kind
        self.paths[name] = path
        return {complex_tag: {kind: node}} if complex_tag else {kind: node}

    def blob(self, value: bytes | io.BytesIO, path: tuple[str | int, ...], name: str) -> dict[str, str]:
        """A ``bytes`` or ``io.BytesIO`` value as a uint8 array (no pickle: its bytes are the array)."""
        if name in self.arrays:
            raise self.fail(path, f"has the tensor name {name!r} of {path_text(self.paths[name])}")
        kind = _BLOBS[type(value)]
        data = value if isinstance(value, bytes) else value.getvalue()
        array = np.frombuffer(data, dtype=np.uint8)
        self.arrays[name] = array.copy() if self.into else array  # into= fills it: it must be writable
        self.kinds[name] = kind
        self.paths[name] = path
        return {kind: name}

    def dtensor(self, value: Any, path: tuple[str | int, ...], name: str) -> tuple[np.ndarray, Chunk]:
        """A DTensor's local chunk (a view of it) and where it sits in the global tensor; ``name``
        joins the replicated arrays if another rank holds an identical copy of the chunk."""
        chunk = local_chunk(value, f"{self.owner}: {path_text(path)}")
        if chunk.replicated:
            self.replicate_chunks.add(name)
        return self.tensor(chunk.tensor, path), Chunk(chunk.global_shape, chunk.offsets)

    def chunk_of(self, value: ChunkOf, path: tuple[str | int, ...]) -> tuple[np.ndarray, Chunk]:
        array = self.tensor(value.data, path) if is_tensor(value.data) else value.data
        if not isinstance(array, np.ndarray):
            raise self.fail(path, f"is a ChunkOf a {type(array).__name__}, not of an array or tensor")
        shape, offsets = self.dims(value.global_shape, path), self.dims(value.offsets, path)
        if not (len(shape) == len(offsets) == array.ndim) or any(
            o < 0 or o + n > whole for o, n, whole in zip(offsets, array.shape, shape, strict=True)
        ):
            raise self.fail(path, f"is a chunk {array.shape} at {offsets} that is not inside a tensor of {shape}")
        return array, Chunk(shape, offsets)

    def dims(self, values: Any, path: tuple[str | int, ...]) -> tuple[int, ...]:
        """A chunk's global shape or offsets as the integers the structure document holds (a numpy or
        torch integer becomes an ``int``); a bool, a float or a negative number is refused, as the reader would."""
        try:
            dims = tuple(_dimension(d) for d in values)
        except TypeError:
            dims = None
        if dims is None or len(dims) > MAX_DIMS or any(d < 0 for d in dims):
            raise self.fail(
                path,
                f"is a ChunkOf whose global_shape or offsets {values!r:.120} are not at most {MAX_DIMS} integers >= 0",
            )
        return dims

    def tensor(self, value: Any, path: tuple[str | int, ...]) -> np.ndarray:
        cuda = value.device.type != "cpu" and is_cuda(value)
        if self.into and value.device.type != "cpu" and not (cuda and self.devices is not None):
            where = "CPU tensors and arrays" if self.devices is None else "CPU and CUDA tensors and arrays"
            raise self.fail(path, f"is on {value.device}; into= fills {where} in place")
        try:
            if cuda and self.into and self.devices is not None:
                return self.devices.host_for(value)
            if cuda and self.off_host and not value.is_complex():  # complex: copied here, its pairs need bytes
                return stand_in(value, self.ready)
            return to_numpy(value)
        except (RuntimeError, TypeError, NotImplementedError) as exc:  # sparse, quantized, exotic dtypes
            raise self.fail(path, f"is a tensor numpy cannot view: {exc}") from exc


def _dimension(value: Any) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError("a bool is not a dimension")
    return operator.index(value)


def _text_bytes(text: str) -> int:
    """Roughly the bytes ``text`` takes in a shard's header: json escapes a non-ASCII character
    as ``\\uXXXX`` in the structure document, and its backslash again in the header."""
    return len(text) if text.isascii() else 7 * len(text)


@dataclass(frozen=True)
class FlatState:
    """A rank's state as a shard holds it: arrays by tensor name, and their structure.

    ``replicated`` names the replicated arrays of a state of DTensors: those other ranks may
    hold identical copies of (its plain arrays, and DTensor chunks on a replicated mesh
    dimension), which a save has one rank write (:mod:`tiered_ckpt.dist.replicas`).
    """

    arrays: dict[str, np.ndarray]
    structure: Structure
    replicated: frozenset[str] = frozenset()

    def chunk_records(self, digests: Mapping[str, PartDigest]) -> tuple[ChunkRecord, ...]:
        """Every array of this state as the chunk the manifest records (a plain array is the
        one chunk of itself), with the sha256 and xxh3-64 of its bytes from ``digests``."""
        records = []
        for name, array in self.arrays.items():
            shape = tuple(array.shape)
            chunk = self.structure.chunks.get(name, Chunk(shape, (0,) * array.ndim))
            records.append(
                ChunkRecord(
                    name,
                    dtype_code(array),
                    chunk.global_shape,
                    chunk.offsets,
                    shape,
                    digests[name].sha256,
                    digests[name].xxh3_64,
                )
            )
        return tuple(records)

    def record_bytes(self, world_size: int) -> int:
        """At least the bytes this rank's record adds to the manifest of a step of ``world_size``
        ranks (a state of DTensors records every array as a chunk, a plain one each array's
        xxh3-64 where they fit; :func:`~tiered_ckpt.format.manifest.record_bytes_bound`)."""
        if self.structure.chunks:
            return record_bytes_bound((name, array.ndim) for name, array in self.arrays.items())
        digests = 16 * len(self.arrays) if records_array_digests(len(self.arrays), world_size) else 0
        return record_bytes_bound() + digests

    def unflatten(self, *, torch: bool = False) -> dict[Any, Any]:
        """The nested state: arrays as numpy, or (``torch=True``) as each leaf was saved."""
        return self.structure.build(self.arrays, torch=torch)

    def metadata(self) -> dict[str, str]:
        """What the shard's ``__metadata__`` holds of this state."""
        return {STRUCTURE_KEY: self.structure.to_json()}

    @classmethod
    def from_shard(cls, contents: ShardContents, what: str, replicas: Iterable[str] = ()) -> FlatState:
        """The state a verified shard holds; a shard without a structure document (written
        before there were any) is a flat dict of its arrays. ``replicas`` names the arrays
        the document names but the shard file leaves out (its record's ``elsewhere``: left to
        their writers' shards, or referenced in earlier files): they are not in the state
        returned. Raises :class:`ShardFormatError` naming ``what`` if the document is not valid."""
        return cls(contents.arrays, structure_of(contents.metadata, contents.arrays, what, replicas))


def own_targets(
    elsewhere: frozenset[str], into: Mapping[str, np.ndarray] | None
) -> tuple[frozenset[str], dict[str, np.ndarray] | None]:
    """The names of the arrays a shard's file leaves out (``elsewhere``: its record's
    :attr:`~tiered_ckpt.format.manifest.ShardRecord.elsewhere`), and of the caller's arrays
    ``into`` (None: none) those the shard file itself fills."""
    return elsewhere, {
        name: array for name, array in into.items() if name not in elsewhere
    } if into is not None else None


@cyclic_gc_paused()  # an object or more per array, all alive until returned: see io/gc_pause.py
def flatten(
    state: Any,
    owner: str = "state",
    *,
    into: bool = False,
    devices: DeviceTargets | None = None,
    off_host: bool = False,
) -> FlatState:
    """``state`` as named numpy arrays (torch tensors as views, copied to host from another
    device) and its structure; raise :class:`InvalidStateError` naming ``owner`` and the
    path of the first value that cannot be saved. ``off_host=True`` (a save that stages):
    a CUDA tensor becomes an :class:`~tiered_ckpt.io.off_host.OffHost` stand-in, whose
    bytes are copied later, and only once. ``into=True`` checks a state to fill in place
    instead: every tensor must then be on the CPU, or on a CUDA device if ``devices`` holds
    the host buffers that stand in for them."""
    if not isinstance(state, dict):
        raise InvalidStateError(f"{owner}: the state is a {type(state).__name__}, not a dict")
    flattener = _Flattener(owner, into, devices, off_host)
    root = flattener.node(state, (), "")
    structure = Structure(root, flattener.kinds, flattener.paths, is_flat(root), flattener.chunks)
    plain = {name for name, kind in flattener.kinds.items() if kind != "dtensor"}
    replicated = frozenset(plain | flattener.replicate_chunks) if flattener.chunks else frozenset()
    flat = FlatState(flattener.arrays, structure, replicated)
    if not into:
        flattener.check_header(flat)
    return flat


def flatten_into(into: Any, owner: str, devices: DeviceTargets | None = None) -> FlatState:
    """A state to fill in place: its arrays by tensor name (views of its tensors and DTensor
    chunks; for a CUDA tensor, a host buffer of ``devices``) and where its DTensor chunks sit;
    its scalars are not filled."""
    return flatten(into, owner, into=True, devices=devices)


def sharded_names(keys: Iterable[str | Sequence[str | int]], names: Iterable[str]) -> list[str]:
    """The tensor names of ``sharded_keys``: a tuple is a path of dict keys, a string a tensor
    name (or a top-level key, e.g. ``"a/b"`` for the name ``a%2Fb``)."""
    known = set(names)
    resolved = []
    for key in keys:
        if isinstance(key, str):
            name = key if key in known or leaf_name((key,)) not in known else leaf_name((key,))
        elif isinstance(key, Sequence) and all(type(part) in (str, int) for part in key):
            name = leaf_name(tuple(key))
        else:
            raise InvalidStateError(f"sharded_keys: {key!r:.80} is neither a tensor name nor a path of keys")
        resolved.append(name)
    return resolved
