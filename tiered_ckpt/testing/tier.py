"""The tier contract: what every tier guarantees, written once (as zarr's ``StoreTests``).

A tier's tests, in this repository or out of it, subclass :class:`TierContract` and provide
three things::

    from tiered_ckpt.testing.tier import TierContract

    class TestMyTier(TierContract):
        @pytest.fixture
        def tier(self, tmp_path):  # a fresh, empty tier, ready to write (a local tier under its lock)
            return MyTier(tmp_path / "store")

        def replace_shard(self, tier, step, record, data): ...  # put other bytes where a landed
            # shard's copy is kept, bypassing the tier (a flipped byte, a truncated or longer copy)

        def replace_manifest(self, tier, step, data): ...  # the same for a committed step's manifest

pytest collects the contract's tests on the subclass; a tier that passes them holds the
properties of DESIGN §2, as far as one tier holds them: visibility (a step is visible exactly
once committed), crash safety (a landing that fails leaves nothing a reader takes for the
shard, and never destroys a good copy), verification (every tier notices bytes that are not
the record's, and never streams more than the record's size plus one byte), and deletion
(invisible first, then gone; the neighbours untouched).

This module imports pytest: the package itself never imports it, only a test suite does.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, BinaryIO

import pytest
import xxhash

from tiered_ckpt.errors import CheckpointError, ChecksumMismatchError, IncompleteCheckpointError, ManifestError
from tiered_ckpt.format.layout import shard_name
from tiered_ckpt.format.manifest import ShardManifest, ShardRecord
from tiered_ckpt.io.hashing import ShardDigest
from tiered_ckpt.tiers.base import Capabilities, Landed, ShardSource, Tier

__all__ = ["WORLD_SIZE", "TierContract", "manifest_of", "read_whole", "record_of", "shard_bytes", "writing"]

WORLD_SIZE = 2


def shard_bytes(step: int, rank: int, size: int = 3000) -> bytes:
    """Bytes a shard of ``rank`` at ``step`` holds here (a tier never looks inside)."""
    return hashlib.shake_256(f"{step}/{rank}".encode()).digest(size)


def record_of(rank: int, data: bytes) -> ShardRecord:
    return ShardRecord(
        rank=rank,
        path=shard_name(rank, WORLD_SIZE),
        sha256=hashlib.sha256(data).hexdigest(),
        xxh3_64=xxhash.xxh3_64_hexdigest(data),
        size_bytes=len(data),
        param_shard_offset=0,
        param_shard_numel=0,
    )


def manifest_of(step: int, shards: list[bytes] | None = None) -> ShardManifest:
    shards = shards or [shard_bytes(step, rank) for rank in range(WORLD_SIZE)]
    records = tuple(record_of(rank, data) for rank, data in enumerate(shards))
    return ShardManifest(
        world_size=WORLD_SIZE, step=step, wall_clock_seconds=1.0e9 + step, sharded_keys=(), shards=records
    )


def writing(data: bytes, fail_after: int | None = None) -> ShardSource:
    """A source that streams ``data`` (failing with OSError after ``fail_after`` bytes, if given)."""

    def write(out: BinaryIO) -> ShardDigest:
        if fail_after is not None:
            out.write(data[:fail_after])
            raise OSError(28, "No space left on device (injected)")
        for start in range(0, len(data), 1000):
            out.write(data[start : start + 1000])
        return ShardDigest(len(data), hashlib.sha256(data).hexdigest(), xxhash.xxh3_64_hexdigest(data))

    return ShardSource(write=write)


def read_whole(tier: Tier, step: int, record: ShardRecord) -> bytes:
    return tier.open_shard(step, record, lambda stream: stream.read())


class TierContract:
    """Subclass with a ``tier`` fixture and the two ``replace_*`` methods (see the module)."""

    def replace_shard(self, tier: Any, step: int, record: ShardRecord, data: bytes) -> None:
        raise NotImplementedError

    def replace_manifest(self, tier: Any, step: int, data: bytes) -> None:
        raise NotImplementedError

    def commit_step(self, tier: Tier, step: int, source: str = "write", tmp_path: Any = None) -> ShardManifest:
        manifest = manifest_of(step)
        landed = []
        for record in manifest.shards:
            data = shard_bytes(step, record.rank)
            if source == "path":
                path = tmp_path / f"{step}-{record.path}"
                path.write_bytes(data)
                landed.append(tier.land_shard(step, record, ShardSource(path=path)))
            else:
                landed.append(tier.land_shard(step, record, writing(data)))
        assert all(
            isinstance(each, Landed) and each.raw_bytes == record.size_bytes
            for each, record in zip(landed, manifest.shards, strict=True)
        )
        tier.commit(manifest, landed=landed)
        return manifest

    # -- the protocol itself -----------------------------------------------------------

    def test_it_speaks_the_protocol(self, tier):
        assert isinstance(tier, Tier)
        assert isinstance(tier.capabilities, Capabilities)
        assert isinstance(tier.name, str) and tier.name
        assert isinstance(tier.url, str) and tier.url
        assert tier.steps() == [] and tier.uncommitted_steps() == [] and tier.list_steps() == ([], [])

    def test_one_listing_says_what_the_two_do(self, tier):
        self.commit_step(tier, 2)
        manifest = manifest_of(5)
        tier.land_shard(5, manifest.shards[0], writing(shard_bytes(5, 0)))
        assert tier.list_steps() == (tier.steps(), tier.uncommitted_steps()) == ([2], [5])

    def test_a_listing_tried_once_says_what_the_listing_does(self, tier):
        self.commit_step(tier, 4)
        tier.land_shard(6, manifest_of(6).shards[1], writing(shard_bytes(6, 1)))
        assert tier.list_steps(once=True) == tier.list_steps() == ([4], [6])

    def test_a_step_whose_every_shard_landed_holds_every_rank(self, tier):
        manifest = self.commit_step(tier, 7)
        held = tier.held_ranks(7, manifest)
        assert list(held) == list(range(WORLD_SIZE)) and all(type(rank) is int for rank in held)

    def test_a_shard_is_named_by_where_the_tier_keeps_it(self, tier):
        record = self.commit_step(tier, 3).shards[1]
        location = tier.shard_location(3, record)
        assert record.path in location and tier.url.rstrip("/") in location

    # -- visibility ----------------------------------------------------------------------

    def test_a_step_is_visible_exactly_once_committed(self, tier):
        manifest = manifest_of(3)
        landed = [tier.land_shard(3, manifest.shards[0], writing(shard_bytes(3, 0)))]
        assert tier.steps() == [] and tier.uncommitted_steps() == [3]
        landed.append(tier.land_shard(3, manifest.shards[1], writing(shard_bytes(3, 1))))
        assert tier.steps() == []
        tier.commit(manifest, landed=landed)
        assert tier.steps() == [3] and tier.uncommitted_steps() == []
        assert tier.manifest(3).shards == manifest.shards and tier.manifest(3).step == 3

    @pytest.mark.parametrize("source", ["write", "path"])
    def test_what_landed_reads_back_byte_for_byte_whole_and_in_ranges(self, tier, tmp_path, source):
        manifest = self.commit_step(tier, 5, source, tmp_path)
        for record in manifest.shards:
            data = shard_bytes(5, record.rank)
            assert read_whole(tier, 5, record) == data
            assert tier.check_shard(5, record) is None
            if tier.capabilities.ranged_reads:
                buffer = bytearray(700)
                digest = tier.read_range_into(5, record, 1000, memoryview(buffer))
                assert bytes(buffer) == data[1000:1700] and digest == hashlib.sha256(data[1000:1700]).hexdigest()
                fast = tier.read_range_into(5, record, 0, memoryview(buffer), "fast")
                assert fast == xxhash.xxh3_64_hexdigest(data[:700])

    def test_steps_are_listed_oldest_first(self, tier):
        for step in (10, 2, 7):
            self.commit_step(tier, step)
        assert tier.steps() == [2, 7, 10]

    def test_a_manifest_that_names_another_step_is_refused(self, tier):
        self.commit_step(tier, 4)
        self.replace_manifest(tier, 4, manifest_of(5).to_json().encode())
        with pytest.raises(ManifestError, match="step"):
            tier.manifest(4)

    def test_a_manifest_that_is_not_one_is_refused(self, tier):
        self.commit_step(tier, 4)
        self.replace_manifest(tier, 4, b'{"world_size": 2, "step": 4}')
        with pytest.raises(ManifestError):
            tier.manifest(4)

    def test_a_second_checkpoint_of_a_committed_step_never_replaces_it_where_commits_are_create_only(self, tier):
        first = self.commit_step(tier, 6)
        if not tier.capabilities.create_only_commit:
            pytest.skip("this tier's commits are not create-only (its writer refuses an existing step)")
        other = manifest_of(6, [b"other" * 100, b"bytes" * 100])
        landed = []
        for record in other.shards:
            data = (b"other" if record.rank == 0 else b"bytes") * 100
            try:
                landed.append(tier.land_shard(6, record, writing(data)))
            except CheckpointError:
                pass  # a tier may refuse to land over a committed shard: as good
        with pytest.raises(CheckpointError):
            tier.commit(other, landed=landed)
        assert tier.manifest(6).shards == first.shards

    # -- crash safety ------------------------------------------------------------------

    def test_a_landing_that_fails_midway_leaves_no_shard(self, tier):
        manifest = manifest_of(8)
        record = manifest.shards[0]
        with pytest.raises(OSError):
            tier.land_shard(8, record, writing(shard_bytes(8, 0), fail_after=1200))
        assert tier.check_shard(8, record) is not None  # nothing under the shard's name
        assert tier.steps() == []

    def test_a_landing_of_bytes_unlike_the_record_is_refused_and_keeps_the_good_copy(self, tier):
        manifest = self.commit_step(tier, 9)
        record = manifest.shards[1]
        with pytest.raises(ChecksumMismatchError):
            tier.land_shard(9, record, writing(shard_bytes(9, 0)))  # rank 0's bytes for rank 1's record
        assert read_whole(tier, 9, record) == shard_bytes(9, 1) and tier.steps() == [9]

    # -- verification ------------------------------------------------------------------

    @pytest.mark.parametrize("change", ["flipped", "truncated", "longer"])
    def test_a_copy_unlike_its_record_is_noticed(self, tier, change):
        manifest = self.commit_step(tier, 11)
        record = manifest.shards[0]
        data = bytearray(shard_bytes(11, 0))
        if change == "flipped":
            data[len(data) // 2] ^= 0x01
        elif change == "truncated":
            data = data[:-10]
        else:
            data += os.urandom(5000)
        self.replace_shard(tier, 11, record, bytes(data))
        problem = tier.check_shard(11, record)
        assert problem is not None and record.path in problem
        try:
            read = read_whole(tier, 11, record)
        except (ChecksumMismatchError, IncompleteCheckpointError):
            return  # refused on opening: the tier knew the size
        assert len(read) <= record.size_bytes + 1 and read != shard_bytes(11, 0)

    def test_a_missing_copy_is_noticed(self, tier):
        manifest = self.commit_step(tier, 12)
        tier.delete_step(12)
        assert tier.check_shard(12, manifest.shards[0]) is not None

    # -- deletion ----------------------------------------------------------------------

    def test_deleting_a_step_removes_it_and_leaves_its_neighbours(self, tier):
        for step in (1, 2, 3):
            self.commit_step(tier, step)
        tier.delete_step(2)
        assert tier.steps() == [1, 3] and tier.uncommitted_steps() == []
        for step in (1, 3):
            for record in tier.manifest(step).shards:
                assert read_whole(tier, step, record) == shard_bytes(step, record.rank)
        tier.delete_step(2)  # deleting what is gone is no error
        assert tier.steps() == [1, 3]

    def test_an_uncommitted_step_can_be_deleted(self, tier):
        manifest = manifest_of(13)
        tier.land_shard(13, manifest.shards[0], writing(shard_bytes(13, 0)))
        tier.delete_step(13)
        assert tier.uncommitted_steps() == [] and tier.steps() == []
