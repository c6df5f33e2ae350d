"""The peer tier: each rank's committed shards also held in the memory of a partner rank on another node.

A :class:`PeerTier` is one process's side of it, with one process per rank: it sends this
rank's shards to its partner (chosen by :func:`~tiered_ckpt.tiers.peer.partners.choose_partners`)
and holds its wards' shards in a :class:`~tiered_ckpt.tiers.peer.memory.PeerMemory`. Copies
travel over :class:`~tiered_ckpt.tiers.peer.link.PeerLink` s of its own, one for saves (the
replicator's thread), one for restores (the caller's), in the rounds of
:mod:`~tiered_ckpt.tiers.peer.copies`.

A save's copy happens in :meth:`PeerTier.land_shard`, which every process calls for its own
rank at once (the replicator's processes work on the same step together); only a copy
whose sha256 matches is kept, and :meth:`PeerTier.commit` then writes the manifest next to
the wards' slots. The shard travels in pieces, and the sender (reading a map of its file,
or of the file a step kept in memory only was serialized to past the host memory budget)
and the holder (writing a map of its slot) let each piece's pages go once it is through:
a copy adds at most a piece or two to either process's resident memory, whatever the
shard's size (the holder's slots are the tier's own storage, bounded by ``peer.max_bytes``).

A restore gets, for a chosen step, the shards its rank lacks on disk from whichever process
holds them (:meth:`PeerTier.prepare_reads`, the tier's preparation of a restore's reads: the
processes agree who sends what, then send), and reads them through the store's chain like
any later tier's (own disk -> partner's memory -> bucket): they land on disk only if they
verify. A fetched shard is received into a file with no name on this rank's disk (the
``spool`` directory: its local directory), not into memory, and read from there through a
map whose pages the reads let go as they move on: a restore holds a block or a piece of it,
whatever its size (see :func:`~tiered_ckpt.tiers.peer.copies.fetch`).

An incremental save's shard references earlier steps' files: its copy carries those the
partner lacks (handed over as :attr:`~tiered_ckpt.tiers.base.ShardSource.referenced`: the
tier's landings pair its processes up, so a file cannot be a landing of its own), the
partner commits the step only holding every one, and keeps them while a step it holds
references them (``capabilities.references``); a restore's copy brings them with the shard.

A partner that died, hangs or sent bytes that do not verify fails only the copy (a
:class:`~tiered_ckpt.PeerError`): the replicator logs it and the step is not in this
tier; a link that timed out stays broken for the run (see
:class:`~tiered_ckpt.tiers.peer.link.PeerLink`).
"""

from __future__ import annotations

import hashlib
import io
import logging
import mmap
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar

import numpy as np

from tiered_ckpt.errors import CheckpointError, IncompleteCheckpointError, ManifestError, PeerError, UsageError
from tiered_ckpt.format.manifest import ShardManifest, ShardRecord
from tiered_ckpt.io.hashing import Verify
from tiered_ckpt.io.pages import blocks_of, whole_map
from tiered_ckpt.tiers.base import Capabilities, Gather, Landed, ShardSource
from tiered_ckpt.tiers.peer.copies import PIECE_BYTES, Outgoing, Transfer, copy_step, fetch
from tiered_ckpt.tiers.peer.link import PeerLink
from tiered_ckpt.tiers.peer.memory import PeerMemory, file_map
from tiered_ckpt.tiers.peer.partners import Partners

__all__ = ["PeerTier"]

logger = logging.getLogger("tiered_ckpt")

T = TypeVar("T")


class PeerTier:
    """This process's side of the peer tier (see the module doc), for rank ``rank`` of ``partners``;
    ``spool``: a directory on this node's disk, where a restore receives the copies it fetches."""

    name = "peer"

    def __init__(
        self,
        memory: PeerMemory,
        partners: Partners,
        rank: int,
        save_link: PeerLink,
        restore_link: PeerLink,
        spool: Path,
    ) -> None:
        holder = partners.partner[rank]
        if holder is None:
            raise UsageError(f"rank {rank} has no partner on another node: the peer tier protects nothing")
        self.memory = memory
        self.partners = partners
        self.rank = rank
        self.partner: int = holder
        self.wards = partners.wards(rank)
        self.url = f"peer://rank-{self.partner}"
        self.capabilities = Capabilities(
            durable=False,
            shared=False,
            create_only_commit=False,
            store_checksums=False,
            ranged_reads=False,
            prepared_reads=True,
            references=True,
            paired_landings=True,
        )
        self._save_link = save_link
        self._restore_link = restore_link
        self._spool = spool
        self._received: dict[tuple[int, int], memoryview] = {}  # (step, rank) -> bytes fetched for a restore
        self._fetched_for: dict[int, set[tuple[int, int]]] = {}  # a restored step -> its keys in _received
        self._manifests: dict[int, ShardManifest] = {}  # manifests fetched for a restore
        self._copying: tuple[int, bool] | None = None  # the step being copied, and whether from the disk
        self._lock = threading.Lock()  # guards what a restore fetched

    def __repr__(self) -> str:
        return f"PeerTier(rank={self.rank}, partner={self.partner}, wards={list(self.wards)})"

    # -- what is held ----------------------------------------------------------------------

    def steps(self) -> list[int]:
        """The steps committed in this process's memory (its wards' shards of them), oldest first."""
        with self.memory.lock:
            return self.memory.steps()

    def uncommitted_steps(self) -> list[int]:
        """Steps of which this process holds a ward's shard but no commit, oldest first."""
        with self.memory.lock:
            return self.memory.uncommitted_steps()

    def list_steps(self, *, once: bool = False) -> tuple[list[int], list[int]]:
        """``(steps(), uncommitted_steps())`` at one instant (``once``: nothing to retry, ignored)."""
        with self.memory.lock:
            return self.memory.steps(), self.memory.uncommitted_steps()

    def kept_steps(self) -> list[int]:
        """Steps not committed here of which slots are kept for the committed steps referencing them."""
        with self.memory.lock:
            return self.memory.kept_steps()

    def collect_unreferenced(self, *, all_steps: bool = False) -> list[int]:
        """Free the slots no committed step here references any more (see
        :meth:`~tiered_ckpt.tiers.peer.memory.PeerMemory.collect_unreferenced`); the steps none is left of."""
        with self.memory.lock:
            return self.memory.collect_unreferenced(all_steps=all_steps)

    def holdings(self) -> dict[int, tuple[int, ...]]:
        """The committed steps held here, each with the ranks whose shards are held."""
        with self.memory.lock:
            return {step: tuple(sorted(self.memory.held(step))) for step in self.memory.steps()}

    def held_ranks(self, step: int, manifest: ShardManifest) -> tuple[int, ...]:
        """The ranks of ``manifest`` whose shards of ``step`` this process holds (its wards'): a
        tier each process holds a part of, as a node's disk is."""
        with self.memory.lock:
            held = self.memory.held(step)
        return tuple(record.rank for record in manifest.shards if record.rank in held)

    def shard_location(self, step: int, record: ShardRecord) -> str:
        """Where ``record``'s copy is: the memory of the rank holding it."""
        return f"peer://rank-{self.partners.partner[record.rank]}/step-{step}/{record.path}"

    def manifest(self, step: int) -> ShardManifest:
        """The manifest of ``step`` as a restore fetched it, or as held here; validated."""
        with self._lock:
            fetched = self._manifests.get(step)
        if fetched is not None:
            return fetched
        with self.memory.lock:
            text = self.memory.manifest_text(step)
        return _parse_manifest(text, step, f"{self.memory.root}: step {step}'s manifest")

    # -- reading -------------------------------------------------------------------------------

    def _copy(self, step: int, record: ShardRecord) -> memoryview:
        """The copy of ``record``'s shard fetched or held here: a whole map of its file where it is
        one (:func:`~tiered_ckpt.io.pages.whole_map`: a reader may let its pages go)."""
        with self._lock:
            fetched = self._received.get((step, record.rank))
        if fetched is not None:
            return fetched
        try:
            with self.memory.lock:
                held = self.memory.view(step, record.rank)
            mapped = file_map(held)  # a private map of its slot, read only
            return memoryview(mapped) if mapped is not None else held.data
        except CheckpointError:
            raise IncompleteCheckpointError(
                f"{self.shard_location(step, record)}: no copy of rank {record.rank}'s shard reached this rank"
            ) from None

    def copy_in_memory(self, step: int, record: ShardRecord) -> memoryview | None:
        """The bytes of ``record``'s copy, if this rank has them in memory (fetched or held), not yet
        verified: a reader may verify and parse them there rather than stream them (None: none)."""
        try:
            return self._copy(step, record)
        except IncompleteCheckpointError:
            return None

    def open_shard(self, step: int, record: ShardRecord, consume: Callable[[BinaryIO], T]) -> T:
        """Stream the copy of ``record``'s shard that reached this rank (at most its size + 1 bytes)."""
        data = self._copy(step, record)
        return consume(_Reader(data[: record.size_bytes + 1]))  # type: ignore[arg-type]

    def read_range_into(
        self, step: int, record: ShardRecord, offset: int, buffer: memoryview, verify: Verify = "full"
    ) -> str:
        raise UsageError("the peer tier serves whole shards only (capabilities.ranged_reads is False)")

    def check_shard(self, step: int, record: ShardRecord) -> str | None:
        """Hash the copy of ``record``'s shard held or fetched here; the problem, or None if it matches."""
        where = self.shard_location(step, record)
        try:
            data = self._copy(step, record)
        except IncompleteCheckpointError as exc:
            return str(exc)
        if len(data) != record.size_bytes:
            return f"{where}: {len(data)} bytes, the manifest records {record.size_bytes}"
        digest = hashlib.sha256()
        for block in blocks_of(data, PIECE_BYTES, whole_map(data)):
            digest.update(block)
        if digest.hexdigest() != record.sha256:
            return f"{where}: its sha256 does not match the manifest"
        return None

    def finish_reads(self, step: int) -> None:
        """Drop what a restore fetched of ``step`` (the refills hold the copies they land)."""
        with self._lock:
            self._manifests.pop(step, None)
            for key in self._fetched_for.pop(step, set()):
                self._received.pop(key, None)

    # -- a save's copy -------------------------------------------------------------------------

    def land_shard(
        self, step: int, record: ShardRecord, source: ShardSource, *, deadline: float | None = None
    ) -> Landed:
        """Copy this rank's shard ``record`` of ``step`` to its partner and take the wards' copies
        (every process calls it at once; the link's timeout, not ``deadline``, bounds each round);
        what landed is the shard as it is, in the partner's memory. The earlier files the
        shard references (``source.referenced``) travel with it where the partner lacks them.

        Raises :class:`PeerError` if the partner did not keep a matching copy
        (:class:`MemoryBudgetError` if its memory refused it; ``transient=False`` if the link
        failed); the wards' copies are kept or not whatever happens to this rank's own.
        """
        if record.rank != self.rank:
            raise UsageError(f"rank {self.rank}'s peer tier sends its own shard only, not rank {record.rank}'s")
        self._copying = (step, source.path is not None)  # from the disk or not: one cadence, every rank
        files = []
        for each, file, where in ((step, record, source), *source.referenced):
            reading = _mapped(where, file)
            with reading as data:
                files.append(Outgoing(each, file, data, reading.map))
        copy_step(self._save_link, self.memory, files[0], self.partner, self.wards, files[1:])
        return Landed.as_is(record)

    def commit(self, manifest: ShardManifest, *, landed: Sequence[Landed] = (), deadline: float | None = None) -> None:
        """Commit ``manifest``'s step here: every ward's shard of it, and every earlier file the shard
        references, must be held and match its record (a rank holding no ward's shard keeps
        nothing of the step; ``landed`` says nothing more). The files referenced are kept while
        the step is."""
        step = manifest.step
        if not self.wards:
            return
        with self.memory.lock:
            referenced = set()
            for ward in self.wards:
                record = manifest.shard(ward)
                for each, file in ((step, record), *((ref.step, ref.file) for ref in record.references)):
                    if not self.memory.holds(each, file.rank, file.size_bytes, file.sha256):
                        what = "copy" if each == step else f"file of step {each} that its shard references"
                        raise PeerError(
                            f"{self.memory.root}: step {step}: rank {ward}'s {what} is not held as recorded"
                        )
                    if each != step:
                        referenced.add((each, file.rank))
            self.memory.commit(step, manifest.to_json(), on_disk=self._copying == (step, True), referenced=referenced)

    def delete_step(self, step: int) -> None:
        """Forget ``step`` here: its manifest first, then its slots (kept for later steps)."""
        with self.memory.lock:
            self.memory.delete_step(step)

    # -- a restore's copies ----------------------------------------------------------------------

    def prepare_reads(self, step: int, ranks: Sequence[int], gather: Gather, *, repairs: bool, elsewhere: bool) -> bool:
        """Fetch from the processes holding them in memory the shards of ``step`` of this process's
        ``ranks`` (those it lacks on disk, or, ``repairs``, whose disk copy failed), for the
        store's chain to read and verify (a collective: the processes agree through ``gather``
        who sends what). A copy that does not arrive leaves the next tier to read. True if some
        process fetched some copy (the same on every process)."""
        label = "restore: repairs" if repairs else "restore: partners"
        plans = gather(label, _PartnerPlan, lambda: _PartnerPlan(tuple(ranks), self.holdings().get(step, ())))
        transfers = []
        for needer, wanted in enumerate(plans):
            for rank in wanted.needs:
                holder = next((each for each, other in enumerate(plans) if rank in other.held), None)
                if holder is not None and holder != needer:
                    transfers.append((holder, needer, rank))
        if not transfers:
            return False
        # A copy of a step no disk of this node holds, nor the bucket, exists only while its holder lives
        only_there = not elsewhere and not repairs
        for rank in self._fetch(step, transfers):
            holder = next(h for h, _n, r in transfers if r == rank)
            level = logging.WARNING if only_there else logging.INFO
            logger.log(
                level,
                "restore of step %d: rank %d's shard came from rank %d's memory%s",
                step,
                rank,
                holder,
                " (on no disk of this node, not in the bucket: only while that partner lived)" if only_there else "",
            )
        return True

    def _fetch(self, step: int, transfers: Sequence[Transfer]) -> list[int]:
        """Send and receive the copies of ``step`` that ``transfers`` name (every process calls it at
        once, with the same list); return the ranks whose shards reached this rank, each with a
        manifest that validates (the shards themselves are verified when the store reads them).
        Never raises: a copy that does not arrive is logged, and the next tier is read instead."""
        referenced: dict[int, list[int]] = {}
        for holder, _needer, shard in transfers:
            if holder == self.rank:
                try:
                    record = self.manifest(step).shard(shard)
                except CheckpointError:  # not held after all: the copy says so
                    continue
                referenced[shard] = [ref.step for ref in record.references]
        try:
            arrived = fetch(self._restore_link, self.memory, step, self.rank, transfers, self._spool, referenced)
        except Exception:  # a bug or a failing memory file system must not stop a restore the bucket can serve
            logger.warning("restore of step %d: fetching the partners' copies failed", step, exc_info=True)
            return []
        ranks = []
        for shard, copy in arrived.items():
            holder = next(h for h, _n, r in transfers if r == shard)
            try:
                fetched = _parse_manifest(copy.manifest, step, f"rank {holder}'s memory: step {step}'s manifest")
            except ManifestError as exc:
                logger.warning("restore of step %d: %s", step, exc)
                continue
            files = {(step, shard): copy.data, **{(each, shard): data for each, data in copy.referenced.items()}}
            with self._lock:
                self._manifests.setdefault(step, fetched)
                self._received.update(files)
                self._fetched_for.setdefault(step, set()).update(files)
            ranks.append(shard)
        return ranks


@dataclass(frozen=True)
class _PartnerPlan:
    """One process's part of fetching from partners: the ranks it lacks on disk, and the ranks it holds in memory."""

    needs: tuple[int, ...]
    held: tuple[int, ...]


def _parse_manifest(text: bytes, step: int, source: str) -> ShardManifest:
    manifest = ShardManifest.from_json(text, source=source)
    if manifest.step != step:
        raise ManifestError(f"{source}: field 'step' is {manifest.step}, not {step}")
    return manifest


class _Reader(io.RawIOBase):
    """A read-only stream over a buffer in memory, without a copy of it (``io.BytesIO`` makes one)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view, self._offset = view, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        count = min(len(buffer), len(self._view) - self._offset)
        buffer[:count] = self._view[self._offset : self._offset + count]
        self._offset += count
        return count


class _mapped:
    """``source``'s bytes as a uint8 array for the time of a ``with`` block: a private map of its
    file (no copy), its bytes in memory, or what its writer produces; or, if they cannot be read,
    the exception (the copy then tells the partner there is nothing to send).

    ``map``: the map of a file the array is, whose pages the copy lets go as it sends them:
    the shard's file, or the file a step kept in memory only was serialized to past the host
    memory budget (:func:`~tiered_ckpt.engine.shards.serialize_shards` hands over a whole map
    of it); None for bytes in memory."""

    def __init__(self, source: ShardSource, record: ShardRecord) -> None:
        self._source, self._record = source, record
        self.map: mmap.mmap | None = None

    def __enter__(self) -> np.ndarray | BaseException:
        try:
            return self._read()
        except Exception as exc:  # a shard gone or short on disk, a writer failing
            logger.warning("peer copy: rank %d's own shard cannot be read: %s", self._record.rank, exc)
            return exc

    def _read(self) -> np.ndarray:
        size, source = self._record.size_bytes, self._source
        if source.data is not None:  # a send reads a writable buffer: only bytes are copied, once
            data = source.data
            if isinstance(data, memoryview):
                self.map = whole_map(data)
            return np.frombuffer(bytearray(data) if isinstance(data, bytes) else data, np.uint8)
        if source.path is not None and size:
            try:
                with open(Path(source.path), "rb") as file:
                    mapped = mmap.mmap(file.fileno(), size, access=mmap.ACCESS_COPY)
            except FileNotFoundError:
                if source.write is None:
                    raise  # else moved since (an earlier step's file, kept for later steps): its writer finds it
            else:
                self.map = mapped
                return np.frombuffer(mapped, np.uint8, count=size)
        if source.write is not None:
            out = io.BytesIO()
            source.write(out)
            return np.frombuffer(bytearray(out.getbuffer()), np.uint8)
        return np.zeros(0, np.uint8)

    def __exit__(self, *exc: object) -> None:
        return None
