"""Retention by reachability in the bucket (tiered_ckpt/tiers/remote/kept.py): an earlier step's
object stays while a committed step references it, goes with the last one, and a start-up
removes what a crashed upload left for a step never committed (real buckets, real managers)."""

import hashlib
import shutil

import numpy as np
import pytest

from support.states import same_state
from support.stores import REMOTES, with_slow
from tiered_ckpt import CheckpointManager, LocalOptions, RemoteOptions
from tiered_ckpt.format.layout import KEPT_NAME, MANIFEST_NAME
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.tiers.remote.tier import RemoteTier

RNG = np.random.default_rng(11)
BASE = {f"layer{i}": RNG.standard_normal((64, 64)).astype(np.float32) for i in range(4)}  # 16 KiB each


def lora(step: int, base: dict | None = None) -> dict:
    """A frozen base and an adapter that changes every step."""
    adapter = np.random.default_rng(step).standard_normal((64, 8)).astype(np.float32)
    return {"base": dict(base or BASE), "adapter": adapter, "step": step}


def manager(tmp_path, url, options, **remote) -> CheckpointManager:
    local = LocalOptions(tmp_path / "local", keep_last=1)
    bucket = RemoteOptions(url, storage_options=options, keep_last=1, **remote)
    return CheckpointManager(local, remote=bucket, world_size=1)


def save(tmp_path, url, options, states: dict[int, dict], **remote) -> None:
    with manager(tmp_path, url, options, **remote) as m:
        for step, state in states.items():
            m.save(step, state, blocking=True)
            m.wait(uploaded=True)


@pytest.mark.parametrize("remote_url", with_slow(REMOTES, "s3", "gcs", "azure", "file"), indirect=True)
def test_a_deleted_step_keeps_what_a_retained_one_references_and_goes_with_the_last(tmp_path, remote_url):
    url, options = remote_url
    states = {step: lora(step) for step in (1, 2, 3)}
    save(tmp_path, url, options, states)
    tier = RemoteTier(url, options)
    assert tier.survey() == ([3], [], [1])  # step 1's file holds the base every later step references
    assert tier.kept_steps() == [1] and tier.uncommitted_steps() == []
    shutil.rmtree(tmp_path / "local")
    with manager(tmp_path, url, options) as m:  # the bucket alone, step 1's manifest long gone
        assert same_state(m.restore(step=3).states[0], states[3])
    new_base = {name: value + 1 for name, value in BASE.items()}
    save(tmp_path, url, options, {4: lora(4, new_base), 5: lora(5, new_base)})
    assert tier.survey() == ([5], [], [4])  # step 1's objects went with step 3, the last referencing them
    assert tier.backend.find(tier._path(1)) == []


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["flat", "hashed"])
def test_a_kept_compressed_object_is_found_by_a_reader_that_never_read_its_referencing_step(tmp_path, s3_url, layout):
    url, options = s3_url
    states = {step: lora(step) for step in (1, 2)}
    save(tmp_path, url, options, states, compression="zstd", layout=layout)
    reader = RemoteTier(url, options)  # what the bucket records of step 1's file is in step 2's manifest only
    assert reader.survey() == ([2], [], [1])
    ref = reader.manifest(2).shards[0].references[0]
    fresh = RemoteTier(url, options)
    assert fresh.check_shard(1, ref.file) is None
    assert fresh.shard_location(1, ref.file).endswith(".zst")
    buffer = bytearray(64)
    fresh.read_range_into(1, ref.file, 0, memoryview(buffer))
    assert bytes(buffer) == LocalTier(tmp_path / "local").shard_path(1, ref.file).read_bytes()[:64]


def test_a_start_removes_what_a_crashed_upload_left_and_keeps_what_is_referenced(tmp_path, memory_url):
    url, options = memory_url
    save(tmp_path, url, options, {step: lora(step) for step in (1, 2)})
    tier = RemoteTier(url, options)
    leftover = tier.manifest(2).shards[0].path
    tier.mark_kept(7)  # an upload of step 8 landed step 7's file for it, then died before committing
    tier.backend.put_bytes(tier._path(7, leftover), b"x" * 100)
    tier.backend.put_bytes(tier._path(8, leftover), b"y" * 100)  # and half of step 8
    assert tier.survey() == ([2], [8], [1, 7])
    assert tier.collect_unreferenced() == []  # while uploads may run: nothing newer than step 2 is touched
    with manager(tmp_path, url, options) as m:
        m.wait()
    assert tier.survey() == ([2], [], [1])
    assert tier.backend.find(tier._path(7)) == [] and tier.backend.find(tier._path(8)) == []


def test_nothing_referenced_is_deleted_while_a_later_manifest_cannot_be_read(tmp_path, memory_url, caplog):
    url, options = memory_url
    save(tmp_path, url, options, {step: lora(step) for step in (1, 2)})
    tier = RemoteTier(url, options)
    path = tier._path(2, MANIFEST_NAME)
    good = tier.backend.read(path)
    held = tier.backend.find(tier._path(1))
    tier.backend.put_bytes(path, good[:-20])  # damaged: what step 2 references is unknown
    tier.delete_step(1)
    assert tier.backend.find(tier._path(1)) == held  # everything kept, marked
    assert tier.collect_unreferenced() == [] and tier.backend.find(tier._path(1)) == held
    tier.backend.put_bytes(path, good)
    assert tier.collect_unreferenced() == []  # readable again: step 2 references step 1's shard
    kept = tier.backend.find(tier._path(1))
    assert sorted(name.rsplit("/", 1)[-1] for name in kept) == sorted([KEPT_NAME, held[-1].rsplit("/", 1)[-1]])


@pytest.mark.parametrize("damage", ["deleted", "replaced"])
def test_a_referenced_object_gone_or_damaged_in_the_bucket_is_put_again_by_the_next_upload(
    tmp_path, memory_url, damage
):
    url, options = memory_url
    states = {1: lora(1), 2: lora(2)}
    save(tmp_path, url, options, {1: states[1]})
    tier = RemoteTier(url, options)
    record = tier.manifest(1).shards[0]
    tier.delete_step(1)  # nothing references it yet: every object goes
    if damage == "replaced":
        tier.backend.put_bytes(tier._path(1, record.path), b"not the shard")
    save(tmp_path, url, options, {2: states[2]})  # references step 1's file, still on the disk
    assert tier.survey() == ([2], [], [1])
    assert hashlib.sha256(tier.backend.read(tier._path(1, record.path))).hexdigest() == record.sha256
    shutil.rmtree(tmp_path / "local")
    with manager(tmp_path, url, options) as m:
        assert same_state(m.restore(step=2).states[0], states[2])


def test_an_object_of_the_same_size_is_never_taken_for_the_referenced_file(tmp_path, memory_url):
    """A store keeping no sha256 (memory, a file system): a damaged object of the right size under
    a kept prefix is read and found out, and the next upload puts the file again."""
    url, options = memory_url
    states = {step: lora(step) for step in (1, 2, 3)}
    save(tmp_path, url, options, {1: states[1], 2: states[2]})
    tier = RemoteTier(url, options)
    record = tier.manifest(2).shards[0].references[0].file
    key = tier._path(1, record.path)
    tier.backend.put_bytes(key, bytes(reversed(tier.backend.read(key))))  # same size, other bytes
    save(tmp_path, url, options, {3: states[3]})
    assert hashlib.sha256(tier.backend.read(key)).hexdigest() == record.sha256
    shutil.rmtree(tmp_path / "local")
    with manager(tmp_path, url, options) as m:
        assert same_state(m.restore(step=3).states[0], states[3])


def test_another_file_of_a_step_is_never_put_over_the_object_a_committed_step_keeps(tmp_path, memory_url):
    """The manager never saves a step number the bucket holds again; a landing of another file
    under a kept object's name (another tool, another run's disk) is refused, the object intact."""
    from tiered_ckpt import RemoteError, save_sharded
    from tiered_ckpt.tiers.base import ShardSource

    url, options = memory_url
    first = {step: lora(step) for step in (1, 2)}
    save(tmp_path / "a", url, options, first)  # step 1 deleted, its file kept for step 2
    tier = RemoteTier(url, options)
    held = {name: tier.backend.read(name) for name in tier.backend.find(tier._path(1))}
    other = save_sharded([lora(1, {name: value * 2 for name, value in BASE.items()})], tmp_path / "b", step=1)
    with pytest.raises(RemoteError, match="kept for step 2, which references it as another file") as caught:
        tier.land_shard(1, other.shards[0], ShardSource(path=tmp_path / "b" / other.shards[0].path))
    assert not caught.value.transient
    assert {name: tier.backend.read(name) for name in tier.backend.find(tier._path(1))} == held
    with manager(tmp_path / "c", url, options) as m:
        assert same_state(m.restore(step=2).states[0], first[2])


def test_a_damaged_newer_manifest_does_not_stop_an_upload_finding_a_kept_compressed_file(tmp_path, memory_url):
    from tiered_ckpt.format.layout import MANIFEST_NAME as MANIFEST
    from tiered_ckpt.tiers.remote.leases import Lease

    url, options = memory_url
    states = {step: lora(step) for step in (1, 2, 3, 4)}
    save(tmp_path, url, options, {step: states[step] for step in (1, 2, 3)}, compression="zstd")
    tier = RemoteTier(url, options)
    path = tier._path(3, MANIFEST)
    tier.backend.put_bytes(path, tier.backend.read(path)[:-20])  # the one manifest saying how step 1 is kept
    other = Lease(RemoteTier(url, options), run_id="0123456789abcdef")  # a live run: no clean-up at start
    other.hold()
    try:
        save(tmp_path, url, options, {4: states[4]}, compression="zstd")
    finally:
        other.release()
    assert 4 in tier.steps() and {ref.step for ref in tier.manifest(4).shards[0].references} == {1}
    shutil.rmtree(tmp_path / "local")
    with manager(tmp_path, url, options, compression="zstd") as m:
        assert same_state(m.restore(step=4).states[0], states[4])
