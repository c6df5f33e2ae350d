"""The one executor of a restore's plan (:mod:`~tiered_ckpt.engine.restore_plan`): every
planned read run through the store's chain, whatever the request that planned it.

:meth:`ReadExecutor.run`, step by step:

1. a partial restore's reads (``paths``) look at their shards first: each shard's header,
   verified and parsed (:meth:`TieredStore.read_shard_index`), its structure cut to the
   paths; a shard whose record has no per-array digests (saved before they were recorded)
   is read whole there, verified by its sha256, and cut. The caller's arrays are checked
   against every shard's selection before any is filled (:class:`InvalidStateError` naming
   ``into[index]`` and the arrays that differ);
2. every read runs, ``max_workers`` at a time: a whole shard through
   :meth:`TieredStore.fetch_shard` (this node's disk, else each of the read's later tiers,
   verified by the shard's sha256, straight into the caller's arrays when given), its header
   and some arrays through :meth:`TieredStore.read_parts` (each array verified);
3. a whole shard read from a later tier refills this node's step (created for it, and
   removed again if the reads fail before it was committed): a copy read from memory is
   returned to land after the restore (:class:`~tiered_ckpt.engine.refill.Refill`), else the
   refill is recorded at once.

What was read comes back as a value (:class:`Executed`); nothing is kept here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from tiered_ckpt.engine.refill import Refill
from tiered_ckpt.engine.restore_plan import Selection, ShardRead
from tiered_ckpt.errors import InvalidStateError
from tiered_ckpt.format.differences import into_difference
from tiered_ckpt.format.manifest import ShardManifest, ShardRecord
from tiered_ckpt.format.remote_manifest import RemoteManifest
from tiered_ckpt.format.selection import prefixes, select
from tiered_ckpt.format.state import FlatState
from tiered_ckpt.format.structure import Structure
from tiered_ckpt.io.hashing import Verify
from tiered_ckpt.io.parallel import run_parallel
from tiered_ckpt.tiers.shard_parts import ShardIndex
from tiered_ckpt.tiers.store import FetchedShard, TieredStore, TierName

__all__ = ["Executed", "ReadExecutor"]


@dataclass(frozen=True)
class Executed:
    """What a plan's reads gave: by saved rank, the verified ``states`` (whole shards, or the
    parts read) and the tier each came from (``sources``); the bytes read; the ``refills``
    left to land after the restore; and, for a partial restore, by saved rank, the names its
    paths start (``starts``, :func:`~tiered_ckpt.format.selection.prefixes`)."""

    states: Mapping[int, FlatState]
    sources: Mapping[int, TierName]
    bytes_read: int
    refills: tuple[Refill, ...] = ()
    starts: Mapping[int, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class _Looked:
    """A partial restore's look at one shard before anything is filled: the selection's structure,
    the dtype and shape of each of its arrays the shard holds, and the shard's verified header,
    parsed (not read again for its parts), or, for a shard read whole, its cut state and tier."""

    structure: Structure
    kinds: Mapping[str, tuple[np.dtype, tuple[int, ...]]]
    index: ShardIndex | None = None
    whole: FetchedShard | None = None


def _part_bytes(record: ShardRecord, state: FlatState) -> int:
    """The bytes a partial read of ``record``'s shard took: its header, the headers of the files it
    references, and the arrays in ``state``."""
    headers = record.header_bytes + sum(ref.file.header_bytes for ref in record.references)
    return headers + sum(array.nbytes for array in state.arrays.values())


def _whole_bytes(record: ShardRecord, state: FlatState) -> int:
    """The bytes a whole read of ``record``'s shard took: its file, and the headers and arrays it
    references in earlier files."""
    referenced = record.referenced
    extra = sum(ref.file.header_bytes for ref in record.references)
    return record.size_bytes + extra + sum(a.nbytes for name, a in state.arrays.items() if name in referenced)


def _check_selected_into(index: int | None, looked: _Looked, target: Mapping[str, np.ndarray]) -> None:
    """Raise :class:`InvalidStateError` naming ``into[index]`` and its arrays unless ``target``
    holds exactly the selection ``looked`` at, each writable and C-contiguous where read into."""
    expected = {**dict.fromkeys(looked.structure.kinds), **looked.kinds}
    problem = into_difference(expected, target, "the selected paths")
    if problem:
        raise InvalidStateError(f"into[{index}] does not hold the arrays of the selected paths: {problem}")
    for name in looked.kinds:
        array = target[name]
        if not (array.flags.c_contiguous and array.flags.writeable):
            raise InvalidStateError(f"into[{index}][{name!r}] must be writable and C-contiguous")


class ReadExecutor:
    """Runs plans' reads (see the module doc) through ``store``, ``max_workers`` at a time."""

    def __init__(self, store: TieredStore, max_workers: int | None = None) -> None:
        self._store = store
        self._max_workers = max_workers

    def run(
        self,
        manifest: ShardManifest,
        reads: Sequence[ShardRead],
        *,
        verify: Verify = "full",
        into: Mapping[int, Mapping[str, np.ndarray]] | None = None,
        paths: Selection | None = None,
        indexes: Mapping[int, ShardIndex] | None = None,
        remote: RemoteManifest | None = None,
        in_local: bool | None = None,
    ) -> Executed:
        """Run ``reads`` of ``manifest``'s step (see the module doc): each into ``into``'s arrays
        for its saved rank when given (for a whole read, every array of the shard; for a read of
        parts, those it names), a selected read cut to ``paths``. ``indexes``: by saved rank,
        headers already read and parsed (:meth:`TieredStore.read_shard_index`), not read again.
        ``remote``: the bucket's manifest of the step, recorded by a refill (None: a nearer
        tier's manifest was read); ``in_local``: whether this node's disk had committed the step
        before the reads (None: looked up here, if a whole read refills it). Raises the store's
        errors, naming the shard."""
        into = into or {}
        indexes = indexes or {}
        step = manifest.step
        starts: dict[int, tuple[str, ...]] = {}

        def cut_to(rank: int, structure: Structure) -> Structure:
            assert paths is not None  # only a selected read is cut
            what = f"rank {rank} shard {manifest.shard(rank).path}"
            starts[rank] = prefixes(structure, paths, what)
            return select(structure, paths, what)

        def look(read: ShardRead) -> _Looked:
            record = manifest.shard(read.rank)
            if read.whole:  # a record without per-array digests: read whole, then cut
                fetched = self._store.fetch_shard(step, record, verify=verify, later=read.tiers)
                structure = cut_to(record.rank, fetched.state.structure)
                arrays = {name: fetched.state.arrays[name] for name in structure.kinds if name in fetched.state.arrays}
                kinds = {name: (array.dtype, array.shape) for name, array in arrays.items()}
                cut = FetchedShard(FlatState(arrays, structure), fetched.source, fetched.copy)
                return _Looked(structure, kinds, whole=cut)
            parsed, _source = self._store.read_shard_index(step, record, later=read.tiers)
            structure = cut_to(record.rank, parsed.structure)
            entries = parsed.whole_header(record).arrays
            kinds = {n: (e.dtype, e.shape) for n, e in entries.items() if n in structure.kinds}
            return _Looked(structure, kinds, index=parsed)

        def one(read: ShardRead, looked: _Looked | None) -> FetchedShard:
            record, target = manifest.shard(read.rank), into.get(read.rank)
            if looked is not None and looked.whole is not None:
                return _filled(looked.whole, target)
            if read.whole:
                return self._store.fetch_shard(step, record, verify=verify, into=target, later=read.tiers)
            if read.selected:
                names = partial(cut_to, read.rank)
                index = looked.index if looked is not None else None
            else:
                assert read.names is not None
                names, index = read.names, indexes.get(read.rank)  # type: ignore[assignment]
            state, source = self._store.read_parts(
                step, record, names, later=read.tiers, into=target, verify=verify, index=index
            )
            return FetchedShard(state, source)

        whole = [read.rank for read in reads if read.whole]
        with self._step_dir(step) if whole else nullcontext(False) as created:
            was_committed = in_local
            if whole and was_committed is None:  # only a refill records it
                was_committed = step in self._store.local.steps()
            looks = self._looks(reads, look, into) if paths is not None else [None] * len(reads)
            fetched = run_parallel(lambda pair: one(*pair), list(zip(reads, looks, strict=True)), self._max_workers)
            wholes = [each for read, each in zip(reads, fetched, strict=True) if read.whole]
            refills = self._refills(manifest, remote, whole, bool(was_committed), created, wholes) if whole else ()
        states = {read.rank: got.state for read, got in zip(reads, fetched, strict=True)}
        bytes_read = sum(
            _whole_bytes(manifest.shard(read.rank), got.state)
            if read.whole
            else _part_bytes(manifest.shard(read.rank), got.state)
            for read, got in zip(reads, fetched, strict=True)
        )
        sources = {read.rank: got.source for read, got in zip(reads, fetched, strict=True)}
        return Executed(states, sources, bytes_read, refills, starts)

    def _looks(
        self,
        reads: Sequence[ShardRead],
        look: Callable[[ShardRead], _Looked],
        into: Mapping[int, Mapping[str, np.ndarray]],
    ) -> list[_Looked | None]:
        """Step 1 for a partial restore: the looks of the reads into the caller's arrays and of
        the shards read whole, by index of ``reads``, every caller's array checked against its
        look before any is filled."""
        firsts = [index for index, read in enumerate(reads) if read.rank in into or read.whole]
        looks: list[_Looked | None] = [None] * len(reads)
        looked_at = run_parallel(lambda index: look(reads[index]), firsts, self._max_workers)
        for index, looked in zip(firsts, looked_at, strict=True):
            looks[index] = looked
        for index, seen in zip(firsts, looked_at, strict=True):
            if reads[index].rank in into:
                _check_selected_into(reads[index].into, seen, into[reads[index].rank])
        return looks

    @contextmanager
    def _step_dir(self, step: int) -> Iterator[bool]:
        """The local directory of ``step`` while shards are read into it: created if needed (True
        is yielded), and removed again if this restore created it and fails before committing it."""
        created = not self._store.local.step_dir(step).is_dir()
        self._store.local.new_step_dir(step)
        try:
            yield created
        except BaseException:
            if created:
                self._store.local.discard_uncommitted(step)
            raise

    def _refills(
        self,
        manifest: ShardManifest,
        remote: RemoteManifest | None,
        ranks: Sequence[int],
        was_committed: bool,
        created: bool,
        fetched: Sequence[FetchedShard],
    ) -> tuple[Refill, ...]:
        """After ``ranks``' shards were ``fetched`` into the local step: the refill the copies read
        from memory leave to land after the restore returns, or, with none, the refill recorded now."""
        copies = tuple(each.copy for each in fetched if each.copy is not None)
        if copies:
            return (Refill(manifest, remote, tuple(ranks), was_committed, created, copies),)
        self._store.record_refill(manifest, remote, ranks, was_committed=was_committed)
        return ()


def _filled(fetched: FetchedShard, into: Mapping[str, np.ndarray] | None) -> FetchedShard:
    """A shard read whole and cut, its arrays copied into ``into``'s where it has them (checked
    to match before: :func:`_check_selected_into`)."""
    if not into:
        return fetched
    arrays = dict(fetched.state.arrays)
    for name, array in arrays.items():
        if name in into:
            np.copyto(into[name], array)
            arrays[name] = into[name]
    return FetchedShard(FlatState(arrays, fetched.state.structure), fetched.source, fetched.copy)
