"""Which step a restore reads: steps 1 and 2 of a restore (:mod:`~tiered_ckpt.engine.restore`).

1. every process reports its arguments and the steps its local tier has committed (with
   the world size each was saved with, and whether the ranks agreed on its commit); the
   leader adds the bucket's steps (:class:`StepReport`, one collective);
2. the leader picks the step: the one asked for, or the newest that every process
   holds locally or the bucket holds, and every process gets it (:class:`StepChoice`, a
   second collective); a step some processes hold and none recorded the agreement of (a
   save cut short between the ranks' commits) is skipped, and deleted from the disks
   holding it (:meth:`StepChooser.drop_unfinished_saves`).

Once the chosen step is restored, local steps newer than it whose commit never reached
every rank are deleted (:meth:`StepChooser.drop_unfinished_commits`): they could never be
restored.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from tiered_ckpt.dist.coordination import Attempt, Coordinator, gather, leader_decides
from tiered_ckpt.engine.restore_result import rank_ranges
from tiered_ckpt.errors import (
    CheckpointError,
    IncompleteCheckpointError,
    InvalidStateError,
    ManifestError,
    RemoteError,
    UsageError,
    WorldSizeMismatchError,
)
from tiered_ckpt.tiers.peer.tier import PeerTier
from tiered_ckpt.tiers.store import TieredStore

__all__ = ["AgreedStep", "Disks", "StepChoice", "StepChooser", "StepReport", "same_call"]

logger = logging.getLogger("tiered_ckpt")


@dataclass(frozen=True)
class StepReport:
    """One process's part of step 1: its arguments (canonical JSON), its committed local
    steps with the world size of each (None: the manifest does not validate), on the
    leader only the bucket's committed steps, for each local step whether the ranks
    agreed on its commit (None: no record says, e.g. a step saved before such records),
    and the steps committed in its peer memory: (step, world size, ranks held)."""

    arguments: str
    local: tuple[tuple[int, int | None], ...]
    remote: tuple[int, ...] | None
    agreed: tuple[tuple[int, bool | None], ...] = ()
    peer: tuple[tuple[int, int, tuple[int, ...]], ...] = ()
    bucket_down: str | None = None  # on the leader: why the bucket could not be listed (None: it was)


@dataclass(frozen=True)
class StepChoice:
    """The step every process restores (None: none), the unfinished saves every process deletes,
    and the bucket's steps if the leader listed them while choosing (None: as reported)."""

    step: int | None
    unfinished: tuple[int, ...] = ()
    remote: tuple[int, ...] | None = None


@dataclass(frozen=True)
class AgreedStep:
    """Steps 1 and 2 as every process knows them: the ``choice``, the bucket's steps, the
    steps complete in some tier (in order), and every process's report (by rank)."""

    choice: StepChoice
    remote_steps: frozenset[int]
    complete: tuple[int, ...]
    reports: tuple[StepReport, ...]

    @property
    def bucket_unlisted(self) -> bool:
        """Whether the leader's listing of the bucket failed and the step was chosen without it."""
        return self.reports[0].bucket_down is not None and self.choice.remote is None


def same_call(arguments: Sequence[str], call: str) -> None:
    """Raise :class:`InvalidStateError` on every rank if the ranks made ``call`` with different arguments."""
    if len(set(arguments)) > 1:
        shown = {rank: json.loads(text) for rank, text in enumerate(arguments)}
        raise InvalidStateError(f"the ranks called {call} with different arguments: {shown}")


def _ranks_text(ranks: Collection[int]) -> str:
    """``rank 2`` or ``ranks 0-1,3``."""
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {rank_ranges(ranks)}"


@dataclass(frozen=True)
class Disks:
    """What each rank's disk holds (index: rank), from the ranks' :class:`StepReport`: per
    committed step the world size it was saved by (None: its manifest is damaged) and whether
    the ranks agreed its commit (None: no record, or a damaged one)."""

    world_sizes: tuple[Mapping[int, int | None], ...]
    agreed: tuple[Mapping[int, bool | None], ...]

    @classmethod
    def of(cls, reports: Sequence[StepReport]) -> Disks:
        return cls(tuple(dict(r.local) for r in reports), tuple(dict(r.agreed) for r in reports))

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


def _with_partners(reports: Sequence[StepReport], disks: Disks, world_size: int) -> set[int]:
    """The steps of ``world_size`` ranks that every rank (one per process) holds on its own disk
    or has a copy of in some process's peer memory."""
    if len(reports) != world_size:
        return set()
    held: dict[int, set[int]] = {}
    for report in reports:
        for step, saved_by, ranks in report.peer:
            if saved_by == world_size:
                held.setdefault(step, set()).update(ranks)
    return {
        step
        for step, ranks in held.items()
        if all(rank in ranks or step in disks.world_sizes[rank] for rank in range(world_size))
    }


class StepChooser:
    """Steps 1 and 2 (see the module doc) for the ranks of ``coordinator``, saved by
    ``world_size`` ranks, over ``store``; and the deletion of the steps they find unrestorable."""

    def __init__(
        self, store: TieredStore, coordinator: Coordinator, world_size: int, peer: PeerTier | None = None
    ) -> None:
        self._store = store
        self._coordinator = coordinator
        self._world_size = world_size
        self._peer = peer

    @property
    def _one_process(self) -> bool:
        return len(self._coordinator.local_ranks) == self._world_size

    def agree(
        self,
        step: int | None,
        arguments: str,
        world_size: int,
        missing_ok: bool,
        checked: Attempt[None],
        reshard: bool = False,
    ) -> AgreedStep:
        """Steps 1 and 2 (two collectives): the step every process restores (None: none, and
        ``missing_ok``) with the unfinished saves to delete. ``checked`` is the caller's own
        checks: if they failed, their error is raised inside the first collective, so every
        rank raises."""
        reports = gather(
            self._coordinator, "restore: steps", StepReport, lambda: self._report(arguments, world_size, checked)
        )
        same_call([report.arguments for report in reports], "restore")
        remote_steps = set(reports[0].remote or ())
        disks = Disks.of(reports)
        held = disks.on_every_disk().union(_with_partners(reports, disks, self._world_size))

        def choose() -> StepChoice:
            listed = self._list_again(step, held, disks, reports[0].bucket_down)
            complete = sorted(remote_steps.union(held, listed or ()))
            chosen = self._choose(step, complete, disks, missing_ok, reshard)
            return chosen if listed is None else dataclasses.replace(chosen, remote=tuple(listed))

        chosen = leader_decides(self._coordinator, "restore: choice", StepChoice, choose)
        if chosen.remote is not None:
            remote_steps = set(chosen.remote)
        complete = sorted(remote_steps.union(held))
        return AgreedStep(chosen, frozenset(remote_steps), tuple(complete), tuple(reports))

    def _list_again(self, step: int | None, held: set[int], disks: Disks, down: str | None) -> list[int] | None:
        """Leader, when the bucket failed its first listing (``down`` says how; None: it did not):
        nothing if the disks (and partners) hold every rank's shard of the step asked for, or of
        the newest step any disk holds (the bucket, fed from the disks, holds none newer); else
        the bucket's steps, listed under the retry policy. Raises :class:`RemoteError`
        (transient, naming the bucket) if that fails too."""
        remote = self._store.remote
        if down is None or remote is None:
            return None
        wanted = step if step is not None else max(disks.steps().union(held), default=None)
        if wanted is not None and wanted in held:
            logger.warning(
                "restore: the bucket %s did not answer (%s); step %d is restored from this job's disks without it",
                remote.url, down, wanted,
            )  # fmt: skip
            return None
        try:
            return remote.steps()
        except RemoteError as exc:
            if not exc.transient:
                raise
            what = f"step {wanted}" if wanted is not None else "a step"
            raise RemoteError(
                f"restore: the bucket {remote.url} does not answer ({exc}), and the disks of this job hold no "
                f"complete copy of {what}: try again once the bucket answers",
                transient=True,
            ) from exc

    def _report(self, arguments: str, world_size: int, checked: Attempt[None]) -> StepReport:
        checked.done()
        if not self._one_process and world_size != self._world_size:
            raise UsageError(f"with one process per rank the world size is the coordinator's, {self._world_size}")
        local: list[tuple[int, int | None]] = []
        steps = self._store.local.steps()
        for step in steps:
            try:
                local.append((step, self._store.local.manifest(step).world_size))
            except ManifestError:
                local.append((step, None))  # damaged: the restore falls back to the remote manifest or fails
        remote, down = self._remote_report()
        agreed = tuple((step, self._store.local.agreement(step)) for step in steps)
        return StepReport(arguments, tuple(local), remote, agreed, self._peer_report(), down)

    def _remote_report(self) -> tuple[tuple[int, ...] | None, str | None]:
        """Leader: the bucket's committed steps, each request tried once (a bucket that does not
        answer costs a restore the disks can serve one request, see :meth:`_list_again`), or why
        they could not be listed; other processes: nothing."""
        remote = self._store.remote
        if not self._coordinator.is_leader:
            return None, None
        if remote is None:
            return (), None
        try:
            return tuple(remote.list_steps(once=True)[0]), None
        except RemoteError as exc:
            if not exc.transient:
                raise
            return None, str(exc)

    def _peer_report(self) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
        """The steps committed in this process's peer memory, with the world size and ranks of each."""
        if self._peer is None:
            return ()
        report = []
        for step, ranks in self._peer.holdings().items():
            try:
                report.append((step, self._peer.manifest(step).world_size, ranks))
            except CheckpointError as exc:  # a damaged copy is one fewer source, never a failed restore
                logger.warning("peer memory: step %d is not usable: %s", step, exc)
        return tuple(report)

    def _choose(
        self, step: int | None, complete: list[int], disks: Disks, missing_ok: bool, reshard: bool
    ) -> StepChoice:
        """Leader: the step every rank restores (None: nothing anywhere, and ``missing_ok``),
        passing over the saves cut short between the ranks' commits (:meth:`_unfinished`)."""
        unfinished = self._unfinished(disks.steps() - set(complete), disks)
        for partial in unfinished:
            logger.warning(
                "step %d is committed on the disks of %s only, and no rank recorded that every rank committed it "
                "(a save cut short before every rank committed): it was never restorable; deleting it from "
                "those disks and restoring an older step, if any",
                partial,
                _ranks_text(disks.holders(partial)),
            )
        if step in unfinished:
            raise IncompleteCheckpointError(
                f"{self._store.where()}: step {step} was never committed on every rank (a save cut short before "
                f"every rank committed); committed steps: {complete}"
            )
        return StepChoice(self._chosen(step, complete, disks.without(unfinished), missing_ok, reshard), unfinished)

    def _unfinished(self, partial: set[int], disks: Disks) -> tuple[int, ...]:
        """Of the ``partial`` steps (committed on some ranks' disks, not on all and not in the
        bucket), those saved by this job's world size that every rank holding one recorded as
        not agreed: the save was cut short before every rank committed, so it never existed
        on every rank. A step some rank marked agreed was committed everywhere (a disk lost it
        since); one with no record (saved by an older version) cannot be told apart: both
        stay, and refuse the restore as before."""
        found = []
        for step in sorted(partial):
            holders = disks.holders(step)
            ours = (disks.world_sizes[rank].get(step) == self._world_size for rank in holders)
            if all(ours) and all(disks.agreed[rank].get(step) is False for rank in holders):
                found.append(step)
        return tuple(found)

    def _chosen(
        self, step: int | None, complete: list[int], disks: Disks, missing_ok: bool, reshard: bool
    ) -> int | None:
        """:meth:`_choose` once the unfinished saves are left out of ``disks``."""
        held = disks.steps()
        if missing_ok and step is None and not complete and not held:
            return None
        unavailable = not complete if step is None else step not in complete
        if unavailable:
            wanted = max(held, default=None) if step is None else step
            if wanted in held:
                raise self._held_by_some(wanted, disks, reshard)
            if step is None:
                raise IncompleteCheckpointError(f"{self._store.where()}: no committed checkpoint to restore")
            raise IncompleteCheckpointError(
                f"{self._store.where()}: step {step} is not committed; committed steps: {complete}"
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
        """Leader, one process per rank: the error for ``step``, committed on some ranks' disks
        only and in no bucket. It says what is true: the step exists, saved by so many ranks;
        the ranks without a copy cannot read other nodes' disks; what would restore it."""
        holders, lacking = disks.holders(step), disks.lacking(step)
        saved_by = next((known[step] for known in disks.world_sizes if known.get(step) is not None), None)
        remote = self._store.remote
        bucket = "no bucket is configured (remote.url)" if remote is None else f"the bucket {remote.url} lacks it"
        if self._peer is None:
            through = "only through a bucket"
        else:
            bucket = f"{bucket}, nor do the partners' memories (peer tier) hold the shards the other ranks lack"
            through = "only through a bucket or a partner's memory holding them"
        problem = (
            f"{self._store.local.root}: step {step}, saved by {saved_by or 'an unknown number of'} ranks, "
            f"is committed on the disks of {_ranks_text(holders)} only and {bucket}: {_ranks_text(lacking)} of "
            f"this job's {self._world_size} {'holds' if len(lacking) == 1 else 'hold'} no copy, and a rank can read "
            f"the shards on other nodes' disks {through}"
        )
        if saved_by is None or saved_by == self._world_size:
            if any(disks.agreed[rank].get(step) for rank in holders):
                return IncompleteCheckpointError(f"{problem} (every rank committed it: a node's disk was replaced)")
            return IncompleteCheckpointError(
                f"{problem} (a save cut short between ranks' commits, or a node's disk replaced)"
            )
        fix = f"to restore it on {self._world_size} ranks, give the job a bucket holding step {step} (remote.url)"
        if reshard:
            return IncompleteCheckpointError(f"{problem}; {fix}")
        return WorldSizeMismatchError(f"{problem}; {fix} and restore with reshard=True (--reshard)")

    def drop_unfinished_saves(self, agreed: AgreedStep) -> None:
        """Delete this process's copies of the chosen unfinished saves, cut short before every
        rank committed (:meth:`_unfinished`): never restorable, never in the bucket, and each
        would refuse the save of its step number again."""
        held = set(self._store.local.steps())
        for step in agreed.choice.unfinished:
            if step in held:
                logger.warning(
                    "deleting step %d from %s: the save was cut short before every rank committed it",
                    step,
                    self._store.local.root,
                )
                self._store.local.delete_step(step)

    def drop_unfinished_commits(self, restored: int, agreed: AgreedStep) -> None:
        """Delete local steps newer than ``restored`` whose commit did not reach every rank.

        Such a step can never be restored (a rank lacks it and so does the bucket), and
        it would refuse the save of its step number again. Steps of another world size
        are kept: the ranks that would complete them are not in this job.
        """
        world_sizes = Disks.of(agreed.reports).world_sizes
        for step in self._store.local.steps():
            saved_with = {known.get(step, self._world_size) for known in world_sizes}
            if step > restored and step not in agreed.complete and saved_with == {self._world_size}:
                logger.warning(
                    "deleting step %d from %s: its commit did not reach every rank", step, self._store.local.root
                )
                self._store.local.delete_step(step)

    def drop_unrestorable_copies(self, restored: int | None, agreed: AgreedStep) -> None:
        """Delete from this process's peer memory the steps newer than ``restored`` (None: every
        step) saved by this job's world size that not every rank can restore (a lost node held the
        other parts): they never will be, and each would refuse the save of its step number and
        the ones before it (:meth:`CheckpointManager.save` counts the partners' memory)."""
        if self._peer is None:
            return
        for step, saved_by, _ranks in self._peer_report():
            newer = restored is None or step > restored
            if newer and saved_by == self._world_size and step not in agreed.complete:
                logger.info("deleting step %d from the partners' memory: not every rank can restore it", step)
                self._peer.delete_step(step)
