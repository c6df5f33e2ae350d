"""The peer tier's two exchanges over a :class:`~tiered_ckpt.tiers.peer.link.PeerLink`.

:func:`copy_step`, a save's copy, which every process runs at once for its own rank, in
four rounds, each rank playing both parts (sender to its partner, holder of its wards):

1. *offer*: the step, the shard's size and its sha256 go to the partner (size -1: this rank
   could not read its own shard, and sends nothing);
2. *answer*: the partner says whether its memory takes the shard (its budget);
3. *bytes*: the shard goes straight from the sender's buffer into the partner's slot, in
   pieces of at most :data:`PIECE_BYTES`, one exchange per piece (both sides know each
   copy's size from its offer, so their exchanges pair up); the partner hashes each piece
   as it lands, and each side lets a piece's pages go once it is through
   (:func:`~tiered_ckpt.io.pages.let_go`, for a shard sent from a map of its file and for
   the slot's map): neither process holds more than a piece of the shard in its resident
   memory, whatever its size;
4. *check*: the partner compares the hash of what it received with the offer and answers
   whether it matches; only a copy that matches is kept.

Whatever fails on one rank (its own shard unreadable, its memory full, bytes that do not
match) becomes an answer of the protocol, so every rank still runs every round and no
partner waits for a message that will not come; only the link itself failing (a partner
that died or hangs) cuts the rounds short. A slot handed out for a copy that is not kept
is freed.

:func:`fetch`, a restore's copies: the holders send each needed shard with the step's
manifest, in two rounds (sizes, then bytes); what does not arrive is logged and left to
the next tier.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tiered_ckpt.errors import MemoryBudgetError, PeerError
from tiered_ckpt.format.manifest import ShardRecord
from tiered_ckpt.io.fresh_memory import new_array
from tiered_ckpt.io.pages import let_go
from tiered_ckpt.tiers.peer.link import PeerLink
from tiered_ckpt.tiers.peer.memory import PeerMemory, Slot, file_map

__all__ = ["PIECE_BYTES", "Transfer", "copy_step", "fetch"]

logger = logging.getLogger("tiered_ckpt")

_OFFER = struct.Struct("<qq32s")  # step, size (-1: nothing to send), sha256
_SIZES = struct.Struct("<qq")  # manifest bytes, shard bytes (-1: not held after all)
_MAX_MANIFEST = 64 << 20
PIECE_BYTES = 8 << 20
"""The most bytes of a shard one message of a copy carries. A process sends a piece to its
partner while it receives one from a ward, so a copy holds two pieces at once: 16 MiB, half
of the one staging slot a save may hold past ``runtime.host_memory_bytes`` (the rest is the
write path's). A piece of 8 MiB takes milliseconds on any link a partner is worth having on,
against the tens of microseconds an exchange costs."""
Transfer = tuple[int, int, int]
"""One copy of a restore: (the rank that sends it, the rank that receives it, the shard's rank)."""


def _bytes(data: bytes) -> np.ndarray:
    return np.frombuffer(bytearray(data), np.uint8)


def copy_step(
    link: PeerLink,
    memory: PeerMemory,
    step: int,
    record: ShardRecord,
    data: np.ndarray | BaseException,
    partner: int,
    wards: Sequence[int],
    *,
    mapped: mmap.mmap | None = None,
) -> None:
    """Copy ``data`` (this rank's shard ``record`` of ``step``, or why it could not be read) to
    ``partner`` and take the ``wards``' copies (see the module doc). ``mapped``: the map of a
    file that ``data`` is, from its first byte, whose pages are let go as they are sent.

    Raises :class:`PeerError` if the partner did not keep a matching copy
    (:class:`MemoryBudgetError` if its memory refused it, ``transient=False`` if the link
    failed); the wards' copies are kept or not whatever happens to this rank's own.
    """
    readable = isinstance(data, np.ndarray)
    size = record.size_bytes if readable else -1
    offer = _bytes(_OFFER.pack(step, size, bytes.fromhex(record.sha256)))
    offers = {ward: np.zeros(_OFFER.size, np.uint8) for ward in wards}
    slots: dict[int, _Receiving] = {}
    try:
        link.exchange([(partner, offer)], list(offers.items()))
        answers = {ward: _take(memory, step, ward, raw, slots) for ward, raw in offers.items()}
        answer = np.zeros(1, np.uint8)
        link.exchange(list(answers.items()), [(partner, answer)])
        _move(link, partner, data if answer[0] and isinstance(data, np.ndarray) else None, mapped, slots)
        checks = {ward: _keep(memory, receiving) for ward, receiving in slots.items()}
        slots.clear()  # each one kept or freed
        check = np.zeros(1, np.uint8)
        link.exchange(list(checks.items()), [(partner, check)] if answer[0] else [])
    finally:
        for receiving in slots.values():
            with memory.lock:
                memory.release(receiving.number)
    where = f"rank {partner}'s memory (step {step}, rank {record.rank}'s shard)"
    if not isinstance(data, np.ndarray):
        raise PeerError(f"{where}: this rank could not read its own shard: {data}") from data
    if not answer[0]:
        raise MemoryBudgetError(f"{where}: the partner refused the copy (its peer.max_bytes, or an error it logged)")
    if not check[0]:
        raise PeerError(f"{where}: the bytes the partner received did not match their sha256; not kept")


@dataclass
class _Receiving:
    """A ward's copy on its way into a slot: the slot's number and writable map, what the ward
    offered, and the hash of the bytes received so far."""

    number: int
    buffer: np.ndarray
    slot: Slot
    hasher: Any = field(default_factory=hashlib.sha256)


def _pieces(size: int) -> list[slice]:
    """The pieces a copy of ``size`` bytes travels in, in order (the same on both sides)."""
    return [slice(start, min(start + PIECE_BYTES, size)) for start in range(0, size, PIECE_BYTES)]


def _move(
    link: PeerLink, partner: int, data: np.ndarray | None, mapped: mmap.mmap | None, slots: Mapping[int, _Receiving]
) -> None:
    """Round 3: ``data`` (None: nothing) to ``partner`` and the wards' bytes into their slots, a
    piece of each at a time, one exchange per piece; each piece received is hashed, and each
    piece sent from ``mapped`` or received into a slot's map is let go (see the module doc)."""
    sends = _pieces(data.size) if data is not None else []
    receives = {ward: _pieces(receiving.slot.size) for ward, receiving in slots.items()}
    maps = {ward: file_map(receiving.buffer) for ward, receiving in slots.items()}
    for index in range(max([len(sends), *map(len, receives.values())])):
        piece = sends[index] if index < len(sends) else None
        arriving = {ward: pieces[index] for ward, pieces in receives.items() if index < len(pieces)}
        link.exchange(
            [(partner, data[piece])] if data is not None and piece is not None else [],
            [(ward, slots[ward].buffer[part]) for ward, part in arriving.items()],
        )
        for ward, part in arriving.items():
            slots[ward].hasher.update(slots[ward].buffer[part])
            into = maps[ward]
            if into is not None and not let_go(into, part.start, part.stop):
                maps[ward] = None
        if mapped is not None and piece is not None and not let_go(mapped, piece.start, piece.stop):
            mapped = None


def _take(memory: PeerMemory, step: int, ward: int, raw: np.ndarray, slots: dict[int, _Receiving]) -> np.ndarray:
    """Round 2 for one ward: a slot for its offer (recorded in ``slots``), and the answer to send."""
    ward_step, size, digest = _OFFER.unpack(raw.tobytes())
    if ward_step != step or size < 0:
        if ward_step != step:
            logger.error("peer copy of step %d: rank %d offered step %d instead", step, ward, ward_step)
        return np.zeros(1, np.uint8)
    try:
        with memory.lock:
            number, buffer = memory.buffer_for(step, ward, size)
    except Exception as exc:  # a full memory, a failing memory file system: the answer is no
        logger.warning("peer copy of step %d: not holding rank %d's shard: %s", step, ward, exc)
        return np.zeros(1, np.uint8)
    slots[ward] = _Receiving(number, buffer, Slot(step, ward, size, digest.hex()))
    return np.ones(1, np.uint8)


def _keep(memory: PeerMemory, receiving: _Receiving) -> np.ndarray:
    """Round 4 for one ward: keep its copy if what arrived matches its offer; the answer to send."""
    number, slot = receiving.number, receiving.slot
    try:
        with memory.lock:
            if receiving.hasher.hexdigest() == slot.sha256:
                memory.accept(number, slot)
                return np.ones(1, np.uint8)
            logger.warning("peer copy of step %d: rank %d's shard arrived changed; not kept", slot.step, slot.rank)
            memory.release(number)
    except Exception as exc:  # the memory file system failed while the copy was recorded
        logger.warning("peer copy of step %d: rank %d's shard not kept: %s", slot.step, slot.rank, exc)
        with memory.lock:
            memory.release(number)
    return np.zeros(1, np.uint8)


def fetch(
    link: PeerLink, memory: PeerMemory, step: int, rank: int, transfers: Sequence[Transfer]
) -> dict[int, tuple[bytes, np.ndarray]]:
    """Send and receive the copies of ``step`` that ``transfers`` name (every process calls it at
    once, with the same list); return, by shard rank, the manifest document and bytes that
    reached this rank (``rank``), neither yet verified.

    A copy that does not arrive (its holder died or hangs, within the link's timeout, or no
    longer holds it) is logged, not raised: the restore reads that shard from the next tier.
    """
    sends = [(needer, shard) for holder, needer, shard in transfers if holder == rank]
    receives = [(holder, shard) for holder, needer, shard in transfers if needer == rank]
    outgoing = [_outgoing(memory, step, shard) for _needer, shard in sends]
    sizes = {(holder, shard): np.zeros(_SIZES.size, np.uint8) for holder, shard in receives}
    incoming: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    try:
        link.exchange(
            [(needer, header) for (needer, _shard), (header, _m, _d) in zip(sends, outgoing, strict=True)],
            [(holder, buffer) for (holder, _shard), buffer in sizes.items()],
        )
        for key, raw in sizes.items():
            manifest_bytes, shard_bytes = _SIZES.unpack(raw.tobytes())
            if 0 <= manifest_bytes <= _MAX_MANIFEST and shard_bytes >= 0:
                incoming[key] = (np.empty(manifest_bytes, np.uint8), new_array((shard_bytes,), np.uint8))
        payload = []
        for (needer, _shard), (_header, manifest, data) in zip(sends, outgoing, strict=True):
            if manifest is not None:
                payload += [(needer, manifest), (needer, data)]
        link.exchange(payload, [(holder, part) for (holder, _shard), pair in incoming.items() for part in pair])
    except PeerError as exc:
        logger.warning("restore of step %d: the partners' copies did not arrive: %s", step, exc)
        return {}
    return {shard: (manifest.tobytes(), data) for (_holder, shard), (manifest, data) in incoming.items()}


def _outgoing(memory: PeerMemory, step: int, shard: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """The header, manifest and bytes of ``shard``'s held copy of ``step`` (a header of -1s if gone)."""
    try:
        with memory.lock:
            data = memory.view(step, shard)
            manifest = _bytes(memory.manifest_text(step))
    except Exception as exc:  # gone, or its memory file unreadable: the needer reads the next tier
        logger.warning("restore of step %d: cannot send rank %d's copy: %s", step, shard, exc)
        return _bytes(_SIZES.pack(-1, -1)), None, np.zeros(0, np.uint8)
    return _bytes(_SIZES.pack(manifest.size, data.size)), manifest, data
