"""What a landing returns (tiered_ckpt/tiers/base.py's ``Landed``), how it reaches the process that
commits (a collective's JSON payload), and a commit that carries it: no tier keeps state between
landing and commit."""

import json

import numpy as np
import pytest

from tiered_ckpt import save_sharded
from tiered_ckpt.dist.coordination import SingleProcessCoordinator, from_payload, to_payload
from tiered_ckpt.engine.sending import Sender, _Landings
from tiered_ckpt.errors import CheckpointError, RemoteError
from tiered_ckpt.format.compressed import CompressedObject
from tiered_ckpt.format.layout import step_dir_name
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.tiers.base import Confirmed, Landed, ShardSource
from tiered_ckpt.tiers.local import LocalTier
from tiered_ckpt.tiers.remote.tier import RemoteTier
from tiered_ckpt.tiers.store import TieredStore

STORED = CompressedObject("zstd", 1234, "ab" * 8, 200, 4 << 20, (100, 1134))


def test_what_landed_crosses_a_collective_as_json_and_comes_back_equal():
    sent = [
        Landed(1, "rank-1", "7f/rank-1", 1234, 4096, "crc32c:AAAAAA==", STORED.to_json()),
        Landed(2, "rank-2", "rank-2", 4096, 4096, sent=False),  # found already there, uncompressed
    ]
    payload = json.loads(json.dumps(to_payload(_Landings.of(sent))))  # what a collective carries
    assert _Landings.of(sent).landed() == sent
    assert from_payload(_Landings, payload).landed() == sent
    assert CompressedObject.from_json(sent[0].compression, source="test") == STORED


@pytest.mark.parametrize("layout", ["flat", "hashed"])
def test_a_commit_records_what_another_process_landed_and_this_tier_never_saw(tmp_path, memory_url, layout):
    """Two tiers on one URL stand for two processes: one lands (compressed, spread over prefixes),
    the other commits what it is handed; a commit not handed it cannot find the objects."""
    url, options = memory_url
    states = [{"w": np.arange(50_000, dtype=np.float32) + rank} for rank in range(2)]
    manifest = save_sharded(states, tmp_path / step_dir_name(3), step=3)
    landing = RemoteTier(url, options, compression="zstd", layout=layout)
    landed = [
        landing.land_shard(3, record, ShardSource(path=tmp_path / step_dir_name(3) / record.path))
        for record in manifest.shards
    ]
    assert all(each.sent and each.compression is not None and each.stored_bytes < each.raw_bytes for each in landed)
    assert [each.rank for each in landed] == [0, 1] and [each.raw_bytes for each in landed] == [
        r.size_bytes for r in manifest.shards
    ]
    with pytest.raises(RemoteError, match="2 of its objects changed after their upload was confirmed") as caught:
        RemoteTier(url, options).commit(manifest)  # handed nothing: the uncompressed objects are missing
    assert not caught.value.transient and RemoteTier(url, options).steps() == []
    committing = RemoteTier(url, options)  # compresses nothing itself, lays out flat
    crossed = [from_payload(Landed, each) for each in json.loads(json.dumps([to_payload(each) for each in landed]))]
    remote = committing.commit(manifest, landed=crossed)
    assert set(remote.compression) == {record.path for record in manifest.shards}
    assert dict(remote.locations) == {each.path: each.location for each in landed if each.location != each.path}
    assert RemoteTier(url, options).read_manifest(3) == remote
    assert committing.backend.read(f"{committing.backend.root}/latest") == b"3\n"  # latest moved by the commit
    for record in manifest.shards:
        assert RemoteTier(url, options).check_shard(3, record) is None


def test_a_step_tried_again_records_the_store_checksums_its_earlier_try_sent(tmp_path, s3_url, monkeypatch):
    """The second try finds every object intact (nothing sent, no checksum of its own): the commit
    still records the store's checksums of what the first try sent, as the sender kept them."""
    states = [{"w": np.arange(50_000, dtype=np.float32) + rank} for rank in range(2)]
    manifest = save_sharded(states, tmp_path / "ckpt" / step_dir_name(1), step=1)
    tier = RemoteTier(*s3_url)
    store = TieredStore([LocalTier(tmp_path / "ckpt"), tier])
    sender = Sender(store, tier, SingleProcessCoordinator(1), None, 2, None)
    commit, failures = RemoteTier.commit, [RemoteError("reset by peer (injected)", transient=True)]

    def fail_once(self, *args, **kwargs):
        if failures:
            raise failures.pop()
        return commit(self, *args, **kwargs)

    monkeypatch.setattr(RemoteTier, "commit", fail_once)
    landed = []
    monkeypatch.setattr(Sender, "_with_earlier_tries", record(Sender._with_earlier_tries, landed))
    with store.local.lock():
        with pytest.raises(CheckpointError, match="injected"):
            sender.send(1, None)
        sender.send(1, None)
    assert [each.sent for each in landed[1][2]] == [False, False]  # the second try sent nothing
    checksums = tier.read_manifest(1).store_checksums
    assert set(checksums) == {record.path for record in manifest.shards}
    assert checksums == {each.path: each.checksum for each in landed[0][2]}
    assert store.receipted(1)
    sender.forget(1)
    assert sender._landed == {}  # a step settled keeps nothing


def record(method, calls):
    def recording(self, step, landed):
        calls.append((self, step, list(landed)))
        return method(self, step, landed)

    return recording


def test_what_landed_is_checked_as_a_reader_would_before_the_commit_makes_a_request(tmp_path, memory_url):
    url, options = memory_url
    manifest = save_sharded([{"w": np.arange(1000, dtype=np.float32)}], tmp_path / step_dir_name(2), step=2)
    record = manifest.shard(0)
    tier = RemoteTier(url, options)
    good = tier.land_shard(2, record, ShardSource(path=tmp_path / step_dir_name(2) / record.path))
    escaping = Landed(0, record.path, f"../{record.path}", record.size_bytes, record.size_bytes)
    requests = tier.backend.requests
    with pytest.raises(RemoteError, match="what was landed cannot be committed: .*field 'locations'") as caught:
        tier.commit(manifest, landed=[escaping])
    assert not caught.value.transient and tier.backend.requests == requests and tier.steps() == []
    assert tier.commit(manifest, landed=[good]).manifest == manifest and tier.steps() == [2]


def test_each_process_confirms_what_it_landed_and_the_commit_checks_only_the_rest(tmp_path, memory_url, monkeypatch):
    """Three tiers on one URL stand for three processes, each landing its rank's shard; two confirm
    theirs (a HEAD each) and the committing one checks only the shard no process confirmed."""
    url, options = memory_url
    tiers = [RemoteTier(url, options) for _ in range(3)]

    def landed_step(step: int) -> tuple[ShardManifest, list[Landed]]:
        states = [{"w": np.arange(10_000, dtype=np.float32) + rank + step} for rank in range(3)]
        manifest = save_sharded(states, tmp_path / step_dir_name(step), step=step)
        source = tmp_path / step_dir_name(step)
        return manifest, [
            tier.land_shard(step, record, ShardSource(path=source / record.path))
            for tier, record in zip(tiers, manifest.shards, strict=True)
        ]

    manifest, landed = landed_step(4)
    confirmed = [tiers[rank].confirm(manifest, [landed[rank]]) for rank in (0, 1)]
    assert [each.objects for each in confirmed] == [((None, record.path),) for record in manifest.shards[:2]]
    assert not any(each.problems for each in confirmed)
    crossed = [from_payload(Confirmed, json.loads(json.dumps(to_payload(each)))) for each in confirmed]
    heads: list[str] = []
    head = tiers[0].backend.head
    monkeypatch.setattr(tiers[0].backend, "head", lambda path, **kw: heads.append(path) or head(path, **kw))
    assert tiers[0].commit(manifest, landed=landed, confirmed=crossed).manifest == manifest
    assert [path.rsplit("/", 1)[1] for path in heads] == [manifest.shard(2).path]

    # An object replaced after its landing: the process that landed it finds it, and the step is refused.
    manifest, landed = landed_step(5)
    tiers[1].backend.put_bytes(f"{tiers[1].backend.root}/{step_dir_name(5)}/{landed[1].location}", b"another run's")
    confirmed = [tier.confirm(manifest, [each]) for tier, each in zip(tiers, landed, strict=True)]
    assert [len(each.problems) for each in confirmed] == [0, 1, 0] and landed[1].location in confirmed[1].problems[0]
    with pytest.raises(RemoteError, match=r"1 of its objects changed after their upload was confirmed") as caught:
        tiers[0].commit(manifest, landed=landed, confirmed=confirmed)
    assert not caught.value.transient and RemoteTier(url, options).steps() == [4]
