"""The tier protocol: the words every tier speaks, and a record of what a tier can do.

A tier holds checkpoints of one job in one place (this node's disk, a bucket, a partner's
memory). It knows only its own storage; tiers meet in :class:`~tiered_ckpt.tiers.store.TieredStore`,
which moves shards between them. Every tier implements :class:`Tier`; what differs between
them is said by :class:`Capabilities`, never by a tier's type: an optional ability (receipts
of its commits, run leases, a ``latest`` pointer, the store's checksums, retrying its
storage's failures) is a flag there, and a tier that sets one also speaks that ability's
words, which :mod:`~tiered_ckpt.tiers.abilities` hands out by the flag.

A step's life on a tier, in the order the calls are made:

1. ``steps()`` and ``uncommitted_steps()`` (both at once: ``list_steps()``): what the tier
   holds, committed or not (a step being written, or left by a crash: a later
   ``delete_step`` removes it); ``held_ranks(step, manifest)``: whose shards of a committed
   step it holds (every rank's on a ``shared`` tier, a node's part on a node-local one).
2. ``land_shard(step, record, source) -> Landed`` for each shard the caller holds: the
   shard's bytes appear under their final name only once they match ``record`` (size and
   sha256); a failed or interrupted landing leaves nothing a reader could take for the
   shard. What it returns says what landed (where, its sizes stored and raw, the store's
   checksum, how it is compressed): a frozen value that crosses a collective, so that the
   processes landing shards need not be the one committing them. The tier keeps nothing of
   it: between landing and commit, the caller holds that state.
3. ``commit(manifest, landed=...)``, given what every landing of the step returned (gathered
   from every process): the tier confirms the shards, records what they say and makes the
   step visible, exactly once this returns, and only if every shard of it was landed (on a
   tier that is ``shared``, by every rank); where ``capabilities.latest``, it then moves its
   ``latest`` pointer. Where ``capabilities.create_only_commit``, a second commit of a
   different checkpoint of the same step is refused rather than written over the first.
   Where ``capabilities.receipts``, it returns the commit's record, which the caller keeps
   as a receipt in the first tier.
4. ``manifest(step)``: the step's manifest, strictly validated (manifests are untrusted
   input); one that names another step is refused.
5. ``open_shard(step, record, consume)`` to stream a shard whole, or, where
   ``capabilities.ranged_reads``, ``read_range_into(step, record, offset, buffer)`` for parts
   of it. Neither verifies the whole shard: the caller hashes what it reads (the store does).
6. ``check_shard(step, record)``: read and hash one shard, returning the problem or None.
7. ``delete_step(step)``: the step becomes invisible first (its manifest goes), then its
   shards; a crash in between leaves an uncommitted step, never a visible partial one.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol, TypeVar, runtime_checkable

from tiered_ckpt.errors import UsageError
from tiered_ckpt.format.manifest import ShardManifest, ShardRecord
from tiered_ckpt.format.remote_manifest import RemoteManifest
from tiered_ckpt.io.hashing import ShardDigest, Verify, copy_and_hash

__all__ = ["Capabilities", "Confirmed", "Gather", "Landed", "PreparedReads", "ShardSource", "Tier"]

T = TypeVar("T")
P = TypeVar("P")


@dataclass(frozen=True)
class Capabilities:
    """What a tier can do, for the store and the engine to decide by (never a tier's type).

    ``durable``: a committed step survives the job's processes (and, for a disk, a reboot).
    ``shared``: every node sees the same copy (a bucket); otherwise each node holds its own
    (a local disk, a partner's memory), and a replaced node's copy is gone.
    ``create_only_commit``: a commit never overwrites another commit of the same step.
    ``store_checksums``: the storage computes a checksum of what it received, kept with the
    object, so bytes changed in transit are caught without a download.
    ``ranged_reads``: parts of a shard can be read without reading it whole.

    The optional abilities the replication side asks for (each False unless a tier says so;
    see :mod:`~tiered_ckpt.tiers.abilities` for the words a tier that has one speaks):
    ``receipts``: its commits are the ones a later run resumes from, each recorded in the
    first tier's step (a receipt, from what :meth:`Tier.commit` returns); ``leases``: a run
    holds a lease on its storage, and uploads a failed run left open there are aborted;
    ``latest``: its commit moves a ``latest`` pointer to the step; ``retries``: its storage
    fails transiently and it retries its requests under its own policy, telling how they fail.
    ``prepared_reads``: a restore prepares its reads of the tier first, and the copies read are
    in this process's memory (a partner's memory): the tier is a :class:`PreparedReads`.
    ``references``: it keeps a file of a step it deleted while a step it holds references it
    (:attr:`~tiered_ckpt.format.manifest.ShardRecord.references`), and reads it there: an
    incremental save is made only where every tier of the store does. ``paired_landings``:
    every process lands its own shard at once, each landing an exchange with other
    processes (a partner's memory), so every process makes the same number of them.
    ``confirms``: right before its commit, the objects landed are checked once more; each
    process checks those it landed (``confirm``), so that the process committing makes no
    request per rank (see :class:`~tiered_ckpt.tiers.abilities.ConfirmingTier`).
    """

    durable: bool
    shared: bool
    create_only_commit: bool
    store_checksums: bool
    ranged_reads: bool
    receipts: bool = False
    leases: bool = False
    latest: bool = False
    retries: bool = False
    prepared_reads: bool = False
    references: bool = False
    paired_landings: bool = False
    confirms: bool = False

    @property
    def references_with_shards(self) -> bool:
        """Whether the tier lands the earlier files a shard references with the shard
        (:attr:`ShardSource.referenced`): it keeps them, and its landings pair the processes up
        (``paired_landings``), so a file cannot be a landing of its own."""
        return self.references and self.paired_landings


@dataclass(frozen=True)
class Landed:
    """What landing one shard left in a tier (:meth:`Tier.land_shard`), for its commit.

    ``rank`` and ``path``: the shard's, as its record says. ``location``: where the tier put it
    in the step, as its commit records it (the shard's own name, unless the tier spreads its
    objects over prefixes). ``stored_bytes``: the size of what it holds; ``raw_bytes``: the
    shard's (the same unless ``compression`` says how the stored bytes compress it, in the
    tier's own words, as JSON). ``checksum``: the checksum the storage computed of what it received
    and keeps with it, where it does (``capabilities.store_checksums``; None for a shard found
    already there intact). ``sent``: False if it was already there intact, nothing sent.
    ``step``: None for a shard of the step being committed; for a file of an earlier step that
    its shards reference (an incremental save), that step, under whose prefix it landed.

    Plain JSON fields: it crosses a collective (every process's landings reach the one that
    commits), and the tier that reads it back takes it as untrusted input.
    """

    rank: int
    path: str
    location: str
    stored_bytes: int
    raw_bytes: int
    checksum: str | None = None
    compression: str | None = None
    sent: bool = True
    step: int | None = None

    @classmethod
    def as_is(cls, record: ShardRecord, *, sent: bool = True) -> Landed:
        """A shard landed under its own name as the bytes it is, with no checksum of the storage's."""
        return cls(record.rank, record.path, record.path, record.size_bytes, record.size_bytes, sent=sent)


@dataclass(frozen=True)
class Confirmed:
    """What one process confirmed, right before a commit, of the objects it landed: each as
    (``step``, ``path``) of its :class:`Landed`, and the problems found, each naming its object.

    Plain JSON fields: it crosses a collective to the process that commits."""

    objects: tuple[tuple[int | None, str], ...]
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class ShardSource:
    """The bytes of one shard, handed to :meth:`Tier.land_shard`.

    ``path``: a file on this node's disk holding them (a committed local shard), which a tier
    may read in concurrent parts (and write a copy of beside it under a temp name, as the
    object-store tier writes a compressed one). ``write``: a function that streams them into a binary file
    object and returns their digest (the writer serializing a state, a download being
    refilled). ``data``: the bytes themselves, in memory (a step kept in no file); ``write``
    is then made from them, so a tier that streams needs nothing else. At least one is given;
    given more, they hold the same bytes.

    ``referenced``: for a tier that keeps referenced files and whose landings pair its
    processes up (:attr:`Capabilities.references_with_shards`), the earlier files the shard
    references, each as its step, record and source: it lands them with the shard, under their
    own steps (another tier is handed them by landings of their own).

    ``earlier``: the file is an earlier step's, which the step being sent references (not a
    shard of a step being sent itself): a tier that may keep it already, under that step or
    for a committed step referencing it, looks it up there before sending it.
    """

    path: Path | None = None
    write: Callable[[BinaryIO], ShardDigest] | None = None
    data: bytes | bytearray | memoryview | None = None
    referenced: tuple[tuple[int, ShardRecord, ShardSource], ...] = ()
    earlier: bool = False

    def __post_init__(self) -> None:
        if self.data is not None and self.write is None:
            data = self.data
            object.__setattr__(self, "write", lambda out: copy_and_hash(io.BytesIO(data), out))
        if self.path is None and self.write is None:
            raise UsageError("a ShardSource needs a path, a write function or the bytes")


@runtime_checkable
class Tier(Protocol):
    """One place that holds checkpoints; the call sequence is in this module's docstring."""

    name: str
    """How restores and statuses name this tier ("local", "remote", ...)."""

    url: str
    """Where the tier is, as one string: messages name it, and a receipt of a commit records it."""

    capabilities: Capabilities

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        ...

    def uncommitted_steps(self) -> list[int]:
        """Steps with shards but no commit, oldest first."""
        ...

    def list_steps(self, *, once: bool = False) -> tuple[list[int], list[int]]:
        """``(steps(), uncommitted_steps())`` from one look at the storage. ``once``: a tier that
        retries transient failures tries its first request once (a caller that can do without
        the tier learns at once that it is failing); others ignore it."""
        ...

    def held_ranks(self, step: int, manifest: ShardManifest) -> Sequence[int]:
        """The ranks of ``manifest`` whose shards of committed ``step`` this tier holds, in
        increasing order: every rank on a ``shared`` tier; on a node-local one (a disk, a
        partner's memory) the part this node holds, which may be fewer (the rest live on other
        nodes). A record of them that does not validate raises :class:`ManifestError`."""
        ...

    def shard_location(self, step: int, record: ShardRecord) -> str:
        """Where ``record``'s shard of ``step`` is (a path, a URL), for messages."""
        ...

    def manifest(self, step: int) -> ShardManifest:
        """The validated manifest of committed ``step``."""
        ...

    def open_shard(self, step: int, record: ShardRecord, consume: Callable[[BinaryIO], T]) -> T:
        """Open ``record``'s shard and return ``consume(stream)``; the stream ends after at most
        ``record.size_bytes + 1`` bytes, so a shard longer than its record is never read whole."""
        ...

    def read_range_into(
        self, step: int, record: ShardRecord, offset: int, buffer: memoryview, verify: Verify = "full"
    ) -> str:
        """Fill ``buffer`` with the shard's bytes from ``offset`` and return their sha256
        (``verify="fast"``: their xxh3-64); a shard shorter than that raises."""
        ...

    def check_shard(self, step: int, record: ShardRecord) -> str | None:
        """Read and hash ``record``'s shard; the problem (naming the copy), or None if it matches."""
        ...

    def land_shard(
        self, step: int, record: ShardRecord, source: ShardSource, *, deadline: float | None = None
    ) -> Landed:
        """Put ``source``'s bytes at ``record``'s place in ``step``, atomically and verified; say
        what landed. The tier keeps nothing of it for the commit: the caller hands it over.

        A tier whose storage fails transiently retries until ``deadline`` (a
        ``time.monotonic()`` value; None: its own retry policy alone decides)."""
        ...

    def commit(
        self, manifest: ShardManifest, *, landed: Sequence[Landed] = (), deadline: float | None = None
    ) -> RemoteManifest | None:
        """Make ``manifest``'s step visible; its shards must have landed (``deadline``: as for
        :meth:`land_shard`).

        ``landed``: what :meth:`land_shard` returned of the step's shards, on every process (a
        shard it does not name is taken as landed under its own name, with no checksum of the
        storage's). The tier confirms the shards, records what ``landed`` says of them, commits,
        and, where ``capabilities.latest``, moves its ``latest`` pointer. Returns the commit's
        record where ``capabilities.receipts`` (kept as the step's receipt), else None."""
        ...

    def delete_step(self, step: int) -> None:
        """Remove ``step``: its commit first, then its shards."""
        ...


class Gather(Protocol):
    """A collective among the processes of a restore: ``action()`` run on every one, its
    ``payload`` (a frozen dataclass of JSON fields) returned from every process, in rank order;
    ``label`` names it in errors (:func:`~tiered_ckpt.dist.coordination.gather`)."""

    def __call__(self, label: str, payload: type[P], action: Callable[[], P]) -> list[P]: ...


class PreparedReads(Tier, Protocol):
    """A tier whose copies a restore brings to the reading process before it reads them, and
    reads in this process's memory (``capabilities.prepared_reads``; a partner's memory).

    A restore calls, on every process at once and in this order: :meth:`prepare_reads` for
    the shards a process lacks on its disk; its reads (the store's chain asks
    :meth:`copy_in_memory`); :meth:`prepare_reads` again with ``repairs`` for the shards whose
    disk copy failed, and reads again; :meth:`finish_reads` (whether it succeeded or not)."""

    def prepare_reads(self, step: int, ranks: Sequence[int], gather: Gather, *, repairs: bool, elsewhere: bool) -> bool:
        """Bring to the processes needing them the copies of ``step``'s shards of this process's
        ``ranks`` (a collective through ``gather``; every process calls it with its own). Never
        raises for a copy that does not arrive (the next tier is read instead). ``elsewhere``:
        a durable tier holds the step too (else a copy brought exists only while its holder
        lives, which is logged at WARNING). True if some process brought some copy (the same
        on every process)."""
        ...

    def copy_in_memory(self, step: int, record: ShardRecord) -> memoryview | None:
        """The bytes of ``record``'s copy if this process has them (brought or held), not yet
        verified (None: none)."""
        ...

    def finish_reads(self, step: int) -> None:
        """Drop what :meth:`prepare_reads` brought of ``step``."""
        ...
