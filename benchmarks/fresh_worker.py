"""One measurement of the ``fresh`` section, in a process of its own.

Run as ``python -m benchmarks.fresh_worker TASK_JSON`` by :mod:`benchmarks.fresh`; prints one
JSON line ``{"seconds": ..., "cpu_seconds": ...}`` on stdout: the wall-clock seconds of
the measured call and the CPU seconds (user + system, every thread) this process spent
in it, from ``resource.getrusage``. Parameters come as JSON on the command line and
results go back as JSON: nothing crosses the process boundary as pickle.

What the task holds: ``task`` (see :data:`TASKS`), ``method`` (a save or a load),
``directory``, ``size`` (bytes of the state), ``ranks``, and for the plain writes
``direct``, ``streams``; for uploads ``endpoint`` and ``bucket``. The state is made
here from the same seeds in every process (:func:`~benchmarks.harness.make_states`), so
every method saves the same bytes; what state a load gets or fills is its shapes only.
Cache state (cold, warm) is the parent's business: it evicts or reads the files first.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import mmap
import os
import resource
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import CHUNK, MOTO_KEYS, fsync_tree, make_states, per_shard, raw_read, sha256_all_cores

__all__ = ["TASKS", "main", "run_task"]

States = list[dict[str, Any]]
WRITE_BLOCK = 4 << 20  # O_DIRECT block of the plain writes: a multiple of 4096, page-aligned below
WRITEBACK_STEP = 8 << 20  # buffered plain writes start writeback of every 8 MiB as soon as it is written


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _measure(action: Callable[[], object]) -> dict[str, float]:
    cpu, start = _cpu(), time.perf_counter()
    result = action()
    seconds, cpu_seconds = time.perf_counter() - start, _cpu() - cpu
    del result  # freeing what a load returned is not part of the load
    return {"seconds": seconds, "cpu_seconds": cpu_seconds}


def _shapes(size: int, ranks: int) -> States:
    """Arrays of the shapes and dtypes of :func:`~benchmarks.harness.make_states`, zero-filled
    and touched (a caller's arrays are resident), without the random fill."""
    numel = size // ranks // 14  # as make_rank_state: 2 + 4 + 4 + 4 bytes per element
    return [
        {
            "param_fp16": np.zeros(numel, np.float16) + 1,
            "master_fp32": np.zeros(numel, np.float32) + 1,
            "exp_avg": np.zeros(numel, np.float32) + 1,
            "exp_avg_sq": np.zeros(numel, np.float32) + 1,
            "step": np.array(1, dtype=np.int64),
        }
        for _ in range(ranks)
    ]


def _tensors(states: States) -> States:
    import torch

    return [{key: torch.from_numpy(np.asarray(value)) for key, value in state.items()} for state in states]


def _dcp_flat(states: States) -> dict[str, Any]:
    return {f"{rank}/{key}": value for rank, state in enumerate(_tensors(states)) for key, value in state.items()}


# Each peer as the ``peers`` section runs it: one thread per shard, fsync of every file.
def _save(method: str, states: States, directory: Path) -> Callable[[], object]:
    if method == "tiered_ckpt":
        from tiered_ckpt.oneshot import save_sharded

        return lambda: save_sharded(states, directory, step=1)
    if method == "safetensors":
        from safetensors.numpy import save_file

        def write(rank: int) -> None:
            save_file(states[rank], str(directory / f"{rank}.safetensors"))

    elif method == "torch.save":
        import torch

        tensors = _tensors(states)

        def write(rank: int) -> None:
            torch.save(tensors[rank], directory / f"{rank}.pt")

    elif method == "dcp":
        import torch.distributed.checkpoint as dcp

        state = _dcp_flat(states)
        return lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory), thread_count=2))
    else:
        raise ValueError(f"no save method {method!r}")

    def save() -> None:
        directory.mkdir(parents=True)
        per_shard(write, len(states))
        fsync_tree(directory)

    return save


def _load(method: str, size: int, ranks: int, directory: Path) -> Callable[[], object]:
    """Load into new arrays (``tiered_ckpt-into``: into the caller's, allocated here first;
    ``tiered_ckpt-fast``: into new arrays, verified by xxh3-64 rather than sha256)."""
    if method in ("tiered_ckpt", "tiered_ckpt-into", "tiered_ckpt-fast"):
        from tiered_ckpt.oneshot import load_sharded

        into = _shapes(size, ranks) if method == "tiered_ckpt-into" else None
        verify = "fast" if method == "tiered_ckpt-fast" else "full"
        return lambda: load_sharded(directory, ranks, into=into, verify=verify)
    if method == "safetensors":
        from safetensors.numpy import load_file

        return lambda: per_shard(lambda rank: load_file(str(directory / f"{rank}.safetensors")), ranks)
    if method == "torch.save":
        import torch

        return lambda: per_shard(lambda rank: torch.load(directory / f"{rank}.pt", weights_only=True), ranks)
    if method == "dcp":
        import torch
        import torch.distributed.checkpoint as dcp

        shapes = _dcp_flat(_shapes(size, ranks))

        def load() -> object:
            target = {key: torch.empty_like(value) for key, value in shapes.items()}  # dcp loads in place
            dcp.load(target, storage_reader=dcp.FileSystemReader(str(directory)))
            return target

        return load
    raise ValueError(f"no load method {method!r}")


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    # The os module has no sync_file_range: it is called through libc (Linux only). Not the
    # library's own loader: the plain-code limit must not run the code it is the limit for.
    if not sys.platform.startswith("linux"):
        return None
    function = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        function.restype = ctypes.c_int
    return function


_sync_file_range = _load_sync_file_range()
_SYNC_WRITE, _SYNC_WAIT = 2, 1 | 2 | 4  # SYNC_FILE_RANGE_WRITE; WAIT_BEFORE | WRITE | WAIT_AFTER


def _plain_write(path: Path, views: list[memoryview], *, direct: bool) -> None:
    """Write ``views`` one after another into ``path`` and fsync it, the plain way: with
    ``direct``, through one page-aligned block (O_DIRECT), the unaligned tail through the
    page cache; otherwise through the page cache, writeback of each 8 MiB started as soon
    as it is written and its pages dropped once it is on disk (the cache released behind)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    try:
        if direct:
            block = np.frombuffer(mmap.mmap(-1, WRITE_BLOCK), np.uint8)
            pending = 0
            for view in views:
                start = 0
                while start < len(view):
                    piece = view[start : start + WRITE_BLOCK - pending]
                    block[pending : pending + len(piece)] = np.frombuffer(piece, np.uint8)
                    pending, start = pending + len(piece), start + len(piece)
                    if pending == WRITE_BLOCK:
                        os.write(fd, block)
                        pending = 0
            if pending:  # the tail, not a multiple of the block
                os.close(fd)
                fd = os.open(path, os.O_WRONLY | os.O_APPEND)
                os.write(fd, block[:pending])
        else:
            sync_range = _sync_file_range
            position = started = released = 0
            for view in views:
                for start in range(0, len(view), CHUNK):
                    position += os.write(fd, view[start : start + CHUNK])
                    if sync_range is not None and position - started >= WRITEBACK_STEP:
                        sync_range(fd, started, position - started, _SYNC_WRITE)
                        if started - released >= WRITEBACK_STEP:  # the range before: wait for it, drop it
                            sync_range(fd, released, started - released, _SYNC_WAIT)
                            os.posix_fadvise(fd, released, started - released, os.POSIX_FADV_DONTNEED)
                            released = started
                        started = position
        os.fsync(fd)
    finally:
        os.close(fd)


def _views(state: dict[str, Any]) -> list[memoryview]:
    return [memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)) for array in state.values()]


def _write_plain(states: States, directory: Path, *, direct: bool, streams: int) -> Callable[[], object]:
    """The same bytes as a save, each rank's to a file of its own, ``streams`` files at a time
    (one stream: one file after another), then the directory fsynced."""

    def write() -> None:
        directory.mkdir(parents=True)
        with ThreadPoolExecutor(streams) as pool:
            list(
                pool.map(
                    lambda rank: _plain_write(directory / f"raw-{rank}", _views(states[rank]), direct=direct),
                    range(len(states)),
                )
            )
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    return write


def _hash_one_core(states: States, new_hasher: Callable[[], Any]) -> None:
    """Hash each state's bytes on this thread, a chunk at a time, with a hasher of its own."""
    for state in states:
        hasher = new_hasher()
        for view in _views(state):
            for start in range(0, len(view), CHUNK):
                hasher.update(view[start : start + CHUNK])


def _xxh3(states: States) -> None:
    import xxhash

    _hash_one_core(states, xxhash.xxh3_64)


def _sha256_one_core(states: States) -> None:
    _hash_one_core(states, hashlib.sha256)


def _upload(method: str, task: dict[str, Any]) -> Callable[[], object]:
    """Upload the committed checkpoint in ``directory`` to a fresh bucket: through the remote
    tier's defaults (as the ``remote`` section) or each shard file with boto3's ``upload_file``."""
    import boto3

    client = boto3.client("s3", endpoint_url=task["endpoint"], **MOTO_KEYS)
    bucket, directory = task["bucket"], Path(task["directory"])
    client.create_bucket(Bucket=bucket)
    if method == "boto3":
        files = sorted(directory.glob("*/rank-*"))
        return lambda: [client.upload_file(str(path), bucket, f"boto3/{path.name}") for path in files]
    from tiered_ckpt.engine.replication import Replicator
    from tiered_ckpt.tiers.local import LocalTier
    from tiered_ckpt.tiers.remote.tier import RemoteTier
    from tiered_ckpt.tiers.store import TieredStore

    options = {
        "key": MOTO_KEYS["aws_access_key_id"],
        "secret": MOTO_KEYS["aws_secret_access_key"],
        "client_kwargs": {"endpoint_url": task["endpoint"], "region_name": MOTO_KEYS["region_name"]},
        "skip_instance_cache": True,
    }
    store = TieredStore([LocalTier(directory), RemoteTier(f"s3://{bucket}/ours", options)])

    def upload() -> None:
        with store.local.lock(), contextlib.closing(Replicator(store)) as uploader:
            _push(store, uploader, 1)

    return upload


TASKS = ("save", "load", "write", "read", "sha256", "sha256-one-core", "xxh3", "upload")


def run_task(task: dict[str, Any]) -> dict[str, float]:
    """Prepare ``task`` (make its state, import its library), then measure it."""
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    kind, size, ranks = task["task"], int(task.get("size", 0)), int(task.get("ranks", 1))
    directory = Path(task.get("directory", "."))
    if kind == "save":
        return _measure(_save(task["method"], make_states(size, ranks), directory))
    if kind == "load":
        return _measure(_load(task["method"], size, ranks, directory))
    if kind == "write":
        states = make_states(size, ranks)
        return _measure(_write_plain(states, directory, direct=bool(task["direct"]), streams=int(task["streams"])))
    if kind == "read":
        files = sorted(directory.glob("raw-*"))
        return _measure(lambda: raw_read(files) if task.get("streams", 0) != 1 else [raw_read([f]) for f in files])
    if kind in ("sha256", "sha256-one-core", "xxh3"):
        states = make_states(size, ranks)
        function = {"sha256": sha256_all_cores, "sha256-one-core": _sha256_one_core, "xxh3": _xxh3}[kind]
        return _measure(lambda: function(states))
    if kind == "upload":
        return _measure(_upload(task["method"], task))
    raise ValueError(f"no task {kind!r} (one of {', '.join(TASKS)})")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m benchmarks.fresh_worker TASK_JSON", file=sys.stderr)
        return 2
    print(json.dumps(run_task(json.loads(argv[0]))))
    return 0


def _push(store: Any, uploader: Any, step: int) -> None:
    """Upload ``step`` through ``uploader`` and wait for it; its failure, if any, raised."""
    from tiered_ckpt import maintenance

    maintenance.push(store, uploader, step)
    uploader.errors.raise_first()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
