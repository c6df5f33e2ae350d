"""A step's shards written through the local tier, and the one place a manifest is built.

Both writers of a new step use it: the background writer (:mod:`~tiered_ckpt.engine.writer`,
this process's ranks) and the one-shot save (:mod:`~tiered_ckpt.oneshot`, every rank). Each
shard lands with :meth:`WritingTier.write_shard <tiered_ckpt.tiers.abilities.WritingTier.write_shard>`,
so every write checks the tier's lock; the directory's fsync is left to the commit. A step
kept in memory only (for a partner's memory) is serialized to bytes instead
(:func:`serialize_shards`), with the same records: in buffers reused from save to save while
they fit the room the host memory budget leaves, else to unlinked files mapped back, whose
pages a reader lets go as it moves on (:mod:`~tiered_ckpt.io.pages`).
"""

from __future__ import annotations

import dataclasses
import mmap
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import BinaryIO, Literal, cast

import numpy as np

from tiered_ckpt.dist.replicas import written
from tiered_ckpt.engine.incremental import Baseline, Held, choose_references
from tiered_ckpt.format.content import DIGESTS_KEY, content_digest, digests_text
from tiered_ckpt.format.layout import shard_name
from tiered_ckpt.format.manifest import (
    METRICS_SCHEMA_VERSION,
    REFERENCES_SCHEMA_VERSION,
    SCHEMA_VERSION,
    Reference,
    ShardManifest,
    ShardRecord,
    records_array_digests,
    references_fit,
)
from tiered_ckpt.format.metrics import Metrics
from tiered_ckpt.format.shardfile import header_length, json_length_bound, write_shard
from tiered_ckpt.format.state import FlatState
from tiered_ckpt.io.hashing import PartDigest, ShardDigest
from tiered_ckpt.io.parallel import run_parallel
from tiered_ckpt.tiers.abilities import WritingTier
from tiered_ckpt.tiers.base import ShardSource

__all__ = ["Borrowed", "ShardBuffer", "build_manifest", "serialize_shards", "write_shards"]


def write_shards(
    tier: WritingTier,
    step: int,
    states: Sequence[FlatState],
    ranks: Sequence[int],
    *,
    world_size: int,
    numels: Sequence[int],
    max_workers: int | None = None,
    replicas: Mapping[int, Mapping[str, int]] | None = None,
    borrowed: Borrowed | None = None,
    baseline: Baseline | None = None,
) -> list[ShardRecord]:
    """Write the shards of ``ranks`` (``states[i]`` is rank ``ranks[i]``'s) into ``step`` of ``tier``
    (held locked), each with its structure document; return their records, in the order of ``ranks``.

    ``replicas[rank]`` is that rank's replicas: the replicated arrays its shard leaves out, each
    mapped to its writer, the rank whose shard stores it (:func:`~tiered_ckpt.dist.replicas.choose_writers`);
    its record lists them as ``replicas``. Temp files an earlier crash left in the step are removed first. Each shard is
    durable under its name once this returns; the names are, once the tier's commit is.
    ``borrowed``: the arrays that are the caller's own memory, and whom to tell when each
    shard is done with them. ``baseline``: the arrays of the previous step, which a shard
    references rather than writes where they did not change (:mod:`~tiered_ckpt.engine.incremental`);
    it is told what each shard wrote.
    """
    tier.new_step_dir(step)
    tier.clear_temp_files(step)

    def write(index: int) -> ShardRecord:
        rank = ranks[index]
        previous = baseline.previous(step, rank) if baseline is not None else None
        skipped = baseline.skipped(rank) if baseline is not None else frozenset()
        left = (replicas or {}).get(rank, {})
        shard = _Shard(step, states[index], rank, world_size, left, borrowed, previous, skipped)
        digest = tier.write_shard(step, shard.name, ShardSource(write=shard.write), sync_directory=False)
        record = shard.record(digest, numels)
        if baseline is not None:
            baseline.wrote(step, record, list(shard.state.arrays), shard.digests, shard.unchanged)
        return record

    return run_parallel(write, range(len(ranks)), max_workers)


class ShardBuffer:
    """A shard's bytes in memory, written in place into a buffer reused from save to save.

    A new ``io.BytesIO`` each save regrows while it is written and touches fresh pages; this
    buffer reaches a shard's size once and is then overwritten: the view :meth:`write_shard`
    returned holds its shard's bytes until the next call."""

    def __init__(self) -> None:
        self._data = np.empty(0, np.uint8)
        self._size = 0

    @property
    def capacity(self) -> int:
        """The bytes the buffer holds (what it grew to)."""
        return self._data.size

    def reserve(self, size: int) -> None:
        """Hold at least ``size`` bytes, allocated at once (not regrown while a shard is
        written, which holds the old array and the new one together)."""
        if self._data.size < size:
            self._data = np.empty(0, np.uint8)  # freed before the new one is allocated
            self._data = np.empty(size, np.uint8)

    def release(self) -> None:
        """Free the buffer's memory (a view of it still held keeps it until dropped)."""
        self._data, self._size = np.empty(0, np.uint8), 0

    def write(self, chunk: memoryview | bytes) -> int:
        view = np.frombuffer(chunk, np.uint8)
        end = self._size + view.size
        if end > self._data.size:  # the old array stays whole while a view of it is held
            grown = np.empty(max(end, 2 * self._data.size), np.uint8)
            grown[: self._size] = self._data[: self._size]
            self._data = grown
        self._data[self._size : end] = view
        self._size = end
        return view.size

    def write_shard(self, shard: _Shard) -> tuple[ShardDigest, memoryview]:
        """Write ``shard`` from the buffer's start; its digest and a view of its bytes."""
        self._size = 0
        digest = shard.write(cast(BinaryIO, self))
        return digest, self._data[: self._size].data


def serialize_shards(
    step: int,
    states: Sequence[FlatState],
    ranks: Sequence[int],
    *,
    world_size: int,
    numels: Sequence[int],
    max_workers: int | None = None,
    replicas: Mapping[int, Mapping[str, int]] | None = None,
    buffers: Mapping[int, ShardBuffer] | None = None,
    borrowed: Borrowed | None = None,
    room: int | None = None,
    spill_dir: Path | None = None,
    on_spill: Callable[[int, int], None] | None = None,
) -> list[tuple[ShardRecord, memoryview]]:
    """The shards :func:`write_shards` would write, as bytes with their records (a step kept in
    memory only), in the order of ``ranks``.

    A shard is serialized in ``buffers[rank]`` if given (what the last call returned for that
    rank is overwritten), else in a buffer of its own, as long as the buffers of this call
    hold at most ``room`` bytes (None: no bound), in the order of ``ranks``. Any other goes to
    an unlinked file in ``spill_dir`` (default: the system's temporary directory), and its
    bytes are a whole private map of that file: the page cache holds them, not this process,
    and a reader that lets each part's pages go once read (:func:`~tiered_ckpt.io.pages.let_go`)
    keeps them out of it; the file goes once the last view of the map is dropped. Its
    ``buffers[rank]`` is freed, and ``on_spill(rank, size_bytes)`` told.
    """
    shards = [
        _Shard(step, states[index], rank, world_size, (replicas or {}).get(rank, {}), borrowed)
        for index, rank in enumerate(ranks)
    ]
    owned = {rank: buffers[rank] if buffers is not None else ShardBuffer() for rank in ranks}
    spilled: set[int] = set()
    if room is not None:
        used = 0
        for shard in shards:
            held = max(owned[shard.rank].capacity, shard.size_bytes)
            if used + held <= room:
                used += held
            else:
                spilled.add(shard.rank)
                owned[shard.rank].release()

    def serialize(index: int) -> tuple[ShardRecord, memoryview]:
        shard = shards[index]
        if shard.rank in spilled:
            digest, data = _spill(shard, spill_dir)
            if on_spill is not None:
                on_spill(shard.rank, digest.size_bytes)
        else:
            owned[shard.rank].reserve(shard.size_bytes if room is not None else 0)
            digest, data = owned[shard.rank].write_shard(shard)
        return shard.record(digest, numels), data

    return run_parallel(serialize, range(len(ranks)), max_workers)


def _spill(shard: _Shard, directory: Path | None) -> tuple[ShardDigest, memoryview]:
    """Write ``shard`` to an unlinked file in ``directory``; its digest and a whole private map of
    the file (writable, as a send over torch wants; never written)."""
    with tempfile.TemporaryFile(dir=directory) as file:
        digest = shard.write(cast(BinaryIO, file))
        file.flush()
        mapped = mmap.mmap(file.fileno(), digest.size_bytes, access=mmap.ACCESS_COPY)
    return digest, memoryview(mapped)


class Borrowed:
    """The arrays of a save that are the caller's own memory (``direct``, by rank: not staged,
    or only their last bytes, in ``tails``: :class:`~tiered_ckpt.engine.staging.Staged`), and
    the save call waiting until every shard of this process is done with them (:meth:`wait`).

    A shard tells :meth:`done` once it read the last of them (or holds none); :meth:`release`
    ends the wait whatever happened (the write failed, or never started)."""

    def __init__(
        self, direct: Mapping[int, frozenset[str]], tails: Mapping[int, Mapping[str, np.ndarray]] | None = None
    ) -> None:
        self.direct = dict(direct)
        self.tails = dict(tails or {})
        self._left = set(direct)
        self._lock = threading.Lock()
        self._released = threading.Event()

    def done(self, rank: int) -> None:
        """Rank ``rank``'s shard reads none of the caller's arrays any more."""
        with self._lock:
            self._left.discard(rank)
            if not self._left:
                self._released.set()

    def release(self) -> None:
        """No shard reads the caller's arrays any more (the writer is done, or failed)."""
        self._released.set()

    def wait(self) -> None:
        """Block until every shard is done with the caller's arrays."""
        self._released.wait()


class _Shard:
    """One rank's shard of a step: its name, its bytes (written to a stream) and its record."""

    def __init__(
        self,
        step: int,
        state: FlatState,
        rank: int,
        world_size: int,
        replicas: Mapping[str, int],
        borrowed: Borrowed | None = None,
        previous: Mapping[str, Held] | None = None,
        skipped: frozenset[str] = frozenset(),
    ) -> None:
        self.rank = rank
        self.borrowed = borrowed
        self.name = shard_name(rank, world_size)
        self.replicas = replicas
        self.state = written(state, replicas)
        # A state of DTensors, or with replicated arrays: each array recorded as a chunk, readable alone.
        self.chunked = bool(state.structure.chunks or state.replicated)
        self.array_digests = not self.chunked and records_array_digests(len(self.state.arrays), world_size)
        self.digests: dict[str, str] = {}  # of every array, "" for one not hashed (engine/incremental.py)
        self.unchanged: dict[str, bool] = {}  # of the arrays compared with the previous step's
        self.references: tuple[Reference, ...] = ()
        self._referenced: dict[str, PartDigest] = {}  # a shard of DTensors: its referenced chunks' digests
        self._stored = self.state  # every array the shard records: its own and those it references
        arrays = self.state.arrays
        if previous is not None and self.chunked:  # a chunk is referenced only where its digests are known
            previous = {name: held for name, held in previous.items() if held.chunk is not None}
        if previous is not None and (self.array_digests or self.chunked) and _references_fit(arrays, world_size):
            tails = borrowed.tails.get(rank, {}) if borrowed is not None else {}
            hashed = [name for name in arrays if name not in tails and name not in skipped]
            groups = [hashed[i::_HASHERS] for i in range(_HASHERS)]  # a thread per group, not per array
            found = run_parallel(lambda group: {name: content_digest(arrays[name]) for name in group}, groups, _HASHERS)
            self.digests = dict.fromkeys(arrays, "")
            for part in found:
                self.digests.update(part)
            self.unchanged = {
                name: previous[name].digest == digest
                for name, digest in self.digests.items()
                if digest and name in previous
            }
            sizes = {name: array.nbytes for name, array in arrays.items()}
            self.references = choose_references(previous, self.digests, sizes)
            if self.references:
                left = {name for ref in self.references for name in ref.names}
                own = {name: array for name, array in arrays.items() if name not in left}
                self.state = dataclasses.replace(self.state, arrays=own)
                for name in left if self.chunked else ():
                    chunk = previous[name].chunk
                    assert chunk is not None  # filtered above
                    self._referenced[name] = PartDigest(arrays[name].nbytes, chunk.sha256, chunk.xxh3_64)
        self.metadata = {
            "tiered_ckpt.rank": str(rank),
            "tiered_ckpt.world_size": str(world_size),
            "tiered_ckpt.step": str(step),
            **self.state.metadata(),
            **({DIGESTS_KEY: digests_text(self.digests)} if self.digests else {}),
        }

    @cached_property
    def size_bytes(self) -> int:
        """The bytes :meth:`write` writes: the length prefix, the padded header and the arrays."""
        arrays = self.state.arrays
        return 8 + header_length(arrays, self.metadata) + sum(array.nbytes for array in arrays.values())

    def write(self, out: BinaryIO) -> ShardDigest:
        parts: Literal["both", "xxh3"] | None = "both" if self.chunked else "xxh3" if self.array_digests else None
        borrowed = self.borrowed
        waiting = set(borrowed.direct.get(self.rank, ())).intersection(self.state.arrays) if borrowed else set()
        if borrowed is None or not waiting:
            if borrowed is not None:
                borrowed.done(self.rank)
            return write_shard(out, self.state.arrays, self.metadata, part_digests=parts)

        def done_with(name: str) -> None:
            waiting.discard(name)
            if not waiting:
                borrowed.done(self.rank)

        tails = {name: tail for name, tail in borrowed.tails.get(self.rank, {}).items() if name in self.state.arrays}
        return write_shard(out, self.state.arrays, self.metadata, part_digests=parts, done_with=done_with, tails=tails)

    def record(self, digest: ShardDigest, numels: Sequence[int]) -> ShardRecord:
        return ShardRecord(
            rank=self.rank,
            path=self.name,
            sha256=digest.sha256,
            xxh3_64=digest.xxh3_64,
            size_bytes=digest.size_bytes,
            param_shard_offset=sum(numels[: self.rank]),
            param_shard_numel=numels[self.rank],
            chunks=self._stored.chunk_records({**digest.arrays, **self._referenced}) if self.chunked else (),
            header_bytes=digest.header_bytes,
            header_sha256=digest.header_sha256,
            replicas=tuple(sorted(self.replicas.items())),
            array_xxh3_64="".join(digest.arrays[name].xxh3_64 for name in sorted(digest.arrays))
            if self.array_digests
            else "",
            references=self.references,
        )


_HASHERS = 2  # content digests of a shard's arrays hashed at once: XXH3 lets the GIL go


def _references_fit(arrays: Mapping[str, np.ndarray], world_size: int) -> bool:
    return references_fit(sum(json_length_bound(name) for name in arrays), len(arrays), world_size)


def build_manifest(
    step: int,
    records: Sequence[ShardRecord],
    *,
    world_size: int,
    sharded_keys: tuple[str, ...],
    wall_clock_seconds: float,
    metrics: Metrics = (),
    source: str = "manifest",
) -> ShardManifest:
    """The manifest of ``step`` from every rank's shard record and the step's ``metrics``,
    validated as any manifest is (``source`` names where the records came from in its errors,
    e.g. the ranks' exchange). It is written in the oldest schema version that holds it."""
    version = SCHEMA_VERSION
    if any(r.references for r in records):
        version = REFERENCES_SCHEMA_VERSION
    if metrics:
        version = METRICS_SCHEMA_VERSION
    return ShardManifest(
        world_size=world_size,
        step=step,
        wall_clock_seconds=wall_clock_seconds,
        sharded_keys=sharded_keys,
        shards=tuple(records),
        schema_version=version,
        metrics=metrics,
        source=source,
    )
