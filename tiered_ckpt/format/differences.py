"""What differs between the arrays a checkpoint holds and the arrays a caller gave to fill (``into``).

One message for every reader that fills the caller's arrays: a shard read whole, a
selection of a partial restore, a state of DTensors filled chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["into_difference"]

_LISTED = 5  # names shown per kind of difference; a state of thousands of arrays keeps a short message


def into_difference(
    expected: Mapping[str, tuple[np.dtype, tuple[int, ...]] | None], into: Mapping[str, Any], holder: str = "the shard"
) -> str:
    """What differs between the arrays ``holder`` holds (``expected``: name -> dtype and shape,
    or None to compare the name only) and ``into``'s: the names missing from ``into``, those
    it has in excess, and those of another dtype or shape (a few of each, with counts); ""
    if they match."""
    missing = sorted(expected.keys() - into.keys())
    extra = sorted(into.keys() - expected.keys())
    found = []
    for name, kind in expected.items():
        if kind is None or name not in into:
            continue
        dtype, shape = kind
        array = into[name]
        if not isinstance(array, np.ndarray) or array.dtype != dtype or array.shape != shape:
            got = f"{array.dtype} {_shape(array.shape)}" if isinstance(array, np.ndarray) else type(array).__name__
            found.append((name, f"{name!r:.120} {got} ({holder}: {dtype} {_shape(shape)})"))
    mismatched = [text for _name, text in sorted(found)]
    parts = [
        _listed(f"{len(missing)} missing from into", [f"{name!r:.120}" for name in missing]),
        _listed(f"{len(extra)} not in {holder}", [f"{name!r:.120}" for name in extra]),
        _listed(f"{len(mismatched)} of another dtype or shape", mismatched),
    ]
    return "; ".join(part for part, items in zip(parts, (missing, extra, mismatched), strict=True) if items)


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) if shape else "scalar"


def _listed(title: str, items: list[str]) -> str:
    more = f", and {len(items) - _LISTED} more" if len(items) > _LISTED else ""
    return f"{title}: {', '.join(items[:_LISTED])}{more}"
