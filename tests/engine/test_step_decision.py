"""The choice of a restore's step as a function of what each tier holds (tiered_ckpt.engine.step_decision).

No I/O: reports are drawn for arbitrary lists of tiers (a disk first, then any later tiers,
shared or node-local, durable or not), and the choice is checked against what each rank can
read, against today's rule for the store's disk, partner's memory and bucket, and for not
depending on the later tiers' order or names.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiered_ckpt.dist.coordination import from_payload, to_payload
from tiered_ckpt.engine.step_decision import Holdings, StepChoice, StepReport, TierView
from tiered_ckpt.errors import CheckpointError, IncompleteCheckpointError, WorldSizeMismatchError
from tiered_ckpt.tiers.base import Capabilities

STEPS = st.integers(1, 6)


def facts(name: str, *, shared: bool, durable: bool) -> TierView:
    capabilities = Capabilities(
        durable=durable, shared=shared, create_only_commit=False, store_checksums=False, ranged_reads=False
    )
    return TierView(name, f"mem://{name}", capabilities)


DISK = facts("local", shared=False, durable=True)


@st.composite
def tier_lists(draw: st.DrawFn) -> tuple[TierView, ...]:
    """A disk, then 0 to 3 later tiers of any capabilities."""
    kinds = draw(st.lists(st.tuples(st.booleans(), st.booleans()), max_size=3))
    return (
        DISK,
        *(facts(f"t{index}", shared=shared, durable=durable) for index, (shared, durable) in enumerate(kinds)),
    )


@st.composite
def holdings(draw: st.DrawFn, tiers: st.SearchStrategy[tuple[TierView, ...]] | None = None) -> Holdings:
    """Every process's report for ``tiers`` (default: any): one process holding every rank, or one per rank."""
    chosen = draw(tier_lists() if tiers is None else tiers)
    world_size = draw(st.integers(1, 4))
    processes = draw(st.sampled_from(sorted({1, world_size})))
    saved_by = st.sampled_from([world_size, world_size + 1, None])
    reports = []
    for process in range(processes):
        leader = process == 0
        disk = draw(st.dictionaries(STEPS, saved_by, max_size=4))
        held: list[tuple[str, tuple[tuple[int, int | None, tuple[int, ...] | None], ...] | None]]
        held = [(DISK.name, tuple((step, by, None) for step, by in sorted(disk.items())))]
        down = []
        for tier in chosen[1:]:
            if tier.capabilities.shared:
                if not leader:
                    held.append((tier.name, None))
                elif draw(st.booleans()) and len(down) < 2:
                    held.append((tier.name, None))
                    down.append((tier.name, "refused (drawn)"))
                else:
                    steps = draw(st.sets(STEPS, max_size=3))
                    held.append((tier.name, tuple((step, None, None) for step in sorted(steps))))
            else:
                copies = draw(
                    st.dictionaries(
                        STEPS,
                        st.tuples(
                            st.sampled_from([world_size, world_size + 1]), st.sets(st.integers(0, world_size - 1))
                        ),
                        max_size=3,
                    )
                )
                held.append((tier.name, tuple((s, by, tuple(sorted(r))) for s, (by, r) in sorted(copies.items()))))
        agreed = tuple((step, draw(st.sampled_from([True, False, None]))) for step in sorted(disk))
        reports.append(StepReport("{}", tuple(held), agreed, tuple(down)))
    return Holdings(tuple(reports), chosen, world_size)


def readable_by_every_rank(holdings: Holdings, step: int) -> bool:
    """The rule written per rank: some shared tier committed the step; or each rank finds its shard
    on its process's disk or (the step saved by this world size) in any process's node-local tier;
    or every disk holds it."""
    reports, world_size = holdings.reports, holdings.world_size
    for tier in holdings.tiers[1:]:
        listed = reports[0].held(tier.name)
        if tier.capabilities.shared and listed is not None and step in {s for s, _by, _r in listed}:
            return True
    disks = [{s for s, _by, _r in report.tiers[0][1] or ()} for report in reports]
    if all(step in disk for disk in disks):
        return True

    def rank_finds(rank: int) -> bool:
        if step in disks[rank if len(reports) == world_size else 0]:
            return True
        return any(
            s == step and by == world_size and rank in (ranks or ())
            for report in reports
            for tier in holdings.tiers[1:]
            if not tier.capabilities.shared
            for s, by, ranks in report.held(tier.name) or ()
        )

    return all(rank_finds(rank) for rank in range(world_size))


def outcome(holdings: Holdings, step: int | None, missing_ok: bool = True) -> StepChoice | str:
    try:
        return holdings.choose(step, missing_ok, reshard=False)
    except CheckpointError as exc:
        return type(exc).__name__


@pytest.mark.slow
@given(holdings(), st.one_of(st.none(), STEPS))
def test_the_complete_steps_are_those_every_rank_can_read(holdings, step):
    complete = holdings.complete()
    assert complete == sorted(complete) and len(set(complete)) == len(complete)
    assert set(complete) == {each for each in range(1, 7) if readable_by_every_rank(holdings, each)}
    chosen = outcome(holdings, step)
    if isinstance(chosen, str):
        assert (step not in complete) if step is not None else not complete
        assert chosen in {"IncompleteCheckpointError", "WorldSizeMismatchError"}
        return
    if step is not None:
        assert chosen.step == step
    elif complete:
        assert chosen.step == complete[-1]
    else:
        assert chosen.step is None and not holdings.disks.steps() - set(chosen.unfinished)


@pytest.mark.slow
@given(holdings())
def test_an_unfinished_save_is_on_some_disks_only_ours_and_never_agreed(holdings):
    chosen = outcome(holdings, None)
    unfinished = chosen.unfinished if isinstance(chosen, StepChoice) else ()
    disks = holdings.disks
    for step in unfinished:
        holders = disks.holders(step)
        assert holders and disks.lacking(step) and step not in holdings.complete()
        assert all(disks.world_sizes[rank][step] == holdings.world_size for rank in holders)
        assert all(disks.agreed[rank].get(step) is False for rank in holders)
        assert chosen.step != step
        assert outcome(holdings, step) == "IncompleteCheckpointError"


@pytest.mark.slow
@given(holdings(), st.randoms(use_true_random=False), st.one_of(st.none(), STEPS))
def test_the_choice_depends_on_what_tiers_can_do_not_on_their_order_or_names(holdings, random, step):
    later = list(range(1, len(holdings.tiers)))
    random.shuffle(later)
    renamed = {tier.name: f"renamed-{index}" for index, tier in enumerate(holdings.tiers) if index}
    renamed[holdings.tiers[0].name] = holdings.tiers[0].name

    def moved(report: StepReport) -> StepReport:
        tiers = (report.tiers[0], *(report.tiers[index] for index in later))
        return StepReport(
            report.arguments,
            tuple((renamed[name], held) for name, held in tiers),
            report.agreed,
            tuple((renamed[name], why) for name, why in report.down),
        )

    tiers = (
        holdings.tiers[0],
        *(dataclasses.replace(holdings.tiers[i], name=renamed[holdings.tiers[i].name]) for i in later),
    )
    again = Holdings(tuple(map(moved, holdings.reports)), tiers, holdings.world_size)
    assert again.complete() == holdings.complete()
    first, second = outcome(holdings, step), outcome(again, step)
    assert type(first) is type(second)
    if isinstance(first, StepChoice):
        assert (first.step, first.unfinished) == (second.step, second.unfinished)


def todays_complete(holdings: Holdings) -> set[int]:
    """The rule before tiers reported by name: the bucket's steps, those on every disk, and (one
    process per rank) those every rank holds on its disk or in some process's peer memory."""
    reports, world_size = holdings.reports, holdings.world_size
    remote = {step for step, _by, _r in reports[0].held("remote") or ()}
    disks = [{s for s, _by, _r in report.tiers[0][1] or ()} for report in reports]
    held = set(disks[0]).intersection(*disks[1:])
    if len(reports) == world_size:
        partners: dict[int, set[int]] = {}
        for report in reports:
            for step, saved_by, ranks in report.held("peer") or ():
                if saved_by == world_size:
                    partners.setdefault(step, set()).update(ranks or ())
        held |= {s for s, got in partners.items() if all(r in got or s in disks[r] for r in range(world_size))}
    return remote | held


TODAYS_TIERS = st.sampled_from(
    [
        (DISK,),
        (DISK, facts("remote", shared=True, durable=True)),
        (DISK, facts("peer", shared=False, durable=False)),
        (DISK, facts("peer", shared=False, durable=False), facts("remote", shared=True, durable=True)),
    ]
)


@pytest.mark.slow
@given(holdings(TODAYS_TIERS), st.one_of(st.none(), STEPS))
def test_todays_disk_partner_memory_and_bucket_are_chosen_from_as_before(holdings, step):
    if len(holdings.reports) == 1 and holdings.world_size > 1:  # the peer tier needs one process per rank
        holdings = dataclasses.replace(holdings, tiers=tuple(t for t in holdings.tiers if t.name != "peer"))
    assert set(holdings.complete()) == todays_complete(holdings)


@pytest.mark.slow
@given(holdings(), st.one_of(st.none(), STEPS))
def test_a_report_and_a_choice_cross_a_collective_unchanged(holdings, step):
    for report in holdings.reports:
        assert from_payload(StepReport, to_payload(report)) == report
    chosen = outcome(holdings, step)
    if isinstance(chosen, StepChoice):
        assert from_payload(StepChoice, to_payload(chosen)) == chosen


def test_a_step_on_some_disks_only_names_every_tier_that_lacks_it():
    """Two ranks, step 2 on rank 0's disk only, saved by 3 ranks: no tier gives rank 1 a copy."""
    tiers = (DISK, facts("peer", shared=False, durable=False), facts("remote", shared=True, durable=True))
    reports = (
        StepReport("{}", (("local", ((2, 3, None),)), ("peer", ()), ("remote", ())), ((2, True),)),
        StepReport("{}", (("local", ()), ("peer", ()), ("remote", None))),
    )
    with pytest.raises(WorldSizeMismatchError) as caught:
        Holdings(reports, tiers, 2).choose(None, False, reshard=False)
    assert str(caught.value) == (
        "mem://local: step 2, saved by 3 ranks, is committed on the disks of rank 0 only and the bucket "
        "mem://remote lacks it, nor do the partners' memories (peer tier) hold the shards the other ranks lack: "
        "rank 1 of this job's 2 holds no copy, and a rank can read the shards on other nodes' disks only through "
        "a bucket or a partner's memory holding them; to restore it on 2 ranks, give the job a bucket holding "
        "step 2 (remote.url) and restore with reshard=True (--reshard)"
    )
    with pytest.raises(IncompleteCheckpointError, match=r"\(remote\.url\)$"):
        Holdings(reports, tiers, 2).choose(None, False, reshard=True)


def test_a_shared_tier_listed_again_is_carried_in_the_choice():
    tiers = (DISK, facts("remote", shared=True, durable=True))
    reports = (StepReport("{}", (("local", ((1, 1, None),)), ("remote", None)), (), (("remote", "timed out"),)),)
    holdings = Holdings(reports, tiers, 1)
    assert holdings.shared() == {"remote": None} and holdings.complete() == [1]
    chosen = holdings.choose(None, False, False, {"remote": (1, 4)})
    assert chosen == StepChoice(4, (), (("remote", (1, 4)),))
    assert holdings.shared(dict(chosen.listed)) == {"remote": frozenset({1, 4})}
