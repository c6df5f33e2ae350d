"""Child process for the incremental-save crash tests: saves a schedule of steps whose arrays
change now and then (so later steps reference earlier files), with ``keep_last=2`` retention,
and pauses the ``COUNT``-th time it reaches ``POINT``; the parent sends SIGKILL.

Usage: python incremental_child.py DIRECTORY POINT COUNT [STEP VERSIONS_JSON KEEP_LAST [BUCKET_URL REMOTE_KEEP EVERY]]

With STEP, it saves that one step instead, its arrays at the versions the JSON list gives
(:func:`~support.states.incremental_state`), with ``keep_last=KEEP_LAST`` ("none": every step),
and prints "DONE" if it never reached the point (with BUCKET_URL, once uploaded there, that
tier's ``keep_last=REMOTE_KEEP`` and ``every=EVERY``). It prints "PAUSED" once there and
blocks. Points:
  before-commit     a step's shards (with their references) are durable, its manifest not written
  kept-marked       a deleted step's directory is marked as keeping referenced files, its manifest still there
  removing          a deleted step's manifest is gone, its files not yet removed (or kept)
  removing-dir      a step with nothing referenced is about to be removed whole
  remote-commit     a step's objects (and the earlier files it references) landed, its remote manifest not written
  remote-kept       a bucket prefix was just marked as keeping referenced files
  remote-removing   a bucket prefix's unreferenced objects are about to be removed
"""

import json
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from support.states import incremental_state  # noqa: E402
from tiered_ckpt import CheckpointManager, LocalOptions, RemoteOptions  # noqa: E402
from tiered_ckpt.format.layout import KEPT_NAME  # noqa: E402
from tiered_ckpt.tiers import local  # noqa: E402
from tiered_ckpt.tiers.remote import kept, tier  # noqa: E402


def pause_before(owner: type, name: str, arrive) -> None:
    """Make ``owner.name`` call ``arrive()`` before it runs."""
    original = getattr(owner, name)

    def paused(*args, **kwargs):
        arrive()
        return original(*args, **kwargs)

    setattr(owner, name, paused)


STEPS = 40


def main() -> None:
    directory, point, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    reached = [0]
    lock = threading.Lock()

    def arrive() -> None:
        with lock:
            reached[0] += 1
            if reached[0] != count:
                return
        print("PAUSED", flush=True)
        threading.Event().wait()

    if point == "before-commit":
        commit = local.LocalTier.commit

        def paused_commit(self, *args, **kwargs):
            arrive()
            return commit(self, *args, **kwargs)

        local.LocalTier.commit = paused_commit
    elif point == "kept-marked":
        write_bytes = local.write_bytes

        def paused_write(path, data, *args, **kwargs):
            result = write_bytes(path, data, *args, **kwargs)
            if os.path.basename(path) == KEPT_NAME:
                arrive()
            return result

        local.write_bytes = paused_write
    elif point == "removing":
        remove = local.LocalTier._remove_all_but

        def paused_remove(self, *args, **kwargs):
            arrive()
            return remove(self, *args, **kwargs)

        local.LocalTier._remove_all_but = paused_remove
    elif point == "removing-dir":
        rmtree = local.shutil.rmtree

        def paused_rmtree(path, *args, **kwargs):
            arrive()
            return rmtree(path, *args, **kwargs)

        local.shutil.rmtree = paused_rmtree
    elif point == "remote-commit":
        pause_before(tier.RemoteTier, "commit", arrive)
    elif point == "remote-removing":
        pause_before(kept.KeptObjects, "keep_only", arrive)
    elif point == "remote-kept":
        mark = kept.KeptObjects.mark_kept

        def paused_mark(self, *args, **kwargs):
            mark(self, *args, **kwargs)
            arrive()

        kept.KeptObjects.mark_kept = paused_mark
    else:
        raise SystemExit(f"unknown point {point}")
    if len(sys.argv) > 4:
        step, versions, keep_last = int(sys.argv[4]), json.loads(sys.argv[5]), sys.argv[6]
        options = LocalOptions(directory, keep_last=None if keep_last == "none" else int(keep_last))
        remote = None
        if len(sys.argv) > 7:
            remote_keep = None if sys.argv[8] == "none" else int(sys.argv[8])
            remote = RemoteOptions(sys.argv[7], keep_last=remote_keep, every=int(sys.argv[9]))
        with CheckpointManager(options, remote=remote, world_size=1) as manager:
            manager.save(step, incremental_state(step, dict(enumerate(versions))), blocking=True)
            manager.wait(uploaded=remote is not None)
    else:
        with CheckpointManager(LocalOptions(directory, keep_last=2), world_size=1) as manager:
            for step in range(1, STEPS + 1):
                manager.save(step, incremental_state(step), blocking=True)
                manager.wait()
    print("DONE", flush=True)  # never reached the point (a schedule's parent fails its check)
    threading.Event().wait()


if __name__ == "__main__":
    main()
