"""Reading parts of one shard through a reader of its byte ranges, without reading it whole.

:func:`verified_header` reads a shard's header and checks it against the sha256 its manifest
record holds; :func:`shard_index` parses it once (structure document, each plain array's
xxh3-64); :func:`read_verified_parts` reads some of the shard's arrays straight into their
memory, each verified against the digest the record holds for it. The reader is a tier's
(:meth:`~tiered_ckpt.tiers.base.Tier.read_range_into`) or the local file's: which tier is
tried, and in what order, is the store's business (:meth:`~tiered_ckpt.tiers.store.TieredStore.read_parts`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace

import numpy as np

from tiered_ckpt.errors import ChecksumMismatchError, ManifestError, ShardFormatError, UsageError
from tiered_ckpt.format.manifest import ShardRecord
from tiered_ckpt.format.shardfile import ShardHeader, read_header
from tiered_ckpt.format.state import FlatState
from tiered_ckpt.format.structure import Structure, structure_of
from tiered_ckpt.io.fresh_memory import new_array
from tiered_ckpt.io.hashing import Verify

__all__ = ["ShardIndex", "read_verified_arrays", "read_verified_parts", "shard_index", "verified_header"]


def verified_header(read_into: Callable[[int, memoryview, Verify], str], record: ShardRecord, what: str) -> ShardHeader:
    """A shard's header through ``read_into(offset, buffer)``, checked against the sha256 its record holds."""
    if not record.header_bytes:
        raise ShardFormatError(f"{what}: the manifest records no digest of its header: it can only be read whole")
    raw = bytearray(record.header_bytes)
    if read_into(0, memoryview(raw), "full") != record.header_sha256:
        raise ChecksumMismatchError(f"{what}: its header's sha256 is not the one the manifest records")
    return read_header(bytes(raw), record.size_bytes, what)


@dataclass(frozen=True)
class ShardIndex:
    """A shard's verified header, parsed once for the reads of its parts
    (:meth:`~tiered_ckpt.tiers.store.TieredStore.read_parts`): where each array lies, the
    structure document, and the xxh3-64 its record holds for each plain array ({} if none).
    ``references``: the verified header of each earlier file its record references, in the
    record's order (:attr:`~tiered_ckpt.format.manifest.ShardRecord.references`)."""

    header: ShardHeader
    structure: Structure
    digests: Mapping[str, str]
    references: tuple[ShardHeader, ...] = ()

    def whole_header(self, record: ShardRecord) -> ShardHeader:
        """The header as if the shard's file held every array of its state: its own arrays, and
        each one it references as the referenced file's header describes it (dtype and shape;
        its place is in that file)."""
        if not self.references:
            return self.header
        arrays = dict(self.header.arrays)
        for ref, header in zip(record.references, self.references, strict=True):
            arrays.update((name, header.arrays[name]) for name in ref.names)
        return replace(self.header, arrays=arrays)


def shard_index(header: ShardHeader, record: ShardRecord, what: str) -> ShardIndex:
    """``header`` (verified, of ``record``'s shard) parsed; :class:`ShardFormatError` naming ``what``."""
    record.check_holds(header.arrays, what)
    structure = structure_of(header.metadata, header.arrays, what, record.elsewhere)
    try:
        digests = record.array_digests(header.arrays)
    except ManifestError as exc:
        raise ShardFormatError(f"{what}: {exc}") from None
    return ShardIndex(header, structure, digests)


def read_verified_parts(
    read_into: Callable[[int, memoryview, Verify], str],
    record: ShardRecord,
    names: Collection[str] | Callable[[Structure], Structure],
    what: str,
    into: Mapping[str, np.ndarray],
    verify: Verify,
    index: ShardIndex | None = None,
) -> FlatState:
    """Read, verify and parse a shard's header (unless ``index`` is it), then each of ``names``' arrays,
    through ``read_into(offset, buffer)``: each copied straight into its memory (``into``'s, else
    new) and hashed piece by piece while each piece is in cache, with no copy through Python bytes."""
    if index is None:
        index = shard_index(verified_header(read_into, record, what), record, what)
    structure = index.structure
    if callable(names):
        structure = names(structure)
        names = [name for name in structure.kinds if name in index.header.arrays]
    arrays = read_verified_arrays(read_into, record, names, what, into, verify, index.header, index.digests)
    return FlatState(arrays, structure)


def read_verified_arrays(
    read_into: Callable[[int, memoryview, Verify], str],
    record: ShardRecord,
    names: Collection[str],
    what: str,
    into: Mapping[str, np.ndarray],
    verify: Verify,
    header: ShardHeader,
    plain: Mapping[str, str],
) -> dict[str, np.ndarray]:
    """``names``' arrays of a shard whose verified ``header`` is given, read as
    :func:`read_verified_parts` reads them: each verified against its chunk record's digest, or
    its xxh3-64 in ``plain``."""
    recorded = {chunk.name: chunk for chunk in record.chunks}
    if names and not recorded and not plain:
        raise ShardFormatError(f"{what}: the manifest records no digest of its arrays: it can only be read whole")
    arrays = {}
    for name in names:
        entry, chunk = header.arrays.get(name), recorded.get(name)
        if entry is None or (chunk is None and name not in plain) or (chunk and entry.shape != chunk.sizes):
            raise ShardFormatError(f"{what}: the array {name!r} is not in the shard as the manifest records it")
        array = into[name] if name in into else new_array(entry.shape, entry.dtype)
        if array.shape != entry.shape or array.dtype != entry.dtype or not array.flags.c_contiguous:
            raise UsageError(f"{what}: into[{name!r}] is not a C-contiguous {entry.dtype} array of {entry.shape}")
        # A plain shard records only each array's xxh3-64: its sha256 covers the whole file.
        fast = chunk is None or (verify == "fast" and bool(chunk.xxh3_64))
        expected = plain[name] if chunk is None else chunk.xxh3_64 if fast else chunk.sha256
        if read_into(entry.begin, array.reshape(-1).view(np.uint8).data, "fast" if fast else "full") != expected:
            kind = "xxh3-64" if fast else "sha256"
            raise ChecksumMismatchError(f"{what}: the bytes of {name!r} do not match the {kind} the manifest records")
        arrays[name] = array
    return arrays
