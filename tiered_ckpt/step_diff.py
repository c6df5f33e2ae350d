"""What a step holds and how two steps differ, from their manifests and shard headers alone
(``tiered-ckpt show`` and ``tiered-ckpt diff``): no shard is read whole, nothing is written.

An array is named by the rank whose shard stores it and its tensor name. Two steps' copies
of it are the same bytes where the digests their manifests record for it agree (the sha256
of each array of a state of DTensors, or the xxh3-64 of each array of a shard of plain
arrays); where either step recorded none, whether its bytes changed is unknown, and said so.
A step of an incremental save owns its shard files and references the arrays it did not
write again in earlier steps' files: both are counted (``own_bytes``, ``referenced_bytes``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.format.shardfile import DTYPE_CODES
from tiered_ckpt.tiers.store import TieredStore

__all__ = ["ArrayChange", "StepArray", "StepArrays", "StepDiff", "diff_steps", "step_arrays"]

Change = Literal["added", "removed", "dtype", "shape", "bytes", "unknown"]


@dataclass(frozen=True)
class StepArray:
    """One array of a step as its shard stores it: ``rank``'s shard, ``name``, safetensors
    ``dtype`` code, ``shape``, ``bytes``, the ``tier`` its header was read from, the
    digest the manifest records for its bytes (``"sha256:…"`` or ``"xxh3_64:…"``; "" if none)
    and ``stored_in``: the step whose file holds its bytes (an earlier one where the step
    references it: an incremental save; None: its own)."""

    rank: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    tier: str
    digest: str = ""
    stored_in: int | None = None

    def describe(self) -> str:
        """``BF16 4096x4096``: its dtype and shape, as ``show`` prints them."""
        return f"{self.dtype} {'x'.join(map(str, self.shape)) or 'scalar'}"


@dataclass(frozen=True)
class StepArrays:
    """The arrays of one step (:func:`step_arrays`), by rank and name. ``missing_ranks``: the
    ranks whose shards are on other nodes' disks (one rank's directory of a multi-process
    job without a bucket holding the step): their arrays are not listed."""

    manifest: ShardManifest
    arrays: Mapping[tuple[int, str], StepArray]
    missing_ranks: tuple[int, ...] = ()

    @property
    def own_bytes(self) -> int:
        """The bytes of its shard files: what the step owns (the arrays it references are not)."""
        return self.manifest.total_bytes

    @property
    def referenced_bytes(self) -> int:
        """The bytes of the arrays it references in earlier steps' files."""
        return self.manifest.referenced_bytes


@dataclass(frozen=True)
class ArrayChange:
    """How one array differs between two steps: ``added`` (only in the second), ``removed``
    (only in the first), ``dtype``, ``shape``, ``bytes`` (their digests differ) or ``unknown``
    (same dtype and shape, and a step recorded no digest to compare). ``before``/``after``:
    the array in each step (None where it is absent)."""

    rank: int
    name: str
    change: Change
    before: StepArray | None
    after: StepArray | None


@dataclass(frozen=True)
class StepDiff:
    """Two steps compared (:func:`diff_steps`): the arrays that differ, in rank and name order,
    and how many are the same (dtype, shape and digest)."""

    first: StepArrays
    second: StepArrays
    changes: tuple[ArrayChange, ...]
    same: int

    @property
    def identical(self) -> bool:
        """True if every array of both steps is the same, as far as the digests tell."""
        return not self.changes

    def to_dict(self) -> dict[str, Any]:
        """What ``tiered-ckpt diff --json`` prints."""

        def side(arrays: StepArrays) -> dict[str, Any]:
            return {
                "step": arrays.manifest.step,
                "world_size": arrays.manifest.world_size,
                "bytes": arrays.own_bytes,
                "referenced_bytes": arrays.referenced_bytes,
                "missing_ranks": list(arrays.missing_ranks),
            }

        def one(array: StepArray | None) -> dict[str, Any] | None:
            if array is None:
                return None
            return {
                "dtype": array.dtype,
                "shape": list(array.shape),
                "bytes": array.bytes,
                "digest": array.digest,
                "stored_in": array.stored_in,
            }

        changes = [
            {"rank": c.rank, "name": c.name, "change": c.change, "before": one(c.before), "after": one(c.after)}
            for c in self.changes
        ]
        return {
            "first": side(self.first),
            "second": side(self.second),
            "identical": self.identical,
            "same": self.same,
            "changes": changes,
        }


def step_arrays(store: TieredStore, step: int) -> StepArrays:
    """Every array of ``step`` from its manifest and its shards' headers (each verified by its
    sha256), read from the nearest tier holding them. Raises as the store's reads do
    (:class:`~tiered_ckpt.errors.IncompleteCheckpointError` for a step no tier holds)."""
    in_local = step in store.local.steps()
    in_remote = store.remote is not None and step in store.remote_steps()
    manifest, _remote = store.manifests(step, in_local=in_local, in_remote=in_remote)
    later = store.readable(in_remote)
    held = set(store.local.held_ranks(step, manifest)) if in_local else set()
    missing = () if later else tuple(record.rank for record in manifest.shards if record.rank not in held)
    arrays: dict[tuple[int, str], StepArray] = {}
    for record in manifest.shards:
        if record.rank in missing:
            continue
        header, tier = store.read_shard_header(step, record, later=later)
        names = sorted(header.arrays)
        digests = record.digests_by_name(names)
        referenced = record.referenced
        for name in names:
            entry = header.arrays[name]
            dtype, size = DTYPE_CODES[entry.dtype], entry.end - entry.begin
            stored_in = referenced[name].step if name in referenced else None
            arrays[record.rank, name] = StepArray(
                record.rank, name, dtype, tuple(entry.shape), size, tier, digests.get(name, ""), stored_in
            )
    return StepArrays(manifest, arrays, missing)


def _change(before: StepArray, after: StepArray) -> Change | None:
    if before.dtype != after.dtype:
        return "dtype"
    if before.shape != after.shape:
        return "shape"
    kind = before.digest.partition(":")[0]
    if not before.digest or kind != after.digest.partition(":")[0]:
        return "unknown"
    return None if before.digest == after.digest else "bytes"


def diff_steps(store: TieredStore, first: int, second: int) -> StepDiff:
    """How ``second`` differs from ``first``, array by array (see the module doc)."""
    a, b = step_arrays(store, first), step_arrays(store, second)
    changes: list[ArrayChange] = []
    same = 0
    for key in sorted(set(a.arrays) | set(b.arrays)):
        before, after = a.arrays.get(key), b.arrays.get(key)
        if before is None or after is None:
            if key[0] in (*a.missing_ranks, *b.missing_ranks):
                continue  # on another node's disk in one of them: nothing to compare it with
            changes.append(ArrayChange(*key, "added" if before is None else "removed", before, after))
            continue
        change = _change(before, after)
        if change is None:
            same += 1
        else:
            changes.append(ArrayChange(*key, change, before, after))
    return StepDiff(a, b, tuple(changes), same)
