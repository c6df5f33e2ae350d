"""The peer tier's two exchanges over a :class:`~tiered_ckpt.tiers.peer.link.PeerLink`.

:func:`copy_step`, a save's copy, which every process runs at once for its own rank, in
four rounds, each rank playing both parts (sender to its partner, holder of its wards):

1. *offer*: the step, the shard's size and its sha256 go to the partner (size -1: this rank
   could not read its own shard, and sends nothing), with the step, size and sha256 of each
   earlier file the shard references (an incremental save's, at most
   :data:`~tiered_ckpt.format.manifest.MAX_REFERENCED_FILES`: the offer has a fixed size);
2. *answer*: the partner says, for each file, whether its memory takes it (its budget) or
   holds it already (a slot of that step and rank with that sha256, which it then keeps for
   the step: :meth:`~tiered_ckpt.tiers.peer.memory.PeerMemory.pin`); it takes all the files
   it lacks or none;
3. *bytes*: each file taken goes straight from the sender's buffer into the partner's slot, in
   pieces of at most :data:`PIECE_BYTES`, one exchange per piece (both sides know each
   copy's size from its offer, so their exchanges pair up); the partner hashes each piece
   as it lands, and each side lets a piece's pages go once it is through
   (:func:`~tiered_ckpt.io.pages.let_go`, for a shard sent from a map of its file and for
   the slot's map): neither process holds more than a piece of each copy in its resident
   memory, whatever the shard's size;
4. *check*: the partner compares the hash of each file it received with the offer and
   answers whether it matches; only a copy that matches is kept.

Whatever fails on one rank (its own shard unreadable, its memory full, bytes that do not
match) becomes an answer of the protocol, so every rank still runs every round and no
partner waits for a message that will not come; only the link itself failing (a partner
that died or hangs) cuts the rounds short. A slot handed out for a copy that is not kept
is freed.

:func:`fetch`, a restore's copies: the holders send each needed shard with the step's
manifest and the earlier files it references that they hold, in rounds (sizes, manifests,
then the bytes in pieces as a save's copy sends them, each piece's pages let go once sent);
what does not arrive is logged and left to the next tier. The needer receives each file into
a file with no name on its own disk (:func:`~tiered_ckpt.io.scratch.unnamed_map`: the disk
the restore refills), through a map whose pages it lets go once each piece is written: it
holds a piece of each file, whatever its size, and nothing is left behind if it dies.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tiered_ckpt.errors import MemoryBudgetError, PeerError, UsageError
from tiered_ckpt.format.manifest import MAX_REFERENCED_FILES, ShardRecord
from tiered_ckpt.io.fresh_memory import new_array
from tiered_ckpt.io.pages import let_go
from tiered_ckpt.io.scratch import unnamed_map
from tiered_ckpt.tiers.peer.link import SLOWEST_BYTES_PER_SECOND, PeerLink
from tiered_ckpt.tiers.peer.memory import PeerMemory, Slot, file_map

__all__ = ["PIECE_BYTES", "Fetched", "Outgoing", "Transfer", "copy_step", "fetch"]

logger = logging.getLogger("tiered_ckpt")

_FILES = 1 + MAX_REFERENCED_FILES  # the answers and checks of a copy: one per file, the shard's first
_SEND, _HELD = 1, 2  # an answer for a file (0: not taken)
_MAX_MANIFEST = 64 << 20
PIECE_BYTES = 8 << 20
"""The most bytes of a shard one message of a copy carries. A process sends a piece to its
partner while it receives one from its ward (the usual one), so it holds two pieces at
once: 16 MiB, half of the one staging slot a save may hold past ``runtime.host_memory_bytes``
(the rest is the write path's). A piece of 8 MiB takes milliseconds on any link a partner
is worth having on, against the tens of microseconds an exchange costs (gloo on loopback
moved 2.6-2.8 GB/s both ways in pieces of 4 to 64 MiB, 2.4 GB/s in one of 256 MiB)."""
Transfer = tuple[int, int, int]
"""One copy of a restore: (the rank that sends it, the rank that receives it, the shard's rank)."""


def _bytes(data: bytes) -> np.ndarray:
    return np.frombuffer(bytearray(data), np.uint8)


@dataclass(frozen=True)
class _Message:
    """A message of a fixed size, so that its receiver knows its length before it arrives: the
    fields of ``head``, its last one the number of rows that follow, then up to
    :data:`~tiered_ckpt.format.manifest.MAX_REFERENCED_FILES` rows of ``row``."""

    head: struct.Struct
    row: struct.Struct

    @property
    def size(self) -> int:
        return self.head.size + MAX_REFERENCED_FILES * self.row.size

    def pack(self, fields: tuple[Any, ...], rows: Sequence[tuple[Any, ...]]) -> np.ndarray:
        raw = bytearray(self.size)
        self.head.pack_into(raw, 0, *fields, len(rows))
        for index, row in enumerate(rows):
            self.row.pack_into(raw, self.head.size + index * self.row.size, *row)
        return np.frombuffer(raw, np.uint8)

    def unpack(self, raw: np.ndarray) -> tuple[tuple[Any, ...], list[tuple[Any, ...]] | None]:
        """The head's fields (but the count) and the rows; None for rows more than a message holds."""
        data = raw.tobytes()
        *fields, count = self.head.unpack_from(data)
        if not 0 <= count <= MAX_REFERENCED_FILES:
            return tuple(fields), None
        return tuple(fields), [self.row.unpack_from(data, self.head.size + i * self.row.size) for i in range(count)]


# A save's offer: the shard's step, size (-1: nothing to send) and sha256; each earlier file's
# step, size (-1: unreadable) and sha256.
_OFFER = _Message(struct.Struct("<qq32sq"), struct.Struct("<qq32s"))
# A restore's copy: the manifest's bytes, the shard's (-1: not held after all); each earlier
# file's step and bytes.
_SIZES = _Message(struct.Struct("<qqq"), struct.Struct("<qq"))


@dataclass(frozen=True)
class Outgoing:
    """One file a save's copy sends: ``record``'s shard of ``step`` (this rank's own, or an earlier
    file it references), its bytes or why they could not be read, and the map of a file the
    bytes are, from its first byte, whose pages are let go as they are sent (None: memory)."""

    step: int
    record: ShardRecord
    data: np.ndarray | BaseException
    mapped: mmap.mmap | None = None


def copy_step(
    link: PeerLink,
    memory: PeerMemory,
    own: Outgoing,
    partner: int,
    wards: Sequence[int],
    referenced: Sequence[Outgoing] = (),
) -> None:
    """Copy ``own`` (this rank's shard of its step, or why it could not be read) and the
    ``referenced`` earlier files it references that the partner lacks to ``partner``, and take
    the ``wards``' copies (see the module doc).

    Raises :class:`PeerError` if the partner did not keep a matching copy of every file
    (:class:`MemoryBudgetError` if its memory refused them, ``transient=False`` if the link
    failed); the wards' copies are kept or not whatever happens to this rank's own.
    """
    if len(referenced) > MAX_REFERENCED_FILES:
        raise UsageError(f"a shard references at most {MAX_REFERENCED_FILES} earlier files, not {len(referenced)}")
    step, record, files = own.step, own.record, (own, *referenced)
    offer = _offer(files)
    offers = {ward: np.zeros(_OFFER.size, np.uint8) for ward in wards}
    slots: dict[int, list[_Receiving]] = {}
    try:
        link.exchange([(partner, offer)], list(offers.items()))
        answers = {ward: _take(memory, step, ward, raw, slots) for ward, raw in offers.items()}
        answer = np.zeros(_FILES, np.uint8)
        link.exchange(list(answers.items()), [(partner, answer)])
        sends = [
            _Flow(partner, each.data, each.mapped)
            for each, said in zip(files, answer, strict=False)
            if said == _SEND and isinstance(each.data, np.ndarray)
        ]
        _stream(link, sends, [receiving.flow for taken in slots.values() for receiving in taken])
        checks = {ward: _keep(memory, answers[ward], taken) for ward, taken in slots.items()}
        slots.clear()  # each one kept or freed
        check = np.zeros(_FILES, np.uint8)
        link.exchange(list(checks.items()), [(partner, check)] if sends else [])
    finally:
        for taken in slots.values():
            with memory.lock:
                for receiving in taken:
                    memory.release(receiving.number)
    where = f"rank {partner}'s memory (step {step}, rank {record.rank}'s shard)"
    for each in files:
        if not isinstance(each.data, np.ndarray):
            what = "its own shard" if each is own else f"the file of step {each.step} its shard references"
            raise PeerError(f"{where}: this rank could not read {what}: {each.data}") from each.data
    if not answer[0]:
        raise MemoryBudgetError(f"{where}: the partner refused the copy (its peer.max_bytes, or an error it logged)")
    if sends and not all(check[: len(files)]):
        raise PeerError(f"{where}: the bytes the partner received did not match their sha256; not kept")


def _offer(files: Sequence[Outgoing]) -> np.ndarray:
    """Round 1: what this rank offers its partner (see the module doc)."""

    def described(each: Outgoing) -> tuple[int, int, bytes]:
        size = each.record.size_bytes if isinstance(each.data, np.ndarray) else -1
        return each.step, size, bytes.fromhex(each.record.sha256)

    own, *earlier = files
    return _OFFER.pack(described(own), [described(each) for each in earlier])


@dataclass
class _Flow:
    """One buffer moving to or from ``rank`` a piece at a time: ``mapped``, the map of a file it
    is from its first byte (None: memory of its own), whose pages are let go once each piece is
    through; ``hasher``, fed each piece received (None: not hashed here)."""

    rank: int
    buffer: np.ndarray
    mapped: mmap.mmap | None = None
    hasher: Any = None

    def piece(self, index: int) -> slice | None:
        """The ``index``-th piece of the buffer (the same on both sides of a copy), None past its end."""
        start = index * PIECE_BYTES
        return slice(start, min(start + PIECE_BYTES, self.buffer.size)) if start < self.buffer.size else None

    def through(self, piece: slice, received: bool) -> None:
        """``piece`` went through: hash it if it was received, and let its pages go."""
        if received and self.hasher is not None:
            self.hasher.update(self.buffer[piece])
        if self.mapped is not None and not let_go(self.mapped, piece.start, piece.stop):
            self.mapped = None  # the map keeps its pages: not asked again


def _stream(link: PeerLink, sends: Sequence[_Flow], receives: Sequence[_Flow]) -> None:
    """Move every buffer of ``sends`` and fill every buffer of ``receives`` a piece of each at a
    time, one exchange per piece (their sizes are known on both sides, so the exchanges of
    both pair up in order); each piece is then hashed and let go (:meth:`_Flow.through`).
    The whole transfer is bounded as one exchange of its bytes would be (the link's timeout
    plus the bytes sent, or received if more, at its slowest rate): a partner that answers
    slower than that counts as hung, however small each piece."""
    flows = (*sends, *receives)
    moved = max(sum(flow.buffer.size for flow in sends), sum(flow.buffer.size for flow in receives))
    deadline = time.monotonic() + link.timeout_seconds + moved / SLOWEST_BYTES_PER_SECOND
    rounds = max((-(-flow.buffer.size // PIECE_BYTES) for flow in flows), default=0)
    for index in range(rounds):
        out = [(flow, piece) for flow in sends if (piece := flow.piece(index)) is not None]
        into = [(flow, piece) for flow in receives if (piece := flow.piece(index)) is not None]
        link.exchange(
            [(flow.rank, flow.buffer[piece]) for flow, piece in out],
            [(flow.rank, flow.buffer[piece]) for flow, piece in into],
            deadline=deadline,
        )
        for flow, piece in into:
            flow.through(piece, received=True)
        for flow, piece in out:
            flow.through(piece, received=False)


@dataclass(frozen=True)
class _Receiving:
    """A ward's file on its way into a slot: the slot's number, what the ward offered, and the
    flow filling the slot's map (hashed as it arrives)."""

    number: int
    slot: Slot
    flow: _Flow


def _take(memory: PeerMemory, step: int, ward: int, raw: np.ndarray, slots: dict[int, list[_Receiving]]) -> np.ndarray:
    """Round 2 for one ward: a slot for each file of its offer this memory lacks (recorded in
    ``slots``), those it holds pinned, all or none; the answers to send."""
    answer = np.zeros(_FILES, np.uint8)
    (ward_step, size, digest), earlier = _OFFER.unpack(raw)
    if ward_step != step or size < 0 or earlier is None:
        if ward_step != step:
            logger.error("peer copy of step %d: rank %d offered step %d instead", step, ward, ward_step)
        return answer
    offered = [(step, size, digest), *earlier]
    if any(size < 0 for _step, size, _digest in offered):
        return answer  # the ward could not read a file: its copy fails whatever is taken
    taken: list[_Receiving] = []
    pinned: list[tuple[int, int]] = []
    try:
        with memory.lock:
            held = [
                index > 0 and memory.holds(each, ward, size, digest.hex())
                for index, (each, size, digest) in enumerate(offered)
            ]
            pinned = [(each, ward) for (each, _size, _digest), there in zip(offered, held, strict=True) if there]
            memory.pin(step, pinned)
            for index, (each, size, digest) in enumerate(offered):
                if held[index]:
                    answer[index] = _HELD
                    continue
                number, buffer = memory.buffer_for(each, ward, size)
                taken.append(
                    _Receiving(
                        number,
                        Slot(each, ward, size, digest.hex()),
                        _Flow(ward, buffer, file_map(buffer), hashlib.sha256()),
                    )
                )
                answer[index] = _SEND
    except Exception as exc:  # a full memory, a failing memory file system: the answer is no
        logger.warning("peer copy of step %d: not holding rank %d's shard: %s", step, ward, exc)
        with memory.lock:
            memory.unpin(step, pinned)
            for receiving in taken:
                memory.release(receiving.number)
        return np.zeros(_FILES, np.uint8)
    if taken:
        slots[ward] = taken
    return answer


def _keep(memory: PeerMemory, answer: np.ndarray, taken: Sequence[_Receiving]) -> np.ndarray:
    """Round 4 for one ward: keep each file taken if what arrived matches its offer; the checks
    to send (a file held already checks)."""
    check: np.ndarray = (answer == _HELD).astype(np.uint8)
    sent = iter(taken)
    for index in np.flatnonzero(answer == _SEND):
        receiving = next(sent)
        number, slot = receiving.number, receiving.slot
        try:
            with memory.lock:
                if receiving.flow.hasher.hexdigest() == slot.sha256:
                    memory.accept(number, slot)
                    check[index] = 1
                    continue
                logger.warning("peer copy of step %d: rank %d's shard arrived changed; not kept", slot.step, slot.rank)
                memory.release(number)
        except Exception as exc:  # the memory file system failed while the copy was recorded
            logger.warning("peer copy of step %d: rank %d's shard not kept: %s", slot.step, slot.rank, exc)
            with memory.lock:
                memory.release(number)
    return check


@dataclass(frozen=True)
class Fetched:
    """What a restore's copy brought of one shard, not yet verified: the step's manifest
    document, the shard's bytes, and those of the earlier files it references, by their step."""

    manifest: bytes
    data: memoryview
    referenced: dict[int, memoryview]


def fetch(
    link: PeerLink,
    memory: PeerMemory,
    step: int,
    rank: int,
    transfers: Sequence[Transfer],
    spool: Path,
    referenced: Mapping[int, Sequence[int]] | None = None,
) -> dict[int, Fetched]:
    """Send and receive the copies of ``step`` that ``transfers`` name (every process calls it at
    once, with the same list), each with the earlier files its shard references that its
    holder holds (``referenced``: by shard rank, their steps, for the shards this rank sends);
    return, by shard rank, what reached this rank (``rank``): the bytes, each a whole map of an
    unnamed file on ``spool``'s disk (see the module doc), whose pages a reader may let go
    (:func:`~tiered_ckpt.io.pages.blocks_of`), or memory where that disk had no room.

    A copy that does not arrive (its holder died or hangs, within the link's timeout, or no
    longer holds it) is logged, not raised: the restore reads that shard from the next tier.
    """
    referenced = referenced or {}
    sends = [(needer, shard) for holder, needer, shard in transfers if holder == rank]
    receives = [(holder, shard) for holder, needer, shard in transfers if needer == rank]
    outgoing = [_outgoing(memory, step, shard, referenced.get(shard, ())) for _needer, shard in sends]
    sizes = {(holder, shard): np.zeros(_SIZES.size, np.uint8) for holder, shard in receives}
    incoming: dict[tuple[int, int], tuple[np.ndarray, list[tuple[int, _Flow]]]] = {}
    try:
        link.exchange(
            [(needer, header) for (needer, _shard), (header, _m, _d) in zip(sends, outgoing, strict=True)],
            [(holder, buffer) for (holder, _shard), buffer in sizes.items()],
        )
        for (holder, shard), raw in sizes.items():
            (manifest_bytes, shard_bytes), earlier = _SIZES.unpack(raw)
            if 0 <= manifest_bytes <= _MAX_MANIFEST and shard_bytes >= 0 and earlier is not None:
                files = [(step, shard_bytes), *earlier]
                flows = [(each, _Flow(holder, *_room(spool, each, shard, max(size, 0)))) for each, size in files]
                incoming[holder, shard] = (np.empty(manifest_bytes, np.uint8), flows)
        served = []
        for (needer, _shard), (_header, manifest, data) in zip(sends, outgoing, strict=True):
            if manifest is not None:
                served.append((needer, manifest, data))
        link.exchange(
            [(needer, manifest) for needer, manifest, _data in served],
            [(holder, manifest) for (holder, _shard), (manifest, _flows) in incoming.items()],
        )
        _stream(
            link,
            [_Flow(needer, each, file_map(each)) for needer, _manifest, data in served for each in data],
            [flow for _manifest, flows in incoming.values() for _step, flow in flows],
        )
    except PeerError as exc:
        logger.warning("restore of step %d: the partners' copies did not arrive: %s", step, exc)
        return {}
    return {
        shard: Fetched(
            manifest.tobytes(),
            _received(flows[0][1]),
            {each: _received(flow) for each, flow in flows[1:]},
        )
        for (_holder, shard), (manifest, flows) in incoming.items()
    }


def _received(flow: _Flow) -> memoryview:
    return memoryview(flow.mapped) if flow.mapped is not None else flow.buffer.data


def _room(spool: Path, step: int, shard: int, size: int) -> tuple[np.ndarray, mmap.mmap | None]:
    """Where ``shard``'s fetched copy of ``size`` bytes is received, and the map it is (None: memory):
    a map of an unnamed file on ``spool``'s disk; memory, past the host memory budget, if that
    disk has no room for it (logged), rather than leave a copy the restore may need unread."""
    if size == 0:
        return np.zeros(0, np.uint8), None
    try:
        mapped = unnamed_map(spool, size)
    except OSError as exc:
        logger.warning(
            "restore of step %d: rank %d's copy (%d bytes) is received into memory, past"
            " runtime.host_memory_bytes: no room for it on %s: %s",
            step,
            shard,
            size,
            spool,
            exc,
        )
        return new_array((size,), np.uint8), None
    return np.frombuffer(mapped, np.uint8), mapped


def _outgoing(
    memory: PeerMemory, step: int, shard: int, referenced: Sequence[int] = ()
) -> tuple[np.ndarray, np.ndarray | None, list[np.ndarray]]:
    """The header, manifest and bytes (the shard's, then each earlier file of ``referenced``
    this memory holds) of ``shard``'s held copy of ``step`` (a header of -1s if gone)."""
    try:
        with memory.lock:
            data = [memory.view(step, shard)]
            manifest = _bytes(memory.manifest_text(step))
            held = [each for each in referenced if shard in memory.held(each)][:MAX_REFERENCED_FILES]
            data += [memory.view(each, shard) for each in held]
    except Exception as exc:  # gone, or its memory file unreadable: the needer reads the next tier
        logger.warning("restore of step %d: cannot send rank %d's copy: %s", step, shard, exc)
        return _SIZES.pack((-1, -1), []), None, []
    sizes = [(each, part.size) for each, part in zip(held, data[1:], strict=True)]
    return _SIZES.pack((manifest.size, data[0].size), sizes), manifest, data
