"""Child process for the crash tests: saves a large checkpoint and pauses at a chosen point.

Usage: python crash_child.py DIRECTORY POINT BYTES_PER_RANK [manager | REMOTE_JSON]

Without "manager" it calls save_sharded for step 2. With "manager" it opens a
CheckpointManager on DIRECTORY, saves step 1 (version 1 of the states) blocking, then
step 2 (version 2) asynchronously, and the pause hits the background writer. With
POINT "upload" and a JSON {"url", "options"} it saves and uploads step 1, then pauses
step 2's upload right after its first shard is uploaded and confirmed. With POINT
"multipart" (and the JSON) it saves step 1 and pauses its upload once the first shard's
multipart upload is open in the bucket (parts of 5 MiB).

It prints "PAUSED" once the save reaches POINT and then blocks until it is killed;
the parent sends SIGKILL. Points:
  shard-bytes:N     after N bytes of shard data have been written (all writer threads)
  before-manifest   every shard is durable under its final name, no manifest yet
  manifest-rename   the manifest's temp file is written and fsynced, not yet renamed
  after-commit      the manifest is renamed into place, the directory not yet fsynced
"""

import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from support.states import large_states  # noqa: E402
from tiered_ckpt import save_sharded  # noqa: E402
from tiered_ckpt.format.layout import MANIFEST_NAME  # noqa: E402
from tiered_ckpt.io import durable, hashing  # noqa: E402
from tiered_ckpt.tiers import local  # noqa: E402

_announce = threading.Lock()


def pause_forever(*_args, **_kwargs):
    """Tell the parent (once, whichever writer thread gets here first) and block."""
    if _announce.acquire(blocking=False):
        print("PAUSED", flush=True)
    threading.Event().wait()


def install(point: str) -> None:
    if point.startswith("shard-bytes:"):
        limit = int(point.split(":")[1])
        original = hashing.write_all
        lock = threading.Lock()
        written = [0]

        def counting_write_all(out, chunk):
            original(out, chunk)
            with lock:
                written[0] += len(chunk)
                reached = written[0] >= limit
            if reached:
                pause_forever()

        hashing.write_all = counting_write_all
    elif point == "before-manifest":
        local._write_manifest = pause_forever  # the local tier's commit of the manifest
    elif point == "manifest-rename":
        original_replace = os.replace

        def replace(src, dst):
            if os.path.basename(dst) == MANIFEST_NAME:
                pause_forever()
            original_replace(src, dst)

        durable.os.replace = replace
    elif point == "after-commit":
        durable.fsync_directory = pause_forever
    else:
        raise SystemExit(f"unknown point {point}")


def run_upload(directory: str, bytes_per_rank: int, remote_json: str) -> None:
    """Save and upload step 1, then pause step 2's upload after its first shard is confirmed."""
    import json

    from tiered_ckpt import CheckpointManager, RemoteOptions, UploadOptions
    from tiered_ckpt.tiers.remote.tier import RemoteTier

    remote = json.loads(remote_json)
    manager = CheckpointManager(
        directory,
        world_size=4,
        remote=RemoteOptions(remote["url"], storage_options=remote["options"]),
        upload=UploadOptions(concurrency=1),
    )
    manager.save(1, large_states(4, bytes_per_rank, version=1))
    manager.wait(uploaded=True)
    original = RemoteTier.land_shard

    def upload_then_pause(tier, step, record, source, **options):
        original(tier, step, record, source, **options)
        pause_forever()

    RemoteTier.land_shard = upload_then_pause
    manager.save(2, large_states(4, bytes_per_rank, version=2))
    manager.wait(uploaded=True)


def run_multipart(directory: str, bytes_per_rank: int, remote_json: str) -> None:
    """Save step 1 and pause its upload when the first part is about to be read (the multipart upload is open)."""
    import json

    from tiered_ckpt import CheckpointManager
    from tiered_ckpt.tiers.remote.backends import multipart

    remote = json.loads(remote_json)
    from tiered_ckpt import RemoteOptions, UploadOptions

    manager = CheckpointManager(
        directory,
        world_size=4,
        remote=RemoteOptions(remote["url"], storage_options=remote["options"]),
        upload=UploadOptions(concurrency=1, part_bytes=5 << 20),
    )
    multipart._read_part = pause_forever
    manager.save(1, large_states(4, bytes_per_rank, version=1))
    manager.wait(uploaded=True)


def run_manager(directory: str, point: str, bytes_per_rank: int) -> None:
    from tiered_ckpt import CheckpointManager, LocalOptions

    manager = CheckpointManager(LocalOptions(directory, keep_last=3), world_size=4)
    manager.save(1, large_states(4, bytes_per_rank, version=1), blocking=True)
    install(point)
    manager.save(2, large_states(4, bytes_per_rank, version=2))
    manager.wait()


if __name__ == "__main__":
    directory, point, bytes_per_rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if sys.argv[4:] == ["manager"]:
        run_manager(directory, point, bytes_per_rank)
    elif point == "upload":
        run_upload(directory, bytes_per_rank, sys.argv[4])
    elif point == "multipart":
        run_multipart(directory, bytes_per_rank, sys.argv[4])
    else:
        states = large_states(4, bytes_per_rank)
        install(point)
        save_sharded(states, directory, step=2)
    print("DONE", flush=True)
