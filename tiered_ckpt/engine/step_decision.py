"""The choice of a restore's step, as a function of what every tier holds: no I/O, no collective.

Every process reports what each tier of its store holds (:class:`StepReport`, by the tier's
name, in the store's order); :class:`Holdings` reads those reports against the tiers'
capabilities (:class:`TierView`) and picks the step (:meth:`Holdings.choose`), for any list
of tiers whose first is this node's disk:

- a step committed in a ``shared`` tier (a bucket) is complete: every process reads it there;
- so is one every process's disk holds (the first tier, each process reading its own);
- so is a step saved by this job's world size of which every rank's shard is on its
  process's disk or held by some process's node-local later tier (a partner's memory: with
  one process per rank, the restore hands its copies to the ranks that lack them);
- a step on some disks only that every rank holding it recorded as not agreed (a save cut
  short before every rank committed) was never restorable: it is passed over, and deleted.

:class:`~tiered_ckpt.engine.step_choice.StepChooser` gathers the reports and runs the choice
on the leader.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from tiered_ckpt.engine.restore_result import rank_ranges
from tiered_ckpt.errors import CheckpointError, IncompleteCheckpointError, WorldSizeMismatchError
from tiered_ckpt.tiers.base import Capabilities, Tier

__all__ = ["Holding", "StepReport", "StepChoice", "TierView", "Disks", "Holdings", "ranks_text", "called"]

logger = logging.getLogger("tiered_ckpt")

Holding = tuple[int, int | None, tuple[int, ...] | None]
"""A committed step one tier holds, as a report carries it: ``(step, saved_by, ranks)``.

``saved_by``: the world size of its manifest (None: not read, as a shared tier's are not, or
a disk's manifest that does not validate). ``ranks``: the ranks whose shards this process's
copy holds (None: not narrowed: a shared tier holds every rank's, a process's disk its own)."""


@dataclass(frozen=True)
class StepReport:
    """One process's part of step 1: its arguments (canonical JSON); for each tier, by name in
    the store's order, the committed steps it holds (None: not listed by this process: a shared
    tier is listed by the leader only, or not at all when it does not answer); for each step on
    its disk whether the ranks agreed its commit (None: no record says, e.g. a step saved before
    such records); and, on the leader, the shared tiers it could not list, with why."""

    arguments: str
    tiers: tuple[tuple[str, tuple[Holding, ...] | None], ...]
    agreed: tuple[tuple[int, bool | None], ...] = ()
    down: tuple[tuple[str, str], ...] = ()

    def held(self, name: str) -> tuple[Holding, ...] | None:
        """What the tier called ``name`` holds (None: not listed)."""
        return next((held for each, held in self.tiers if each == name), None)


@dataclass(frozen=True)
class StepChoice:
    """The step every process restores (None: none), the unfinished saves every process deletes,
    and the shared tiers the leader listed while choosing (their first listing having failed),
    by name with their committed steps; ``bucket_shards``: the
    :meth:`~tiered_ckpt.format.manifest.ShardManifest.shards_digest` of the bucket's manifest
    of the step, as the leader read it, for the disks' copies to be checked against (None: not
    read; a process whose disk holds the step reads it itself)."""

    step: int | None
    unfinished: tuple[int, ...] = ()
    listed: tuple[tuple[str, tuple[int, ...]], ...] = ()
    bucket_shards: str | None = None


@dataclass(frozen=True)
class TierView:
    """What the choice knows of one tier of the store: its name, where it is (for messages), and
    what it can do."""

    name: str
    url: str
    capabilities: Capabilities

    @classmethod
    def of(cls, tier: Tier) -> TierView:
        return cls(tier.name, tier.url, tier.capabilities)


def ranks_text(ranks: Collection[int]) -> str:
    """``rank 2`` or ``ranks 0-1,3``."""
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {rank_ranges(ranks)}"


def called(tier: TierView) -> str:
    """How messages name a shared tier: "the bucket <url>" for a durable one."""
    return f"the bucket {tier.url}" if tier.capabilities.durable else f"the {tier.name} tier {tier.url}"


@dataclass(frozen=True)
class Disks:
    """What each rank's disk (the store's first tier) holds (index: rank), from the ranks'
    :class:`StepReport`: per committed step the world size it was saved by (None: its manifest
    is damaged) and whether the ranks agreed its commit (None: no record, or a damaged one)."""

    world_sizes: tuple[Mapping[int, int | None], ...]
    agreed: tuple[Mapping[int, bool | None], ...]

    @classmethod
    def of(cls, reports: Sequence[StepReport]) -> Disks:
        return cls(
            tuple({step: saved_by for step, saved_by, _ranks in report.tiers[0][1] or ()} for report in reports),
            tuple(dict(report.agreed) for report in reports),
        )

    def steps(self) -> set[int]:
        """The steps committed on some rank's disk."""
        return set().union(*self.world_sizes)

    def on_every_disk(self) -> set[int]:
        return set(self.world_sizes[0]).intersection(*self.world_sizes[1:])

    def holders(self, step: int) -> list[int]:
        return [rank for rank, steps in enumerate(self.world_sizes) if step in steps]

    def lacking(self, step: int) -> list[int]:
        return [rank for rank, steps in enumerate(self.world_sizes) if step not in steps]

    def without(self, steps: Collection[int]) -> Disks:
        """The same disks, ``steps`` left out."""
        return Disks(
            tuple({s: size for s, size in held.items() if s not in steps} for held in self.world_sizes), self.agreed
        )


@dataclass(frozen=True)
class Holdings:
    """Every process's report (by rank) read against the store's ``tiers`` (in order, the first
    this node's disk), for a job of ``world_size`` ranks whose processes are the reports'."""

    reports: tuple[StepReport, ...]
    tiers: tuple[TierView, ...]
    world_size: int

    @property
    def disks(self) -> Disks:
        return Disks.of(self.reports)

    @property
    def shared_tiers(self) -> tuple[TierView, ...]:
        return tuple(tier for tier in self.tiers[1:] if tier.capabilities.shared)

    @property
    def node_tiers(self) -> tuple[TierView, ...]:
        """The later tiers each node holds its own part of (a partner's memory)."""
        return tuple(tier for tier in self.tiers[1:] if not tier.capabilities.shared)

    def shared(self, listed: Mapping[str, Collection[int]] | None = None) -> dict[str, frozenset[int] | None]:
        """Each shared tier's committed steps, by name: as ``listed`` (the tiers listed again) or
        the leader reported them (None: its listing failed)."""
        listed = listed or {}
        found: dict[str, frozenset[int] | None] = {}
        for tier in self.shared_tiers:
            held = self.reports[0].held(tier.name)
            if tier.name in listed:
                found[tier.name] = frozenset(listed[tier.name])
            else:
                found[tier.name] = None if held is None else frozenset(step for step, _by, _ranks in held)
        return found

    def down(self) -> dict[str, str]:
        """The shared tiers the leader could not list, by name, with why."""
        return dict(self.reports[0].down)

    def on_nodes(self) -> set[int]:
        """The steps every rank can read without a shared tier: those on every process's disk, and
        those saved by ``world_size`` ranks of which each rank's shard is on its process's disk or
        held by some process's node-local later tier (with one process per rank the restore hands
        those copies to the ranks that lack them)."""
        disks = self.disks
        held = disks.on_every_disk()
        processes = len(self.reports)
        if processes not in (1, self.world_size):
            return held
        ranks: dict[int, set[int]] = {}
        for report in self.reports:
            for tier in self.node_tiers:
                for step, saved_by, holds in report.held(tier.name) or ():
                    if saved_by == self.world_size:
                        ranks.setdefault(step, set()).update(holds or ())
        disk_of = (lambda rank: rank) if processes == self.world_size else (lambda rank: 0)
        return held.union(
            step
            for step, got in ranks.items()
            if all(rank in got or step in disks.world_sizes[disk_of(rank)] for rank in range(self.world_size))
        )

    def complete(self, listed: Mapping[str, Collection[int]] | None = None) -> list[int]:
        """The steps every rank can restore, oldest first (``listed`` as for :meth:`shared`)."""
        shared = (steps for steps in self.shared(listed).values() if steps is not None)
        return sorted(self.on_nodes().union(*shared))

    def where(self) -> str:
        """Every tier's location, for messages."""
        return " and ".join(tier.url for tier in self.tiers)

    def choose(
        self,
        step: int | None,
        missing_ok: bool,
        reshard: bool,
        listed: Mapping[str, Collection[int]] | None = None,
    ) -> StepChoice:
        """The step every rank restores: ``step``, or the newest complete one (None: nothing
        anywhere, and ``missing_ok``), passing over the saves cut short before every rank
        committed (:meth:`unfinished`); ``listed``: the shared tiers listed again (carried in the
        choice). Raises :class:`IncompleteCheckpointError` (or :class:`WorldSizeMismatchError`
        for a step of another world size on some disks only, without ``reshard``) if none can be."""
        complete = self.complete(listed)
        disks = self.disks
        unfinished = self.unfinished(disks.steps() - set(complete))
        for partial in unfinished:
            logger.warning(
                "step %d is committed on the disks of %s only, and no rank recorded that every rank committed it "
                "(a save cut short before every rank committed): it was never restorable; deleting it from "
                "those disks and restoring an older step, if any",
                partial,
                ranks_text(disks.holders(partial)),
            )
        if step in unfinished:
            raise IncompleteCheckpointError(
                f"{self.where()}: step {step} was never committed on every rank (a save cut short before "
                f"every rank committed); committed steps: {complete}"
            )
        chosen = self._chosen(step, complete, disks.without(unfinished), missing_ok, reshard)
        again = tuple((name, tuple(sorted(steps))) for name, steps in (listed or {}).items())
        return StepChoice(chosen, unfinished, again)

    def unfinished(self, partial: set[int]) -> tuple[int, ...]:
        """Of the ``partial`` steps (committed on some ranks' disks, not complete), those saved by
        this job's world size that every rank holding one recorded as not agreed: the save was
        cut short before every rank committed, so it never existed on every rank. A step some
        rank marked agreed was committed everywhere (a disk lost it since); one with no record
        (saved by an older version) cannot be told apart: both stay, and refuse the restore."""
        disks = self.disks
        found = []
        for step in sorted(partial):
            holders = disks.holders(step)
            ours = (disks.world_sizes[rank].get(step) == self.world_size for rank in holders)
            if all(ours) and all(disks.agreed[rank].get(step) is False for rank in holders):
                found.append(step)
        return tuple(found)

    def _chosen(
        self, step: int | None, complete: list[int], disks: Disks, missing_ok: bool, reshard: bool
    ) -> int | None:
        """:meth:`choose` once the unfinished saves are left out of ``disks``."""
        held = disks.steps()
        if missing_ok and step is None and not complete and not held:
            return None
        unavailable = not complete if step is None else step not in complete
        if unavailable:
            wanted = max(held, default=None) if step is None else step
            if wanted in held:
                raise self._held_by_some(wanted, disks, reshard)
            if step is None:
                raise IncompleteCheckpointError(f"{self.where()}: no committed checkpoint to restore")
            raise IncompleteCheckpointError(
                f"{self.where()}: step {step} is not committed; committed steps: {complete}"
            )
        for partial in sorted(held - set(complete)):
            logger.warning(
                "step %d is committed on ranks %s only and not in the bucket (a save cut short between "
                "ranks' commits, or a node's disk replaced): it cannot be restored",
                partial,
                disks.holders(partial),
            )
        return complete[-1] if step is None else step

    def _held_by_some(self, step: int, disks: Disks, reshard: bool) -> CheckpointError:
        """The error for ``step``, committed on some ranks' disks only and in no shared tier. It
        says what is true: the step exists, saved by so many ranks; the ranks without a copy
        cannot read other nodes' disks; what would restore it."""
        holders, lacking = disks.holders(step), disks.lacking(step)
        saved_by = next((known[step] for known in disks.world_sizes if known.get(step) is not None), None)
        shared = self.shared_tiers
        if not shared:
            missing = "no bucket is configured (remote.url)"
        else:
            missing = f"{' and '.join(map(called, shared))} {'lacks' if len(shared) == 1 else 'lack'} it"
        through = "only through a bucket"
        if self.node_tiers:
            copies = [_node_copies(tier) for tier in self.node_tiers]
            missing += f", nor do {' nor '.join(what for what, _ in copies)} hold the shards the other ranks lack"
            through += "".join(f" or {how}" for _, how in copies)
        problem = (
            f"{self.tiers[0].url}: step {step}, saved by {saved_by or 'an unknown number of'} ranks, "
            f"is committed on the disks of {ranks_text(holders)} only and {missing}: {ranks_text(lacking)} of "
            f"this job's {self.world_size} {'holds' if len(lacking) == 1 else 'hold'} no copy, and a rank can read "
            f"the shards on other nodes' disks {through}"
        )
        if saved_by is None or saved_by == self.world_size:
            if any(disks.agreed[rank].get(step) for rank in holders):
                return IncompleteCheckpointError(f"{problem} (every rank committed it: a node's disk was replaced)")
            return IncompleteCheckpointError(
                f"{problem} (a save cut short between ranks' commits, or a node's disk replaced)"
            )
        fix = f"to restore it on {self.world_size} ranks, give the job a bucket holding step {step} (remote.url)"
        if reshard:
            return IncompleteCheckpointError(f"{problem}; {fix}")
        return WorldSizeMismatchError(f"{problem}; {fix} and restore with reshard=True (--reshard)")


def _node_copies(tier: TierView) -> tuple[str, str]:
    """How messages name a node-local later tier's copies: what holds them, and how a rank gets one."""
    if tier.capabilities.durable:
        return f"the {tier.name} tiers of the nodes", f"the {tier.name} tier of a node holding them"
    return f"the partners' memories ({tier.name} tier)", "a partner's memory holding them"
