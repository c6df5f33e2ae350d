"""Incremental saves: an array unchanged since the previous step is referenced, not written again.

Each rank's shard of a new step is compared, array by array, with the same rank's arrays of
the newest step this disk committed before it (its *baseline*), by content digest
(:mod:`~tiered_ckpt.format.content`: XXH3-128 of dtype, shape and bytes, computed from the
staged arrays before the shard is laid out). An array whose digest equals the baseline's,
of at least :data:`SMALLEST_REFERENCED` bytes, is left out of the new shard file and recorded
as a :class:`~tiered_ckpt.format.manifest.Reference` to the earlier file holding its bytes:
the file the baseline wrote it to, or the one the baseline itself referenced (a reference
always names the file the bytes are in, never a chain). At most
:data:`~tiered_ckpt.format.manifest.MAX_REFERENCED_FILES` files are referenced per shard,
those holding the most of its bytes first, and only while the bytes those files hold that the
shard does not use (which a reference keeps on the disk with them) add up to at most the
shard's own state: the other unchanged arrays are written again, so that the files a
retained step keeps take at most twice its state.

Only where every tier of the store keeps referenced files (``capabilities.references``), for
shards of plain arrays (a state of DTensors and replicated arrays are written whole), and
where the references fit the manifest (:func:`~tiered_ckpt.format.manifest.references_fit`).
The baseline of the last step a writer committed is kept in memory; the first save after a
restart reads it from the step's shard headers, and a baseline that cannot be read (or a
referenced file no longer the size recorded) is none: the save writes every array, never fails.
An array that changed at each of the last two comparisons is not hashed but at two saves of
every :data:`PROBE_EVERY` (a pretraining state, which changes whole, pays the digests at
those only).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from tiered_ckpt.errors import CheckpointError
from tiered_ckpt.format.content import parse_digests
from tiered_ckpt.format.manifest import MAX_REFERENCED_FILES, ChunkRecord, Reference, ShardRecord
from tiered_ckpt.tiers.store import TieredStore

__all__ = ["Baseline", "Held", "PROBE_EVERY", "SMALLEST_REFERENCED", "choose_references", "held_arrays"]

logger = logging.getLogger("tiered_ckpt")

SMALLEST_REFERENCED = 4096
"""Smaller arrays are written again: a reference costs a ranged read, rewriting them nothing."""

PROBE_EVERY = 8
"""An array found changed at each of the last two comparisons is not hashed (it is written, as it
would be) but at two saves in every ``PROBE_EVERY``, which tell whether it still changes: a state
that changes whole every step pays the digests at a quarter of its saves."""


@dataclass(frozen=True)
class Held:
    """Where one array of a baseline is: its content ``digest``, the ``file`` (its record, without
    per-array digests) of ``step`` that holds its bytes, and its ``xxh3_64`` there; ``chunk``: the
    record of it as a chunk, for a shard of DTensors (None: a plain shard's)."""

    digest: str
    step: int
    file: ShardRecord
    xxh3_64: str
    chunk: ChunkRecord | None = None


def held_arrays(step: int, record: ShardRecord, names: Sequence[str], digests: Mapping[str, str]) -> dict[str, Held]:
    """By name, where each array of ``record``'s shard of ``step`` is: its own ``names`` (the
    arrays its file holds) in that file, the arrays it references where they are; only those
    with a content digest in ``digests``."""
    own = file_record(record)
    chunks = {chunk.name: chunk for chunk in record.chunks if chunk.xxh3_64}
    if record.chunks:
        xxh3 = {name: chunks[name].xxh3_64 for name in names if name in chunks}
    else:
        xxh3 = record.array_digests(names)
    held = {
        name: Held(digests[name], step, own, xxh3[name], chunks.get(name))
        for name in names
        if digests.get(name) and name in xxh3
    }
    for ref in record.references:
        for name, digest64 in ref.digests().items():
            if digests.get(name) and (name in chunks or not record.chunks):
                held[name] = Held(digests[name], ref.step, ref.file, digest64, chunks.get(name))
    return held


def file_record(record: ShardRecord) -> ShardRecord:
    """``record`` as a reference names its file: without per-array digests, references or replicas."""
    return replace(record, array_xxh3_64="", references=(), replicas=(), chunks=())


def choose_references(
    previous: Mapping[str, Held], digests: Mapping[str, str], sizes: Mapping[str, int]
) -> tuple[Reference, ...]:
    """The references of a shard whose arrays have content ``digests`` and byte ``sizes``,
    against ``previous`` (see the module doc), each file's names sorted, files by step."""
    by_file: dict[tuple[int, str], list[tuple[str, Held]]] = {}
    for name, digest in digests.items():
        held = previous.get(name)
        if held is not None and digest and held.digest == digest and sizes[name] >= SMALLEST_REFERENCED:
            by_file.setdefault((held.step, held.file.path), []).append((name, held))
    largest = sorted(by_file.values(), key=lambda group: -sum(sizes[name] for name, _ in group))
    references: list[Reference] = []
    pinned, bound = 0, sum(sizes.values())
    for group in largest:
        taken = sum(sizes[name] for name, _ in group)
        unused = group[0][1].file.size_bytes - taken  # what the file holds that this shard does not use
        if len(references) == MAX_REFERENCED_FILES or pinned + unused > bound:
            continue
        pinned += unused
        group.sort(key=lambda pair: pair[0])
        first = group[0][1]
        names = tuple(name for name, _ in group)
        digests64 = "".join(held.xxh3_64 for _, held in group)
        references.append(Reference(first.step, first.file, names, digests64, sum(sizes[name] for name in names)))
    return tuple(sorted(references, key=lambda ref: ref.step))


class Baseline:
    """The arrays of the last step a writer committed, by rank, for the next save to compare with."""

    def __init__(self, store: TieredStore) -> None:
        self._store = store
        self._kept: tuple[int, dict[int, dict[str, Held]]] | None = None
        self._pending: dict[int, dict[int, dict[str, Held]]] = {}
        self._streaks: dict[int, dict[str, int]] = {}  # by rank and name: comparisons in a row it changed at
        self._pending_streaks: dict[int, dict[int, dict[str, int]]] = {}
        self._saves = 0

    def skipped(self, rank: int) -> frozenset[str]:
        """The arrays of rank ``rank`` the next save does not hash: those that changed at each of
        the last two comparisons, except at the saves that probe them (see :data:`PROBE_EVERY`)."""
        if self._saves % PROBE_EVERY < 2:
            return frozenset()
        return frozenset(name for name, changes in self._streaks.get(rank, {}).items() if changes >= 2)

    def previous(self, step: int, rank: int) -> Mapping[str, Held]:
        """Rank ``rank``'s arrays of the newest step committed on this disk before ``step``, each
        whose file is still there as recorded ({} if none can be read: every array is written)."""
        local = self._store.local
        earlier = None
        try:
            earlier = max((each for each in local.steps() if each < step), default=None)
            if earlier is None:
                return {}
            if self._kept is not None and self._kept[0] == earlier:
                arrays = self._kept[1].get(rank)
            else:
                arrays = self._read(earlier, rank)
            if not arrays:
                return {}
            present = {
                key: _present(local.shard_path(key[0], held.file), held.file.size_bytes)
                for key, held in {(h.step, h.file.path): h for h in arrays.values()}.items()
            }
            return {name: held for name, held in arrays.items() if present[(held.step, held.file.path)]}
        except (CheckpointError, OSError) as exc:
            logger.info(
                "step %d rank %d: every array is written (step %s cannot be compared: %s)", step, rank, earlier, exc
            )
            return {}

    def _read(self, step: int, rank: int) -> dict[str, Held] | None:
        """Rank ``rank``'s arrays of committed ``step``, from its verified shard header."""
        local = self._store.local
        manifest = local.manifest(step)
        if rank >= manifest.world_size or rank not in local.held_ranks(step, manifest):
            return None
        record = manifest.shard(rank)
        if not (record.chunks or record.array_xxh3_64):  # no digest of each array to verify a reader by
            return None
        header, _tier = self._store.read_shard_header(step, record, later=())
        own = [name for name in header.arrays if name not in record.elsewhere]
        digests = parse_digests(header.metadata, header.arrays, f"rank {rank} shard {local.shard_path(step, record)}")
        return held_arrays(step, record, own, digests)

    def wrote(
        self,
        step: int,
        record: ShardRecord,
        names: Sequence[str],
        digests: Mapping[str, str],
        unchanged: Mapping[str, bool],
    ) -> None:
        """Rank ``record.rank``'s shard of ``step`` was written, holding ``names`` (digests of every
        array of its state: ``digests``, "" for one not hashed; ``unchanged``: of the arrays
        compared with the baseline, whether each was the same); it becomes the baseline once
        :meth:`committed`."""
        rank = record.rank
        self._pending.setdefault(step, {})[rank] = held_arrays(step, record, names, digests)
        before = self._streaks.get(rank, {})
        streaks = {name: before.get(name, 0) for name in digests}
        for name, same in unchanged.items():
            streaks[name] = 0 if same else streaks[name] + 1
        self._pending_streaks.setdefault(step, {})[rank] = streaks

    def committed(self, step: int) -> None:
        """``step`` is committed on this disk: the next save compares with it."""
        self._kept = (step, self._pending.pop(step, {}))
        self._streaks.update(self._pending_streaks.pop(step, {}))
        self._saves += 1
        self._pending = {each: ranks for each, ranks in self._pending.items() if each > step}
        self._pending_streaks = {each: ranks for each, ranks in self._pending_streaks.items() if each > step}

    def failed(self, step: int) -> None:
        """``step`` was not committed: nothing it wrote is compared with."""
        self._pending.pop(step, None)
        self._pending_streaks.pop(step, None)


def _present(path: os.PathLike[str], size: int) -> bool:
    try:
        return os.stat(path).st_size == size
    except OSError:
        return False
