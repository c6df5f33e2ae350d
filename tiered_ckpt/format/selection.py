"""Which parts of a saved state a partial restore reads, and the structure of what it returns.

A selection is a list of paths: a tuple of dict keys from the root (``("optim", "state")``),
a top-level key (``"model"``), or a tensor name as the shard holds it (``"model/w"``) or the
start of some (``"optim/state/#0"``, the part of the state they lie under). What
is restored is the saved state cut down to the values under those paths, nested as saved:
``{"model": {...}}`` for ``["model"]``. A path may not go into a list or tuple (select the
list itself): cutting one would change its indices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tiered_ckpt.errors import UsageError
from tiered_ckpt.format.structure import Structure, decode_key, is_flat, leaf_name, path_text

__all__ = ["Paths", "check_paths", "prefixes", "resolve_path", "select", "selects"]

Paths = Sequence[str | Sequence[str | int]]
"""What ``restore(paths=...)`` takes: top-level keys, tensor names or tuples of keys."""


def check_paths(paths: object, caller: str = "restore") -> tuple[str | tuple[str | int, ...], ...]:
    """``paths`` as a tuple of strings and key tuples; :class:`UsageError` naming ``caller`` and
    the first entry that is neither (or an empty selection, which would restore nothing)."""
    if isinstance(paths, (str, bytes)) or not isinstance(paths, Sequence):
        raise UsageError(f"{caller}: paths must be a list of keys, names or key tuples, got {paths!r:.80}")
    checked: list[str | tuple[str | int, ...]] = []
    for entry in paths:
        if isinstance(entry, str):
            checked.append(entry)
        elif (
            isinstance(entry, Sequence)
            and not isinstance(entry, (bytes, bytearray))
            and entry
            and all(type(key) in (str, int) for key in entry)
        ):
            checked.append(tuple(entry))
        else:
            raise UsageError(f"{caller}: paths: {entry!r:.80} is neither a key, a tensor name nor a tuple of keys")
    if not checked:
        raise UsageError(f"{caller}: paths is empty: it would select nothing (None is everything)")
    return tuple(checked)


def prefixes(structure: Structure, paths: Sequence[str | tuple[str | int, ...]], what: str) -> tuple[str, ...]:
    """The tensor names the selection's paths start (a name is selected when it is one of them
    or starts with one and "/"): what :func:`selects` decides by, from names alone, the same
    on every rank of a job whose states share one nesting."""
    return tuple(leaf_name(resolve_path(structure, entry, what)) for entry in paths)


def selects(names: Sequence[str], name: str) -> bool:
    """Whether ``name`` lies under one of the :func:`prefixes` ``names``."""
    return any(name == prefix or name.startswith(prefix + "/") for prefix in names)


def resolve_path(structure: Structure, entry: str | tuple[str | int, ...], what: str) -> tuple[str | int, ...]:
    """The path of keys one entry of a selection stands for in ``structure`` (see the module
    doc); :class:`UsageError` naming ``what`` if it is neither a key, an array nor the start
    of some array names."""
    if isinstance(entry, tuple):
        return entry
    top = [decode_key(key) for key, _item in structure.root["dict"]]
    if entry in top:
        return (entry,)
    if entry in structure.paths:
        return structure.paths[entry]
    below = next((path for name, path in structure.paths.items() if name.startswith(entry + "/")), None)
    if below is not None:  # the start of some tensor names: the part of the state they lie under
        return below[: entry.count("/") + 1]
    keys = sorted(str(key) for key in top)
    raise UsageError(f"{what}: paths: {entry!r:.200} is neither a top-level key ({', '.join(keys)[:300]}) nor an array")


def _cut(node: Any, wanted: list[tuple[str | int, ...]], path: tuple[str | int, ...], what: str) -> Any:
    """``node`` with only what lies under ``wanted`` (paths below ``node``'s own ``path``)."""
    if any(not rest for rest in wanted):
        return node
    if not (isinstance(node, dict) and set(node) == {"dict"}):
        kind = next(iter(node)) if isinstance(node, dict) and node else "value"
        raise UsageError(f"{what}: paths: {path_text((*path, wanted[0][0]))} goes into a {kind}, not a dict")
    items = []
    for key, item in node["dict"]:
        decoded = decode_key(key)
        below = [rest[1:] for rest in wanted if rest[0] == decoded and type(rest[0]) is type(decoded)]
        if below:
            items.append([key, _cut(item, below, (*path, decoded), what)])
    return {"dict": items}


def select(structure: Structure, paths: Sequence[str | tuple[str | int, ...]], what: str) -> Structure:
    """The part of ``structure`` under ``paths`` (see the module doc), its arrays those under
    them. :class:`UsageError` naming ``what`` (the shard) if a path is not in the state or goes
    into a list, a tuple or a value."""
    wanted = [resolve_path(structure, entry, what) for entry in paths]
    for path in wanted:
        if not structure.contains(path):
            raise UsageError(f"{what}: paths: {path_text(path)} is not in the saved state")
    root = _cut(structure.root, wanted, (), what)
    names = {name for name, place in structure.paths.items() if any(place[: len(p)] == p for p in wanted)}
    return Structure(
        root,
        {name: kind for name, kind in structure.kinds.items() if name in names},
        {name: place for name, place in structure.paths.items() if name in names},
        is_flat(root),
        {name: chunk for name, chunk in structure.chunks.items() if name in names},
    )
