"""What the remote tier keeps of the shards it landed (tiered_ckpt/tiers/remote/landed.py), and how it
reaches the process that commits: handed over once, through a collective's JSON payload."""

import json

from tiered_ckpt.dist.coordination import from_payload, to_payload
from tiered_ckpt.engine.sending import _Put
from tiered_ckpt.format.compressed import CompressedObject
from tiered_ckpt.tiers.remote.landed import Landed, LandedShards

STORED = CompressedObject("zstd", 1234, "ab" * 8, 200, 4 << 20, (100, 1134))


def test_what_a_landing_kept_is_handed_over_once_and_forgotten_with_its_step():
    landed = LandedShards()
    landed.keep(3, "a", "crc32c:AAAAAA==", STORED)
    landed.keep(3, "b", None, None)  # found already there, uncompressed: nothing to keep
    landed.keep(4, "a", "crc32c:BBBBBB==", None)
    assert landed.compressed(3, "a") == STORED and landed.checksum(3, "b") is None
    assert landed.of(3, {"b"}) == Landed({}, {})
    taken = landed.take(3)
    assert taken == Landed({"a": "crc32c:AAAAAA=="}, {"a": STORED})
    assert landed.take(3) == Landed() and landed.of(4).checksums == {"a": "crc32c:BBBBBB=="}
    landed.add(3, taken)  # on the process that commits
    assert landed.of(3) == taken
    landed.forget(3)
    assert landed.of(3) == Landed() and landed.compressed(3, "a") is None


def test_a_processs_landing_crosses_a_collective_as_json_and_comes_back_equal():
    sent = Landed({"rank-1": "crc32c:AAAAAA=="}, {"rank-1": STORED})
    payload = json.loads(json.dumps(to_payload(_Put.of(sent))))  # what a collective carries
    assert _Put.of(sent).landed("test") == sent
    assert from_payload(_Put, payload).landed("test") == sent
