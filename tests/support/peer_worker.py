"""One rank of a multi-process job with a peer tier: ``python peer_worker.py CONFIG_JSON RANK``.

Joins a gloo job through a file store, opens a CheckpointManager on
``<local_root>/rank-<RANK>`` with a peer tier whose nodes are ``config["nodes"]`` (by rank)
and whose memory folder is ``config["memory"][<node>]`` (each "node" its own), and a bucket if
the config has a URL; runs the actions and writes ``<results>/rank-<RANK>.json``.

Actions: {"do": "save", "step": S} (blocking, then waits for the partner copy), {"do": "train",
"steps": N} (saves 1..N, recording those some tier's cadence took), {"do": "wait"}
(uploads and refills; records lag().refill_error), {"do": "restore", "step": S} (S optional;
records step, sources and digests), {"do": "report"} (whether the tier is on; its lag and verify), {"do": "saves",
"count": N} (N saves of a small state, each followed by the partner copy, recording the
memory held after each), and
{"do": "kill_on_copy", "rank": R, "step": S}: rank R SIGKILLs itself once it has received
its ward's bytes of step S, before answering; {"do": "hang_on_serve", "rank": R, "seconds": T}:
rank R sleeps T seconds before sending a restore its copies (a partner that hangs);
{"do": "hang_on_copy", "rank": R, "seconds": T}: rank R sleeps T seconds after receiving
a copy, before answering; {"do": "corrupt_copy", "rank": R}: the bytes rank R sends its partner are changed on the way
(until {"do": "uncorrupt_copy"}); {"do": "unreadable_copy", "rank": R}: rank R cannot read
its own shard for the copy (until "uncorrupt_copy"); {"do": "restore_if_any"} records the
step restored, or None; {"do": "record_logs"} records every later log record of the library
as [level, message] in "logs"; {"do": "measured_save", "step": S, "bytes": N}: a blocking save
of a state of N bytes (8 float32 arrays), then the partner copy, recording in "measured" what
they added to the process's peak resident memory (``VmHWM``, reset before through
``/proc/self/clear_refs``), the shard's size, the copy's error and the state's digests.
{"do": "measured_restore", "step": S, "bytes": N}: a restore of step S into the arrays of such a
state (given, written before), then the refill of this rank's disk, recording in "measured" what
they added to the peak resident memory, the sources, the refill's error and the digests.
{"do": "no_room_on_disk", "rank": R}: rank R's disk has no room for the copies a restore fetches.
{"do": "peer_held"} records the steps this rank's memory holds committed, those it keeps slots
of for them, and its bytes. ``config["piece_bytes"]`` sets the pieces a copy travels in;
``config["state"]`` = "lora" saves :func:`rank_worker.lora_state` (see :func:`rank_worker.state_of`).
"""

import errno
import logging
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import torch
from rank_worker import digests, serve, state_of

from tiered_ckpt import (
    CheckpointError,
    CheckpointManager,
    LocalOptions,
    PeerOptions,
    RemoteOptions,
    RuntimeOptions,
    TorchDistributedCoordinator,
    UploadOptions,
)
from tiered_ckpt.tiers.peer import copies as peer_copy
from tiered_ckpt.tiers.peer import memory as peer_memory
from tiered_ckpt.tiers.peer import tier as peer

_ENTER = peer._mapped.__enter__
CONFIG: dict = {}  # the job's config, for the states its actions save
_READ = peer._mapped._read


def run(config: dict, coordinator: TorchDistributedCoordinator, result: dict) -> None:
    rank, world_size = coordinator.rank, coordinator.world_size
    CONFIG.update(config)
    url = config.get("url")
    nodes = config["nodes"]
    options = PeerOptions(
        nodes=tuple(nodes),
        memory_dir=config["memory"][nodes[rank]],
        timeout_seconds=config.get("peer_timeout", 10),
        max_bytes=config.get("max_bytes"),
        every=config.get("peer_every", 1),
    )
    if "piece_bytes" in config:
        peer_copy.PIECE_BYTES = config["piece_bytes"]
    local = Path(config["local_root"]) / f"rank-{rank}"
    storage = config.get("options") or {}
    checkpoints = CheckpointManager(
        LocalOptions(local, keep_last=config.get("keep_last", 3), every=config.get("local_every", 1)),
        coordinator=coordinator,
        remote=RemoteOptions(url, storage_options=storage, every=config.get("remote_every", 1)) if url else None,
        upload=UploadOptions(max_tries=2),
        peer=options,
        runtime=RuntimeOptions(host_memory_bytes=config.get("host_memory_bytes")),
    )
    try:
        for action in config["actions"]:
            act(action, rank, world_size, checkpoints, result)
    except CheckpointError as exc:
        result["error"] = [type(exc).__name__, str(exc)]
    try:
        checkpoints.close()
    except CheckpointError as exc:
        result["close_error"] = [type(exc).__name__, str(exc)]


def held_bytes(checkpoints: CheckpointManager) -> tuple[int, int]:
    """The bytes of the slot files this rank's peer memory holds, and the files in its folder."""
    memory = checkpoints._parts.peer.target.memory
    return memory.bytes_held(), len(list(memory.root.iterdir()))


def resident(field: str) -> int:
    """A ``/proc/self/status`` figure of this process, in bytes."""
    with open("/proc/self/status") as status:
        found = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.M)
    assert found is not None, field
    return int(found.group(1)) * 1024


def measured_save(checkpoints: CheckpointManager, step: int, rank: int, size: int) -> dict:
    """A save of ``size`` bytes of tensors and its partner copy, with what they added to the peak resident memory."""
    state = {
        f"w{i}": torch.from_numpy(np.random.default_rng([step, rank, i]).random(size // 32, np.float32))
        for i in range(8)
    }
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the peak is now the current resident memory
    before = resident("VmRSS")
    handle = checkpoints.save(step, state, blocking=True)
    checkpoints._parts.peer.wait()
    peak = resident("VmHWM") - before
    manifest = handle.committed.result()
    return {
        "peak": peak,
        "shard_bytes": manifest.shard(rank).size_bytes if manifest is not None else None,
        "peer_error": checkpoints._parts.peer.last_error,
        "digests": digests(state),
    }


def measured_restore(checkpoints: CheckpointManager, step: int, size: int) -> dict:
    """A restore of ``step`` into the arrays of a state of ``size`` bytes (as :func:`measured_save`
    saves), and the refill of this rank's disk it leaves, with what they added to the peak resident memory."""
    into = {f"w{i}": torch.ones(size // 32, dtype=torch.float32) for i in range(8)}  # written: resident before
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    before = resident("VmRSS")
    restored = checkpoints.restore(step=step, into=into)
    checkpoints.wait()  # the refill of the disk lands after the restore returned
    peak = resident("VmHWM") - before
    return {
        "peak": peak,
        "step": restored.step,
        "sources": {str(old): tier for old, tier in restored.sources.items()},
        "refill_error": checkpoints.lag().refill_error,
        "digests": digests(into),
    }


def act(action: dict, rank: int, world_size: int, checkpoints: CheckpointManager, result: dict) -> None:
    if action["do"] == "measured_save":
        result["measured"] = measured_save(checkpoints, action["step"], rank, action["bytes"])
    elif action["do"] == "measured_restore":
        result["measured"] = measured_restore(checkpoints, action["step"], action["bytes"])
    elif action["do"] == "save":
        handle = checkpoints.save(action["step"], state_of(CONFIG, action["step"], world_size, rank), blocking=True)
        result.setdefault("committed", []).append(handle.committed.result() is not None)
        checkpoints._parts.peer.wait()
        result.setdefault("peer_errors", []).append(checkpoints._parts.peer.last_error)
    elif action["do"] == "wait":
        checkpoints.wait(uploaded=True)
        result["refill_error"] = checkpoints.lag().refill_error
    elif action["do"] == "train":
        for step in range(1, action["steps"] + 1):
            saved = checkpoints.save(step, state_of(CONFIG, step, world_size, rank), blocking=True)
            result.setdefault("saved", []).append(step) if saved.committed.result() is not None else None
            checkpoints._parts.peer.wait()
        result["local_steps"] = checkpoints.steps()
    elif action["do"] == "peer_held":
        memory = checkpoints._parts.peer.target.memory
        with memory.lock:
            result["peer_held"] = {"steps": memory.steps(), "kept": memory.kept_steps(), "bytes": memory.bytes_held()}
    elif action["do"] == "report":
        result["peer_on"] = checkpoints._parts.peer is not None
        if result["peer_on"]:
            result["lag"] = checkpoints.lag().to_dict()
            result["verify"] = [[c.step, c.tier, c.rank, c.status] for c in checkpoints.verify().checks]
    elif action["do"] == "saves":
        for step in range(1, action["count"] + 1):
            checkpoints.save(step, state_of(CONFIG, step, world_size, rank), blocking=True)
            checkpoints._parts.peer.wait()
            result.setdefault("held", []).append(held_bytes(checkpoints))
        result["peer_error"] = checkpoints._parts.peer.last_error
    elif action["do"] == "kill_on_copy" and action["rank"] == rank:
        accept = peer_memory.PeerMemory.accept

        def accept_or_die(self, number, slot):
            if slot.step == action["step"]:
                os.kill(os.getpid(), signal.SIGKILL)
            return accept(self, number, slot)

        peer_memory.PeerMemory.accept = accept_or_die
    elif action["do"] == "corrupt_copy" and action["rank"] == rank:
        enter = peer._mapped.__enter__

        def flipped(self):
            data = enter(self).copy()  # what goes on the wire, changed in transit; the file is untouched
            data[len(data) // 2] ^= 0xFF
            return data

        peer._mapped.__enter__ = flipped
    elif action["do"] == "uncorrupt_copy":
        peer._mapped.__enter__ = _ENTER
        peer._mapped._read = _READ
    elif action["do"] == "unreadable_copy" and action["rank"] == rank:

        def unreadable(self):
            raise ValueError("mmap length is greater than file size")  # a shard cut short on disk

        peer._mapped._read = unreadable
    elif action["do"] == "no_room_on_disk" and action["rank"] == rank:

        def no_room(directory, size):
            raise OSError(errno.ENOSPC, "No space left on device", str(directory))

        peer_copy.unnamed_map = no_room
    elif action["do"] == "record_logs":
        records = result.setdefault("logs", [])

        class Recorder(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                records.append([record.levelname, record.getMessage()])

        logger = logging.getLogger("tiered_ckpt")
        logger.setLevel(logging.DEBUG)
        logger.addHandler(Recorder())
    elif action["do"] == "restore_if_any":
        restored = checkpoints.restore(missing_ok=True)
        result["restored_if_any"] = None if restored is None else restored.step
    elif action["do"] == "hang_on_copy" and action["rank"] == rank:
        accept = peer_memory.PeerMemory.accept

        def hang_then_accept(self, number, slot):
            time.sleep(action["seconds"])  # the partner hangs after receiving, before it answers
            return accept(self, number, slot)

        peer_memory.PeerMemory.accept = hang_then_accept
    elif action["do"] == "hang_on_serve" and action["rank"] == rank:
        outgoing = peer_copy._outgoing

        def hang_then_send(*args):
            time.sleep(action["seconds"])  # the partner hangs while a restore waits for its copy
            return outgoing(*args)

        peer_copy._outgoing = hang_then_send
    elif action["do"] == "restore":
        restored = checkpoints.restore(step=action.get("step"))
        result["restored"] = {
            "step": restored.step,
            "sources": {str(old): tier for old, tier in restored.sources.items()},
            "digests": digests(restored.torch_state()),
        }


def main() -> None:
    serve(run)


if __name__ == "__main__":
    main()
