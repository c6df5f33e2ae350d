"""The one place where tiers meet.

A :class:`TieredStore` composes an ordered list of tiers: first this node's disk (a
:class:`~tiered_ckpt.tiers.local.LocalTier`, where steps are written and every read
lands), then any number of later tiers, nearest first (a partner's memory, a bucket);
no tier knows another. Reading a shard is a chain, in the tiers' order:

1. the first tier's copy, if its size and sha256 (or xxh3-64) match the manifest;
2. else each later tier in turn, tried twice: its copy is hashed while it streams into
   a temp file in the first tier's step, renamed into place only if it matches (so the
   first tier is refilled), then read as in 1 (a part of a shard is read from the later
   tier itself where it serves ranged reads);
3. else an error naming the step, the rank and every copy tried.

The first copy that verifies wins. Every shard that moves between tiers goes through
the store: a replicator's put (:meth:`TieredStore.send_shard`), a refill
(:meth:`TieredStore.download_shard`), a read. The store also records what the later tiers
committed (receipts in the first tier) and holds each tier's retention (applied by
:mod:`~tiered_ckpt.tiers.pruning`); :mod:`~tiered_ckpt.tiers.survey` says what each tier
holds; :func:`~tiered_ckpt.maintenance.pull` fills the first tier from the bucket. Writing
needs the local directory's lock (``store.local.lock()``), which a manager holds for its
whole run and the CLI for one command.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import BinaryIO, NoReturn, TypeVar, cast

import numpy as np

from tiered_ckpt.errors import (
    CheckpointError,
    ChecksumMismatchError,
    IncompleteCheckpointError,
    ManifestError,
    RemoteError,
    ShardFormatError,
    UsageError,
)
from tiered_ckpt.format.manifest import Reference, ShardManifest, ShardRecord
from tiered_ckpt.format.remote_manifest import RemoteManifest
from tiered_ckpt.format.shardfile import ShardHeader, read_shard_buffer
from tiered_ckpt.format.state import FlatState, own_targets
from tiered_ckpt.format.structure import Structure
from tiered_ckpt.io.hashing import CHUNK_BYTES, Hasher, ShardDigest, Verify, copy_and_hash, hashing_writer
from tiered_ckpt.io.pages import blocks_of, whole_map
from tiered_ckpt.io.parallel import run_parallel
from tiered_ckpt.tiers.abilities import ReceiptedTier, receipts_of
from tiered_ckpt.tiers.base import Landed, PreparedReads, ShardSource, Tier
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.tiers.retention import RetentionPolicy
from tiered_ckpt.tiers.shard_parts import (
    ShardIndex,
    read_verified_arrays,
    read_verified_parts,
    shard_index,
    verified_header,
)
from tiered_ckpt.tiers.step_metrics import StepMetrics

__all__ = ["FetchedShard", "TieredStore", "TierName", "Landing"]

logger = logging.getLogger("tiered_ckpt")

TierName = str
"""The name of the tier a shard was read from (:attr:`~tiered_ckpt.tiers.base.Tier.name`)."""

Landing = tuple[ShardRecord, memoryview]
"""A shard's bytes in memory that matched its record, waiting to land on the local disk."""


@dataclass(frozen=True)
class FetchedShard:
    """A shard read through the store's chain (:meth:`TieredStore.fetch_shard`): its verified
    ``state``, the name of the tier it came from (``source``), and ``copy``: the verified bytes
    of a copy read from this process's memory, which the caller lands on the local disk
    (:meth:`TieredStore.land_copies`) when it chooses (None: the chain refilled the disk
    itself, or the first tier served it)."""

    state: FlatState
    source: TierName
    copy: Landing | None = None


T = TypeVar("T")
_READ_FAILURES = (IncompleteCheckpointError, ChecksumMismatchError, ShardFormatError)
_TRIES_OF_A_LATER_TIER = 2


class TieredStore:
    """Steps and shards across ``tiers``, nearest first; ``tiers[0]`` is this node's disk.

    ``retention`` maps a tier's name to its :class:`RetentionPolicy` (a tier not named
    keeps every step). The later tiers may be any number, durable or not, shared or not
    (a second disk, a partner's memory, a shared memory, a bucket); what differs between them
    is said by their capabilities. :attr:`remote` is the first later tier with receipts (the
    bucket), where the bucket is meant (None without one).
    """

    def __init__(self, tiers: Sequence[Tier], retention: Mapping[str, RetentionPolicy] | None = None) -> None:
        tiers = tuple(tiers)
        if not tiers or not isinstance(tiers[0], LocalTier):
            raise UsageError(f"a store's first tier is this node's disk (a LocalTier), got {tiers[:1]!r}")
        names = [tier.name for tier in tiers]
        if len(set(names)) != len(names):
            raise UsageError(f"a store's tiers need names of their own, got {names}")
        unknown = set(retention or {}) - set(names)
        if unknown:
            raise UsageError(f"retention names tiers the store does not have: {sorted(unknown)} (tiers: {names})")
        self.tiers: tuple[Tier, ...] = tiers
        self.local: LocalTier = tiers[0]
        self.retention: Mapping[str, RetentionPolicy] = dict(retention or {})
        self.remote: ReceiptedTier | None = next(
            (receipted for tier in tiers[1:] if (receipted := receipts_of(tier)) is not None), None
        )
        self.retention_lock = threading.Lock()  # retention passes of the local tier never interleave
        self._holds: dict[object, frozenset[int]] = {}  # by holder
        self._holds_lock = threading.Lock()
        self._held: frozenset[int] = frozenset()  # their union, replaced whole: a retention pass reads one set
        self.step_metrics = StepMetrics()  # what keep-best retention ranks steps by

    @property
    def held(self) -> frozenset[int]:
        """The steps something outside the store names (a framework's checkpoint pointers), which
        no tier's retention deletes while they are held (see :meth:`hold`)."""
        return self._held

    def hold(self, steps: Collection[int], holder: object = None) -> None:
        """``holder`` (e.g. one framework plugin of several on this store) holds exactly ``steps``
        from now on (those it held before and not given are released): every tier's retention
        keeps the steps any holder holds, beside what its policy keeps."""
        with self._holds_lock:
            self._holds[holder] = frozenset(steps)
            self._held = frozenset().union(*self._holds.values())

    def __repr__(self) -> str:
        return f"TieredStore([{', '.join(repr(tier) for tier in self.tiers)}])"

    def sendable(self, step: int, tier: Tier) -> bool:
        """Whether local ``step`` may go to ``tier``: unless its shards reference earlier steps'
        files (an incremental save made without ``tier``) and ``tier`` keeps no referenced files.
        A step whose manifest cannot be read is left to the reads that will say why."""
        if tier.capabilities.references:
            return True
        try:
            return not any(record.references for record in self.local.manifest(step).shards)
        except CheckpointError:
            return True

    @property
    def keeps_references(self) -> bool:
        """Whether every tier keeps the files its steps reference (``capabilities.references``):
        only then may a save reference an earlier step's file."""
        return all(tier.capabilities.references for tier in self.tiers)

    @property
    def later(self) -> tuple[Tier, ...]:
        """The tiers after the first, nearest first."""
        return self.tiers[1:]

    def readable(self, in_remote: bool | None) -> tuple[str, ...]:
        """The later tiers a read of a step tries, by name: a tier every node sees and a later run
        resumes from (``shared`` and ``durable``: a bucket) if it committed the step
        (``in_remote``) or may have (None: it could not be listed), and every other later tier
        (what each holds is not listed first: a copy it lacks is one more failed try)."""
        return tuple(
            tier.name
            for tier in self.later
            if not (tier.capabilities.shared and tier.capabilities.durable) or in_remote is not False
        )

    def tier(self, name: str) -> Tier:
        """The tier called ``name``."""
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise UsageError(f"the store has no tier {name!r} (tiers: {[tier.name for tier in self.tiers]})")

    def policy(self, tier: Tier) -> RetentionPolicy:
        """``tier``'s retention (keep everything, if none was given)."""
        return self.retention.get(tier.name, RetentionPolicy())

    def where(self) -> str:
        """Every tier's location, for messages."""
        return " and ".join(tier.url for tier in self.tiers)

    # -- what the later tiers committed ---------------------------------------------------------

    def remote_steps(self) -> list[int]:
        """Steps committed in the bucket (:attr:`remote`), oldest first (empty without one)."""
        return self.remote.steps() if self.remote is not None else []

    def receipted(self, step: int, tier: Tier | None = None) -> bool:
        """True if the local step records its commit in ``tier`` (default: the bucket)."""
        tier = tier or self.remote
        return tier is not None and self.local.has_receipt(step, tier.url)

    def mend_receipt(self, step: int, tier: Tier) -> bool:
        """Record ``tier``'s commit of ``step``, which its listing names, if it committed the very
        checkpoint this disk holds (a crash between the commit and its receipt lost the receipt):
        True if recorded, False if the tier has no receipts or committed another checkpoint. Raises
        :class:`RemoteError` if its record cannot be read, :class:`ManifestError` if damaged."""
        receipted = receipts_of(tier)
        if receipted is None:
            return False
        remote = receipted.read_manifest(step)
        if remote.manifest.shards != self.local.manifest(step).shards:
            return False
        self.record_commit(step, tier, remote)
        logger.info("step %d: %s committed it already, the receipt was lost; recorded", step, tier.url)
        return True

    def record_commit(self, step: int, tier: Tier, committed: RemoteManifest) -> None:
        """Record in the local step that ``tier`` committed it: a receipt. Only a tier whose
        capabilities say ``receipts`` has them (a durable one: a receipt of a copy that dies with
        the job would outlive it)."""
        if not tier.capabilities.receipts:
            raise UsageError(f"only a tier with receipts has its commits recorded, not {tier!r}")
        self.local.write_receipt(step, tier.url, committed)

    def manifests(
        self, step: int, *, in_local: bool, in_remote: bool, bucket_shards: str | None = None
    ) -> tuple[ShardManifest, RemoteManifest | None]:
        """The step's manifest (the local one if it validates, else a later tier's that is not the
        bucket, else the bucket's) and the bucket's remote manifest (``in_*``: whether each
        tier committed the step; None when a nearer tier's manifest was used instead, or when
        ``bucket_shards`` stood for it).

        ``bucket_shards``: the :meth:`~tiered_ckpt.format.manifest.ShardManifest.shards_digest`
        of the bucket's manifest, as a restore's leader read it; a valid local manifest of a
        step with the bucket's receipt is checked against it and the bucket is not asked (one
        read a restore, not one a process; a step without the receipt reads the bucket's, whose
        record a refill of the step writes as its receipt).

        Raises :class:`ManifestError` if the two describe different checkpoints.
        """
        if in_local and in_remote and bucket_shards is not None and self.receipted(step):
            try:
                local = self.local.manifest(step)
            except ManifestError:
                pass  # read the bucket's below
            else:
                if local.shards_digest() != bucket_shards:
                    raise _different_checkpoints(step)
                return local, None
        if not in_local:  # a nearer copy's manifest first: reading the bucket's costs a request
            for tier in self.later:
                if tier is not self.remote:
                    try:
                        return tier.manifest(step), None
                    except CheckpointError:
                        continue
        remote = self.remote.read_manifest(step) if in_remote and self.remote is not None else None
        if not in_local:
            if remote is None:
                raise IncompleteCheckpointError(f"{self.where()}: step {step} is committed in no tier")
            return remote.manifest, remote
        try:
            local = self.local.manifest(step)
        except ManifestError:
            if remote is None:
                raise
            logger.warning("the local manifest of step %d is damaged; using the remote one", step)
            return remote.manifest, remote
        if remote is not None and remote.manifest.shards != local.shards:
            raise _different_checkpoints(step)
        return local, remote

    # -- reading shards ---------------------------------------------------------------------

    def send_shard(
        self,
        step: int,
        record: ShardRecord,
        tier: Tier,
        *,
        deadline: float | None = None,
        data: memoryview | None = None,
    ) -> Landed:
        """Land the first tier's copy of ``record``'s shard in ``tier`` (a replicator's put), or
        ``data``, the shard's bytes, for a step the first tier does not hold (one kept in memory
        only): the copy appears there only once it matches the record; what landed, for the
        tier's commit (see :meth:`Tier.land_shard`). A tier landing referenced files with the
        shard (:attr:`~tiered_ckpt.tiers.base.Capabilities.references_with_shards`) is handed
        the first tier's copies of those the shard references."""
        referenced: tuple[tuple[int, ShardRecord, ShardSource], ...] = ()
        if tier.capabilities.references_with_shards:
            referenced = tuple((ref.step, ref.file, self._referenced_source(ref)) for ref in record.references)
        path = self.local.shard_path(step, record) if data is None else None
        source = ShardSource(path=path, data=data, referenced=referenced)
        return tier.land_shard(step, record, source, deadline=deadline)

    def _referenced_source(self, ref: Reference) -> ShardSource:
        """The first tier's copy of the earlier file ``ref`` names: its path, and a writer that
        finds the file where it is when called. Retention may delete the file's step meanwhile,
        moving the file to the step's kept directory (once, atomically): a reader that finds no
        file at the path streams it from the writer."""

        def write(out: BinaryIO) -> ShardDigest:
            with open(self.local.shard_path(ref.step, ref.file), "rb") as source:
                return copy_and_hash(source, out)

        return ShardSource(path=self.local.shard_path(ref.step, ref.file), write=write)

    def send_referenced(self, ref: Reference, tier: Tier, *, deadline: float | None = None) -> Landed:
        """Land the first tier's copy of the earlier file ``ref`` names in ``tier``, under its own
        step's place there (a replicator's put of a step referencing it): what landed, with its step.

        Retention may delete the file's step meanwhile, moving the file to the step's kept
        directory (once, atomically): a landing that fails after the move lands it from there."""
        path = self.local.shard_path(ref.step, ref.file)
        try:
            landed = tier.land_shard(ref.step, ref.file, ShardSource(path=path, earlier=True), deadline=deadline)
        except CheckpointError:
            moved = self.local.shard_path(ref.step, ref.file)
            if moved == path:
                raise
            landed = tier.land_shard(ref.step, ref.file, ShardSource(path=moved, earlier=True), deadline=deadline)
        return replace(landed, step=ref.step)

    def download_shard(self, step: int, record: ShardRecord, tier: Tier | None = None) -> None:
        """Stream ``record``'s copy in ``tier`` (default: the bucket) into the local step,
        landing it only if it verifies (a refill)."""
        tier = tier or self.remote
        if tier is None or tier is self.local:
            raise UsageError("downloading a shard needs a tier after the first (remote.url)")

        def land(source: BinaryIO) -> None:  # through the page cache: the read that follows finds it there
            write = ShardSource(write=lambda out: copy_and_hash(source, out))
            # named once the tier has opened it (and read where its bucket keeps it): a copy
            # that does not match is the bucket's, not this disk's
            copy = tier.shard_location(step, record)
            self.local.land_shard(step, record, write, cached=True, copy_of=copy)

        tier.open_shard(step, record, land)

    def download_referenced(self, step: int, record: ShardRecord, tier: Tier) -> None:
        """Stream ``record``'s copy in ``tier``, a file of earlier ``step`` that a step being read
        references, to this disk (:meth:`LocalTier.land_referenced`), landing it only if it verifies."""

        def land(source: BinaryIO) -> None:
            write = ShardSource(write=lambda out: copy_and_hash(source, out))
            self.local.land_referenced(step, record, write, copy_of=tier.shard_location(step, record))

        tier.open_shard(step, record, land)

    def fetch_shard(
        self,
        step: int,
        record: ShardRecord,
        *,
        verify: Verify = "full",
        into: Mapping[str, np.ndarray] | None = None,
        later: Collection[str] | None = None,
    ) -> FetchedShard:
        """One shard's verified state and the name of the tier it came from (see the module doc
        for the chain). ``later``: the names of the later tiers to try (None: every one; empty:
        the first tier only). A copy read from this process's memory is not landed on the local
        disk here: it is returned, verified (:attr:`FetchedShard.copy`), for :meth:`land_copies`."""

        def read(tier: Tier) -> tuple[FlatState, Landing | None]:
            data = _copy_in_memory(tier, step, record) if tier is not self.local else None
            if data is not None:
                return self._read_from_memory(step, record, data, verify, into, tier), (record, data)
            if tier is not self.local:
                self.download_shard(step, record, tier)
            return self.local.read_shard(step, record, verify, into), None

        (state, copy), source = self._first_that_verifies(step, record, read, later, refills=True)
        if record.references:
            arrays = dict(state.arrays)
            for ref in record.references:
                arrays.update(self._read_referenced(step, ref, ref.names, into or {}, verify, later, refills=True))
            state = FlatState(arrays, state.structure, state.replicated)
        return FetchedShard(state, source, copy)

    def _read_referenced(
        self,
        step: int,
        ref: Reference,
        names: Collection[str],
        into: Mapping[str, np.ndarray],
        verify: Verify,
        later: Collection[str] | None,
        header: ShardHeader | None = None,
        *,
        refills: bool = False,
    ) -> dict[str, np.ndarray]:
        """``names`` of the arrays ``ref`` (a reference of a shard of ``step``) places in an earlier
        file, read along the chain as :meth:`read_parts` reads parts (``header``: the file's,
        verified already), each verified against the xxh3-64 the reference records. ``refills``
        (a whole shard's restore, which refills this disk): a file read from a later tier is
        landed whole on this disk first (:meth:`download_referenced`), so that the step the
        restore commits here holds every file it references."""
        digests = ref.digests()

        def read(tier: Tier) -> dict[str, np.ndarray]:
            if tier is not self.local and (refills or not tier.capabilities.ranged_reads):
                self.download_referenced(ref.step, ref.file, tier)
                tier = self.local
            what = f"rank {ref.file.rank} shard {_located(tier, ref.step, ref.file)} (referenced by step {step})"
            if tier is self.local:
                return self._read_referenced_here(ref, names, what, into, verify, header)
            read_range = functools.partial(tier.read_range_into, ref.step, ref.file)
            seen = header or verified_header(read_range, ref.file, what)
            return read_verified_arrays(read_range, ref.file, names, what, into, verify, seen, digests)

        return self._first_that_verifies(ref.step, ref.file, read, later, refills=False)[0]

    def _read_referenced_here(
        self,
        ref: Reference,
        names: Collection[str],
        what: str,
        into: Mapping[str, np.ndarray],
        verify: Verify,
        header: ShardHeader | None,
    ) -> dict[str, np.ndarray]:
        """:meth:`_read_referenced` from this disk; read again from the step's kept directory if the
        file moved there while it was read (its step deleted meanwhile: a move happens once)."""

        def read() -> dict[str, np.ndarray]:
            with self.local.open_ranges(ref.step, ref.file) as read_into:
                seen = header or verified_header(read_into, ref.file, what)
                return read_verified_arrays(read_into, ref.file, names, what, into, verify, seen, ref.digests())

        path = self.local.shard_path(ref.step, ref.file)
        try:
            return read()
        except IncompleteCheckpointError:
            if self.local.shard_path(ref.step, ref.file) == path:
                raise
        return read()

    def _read_from_memory(
        self,
        step: int,
        record: ShardRecord,
        data: memoryview,
        verify: Verify,
        into: Mapping[str, np.ndarray] | None,
        tier: Tier,
    ) -> FlatState:
        """The state in a copy already in memory, each byte hashed once as it is copied into its
        array (the caller lands the copy on the local disk as it is: the disk's read of a refill
        is spared). Raises as :meth:`LocalTier.read_shard` does."""
        what = f"rank {record.rank} shard {tier.shard_location(step, record)}"
        if len(data) != record.size_bytes:
            raise IncompleteCheckpointError(f"{what}: {len(data)} bytes, the manifest records {record.size_bytes}")
        replicas, own = own_targets(record.elsewhere, into)
        contents = read_shard_buffer(data, check=lambda d: record.verify(d, what), verify=verify, what=what, into=own)
        record.check_holds(contents.arrays, what)
        return FlatState.from_shard(contents, what, replicas)

    def land_copies(self, step: int, copies: Sequence[Landing], max_workers: int | None = None) -> None:
        """Land each ``(record, bytes)`` of ``step`` in the local step, ``max_workers`` at a time,
        hashed again as they are written: memory a tier reuses may have changed since they were
        checked. Bytes that are a whole map of a file (a fetched copy received on disk) are
        written a block at a time, each block's pages let go once written. The caller records
        the refill (:meth:`record_refill`). Raises as :meth:`LocalTier.land_shard` does
        (:class:`ChecksumMismatchError`: the bytes changed)."""

        def land(copy: Landing) -> None:
            record, data = copy

            def write(out: BinaryIO) -> ShardDigest:
                hasher = Hasher()
                writer = hashing_writer(out, hasher)
                for block in blocks_of(data, CHUNK_BYTES, whole_map(data)):
                    writer(block)
                return hasher.digest()

            self.local.land_shard(step, record, ShardSource(write=write))

        run_parallel(land, copies, max_workers)

    def _first_that_verifies(
        self, step: int, record: ShardRecord, read: Callable[[Tier], T], later: Collection[str] | None, refills: bool
    ) -> tuple[T, TierName]:
        """The chain of every read: ``read(tier)`` for the first tier, then for each tier named in
        ``later`` (None: every later tier), in the store's order, each later tier tried twice;
        raises naming every copy tried if none verifies.

        A copy that fails (missing, short, unreadable, not matching) is one more reason to
        read the next tier; a shard the local step should hold and is taken from a later tier
        is logged at WARNING with the local copy's problem (``refills``: ``read()`` wrote a
        good copy back), one this node never held (a replaced node, a reshard) at INFO, naming
        the tiers that held no copy. Each failed try of a later tier is logged at WARNING; a tier
        keeping its copies in this process's memory that holds none (a partner's memory that
        sent none) is not tried at all.
        """
        tried: list[tuple[str, str, CheckpointError]] = []
        absent: list[str] = []
        chain = [self.local, *(tier for tier in self.later if later is None or tier.name in later)]
        for tier in chain:
            first = tier is self.local
            if not first and _holds_no_copy(tier, step, record):  # nothing to try, nothing to try again
                where = tier.shard_location(step, record)
                missing = IncompleteCheckpointError(f"{where}: no copy of rank {record.rank}'s shard reached this rank")
                tried.append((tier.name, where, missing))
                absent.append(tier.name)
                continue
            for attempt in range(1, 2 if first else _TRIES_OF_A_LATER_TIER + 1):
                try:
                    found = read(tier)
                except (*_READ_FAILURES, RemoteError) as error:
                    if first and (isinstance(error, RemoteError) or len(chain) == 1):
                        raise
                    # named after the read: a tier reading where its bucket keeps the copy names it then
                    where = tier.shard_location(step, record)
                    tried.append((tier.name, where, error))
                    if not first:
                        logger.warning(
                            "step %d rank %d: try %d of %d of %s failed: %s",
                            step,
                            record.rank,
                            attempt,
                            _TRIES_OF_A_LATER_TIER,
                            where,
                            error,
                        )
                    continue
                if first:
                    return found, tier.name
                where = tier.shard_location(step, record)
                if self.held_locally(step, record.rank):
                    done = "repaired the local copy from" if refills else "read it instead from"
                    logger.warning(
                        "step %d rank %d: %s %s; the local copy failed: %s", step, record.rank, done, where, tried[0][2]
                    )
                else:
                    logger.info(
                        "step %d rank %d: not on this node's disk%s; read from %s",
                        step,
                        record.rank,
                        "".join(f" nor in the {name} tier" for name in absent),
                        where,
                    )
                tried.clear()  # their tracebacks hold this frame and what ``read`` filled: a cycle
                return found, tier.name
        return _no_copy_verifies(record, tried)

    def held_locally(self, step: int, rank: int) -> bool:
        """True if the local tier committed ``step`` holding ``rank``'s shard (whether its bytes verify or not)."""
        try:
            return rank in self.local.held_ranks(step, self.local.manifest(step))
        except CheckpointError:  # not committed here, or its records are damaged (logged where they are read)
            return False

    def read_parts(
        self,
        step: int,
        record: ShardRecord,
        names: Collection[str] | Callable[[Structure], Structure],
        *,
        later: Collection[str] | None = None,
        into: Mapping[str, np.ndarray] | None = None,
        verify: Verify = "full",
        index: ShardIndex | None = None,
    ) -> tuple[FlatState, TierName]:
        """Some arrays of ``record``'s shard, verified, and the tier they came from (``index``:
        its header as :meth:`read_shard_index` returned it, neither read nor parsed again: the
        reads of many arrays of one shard, one call each, parse its structure document once).

        Reads only the shard's header and those arrays' bytes, each checked against the
        sha256 the manifest records for it in a state of DTensors (``verify="fast"``: its
        xxh3-64, where the manifest records one), against its xxh3-64 in a shard of plain
        arrays (all a save records of them; the header always by sha256), along the chain of the module
        doc (``later`` as for :meth:`fetch_shard`). The state returned has the whole structure
        but only ``names``' arrays; ``names`` may instead be a function of the shard's
        structure giving a part of it (a partial restore's selection): the state returned has
        that structure, and the arrays in it the shard holds. An array named in ``into`` (C-contiguous, of its dtype and
        shape) is read into that memory rather than new memory; if no copy verifies, it holds
        unspecified values. Raises :class:`ChecksumMismatchError` or
        :class:`IncompleteCheckpointError` naming every copy tried.
        """
        targets = into or {}
        if record.references:
            return self._read_parts_referencing(step, record, names, later, targets, verify, index)

        # ``read`` must not call itself: a closure over itself is a reference cycle, which would
        # keep ``into``'s arrays (whole tensors, for an export) alive until the next collection.
        def read(tier: Tier) -> FlatState:
            if tier is not self.local and not tier.capabilities.ranged_reads:
                self.download_shard(step, record, tier)
                tier = self.local
            what = f"rank {record.rank} shard {_located(tier, step, record)}"
            if tier is self.local:
                with self.local.open_ranges(step, record) as read_into:
                    return read_verified_parts(read_into, record, names, what, targets, verify, index)
            read_range = functools.partial(tier.read_range_into, step, record)
            return read_verified_parts(read_range, record, names, what, targets, verify, index)

        return self._first_that_verifies(step, record, read, later, refills=False)

    def _read_parts_referencing(
        self,
        step: int,
        record: ShardRecord,
        names: Collection[str] | Callable[[Structure], Structure],
        later: Collection[str] | None,
        into: Mapping[str, np.ndarray],
        verify: Verify,
        index: ShardIndex | None,
    ) -> tuple[FlatState, TierName]:
        """:meth:`read_parts` of a shard that references arrays in earlier files: those its own
        file holds from it, the others from the files that hold them."""
        if index is None:
            index, _source = self.read_shard_index(step, record, later=later)
        structure = index.structure
        if callable(names):
            structure = names(structure)
            every = index.whole_header(record).arrays
            names = [name for name in structure.kinds if name in every]
        wanted = set(names)
        referenced = record.referenced
        own = [name for name in names if name not in referenced]
        state, source = self.read_parts(
            step, replace(record, references=()), own, later=later, into=into, verify=verify, index=index
        )
        arrays = dict(state.arrays)
        for ref, header in zip(record.references, index.references, strict=True):
            mine = [name for name in ref.names if name in wanted]
            if mine:
                arrays.update(self._read_referenced(step, ref, mine, into, verify, later, header))
        return FlatState(arrays, structure), source

    def read_shard_header(
        self, step: int, record: ShardRecord, *, later: Collection[str] | None = None
    ) -> tuple[ShardHeader, TierName]:
        """``record``'s shard header (each array's place, dtype and shape; the metadata), verified by its
        sha256, from the nearest tier serving ranged reads (``later`` as for :meth:`fetch_shard`); writes nothing.
        For a shard that references arrays in earlier files, their entries are added from those
        files' verified headers (:meth:`ShardIndex.whole_header`: their places are in those files)."""
        if record.references:
            index, source = self.read_shard_index(step, record, later=later)
            return index.whole_header(record), source
        return self._own_header(step, record, later)

    def _own_header(
        self, step: int, record: ShardRecord, later: Collection[str] | None
    ) -> tuple[ShardHeader, TierName]:
        """The header of ``record``'s own file, verified (see :meth:`read_shard_header`)."""

        def read(tier: Tier) -> ShardHeader:
            what = f"rank {record.rank} shard {_located(tier, step, record)}"
            if tier is self.local:
                with self.local.open_ranges(step, record) as read_into:
                    return verified_header(read_into, record, what)
            if not tier.capabilities.ranged_reads:
                raise IncompleteCheckpointError(f"{what}: the tier reads whole shards only")
            return verified_header(functools.partial(tier.read_range_into, step, record), record, what)

        return self._first_that_verifies(step, record, read, later, refills=False)

    def read_shard_index(
        self, step: int, record: ShardRecord, *, later: Collection[str] | None = None
    ) -> tuple[ShardIndex, TierName]:
        """``record``'s shard header as :meth:`read_shard_header` reads it, parsed for
        :meth:`read_parts`: its structure document and its arrays' digests. Raises as
        :meth:`read_shard_header` does, and :class:`ShardFormatError` for a structure document
        or digests that do not match the header."""
        header, source = self._own_header(step, record, later)
        index = shard_index(header, record, f"rank {record.rank} shard {record.path}")
        if record.references:
            index = replace(
                index, references=tuple(self._reference_header(step, ref, later) for ref in record.references)
            )
        return index, source

    def _reference_header(self, step: int, ref: Reference, later: Collection[str] | None) -> ShardHeader:
        """The verified header of the earlier file ``ref`` (of a shard of ``step``) names, holding
        each array it names (:class:`ShardFormatError` otherwise)."""
        header, tier = self._own_header(ref.step, ref.file, later)
        missing = [name for name in ref.names if name not in header.arrays]
        if missing:
            where = self.tier(tier).shard_location(ref.step, ref.file)
            raise ShardFormatError(
                f"{where} (referenced by step {step}): holds no array {missing[0]!r:.80} that the reference names"
            )
        return header

    # -- writing the local tier from a later one --------------------------------------------

    def record_refill(
        self, manifest: ShardManifest, remote: RemoteManifest | None, fetched: Collection[int], was_committed: bool
    ) -> None:
        """After shards of ``fetched`` ranks were read into the local step: record what it holds,
        commit it locally if it was not committed here before, and record the bucket's
        commit (``remote``) if the step has no receipt. Nothing is rewritten that is already right."""
        step = manifest.step
        if not was_committed:
            self.local.commit(manifest, held=fetched)
        else:
            held: set[int] | None
            try:
                held = set(self.local.held_ranks(step, manifest))
            except ManifestError:
                logger.warning("step %d: the record of held shards is damaged; rewriting it", step, exc_info=True)
                held = None
            if held is None or not held >= set(fetched):
                self.local.record_held(step, manifest, (held or set()) | set(fetched))
        if remote is not None and self.remote is not None and not self.receipted(step):
            self.record_commit(step, self.remote, remote)


def _different_checkpoints(step: int) -> ManifestError:
    """The error of a disk's manifest of ``step`` whose shards are not the bucket's."""
    return ManifestError(f"the local and remote manifests of step {step} describe different checkpoints")


def _located(tier: Tier, step: int, record: ShardRecord) -> str:
    """Where ``tier`` keeps ``record``'s copy of ``step``, as it names the copy it reads: a tier with
    receipts first learns where (a process that checked its disk by digest never read the record)."""
    receipted = receipts_of(tier)
    if receipted is not None:
        receipted.look_up(step, record)
    return tier.shard_location(step, record)


def _copy_in_memory(tier: Tier, step: int, record: ShardRecord) -> memoryview | None:
    """The bytes of ``tier``'s copy of ``record``'s shard if the tier keeps its copies in this
    process's memory (``capabilities.prepared_reads``) and holds one, not yet verified."""
    return cast(PreparedReads, tier).copy_in_memory(step, record) if tier.capabilities.prepared_reads else None


def _holds_no_copy(tier: Tier, step: int, record: ShardRecord) -> bool:
    """True if ``tier`` keeps its copies in this process's memory and holds none of ``record``'s
    shard (a partner's memory that sent none): a try would fail at once, and so would a second."""
    return tier.capabilities.prepared_reads and _copy_in_memory(tier, step, record) is None


def _no_copy_verifies(record: ShardRecord, tried: list[tuple[str, str, CheckpointError]]) -> NoReturn:
    """Raise the error of a shard no copy of which verified: each copy of ``tried`` (tier name,
    location, error of each try) named once, by its tier and location, with what its tries found
    (once, if every try found the same)."""
    mismatch = any(isinstance(error, ChecksumMismatchError) for _tier, _where, error in tried)
    error_type = ChecksumMismatchError if mismatch else IncompleteCheckpointError
    copies: dict[tuple[str, str], list[str]] = {}
    for tier, where, error in tried:
        copies.setdefault((tier, where), []).append(str(error))
    listing = []
    for (tier, where), problems in copies.items():
        tries = f" ({len(problems)} tries)" if len(problems) > 1 else ""
        listing.append(f"{tier} {where}{tries}: {'; then '.join(dict.fromkeys(problems))}")
    raise error_type(f"rank {record.rank}: no copy verifies; tried {'; '.join(listing)}") from tried[-1][2]
