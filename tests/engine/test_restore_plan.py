"""A restore's plan (tiered_ckpt.engine.restore_plan): a pure function, tested with no I/O over
world sizes, the processes' ranks, what the caller gives and which tier holds what."""

import re
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_ckpt.dist.reshard import ChunkPlan, partition_sizes
from tiered_ckpt.engine.restore_plan import (
    RestoreRequest,
    StepHoldings,
    TierHolding,
    needed_ranks,
    plan_chunk_restore,
    plan_parts,
    plan_replica_reads,
    plan_restore,
    plan_selected_restore,
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
        job = target if saved == target else draw(st.integers(1, 8))  # a job of another size reshards
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


@pytest.mark.slow
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


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(cases(), st.booleans())
def test_a_partial_restore_reads_the_selection_of_each_needed_shard_or_a_shard_without_digests_whole(case, digests):
    manifest, request, held = case
    if digests:  # records that name their arrays' digests: only the selection is read of them
        manifest = replace(manifest, shards=tuple(replace(r, array_xxh3_64="0" * 16) for r in manifest.shards))
    resharded = manifest.world_size != request.world_size
    expected: tuple[type[Exception], str] | None = None
    if resharded and not request.reshard:
        expected = WorldSizeMismatchError, "reshard"
    elif resharded and (request.into is not None or any(r.chunks for r in manifest.shards)):
        expected = UsageError, "paths with reshard=True"
    elif request.into is not None and request.into != len(request.ranks):
        expected = InvalidStateError, "this process restores"
    if expected is not None:
        with pytest.raises(expected[0], match=expected[1]):
            plan_selected_restore(manifest, request, held, ["model"])
        return
    try:
        whole_plan = plan_restore(manifest, replace(request, into=None), held)
    except IncompleteCheckpointError as exc:
        with pytest.raises(IncompleteCheckpointError, match=re.escape(str(exc))):
            plan_selected_restore(manifest, request, held, ["model"])
        return
    plan = plan_selected_restore(manifest, request, held, ["model"])
    assert plan.paths == ("model",) and plan.ranks == whole_plan.ranks
    assert [(r.rank, r.tiers) for r in plan.reads] == [(r.rank, r.tiers) for r in whole_plan.reads]
    for index, read in enumerate(plan.reads):
        record = manifest.shard(read.rank)
        assert read.selected == bool(record.chunks or record.array_xxh3_64) and read.whole == (not read.selected)
        assert read.names is None and read.into == (index if request.into is not None else None)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_restore_into_dtensors_reads_each_overlapping_shard_once_and_refills_only_its_own_missing_shards(data):
    saved = data.draw(st.integers(1, 6))
    manifest = manifest_of(saved, 12)
    one_process = data.draw(st.booleans())
    target = saved if data.draw(st.booleans()) else data.draw(st.integers(1, 6))
    ranks = tuple(range(target)) if one_process else (data.draw(st.integers(0, target - 1)),)
    request = RestoreRequest(ranks, target, one_process or target == 1, reshard=True)
    names = st.frozensets(st.sampled_from(["a", "b", "c"]), min_size=1)
    plans = [ChunkPlan(data.draw(st.dictionaries(st.integers(0, saved - 1), names, min_size=1)), {}, 0) for _ in ranks]
    held_here = data.draw(st.frozensets(st.integers(0, saved - 1)))
    everything = StepHoldings(WHERE, (TierHolding("local", held_here), TierHolding("remote", frozenset(range(saved)))))
    plan = plan_chunk_restore(manifest, request, everything, plans, held_here)
    assert [read.rank for read in plan.reads] == sorted({rank for p in plans for rank in p.reads})
    for read in plan.reads:
        whole = saved == target and read.rank in ranks and read.rank not in held_here
        assert read.whole == whole and read.tiers == ("remote",)
        if not whole:
            assert read.names == frozenset().union(*(p.reads.get(read.rank, frozenset()) for p in plans))
    disk_only = StepHoldings(WHERE, (TierHolding("local", held_here),))
    missing = sorted({rank for p in plans for rank in p.reads} - held_here)
    if missing:
        with pytest.raises(IncompleteCheckpointError, match=re.escape(f"ranks {missing} are not")):
            plan_chunk_restore(manifest, request, disk_only, plans, held_here)


@st.composite
def replicated_manifests(draw: st.DrawFn) -> ShardManifest:
    """A step whose arrays ``a0``..``a3`` are each stored by one writer rank, and left to it by
    some of the other ranks' shards."""
    world_size = draw(st.integers(1, 6))
    manifest = manifest_of(world_size, draw(st.integers(0, 20)))
    writer_of = draw(st.dictionaries(st.sampled_from(["a0", "a1", "a2", "a3"]), st.integers(0, world_size - 1)))
    records = []
    for record in manifest.shards:
        chunks = tuple(
            ChunkRecord(name, "I64", (), (), (), "0" * 64)
            for name, writer in writer_of.items()
            if writer == record.rank
        )
        left = tuple((name, w) for name, w in sorted(writer_of.items()) if w != record.rank and draw(st.booleans()))
        digest = "0" * 64 if chunks else ""
        records.append(
            replace(record, chunks=chunks, header_bytes=8 if chunks else 0, header_sha256=digest, replicas=left)
        )
    return replace(manifest, shards=tuple(records))


@settings(max_examples=300, deadline=None)
@given(replicated_manifests(), st.data())
def test_the_arrays_a_restores_shards_left_to_others_are_read_once_from_each_writer_not_read(manifest, data):
    read = data.draw(st.frozensets(st.integers(0, manifest.world_size - 1), min_size=1))
    held = data.draw(holdings(manifest.world_size))
    reads = plan_replica_reads(manifest, read, held)
    expected: dict[int, set[str]] = {}
    for rank in read:
        for name, writer in manifest.shard(rank).replicas:
            expected.setdefault(writer, set()).add(name)
    absent = {writer: names for writer, names in expected.items() if writer not in read}
    assert [each.rank for each in reads] == sorted(absent)  # each writer once, in rank order, none already read
    for each in reads:
        assert each.names == absent[each.rank] and not each.whole and each.into is None
        assert each.tiers == held.later_for(each.rank)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.data())
def test_a_reader_of_named_arrays_reads_each_shard_once_from_the_tiers_that_may_hold_it(world_size, data):
    ranks = st.integers(0, world_size - 1)
    wanted = data.draw(st.dictionaries(ranks, st.frozensets(st.sampled_from(["a", "b", "c"]))))
    held = data.draw(holdings(world_size))
    reads = plan_parts(held, wanted)
    assert [read.rank for read in reads] == sorted(wanted)
    for read in reads:
        assert read.names == wanted[read.rank] and not read.whole and not read.selected
        later = [tier.name for tier in held.tiers[1:] if tier.may_hold(read.rank)]
        assert list(read.tiers) == later
