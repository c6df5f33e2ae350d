"""A job caught mid-upload, for tests/tiers/remote/test_owners.py: ``python lease_child.py DIR REMOTE_JSON``.

It saves step 1 of two ranks to the bucket named in the JSON ({"url", "options"}): rank 0's
shard is small (one PUT, confirmed), rank 1's goes up in 5 MiB parts, and the upload pauses
for good as rank 1's first parts are about to be read, its multipart upload open. It prints
``PAUSED`` then, and waits to be killed.
"""

import json
import sys
import threading

import numpy as np

from tiered_ckpt import CheckpointManager, RemoteOptions, UploadOptions
from tiered_ckpt.tiers.remote.backends import multipart

PART_BYTES = 5 << 20


def main(directory: str, remote_json: str) -> None:
    remote = json.loads(remote_json)
    manager = CheckpointManager(
        directory,
        world_size=2,
        remote=RemoteOptions(remote["url"], storage_options=remote["options"]),
        upload=UploadOptions(concurrency=1, part_bytes=PART_BYTES),
    )
    original = multipart._read_part
    paused = threading.Lock()  # parts are read on several threads: one of them says PAUSED

    def pause_at_the_first_part(path, offset, length):
        if length == PART_BYTES:  # a part of the multipart upload, not a whole small file
            if paused.acquire(blocking=False):
                print("PAUSED", flush=True)
            threading.Event().wait()
        return original(path, offset, length)

    multipart._read_part = pause_at_the_first_part
    states = [
        {"w": np.arange(1000, dtype=np.float32)},
        {"w": np.random.default_rng(1).integers(0, 255, 12 << 20, dtype=np.uint8).view(np.float32)},
    ]
    manager.save(1, states)
    manager.wait(uploaded=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
