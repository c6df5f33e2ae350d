"""The ``requests`` section of the benchmark: the bucket requests of one save and one restore at
1,024 and 4,096 ranks, counted by kind.

A bucket's budget is its requests (S3 answers 503 SlowDown past about 3,500 writes or 5,500
reads per second per key prefix), so at a thousand ranks what a save costs is how many
requests each rank makes, and whether one rank's grow with the ranks or the steps. Here one
process leads a job of ``N`` simulated ranks (:class:`~benchmarks.harness.SimulatedRanks`:
each collective hands it every rank's payload, made from its own) against moto's S3 server
in its own process; every request its S3 client sends (aiobotocore's ``_make_api_call``, by
operation name: ListObjectsV2, HeadObject, GetObject, PutObject and the multipart calls)
is counted. The other ranks' shard objects are server-side copies of the leader's (not
counted), made as their landings cross the collective, so the leader's commit finds them.

Printed per ``N``: the leader's requests of a save (after a first save, which also creates
the run's lease and markers) until its upload is committed, and of a restore of that step
in a fresh manager, by kind; then each kind's growth from 1,024 to 4,096 ranks (4.0 is
linear in the ranks; 1.0 is a count that does not grow) and the PUTs a GiB of shard takes at
the default part size. The ranks that do not lead make the requests of their own shard only
(its PUT or its parts), so the leader's counts are the ones that can grow.
"""

from __future__ import annotations

import collections
import contextlib
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import SimulatedRanks, Target, moto_server
from tiered_ckpt.format.layout import shard_name, step_dir_name
from tiered_ckpt.manager import CheckpointManager
from tiered_ckpt.options import LocalOptions, RemoteOptions, RuntimeOptions, UploadOptions

__all__ = ["bench_requests"]

RANKS = (1024, 4096)
PREFIX = "run"


class _CopiedRanks(SimulatedRanks):
    """Simulated ranks whose shard objects are in the bucket too: as each rank's landing report
    is made from the leader's, the leader's object is copied under the rank's own name."""

    def __init__(self, world_size: int, client: Any, bucket: str) -> None:
        super().__init__(world_size)
        self.client, self.bucket = client, bucket
        self.step = 0  # the step being saved, whose prefix the copies go under

    def renumber(self, payload: Any, rank: int) -> Any:
        result = payload.get("result") if isinstance(payload, dict) else None
        objects = result.get("objects") if isinstance(result, dict) else None
        if rank and isinstance(objects, (list, tuple)):  # what rank ``rank`` confirmed (Confirmed): its own copy
            mine = [[at, shard_name(rank, self.world_size)] if at is None else [at, path] for at, path in objects]
            return {**payload, "result": {**result, "objects": mine}}
        shards = result.get("shards") if isinstance(result, dict) else None
        if not rank or not isinstance(shards, (list, tuple)) or not shards or "location" not in shards[0]:
            return super().renumber(payload, rank)
        moved = []
        for landed in shards:  # a shard landed in the bucket (Landed): its object, copied as rank ``rank``'s
            name = shard_name(rank, self.world_size)
            step = step_dir_name(self.step)
            source = {"Bucket": self.bucket, "Key": f"{PREFIX}/{step}/{landed['location']}"}
            self.client.copy_object(Bucket=self.bucket, Key=f"{PREFIX}/{step}/{name}", CopySource=source)
            moved.append({**landed, "rank": rank, "path": name, "location": name})
        return {**payload, "result": {**result, "shards": moved}}


@contextlib.contextmanager
def _counting() -> Iterator[collections.Counter[str]]:
    """Every request any S3 client of this process sends, by operation name, while open."""
    import aiobotocore.client

    counts: collections.Counter[str] = collections.Counter()
    original = aiobotocore.client.AioBaseClient._make_api_call

    async def counted(self: Any, operation: str, parameters: Any) -> Any:
        counts[operation] += 1
        return await original(self, operation, parameters)

    aiobotocore.client.AioBaseClient._make_api_call = counted  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        aiobotocore.client.AioBaseClient._make_api_call = original  # type: ignore[method-assign]


def bench_requests(root: Path, ranks: Sequence[int] = RANKS) -> list[Target]:
    """Print the section's figures (see the module doc); return the growth of a save's and a
    restore's requests from the fewest ranks to the most as issue 45's item 3 rows (linear or
    better: at most the ranks' own growth)."""
    try:
        import aiobotocore.client  # noqa: F401
        import moto  # noqa: F401
    except ImportError:
        print("  skipped: needs s3fs, boto3 and moto (pip install -e '.[bench]')")
        return []
    saves: dict[int, collections.Counter[str]] = {}
    restores: dict[int, collections.Counter[str]] = {}
    with moto_server() as (_endpoint, client, options), _counting() as counts:
        for count in ranks:
            bucket = f"requests-{count}"
            client.create_bucket(Bucket=bucket)
            remote = RemoteOptions(f"s3://{bucket}/{PREFIX}", storage_options=options)
            simulated = _CopiedRanks(count, client, bucket)
            local = LocalOptions(root / f"requests-{count}", keep_last=None)
            kept = {"runtime": RuntimeOptions(incremental=False), "upload": UploadOptions(max_tries=1)}
            with CheckpointManager(local, remote=remote, coordinator=simulated, **kept) as manager:
                for step in (1, 2):  # the first creates the run's lease: the second is a save like any
                    simulated.step = step
                    counts.clear()
                    state = {"param": np.full(64, step, dtype=np.float32), "exp_avg": np.zeros(64, dtype=np.float32)}
                    manager.save(step, state, blocking=True)
                    manager.wait(uploaded=True)
                saves[count] = collections.Counter(counts)
            shutil.rmtree(root / f"requests-{count}")
            with CheckpointManager(
                LocalOptions(root / f"requests-{count}"), remote=remote, coordinator=SimulatedRanks(count), **kept
            ) as fresh:
                counts.clear()
                fresh.restore(2)
                restores[count] = collections.Counter(counts)
            shutil.rmtree(root / f"requests-{count}")
    for what, counted in (("save", saves), ("restore", restores)):
        for count in ranks:
            kinds = ", ".join(f"{kind} {number}" for kind, number in sorted(counted[count].items()))
            total = sum(counted[count].values())
            print(f"  the leader of {count:>5} ranks, one {what:<7}: {total:>5} requests ({kinds})")
    first, last = ranks[0], ranks[-1]
    targets = []
    for what, counted in (("save", saves), ("restore", restores)):
        growth = sum(counted[last].values()) / max(1, sum(counted[first].values()))
        targets.append(Target(3, f"{what} requests, growth {first} -> {last} ranks", growth, last / first, False))
    for what, counted in (("save", saves), ("restore", restores)):
        for kind in sorted(set(counted[first]) | set(counted[last])):
            before, after = counted[first][kind], counted[last][kind]
            growth = after / before if before else float("inf")
            verdict = "grows with the ranks" if growth > 1.5 else "does not grow"
            print(f"    {what:<7} {kind:<24} growth {first} -> {last} ranks {growth:5.2f}  ({verdict})")
    part = UploadOptions().part_bytes
    print(f"  a shard's PUTs per GiB at part_bytes={part >> 20} MiB: {(1 << 30) // part} parts + 2 multipart calls")
    return targets
