"""What a rank hands to ``save``: a nested state, flattened to named arrays and a structure document.

A rank's state is a dict nesting dicts, lists and tuples whose leaves are arrays (numpy
arrays, numpy scalars, torch tensors), ``bytes`` and ``io.BytesIO`` values, or JSON-like
scalars (``int`` of any size, ``float``, ``bool``, ``str``, ``None``). Dict keys are
``str`` or ``int``. It is saved as

- its arrays, each under a **tensor name** made from its path (:func:`leaf_name`): the
  path's keys joined by ``/``, a ``str`` key as itself with ``%``, ``/`` and a leading
  ``#`` percent-escaped (and ``""`` as ``%``), an ``int`` key as ``#<n>``, a list or tuple
  index as ``<n>``. So ``state["optim"]["state"][0]["exp_avg"]`` is
  ``optim/state/#0/exp_avg`` and a flat ``{"w": ...}`` keeps the name ``w``. Distinct
  paths give distinct names, whatever characters the keys hold;
- the **structure document** (:class:`Structure`), strict versioned JSON in the shard's
  safetensors ``__metadata__`` under ``tiered_ckpt.structure``, so the shard's sha256
  covers it. It is the state with every array replaced by ``{"array": name}`` (or
  ``{"tensor": name}`` for a torch tensor), and every container and scalar typed:
  ``{"dict": [[key, node], ...]}`` (key order kept), ``{"list": [...]}``,
  ``{"tuple": [...]}``, ``null``, ``true``/``false``, a JSON string, a JSON integer (for
  ``-2**63 <= n < 2**63``), ``{"int": "<hex>"}`` (any other int), ``{"float": "<16 hex
  digits>"}`` (the IEEE-754 bits: -0.0, inf, nan payloads and subnormals exact). A
  ``DTensor`` (one process per rank) is saved as its local chunk, ``{"dtensor": [name,
  global_shape, offsets]}``: the box of the global tensor the chunk is. A ``bytes`` or
  ``io.BytesIO`` value is saved as a 1-D uint8 array, ``{"bytes": name}`` or
  ``{"bytesio": name}``, and comes back as the same type. A complex64 or complex128
  array, tensor or DTensor (a shard has no complex dtype) is saved as its float pairs
  (the real and imaginary parts, a trailing dimension of 2: ``view_as_real``), its node
  wrapped as ``{"complex64": node}`` or ``{"complex128": node}``, and comes back complex.

Nothing else is accepted: :func:`flatten` raises :class:`InvalidStateError` naming the
path (``state["optim"]["foo"]``) of the first value it cannot store, before anything is
written. Nor is what the reader would refuse (a shard that saves always loads): a
container nested :data:`MAX_DEPTH` keys deep, a shard header over the reader's limit
(:data:`~tiered_ckpt.shardfile.MAX_HEADER_BYTES`: the arrays' names and shapes, and the
structure document with every scalar in it; the error names the largest value), a
chunk placed by anything but integers. No pickle anywhere.
"""

from __future__ import annotations

import io
import json
import operator
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import numpy as np

from tiered_ckpt.errors import InvalidStateError, ShardFormatError
from tiered_ckpt.format.manifest import ChunkRecord, record_bytes_bound
from tiered_ckpt.format.shardfile import (
    MAX_DIMS,
    ShardContents,
    array_problem,
    dtype_code,
    header_problem,
)
from tiered_ckpt.io.hashing import ShardDigest
from tiered_ckpt.torch.tensors import as_complex, float_pairs, is_tensor, to_numpy, to_torch

__all__ = [
    "State",
    "Chunk",
    "ChunkOf",
    "Structure",
    "FlatState",
    "STRUCTURE_KEY",
    "STRUCTURE_VERSION",
    "MAX_DEPTH",
    "flatten",
    "flatten_into",
    "structure_of",
    "leaf_name",
    "unescape",
    "path_text",
    "sharded_names",
]

State = Mapping[Any, Any]
"""A rank's state: a dict of arrays, tensors, scalars and nested dicts, lists and tuples."""

STRUCTURE_KEY = "tiered_ckpt.structure"
STRUCTURE_VERSION = 1
# Real states nest a handful of levels; a bound keeps a hostile document (or a state
# that contains itself) from exhausting the stack. One rule for the writer and the
# reader (_too_deep): a container sits less than MAX_DEPTH keys deep, a leaf at most MAX_DEPTH.
MAX_DEPTH = 100
# Room flatten keeps in a shard's header for what the writer adds next to the structure
# document (the rank, world size and step: ~100 bytes), so that what flatten accepts fits.
_WRITER_METADATA_BYTES = 1024
_NAMED_VALUE_BYTES = 1024  # a header over its limit names its largest value if it is at least this large

PathKey = tuple[Literal["key", "index"], str | int]
Kind = Literal["array", "tensor", "dtensor", "legacy", "bytes", "bytesio"]
_SMALL_INT = 2**63
_HEX_INT = re.compile(r"-?0x[0-9a-f]+")
_FLOAT_BITS = re.compile(r"[0-9a-f]{16}")
_SCALARS = (type(None), bool, int, float, str)
_COMPLEX = ("complex64", "complex128")  # the wrapper tags of complex leaves, saved as float pairs
_BLOBS: dict[type, Kind] = {bytes: "bytes", io.BytesIO: "bytesio"}


def _escape(key: str) -> str:
    if not key:
        return "%"
    escaped = key.replace("%", "%25").replace("/", "%2F")
    return "%23" + escaped[1:] if escaped.startswith("#") else escaped


def unescape(segment: str) -> str:
    """The ``str`` key a name segment was made of (the inverse of the escaping in :func:`leaf_name`)."""
    if segment == "%":
        return ""
    if segment.startswith("%23"):
        segment = "#" + segment[3:]
    return segment.replace("%2F", "/").replace("%25", "%")


def _segment(kind: str, key: str | int) -> str:
    if kind == "index":
        return str(key)
    return f"#{key}" if isinstance(key, int) else _escape(key)


def leaf_name(path: Sequence[str | int], kinds: Sequence[str] | None = None) -> str:
    """The tensor name of the array at ``path`` (dict keys; ints are dict keys unless ``kinds``
    marks them ``"index"`` of a list or tuple)."""
    kinds = kinds if kinds is not None else ["key"] * len(path)
    name = "/".join(_segment(kind, key) for kind, key in zip(kinds, path, strict=True))
    return "%5F_metadata__" if name == "__metadata__" else name  # the safetensors header's own key


def path_text(path: Sequence[str | int]) -> str:
    """``path`` as the Python expression a user would write: ``state["optim"][0]``."""
    return "state" + "".join(f"[{json.dumps(key) if isinstance(key, str) else key}]" for key in path)


def _too_deep(depth: int) -> bool:
    """True for a container ``depth`` keys below the root that neither the writer nor the reader accepts."""
    return depth >= MAX_DEPTH


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _encode_int(value: int) -> Any:
    return value if -_SMALL_INT <= value < _SMALL_INT else {"int": hex(value)}


def _encode_float(value: float) -> dict[str, str]:
    return {"float": struct.pack(">d", value).hex()}


@dataclass(frozen=True)
class Chunk:
    """Where a DTensor's local chunk sits in the global tensor."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


@dataclass(frozen=True)
class ChunkOf:
    """A leaf that is one box of a larger tensor: ``data`` (an array or tensor) is the part of
    a tensor of ``global_shape`` that starts at ``offsets``. It is saved and restored as a
    DTensor's local chunk is (this is how a DTensor is saved), for writers that shard
    tensors themselves (the torch.distributed.checkpoint backend)."""

    data: Any
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


@dataclass(frozen=True)
class Structure:
    """A rank's state with its arrays replaced by their names (see the module doc).

    ``root`` is the validated JSON tree; ``kinds`` maps each tensor name to how it was
    handed to ``save`` (``"array"``: numpy, ``"tensor"``: torch, ``"bytes"``/``"bytesio"``:
    a ``bytes``/``io.BytesIO`` value, ``"legacy"``: a shard written without a structure
    document); ``paths`` maps it to its path in the state.
    ``flat`` is True for a dict of arrays under ``str`` keys and nothing else; ``chunks``
    places each DTensor leaf's chunk in its global tensor.
    """

    root: Any = field(repr=False)
    kinds: Mapping[str, Kind] = field(repr=False)
    paths: Mapping[str, tuple[str | int, ...]] = field(repr=False)
    flat: bool
    chunks: Mapping[str, Chunk] = field(default_factory=dict, repr=False)

    @classmethod
    def of_names(cls, names: Iterable[str]) -> Structure:
        """The structure of a shard written without a document: a flat dict of its arrays."""
        ordered = sorted(names)
        root = {"dict": [[name, {"array": name}] for name in ordered]}
        return cls(root, dict.fromkeys(ordered, "legacy"), {name: (name,) for name in ordered}, True)

    def to_json(self) -> str:
        """The document as a shard's metadata holds it."""
        return self._json

    @cached_property
    def _json(self) -> str:  # made once: flatten measures it, the writer writes it
        return json.dumps({"version": STRUCTURE_VERSION, "root": self.root}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str, names: Iterable[str], what: str) -> Structure:
        """Parse and strictly validate a structure document against the shard's tensor ``names``.

        Raises :class:`ShardFormatError` naming ``what`` (the file) and the problem: not
        JSON, an unknown version, a node of the wrong shape, a tensor the shard lacks or
        names twice, a shard array the document leaves out, nesting deeper than
        :data:`MAX_DEPTH`.
        """
        try:
            document = json.loads(text)
        except (ValueError, RecursionError) as exc:  # ValueError: bad JSON, or an int too long to parse
            raise ShardFormatError(f"{what}: the structure document is not valid JSON: {exc}") from None
        if not isinstance(document, dict) or set(document) != {"version", "root"}:
            raise ShardFormatError(f"{what}: the structure document must be an object with version and root")
        if document["version"] != STRUCTURE_VERSION or type(document["version"]) is not int:
            raise ShardFormatError(
                f"{what}: the structure document has version {document['version']!r:.40}; "
                f"this library reads version {STRUCTURE_VERSION}"
            )
        parser = _Parser(set(names), what)
        parser.node(document["root"], (), 0, is_root=True)
        missing = sorted(set(names) - set(parser.kinds))
        if missing:
            raise ShardFormatError(f"{what}: the structure document leaves out the shard's arrays {missing[:5]}")
        return cls(document["root"], parser.kinds, parser.paths, _is_flat(document["root"]), parser.chunks)

    def build(self, arrays: Mapping[str, Any], *, torch: bool = False) -> dict[Any, Any]:
        """The state, with each array taken from ``arrays`` by name; ``torch=True`` gives the
        leaves saved as torch tensors (and those of a legacy shard) as CPU tensors."""
        return _build(self.root, arrays, self.kinds if torch else None)

    def build_at(self, path: Sequence[str | int], arrays: Mapping[str, Any], *, torch: bool = False) -> Any:
        """The value at ``path`` (dict keys and list indices from the root), built as
        :meth:`build` builds the whole state; ``arrays`` needs only the arrays under it.
        Raises ``KeyError`` if there is no such path."""
        return _build(self._node_at(path), arrays, self.kinds if torch else None)

    def keys_at(self, path: Sequence[str | int]) -> list[str | int]:
        """The keys of the dict at ``path``, in order; raises ``KeyError`` if there is no dict there."""
        node = self._node_at(path)
        if not (isinstance(node, dict) and "dict" in node):
            raise KeyError(tuple(path))
        return [_decode_key(key) for key, _item in node["dict"]]

    def _node_at(self, path: Sequence[str | int]) -> Any:
        node = self.root
        for key in path:
            ((tag, value),) = node.items() if isinstance(node, dict) else ((None, None),)
            if tag == "dict":
                matches = [item for item_key, item in value if _decode_key(item_key) == key]
                if not matches:
                    raise KeyError(key)
                node = matches[0]
            elif tag in ("list", "tuple") and type(key) is int and 0 <= key < len(value):
                node = value[key]
            else:
                raise KeyError(key)
        return node

    def difference(self, other: Structure) -> str | None:
        """The path of the first place where ``other`` differs from this structure (keys,
        container types, scalars, array names or kinds), or None if they are the same."""
        return _difference(self.root, other.root, ())


class _Parser:
    """One validating walk over a structure document's tree."""

    def __init__(self, names: set[str], what: str) -> None:
        self.names = names
        self.what = what
        self.kinds: dict[str, Kind] = {}
        self.paths: dict[str, tuple[str | int, ...]] = {}
        self.chunks: dict[str, Chunk] = {}

    def fail(self, path: tuple[str | int, ...], problem: str) -> ShardFormatError:
        return ShardFormatError(f"{self.what}: structure document, at {path_text(path)}: {problem}")

    def node(self, node: Any, path: tuple[str | int, ...], depth: int, is_root: bool = False) -> None:
        if is_root and not (isinstance(node, dict) and set(node) == {"dict"}):
            raise self.fail(path, f"the root must be a dict node, got {str(node)[:80]}")
        if node is None or type(node) in (bool, str):
            return
        if type(node) is int:
            if not -_SMALL_INT <= node < _SMALL_INT:
                raise self.fail(path, "an integer outside [-2**63, 2**63) must be written as {'int': hex}")
            return
        if not isinstance(node, dict) or len(node) != 1:
            raise self.fail(path, f"expected a typed node (an object with one key), got {str(node)[:80]}")
        ((tag, value),) = node.items()
        if tag in ("list", "tuple", "dict") and _too_deep(depth):
            raise self.fail(path, f"nested deeper than {MAX_DEPTH} levels")
        if tag in ("array", "tensor", "bytes", "bytesio"):
            self.leaf(tag, value, path)
        elif tag == "dtensor":
            self.dtensor(value, path)
        elif tag in _COMPLEX:
            if not (isinstance(value, dict) and len(value) == 1 and set(value) <= {"array", "tensor", "dtensor"}):
                raise self.fail(path, f"{tag} must wrap an array, tensor or dtensor node")
            self.node(value, path, depth + 1)
        elif tag in ("list", "tuple"):
            if not isinstance(value, list):
                raise self.fail(path, f"{tag} must hold a JSON list")
            for index, item in enumerate(value):
                self.node(item, (*path, index), depth + 1)
        elif tag == "dict":
            self.mapping(value, path, depth)
        elif tag == "int":
            if not isinstance(value, str) or not _HEX_INT.fullmatch(value):
                raise self.fail(path, "an int must be a hex string like '-0x1f'")
        elif tag == "float":
            if not isinstance(value, str) or not _FLOAT_BITS.fullmatch(value):
                raise self.fail(path, "a float must be 16 lowercase hex digits (its IEEE-754 bits)")
        else:
            raise self.fail(path, f"unknown node type {tag!r:.40}")

    def dtensor(self, value: Any, path: tuple[str | int, ...]) -> None:
        if not (isinstance(value, list) and len(value) == 3 and all(isinstance(v, list) for v in value[1:])):
            raise self.fail(path, "a dtensor must be [name, global_shape, offsets]")
        name, shape, offsets = value
        dims = [*shape, *offsets]
        if len(shape) != len(offsets) or len(shape) > MAX_DIMS or any(type(d) is not int or d < 0 for d in dims):
            raise self.fail(path, "a dtensor's global_shape and offsets must be as many integers >= 0")
        self.leaf("dtensor", name, path)
        self.chunks[name] = Chunk(tuple(shape), tuple(offsets))

    def leaf(self, tag: Kind, name: Any, path: tuple[str | int, ...]) -> None:
        if not isinstance(name, str):
            raise self.fail(path, "an array's name must be a string")
        if name not in self.names:
            raise self.fail(path, f"names the array {name!r:.200}, which the shard does not hold")
        if name in self.kinds:
            raise self.fail(path, f"names the array {name!r:.200} a second time")
        self.kinds[name] = tag
        self.paths[name] = path

    def mapping(self, items: Any, path: tuple[str | int, ...], depth: int) -> None:
        if not isinstance(items, list):
            raise self.fail(path, "a dict must hold a JSON list of [key, value] pairs")
        seen: set[tuple[type, Any]] = set()
        for item in items:
            if not isinstance(item, list) or len(item) != 2:
                raise self.fail(path, f"a dict item must be a [key, value] pair, got {str(item)[:80]}")
            key = self.key(item[0], path)
            if (type(key), key) in seen:
                raise self.fail(path, f"the key {key!r:.80} appears twice")
            seen.add((type(key), key))
            self.node(item[1], (*path, key), depth + 1)

    def key(self, key: Any, path: tuple[str | int, ...]) -> str | int:
        if type(key) is str or (type(key) is int and -_SMALL_INT <= key < _SMALL_INT):
            return key
        if isinstance(key, dict) and set(key) == {"int"} and isinstance(key["int"], str):
            if _HEX_INT.fullmatch(key["int"]):
                return int(key["int"], 16)
        raise self.fail(path, f"a dict key must be a string or an integer, got {str(key)[:80]}")


def _is_flat(root: Any) -> bool:
    """True for a dict node of arrays under string keys and nothing else."""
    return all(type(key) is str and isinstance(item, dict) and set(item) <= {"array", "tensor", "dtensor"}
               for key, item in root["dict"])  # fmt: skip


def _decode_key(key: Any) -> Any:
    return int(key["int"], 16) if isinstance(key, dict) else key


def _build(node: Any, arrays: Mapping[str, Any], torch_kinds: Mapping[str, Kind] | None) -> Any:
    if not isinstance(node, dict):
        return node  # None, bool, str, a small int
    ((tag, value),) = node.items()
    if tag == "dict":
        return {_decode_key(key): _build(item, arrays, torch_kinds) for key, item in value}
    if tag == "list":
        return [_build(item, arrays, torch_kinds) for item in value]
    if tag == "tuple":
        return tuple(_build(item, arrays, torch_kinds) for item in value)
    if tag in ("array", "tensor", "dtensor"):
        name = value[0] if tag == "dtensor" else value
        array = arrays[name]
        if torch_kinds is not None and torch_kinds[name] != "array" and isinstance(array, np.ndarray):
            return to_torch(array)
        return array
    if tag == "bytes":
        return np.asarray(arrays[value]).tobytes()
    if tag == "bytesio":
        return io.BytesIO(np.asarray(arrays[value]).tobytes())
    if tag in _COMPLEX:
        try:
            return as_complex(_build(value, arrays, torch_kinds), tag)
        except ValueError as exc:  # a document that wraps an array of other values
            raise ShardFormatError(f"structure document: a {tag} leaf: {exc}") from None
    if tag == "int":
        return int(value, 16)
    return struct.unpack(">d", bytes.fromhex(value))[0]  # "float"


def _difference(mine: Any, theirs: Any, path: tuple[str | int, ...]) -> str | None:
    if type(mine) is not type(theirs):
        return path_text(path)
    if not isinstance(mine, dict):
        return None if mine == theirs else path_text(path)
    ((tag, value),), ((other_tag, other_value),) = mine.items(), theirs.items()
    if tag != other_tag:
        return path_text(path)
    if tag == "dict":
        keys = [_decode_key(key) for key, _ in value]
        if keys != [_decode_key(key) for key, _ in other_value]:
            return path_text(path)
        for key, (_, item), (_, other_item) in zip(keys, value, other_value, strict=True):
            if (found := _difference(item, other_item, (*path, key))) is not None:
                return found
        return None
    if tag in ("list", "tuple"):
        if len(value) != len(other_value):
            return path_text(path)
        for index, (item, other_item) in enumerate(zip(value, other_value, strict=True)):
            if (found := _difference(item, other_item, (*path, index))) is not None:
                return found
        return None
    return None if value == other_value else path_text(path)


class _Flattener:
    """One walk over a state handed to ``save`` (or ``into``), building its structure."""

    def __init__(self, owner: str, into: bool) -> None:
        self.owner = owner
        self.into = into
        self.arrays: dict[str, np.ndarray] = {}
        self.kinds: dict[str, Kind] = {}
        self.paths: dict[str, tuple[str | int, ...]] = {}
        self.chunks: dict[str, Chunk] = {}
        self.replicated: set[str] = set()
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
        if isinstance(value, (np.ndarray, np.generic, ChunkOf)) or is_tensor(value):
            return self.leaf(value, path, "%5F_metadata__" if name == "__metadata__" else name)
        if type(value) in _BLOBS:
            return self.blob(value, path, "%5F_metadata__" if name == "__metadata__" else name)
        if _too_deep(len(path)):
            raise self.fail(path, f"is nested deeper than {MAX_DEPTH} levels")
        if id(value) in self._open:
            raise self.fail(path, "contains itself (a state must be a tree)")
        self._open.add(id(value))
        try:
            if isinstance(value, dict):
                return {"dict": [self.item(key, item, path, name) for key, item in value.items()]}
            if type(value) in (list, tuple):
                tag = "list" if type(value) is list else "tuple"
                prefix = f"{name}/" if path else ""
                return {tag: [self.node(item, (*path, i), f"{prefix}{i}") for i, item in enumerate(value)]}
        finally:
            self._open.discard(id(value))
        raise self.fail(path, f"is a {type(value).__module__}.{type(value).__qualname__}, which a checkpoint "
                        "cannot hold without pickle (arrays, tensors, dicts, lists, tuples, bytes, io.BytesIO, "
                        "int, float, bool, str and None can)")  # fmt: skip

    def item(self, key: Any, value: Any, path: tuple[str | int, ...], name: str) -> list[Any]:
        if type(key) is str:
            if not _is_text(key):
                raise self.fail(path, f"has the key {key!r:.80}, which is not valid Unicode text")
            self.note(_text_bytes(key), (*path, key))
            encoded: Any = key
        elif type(key) is int:
            encoded = _encode_int(key)
        else:
            raise self.fail(path, f"has the key {key!r:.80} of type {type(key).__name__}; keys must be str or int")
        segment = _segment("key", key)
        return [encoded, self.node(value, (*path, key), f"{name}/{segment}" if path else segment)]

    def scalar(self, value: Any, path: tuple[str | int, ...]) -> Any:
        if type(value) is int:
            encoded = _encode_int(value)
            if isinstance(encoded, dict):
                self.note(len(encoded["int"]), path)
            return encoded
        if type(value) is float:
            return _encode_float(value)
        if type(value) is str:
            if not _is_text(value):
                raise self.fail(path, "is a str that is not valid Unicode text (a lone surrogate)")
            self.note(_text_bytes(value), path)
        return value

    def check_header(self, state: FlatState) -> None:
        """Raise :class:`InvalidStateError` if the shard of ``state`` would have a header its reader refuses."""
        problem = header_problem(state.arrays, state.metadata(), _WRITER_METADATA_BYTES)
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
        kind: Kind = ("dtensor" if _is_dtensor(value) else "tensor") if is_tensor(value) else "array"
        if isinstance(value, ChunkOf):
            kind = "dtensor"
        node: Any = name
        if kind == "dtensor":
            array, chunk = self.chunk_of(value, path) if isinstance(value, ChunkOf) else self.dtensor(value, path)
            self.chunks[name] = chunk
            if not isinstance(value, ChunkOf) and any(placement.is_replicate() for placement in value.placements):
                self.replicated.add(name)
            node = [name, list(chunk.global_shape), list(chunk.offsets)]
        elif kind == "tensor":
            array = self.tensor(value, path)
        else:
            array = np.asarray(value) if isinstance(value, np.generic) else value
        complex_tag = None
        if array.dtype.kind == "c" and array.dtype.name in _COMPLEX:
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

    def dtensor(self, value: Any, path: tuple[str | int, ...]) -> tuple[np.ndarray, Chunk]:
        """A DTensor's local chunk (a view of it) and where it sits in the global tensor."""
        if any(placement.is_partial() for placement in value.placements):
            raise self.fail(path, "is a DTensor with a Partial placement (a pending reduction): reduce it first")
        chunks = value.__create_chunk_list__()  # DTensor's own metadata, as DCP's planner reads it
        local = value.to_local()
        if len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(local.shape):
            raise self.fail(path, f"is a DTensor whose local tensor is {len(chunks)} chunks, not one")
        if not local.is_contiguous():
            raise self.fail(path, "is a DTensor whose local tensor is not contiguous")
        return self.tensor(local, path), Chunk(tuple(value.shape), tuple(chunks[0].offsets))

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
            raise self.fail(path, f"is a ChunkOf whose global_shape or offsets {values!r:.120} are not "
                            f"at most {MAX_DIMS} integers >= 0")  # fmt: skip
        return dims

    def tensor(self, value: Any, path: tuple[str | int, ...]) -> np.ndarray:
        if self.into and value.device.type != "cpu":
            raise self.fail(path, f"is on {value.device}; into= fills CPU tensors and arrays in place")
        try:
            return to_numpy(value)
        except (RuntimeError, TypeError) as exc:  # sparse, quantized or otherwise non-strided tensors
            raise self.fail(path, f"is a tensor numpy cannot view: {exc}") from exc


def _dimension(value: Any) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError("a bool is not a dimension")
    return operator.index(value)


def _text_bytes(text: str) -> int:
    """Roughly the bytes ``text`` takes in a shard's header: json escapes a non-ASCII character
    as ``\\uXXXX`` in the structure document, and its backslash again in the header."""
    return len(text) if text.isascii() else 7 * len(text)


def _is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and hasattr(value, "placements")


@dataclass(frozen=True)
class FlatState:
    """A rank's state as a shard holds it: arrays by tensor name, and their structure.

    ``shared`` names the arrays of a state of DTensors that other ranks may hold identical
    copies of (its plain arrays, and DTensor chunks on a replicated mesh dimension): a
    save writes each such copy once (:mod:`tiered_ckpt.replicas`).
    """

    arrays: dict[str, np.ndarray]
    structure: Structure
    shared: frozenset[str] = frozenset()

    def chunk_records(self, digests: Mapping[str, ShardDigest]) -> tuple[ChunkRecord, ...]:
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
                )  # fmt: skip
            )
        return tuple(records)

    def record_bytes(self) -> int:
        """At least the bytes this rank's record adds to its step's manifest (a state of DTensors
        records every array as a chunk; :func:`~tiered_ckpt.manifest.record_bytes_bound`)."""
        chunks = ((name, array.ndim) for name, array in self.arrays.items()) if self.structure.chunks else ()
        return record_bytes_bound(chunks)

    def unflatten(self, *, torch: bool = False) -> dict[Any, Any]:
        """The nested state: arrays as numpy, or (``torch=True``) as each leaf was saved."""
        return self.structure.build(self.arrays, torch=torch)

    def metadata(self) -> dict[str, str]:
        """What the shard's ``__metadata__`` holds of this state."""
        return {STRUCTURE_KEY: self.structure.to_json()}

    @classmethod
    def from_shard(cls, contents: ShardContents, what: str, elsewhere: Iterable[str] = ()) -> FlatState:
        """The state a verified shard holds; a shard without a structure document (written
        before there were any) is a flat dict of its arrays. ``elsewhere`` names the arrays
        the document names but another rank's shard holds (the manifest's replicas): they
        are not in the state returned. Raises :class:`ShardFormatError` naming ``what`` if
        the document is not valid."""
        return cls(contents.arrays, structure_of(contents.metadata, contents.arrays, what, elsewhere))


def structure_of(
    metadata: Mapping[str, str], names: Iterable[str], what: str, elsewhere: Iterable[str] = ()
) -> Structure:
    """The structure of a shard with ``metadata`` holding the arrays ``names`` (and naming
    ``elsewhere``, held by another rank's shard); see :meth:`FlatState.from_shard`."""
    text = metadata.get(STRUCTURE_KEY)
    held_elsewhere = list(elsewhere)
    if text is None:
        if held_elsewhere:
            raise ShardFormatError(f"{what}: a shard without a structure document cannot leave arrays to others")
        return Structure.of_names(names)
    return Structure.from_json(text, [*names, *held_elsewhere], what)


def flatten(state: Any, owner: str = "state", *, into: bool = False) -> FlatState:
    """``state`` as named numpy arrays (torch tensors as views, copied to host from another
    device) and its structure; raise :class:`InvalidStateError` naming ``owner`` and the
    path of the first value that cannot be saved. ``into=True`` checks a state to fill in
    place instead: every tensor must then be on the CPU."""
    if not isinstance(state, dict):
        raise InvalidStateError(f"{owner}: the state is a {type(state).__name__}, not a dict")
    flattener = _Flattener(owner, into)
    root = flattener.node(state, (), "")
    structure = Structure(root, flattener.kinds, flattener.paths, _is_flat(root), flattener.chunks)
    plain = {name for name, kind in flattener.kinds.items() if kind != "dtensor"}
    shared = frozenset(plain | flattener.replicated) if flattener.chunks else frozenset()
    flat = FlatState(flattener.arrays, structure, shared)
    if not into:
        flattener.check_header(flat)
    return flat


def flatten_into(into: Any, owner: str) -> FlatState:
    """A state to fill in place: its arrays by tensor name (views of its tensors and DTensor
    chunks) and where its DTensor chunks sit; its scalars are not filled."""
    return flatten(into, owner, into=True)


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
