"""The structure document: a rank's state with its arrays replaced by their names.

Each array of a state is saved under a **tensor name** made from its path
(:func:`leaf_name`): the path's keys joined by ``/``, a ``str`` key as itself with ``%``,
``/`` and a leading ``#`` percent-escaped (and ``""`` as ``%``), an ``int`` key as
``#<n>``, a list or tuple index as ``<n>``. So ``state["optim"]["state"][0]["exp_avg"]``
is ``optim/state/#0/exp_avg`` and a flat ``{"w": ...}`` keeps the name ``w``. Distinct
paths give distinct names, whatever characters the keys hold.

The document (:class:`Structure`) is strict versioned JSON in the shard's safetensors
``__metadata__`` under ``tiered_ckpt.structure``, so the shard's sha256 covers it. It is
the state with every array replaced by ``{"array": name}`` (or ``{"tensor": name}`` for a
torch tensor), and every container and scalar typed: ``{"dict": [[key, node], ...]}``
(key order kept), ``{"list": [...]}``, ``{"tuple": [...]}``, ``null``, ``true``/``false``,
a JSON string, a JSON integer (for ``-2**63 <= n < 2**63``), ``{"int": "<hex>"}`` (any
other int), ``{"float": "<16 hex digits>"}`` (the IEEE-754 bits: -0.0, inf, nan payloads
and subnormals exact). A chunk of a larger tensor (a ``DTensor``'s local chunk) is
``{"dtensor": [name, global_shape, offsets]}``: the box of the global tensor the chunk
is. A ``bytes`` or ``io.BytesIO`` value is a 1-D uint8 array, ``{"bytes": name}`` or
``{"bytesio": name}``, and comes back as the same type. A complex64 or complex128 leaf
(a shard has no complex dtype) is its float pairs (the real and imaginary parts, a
trailing dimension of 2: ``view_as_real``), its node wrapped as ``{"complex64": node}``
or ``{"complex128": node}``, and comes back complex.

The parser (:meth:`Structure.from_json`) trusts nothing: a document is untrusted input,
refused with :class:`ShardFormatError` naming the file and the path of its first problem.
"""

from __future__ import annotations

import io
import json
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import numpy as np

from tiered_ckpt.errors import ShardFormatError
from tiered_ckpt.format.shardfile import MAX_DIMS
from tiered_ckpt.io.gc_pause import cyclic_gc_paused
from tiered_ckpt.torch.tensors import as_complex, to_torch

__all__ = [
    "Kind",
    "Chunk",
    "Structure",
    "STRUCTURE_KEY",
    "STRUCTURE_VERSION",
    "MAX_DEPTH",
    "COMPLEX_TAGS",
    "structure_of",
    "leaf_name",
    "key_segment",
    "unescape",
    "path_text",
    "too_deep",
    "encode_int",
    "encode_float",
    "is_flat",
    "decode_key",
]

STRUCTURE_KEY = "tiered_ckpt.structure"
STRUCTURE_VERSION = 1
# Real states nest a handful of levels; a bound keeps a hostile document (or a state
# that contains itself) from exhausting the stack. One rule for the writer and the
# reader (too_deep): a container sits less than MAX_DEPTH keys deep, a leaf at most MAX_DEPTH.
MAX_DEPTH = 100

Kind = Literal["array", "tensor", "dtensor", "bytes", "bytesio"]
"""How a tensor name's leaf was handed to ``save`` (see :class:`Structure`)."""
COMPLEX_TAGS = ("complex64", "complex128")  # the wrapper tags of complex leaves, saved as float pairs
_SMALL_INT = 2**63
_FLAT_TAGS = frozenset(("array", "tensor", "dtensor"))
_HEX_INT = re.compile(r"-?0x[0-9a-f]+")
_FLOAT_BITS = re.compile(r"[0-9a-f]{16}")


def _escape(key: str) -> str:
    if not key:
        return "%"
    if "%" not in key and "/" not in key and key[0] != "#":  # most keys: nothing to escape
        return key
    escaped = key.replace("%", "%25").replace("/", "%2F")
    return "%23" + escaped[1:] if escaped.startswith("#") else escaped


def unescape(segment: str) -> str:
    """The ``str`` key a name segment was made of (the inverse of the escaping in :func:`leaf_name`)."""
    if segment == "%":
        return ""
    if segment.startswith("%23"):
        segment = "#" + segment[3:]
    return segment.replace("%2F", "/").replace("%25", "%")


def key_segment(kind: str, key: str | int) -> str:
    """One segment of a tensor name: a list or tuple ``"index"`` as its digits, an ``int`` dict key
    as ``#<n>``, a ``str`` key escaped (so that distinct paths never make the same name)."""
    if kind == "index":
        return str(key)
    return f"#{key}" if isinstance(key, int) else _escape(key)


def leaf_name(path: Sequence[str | int], kinds: Sequence[str] | None = None) -> str:
    """The tensor name of the array at ``path`` (dict keys; ints are dict keys unless ``kinds``
    marks them ``"index"`` of a list or tuple)."""
    kinds = kinds if kinds is not None else ["key"] * len(path)
    name = "/".join(key_segment(kind, key) for kind, key in zip(kinds, path, strict=True))
    return "%5F_metadata__" if name == "__metadata__" else name  # the safetensors header's own key


def path_text(path: Sequence[str | int]) -> str:
    """``path`` as the Python expression a user would write: ``state["optim"][0]``."""
    return "state" + "".join(f"[{json.dumps(key) if isinstance(key, str) else key}]" for key in path)


def too_deep(depth: int) -> bool:
    """True for a container ``depth`` keys below the root that neither the writer nor the reader accepts."""
    return depth >= MAX_DEPTH


def encode_int(value: int) -> Any:
    """The node of an int: itself in ``[-2**63, 2**63)``, else ``{"int": hex}`` (exact at any size)."""
    return value if -_SMALL_INT <= value < _SMALL_INT else {"int": hex(value)}


def encode_float(value: float) -> dict[str, str]:
    """The node of a float: its IEEE-754 bits as 16 hex digits (-0.0, inf and nan payloads exact)."""
    return {"float": struct.pack(">d", value).hex()}


@dataclass(frozen=True)
class Chunk:
    """Where a DTensor's local chunk sits in the global tensor."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


@dataclass(frozen=True)
class Structure:
    """A rank's state with its arrays replaced by their names (see the module doc).

    ``root`` is the validated JSON tree; ``kinds`` maps each tensor name to how it was
    handed to ``save`` (``"array"``: numpy, ``"tensor"``: torch, ``"bytes"``/``"bytesio"``:
    a ``bytes``/``io.BytesIO`` value); ``paths`` maps it to its path in the state.
    ``flat`` is True for a dict of arrays under ``str`` keys and nothing else; ``chunks``
    places each DTensor leaf's chunk in its global tensor.
    """

    root: Any = field(repr=False)
    kinds: Mapping[str, Kind] = field(repr=False)
    paths: Mapping[str, tuple[str | int, ...]] = field(repr=False)
    flat: bool
    chunks: Mapping[str, Chunk] = field(default_factory=dict, repr=False)

    def to_json(self) -> str:
        """The document as a shard's metadata holds it."""
        return self._json

    @cached_property
    def _json(self) -> str:  # made once: flatten measures it, the writer writes it
        return json.dumps({"version": STRUCTURE_VERSION, "root": self.root}, separators=(",", ":"))

    @classmethod
    @cyclic_gc_paused()  # an object or more per array, all alive until returned: see io/gc_pause.py
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
        return cls(document["root"], parser.kinds, parser.paths, is_flat(document["root"]), parser.chunks)

    @cyclic_gc_paused()  # an object or more per array, all alive until returned: see io/gc_pause.py
    def build(self, arrays: Mapping[str, Any], *, torch: bool = False) -> dict[Any, Any]:
        """The state, with each array taken from ``arrays`` by name; ``torch=True`` gives the
        leaves saved as torch tensors as CPU tensors."""
        state: dict[Any, Any] = _build(self.root, arrays, self.kinds if torch else None)  # the root is a dict
        return state

    @cyclic_gc_paused()  # an object or more per array, all alive until returned: see io/gc_pause.py
    def build_at(self, path: Sequence[str | int], arrays: Mapping[str, Any], *, torch: bool = False) -> Any:
        """The value at ``path`` (dict keys and list indices from the root), built as
        :meth:`build` builds the whole state; ``arrays`` needs only the arrays under it.
        Raises ``KeyError`` if there is no such path."""
        return _build(self._node_at(path), arrays, self.kinds if torch else None)

    def contains(self, path: Sequence[str | int]) -> bool:
        """True if the state has a value at ``path`` (dict keys and list indices from the root)."""
        try:
            self._node_at(path)
        except KeyError:
            return False
        return True

    def keys_at(self, path: Sequence[str | int]) -> list[str | int]:
        """The keys of the dict at ``path``, in order; raises ``KeyError`` if there is no dict there."""
        node = self._node_at(path)
        if not (isinstance(node, dict) and "dict" in node):
            raise KeyError(tuple(path))
        return [decode_key(key) for key, _item in node["dict"]]

    def _node_at(self, path: Sequence[str | int]) -> Any:
        node = self.root
        for key in path:
            if not isinstance(node, dict):
                raise KeyError(key)
            ((tag, value),) = node.items()
            if tag == "dict":
                matches = [item for item_key, item in value if decode_key(item_key) == key]
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
        if tag in ("list", "tuple", "dict") and too_deep(depth):
            raise self.fail(path, f"nested deeper than {MAX_DEPTH} levels")
        if tag in ("array", "tensor", "bytes", "bytesio"):
            self.leaf(tag, value, path)
        elif tag == "dtensor":
            self.dtensor(value, path)
        elif tag in COMPLEX_TAGS:
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
            node = item[1]
            if type(node) is dict and len(node) == 1 and "array" in node:  # what node() does, for the common leaf
                self.leaf("array", node["array"], (*path, key))
            else:
                self.node(node, (*path, key), depth + 1)

    def key(self, key: Any, path: tuple[str | int, ...]) -> str | int:
        if type(key) is str or (type(key) is int and -_SMALL_INT <= key < _SMALL_INT):
            return key
        if isinstance(key, dict) and set(key) == {"int"} and isinstance(key["int"], str):
            if _HEX_INT.fullmatch(key["int"]):
                return int(key["int"], 16)
        raise self.fail(path, f"a dict key must be a string or an integer, got {str(key)[:80]}")


def is_flat(root: Any) -> bool:
    """True for a dict node of arrays under string keys and nothing else."""
    return all(type(key) is str and isinstance(item, dict) and item.keys() <= _FLAT_TAGS for key, item in root["dict"])


def decode_key(key: Any) -> Any:
    """A dict key as the structure document holds it (``{"int": hex}`` for a large int), as the state's own."""
    return int(key["int"], 16) if isinstance(key, dict) else key


def _build(node: Any, arrays: Mapping[str, Any], torch_kinds: Mapping[str, Kind] | None) -> Any:
    if not isinstance(node, dict):
        return node  # None, bool, str, a small int
    ((tag, value),) = node.items()
    if tag == "dict":
        return {decode_key(key): _build(item, arrays, torch_kinds) for key, item in value}
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
    if tag in COMPLEX_TAGS:
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
        keys = [decode_key(key) for key, _ in value]
        if keys != [decode_key(key) for key, _ in other_value]:
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


def structure_of(
    metadata: Mapping[str, str], names: Iterable[str], what: str, replicas: Iterable[str] = ()
) -> Structure:
    """The structure of a shard with ``metadata`` holding the arrays ``names`` (and naming its
    ``replicas``, which their writers' shards store); see :meth:`~tiered_ckpt.format.state.FlatState.from_shard`."""
    text = metadata.get(STRUCTURE_KEY)
    if text is None:
        raise ShardFormatError(f"{what}: the shard has no structure document ({STRUCTURE_KEY} in its metadata)")
    return Structure.from_json(text, [*names, *replicas], what)
