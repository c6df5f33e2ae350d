"""Strict reading of an untrusted manifest's JSON (one object, typed fields, errors naming the
field), and the layout manifests are written in.

A manifest (local or remote) is untrusted input: :func:`load_object` refuses a document
over its size bound, duplicate keys and the non-JSON constants ``NaN``/``Infinity``;
:class:`Fields` reads each field with its type checked. Every problem raises
:class:`ManifestError` naming the source (a file or URL) and the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from tiered_ckpt.errors import ManifestError

__all__ = ["load_object", "Fields", "dump_object"]


def dump_object(document: Mapping[str, Any], listed: str) -> str:
    """``document`` (a JSON object) as JSON text ending in a newline, its list ``listed`` last and
    each item of that list on a line of its own.

    How manifests are written: a record a line stays readable, and each line is encoded by
    json's C encoder (``indent`` makes json use its pure-Python one, several times slower over
    10**4 shard records) without the indentation's bytes.
    """
    head = json.dumps({name: value for name, value in document.items() if name != listed})
    items = ",\n".join(json.dumps(item, separators=(",", ":")) for item in document[listed])
    return f"{head[:-1]}{', ' if len(head) > 2 else ''}{json.dumps(listed)}: [\n{items}\n]}}\n"


def load_object(text: str | bytes, source: str, max_bytes: int) -> dict[str, Any]:
    """The JSON object ``text`` holds, read strictly: :class:`ManifestError` naming ``source`` if it
    is over ``max_bytes``, not JSON, has a key twice or ``NaN``/``Infinity``, or is not an object."""
    if len(text) > max_bytes:
        raise ManifestError(f"{source}: manifest is {len(text)} bytes, over the {max_bytes} limit")
    try:
        document = json.loads(text, object_pairs_hook=_reject_duplicate_keys, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ManifestError(f"{source}: not a valid JSON manifest: {exc}") from exc
    if not isinstance(document, dict):
        raise ManifestError(f"{source}: manifest must be a JSON object, got {type(document).__name__}")
    return document


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed")


class Fields:
    """Typed access to one JSON object's fields, with errors naming source and field."""

    def __init__(self, document: Mapping[str, Any], source: str, prefix: str) -> None:
        self._document = document
        self._source = source
        self._prefix = prefix

    def _fail(self, name: str, problem: str) -> ManifestError:
        return ManifestError(f"{self._source}: field '{self._prefix}{name}': {problem}")

    def reject_unknown(self, known: set[str]) -> None:
        """Raise unless every field of the object is one of ``known``."""
        unknown = sorted(set(self._document) - known)
        if unknown:
            raise self._fail(unknown[0], "unknown field")

    def _get(self, name: str) -> Any:
        if name not in self._document:
            raise self._fail(name, "missing")
        return self._document[name]

    def integer(self, name: str, *, minimum: int) -> int:
        """The field ``name``: an integer (not a bool) >= ``minimum``."""
        value = self._get(name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._fail(name, f"expected an integer, got {_describe(value)}")
        if value < minimum:
            raise self._fail(name, f"must be >= {minimum}, got {value}")
        return value

    def number(self, name: str) -> float:
        """The field ``name``: a finite number >= 0, as a float."""
        value = self._get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._fail(name, f"expected a number, got {_describe(value)}")
        if not math.isfinite(value) or value < 0:
            raise self._fail(name, f"must be a finite number >= 0, got {value}")
        return float(value)

    def string(self, name: str) -> str:
        """The field ``name``: a string."""
        value = self._get(name)
        if not isinstance(value, str):
            raise self._fail(name, f"expected a string, got {_describe(value)}")
        return value

    def list_of(self, name: str, item_type: type) -> list[Any]:
        """The field ``name``: a list whose every item is an ``item_type``."""
        value = self._get(name)
        if not isinstance(value, list):
            raise self._fail(name, f"expected a list, got {_describe(value)}")
        for i, item in enumerate(value):
            if not isinstance(item, item_type):
                raise self._fail(f"{name}[{i}]", f"expected {item_type.__name__}, got {_describe(item)}")
        return value


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"
