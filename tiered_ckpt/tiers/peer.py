"""The peer tier: each rank's committed shards also held in the memory of a partner rank on another node.

A :class:`PeerTier` is one process's side of it, with one process per rank: it sends this
rank's shards to its partner (chosen by :func:`~tiered_ckpt.dist.partners.choose_partners`)
and holds its wards' shards in a :class:`~tiered_ckpt.tiers.peer_memory.PeerMemory`. Copies
travel over :class:`~tiered_ckpt.dist.peer_link.PeerLink` s of its own: one for saves (the
replicator's thread), one for restores (the caller's).

A save's copy, inside :meth:`PeerTier.land_shard`, which every process calls for its own
rank at once (the replicator's processes work on the same step together); four rounds,
each rank playing both parts (sender to its partner, holder of its wards):

1. *offer*: the step, the shard's size and its sha256 go to the partner;
2. *answer*: the partner says whether its memory takes it (the budget, ``max_bytes``);
3. *bytes*: the shard goes straight from the local file into the partner's slot;
4. *check*: the partner hashes what it received and answers whether it matches; only a
   copy that matches is kept.

:meth:`PeerTier.commit` then writes the manifest next to the wards' slots. A restore
gets, for a chosen step, the shards its rank lacks on disk from whichever process holds
them (:meth:`PeerTier.fetch`, after the restorer agreed who sends what), and reads
them through the store's chain like any later tier's (own disk -> partner's memory ->
bucket): the store lands them on disk only if they verify.

A partner that died, hangs or sent bytes that do not verify fails only the copy (a
:class:`~tiered_ckpt.PeerError`): the replicator logs it and the step is not in this
tier; a link that timed out stays broken for the run (see
:class:`~tiered_ckpt.dist.peer_link.PeerLink`).
"""

from __future__ import annotations

import io
import logging
import mmap
import struct
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import numpy as np

from tiered_ckpt.dist.partners import Partners
from tiered_ckpt.dist.peer_link import PeerLink
from tiered_ckpt.errors import (
    CheckpointError,
    IncompleteCheckpointError,
    ManifestError,
    MemoryBudgetError,
    PeerError,
    UsageError,
)
from tiered_ckpt.format.manifest import ShardManifest, ShardRecord
from tiered_ckpt.io.hashing import Verify
from tiered_ckpt.tiers.base import Capabilities, ShardSource
from tiered_ckpt.tiers.peer_memory import PeerMemory, Slot, sha256_of

__all__ = ["PeerTier", "Transfer"]

logger = logging.getLogger("tiered_ckpt")

T = TypeVar("T")
_OFFER = struct.Struct("<qq32s")  # step, size, sha256
_SIZES = struct.Struct("<qq")  # manifest bytes, shard bytes (-1: not held after all)
Transfer = tuple[int, int, int]
"""One copy of a restore: (the rank that sends it, the rank that receives it, the shard's rank)."""


class PeerTier:
    """This process's side of the peer tier (see the module doc), for rank ``rank`` of ``partners``."""

    name = "peer"

    def __init__(
        self, memory: PeerMemory, partners: Partners, rank: int, save_link: PeerLink, restore_link: PeerLink
    ) -> None:
        if partners.holder[rank] is None:
            raise UsageError(f"rank {rank} has no partner on another node: the peer tier protects nothing")
        self.memory = memory
        self.partners = partners
        self.rank = rank
        self.partner: int = partners.holder[rank]  # type: ignore[assignment]  # checked above
        self.wards = partners.wards(rank)
        self.url = f"peer://rank-{self.partner}"
        self.capabilities = Capabilities(
            durable=False, shared=False, create_only_commit=False, store_checksums=False, ranged_reads=False
        )
        self._save_link = save_link
        self._restore_link = restore_link
        self._received: dict[tuple[int, int], np.ndarray] = {}  # (step, rank) -> bytes fetched for a restore
        self._manifests: dict[int, ShardManifest] = {}  # manifests fetched for a restore
        self._copying: tuple[int, bool] | None = None  # the step being copied, and whether from the disk
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"PeerTier(rank={self.rank}, partner={self.partner}, wards={list(self.wards)})"

    # -- what is held ----------------------------------------------------------------------

    def steps(self) -> list[int]:
        with self._lock:
            return self.memory.steps()

    def uncommitted_steps(self) -> list[int]:
        with self._lock:
            return self.memory.uncommitted_steps()

    def list_steps(self) -> tuple[list[int], list[int]]:
        with self._lock:
            return self.memory.steps(), self.memory.uncommitted_steps()

    def holdings(self) -> dict[int, tuple[int, ...]]:
        """The committed steps held here, each with the ranks whose shards are held."""
        with self._lock:
            return {step: tuple(sorted(self.memory.held(step))) for step in self.memory.steps()}

    def held_ranks(self, step: int, manifest: ShardManifest) -> tuple[int, ...]:
        """The ranks of ``manifest`` whose shards of ``step`` this process holds (its wards'): a
        tier each process holds a part of, as a node's disk is."""
        with self._lock:
            held = self.memory.held(step)
        return tuple(record.rank for record in manifest.shards if record.rank in held)

    def shard_location(self, step: int, record: ShardRecord) -> str:
        holder = self.partners.holder[record.rank]
        return f"peer://rank-{holder}/step-{step}/{record.path}"

    def manifest(self, step: int) -> ShardManifest:
        """The manifest of ``step`` as a restore fetched it, or as held here; validated."""
        with self._lock:
            fetched = self._manifests.get(step)
            if fetched is not None:
                return fetched
            text = self.memory.manifest_text(step)
        return _parse_manifest(text, step, f"{self.memory.root}: step {step}'s manifest")

    # -- reading -------------------------------------------------------------------------------

    def _copy(self, step: int, record: ShardRecord) -> np.ndarray:
        with self._lock:
            fetched = self._received.get((step, record.rank))
            if fetched is not None:
                return fetched
            try:
                return self.memory.view(step, record.rank)
            except CheckpointError:
                raise IncompleteCheckpointError(
                    f"{self.shard_location(step, record)}: no copy of rank {record.rank}'s shard reached this rank"
                ) from None

    def open_shard(self, step: int, record: ShardRecord, consume: Callable[[BinaryIO], T]) -> T:
        data = self._copy(step, record)
        return consume(io.BytesIO(data.data[: record.size_bytes + 1]))

    def read_range_into(
        self, step: int, record: ShardRecord, offset: int, buffer: memoryview, verify: Verify = "full"
    ) -> str:
        raise UsageError("the peer tier serves whole shards only (capabilities.ranged_reads is False)")

    def check_shard(self, step: int, record: ShardRecord) -> str | None:
        where = self.shard_location(step, record)
        try:
            data = self._copy(step, record)
        except IncompleteCheckpointError as exc:
            return str(exc)
        if data.size != record.size_bytes:
            return f"{where}: {data.size} bytes, the manifest records {record.size_bytes}"
        if sha256_of(data) != record.sha256:
            return f"{where}: its sha256 does not match the manifest"
        return None

    def forget(self, step: int) -> None:
        """Drop what a restore fetched of ``step``."""
        with self._lock:
            self._manifests.pop(step, None)
            for key in [key for key in self._received if key[0] == step]:
                del self._received[key]

    # -- a save's copy -------------------------------------------------------------------------

    def land_shard(self, step: int, record: ShardRecord, source: ShardSource, *, deadline: float | None = None) -> None:
        """Copy this rank's shard ``record`` of ``step`` to its partner, and take the wards' copies
        (the four rounds of the module doc; every process calls it at once).

        Raises :class:`PeerError` if the partner did not keep a matching copy
        (:class:`MemoryBudgetError` if its memory refused it); the wards' copies are kept
        or not whatever happens to this rank's own.
        """
        del deadline  # the link's timeout bounds every round
        if record.rank != self.rank:
            raise UsageError(f"rank {self.rank}'s peer tier sends its own shard only, not rank {record.rank}'s")
        link = self._save_link
        with self._lock:
            self._copying = (step, source.path is not None)  # from the disk or not: one cadence, every rank
        offer = np.frombuffer(bytearray(_OFFER.pack(step, record.size_bytes, bytes.fromhex(record.sha256))), np.uint8)
        offers = {ward: np.zeros(_OFFER.size, np.uint8) for ward in self.wards}
        link.exchange([(self.partner, offer)], list(offers.items()))
        answers, slots = {}, {}
        for ward, raw in offers.items():
            ward_step, size, digest = _OFFER.unpack(raw.tobytes())
            answers[ward] = np.zeros(1, np.uint8)
            if ward_step != step:
                logger.error("peer copy of step %d: rank %d offered step %d instead", step, ward, ward_step)
                continue
            try:
                with self._lock:
                    slots[ward] = (*self.memory.buffer_for(step, ward, size), size, digest.hex())
                answers[ward][0] = 1
            except (MemoryBudgetError, OSError) as exc:
                logger.warning("peer copy of step %d: not holding rank %d's shard: %s", step, ward, exc)
        answer = np.zeros(1, np.uint8)
        link.exchange(list(answers.items()), [(self.partner, answer)])
        with _mapped(source, record) as data:
            sends = [(self.partner, data)] if answer[0] else []
            link.exchange(sends, [(ward, buffer) for ward, (_n, buffer, _s, _d) in slots.items()])
        checks = {}
        for ward, (number, buffer, size, digest) in slots.items():
            matches = sha256_of(buffer) == digest
            checks[ward] = np.array([1 if matches else 0], np.uint8)
            with self._lock:
                if matches:
                    self.memory.accept(number, Slot(step, ward, size, digest))
                else:
                    logger.warning("peer copy of step %d: rank %d's shard arrived changed; not kept", step, ward)
                    self.memory.release(number)
        check = np.zeros(1, np.uint8)
        link.exchange(list(checks.items()), [(self.partner, check)] if answer[0] else [])
        where = f"rank {self.partner}'s memory (step {step}, rank {self.rank}'s shard)"
        if not answer[0]:
            raise MemoryBudgetError(
                f"{where}: the partner refused the copy (its peer.max_bytes, or an error it logged)"
            )
        if not check[0]:
            raise PeerError(f"{where}: the bytes the partner received did not match their sha256; not kept")

    def commit(self, manifest: ShardManifest, *, deadline: float | None = None) -> None:
        """Commit ``manifest``'s step here: every ward's shard of it must be held and match its record."""
        del deadline
        step = manifest.step
        with self._lock:
            held = self.memory.held(step)
            for ward in self.wards:
                record, slot = manifest.shard(ward), held.get(ward)
                if slot is None or slot.size != record.size_bytes or slot.sha256 != record.sha256:
                    raise PeerError(f"{self.memory.root}: step {step}: rank {ward}'s copy is not held as recorded")
            self.memory.commit(step, manifest.to_json(), on_disk=self._copying == (step, True))

    def delete_step(self, step: int) -> None:
        with self._lock:
            self.memory.delete_step(step)

    # -- a restore's copies ----------------------------------------------------------------------

    def fetch(self, step: int, transfers: Sequence[Transfer]) -> list[int]:
        """Send and receive the copies of ``step`` that ``transfers`` name (every process calls it at
        once, with the same list); return the ranks whose shards reached this rank.

        Each copy comes with the step's manifest. A copy that does not arrive (the holder died
        or hangs, within the link's timeout) is logged, not raised: the restore then reads
        that shard from the next tier.
        """
        sends = [(needer, rank) for holder, needer, rank in transfers if holder == self.rank]
        receives = [(holder, rank) for holder, needer, rank in transfers if needer == self.rank]
        link = self._restore_link
        try:
            outgoing = [self._outgoing(step, rank) for _needer, rank in sends]
            sizes = {(holder, rank): np.zeros(_SIZES.size, np.uint8) for holder, rank in receives}
            link.exchange(
                [(needer, header) for (needer, _rank), (header, _m, _d) in zip(sends, outgoing, strict=True)],
                [(holder, buffer) for (holder, _rank), buffer in sizes.items()],
            )
            incoming = {}
            for (holder, rank), raw in sizes.items():
                manifest_bytes, shard_bytes = _SIZES.unpack(raw.tobytes())
                if manifest_bytes < 0 or shard_bytes < 0 or manifest_bytes > 64 << 20:
                    continue
                incoming[(holder, rank)] = (np.empty(manifest_bytes, np.uint8), np.empty(shard_bytes, np.uint8))
            payload = []
            for (needer, _rank), (_header, manifest, data) in zip(sends, outgoing, strict=True):
                if manifest is not None:
                    payload += [(needer, manifest), (needer, data)]
            wanted = [(holder, part) for (holder, _rank), pair in incoming.items() for part in pair]
            link.exchange(payload, wanted)
        except PeerError as exc:
            logger.warning("restore of step %d: the partners' copies did not arrive: %s", step, exc)
            return []
        arrived = []
        for (holder, rank), (manifest_raw, data) in incoming.items():
            source = f"rank {holder}'s memory: step {step}'s manifest"
            try:
                fetched = _parse_manifest(manifest_raw.tobytes(), step, source)
            except ManifestError as exc:
                logger.warning("restore of step %d: %s", step, exc)
                continue
            with self._lock:
                self._manifests.setdefault(step, fetched)
                self._received[(step, rank)] = data
            arrived.append(rank)
        return arrived

    def _outgoing(self, step: int, rank: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """The header, manifest and bytes of ``rank``'s held shard of ``step`` (a header of -1s if gone)."""
        try:
            with self._lock:
                data = self.memory.view(step, rank)
                manifest = np.frombuffer(self.memory.manifest_text(step), np.uint8)
        except (CheckpointError, OSError) as exc:
            logger.warning("restore of step %d: cannot send rank %d's copy: %s", step, rank, exc)
            return np.frombuffer(bytearray(_SIZES.pack(-1, -1)), np.uint8), None, np.zeros(0, np.uint8)
        header = np.frombuffer(bytearray(_SIZES.pack(manifest.size, data.size)), np.uint8)
        return header, manifest.copy(), data


def _parse_manifest(text: bytes, step: int, source: str) -> ShardManifest:
    manifest = ShardManifest.from_json(text, source=source)
    if manifest.step != step:
        raise ManifestError(f"{source}: field 'step' is {manifest.step}, not {step}")
    return manifest


class _mapped:
    """``source``'s bytes as a uint8 array: a private map of its file (no copy), or what its
    writer produces, for the time of a ``with`` block."""

    def __init__(self, source: ShardSource, record: ShardRecord) -> None:
        self._source, self._record = source, record
        self._map: mmap.mmap | None = None

    def __enter__(self) -> np.ndarray:
        size = self._record.size_bytes
        if self._source.data is not None:  # a send reads a writable buffer: bytes are copied once
            data = self._source.data
            return np.frombuffer(data if isinstance(data, bytearray) else bytearray(data), np.uint8)
        if self._source.path is not None and size:
            with open(Path(self._source.path), "rb") as file:
                self._map = mmap.mmap(file.fileno(), size, access=mmap.ACCESS_COPY)
            return np.frombuffer(self._map, np.uint8, count=size)
        if self._source.write is not None:
            out = io.BytesIO()
            self._source.write(out)
            return np.frombuffer(bytearray(out.getbuffer()), np.uint8)
        return np.zeros(0, np.uint8)

    def __exit__(self, *exc: Any) -> None:
        self._map = None  # the array's buffer keeps the map until it is collected
