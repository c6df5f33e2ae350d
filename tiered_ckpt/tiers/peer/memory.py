"""What a rank holds in memory for its partners: their shards, in buffers reused from step to step.

A :class:`PeerMemory` lives in a folder of a memory file system (``/dev/shm`` by default),
so the copies outlive the training process: a launcher that restarts every rank after a
failure (as torchrun does) finds them, while a lost node loses them with its RAM. The
folder holds:

- ``slot-<n>.bin``: one shard's bytes (the file may be longer than the shard); slots are
  reused for later steps, so after the first steps the memory held stays flat;
- ``slot-<n>.json``: which step and rank the slot holds, with the shard's size and
  sha256, written only once the bytes were checked;
- ``step-<step>.json``: the step's manifest, written when the step is committed in the
  peer tier (every rank's copy was taken by its partner), and ``step-<step>.disk`` if the
  step is also on the ranks' disks;
- ``step-<step>.refs``, written before the manifest: the slots (step and rank) of the earlier
  files the step's shards held here reference (an incremental save's), which stay while the
  step does, kept for it after their own step is deleted (see "Kept slots" below).

At most ``max_bytes`` are held in slots (None: the newest committed step of the partners'
shards and the newest one also on disk, each kept until a newer one of its kind is
committed, so a copy in flight needs a third step's room). Room is made by freeing the
oldest steps, the newest step that is also on disk last: it is what a replaced node's disks
are refilled with, while a step kept in memory only is restorable only while every partner
lives. A
shard that cannot fit, even once every other step is freed, is refused
(:class:`~tiered_ckpt.MemoryBudgetError`). What is
read back is untrusted: metadata that does not parse frees its slot, and every copy is
hashed again by whoever uses it.

Kept slots: a slot that a committed step references is never freed, whatever deletes its own
step (the budget, the default's chain, a retention): it is *kept* (:meth:`PeerMemory.kept_steps`),
and freed by the deletion that leaves no committed step referencing it. A copy in flight
marks the slots it found held for the step it brings (:meth:`PeerMemory.pin`) until that
step is committed, so that no room made for it frees them. The budget counts kept slots like
any other: making room deletes committed steps oldest first, and a step's kept slots go with
the last step referencing them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import mmap
import os
import re
import threading
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tiered_ckpt.errors import CheckpointError, ManifestError, MemoryBudgetError, UsageError
from tiered_ckpt.format.strict_json import Fields, load_object
from tiered_ckpt.io.durable import temp_name

__all__ = ["PeerMemory", "Slot", "file_map"]

logger = logging.getLogger("tiered_ckpt")

_SLOT = re.compile(r"slot-(\d{1,6})\.bin")
_MANIFEST = re.compile(r"step-(\d{12})\.json")
_META_LIMIT = 4096
_MANIFEST_LIMIT = 64 << 20


@dataclass(frozen=True)
class Slot:
    """A slot's content: ``rank``'s shard of ``step``, ``size`` bytes hashing to ``sha256``."""

    step: int
    rank: int
    size: int
    sha256: str


class PeerMemory:
    """The partners' shards this rank holds, in ``root`` (see the module doc)."""

    def __init__(self, root: Path, max_bytes: int | None = None) -> None:
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
            raise UsageError(f"max_bytes must be None or an integer >= 1, got {max_bytes!r:.40}")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self._slots: dict[int, Slot | None] = {}  # slot number -> content (None: free)
        self._receiving: set[int] = set()  # slots handed out by buffer_for, not yet accepted or released
        self._refs: dict[int, frozenset[tuple[int, int]]] = {}  # committed step -> the slots it references
        self._pinned: tuple[int, set[tuple[int, int]]] | None = None  # a copy in flight's step and held slots
        self.lock = threading.RLock()  # held by callers around each use: a copy and a restore may overlap
        self._load()

    def __repr__(self) -> str:
        return f"PeerMemory({str(self.root)!r}, max_bytes={self.max_bytes})"

    # -- reading what is held -----------------------------------------------------------------

    def _load(self) -> None:
        """Read the slots left in ``root`` (by an earlier process); free what does not parse."""
        for path in sorted(self.root.iterdir()):
            if path.name.startswith("."):  # a temp file of a write cut short
                path.unlink(missing_ok=True)
                continue
            found = _SLOT.fullmatch(path.name)
            if found is None:
                continue
            number = int(found.group(1))
            self._slots[number] = self._read_meta(number)
        for step in self._manifest_steps():
            if not any(slot is not None and slot.step == step for slot in self._slots.values()):
                self._manifest_path(step).unlink(missing_ok=True)
            elif (refs := self._read_refs(step)) is not None:
                self._refs[step] = refs
        for path in [*self.root.glob("step-*.disk"), *self.root.glob("step-*.refs")]:
            if not path.with_suffix(".json").exists():
                path.unlink(missing_ok=True)

    def _read_refs(self, step: int) -> frozenset[tuple[int, int]] | None:
        """The slots committed ``step`` references; None if their record does not parse, which
        un-commits the step (what it needs kept is unknown: it cannot be trusted to restore)."""
        path = self._refs_path(step)
        if not path.exists():
            return frozenset()
        try:
            fields = Fields(load_object(path.read_bytes(), str(path), _MANIFEST_LIMIT), str(path), "")
            fields.reject_unknown({"steps", "ranks"})
            steps, ranks = fields.list_of("steps", int), fields.list_of("ranks", int)
            if len(steps) != len(ranks) or any(isinstance(n, bool) or n < 0 for n in (*steps, *ranks)):
                raise ManifestError(f"{path}: 'steps' and 'ranks' must be lists of integers >= 0 of one length")
            return frozenset(zip(steps, ranks, strict=True))
        except (ManifestError, OSError) as exc:
            logger.warning("peer memory %s: step %d is no longer held: %s", self.root, step, exc)
            self._uncommit(step)
            return None

    def _read_meta(self, number: int) -> Slot | None:
        path = self._meta_path(number)
        if not path.exists():
            return None
        try:
            fields = Fields(load_object(path.read_bytes(), str(path), _META_LIMIT), str(path), "")
            fields.reject_unknown({"step", "rank", "size", "sha256"})
            slot = Slot(
                fields.integer("step", minimum=0),
                fields.integer("rank", minimum=0),
                fields.integer("size", minimum=0),
                fields.string("sha256"),
            )
            if slot.size > self._bin_path(number).stat().st_size:
                raise ManifestError(f"{path}: the slot is shorter than its {slot.size} bytes")
            return slot
        except (ManifestError, OSError) as exc:
            logger.warning("peer memory %s: freeing slot %d: %s", self.root, number, exc)
            path.unlink(missing_ok=True)
            return None

    def _manifest_steps(self) -> list[int]:
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _MANIFEST.fullmatch(p.name)))

    def steps(self) -> list[int]:
        """Steps committed here (their manifest written), oldest first."""
        return self._manifest_steps()

    def uncommitted_steps(self) -> list[int]:
        """Steps with slots neither committed nor kept for a committed step (a copy's), oldest first."""
        committed, kept = set(self._manifest_steps()), self._kept()
        return sorted(
            {slot.step for slot in self._slots.values() if slot is not None and slot.step not in committed}
            - {step for step, _rank in kept}
        )

    def kept_steps(self) -> list[int]:
        """Steps not committed here of which slots are kept for committed steps, oldest first."""
        committed = set(self._manifest_steps())
        held = {(slot.step, slot.rank) for slot in self._slots.values() if slot is not None}
        return sorted({step for step, rank in self._kept() & held if step not in committed})

    def _kept(self) -> set[tuple[int, int]]:
        """The slots (step, rank) no deletion frees: those committed steps reference, and a copy's pins."""
        return {pair for refs in self._refs.values() for pair in refs} | self._pins()

    def _pins(self) -> set[tuple[int, int]]:
        return self._pinned[1] if self._pinned is not None else set()

    def holds(self, step: int, rank: int, size: int, sha256: str) -> bool:
        """Whether a slot holds ``rank``'s shard of ``step`` of ``size`` bytes hashing to ``sha256``."""
        slot = self.held(step).get(rank)
        return slot is not None and slot.size == size and slot.sha256 == sha256

    def pin(self, step: int, slots: Collection[tuple[int, int]]) -> None:
        """Keep ``slots`` (step, rank) held for ``step``, being copied, until it is committed (or a
        copy of another step begins): the copy found them held and the step will reference them."""
        if self._pinned is None or self._pinned[0] != step:
            self._pinned = (step, set())
        self._pinned[1].update(slots)

    def unpin(self, step: int, slots: Collection[tuple[int, int]]) -> None:
        """``step``'s copy of the shard pinning ``slots`` failed: they are kept for it no more."""
        if self._pinned is not None and self._pinned[0] == step:
            self._pinned[1].difference_update(slots)

    def held(self, step: int) -> dict[int, Slot]:
        """The slots holding shards of ``step``, by rank."""
        return {slot.rank: slot for slot in self._slots.values() if slot is not None and slot.step == step}

    def manifest_text(self, step: int) -> bytes:
        """The manifest document of committed ``step`` (untrusted: the caller validates it)."""
        path = self._manifest_path(step)
        try:
            with open(path, "rb") as source:
                data = source.read(_MANIFEST_LIMIT + 1)
        except FileNotFoundError:
            raise CheckpointError(f"peer memory {self.root}: step {step} is not committed here") from None
        if len(data) > _MANIFEST_LIMIT:
            raise ManifestError(f"{path}: over the {_MANIFEST_LIMIT} byte limit of a manifest")
        return data

    def view(self, step: int, rank: int) -> np.ndarray:
        """``rank``'s shard of ``step`` as a private (copy-on-write) map of its slot."""
        for number, slot in self._slots.items():
            if slot is not None and slot.step == step and slot.rank == rank:
                return _map(self._bin_path(number), slot.size, private=True)
        raise CheckpointError(f"peer memory {self.root}: holds no shard of rank {rank} for step {step}")

    def bytes_held(self) -> int:
        """The bytes of every slot file (held or free): the memory this rank spends on its partners."""
        return sum(self._bin_path(number).stat().st_size for number in self._slots)

    # -- taking a new copy -------------------------------------------------------------------

    def buffer_for(self, step: int, rank: int, size: int) -> tuple[int, np.ndarray]:
        """A slot to receive ``rank``'s shard of ``step`` (``size`` bytes) and a writable map of it
        (shared: what is written lands in the slot's file; :func:`file_map` is the map).

        Frees what the budget needs first (see the module doc); the slot holds nothing
        until :meth:`accept`. Raises :class:`MemoryBudgetError` if the shard cannot fit
        beside the slots a copy pinned (before anything is freed).
        """
        pinned = self._pins()
        held = sum(s.size for s in self._slots.values() if s is not None and (s.step, s.rank) in pinned)
        if self.max_bytes is not None and size + held > self.max_bytes:
            beside = f" beside the {held} bytes of the earlier files it references, held" if held else ""
            raise MemoryBudgetError(
                f"peer memory {self.root}: rank {rank}'s shard of step {step} is {size} bytes{beside}, over the "
                f"budget of {self.max_bytes} bytes (peer.max_bytes)"
            )
        for number, slot in self._slots.items():
            if slot is not None and slot.step == step and slot.rank == rank:
                self._free(number)  # a second copy of the same shard replaces the first
        copying = self._pinned[0] if self._pinned is not None else step
        if self.max_bytes is None:  # what the chain needs stays until this step is committed
            keep = self._needed() | {step, copying}
            for other in self.steps():  # committed, not needed: left by a crash or a budget given up
                if other not in keep:
                    self.delete_step(other)
            kept = self._kept()  # every committed step is now one of ``keep``
            for number, slot in self._slots.items():
                if slot is not None and slot.step not in keep and (slot.step, slot.rank) not in kept:
                    self._free(number)
        number = self._choose_slot(step, size, copying)
        path = self._bin_path(number)
        if not path.exists() or path.stat().st_size < size:
            with open(path, "ab") as out:
                out.truncate(size)
        self._receiving.add(number)
        return number, _map(path, size, private=False)

    def _choose_slot(self, step: int, size: int, copying: int) -> int:
        """A free slot for ``size`` bytes: a free one long enough, else a free one grown (or a new
        one) if the budget allows, freeing the oldest other steps until it does."""
        while True:
            free = [n for n, slot in self._slots.items() if slot is None and n not in self._receiving]
            sizes = {n: self._bin_path(n).stat().st_size for n in self._slots}
            fitting = [n for n in free if sizes[n] >= size]
            if fitting:
                return min(fitting, key=lambda n: sizes[n])
            total = sum(sizes.values())
            grow = max(free, key=lambda n: sizes[n]) if free else None
            extra = size - (sizes[grow] if grow is not None else 0)
            if self.max_bytes is None or total + extra <= self.max_bytes:
                if grow is not None:
                    return grow
                number = max(self._slots, default=-1) + 1
                self._slots[number] = None
                return number
            kept = self._kept()
            loose = {s.step for s in self._slots.values() if s is not None and (s.step, s.rank) not in kept}
            others = sorted((loose | set(self._manifest_steps())) - {step, copying})
            on_disk = [other for other in others if self._disk_path(other).exists()]
            if on_disk:  # the newest step also on disk goes last
                others.remove(on_disk[-1])
                others.append(on_disk[-1])
            if not others:
                if free:  # shrink the budget's use: drop free slots that are too short
                    for n in free:
                        self._bin_path(n).unlink(missing_ok=True)
                        del self._slots[n]
                    continue
                raise MemoryBudgetError(
                    f"peer memory {self.root}: step {step}'s shards need more than the budget of "
                    f"{self.max_bytes} bytes (peer.max_bytes)"
                )
            self.delete_step(others[0])

    def accept(self, number: int, slot: Slot) -> None:
        """Record that slot ``number`` holds ``slot`` (its bytes were checked by the caller)."""
        self._receiving.discard(number)
        _write_small(self._meta_path(number), _slot_json(slot))
        self._slots[number] = slot

    def release(self, number: int) -> None:
        """Slot ``number`` holds nothing (a copy that did not verify, or never arrived)."""
        self._receiving.discard(number)
        self._free(number)

    def commit(
        self, step: int, manifest_json: str, *, on_disk: bool = False, referenced: Collection[tuple[int, int]] = ()
    ) -> None:
        """Write ``step``'s manifest: the step is committed here (``on_disk``: it is also on the
        ranks' disks; ``referenced``: the slots, step and rank, its shards held here reference)."""
        refs = frozenset(referenced)
        if on_disk:
            _write_small(self._disk_path(step), b"")
        if refs:
            steps, ranks = zip(*sorted(refs), strict=True)
            _write_small(self._refs_path(step), json.dumps({"steps": steps, "ranks": ranks}).encode())
        self._refs[step] = refs
        _write_small(self._manifest_path(step), manifest_json.encode())
        if self._pinned is not None and self._pinned[0] == step:
            self._pinned = None
        if self.max_bytes is None:  # the steps the chain no longer needs go now
            keep = self._needed()
            for other in self.steps():
                if other not in keep:
                    self.delete_step(other)

    def _needed(self) -> set[int]:
        """The committed steps the default budget keeps: the newest one, and the newest one also
        on the ranks' disks. A step kept in memory only is restorable only while every partner
        lives; after a node loss, the newest disk step is the newest one every rank can restore,
        and the lost node's shards of it are here."""
        steps = self.steps()
        on_disk = [step for step in steps if self._disk_path(step).exists()]
        return set(steps[-1:] + on_disk[-1:])

    def delete_step(self, step: int) -> None:
        """Forget ``step``: its manifest first, then its slots (free, for later steps) but those a
        committed step references (kept), then the kept slots only ``step`` referenced."""
        referenced = self._refs.get(step, frozenset())
        self._uncommit(step)
        kept, committed = self._kept(), set(self._manifest_steps())
        for number, slot in list(self._slots.items()):
            if slot is None or (slot.step, slot.rank) in kept:
                continue
            if slot.step == step or ((slot.step, slot.rank) in referenced and slot.step not in committed):
                self._free(number)

    def collect_unreferenced(self, *, all_steps: bool = False) -> list[int]:
        """Free the slots of steps not committed here that no committed step references (nor a copy
        pins), of steps older than the newest committed one (``all_steps``: of every step, where no
        copy runs); the steps none is left of."""
        committed = self._manifest_steps()
        newest = committed[-1] if committed else -1
        kept = self._kept()
        gone = set()
        for number, slot in list(self._slots.items()):
            if slot is None or slot.step in committed or (slot.step, slot.rank) in kept:
                continue
            if all_steps or slot.step < newest:
                self._free(number)
                gone.add(slot.step)
        return sorted(step for step in gone if not self.held(step))

    def _free(self, number: int) -> None:
        slot = self._slots.get(number)
        self._meta_path(number).unlink(missing_ok=True)
        self._slots[number] = None
        if slot is not None and not self.held(slot.step):
            self._uncommit(slot.step)

    def _uncommit(self, step: int) -> None:
        """``step`` is committed here no more: its manifest first, then what records beside it."""
        self._manifest_path(step).unlink(missing_ok=True)
        self._disk_path(step).unlink(missing_ok=True)
        self._refs_path(step).unlink(missing_ok=True)
        self._refs.pop(step, None)

    def _bin_path(self, number: int) -> Path:
        return self.root / f"slot-{number}.bin"

    def _meta_path(self, number: int) -> Path:
        return self.root / f"slot-{number}.json"

    def _manifest_path(self, step: int) -> Path:
        return self.root / f"step-{step:012d}.json"

    def _disk_path(self, step: int) -> Path:
        return self.root / f"step-{step:012d}.disk"

    def _refs_path(self, step: int) -> Path:
        return self.root / f"step-{step:012d}.refs"


def file_map(buffer: np.ndarray) -> mmap.mmap | None:
    """The map of a slot's file that ``buffer``, from :meth:`PeerMemory.buffer_for` or
    :meth:`PeerMemory.view`, is (None for an empty one): its pages may be let go
    (:func:`~tiered_ckpt.io.pages.let_go`), the file keeps what was written through it."""
    base = buffer.base
    held = base.obj if isinstance(base, memoryview) else base
    return held if isinstance(held, mmap.mmap) else None


def _map(path: Path, size: int, *, private: bool) -> np.ndarray:
    if size == 0:
        return np.zeros(0, dtype=np.uint8)
    with open(path, "rb" if private else "r+b") as source:
        access = mmap.ACCESS_COPY if private else mmap.ACCESS_WRITE
        mapped = mmap.mmap(source.fileno(), size, access=access)
    return np.frombuffer(mapped, dtype=np.uint8, count=size)


def _slot_json(slot: Slot) -> bytes:
    return json.dumps(dataclasses.asdict(slot)).encode()


def _write_small(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (a memory file system: nothing to fsync)."""
    temp = path.with_name(temp_name(path.name))
    with open(temp, "wb") as out:
        out.write(data)
    os.replace(temp, path)
