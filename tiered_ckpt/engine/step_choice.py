"""Which step a restore reads: steps 1 and 2 of a restore (:mod:`~tiered_ckpt.engine.restore`).

1. every process reports its arguments and what each tier of its store holds: the steps its
   disk has committed (with the world size each was saved with, and whether the ranks agreed
   on its commit), those each node-local later tier holds (with the ranks of each), and, on
   the leader, those each shared tier committed (:class:`StepReport`, one collective);
2. the leader picks the step (:meth:`~tiered_ckpt.engine.step_decision.Holdings.choose`, a
   function of the reports and the tiers' capabilities): the one asked for, or the newest
   that every rank can read, and every process gets it (:class:`StepChoice`, a second
   collective); a step some processes hold and none recorded the agreement of (a save cut
   short between the ranks' commits) is skipped, and deleted from the disks holding it
   (:meth:`StepChooser.drop_unfinished_saves`).

Once the chosen step is restored, local steps newer than it whose commit never reached
every rank are deleted (:meth:`StepChooser.drop_unfinished_commits`): they could never be
restored.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from tiered_ckpt.dist.coordination import Attempt, Coordinator, gather, leader_decides
from tiered_ckpt.engine.step_decision import (
    Disks,
    Holding,
    Holdings,
    StepChoice,
    StepReport,
    TierView,
    called,
)
from tiered_ckpt.errors import CheckpointError, InvalidStateError, ManifestError, RemoteError, UsageError
from tiered_ckpt.tiers.abilities import receipts_of
from tiered_ckpt.tiers.base import Tier
from tiered_ckpt.tiers.store import TieredStore

__all__ = ["AgreedStep", "StepChooser", "same_call"]

logger = logging.getLogger("tiered_ckpt")


@dataclass(frozen=True)
class AgreedStep:
    """Steps 1 and 2 as every process knows them: the ``choice``, the steps committed in a
    shared, durable tier (a bucket), the steps complete in some tier (in order), every
    process's report (by rank), and, by shared, durable tier, the steps it committed
    (``durable``; None: it could not be listed, and the step was chosen without it)."""

    choice: StepChoice
    remote_steps: frozenset[int]
    complete: tuple[int, ...]
    reports: tuple[StepReport, ...]
    durable: Mapping[str, frozenset[int] | None] = field(default_factory=dict)

    def committed(self, step: int) -> dict[str, bool | None]:
        """By shared, durable tier: whether it committed ``step`` (None: it could not be listed)."""
        return {name: None if steps is None else step in steps for name, steps in self.durable.items()}


def same_call(arguments: Sequence[str], call: str) -> None:
    """Raise :class:`InvalidStateError` on every rank if the ranks made ``call`` with different arguments."""
    if len(set(arguments)) > 1:
        shown = {rank: json.loads(text) for rank, text in enumerate(arguments)}
        raise InvalidStateError(f"the ranks called {call} with different arguments: {shown}")


class StepChooser:
    """Steps 1 and 2 (see the module doc) for the ranks of ``coordinator``, saved by
    ``world_size`` ranks, over every tier of ``store``; and the deletion of the steps they find
    unrestorable."""

    def __init__(self, store: TieredStore, coordinator: Coordinator, world_size: int) -> None:
        self._store = store
        self._coordinator = coordinator
        self._world_size = world_size
        self._tiers = tuple(TierView.of(tier) for tier in store.tiers)

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
        try:
            return self._agree(step, arguments, world_size, missing_ok, checked, reshard)
        finally:  # a record the leader's listing read for this choice serves no later one
            for tier in self._store.later:
                receipted = receipts_of(tier)
                if receipted is not None:
                    receipted.take_expected(None)

    def _agree(
        self, step: int | None, arguments: str, world_size: int, missing_ok: bool, checked: Attempt[None], reshard: bool
    ) -> AgreedStep:
        """:meth:`agree`'s two collectives: each process's report of what its tiers hold, gathered;
        the leader's choice (listing the bucket where it must), shared."""
        reports = gather(
            self._coordinator, "restore: steps", StepReport, lambda: self._report(step, arguments, world_size, checked)
        )
        same_call([report.arguments for report in reports], "restore")
        holdings = Holdings(tuple(reports), self._tiers, self._world_size)

        def choose() -> StepChoice:
            choice = holdings.choose(step, missing_ok, reshard, self._list_again(step, holdings))
            return replace(choice, bucket_shards=self._bucket_shards(choice, holdings))

        chosen = leader_decides(self._coordinator, "restore: choice", StepChoice, choose)
        listed = dict(chosen.listed)
        shared = holdings.shared(listed)
        durable = [tier.name for tier in holdings.shared_tiers if tier.capabilities.durable]
        in_bucket = frozenset().union(*(shared[name] or () for name in durable))
        committed = {name: shared[name] for name in durable}
        return AgreedStep(chosen, in_bucket, tuple(holdings.complete(listed)), tuple(reports), committed)

    def _list_again(self, step: int | None, holdings: Holdings) -> dict[str, tuple[int, ...]]:
        """Leader, for each shared tier that failed its first listing: nothing if the disks (and
        node-local tiers, and the shared tiers that answered) hold every rank's shard of the step
        asked for, or of the newest step any disk holds (a shared tier, fed from the disks, holds
        none newer); else its steps, listed under its retry policy. Raises :class:`RemoteError`
        (transient, naming the tier) if that fails too."""
        down = holdings.down()
        held = holdings.on_nodes().union(*(steps for steps in holdings.shared().values() if steps is not None))
        wanted = step if step is not None else max(holdings.disks.steps().union(held), default=None)
        listed: dict[str, tuple[int, ...]] = {}
        for facts in holdings.shared_tiers:
            if facts.name not in down:
                continue
            if wanted is not None and wanted in held:
                logger.warning(
                    "restore: %s did not answer (%s); step %d is restored from this job's disks without it",
                    called(facts),
                    down[facts.name],
                    wanted,
                )
                continue
            try:
                listed[facts.name] = tuple(self._store.tier(facts.name).steps())
            except RemoteError as exc:
                if not exc.transient:
                    raise
                what = f"step {wanted}" if wanted is not None else "a step"
                it = "the bucket" if facts.capabilities.durable else "it"
                raise RemoteError(
                    f"restore: {called(facts)} does not answer ({exc}), and the disks of this job hold no "
                    f"complete copy of {what}: try again once {it} answers",
                    transient=True,
                ) from exc
        return listed

    def _bucket_shards(self, choice: StepChoice, holdings: Holdings) -> str | None:
        """Leader: the digest of the shard records of the bucket's manifest of the chosen step,
        for the processes whose disk holds the step to check their copy against, instead of each
        reading the bucket's (a request a process, of a document that grows with the ranks).
        Only where the listing read that manifest beside it (the step this process's tiers hold
        newest, or the one asked for, see :meth:`_shared_held`): read after the choice, it would
        add a round trip to the restore, where the processes' own reads run beside other work.
        None otherwise, or where no disk holds the step (each process then reads it itself)."""
        bucket, chosen = self._store.remote, choice.step
        if bucket is None or chosen is None:
            return None
        expected = bucket.take_expected(chosen)  # let go whatever follows
        if expected is None or chosen not in holdings.disks.steps():
            return None
        if chosen not in (holdings.shared(dict(choice.listed)).get(bucket.name) or ()):
            return None
        return expected.manifest.shards_digest()

    def _report(self, step: int | None, arguments: str, world_size: int, checked: Attempt[None]) -> StepReport:
        checked.done()
        if not self._one_process and world_size != self._world_size:
            raise UsageError(f"with one process per rank the world size is the coordinator's, {self._world_size}")
        disk = self._store.local
        on_disk: list[Holding] = []
        for step in disk.steps():
            try:
                on_disk.append((step, disk.manifest(step).world_size, None))
            except ManifestError:
                on_disk.append((step, None, None))  # damaged: the restore falls back to another tier's or fails
        tiers: list[tuple[str, tuple[Holding, ...] | None]] = [(disk.name, tuple(on_disk))]
        down: list[tuple[str, str]] = []
        for tier in self._store.later:
            if not tier.capabilities.shared:
                tiers.append((tier.name, self._node_held(tier)))
                continue
            held = {held_step for _name, holdings in tiers for held_step, _by, _ranks in holdings or ()}
            expect = max(held, default=None) if step is None else (step if step in held else None)
            listed, why = self._shared_held(tier, expect)
            tiers.append((tier.name, listed))
            if why is not None:
                down.append((tier.name, why))
        agreed = tuple((step, disk.agreement(step)) for step, _saved_by, _ranks in on_disk)
        return StepReport(arguments, tuple(tiers), agreed, tuple(down))

    def _shared_held(self, tier: Tier, expect: int | None) -> tuple[tuple[Holding, ...] | None, str | None]:
        """Leader: ``tier``'s committed steps, its first request tried once (a tier that does not
        answer costs a restore the disks can serve one request, see :meth:`_list_again`), or why
        they could not be listed; other processes: nothing (every node sees the same).
        ``expect``: the step asked for, or else the newest, if the tiers before ``tier`` hold it
        here; a bucket reads its manifest beside the listing (see :meth:`_bucket_shards`)."""
        if not self._coordinator.is_leader:
            return None, None
        bucket = receipts_of(tier)
        try:
            listed = bucket.list_steps(once=True, expect=expect) if bucket is not None else tier.list_steps(once=True)
            return tuple((step, None, None) for step in listed[0]), None
        except RemoteError as exc:
            if not exc.transient:
                raise
            return None, str(exc)

    def _node_held(self, tier: Tier) -> tuple[Holding, ...]:
        """The steps committed in this process's part of node-local ``tier``, with the world size
        and the ranks held of each."""
        held = []
        for step in tier.steps():
            try:
                manifest = tier.manifest(step)
                held.append((step, manifest.world_size, tuple(tier.held_ranks(step, manifest))))
            except CheckpointError as exc:  # a damaged copy is one fewer source, never a failed restore
                logger.warning("%s tier: step %d is not usable: %s", tier.name, step, exc)
        return tuple(held)

    def drop_unfinished_saves(self, agreed: AgreedStep) -> None:
        """Delete this process's copies of the chosen unfinished saves, cut short before every
        rank committed (:meth:`Holdings.unfinished`): never restorable, never in the bucket, and each
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
        """Delete from this process's part of each node-local later tier that is not durable (a
        partner's memory) the steps newer than ``restored`` (None: every step) saved by this job's
        world size that not every rank can restore (a lost node held the other parts): they never
        will be, and each would refuse the save of its step number and the ones before it
        (:meth:`CheckpointManager.save` counts the partners' memory). A durable tier keeps them, as
        the disk keeps the steps of another world size."""
        for tier in self._store.later:
            if tier.capabilities.shared or tier.capabilities.durable:
                continue
            for step, saved_by, _ranks in self._node_held(tier):
                newer = restored is None or step > restored
                if newer and saved_by == self._world_size and step not in agreed.complete:
                    logger.info("deleting step %d from the %s tier: not every rank can restore it", step, tier.name)
                    tier.delete_step(step)
