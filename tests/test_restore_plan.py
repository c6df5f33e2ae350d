"""A restore's plan (tiered_ckpt.engine.restore_plan): a pure function, tested with no I/O over
world sizes, the processes' ranks, what the caller gives and which tier holds what."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_ckpt.dist.reshard import partition_sizes
from tiered_ckpt.engine.restore_plan import (
    RestoreRequest,
    StepHoldings,
    TierHolding,
    needed_ranks,
    plan_restore,
)
from tiered_ckpt.errors import IncompleteCheckpointError, InvalidStateError, UsageError, WorldSizeMismatchError
from tiered_ckpt.format.manifest import ChunkRecord, ShardManifest, ShardRecord

WHERE = "/disk/step-000000000007"


def manifest_of(world_size: int, numel: int, replicated: bool = False) -> ShardManifest:
    """Step 7 of ``world_size`` ranks holding a flat vector of ``numel`` elements in contiguous slices."""
    sizes = partition_sizes(numel, world_size)
    held = (ChunkRecord("step", "I64", (), (), (), "0" * 64),) if replicated else ()
    records = [
        ShardRecord(rank, f"rank-{rank:05d}-of-{world_size:05d}.safetensors", "0" * 64, "0" * 16, 64,
                    sum(sizes[:rank]), sizes[rank], chunks=() if rank else held, header_bytes=0 if rank else 8,
                    header_sha256="" if rank else "0" * 64,
                    replicas=(("step", 0),) if replicated and rank else ())
        for rank in range(world_size)
    ]  # fmt: skip
    return ShardManifest(world_size, 7, 0.0, ("w",), tuple(records))


@st.composite
def holdings(draw: st.DrawFn, world_size: int) -> StepHoldings:
    """This node's disk and up to three later tiers, each holding some ranks, not listed, or unlisted."""
    ranks = st.frozensets(st.integers(0, world_size - 1))
    local = TierHolding("local", draw(st.one_of(st.none(), ranks)))
    later = []
    for index in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["ranks", "unknown", "unlisted"]))
        held = draw(ranks) if kind == "ranks" else None if kind == "unknown" else frozenset()
        later.append(TierHolding(f"tier{index}", held, unlisted=kind == "unlisted"))
    return StepHoldings(WHERE, (local, *later))


@st.composite
def cases(draw: st.DrawFn) -> tuple[ShardManifest, RestoreRequest, StepHoldings]:
    saved = draw(st.integers(1, 8))
    manifest = manifest_of(saved, draw(st.integers(0, 40)), replicated=draw(st.booleans()))
    target = draw(st.integers(1, 8))
    if draw(st.booleans()):  # one process runs every rank of a job of some size
        job = draw(st.integers(1, 8))
        request_ranks, one_process = tuple(range(job)), True
    else:  # one process per rank
        request_ranks, one_process = (draw(st.integers(0, target - 1)),), target == 1
    reshard = draw(st.booleans())
    given_into = draw(st.one_of(st.none(), st.integers(0, 9)))
    request = RestoreRequest(request_ranks, target, one_process, reshard, given_into)
    return manifest, request, draw(holdings(saved))


def overlapping(manifest: ShardManifest, target: int, new_rank: int) -> set[int]:
    """The saved ranks whose slices share an element with ``new_rank``'s slice on ``target`` ranks."""
    sizes = partition_sizes(manifest.total_numel, target)
    start = sum(sizes[:new_rank])
    elements = set(range(start, start + sizes[new_rank]))
    slices = {r.rank: range(r.param_shard_offset, r.param_shard_offset + r.param_shard_numel) for r in manifest.shards}
    return {rank for rank, saved in slices.items() if elements.intersection(saved)}


def covered(manifest: ShardManifest, ranks: set[int], target: int, new_rank: int) -> bool:
    """True if the slices of saved ``ranks`` cover every element of ``new_rank``'s slice on ``target`` ranks."""
    sizes = partition_sizes(manifest.total_numel, target)
    start = sum(sizes[:new_rank])
    return all(
        any(r.param_shard_offset <= element < r.param_shard_offset + r.param_shard_numel
            for r in manifest.shards if r.rank in ranks)
        for element in range(start, start + sizes[new_rank])
    )  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(cases())
def test_a_plan_reads_each_needed_shard_once_from_the_tiers_that_may_hold_it(case):
    manifest, request, held = case
    resharded = manifest.world_size != request.world_size
    new_ranks = range(request.world_size) if request.one_process else request.ranks
    wanted = set(request.ranks) if not resharded else set()
    if resharded:  # every saved slice overlapping a new rank's, or rank 0's for an empty one (its scalars)
        wanted = set().union(*(overlapping(manifest, request.world_size, n) or {0} for n in new_ranks))
    unserved = sorted(
        r for r in wanted if all(t.unlisted or (t.ranks is not None and r not in t.ranks) for t in held.tiers)
    )
    expected_into = manifest.world_size if request.one_process else len(request.ranks)
    if resharded and not request.reshard:
        with pytest.raises(WorldSizeMismatchError, match="reshard"):
            plan_restore(manifest, request, held)
        return
    if request.reshard and request.into is not None:
        with pytest.raises(UsageError, match="into cannot be combined"):
            plan_restore(manifest, request, held)
        return
    if request.into is not None and request.into != expected_into:
        with pytest.raises(InvalidStateError, match=f"into holds {request.into} rank states"):
            plan_restore(manifest, request, held)
        return
    if unserved:
        with pytest.raises(
            IncompleteCheckpointError,
            match=re.escape(f"{WHERE}: step 7") + ".*" + re.escape(f"ranks {unserved} are not"),
        ):
            plan_restore(manifest, request, held)
        return
    plan = plan_restore(manifest, request, held)
    read_ranks = [read.rank for read in plan.reads]
    assert read_ranks == sorted(set(read_ranks))  # each once, in rank order
    if not resharded:
        assert tuple(read_ranks) == request.ranks and plan.ranks == request.ranks
    else:
        assert set(read_ranks) == wanted
        assert all(covered(manifest, set(read_ranks), request.world_size, n) for n in new_ranks)
        assert plan.ranks == (tuple(range(request.world_size)) if request.one_process else request.ranks)
    later = [tier.name for tier in held.tiers[1:]]
    for index, read in enumerate(plan.reads):
        assert [name for name in later if name in read.tiers] == list(read.tiers)  # the store's order
        for tier in held.tiers[1:]:
            tried = tier.name in read.tiers
            assert tried == (tier.unlisted or tier.ranks is None or read.rank in tier.ranks)
        assert read.into == (index if request.into is not None else None)
    replicated = any(record.replicas for record in manifest.shards)
    assert plan.replicas_from_peers == (not request.one_process and not resharded and replicated)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(1, 8), st.integers(0, 40))
def test_a_step_another_world_size_saved_is_refused_naming_what_would_restore_it(saved, target, numel):
    manifest = manifest_of(saved, numel)
    request = RestoreRequest(tuple(range(target)), target, True)
    bucket = StepHoldings(WHERE, (TierHolding("local", frozenset()), TierHolding("remote", frozenset(range(saved)))))
    disk_only = StepHoldings(WHERE, (TierHolding("local", frozenset()),))
    if saved == target:
        assert needed_ranks(manifest, request) == request.ranks
        return
    with pytest.raises(WorldSizeMismatchError, match="reshard it explicitly"):
        plan_restore(manifest, request, bucket)
    with pytest.raises(WorldSizeMismatchError, match="give the job a bucket"):
        plan_restore(manifest, request, disk_only)
    resharded = plan_restore(manifest, RestoreRequest(tuple(range(target)), target, True, reshard=True), bucket)
    assert all(read.tiers == ("remote",) for read in resharded.reads) and resharded.resharded


def test_an_unlisted_tier_is_tried_but_not_counted_on():
    manifest = manifest_of(2, 10)
    request = RestoreRequest((0, 1), 2, True)
    unlisted = TierHolding("remote", frozenset(), unlisted=True)
    disk = StepHoldings(WHERE, (TierHolding("local", frozenset({0, 1})), unlisted))
    assert [read.tiers for read in plan_restore(manifest, request, disk).reads] == [("remote",), ("remote",)]
    half = StepHoldings(WHERE, (TierHolding("local", frozenset({0})), unlisted))
    with pytest.raises(IncompleteCheckpointError, match=r"ranks \[1\]"):
        plan_restore(manifest, request, half)
    partner = StepHoldings(WHERE, (TierHolding("local", frozenset({0})), TierHolding("peer", None), unlisted))
    assert plan_restore(manifest, request, partner).reads[1].tiers == ("peer", "remote")
